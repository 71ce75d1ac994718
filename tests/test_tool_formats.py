"""The tool-call formats end to end (``GATEWAY_CHAT_TOOL_PARSER``), through the real ``openai`` and ``anthropic``
clients.

For each format a real gateway and simulator run on a tiny tokenizer whose chat template renders an assistant's calls
in that format (``build_tiny_chat_tokenizer(..., tool_format=...)``); the simulator answers with what a model trained
on that template writes (the template's own rendering of the answer, ``/sim/script``). What must hold, unary and
streamed: parallel calls come back as the API's tool calls with arguments typed by the tool's schema (and Kimi-K2's
own call ids), the streamed content and calls equal the unary ones, the session is one token-exact trajectory
(``chat_checks.check_trajectory``), and malformed output is the model's exact text with finish ``stop``, counted in
``gateway_chat_tool_parse_failures_total{parser}``, never a 5xx.

The parsers on their own (adversarial text, random splits of streams) are in ``tests/test_tool_parsers.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
from chat_checks import anthropic_client, check_trajectory, metric, new_session, openai_client, script
from chat_checks import anthropic_turn as kit_anthropic_turn
from conftest import Service, run_gateway, run_simulator

from gateway.chat.tool_parsers import FORMATS as FORMATS_BY_NAME
from sglang_sim.tiny_tokenizer import TOOL_FORMATS, build_tiny_chat_tokenizer

FORMATS = sorted(TOOL_FORMATS)
SYSTEM = "You are a helpful assistant."
FUNCTIONS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
    {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
]
OPENAI_TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in FUNCTIONS
]
# Two calls in one answer; the values typed as the schema says (a format that writes them as bare text must read
# ``2`` back as the integer and ``true`` as the boolean).
CALLS = [("get_weather", {"city": "Paris", "days": 2, "metric": True}), ("get_time", {"zone": "Europe/Paris"})]
CONTENT = "Let me check both."
FINAL_TEXT = "It is sunny in Paris, 21 degrees, and 14:05."
# The stop reason each API gives a turn that ended in calls, and one that did not.
ANTHROPIC_STOP = {"calls": "tool_use", "text": "end_turn"}


@dataclass(frozen=True)
class Stack:
    """One format's gateway, simulator and tokenizer."""

    fmt: str
    tokenizer: Any
    sim: Service
    gateway: Service

    def model_text(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """What a model trained on this template writes for an assistant message: the template's rendering of it
        (Kimi-K2's ids ``functions.NAME:INDEX``, as its template numbers them)."""
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(calls)
            ],
        }
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, message], tools=OPENAI_TOOLS, tokenize=False
        )
        head = "<|im_start|>assistant\n"
        return text[text.rindex(head) + len(head) : -len("<|im_end|>\n")]

    def session(self) -> str:
        return new_session(self.gateway, prefix="fmt")

    def script(self, sid: str, *answers: str) -> None:
        script(self.sim, sid, *answers)

    def failures(self) -> float:
        """``gateway_chat_tool_parse_failures_total`` for this format's parser."""
        return metric(self.gateway, f'gateway_chat_tool_parse_failures_total{{parser="{self.fmt}"}}')


@pytest.fixture(scope="module", params=FORMATS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from transformers import AutoTokenizer

    fmt = request.param
    directory = build_tiny_chat_tokenizer(tmp_path_factory.mktemp(f"tokenizer-{fmt}"), tool_format=fmt)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    env = {"GATEWAY_CHAT_TOOL_PARSER": fmt}
    paired = FORMATS_BY_NAME[fmt].reasoning  # gpt-oss: harmony carries the reasoning too (ChatML text has none)
    if paired is not None:
        env["GATEWAY_CHAT_REASONING_PARSER"] = paired
    with (
        run_simulator("--tokenizer", str(directory)) as sim,
        run_gateway(sim.url, "--tokenizer", str(directory), "--log-level", "warning", env=env) as gateway,
    ):
        yield Stack(fmt, tokenizer, sim, gateway)


def expected_ids(stack: Stack) -> list[str] | None:
    """Kimi-K2's calls keep the ids the model wrote; the others get new ``call_`` ids (None)."""
    return [f"functions.{name}:{i}" for i, (name, _) in enumerate(CALLS)] if stack.fmt == "kimi_k2" else None


def check_call_ids(stack: Stack, ids: list[str]) -> None:
    expected = expected_ids(stack)
    if expected is not None:
        assert ids == expected
    else:
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids), ids


