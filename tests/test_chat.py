"""Agent sessions over the chat APIs, driven by the real ``openai`` and ``anthropic`` clients.

A real gateway and a real simulator, both on a tiny real tokenizer made here (byte-level BPE with a tool-calling
chat template, ``sglang_sim.tiny_tokenizer``). The simulator answers with scripted text (tool calls, final
answers) through ``/sim/script``, so an agent loop runs deterministically over several turns, streamed and not.

What must hold: token-in-token-out (the session's tokens are exactly the template's rendering of the conversation
when the model writes what the template would, and the model's own tokens are kept as generated even when they are
not what the tokenizer would produce), the fold equals the token-level path on the same answers, edited histories
fork branches, and every failure answers in the API's own error shape and leaves the session unchanged.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from chat_checks import (
    CALL_TEXT,
    FINAL_TEXT,
    TOP_P,
    WEATHER_TOOL,
    anthropic_client,
    metric,
    new_session,
    openai_chat,
    openai_client,
    sample,
    script,
    view,
)
from chat_checks import anthropic_turn as kit_anthropic_turn
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway
from safetensors.numpy import load

TOOLS = [WEATHER_TOOL]
SYSTEM = "You are a helpful assistant."


# ---- helpers ---------------------------------------------------------------------------------------------------
def stable(state: dict[str, Any]) -> dict[str, Any]:
    """A session view without the fields that change on every request."""
    return {k: v for k, v in state.items() if k not in ("updated_at", "busy")}


def rendered_ids(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool = False) -> list[int]:
    """The conversation as the template renders it in one go, tool-call arguments as objects (as templates take
    them, and as the model writes them: the API's ``arguments`` string is compact JSON)."""
    text = tokenizer.apply_chat_template(
        [_arguments_parsed(m) for m in messages], tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _arguments_parsed(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        if isinstance(c["function"]["arguments"], str)
        else c
        for c in calls
    ]
    return {**message, "tool_calls": parsed}


# ---- the agent loop, OpenAI -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_openai_agent_loop_keeps_the_tokens_the_template_renders(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any, stream: bool
) -> None:
    sid = new_session(chat_gateway)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    client = openai_client(chat_gateway, sid)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    reply, finish, _ = openai_chat(client, messages, stream=stream, max_tokens=64)
    assert finish == "tool_calls"
    assert reply["content"] == "Let me check."
    (call,) = reply["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["function"]["arguments"] == '{"city":"Paris"}'
    messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    reply, finish, usage = openai_chat(client, messages, stream=stream, max_tokens=64)
    assert finish == "stop" and reply == {"role": "assistant", "content": FINAL_TEXT}

    # The session holds exactly the template's rendering of the whole conversation: nothing was re-tokenized.
    messages.append(reply)
    expected = rendered_ids(tokenizer, messages)
    arrays = sample(chat_gateway, sid)
    tokens = arrays["tokens"].tolist()
    eos = tokenizer.eos_token_id
    # The template closes the last assistant message with "<|im_end|>\n"; the model stopped at <|im_end|>.
    assert tokens == expected[:-1] and tokens[-1] == eos
    state = view(chat_gateway, sid)
    prompt_length = state["prompt_length"]
    first_prompt = rendered_ids(tokenizer, messages[:2], generation_prompt=True)
    assert tokens[:prompt_length] == first_prompt
    # Loss mask: 1 on exactly the model's tokens (its two answers, eos included), 0 on the rendered tool turn.
    answers = [[*tokenizer.encode(text, add_special_tokens=False), eos] for text in (CALL_TEXT, FINAL_TEXT)]
    mask = arrays["loss_mask"]
    assert int(mask.sum()) == sum(len(a) for a in answers)
    response = tokens[prompt_length:]
    assert response[: len(answers[0])] == answers[0] and response[-len(answers[1]) :] == answers[1]
    assert mask[: len(answers[0])].all() and mask[-len(answers[1]) :].all()
    assert not mask[len(answers[0]) : -len(answers[1])].any()
    # Replay data for every token, as for token-level turns.
    assert arrays["rollout_routed_experts"].shape == (len(tokens) - 1, SIM_LAYERS, SIM_TOPK)
    assert len(arrays["rollout_top_p_token_offsets"]) == len(response) + 1
    assert usage.prompt_tokens + usage.completion_tokens == len(tokens)
    assert [m["role"] for m in state["chat"]["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert state["chat"]["messages"][-1]["generated_until_token"] == len(tokens)
    assert state["status"] == "completed"


def test_fold_equals_the_token_level_path_on_the_same_answers(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any
) -> None:
    """The chat route is a token-level session turn plus rendering: the same token ids in, the same sample out."""
    sid = new_session(chat_gateway)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    client = openai_client(chat_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    reply, _, _ = openai_chat(client, messages, stream=False, max_tokens=64)
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}]
    openai_chat(client, messages, stream=False, max_tokens=64)
    chat = sample(chat_gateway, sid)
    turn_log = view(chat_gateway, sid)["turn_log"]
    assert [t["kind"] for t in turn_log] == ["model", "tool", "model"]

    # The same conversation, token by token: prompt ids, generate, append the rendered tool turn, generate.
    tokens, prompt_length = chat["tokens"], view(chat_gateway, sid)["prompt_length"]
    first_end = prompt_length + turn_log[0]["num_tokens"]
    tool_end = first_end + turn_log[1]["num_tokens"]
    token_sid = f"tok-{uuid.uuid4().hex[:10]}"
    script(chat_sim, token_sid, CALL_TEXT, FINAL_TEXT)
    create = {
        "session_id": token_sid,
        "prompt_ids": tokens[:prompt_length].tolist(),
        "num_layers": SIM_LAYERS,
        "moe_router_topk": SIM_TOPK,
        "sampling_defaults": TOP_P,
    }
    with httpx.Client(base_url=chat_gateway.url) as http:
        assert http.post("/v1/sessions", json=create).status_code == 201
        turn = {"sampling_params": {"max_new_tokens": 64}}
        assert http.post(f"/v1/sessions/{token_sid}/generate", json=turn).status_code == 200
        append = {"token_ids": tokens[first_end:tool_end].tolist()}
        assert http.post(f"/v1/sessions/{token_sid}/append", json=append).status_code == 200
        assert http.post(f"/v1/sessions/{token_sid}/generate", json=turn).status_code == 200
    token_level = sample(chat_gateway, token_sid)
    assert sorted(chat) == sorted(token_level)
    for name, array in chat.items():
        np.testing.assert_array_equal(array, token_level[name], err_msg=name)


def test_the_models_own_tokens_are_kept_when_the_tokenizer_would_split_them_otherwise(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any
) -> None:
    """Re-tokenization drift: a model may emit a split of its text that encoding the text would not give back.
    Those tokens are what it was trained to produce and what the next turn's prefix holds."""
    sid = new_session(chat_gateway, moe=False, top_p=False)
    text = "Sunny in Paris"
    odd = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]  # one token per character
    assert odd != tokenizer.encode(text, add_special_tokens=False)
    script(chat_sim, sid, odd, "Anything else?")  # the simulator ends a scripted answer with eos
    client = openai_client(chat_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
    reply, _, _ = openai_chat(client, messages, stream=False, max_tokens=64)
    assert reply["content"] == text
    messages += [reply, {"role": "user", "content": "Thanks"}]
    openai_chat(client, messages, stream=False, max_tokens=64)
    tokens = sample(chat_gateway, sid)["tokens"].tolist()
    prompt_length = view(chat_gateway, sid)["prompt_length"]
    assert tokens[prompt_length : prompt_length + len(odd) + 1] == [*odd, tokenizer.eos_token_id]


def test_malformed_tool_call_text_stays_content(chat_gateway: Service, chat_sim: Service) -> None:
    sid = new_session(chat_gateway, moe=False)
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    script(chat_sim, sid, broken)
    client = openai_client(chat_gateway, sid)
    reply, finish, _ = openai_chat(client, [{"role": "user", "content": "x"}], stream=False, max_tokens=64)
    assert finish == "stop" and reply == {"role": "assistant", "content": broken}


# ---- the agent loop, Anthropic ----------------------------------------------------------------------------------
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def anthropic_turn(client: anthropic.Anthropic, messages: list[dict[str, Any]], *, stream: bool) -> Any:
    kwargs = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    return kit_anthropic_turn(client, stream=stream, messages=messages, **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_anthropic_agent_loop_with_tool_use(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any, stream: bool
) -> None:
    sid = new_session(chat_gateway)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    client = anthropic_client(chat_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = anthropic_turn(client, messages, stream=stream)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Let me check."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature": 21}'}]},
    ]
    second = anthropic_turn(client, messages, stream=stream)
    assert second.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in second.content] == [("text", FINAL_TEXT)]
    # The same tokens as the OpenAI form of this conversation, rendered by the template in one go.
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": FINAL_TEXT},
    ]
    tokens = sample(chat_gateway, sid)["tokens"].tolist()
    assert tokens == rendered_ids(tokenizer, conversation)[:-1]
    assert second.usage.output_tokens == len(tokenizer.encode(FINAL_TEXT, add_special_tokens=False)) + 1


# ---- edited histories -------------------------------------------------------------------------------------------
def run_two_turns(gateway: Service, sim: Service, sid: str) -> list[dict[str, Any]]:
    script(sim, sid, CALL_TEXT, FINAL_TEXT)
    client = openai_client(gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    reply, _, _ = openai_chat(client, messages, stream=False, max_tokens=64)
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}]
    reply, _, _ = openai_chat(client, messages, stream=False, max_tokens=64)
    return [*messages, reply]


