"""Weight updates in the middle of an agent's turn lose nothing (docs/operations/weight-updates.md).

slime's sequence, driven against the simulator while a chat turn runs: pause (SGLang's modes: abort, retract,
in_place) -> flush_cache -> a new weight version -> continue, the pause landing at an exact token (the simulator's
``hold`` fault). For every chat API, unary and streamed, the client gets the one whole answer (the eight sentences
and the tool call, ``weight_update_case``), and the session one turn, token-exact, whose weight versions show the
switch. Then the bounds (GATEWAY_RESUME_MAX, the deadline, an engine that refuses), the trainer's own aborts (the
session's abort route, the gateway-wide abort_all), the token-level opt-in, routing rows across the seam, metrics.

Runs its own simulator and gateways: the pauses and weight updates here would change what other tests' answers carry.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import orjson
import pytest
from chat_checks import (
    WEATHER_TOOL,
    check_trajectory,
    hermes_call,
    metric,
    new_session,
    openai_chat,
    sample,
    script,
    view,
)
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator
from safetensors.numpy import load as load_safetensors
from weight_update_case import (
    ANSWER,
    ANTHROPIC_TOOL,
    APIS,
    HELD_AT,
    MESSAGES,
    MODES,
    SENTENCES,
    run_case,
    update_weights,
    wait_for,
    wait_session_free,
)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from sglang_sim.tiny_tokenizer import build_tiny_chat_tokenizer

    return build_tiny_chat_tokenizer(Path(tempfile.mkdtemp(prefix="tiny-tokenizer-")))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)


@pytest.fixture(scope="module")
def sim(tiny_dir: Path) -> Iterator[Service]:
    with run_simulator("--tokenizer", str(tiny_dir)) as service:
        yield service


@pytest.fixture(scope="module")
def gateway(sim: Service, tiny_dir: Path) -> Iterator[Service]:
    with run_gateway(sim.url, "--tokenizer", str(tiny_dir), "--log-level", "warning") as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_simulator(sim: Service) -> None:
    assert httpx.post(f"{sim.url}/sim/reset").status_code == 200  # weights sim-v0, no pause, fault or script


def model_turns(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [turn for turn in state["turn_log"] if turn["kind"] == "model"]


# ---- the measured case: every API x unary/stream x pause mode ------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_a_weight_update_mid_answer_loses_nothing(
    gateway: Service, sim: Service, tiny: Any, api: str, stream: bool, mode: str
) -> None:
    outcome = run_case(gateway, sim, api, stream, mode)
    # The client: ONE answer, whole (every sentence, then the tool call parsed as one across the seam).
    assert outcome.whole, outcome.client_line()
    assert outcome.finish == {"chat": "tool_calls", "messages": "tool_use", "responses": "completed"}[api]
    # The session: ONE model turn holding every token, the rest of the answer after the update on the new weights.
    answer_tokens = len(tiny.encode(ANSWER, add_special_tokens=False)) + 1  # and the eos
    assert (outcome.status, outcome.model_turns, outcome.response_tokens) == ("completed", 1, answer_tokens)
    assert outcome.spans == [
        {"version": "sim-v0", "start": 0, "end": HELD_AT},
        {"version": "sim-v1", "start": HELD_AT, "end": answer_tokens},
    ]
    # abort mode ends the answer, and the gateway resumed it once; the other modes never end it.
    assert outcome.resumed == (1 if mode == "abort" else 0)
    sid = view_sid(gateway, api)
    check_trajectory(gateway.url, sid, tiny, [ANSWER])
    arrays = sample(gateway, sid)
    assert arrays["loss_mask"].all() and len(arrays["rollout_log_probs"]) == answer_tokens
    assert (arrays["rollout_log_probs"] < 0).all()
    assert len(arrays["rollout_routed_experts"]) == len(arrays["tokens"]) - 1  # every row, across the seam too
    offsets = arrays["rollout_top_p_token_offsets"]
    assert len(offsets) == answer_tokens + 1 and offsets[-1] == len(arrays["rollout_top_p_token_ids"])
    versions = arrays["rollout_weight_version_ids"].tolist()
    assert versions == [0] * HELD_AT + [1] * (answer_tokens - HELD_AT)


def view_sid(gateway: Service, api: str) -> str:
    """The newest session of the case just run (the case makes one per run, its id prefixed by the API)."""
    sessions = httpx.get(f"{gateway.url}/v1/sessions").json()["sessions"]
    mine = [s for s in sessions if s["session_id"].startswith(f"wu-{api}-")]
    return max(mine, key=lambda s: s["created_at"])["session_id"]


def test_the_resumed_answer_is_the_uninterrupted_one_with_the_rows_asked_incrementally(
    gateway: Service, sim: Service
) -> None:
    """The simulator's model continues its own prefix, and routes a position by its token: so a resumed turn must
    hold exactly the tokens, log-probs and routing rows of the same turn uninterrupted. The resuming request asks
    only for the rows the turn lacks (routed_experts_start_len), and keeps the ones the aborted answer brought."""
    whole = new_session(gateway, prefix="whole")
    script(sim, whole, ANSWER)
    openai_chat(chat_client(gateway, whole), MESSAGES, stream=False, seed=5)
    resumed_sid = new_session(gateway, prefix="resumed")
    script(sim, resumed_sid, ANSWER)
    httpx.delete(f"{sim.url}/sim/requests")
    held(sim)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(openai_chat, chat_client(gateway, resumed_sid), MESSAGES, stream=True, seed=5)
        wait_for(sim, held=1)
        update_weights(sim, "abort", "sim-v1")
        message, finish, _ = pending.result(timeout=60)
    assert finish == "tool_calls" and message["content"].strip() == SENTENCES
    a, b = sample(gateway, whole), sample(gateway, resumed_sid)
    for name in ("tokens", "loss_mask", "rollout_log_probs", "rollout_routed_experts"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    requests = [entry["body"] for entry in httpx.get(f"{sim.url}/sim/requests").json()]
    first, again = requests[-2], requests[-1]
    prompt = first["input_len"]
    assert again["input_len"] == prompt + HELD_AT and again["rid"] == f"{first['rid']}-r1"
    assert again["routed_experts_start_len"] == prompt + HELD_AT - 1  # the rows the aborted answer brought
    assert again["sampling_params"]["max_new_tokens"] == first["sampling_params"]["max_new_tokens"] - HELD_AT


def chat_client(gateway: Service, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="unused", max_retries=0, timeout=60)


def held(sim: Service, after_tokens: int = HELD_AT, count: int = 1) -> None:
    fault = {"mode": "hold", "after_tokens": after_tokens, "count": count}
    assert httpx.post(f"{sim.url}/sim/faults", json=fault).status_code == 200


def pause(sim: Service, mode: str = "abort") -> None:
    assert httpx.post(f"{sim.url}/pause_generation", json={"mode": mode}, timeout=30).status_code == 200


def resume_engine(sim: Service) -> None:
    assert httpx.post(f"{sim.url}/continue_generation").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_tool_call_across_the_seam_is_parsed_as_one(gateway: Service, sim: Service, tiny: Any, stream: bool) -> None:
    """The update lands inside the tool call's JSON: the parser only ever sees the joined text."""
    inside_call = len(tiny.encode(f'{SENTENCES}\n<tool_call>\n{{"name": "get_', add_special_tokens=False))
    sid = new_session(gateway, prefix="seam")
    script(sim, sid, ANSWER)
    held(sim, inside_call)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(openai_chat, chat_client(gateway, sid), MESSAGES, stream=stream)
        wait_for(sim, held=1)
        update_weights(sim, "abort", "sim-v1")
        message, finish, _ = pending.result(timeout=60)
    assert finish == "tool_calls"
    assert [(c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert model_turns(wait_session_free(gateway, sid))[-1]["resumed"] == 1
    check_trajectory(gateway.url, sid, tiny, [ANSWER])


def test_a_reasoning_block_across_the_seam_is_one(sim: Service, tiny_dir: Path, tiny: Any) -> None:
    thinking = "<think>\nThe user wants the weather, so I will call the tool for Paris.\n</think>\n\n"
    answer = f"{thinking}Let me check.\n{hermes_call('get_weather', {'city': 'Paris'})}"
    env = {"GATEWAY_CHAT_REASONING_PARSER": "qwen3"}
    with run_gateway(sim.url, "--tokenizer", str(tiny_dir), "--log-level", "warning", env=env) as reasoning:
        sid = new_session(reasoning, prefix="think")
        script(sim, sid, answer)
        held(sim, 8)  # inside the reasoning
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(openai_chat, chat_client(reasoning, sid), MESSAGES, stream=True)
            wait_for(sim, held=1)
            update_weights(sim, "abort", "sim-v1")
            message, finish, _ = pending.result(timeout=60)
        assert message["reasoning_content"] == "The user wants the weather, so I will call the tool for Paris."
        assert message["content"].strip() == "Let me check." and finish == "tool_calls"
        state = wait_session_free(reasoning, sid)
        assert model_turns(state)[-1]["resumed"] == 1 and state["status"] == "completed"


# ---- bounds: honest errors in each API's shape, the session keeping what was generated -----------------------------
@pytest.fixture(scope="module")
def strict_gateway(sim: Service, tiny_dir: Path) -> Iterator[Service]:
    """At most one resume per turn, and a short deadline."""
    env = {"GATEWAY_RESUME_MAX": "1", "GATEWAY_REQUEST_TIMEOUT_S": "4"}
    with run_gateway(sim.url, "--tokenizer", str(tiny_dir), "--log-level", "warning", env=env) as service:
        yield service


def call_api(gateway: Service, sid: str, api: str, stream: bool) -> Any:
    base = f"{gateway.url}/v1/sessions/{sid}"
    if api == "messages":
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)
        kwargs = {"model": "tiny", "max_tokens": 512, "messages": MESSAGES, "tools": [ANTHROPIC_TOOL]}
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as events:
            return events.get_final_message()
    if api == "responses":
        client_o = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        if not stream:
            return client_o.responses.create(model="tiny", input=MESSAGES)
        return [event.type for event in client_o.responses.create(model="tiny", input=MESSAGES, stream=True)]
    return openai_chat(chat_client(gateway, sid), MESSAGES, stream=stream)


def assert_error_in_shape(api: str, stream: bool, outcome: Any, error_type: str) -> None:
    """A 503-class error the API's clients retry, naming the gateway's error type; never a finished answer."""
    if api == "responses" and stream:
        assert isinstance(outcome, list) and outcome[-1] == "response.failed", outcome
        return
    assert isinstance(outcome, openai.APIError | anthropic.APIError), outcome
    if api == "messages":
        # unary: the 503's body; streamed: the in-band error event, which the SDK raises as a status error
        assert isinstance(outcome, anthropic.APIStatusError), outcome
        if not stream:
            assert outcome.status_code == 503
        body = outcome.body
        assert body["error"]["type"] == "overloaded_error" and body["error"]["gateway_type"] == error_type, body
        return
    if not stream:
        assert isinstance(outcome, openai.InternalServerError) and outcome.status_code == 503
        body = outcome.body
        assert body["code"] == error_type, body
    else:
        assert error_type in str(outcome.body or outcome.message), outcome


def run_to_outcome(gateway: Service, sid: str, api: str, stream: bool, drive: Any) -> Any:
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call_api, gateway, sid, api, stream)
        drive()
        try:
            return pending.result(timeout=60)
        except (openai.APIError, anthropic.APIError) as exc:
            return exc


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_past_resume_max_the_client_gets_an_error_and_the_session_keeps_every_token(
    strict_gateway: Service, sim: Service, api: str, stream: bool
) -> None:
    sid = new_session(strict_gateway, prefix=f"max-{api}")
    script(sim, sid, ANSWER)
    held(sim, HELD_AT, count=2)  # the first answer and its resumption both stop at token 49

    def two_updates() -> None:
        wait_for(sim, held=1)
        pause(sim)
        wait_for(sim, waiting=1)  # the resumption waits out the pause
        resume_engine(sim)
        wait_for(sim, held=1)
        pause(sim)  # the second abort: past GATEWAY_RESUME_MAX=1
        resume_engine(sim)

    outcome = run_to_outcome(strict_gateway, sid, api, stream, two_updates)
    assert_error_in_shape(api, stream, outcome, "turn_interrupted")
    state = wait_session_free(strict_gateway, sid)
    (turn,) = model_turns(state)
    assert (state["status"], turn["resumed"], turn["num_tokens"]) == ("aborted", 1, 2 * HELD_AT)
    assert state["chat"]["messages"][-1]["role"] == "assistant"  # recorded, so a retry forks before it
    if not stream and api != "responses":
        body = outcome.body if api == "chat" else outcome.body["error"]
        assert "GATEWAY_RESUME_MAX=1" in body["message"], body


