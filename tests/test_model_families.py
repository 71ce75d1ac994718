"""An agent tool loop through each of the three chat APIs with each MoE family's template (``tests/families.py``):
GLM-4.7, MiniMax-M2, DeepSeek-V3.2, Kimi-K2-Thinking and gpt-oss, each served with its SGLang parser names.

Per family, a real gateway and simulator run on a tiny tokenizer with the family's template and tokens; the session
stops on the family's stop tokens (``stop_token_ids``, as SGLang reads them from the model's generation config);
the simulator answers with what a model trained on that template writes (``families.model_text``: reasoning, a
short preamble and a typed call, then, once the tool has answered, reasoning and the answer). Through the real
``openai`` (Chat Completions, Responses) and ``anthropic`` clients, unary and streamed, the client sends each reply
back as it came. What must hold: the reasoning, content and typed calls come back in each API's shapes; the
session is one branch, and before each answer it holds exactly what the template renders for the conversation so
far (``chat_checks.check_turn_by_turn``), the answers trained and nothing else. Then, per family's quirks: a new
user turn after gpt-oss's answer (``<|return|>`` kept, the history re-closed and its analysis dropped, under both
rewrite policies), and MiniMax-M2 with ``minimax-append-think`` (the reasoning kept in the content).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from chat_checks import (
    TOP_P,
    anthropic_client,
    anthropic_turn,
    check_turn_by_turn,
    full_view,
    metric,
    new_session,
    openai_chat,
    openai_client,
    render_ids,
    session_sample,
)
from conftest import Service, run_gateway, run_simulator
from families import FAMILIES, Family, model_text

from sglang_sim.tiny_tokenizer import build_tiny_chat_tokenizer

FUNCTION = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CHAT_TOOLS = [{"type": "function", "function": FUNCTION}]
SYSTEM = "Be brief."
QUESTION = "Weather in Paris for two days?"
ARGUMENTS = {"city": "Paris", "days": 2}
CALL_REASONING = "I should look the weather up."
PREAMBLE = "Let me check."
RESULT = "sunny, 21 degrees"
FINAL_REASONING = "The tool says sunny."
FINAL = "It is sunny in Paris, 21 degrees."
MODEL_CALL_ID = "functions.get_weather:0"  # the id Kimi's model writes (the other families' templates write none)


@dataclass(frozen=True)
class Stack:
    family: Family
    directory: Path
    tokenizer: Any
    sim: Service
    gateway: Service

    def session(self, gateway: Service | None = None) -> str:
        stops = [self.tokenizer.convert_tokens_to_ids(t) for t in self.family.stops]
        defaults = {**TOP_P, "stop_token_ids": stops}
        return new_session(gateway or self.gateway, prefix="family", sampling_defaults=defaults)

    def answer(self, history: list[dict[str, Any]], message: dict[str, Any], stop: str) -> list[int]:
        """The model's tokens for ``message``: the template's text for it, then the stop token."""
        text = model_text(self.tokenizer, history, message, CHAT_TOOLS)
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.convert_tokens_to_ids(stop)]

    def script(self, sid: str, *answers: list[int]) -> None:
        items = [{"token_ids": ids, "eos": False} for ids in answers]  # the stop token is in the ids
        response = httpx.post(f"{self.sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": items})
        assert response.status_code == 200, response.text


def tool_loop(stack: Stack) -> tuple[list[int], list[int]]:
    """The model's two answers in the loop: reasoning, a preamble and the call; then reasoning and the answer."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    call = {
        "role": "assistant",
        "content": PREAMBLE,
        "reasoning_content": CALL_REASONING,
        "tool_calls": [
            {"id": MODEL_CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ],
    }
    first = stack.answer(history, call, stack.family.call_stop)
    history += [call, {"role": "tool", "tool_call_id": MODEL_CALL_ID, "content": RESULT}]
    final = {"role": "assistant", "content": FINAL, "reasoning_content": FINAL_REASONING}
    return first, stack.answer(history, final, stack.family.answer_stop)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from transformers import AutoTokenizer

    family = FAMILIES[request.param]
    directory = build_tiny_chat_tokenizer(tmp_path_factory.mktemp(f"family-{family.name}"), spec=family.spec)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    args = ("--tokenizer", str(directory), "--log-level", "warning")
    with run_simulator("--tokenizer", str(directory)) as sim, run_gateway(sim.url, *args, env=family.env()) as gateway:
        yield Stack(family, directory, tokenizer, sim, gateway)


def expected_call_ids(stack: Stack, ids: list[str]) -> None:
    if stack.family.tool_parser == "kimi_k2":
        assert ids == [MODEL_CALL_ID]  # Kimi's calls keep the ids the model wrote
    else:
        assert len(ids) == 1 and ids[0].startswith(("call_", "toolu_")), ids


