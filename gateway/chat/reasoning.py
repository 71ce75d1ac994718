"""Reasoning parsers: a reasoning model's completion split into its reasoning and its answer, by SGLang's
``--reasoning-parser`` names so that one value serves both (slime passes it on as ``--sglang-reasoning-parser``).

A registry: each entry is a format from ``gateway.chat.reasoning_formats`` (``think_tags``: ``<think>`` ...
``</think>`` and its variants, as parameters; ``gpt_oss``: harmony), one line each. ``GATEWAY_CHAT_REASONING_PARSER``
takes these names and the aliases below.

Written here rather than imported: SGLang's parsers live inside the engine (torch and all), and these are a few
string searches and, for harmony, a small state machine.
"""

from __future__ import annotations

from gateway.chat.reasoning_formats import gpt_oss
from gateway.chat.reasoning_formats.base import Channel, ReasoningFormat, ReasoningSplitter
from gateway.chat.reasoning_formats.think_tags import ThinkStream, ThinkTags

QWEN_TOOL = "<tool_call>"  # SGLang's Qwen3 and GLM-4.5 reasoning parsers end the reasoning at a tool call too

REASONING_FORMATS: dict[str, ReasoningFormat | None] = {
    "none": None,
    "qwen3": ThinkTags("qwen3", tool_start=QWEN_TOOL),
    "qwen3-thinking": ThinkTags("qwen3-thinking", always_inside=True, tool_start=QWEN_TOOL),
    "deepseek-r1": ThinkTags("deepseek-r1", always_inside=True),
    "deepseek-v3": ThinkTags("deepseek-v3", tool_start=QWEN_TOOL),
    "glm45": ThinkTags("glm45", tool_start=QWEN_TOOL),
    "kimi_k2": ThinkTags("kimi_k2", tool_start="<|tool_calls_section_begin|>"),
    "minimax": ThinkTags("minimax", always_inside=True, tool_start=QWEN_TOOL),
    "minimax-append-think": ThinkTags("minimax-append-think", append_think=True),
    "gpt-oss": gpt_oss.FORMAT,
}
# The gateway's earlier spelling of SGLang's deepseek-r1.
ALIASES: dict[str, str] = {"deepseek_r1": "deepseek-r1"}
NAMES: tuple[str, ...] = (*REASONING_FORMATS, *ALIASES)  # what GATEWAY_CHAT_REASONING_PARSER accepts


def reasoning_format(name: str) -> ReasoningFormat | None:
    """The format a configured name (or alias) stands for (None: no reasoning parser); KeyError with the known
    names when there is none."""
    canonical = ALIASES.get(name, name)
    if canonical not in REASONING_FORMATS:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {', '.join(NAMES)}")
    return REASONING_FORMATS[canonical]


__all__ = [
    "ALIASES",
    "NAMES",
    "REASONING_FORMATS",
    "Channel",
    "ReasoningFormat",
    "ReasoningSplitter",
    "ThinkStream",
    "ThinkTags",
    "reasoning_format",
]