def test_an_engine_that_refuses_the_resumption_is_retried_until_the_deadline(
    strict_gateway: Service, sim: Service
) -> None:
    """Not SGLang (it holds requests while paused): an engine answering 503 to the resubmission is asked again until
    the turn's deadline (GATEWAY_REQUEST_TIMEOUT_S), then the client gets 503 turn_interrupted."""
    sid = new_session(strict_gateway, prefix="refused")
    script(sim, sid, ANSWER)
    held(sim)

    def refuse() -> None:
        wait_for(sim, held=1)
        assert httpx.post(f"{sim.url}/sim/faults", json={"mode": "http_503", "count": -1}).status_code == 200
        pause(sim)
        resume_engine(sim)

    started = time.monotonic()
    outcome = run_to_outcome(strict_gateway, sid, "chat", False, refuse)
    assert_error_in_shape("chat", False, outcome, "turn_interrupted")
    assert outcome.body["message"].startswith("the engine aborted the turn and refused")
    assert time.monotonic() - started < 20  # within the deadline (4 s), not forever
    refused = [e for e in httpx.get(f"{sim.url}/sim/requests").json() if e["body"]["rid"].endswith("-r1")]
    assert len(refused) >= 2  # asked again after a pause
    httpx.delete(f"{sim.url}/sim/faults")
    (turn,) = model_turns(wait_session_free(strict_gateway, sid))
    assert turn["num_tokens"] == HELD_AT and turn["finish_reason"]["type"] == "abort"


