"""A trainer's caps on a chat session, in all three chat APIs, and closing a session before its samples are taken.

slime caps each agent turn at ``min(--rollout-max-response-len, the client's max_tokens, context left)``, keeps a
per-session context budget (``max_context_tokens``: a prompt over it is refused, an answer cut to what is left) and
a turn cap (``max_turns_per_sid``: 429). Here: a session's ``sampling_defaults.max_new_tokens``, ``max_context_tokens``
and ``max_turns``, each checked through the real gateway and simulator in the OpenAI chat, Anthropic and Responses
shapes. ``POST /v1/sessions/{id}/close`` refuses every later turn (409 ``session_closed`` in each API's shape) and
drains the running ones (waits, then aborts).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from chat_checks import metric, new_session, sample, script, view
from conftest import Service, run_gateway

from slime_client.sample import read_safetensors_metadata

LONG_ANSWER = " ".join(f"word{i}" for i in range(40))


# ---- one request per API: the body, where the answer's text and its "length stop" are ------------------------------
def chat_request(api: str, text: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    if api == "openai":
        return "chat/completions", {
            "model": "tiny",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        }
    if api == "anthropic":
        return "v1/messages", {
            "model": "tiny",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        }
    return "responses", {"model": "tiny", "max_output_tokens": max_tokens, "input": text}


def stopped_by_length(api: str, answer: dict[str, Any]) -> bool:
    if api == "openai":
        return answer["choices"][0]["finish_reason"] == "length"
    if api == "anthropic":
        return answer["stop_reason"] == "max_tokens"
    return answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}


def completion_tokens(api: str, answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    return usage["completion_tokens"] if api == "openai" else usage["output_tokens"]


def post(gateway: Service, sid: str, api: str, text: str = "hello", max_tokens: int = 30) -> httpx.Response:
    path, body = chat_request(api, text, max_tokens)
    return httpx.post(f"{gateway.url}/v1/sessions/{sid}/{path}", json=body, timeout=30)


def error_of(api: str, response: httpx.Response) -> tuple[str, str]:
    """(the API's error type, its message) from an error answer in that API's own shape."""
    body = response.json()
    if api == "anthropic":
        assert body["type"] == "error", body
    return body["error"]["type"], body["error"]["message"]


def create(gateway: Service, sid: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid, **fields})


APIS = ["openai", "anthropic", "responses"]


# ---- sampling_defaults.max_new_tokens caps every turn --------------------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_the_sessions_max_new_tokens_caps_a_turn_that_asks_for_more(
    chat_gateway: Service, chat_sim: Service, api: str
) -> None:
    sid = new_session(chat_gateway, moe=False, top_p=False, sampling_defaults={"max_new_tokens": 3})
    script(chat_sim, sid, LONG_ANSWER)
    response = post(chat_gateway, sid, api, max_tokens=30)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert completion_tokens(api, answer) == 3 and stopped_by_length(api, answer)
    assert view(chat_gateway, sid)["turn_log"][-1]["num_tokens"] == 3


def test_without_caps_the_requests_length_wins(chat_gateway: Service, chat_sim: Service) -> None:
    """The default changes nothing: a session without caps answers with the length the request asks for."""
    sid = new_session(chat_gateway, moe=False, top_p=False)
    script(chat_sim, sid, LONG_ANSWER)
    answer = post(chat_gateway, sid, "openai", max_tokens=7).json()
    assert completion_tokens("openai", answer) == 7 and stopped_by_length("openai", answer)


# ---- max_context_tokens: the session's context budget ---------------------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_a_prompt_over_the_sessions_budget_is_refused_in_the_apis_overflow_words(
    chat_gateway: Service, chat_sim: Service, api: str
) -> None:
    sid = f"budget-{api}-{time.monotonic_ns()}"
    assert create(chat_gateway, sid, max_context_tokens=16).status_code == 201
    before = metric(chat_gateway, 'gateway_chat_refused_total{reason="context_budget"}')
    response = post(chat_gateway, sid, api, text="a long question " * 20)
    assert response.status_code == 400, response.text
    kind, message = error_of(api, response)
    assert kind == "invalid_request_error"
    if api == "anthropic":  # Claude Code reads "prompt is too long" (and compacts its conversation)
        assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 15 maximum")
    else:
        assert "maximum context length is 16 tokens" in message
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert metric(chat_gateway, 'gateway_chat_refused_total{reason="context_budget"}') == before + 1
    assert view(chat_gateway, sid)["total_tokens"] == 0  # nothing changed


@pytest.mark.parametrize("api", APIS)
def test_an_answer_that_would_pass_the_budget_is_cut_to_what_is_left(
    chat_gateway: Service, chat_sim: Service, api: str
) -> None:
    sid = f"budget-cut-{api}-{time.monotonic_ns()}"
    budget = 60
    assert create(chat_gateway, sid, max_context_tokens=budget).status_code == 201
    script(chat_sim, sid, LONG_ANSWER)
    response = post(chat_gateway, sid, api, text="hi", max_tokens=500)
    assert response.status_code == 200, response.text
    answer = response.json()
    state = view(chat_gateway, sid)
    assert stopped_by_length(api, answer)
    assert state["total_tokens"] == budget  # the branch ends exactly at the budget
    assert completion_tokens(api, answer) == budget - state["prompt_length"]
    # The next request's prompt (the history, a new user message) no longer fits: refused, the branch unchanged.
    path, body = chat_request(api, "more", 10)
    history = answer_history(api, answer)
    if api == "responses":
        body["input"] = [{"role": "user", "content": "hi"}, *history, {"role": "user", "content": "more"}]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}, *history, {"role": "user", "content": "more"}]
    refused = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/{path}", json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    assert view(chat_gateway, sid)["total_tokens"] == budget


def answer_history(api: str, answer: dict[str, Any]) -> list[dict[str, Any]]:
    if api == "openai":
        return [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]
    if api == "anthropic":
        return [{"role": "assistant", "content": answer["content"]}]
    return [{"role": "assistant", "content": answer["output"][-1]["content"][0]["text"]}]


def test_the_budget_and_the_models_context_together(chat_sim: Service, tokenizer_dir: Any) -> None:
    """A request whose length would pass the model's context but that the session's budget cuts runs (cut), where
    a session without a budget is refused: the budget cuts before the model's context is checked."""
    env = {"GATEWAY_CHAT_CONTEXT_TOKENS": "256"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as gateway:
        uncapped = new_session(gateway, moe=False, top_p=False)
        assert post(gateway, uncapped, "anthropic", max_tokens=400).status_code == 400
        sid = f"budget-and-context-{time.monotonic_ns()}"
        assert create(gateway, sid, max_context_tokens=100).status_code == 201
        script(chat_sim, sid, LONG_ANSWER)
        response = post(gateway, sid, "anthropic", max_tokens=400)
        assert response.status_code == 200, response.text
        assert view(gateway, sid)["total_tokens"] <= 100


# ---- max_turns -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", APIS)
def test_past_the_turn_cap_a_request_is_a_429_in_the_apis_shape(
    chat_gateway: Service, chat_sim: Service, api: str
) -> None:
    sid = f"turn-cap-{api}-{time.monotonic_ns()}"
    assert create(chat_gateway, sid, max_turns=2).status_code == 201
    script(chat_sim, sid, "one", "two")
    assert post(chat_gateway, sid, api, text="first").status_code == 200
    assert post(chat_gateway, sid, api, text="another conversation").status_code == 200  # a second branch: 2 turns
    response = post(chat_gateway, sid, api, text="a third")
    assert response.status_code == 429, response.text
    kind, message = error_of(api, response)
    assert kind == "rate_limit_error" and "max_turns" in message
    if api != "anthropic":
        assert response.json()["error"]["code"] == "turn_limit_reached"
    assert len(view(chat_gateway, sid)["branches"]) == 2  # the refused request started nothing


def test_the_turn_cap_counts_turns_running_at_once(chat_gateway: Service, chat_sim: Service) -> None:
    """A session capped at three turns runs one, then three requests come at once (each a new conversation, so a
    branch of its own): exactly two of them run, the third is a 429."""
    sid = f"turn-cap-parallel-{time.monotonic_ns()}"
    assert create(chat_gateway, sid, max_turns=3).status_code == 201
    script(chat_sim, sid, "first", "a", "b", "c")
    assert post(chat_gateway, sid, "openai", text="the first conversation").status_code == 200
    statuses: list[int] = []

    def one(i: int) -> None:
        statuses.append(post(chat_gateway, sid, "openai", text=f"conversation {i}").status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(statuses) == [200, 200, 429]
    assert sum(kinds.count("model") for kinds in model_turns(chat_gateway, sid)) == 3


def model_turns(gateway: Service, sid: str) -> list[list[str]]:
    branches = view(gateway, sid)["branches"]
    return [[t["kind"] for t in view(gateway, sid, i)["turn_log"]] for i in range(len(branches))]


def test_the_view_shows_the_caps(chat_gateway: Service) -> None:
    sid = f"caps-view-{time.monotonic_ns()}"
    assert create(chat_gateway, sid, max_turns=3).status_code == 201
    state = view(chat_gateway, sid)
    assert state["limits"] == {"max_context_tokens": None, "max_turns": 3} and state["closed"] is False


def test_caps_are_checked_when_the_session_is_created(chat_gateway: Service) -> None:
    for fields in ({"max_turns": 0}, {"max_context_tokens": 0}, {"max_turns": "2"}, {"max_context_tokens": -5}):
        response = create(chat_gateway, f"bad-caps-{time.monotonic_ns()}", **fields)
        assert response.status_code == 422, (fields, response.text)


# ---- close ---------------------------------------------------------------------------------------------------------
def close(gateway: Service, sid: str, wait_timeout_s: float | None = None) -> httpx.Response:
    body = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}
    return httpx.post(f"{gateway.url}/v1/sessions/{sid}/close", json=body, timeout=60)


@pytest.mark.parametrize("api", APIS)
def test_a_closed_session_refuses_every_turn_in_the_apis_shape(
    chat_gateway: Service, chat_sim: Service, api: str
) -> None:
    sid = new_session(chat_gateway)
    script(chat_sim, sid, "before the close")
    assert post(chat_gateway, sid, api).status_code == 200
    closed = close(chat_gateway, sid)
    assert closed.status_code == 200, closed.text
    assert closed.json() | {"closed": True, "drained": True, "aborted_rids": []} == closed.json()
    before = view(chat_gateway, sid)
    assert before["closed"] is True
    response = post(chat_gateway, sid, api, text="after the close")
    assert response.status_code == 409, response.text
    kind, message = error_of(api, response)
    assert kind == "invalid_request_error" and "closed" in message
    if api != "anthropic":
        assert response.json()["error"]["code"] == "session_closed"
    # the token-level API refuses too; the session is as it was, and can still be read and deleted
    generate = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/generate", json={})
    assert generate.status_code == 409 and generate.json()["error"]["type"] == "session_closed"
    assert view(chat_gateway, sid)["total_tokens"] == before["total_tokens"]
    assert close(chat_gateway, sid).status_code == 200  # idempotent
    assert httpx.delete(f"{chat_gateway.url}/v1/sessions/{sid}").status_code == 204
    assert close(chat_gateway, sid).status_code == 404


def test_close_aborts_a_turn_that_runs_past_the_wait(chat_gateway: Service, chat_sim: Service) -> None:
    """A turn still running when the wait is over is aborted: close answers once it has ended (folded as aborted,
    its tokens coherent), so that samples read afterwards hold every turn whole."""
    sid = new_session(chat_gateway)
    assert (
        httpx.post(f"{chat_sim.url}/sim/faults", json={"mode": "delay", "delay_s": 30, "count": 1}).status_code == 200
    )
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(post(chat_gateway, sid, "openai")), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while not view(chat_gateway, sid)["busy"]:
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.02)
        closed = close(chat_gateway, sid, wait_timeout_s=0)
        assert closed.status_code == 200, closed.text
        body = closed.json()
        assert body["drained"] is True and len(body["aborted_rids"]) == 1 and body["busy"] is False
        thread.join(30)
        state = view(chat_gateway, sid)
        assert state["status"] == "aborted" and state["last_error"] == "session closed"
        arrays = sample(chat_gateway, sid)
        assert len(arrays["loss_mask"]) == state["response_length"]
        rows = arrays.get("rollout_routed_experts")  # none when the abort came before any answer
        assert rows is None or len(rows) <= len(arrays["tokens"]) - 1
    finally:
        httpx.delete(f"{chat_sim.url}/sim/faults")
        thread.join(30)


def test_close_waits_for_a_turn_that_ends_within_the_wait(chat_gateway: Service, chat_sim: Service) -> None:
    sid = new_session(chat_gateway)
    script(chat_sim, sid, "a slow but whole answer")
    assert (
        httpx.post(f"{chat_sim.url}/sim/faults", json={"mode": "delay", "delay_s": 0.5, "count": 1}).status_code == 200
    )
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(post(chat_gateway, sid, "anthropic")), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while not view(chat_gateway, sid)["busy"]:
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.02)
        closed = close(chat_gateway, sid, wait_timeout_s=30).json()
        assert closed["drained"] is True and closed["aborted_rids"] == []
        thread.join(30)
        assert answers[0].status_code == 200
        assert view(chat_gateway, sid)["status"] == "completed"
    finally:
        httpx.delete(f"{chat_sim.url}/sim/faults")