def test_an_edited_tool_result_forks_a_branch_from_the_models_last_message(
    chat_gateway: Service, chat_sim: Service
) -> None:
    sid = new_session(chat_gateway)
    history = run_two_turns(chat_gateway, chat_sim, sid)
    before = sample(chat_gateway, sid)
    first_reply_end = view(chat_gateway, sid)["chat"]["messages"][1]["generated_until_token"]
    drift_before = metric(chat_gateway, 'gateway_chat_drift_total{cause="edited_history"}')

    edited = [*history[:2], {**history[2], "content": "raining"}]  # the tool said something else this time
    script(chat_sim, sid, "Take an umbrella.")
    completion = openai_client(chat_gateway, sid).chat.completions.create(
        model="tiny", messages=edited, tools=TOOLS, max_tokens=64
    )
    assert completion.choices[0].message.content == "Take an umbrella."
    assert completion.model_extra["gateway"]["branch"] == 1  # the gateway's own field, beside the API's

    root, state = view(chat_gateway, sid), view(chat_gateway, sid, branch=1)
    assert root["branch"] == 0 and state["branch"] == 1
    first, second = state["branches"]
    assert first["status"] == "completed" and first["parent"] is None and first["turns"] == 3
    # The new branch continues from the end of the model's first reply, with those tokens unchanged; they are its
    # prompt, so the first reply is trained once (in branch 0).
    assert second == second | {"parent": 0, "fork_token": first_reply_end, "first_difference": 2, "turns": 2}
    assert second["cause"] == "edited_history" and second["model"] == "tiny"
    live = sample(chat_gateway, sid, branch=1)
    assert state["prompt_length"] == first_reply_end
    np.testing.assert_array_equal(live["tokens"][:first_reply_end], before["tokens"][:first_reply_end])
    np.testing.assert_array_equal(sample(chat_gateway, sid)["tokens"], before["tokens"])  # the root: unchanged
    assert metric(chat_gateway, 'gateway_chat_drift_total{cause="edited_history"}') == drift_before + 1

    group = httpx.post(f"{chat_gateway.url}/v1/samples", json={"session_ids": [sid]})
    assert group.status_code == 200
    arrays = load(group.content)
    assert {name.split("/")[0] for name in arrays} == {"0", "1"}
    trained = int(arrays["0/loss_mask"].sum()) + int(arrays["1/loss_mask"].sum())
    assert trained == int(before["loss_mask"].sum()) + int(live["loss_mask"].sum())
    np.testing.assert_array_equal(arrays["1/tokens"], live["tokens"])