# ---- the trainer ends turns on purpose: never resumed, an honest error -------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_the_gateway_wide_abort_all_ends_chat_turns_without_resume(
    gateway: Service, sim: Service, api: str, stream: bool
) -> None:
    """slime's end of a rollout: ``/abort_request {"abort_all": true}`` to its router URL, the gateway's."""
    sid = new_session(gateway, prefix=f"all-{api}")
    script(sim, sid, ANSWER)
    held(sim)

    def abort_all() -> None:
        wait_for(sim, held=1)
        answer = httpx.post(f"{gateway.url}/abort_request", json={"abort_all": True}, timeout=30)
        assert answer.status_code == 200  # forwarded: the simulator ends its answers too

    outcome = run_to_outcome(gateway, sid, api, stream, abort_all)
    assert_error_in_shape(api, stream, outcome, "turn_aborted")
    state = wait_session_free(gateway, sid)
    (turn,) = model_turns(state)
    assert (state["status"], turn["resumed"], turn["num_tokens"]) == ("aborted", 0, HELD_AT)
    stats = httpx.get(f"{sim.url}/sim/stats").json()
    assert (stats["resumed"], stats["requests"]) == (0, 1)  # nothing was sent again


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_sessions_abort_route_is_an_error_for_the_chat_client(gateway: Service, sim: Service, stream: bool) -> None:
    sid = new_session(gateway, prefix="route")
    script(sim, sid, ANSWER)
    held(sim)

    def abort() -> None:
        wait_for(sim, held=1)
        assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/abort", timeout=30).json()["aborted"] is True

    outcome = run_to_outcome(gateway, sid, "messages", stream, abort)
    assert_error_in_shape("messages", stream, outcome, "turn_aborted")
    state = wait_session_free(gateway, sid)
    assert state["status"] == "aborted" and model_turns(state)[0]["resumed"] == 0


