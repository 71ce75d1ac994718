"""Tool-call parsers: a model's completion text into content and tool calls, by SGLang's ``--tool-call-parser`` name.

A registry: one module per format under ``gateway.chat.tool_formats`` (each defines ``FORMAT``, a
``ToolCallFormat``), one line here to list it. ``GATEWAY_CHAT_TOOL_PARSER`` takes these names (the value a user
gives SGLang, which slime passes on as ``--sglang-tool-call-parser``) and the aliases below; what every format shares
(all or nothing, typed bare values, the stream splitter) is in ``gateway.chat.tool_formats.base``.

Written here rather than taken from a library: the parsers that exist live inside serving engines (vLLM, SGLang)
and pull the whole engine (torch included) in; these are a cursor over the text, ``json``'s decoder and the tool's
schema. SGLang's own test cases run against them as data (``tests/fixtures/sglang_parsers/``).
"""

from __future__ import annotations

from gateway.chat.reasoning_formats.base import ReasoningFormat
from gateway.chat.tool_formats import (
    deepseekv3,
    deepseekv31,
    deepseekv32,
    glm45,
    glm47,
    gpt_oss,
    hermes,
    kimi_k2,
    minimax_m2,
    qwen3_coder,
)
from gateway.chat.tool_formats.base import (
    ParsedCompletion,
    ToolCallFormat,
    ToolCallStreamSplitter,
    new_tool_call_id,
    partial_marker_length,
)

FORMATS: dict[str, ToolCallFormat] = {
    module.FORMAT.name: module.FORMAT
    for module in (
        hermes,
        qwen3_coder,
        glm45,
        glm47,
        kimi_k2,
        deepseekv3,
        deepseekv31,
        deepseekv32,
        minimax_m2,
        gpt_oss,
    )
}
# SGLang's other names for the same formats.
ALIASES: dict[str, str] = {"qwen": "hermes", "qwen25": "hermes", "glm": "glm45"}
NAMES: tuple[str, ...] = (*FORMATS, *ALIASES)  # what GATEWAY_CHAT_TOOL_PARSER accepts


def pairing_error(tools: ToolCallFormat, reasoning: ReasoningFormat | None) -> str | None:
    """Why the two parsers cannot go together (None: they can): a format that carries the calls and the reasoning
    in one grammar (gpt-oss's harmony) needs both parsers set to it."""
    reasoning_name = "none" if reasoning is None else reasoning.name
    if tools.reasoning is not None and reasoning_name != tools.reasoning:
        return (
            f"GATEWAY_CHAT_TOOL_PARSER={tools.name} needs GATEWAY_CHAT_REASONING_PARSER={tools.reasoning}, not "
            f"{reasoning_name} (one format carries both the reasoning and the calls)"
        )
    if reasoning is not None and reasoning.tool_parser is not None and tools.name != reasoning.tool_parser:
        return (
            f"GATEWAY_CHAT_REASONING_PARSER={reasoning.name} needs GATEWAY_CHAT_TOOL_PARSER={reasoning.tool_parser}, "
            f"not {tools.name} (one format carries both the reasoning and the calls)"
        )
    return None


def tool_format(name: str) -> ToolCallFormat:
    """The format a configured name (or alias) stands for; KeyError with the known names when there is none."""
    found = FORMATS.get(ALIASES.get(name, name))
    if found is None:
        raise KeyError(f"unknown tool parser {name!r}; known: {', '.join(NAMES)}")
    return found


__all__ = [
    "ALIASES",
    "FORMATS",
    "NAMES",
    "ParsedCompletion",
    "ToolCallFormat",
    "ToolCallStreamSplitter",
    "new_tool_call_id",
    "pairing_error",
    "partial_marker_length",
    "tool_format",
]