def test_an_edited_first_message_forks_from_nothing(chat_gateway: Service, chat_sim: Service) -> None:
    sid = new_session(chat_gateway, moe=False)
    run_two_turns(chat_gateway, chat_sim, sid)
    script(chat_sim, sid, "Hello!")
    messages = [{"role": "user", "content": "Hi there"}]
    reply, _, _ = openai_chat(openai_client(chat_gateway, sid), messages, stream=False, max_tokens=64)
    assert reply["content"] == "Hello!"
    state = view(chat_gateway, sid, branch=1)
    assert state["branch"] == 1 and state["turns"] == 1
    assert state["branches"][1] == state["branches"][1] | {"parent": None, "fork_token": 0, "cause": "new_root"}
    assert [m["role"] for m in state["chat"]["messages"]] == ["user", "assistant"]


def test_reject_policy_refuses_an_edited_history(chat_sim: Service, tokenizer_dir: Path) -> None:
    env = {"GATEWAY_CHAT_DRIFT_POLICY": "reject"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), env=env) as gateway:
        sid = new_session(gateway, moe=False)
        history = run_two_turns(gateway, chat_sim, sid)
        state = view(gateway, sid)
        edited = [{"role": "user", "content": "Weather in Rome?"}, *history[1:3]]
        with pytest.raises(openai.ConflictError) as refused:
            openai_chat(openai_client(gateway, sid), edited, stream=False)
        assert refused.value.code == "history_mismatch"
        assert stable(view(gateway, sid)) == stable(state)