# ---- OpenAI ---------------------------------------------------------------------------------------------------------
def openai_chat(client: openai.OpenAI, messages: list[dict[str, Any]], *, stream: bool) -> tuple[dict[str, Any], str]:
    """One completion as a message dict (the stream's deltas put together by call index) and its finish reason."""
    kwargs: dict[str, Any] = {"model": "tiny", "messages": messages, "tools": OPENAI_TOOLS, "max_tokens": 200}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.model_dump(exclude_none=True), str(choice.finish_reason)
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for part in delta.tool_calls or ():
            call = calls.setdefault(
                part.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] += part.id or ""
            call["function"]["name"] += (part.function.name if part.function else None) or ""
            call["function"]["arguments"] += (part.function.arguments if part.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {k: v for k, v in message.items() if v is not None}, finish


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_openai_parallel_calls_in_each_format(stack: Stack, stream: bool) -> None:
    sid = stack.session()
    call_text = stack.model_text(CONTENT, CALLS)
    stack.script(sid, call_text, FINAL_TEXT)
    client = openai_client(stack.gateway, sid)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather and time in Paris?"},
    ]
    reply, finish = openai_chat(client, messages, stream=stream)
    assert finish == "tool_calls"
    assert reply["content"] == CONTENT
    calls = reply["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    check_call_ids(stack, [c["id"] for c in calls])
    results = [
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "14:05"},
    ]
    messages += [reply, *results]
    reply, finish = openai_chat(client, messages, stream=stream)
    assert finish == "stop" and reply == {"role": "assistant", "content": FINAL_TEXT}
    # One trajectory, token for token the template's rendering of the conversation, trained on the model's tokens.
    view = check_trajectory(stack.gateway.url, sid, stack.tokenizer, [call_text, FINAL_TEXT])
    roles = [m["role"] for m in view["chat"]["record"]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant"]


def test_streamed_content_and_calls_equal_the_unary_ones(stack: Stack) -> None:
    answers = []
    for stream in (False, True):
        sid = stack.session()
        stack.script(sid, stack.model_text(CONTENT, CALLS))
        reply, finish = openai_chat(
            openai_client(stack.gateway, sid), [{"role": "user", "content": "x"}], stream=stream
        )
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in reply["tool_calls"]]
        ids = [c["id"] for c in reply["tool_calls"]] if stack.fmt == "kimi_k2" else None
        answers.append((reply["content"], calls, ids, finish))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_malformed_calls_come_back_as_the_models_text(stack: Stack, stream: bool) -> None:
    """An unclosed call (an answer cut short, a model off its format): the exact text, finish ``stop``, counted."""
    whole = stack.model_text(CONTENT, CALLS)
    broken = whole[: whole.rindex("<")]  # the last close marker missing
    if stack.fmt == "gpt-oss":  # its last marker, <|call|>, is a stop token SGLang leaves out anyway: cut the JSON
        broken = whole[: whole.rindex("}")]
    for text in (broken, broken + "\n\nand then some words"):
        sid = stack.session()
        stack.script(sid, text)
        before = stack.failures()
        reply, finish = openai_chat(
            openai_client(stack.gateway, sid), [{"role": "user", "content": "x"}], stream=stream
        )
        assert finish == "stop" and reply == {"role": "assistant", "content": text}
        assert stack.failures() == before + 1
        check_trajectory(stack.gateway.url, sid, stack.tokenizer, [text])


def test_text_that_only_looks_like_a_call_start_is_content(stack: Stack) -> None:
    """A marker's first characters at the end of an answer are held back while streaming, then sent: no failure."""
    # Its ASCII part: the simulator gives each token's text decoded alone, so a token holding part of a character
    # (byte-level BPE) would not come back as the text.
    start = stack.model_text("", CALLS)[:4]
    text = f"Here is a fragment: {start if start.isascii() else start[:1]}"
    for stream in (False, True):
        sid = stack.session()
        stack.script(sid, text)
        before = stack.failures()
        reply, finish = openai_chat(
            openai_client(stack.gateway, sid), [{"role": "user", "content": "x"}], stream=stream
        )
        assert finish == "stop" and reply["content"] == text and stack.failures() == before


# ---- Anthropic ------------------------------------------------------------------------------------------------------
def anthropic_turn(client: anthropic.Anthropic, messages: list[dict[str, Any]], *, stream: bool) -> Any:
    kwargs = {"model": "tiny", "max_tokens": 200, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    return kit_anthropic_turn(client, stream=stream, messages=messages, **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_anthropic_tool_use_in_each_format(stack: Stack, stream: bool) -> None:
    sid = stack.session()
    call_text = stack.model_text(CONTENT, CALLS)
    stack.script(sid, call_text, FINAL_TEXT)
    client = anthropic_client(stack.gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather and time in Paris?"}]
    first = anthropic_turn(client, messages, stream=stream)
    assert first.stop_reason == ANTHROPIC_STOP["calls"]
    text, *uses = first.content
    assert text.type == "text" and text.text == CONTENT
    assert [(u.type, u.name, u.input) for u in uses] == [("tool_use", name, arguments) for name, arguments in CALLS]
    check_call_ids(stack, [u.id for u in uses])
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": '{"temperature": 21}'},
                {"type": "tool_result", "tool_use_id": uses[1].id, "content": "14:05"},
            ],
        },
    ]
    second = anthropic_turn(client, messages, stream=stream)
    assert second.stop_reason == ANTHROPIC_STOP["text"]
    assert [(b.type, b.text) for b in second.content] == [("text", FINAL_TEXT)]
    check_trajectory(stack.gateway.url, sid, stack.tokenizer, [call_text, FINAL_TEXT])