def test_close_refuses_a_bad_wait(chat_gateway: Service) -> None:
    sid = new_session(chat_gateway)
    for body in ({"wait_timeout_s": -1}, {"wait_timeout_s": "5"}, {"wait_timeout_s": 1e9}, {"wait": 1}):
        response = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/close", json=body)
        assert response.status_code == 422, (body, response.text)
    assert view(chat_gateway, sid)["total_tokens"] == 0
    assert post(chat_gateway, sid, "openai").status_code == 200  # still open: nothing was closed


# ---- slime's flags in the sample's metadata ---------------------------------------------------------------------
def test_the_sample_metadata_carries_slimes_flags_over_the_whole_conversation(
    chat_gateway: Service, chat_sim: Service
) -> None:
    from chat_checks import CALL_TEXT, FINAL_TEXT, WEATHER_TOOL, openai_chat, openai_client

    sid = new_session(chat_gateway)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT, "<tool_call>\nnot json\n</tool_call>")
    client = openai_client(chat_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    reply, finish, _ = openai_chat(client, messages, stream=False)
    assert finish == "tool_calls"
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}]
    reply, _, _ = openai_chat(client, messages, stream=False)
    # an edited history forks a branch from the model's call: the parent's call counts for the fork's use_tool
    edited = [*messages[:-1], {"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"], "content": "rain"}]
    reply, _, _ = openai_chat(client, edited, stream=False, tools=[WEATHER_TOOL])
    flags = chat_flags(chat_gateway, sid)
    assert flags == [{"use_tool": True, "ill_formed": False}, {"use_tool": True, "ill_formed": True}]
    plain = new_session(chat_gateway)
    script(chat_sim, plain, "no tools here")
    assert post(chat_gateway, plain, "openai").status_code == 200
    assert chat_flags(chat_gateway, plain) == [{"use_tool": False, "ill_formed": False}]


def group_metadata(gateway: Service, sid: str) -> list[dict[str, str]]:
    body = httpx.post(f"{gateway.url}/v1/samples", json={"session_ids": [sid]}).content
    return json.loads(read_safetensors_metadata(body)["samples"])


def chat_flags(gateway: Service, sid: str) -> list[dict[str, bool]]:
    return [json.loads(meta["chat"]) for meta in group_metadata(gateway, sid)]


def test_samples_of_a_token_session_have_no_chat_flags(gateway: Service) -> None:
    sid = f"token-{time.monotonic_ns()}"
    assert (
        httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid, "prompt_ids": [1, 2, 3]}).status_code == 201
    )
    (meta,) = group_metadata(gateway, sid)
    assert "chat" not in meta