# ---- errors: the API's own shape, the session unchanged ------------------------------------------------------------
@pytest.mark.parametrize(
    ("messages", "extra", "problem"),
    [
        ([{"role": "wizard", "content": "x"}], {}, "role"),
        ([{"role": "tool", "content": "x"}], {}, "tool_call_id"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "x"}], {}, "nope"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], {}, "last message"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "content"),
        ([{"role": "user", "content": "x"}], {"tool_choice": {"type": "function", "function": {"name": "no"}}}, "no"),
        ([{"role": "user", "content": "x"}], {"n": 2}, "n=1"),
        ([{"role": "user", "content": "x"}], {"temperature": 5}, "temperature"),
    ],
)
def test_bad_openai_requests_are_400s_and_change_nothing(
    chat_gateway: Service, messages: list[dict[str, Any]], extra: dict[str, Any], problem: str
) -> None:
    sid = new_session(chat_gateway, moe=False)
    state = view(chat_gateway, sid)
    response = httpx.post(
        f"{chat_gateway.url}/v1/sessions/{sid}/chat/completions",
        json={"messages": messages, "tools": TOOLS, **extra},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and problem in error["message"]
    assert stable(view(chat_gateway, sid)) == stable(state)


def test_bad_anthropic_requests_are_400s_in_its_shape(chat_gateway: Service) -> None:
    sid = new_session(chat_gateway, moe=False)
    state = view(chat_gateway, sid)
    client = anthropic_client(chat_gateway, sid)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}],
        )
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    wrong_max_tokens = httpx.post(
        f"{chat_gateway.url}/v1/sessions/{sid}/v1/messages",
        json={"max_tokens": "8", "messages": [{"role": "user", "content": "x"}]},
    )
    assert wrong_max_tokens.status_code == 400 and "max_tokens" in wrong_max_tokens.json()["error"]["message"]
    assert stable(view(chat_gateway, sid)) == stable(state)


def test_a_failed_upstream_turn_leaves_the_chat_session_unchanged(chat_gateway: Service, chat_sim: Service) -> None:
    sid = new_session(chat_gateway)
    history = run_two_turns(chat_gateway, chat_sim, sid)
    state = view(chat_gateway, sid)
    arrays = sample(chat_gateway, sid)
    messages = [*history, {"role": "user", "content": "And tomorrow?"}]
    for stream in (False, True):
        response = httpx.post(f"{chat_sim.url}/sim/faults", json={"mode": "http_500", "count": 1})
        assert response.status_code == 200, response.text
        with pytest.raises(openai.APIError):
            openai_chat(openai_client(chat_gateway, sid), messages, stream=stream)
        assert stable(view(chat_gateway, sid)) == stable(state)
        after = sample(chat_gateway, sid)
        for name, array in arrays.items():
            np.testing.assert_array_equal(after[name], array, err_msg=name)
    # and the session goes on from where it was
    script(chat_sim, sid, "Rain tomorrow.")
    reply, _, _ = openai_chat(openai_client(chat_gateway, sid), messages, stream=False, max_tokens=64)
    assert reply["content"] == "Rain tomorrow."


def test_context_overflow_is_a_400_in_each_shape(chat_sim: Service, tokenizer_dir: Path) -> None:
    env = {"GATEWAY_CHAT_CONTEXT_TOKENS": "300"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), env=env) as gateway:
        sid = new_session(gateway, moe=False)
        with pytest.raises(openai.BadRequestError) as refused:
            openai_chat(openai_client(gateway, sid), [{"role": "user", "content": "x"}], stream=False, max_tokens=500)
        assert refused.value.code == "context_length_exceeded"
        with pytest.raises(anthropic.BadRequestError):
            anthropic_client(gateway, sid).messages.create(
                model="tiny", max_tokens=500, messages=[{"role": "user", "content": "x"}]
            )
        assert view(gateway, sid)["total_tokens"] == 0