def test_a_client_that_left_is_not_resumed(gateway: Service, sim: Service) -> None:
    """The gateway aborts the turn of a client that left: the engine's abort answer is its own doing, not resumed."""
    sid = new_session(gateway, prefix="gone")
    script(sim, sid, ANSWER)
    held(sim)
    body = {"messages": MESSAGES, "stream": True, "tools": [WEATHER_TOOL]}
    with httpx.stream("POST", f"{gateway.url}/v1/sessions/{sid}/chat/completions", json=body, timeout=30) as reply:
        for line in reply.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                break  # a delta came: the turn runs; the client leaves
    state = wait_session_free(gateway, sid)
    (turn,) = model_turns(state)
    assert state["status"] == "aborted" and turn["resumed"] == 0 and 0 < turn["num_tokens"] <= HELD_AT
    stats = httpx.get(f"{sim.url}/sim/stats").json()
    assert (stats["resumed"], stats["requests"], stats["aborted"]) == (0, 1, 1)


# ---- the token-level API: opt-in, off by default ----------------------------------------------------------------
def token_session(gateway: Service, **extra: Any) -> str:
    body = {"prompt_ids": [5, 6, 7, 8, 9], "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    body["sampling_defaults"] = {"custom_params": {"return_top_p_token_ids": True}}
    response = httpx.post(f"{gateway.url}/v1/sessions", json=body | extra)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


TOKEN_TURN = {"sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 9}}


def token_turn(gateway: Service, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    if not body.get("stream"):
        response = httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()
    events = []
    with httpx.stream("POST", f"{gateway.url}/v1/sessions/{sid}/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line[6:]))
    deltas = [t for e in events if e["type"] == "delta" for t in e["token_ids"]]
    assert events[-1]["type"] == "turn" and deltas == events[-1]["new_token_ids"]  # nothing repeated or missing
    return events[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("where", ["request", "session"])
def test_a_token_level_turn_resumes_when_asked(gateway: Service, sim: Service, stream: bool, where: str) -> None:
    whole_sid = token_session(gateway)
    whole = token_turn(gateway, whole_sid, TOKEN_TURN)
    sid = token_session(gateway, resume=True) if where == "session" else token_session(gateway)
    body = TOKEN_TURN | {"stream": stream} | ({"resume": True} if where == "request" else {})
    held(sim, 13)
    resumes = metric(gateway, 'gateway_turn_resumes_total{mode="%s"}' % ("stream" if stream else "unary"))
    carried = metric(gateway, "gateway_resumed_tokens_total")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(token_turn, gateway, sid, body)
        wait_for(sim, held=1)
        update_weights(sim, "abort", "sim-v1")
        summary = pending.result(timeout=60)
    assert summary["new_token_ids"] == whole["new_token_ids"] and summary["status"] == "truncated"
    assert summary["resumed"] == 1 and summary["finish_reason"] == {"type": "length", "length": 40 - 13}
    assert summary["routed_experts_rows"] == 5 + 40 - 1
    turn = model_turns(view(gateway, sid))[-1]
    assert turn["weight_version_spans"] == [
        {"version": "sim-v0", "start": 0, "end": 13},
        {"version": "sim-v1", "start": 13, "end": 40},
    ]
    a, b = sample(gateway, whole_sid), sample(gateway, sid)
    for name in ("tokens", "rollout_log_probs", "rollout_routed_experts", "loss_mask"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert metric(gateway, 'gateway_turn_resumes_total{mode="%s"}' % ("stream" if stream else "unary")) == resumes + 1
    assert metric(gateway, "gateway_resumed_tokens_total") == carried + 13


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_token_level_turn_is_not_resumed_by_default(gateway: Service, sim: Service, stream: bool) -> None:
    """The slime drop-in: its own partial rollout resumes an aborted sample, so nothing changes for it."""
    sid = token_session(gateway)
    held(sim, 13)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(token_turn, gateway, sid, TOKEN_TURN | {"stream": stream})
        wait_for(sim, held=1)
        update_weights(sim, "abort", "sim-v1")
        summary = pending.result(timeout=60)
    assert summary["status"] == "aborted" and len(summary["new_token_ids"]) == 13 and summary["resumed"] == 0
    assert summary["interrupted"]["type"] == "turn_interrupted" and summary["interrupted"]["reason"] == "off"
    assert httpx.get(f"{sim.url}/sim/stats").json()["resumed"] == 0


def test_the_turn_tensors_of_a_resumed_turn_are_the_whole_turns(gateway: Service, sim: Service) -> None:
    """``Accept: application/vnd.safetensors``: a resumed turn's own tensors cover all of it, rows included."""
    sid = token_session(gateway)
    held(sim, 13)
    headers = {"accept": "application/vnd.safetensors"}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post,
            f"{gateway.url}/v1/sessions/{sid}/generate",
            json=TOKEN_TURN | {"resume": True},
            headers=headers,
            timeout=60,
        )
        wait_for(sim, held=1)
        update_weights(sim, "abort", "sim-v1")
        response = pending.result(timeout=60)
    tensors = load_safetensors(response.content)
    assert len(tensors["tokens"]) == 40 and len(tensors["rollout_routed_experts"]) == 40 + 5 - 1
    assert tensors["rollout_weight_version_ids"].tolist() == [0] * 13 + [1] * 27


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("when", ["waiting", "refused"])
def test_an_abort_between_the_requests_of_a_resumed_turn_keeps_the_first_answer_once(
    gateway: Service, sim: Service, stream: bool, when: str
) -> None:
    """The engine aborted the answer; its resumption waits out the pause (or is refused and about to be sent again)
    when the trainer aborts the session: the turn ends there, its first answer's tokens kept exactly once."""
    sid = new_session(gateway, prefix=f"between-{when}")
    script(sim, sid, ANSWER)
    held(sim)

    def abort_between() -> None:
        wait_for(sim, held=1)
        if when == "refused":
            assert httpx.post(f"{sim.url}/sim/faults", json={"mode": "http_503", "count": -1}).status_code == 200
            pause(sim)
            resume_engine(sim)
            deadline = time.monotonic() + 30
            while not any(e["body"]["rid"].endswith("-r1") for e in httpx.get(f"{sim.url}/sim/requests").json()):
                assert time.monotonic() < deadline, "the resumption was never sent"
                time.sleep(0.01)
        else:
            pause(sim)
            wait_for(sim, waiting=1)
        assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/abort", timeout=30).json()["aborted"] is True

    outcome = run_to_outcome(gateway, sid, "chat", stream, abort_between)
    httpx.delete(f"{sim.url}/sim/faults")
    resume_engine(sim)
    assert_error_in_shape("chat", stream, outcome, "turn_aborted")
    state = wait_session_free(gateway, sid)
    (turn,) = model_turns(state)
    assert (turn["num_tokens"], turn["resumed"], state["status"]) == (HELD_AT, 1, "aborted")
    arrays = sample(gateway, sid)
    assert len(arrays["loss_mask"]) == HELD_AT and len(arrays["rollout_routed_experts"]) == len(arrays["tokens"]) - 1