# ---- OpenAI Chat Completions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_openai_chat_tool_loop(stack: Stack, stream: bool) -> None:
    sid = stack.session()
    answers = tool_loop(stack)
    stack.script(sid, *answers)
    client = openai_client(stack.gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reply, finish, _ = openai_chat(client, messages, stream=stream, tools=CHAT_TOOLS, max_tokens=400)
    assert finish == "tool_calls", reply
    assert reply["reasoning_content"] == CALL_REASONING and reply["content"] == PREAMBLE
    (call,) = reply["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS
    expected_call_ids(stack, [call["id"]])
    messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    reply, finish, _ = openai_chat(client, messages, stream=stream, tools=CHAT_TOOLS, max_tokens=400)
    assert finish == "stop" and reply == {"role": "assistant", "content": FINAL, "reasoning_content": FINAL_REASONING}
    check_turn_by_turn(stack.gateway.url, sid, stack.tokenizer, list(answers))


# ---- Anthropic Messages -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_anthropic_tool_loop(stack: Stack, stream: bool) -> None:
    sid = stack.session()
    answers = tool_loop(stack)
    stack.script(sid, *answers)
    client = anthropic_client(stack.gateway, sid)
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 400,
        "system": SYSTEM,
        "tools": [
            {"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": FUNCTION["parameters"]}
        ],
        "thinking": {"type": "enabled", "budget_tokens": 64},
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = anthropic_turn(client, stream=stream, messages=messages, **kwargs)
    assert first.stop_reason == "tool_use"
    thinking, text, use = first.content
    assert (thinking.type, thinking.thinking) == ("thinking", CALL_REASONING)
    assert (text.type, text.text) == ("text", PREAMBLE)
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", ARGUMENTS)
    expected_call_ids(stack, [use.id])
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    second = anthropic_turn(client, stream=stream, messages=messages, **kwargs)
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in second.content] == [
        ("thinking", FINAL_REASONING),
        ("text", FINAL),
    ]
    check_turn_by_turn(stack.gateway.url, sid, stack.tokenizer, list(answers))


# ---- OpenAI Responses ----------------------------------------------------------------------------------------------
def responses_turn(client: Any, *, stream: bool, **kwargs: Any) -> dict[str, Any]:
    if not stream:
        return client.responses.create(model="tiny", **kwargs).model_dump(exclude_none=True)
    final = None
    for event in client.responses.create(model="tiny", stream=True, **kwargs):
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    assert final is not None
    return final.model_dump(exclude_none=True)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_responses_tool_loop(stack: Stack, stream: bool) -> None:
    """As Codex drives it: ``store: false``, the whole input each turn, the output items sent back as they came."""
    sid = stack.session()
    answers = tool_loop(stack)
    stack.script(sid, *answers)
    client = openai_client(stack.gateway, sid)
    kwargs: dict[str, Any] = {
        "instructions": SYSTEM,
        "tools": [{"type": "function", **FUNCTION}],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 400,
    }
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    first = responses_turn(client, stream=stream, input=history, **kwargs)
    reasoning, message, call = first["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == CALL_REASONING
    assert message["type"] == "message" and message["content"][0]["text"] == PREAMBLE
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == ARGUMENTS
    expected_call_ids(stack, [call["call_id"]])
    history += [*first["output"], {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}]
    second = responses_turn(client, stream=stream, input=history, **kwargs)
    reasoning, message = second["output"]
    assert reasoning["content"][0]["text"] == FINAL_REASONING and message["content"][0]["text"] == FINAL
    check_turn_by_turn(stack.gateway.url, sid, stack.tokenizer, list(answers))


# ---- what a parser that does not fit the output does: the text, never an error --------------------------------------
def test_a_cut_call_is_the_models_text(stack: Stack) -> None:
    """An answer cut inside its call (max_tokens): the text after the reasoning, as the model wrote it, finish
    ``length``; the session still holds the model's tokens."""
    sid = stack.session()
    first, _ = tool_loop(stack)
    cut = first[: len(first) - 4]  # the stop token and the call's last tokens missing
    stack.script(sid, cut)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reply, finish, _ = openai_chat(
        openai_client(stack.gateway, sid), messages, stream=False, tools=CHAT_TOOLS, max_tokens=len(cut)
    )
    assert finish == "length" and "tool_calls" not in reply
    assert reply["reasoning_content"] == CALL_REASONING
    # The content is the preamble, then the unfinished call as the model wrote it (its markers as SGLang sends them:
    # as text when they are special tokens, which the gateway then asks for).
    keeps_special = stack.family.name in ("gpt-oss", "kimi-k2-thinking")
    text = stack.tokenizer.decode(cut, skip_special_tokens=not keeps_special)
    content = reply["content"]
    assert content.startswith(PREAMBLE) and len(content) > len(PREAMBLE) and text.endswith(content[len(PREAMBLE) :])
    assert session_sample(stack.gateway.url, sid)["tokens"].tolist()[-len(cut) :] == cut


# ---- the families' own ways --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", ["gpt-oss"], indirect=True)
@pytest.mark.parametrize("policy", ["append", "fork"])
def test_gpt_oss_a_new_user_turn_after_the_answer(stack: Stack, policy: str) -> None:
    """After a final answer the template renders the history otherwise: that answer closed by ``<|end|>`` (the model
    ended it with ``<|return|>``) and the call's analysis dropped. ``append``: one trajectory, the model's tokens
    kept, then exactly what the template renders after that answer once the user speaks again; ``fork``: a branch
    whose prompt is the conversation as the template renders it now."""
    with run_gateway(stack.sim.url, "--tokenizer", str(stack.directory), "--log-level", "warning",
                     env=stack.family.env(rewrite_policy=policy)) as gateway:  # fmt: skip
        sid = stack.session(gateway)
        first, final = tool_loop(stack)
        history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        stack.script(sid, first, final, final)
        client = openai_client(gateway, sid)
        reply, _, _ = openai_chat(client, history, stream=False, tools=CHAT_TOOLS)
        history += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": RESULT}]
        answer, _, _ = openai_chat(client, history, stream=False, tools=CHAT_TOOLS)
        history += [answer, {"role": "user", "content": "And tomorrow?"}]
        rewrites = metric(gateway, 'gateway_chat_drift_total{cause="rewrite"}')
        again, finish, _ = openai_chat(client, history, stream=False, tools=CHAT_TOOLS)
        assert finish == "stop" and again["content"] == FINAL
        assert metric(gateway, 'gateway_chat_drift_total{cause="rewrite"}') == rewrites + 1
        view = full_view(gateway.url, sid)
        tokens = session_sample(gateway.url, sid)["tokens"].tolist()
        ret, end = (stack.tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|end|>"))
        if policy == "append":
            assert len(view["branches"]) == 1
            after_answer = tokens.index(ret) + 1  # the first answer's <|return|>, as the model wrote it
            user_turn = stack.tokenizer.encode("<|start|>user<|message|>And tomorrow?<|end|><|start|>assistant")
            assert tokens[after_answer : after_answer + len(user_turn)] == user_turn
            assert tokens[after_answer + len(user_turn) :] == final
            return
        assert len(view["branches"]) == 2
        fork = session_sample(gateway.url, sid, branch=1)["tokens"].tolist()
        conversation = [*history, {"role": "assistant", "content": FINAL, "reasoning_content": FINAL_REASONING}]
        for message in conversation:  # arguments as objects, as templates take them (and the gateway gives them)
            for call in message.get("tool_calls", ()):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        expected = render_ids(stack.tokenizer, conversation, CHAT_TOOLS, prompt=False)
        assert fork == expected  # the model stopped at <|return|>, which the template writes last
        assert end in fork[: fork.index(ret)] and stack.tokenizer.encode(CALL_REASONING)[0] not in fork[:10]
        assert CALL_REASONING not in stack.tokenizer.decode(fork)  # the call's analysis, dropped once answered


def test_special_markers_are_asked_for_as_text(stack: Stack) -> None:
    """Harmony's markers and Kimi's tool-call tokens are special tokens: each chat turn asks for
    ``skip_special_tokens: false`` (SGLang would leave them out of the text); a family whose markers are plain text
    does not."""
    sid = stack.session()
    stack.script(sid, tool_loop(stack)[0])
    openai_chat(
        openai_client(stack.gateway, sid), [{"role": "user", "content": QUESTION}], stream=False, tools=CHAT_TOOLS
    )
    log = httpx.get(f"{stack.sim.url}/sim/requests").json()
    params = [r["body"]["sampling_params"] for r in log if str((r.get("body") or {}).get("rid", "")).startswith(sid)][
        -1
    ]
    special = stack.family.name in ("gpt-oss", "kimi-k2-thinking")
    assert (params.get("skip_special_tokens") is False) == special, params


@pytest.mark.parametrize("stack", ["minimax-m2"], indirect=True)
def test_minimax_append_think_keeps_the_reasoning_in_the_content(stack: Stack) -> None:
    """``minimax-append-think``: nothing is split, the content is the whole answer with its ``<think>`` put back; a
    client that sends it back as it came (MiniMax's interleaved thinking) continues the same branch."""
    env = stack.family.env(reasoning_parser="minimax-append-think")
    with run_gateway(stack.sim.url, "--tokenizer", str(stack.directory), "--log-level", "warning", env=env) as gateway:
        sid = stack.session(gateway)
        answers = tool_loop(stack)
        stack.script(sid, *answers)
        client = openai_client(gateway, sid)
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        reply, _, _ = openai_chat(client, messages, stream=True, tools=CHAT_TOOLS)
        assert "reasoning_content" not in reply
        assert reply["content"] == f"<think>{CALL_REASONING}\n</think>\n\n{PREAMBLE}"
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": RESULT}]
        reply, _, _ = openai_chat(client, messages, stream=False, tools=CHAT_TOOLS)
        assert reply["content"] == f"<think>{FINAL_REASONING}\n</think>\n\n{FINAL}"
        check_turn_by_turn(gateway.url, sid, stack.tokenizer, list(answers))