def test_chat_needs_a_tokenizer_and_a_chat_session(gateway: Service, chat_gateway: Service) -> None:
    sid = new_session(gateway, moe=False)
    response = httpx.post(
        f"{gateway.url}/v1/sessions/{sid}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert response.status_code == 501 and response.json()["error"]["code"] == "chat_not_configured"
    response = httpx.post(
        f"{gateway.url}/v1/sessions/{sid}/v1/messages",
        json={"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 501 and response.json()["type"] == "error"
    token_sid = f"tok-{uuid.uuid4().hex[:8]}"
    httpx.post(f"{chat_gateway.url}/v1/sessions", json={"session_id": token_sid, "prompt_ids": [1, 2, 3]})
    response = httpx.post(
        f"{chat_gateway.url}/v1/sessions/{token_sid}/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 400 and "prompt_ids" in response.json()["error"]["message"]
    missing = httpx.post(
        f"{chat_gateway.url}/v1/sessions/nope/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    # a chat session has no prompt for a token-level turn
    generate = httpx.post(f"{chat_gateway.url}/v1/sessions/{new_session(chat_gateway)}/generate", json={})
    assert generate.status_code == 409 and "no prompt" in generate.json()["error"]["message"]


def test_anthropic_clients_authenticate_with_x_api_key(chat_sim: Service, tokenizer_dir: Path) -> None:
    env = {"GATEWAY_API_KEY": "sekrit"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), env=env) as gateway:
        headers = {"authorization": "Bearer sekrit"}
        sid = f"auth-{uuid.uuid4().hex[:8]}"
        assert httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid}, headers=headers).status_code == 201
        script(chat_sim, sid, "ok", "ok")
        good = anthropic.Anthropic(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="sekrit", max_retries=0)
        message = good.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert message.content[0].text == "ok"
        bad = anthropic.Anthropic(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as refused:
            bad.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        # Refused in Anthropic's shape under its prefix (clients read error.type), the challenge header kept.
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
        assert refused.value.response.headers["www-authenticate"].startswith("Bearer")
        with pytest.raises(openai.AuthenticationError) as refused_openai:
            openai.OpenAI(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="wrong", max_retries=0).responses.create(
                model="tiny", input="hi"
            )
        assert refused_openai.value.body["type"] == "authentication_error"
        reply, _, _ = openai_chat(
            openai.OpenAI(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="sekrit", max_retries=0),
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "x"},
            ],
            stream=False,
        )
        assert reply["content"] == "ok"


# ---- aborts and callers that leave ------------------------------------------------------------------------------
def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_abort_mid_chat_turn_is_folded_and_recorded(chat_gateway: Service, chat_sim: Service) -> None:
    """The trainer ends the turn (the session's abort route): the session keeps it, aborted and recorded, and the
    client gets an error in its API's shape (503 turn_aborted), never the cut reply as a final answer."""
    sid = new_session(chat_gateway, moe=False)
    fault = {"mode": "delay", "delay_s": 10, "count": 1}  # past the abort grace: the connection is closed
    assert httpx.post(f"{chat_sim.url}/sim/faults", json=fault).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        client = openai_client(chat_gateway, sid)
        pending = pool.submit(openai_chat, client, [{"role": "user", "content": "x"}], stream=False, max_tokens=8)
        wait_until(lambda: view(chat_gateway, sid)["busy"])
        aborted = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/abort", timeout=30).json()
        with pytest.raises(openai.InternalServerError) as refused:
            pending.result(timeout=30)
    assert aborted["aborted"] is True
    assert refused.value.status_code == 503 and refused.value.body["code"] == "turn_aborted"
    state = view(chat_gateway, sid)
    assert state["status"] == "aborted" and not state["busy"]
    assert [m["role"] for m in state["chat"]["messages"]] == ["user", "assistant"]
    assert state["chat"]["messages"][1]["content"] == ""  # the delay held the answer: no token came


def test_a_streaming_caller_that_leaves_leaves_a_coherent_session(chat_gateway: Service, chat_sim: Service) -> None:
    sid = new_session(chat_gateway)
    fault = {"mode": "delay", "delay_s": 1, "count": 1}
    assert httpx.post(f"{chat_sim.url}/sim/faults", json=fault).status_code == 200
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 8}
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream("POST", f"{chat_gateway.url}/v1/sessions/{sid}/chat/completions", json=body, timeout=0.3) as r,
    ):
        r.read()
    wait_until(lambda: not view(chat_gateway, sid)["busy"])
    state = view(chat_gateway, sid)
    arrays = sample(chat_gateway, sid)
    # Either the turn never started (nothing changed) or it was folded, whole or aborted, and recorded.
    if state["total_tokens"]:
        assert state["status"] in ("aborted", "completed", "truncated")
        assert [m["role"] for m in state["chat"]["messages"]] == ["user", "assistant"]
        assert len(arrays["loss_mask"]) == state["response_length"]
        assert arrays["rollout_routed_experts"].shape[0] <= state["total_tokens"] - 1
    else:
        assert "chat" not in state and state["turns"] == 0
    # The session serves the next request either way.
    script(chat_sim, sid, "Fine.")
    messages = [{"role": "user", "content": "y"}]
    reply, _, _ = openai_chat(openai_client(chat_gateway, sid), messages, stream=False, max_tokens=8)
    assert reply["content"] == "Fine."


async def test_the_sdk_creates_chat_sessions_and_fetches_every_branch(chat_gateway: Service, chat_sim: Service) -> None:
    from slime_client import GatewayClient

    async with GatewayClient(chat_gateway.url) as gw:
        session = await gw.create_session(num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
        client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key="unused", max_retries=0)
        script(chat_sim, session.session_id, "Hello.", "Hi again.")
        first = [{"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(model="tiny", messages=first, max_tokens=16)
        assert reply.choices[0].message.content == "Hello."
        edited = [{"role": "user", "content": "hello"}]  # another first message: a branch from nothing
        await client.chat.completions.create(model="tiny", messages=edited, max_tokens=16)
        samples = await session.fetch_all()
        assert [(s.branch, s.branches) for s in samples] == [(0, 2), (1, 2)]
        assert [(s.parent, s.cause, s.model) for s in samples] == [(None, None, "tiny"), (None, "new_root", "tiny")]
        assert [s.response for s in samples] == ["Hello.", "Hi again."]
        root = await session.fetch()
        assert root.branch == 0 and root.tokens.tolist() == samples[0].tokens.tolist()
        assert (await session.fetch(branch=1)).tokens.tolist() == samples[1].tokens.tolist()
        assert samples[0].rollout_routed_experts is not None and samples[1].rollout_routed_experts is not None


def test_turns_on_different_branches_run_at_once_and_a_busy_branch_is_a_409(
    chat_gateway: Service, chat_sim: Service
) -> None:
    """A turn holds its branch, not the session: while one conversation's turn runs (the simulator holds its answer),
    another conversation on the same session (a subagent: a new root branch) is answered, and a second request for
    the busy branch gets 409 session_busy (the clients retry a 409)."""
    sid = new_session(chat_gateway, moe=False)
    # The held request takes its answer after its delay: the side request, arriving meanwhile, takes the next one.
    script(chat_sim, sid, "First answer.", "Side answer.", "Held answer.")
    main: list[dict[str, Any]] = [{"role": "system", "content": "Main."}, {"role": "user", "content": "Start."}]
    reply, _, _ = openai_chat(openai_client(chat_gateway, sid), main, stream=False, max_tokens=16)
    main += [reply, {"role": "user", "content": "Go on."}]
    assert httpx.post(f"{chat_sim.url}/sim/faults", json={"mode": "delay", "delay_s": 3.0}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(openai_chat, openai_client(chat_gateway, sid), main, stream=False, max_tokens=16)
        wait_until(lambda: view(chat_gateway, sid)["branches"][0]["busy"])
        side = [{"role": "system", "content": "Side agent."}, {"role": "user", "content": "Look."}]
        side_reply, _, _ = openai_chat(openai_client(chat_gateway, sid), side, stream=False, max_tokens=16)
        assert side_reply["content"] == "Side answer." and not held.done()
        with pytest.raises(openai.ConflictError) as busy:
            openai_chat(openai_client(chat_gateway, sid), main, stream=False, max_tokens=16)
        assert busy.value.code == "session_busy"
        assert held.result(timeout=30)[0]["content"] == "Held answer."
    root, other = view(chat_gateway, sid)["branches"]
    assert root["turns"] == 3 and other == other | {"parent": None, "cause": "new_root", "turns": 1}
