"""slime_client.GatewayClient: end to end against the real gateway + simulator, and retries on a MockTransport."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import torch
from conftest import SIM_LAYERS, SIM_TOPK, Service
from procs import free_port

from slime_client import (
    BadRequestError,
    ConflictError,
    GatewayClient,
    GatewayConnectionError,
    GatewayError,
    GatewayResponseError,
    GatewayStatusError,
    GatewayTimeout,
    GatewayTimeoutError,
    MoEShape,
    NotFoundError,
    RolloutSample,
    ServiceUnavailableError,
    Session,
    UpstreamError,
    _retry,
)
from slime_client.errors import make_status_error

PROMPT = [11, 12, 13, 14, 15, 16, 17]
TOOL = [900, 901, 902, 903]
TOP_P = {"custom_params": {"return_top_p_token_ids": True}}


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the backoff schedule's shape but make it milliseconds, so retry tests stay fast."""
    monkeypatch.setattr(_retry, "INITIAL_RETRY_DELAY_S", 0.001)


@pytest.fixture
async def gw(gateway: Service) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(gateway.url, timeout=30) as client:
        yield client


@pytest.fixture
async def sim(simulator: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=simulator.url, timeout=30) as client:
        yield client


async def moe_session(gw: GatewayClient, prompt: list[int] = PROMPT, **extra: Any) -> Session:
    return await gw.create_session(prompt_ids=prompt, num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK, **extra)


async def generate_requests(sim: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    """The /generate calls the simulator received for a session (the gateway's rids start with its id)."""
    log = (await sim.get("/sim/requests")).json()
    return [r for r in log if str((r["body"] or {}).get("rid", "")).startswith(f"{session_id}-")]


def pool_connections(client: httpx.AsyncClient) -> list[Any]:
    return list(client._transport._pool.connections)  # type: ignore[attr-defined]


# ---- sessions end to end ------------------------------------------------------------------------------------------
async def test_multi_turn_session_with_tool_turns(gw: GatewayClient) -> None:
    session = await moe_session(gw, metadata={"task": "agent"}, sampling_defaults={"temperature": 0.7})
    assert session.summary is not None and session.summary.prompt_length == len(PROMPT)

    first = await session.generate({"max_new_tokens": 12, **TOP_P})
    assert first.session_id == session.session_id
    assert first.prompt_length == len(PROMPT)
    assert first.completion_tokens == len(first.new_token_ids) > 0
    assert first.routed_experts_start_len == 0
    assert first.routed_experts_rows == len(PROMPT) + first.completion_tokens - 1
    assert first.top_p_replay is True
    assert first.finish_type in {"stop", "length"}

    appended = await session.append(torch.tensor(TOOL), text=" <tool>")  # tensors are accepted as token ids
    assert appended.total_tokens == len(PROMPT) + first.completion_tokens + len(TOOL)

    second = await session.generate({"max_new_tokens": 9})
    assert second.prompt_length == appended.total_tokens
    assert second.routed_experts_start_len == first.routed_experts_rows  # incremental replay
    assert second.response_length == first.completion_tokens + len(TOOL) + second.completion_tokens

    sample = await session.fetch()
    sample.check_invariants()
    n1, n2 = first.completion_tokens, second.completion_tokens
    assert sample.tokens.tolist() == PROMPT + first.new_token_ids + TOOL + second.new_token_ids
    assert sample.tokens.dtype == torch.int32
    assert sample.loss_mask.tolist() == [1] * n1 + [0] * len(TOOL) + [1] * n2
    assert len(sample.rollout_log_probs) == sample.response_length == n1 + len(TOOL) + n2
    assert (sample.rollout_log_probs[n1 : n1 + len(TOOL)] == 0).all()
    offsets = sample.rollout_top_p_token_offsets
    assert offsets is not None and sample.rollout_top_p_token_ids is not None
    assert len(offsets) == sample.response_length + 1
    assert int(offsets[-1]) == len(sample.rollout_top_p_token_ids)
    assert (offsets.diff()[n1 : n1 + len(TOOL)] == 0).all()  # tool tokens carry empty kept sets
    routing = sample.rollout_routed_experts
    assert routing is not None and routing.dtype == torch.uint8
    assert tuple(routing.shape) == (len(sample.tokens) - 1, SIM_LAYERS, SIM_TOPK)
    assert sample.response == first.text + " <tool>" + second.text
    assert sample.status == second.status
    assert sample.weight_versions == [first.weight_version, second.weight_version]
    assert sample.prompt_tokens == first.prompt_tokens + second.prompt_tokens
    assert sample.cached_tokens == first.cached_tokens + second.cached_tokens
    assert sample.metadata == {"task": "agent"}
    assert (sample.num_layers, sample.moe_router_topk) == (SIM_LAYERS, SIM_TOPK)
    assert sample.turns == 3

    state = await session.state(full=True)
    assert state.full is not None
    assert state.moe == MoEShape(SIM_LAYERS, SIM_TOPK)
    assert state.total_tokens == len(sample.tokens)
    assert state.arrays["rollout_routed_experts"].shape == tuple(routing.shape)
    assert state.weight_versions == sample.weight_versions
    assert state.response == sample.response
    assert state.last_tokens == sample.tokens[-len(state.last_tokens) :].tolist()
    for name in ("tokens", "loss_mask", "rollout_top_p_token_ids", "rollout_top_p_token_offsets"):
        assert state.full[name] == getattr(sample, name).tolist(), name
    assert state.full["rollout_routed_experts"] == routing.tolist()
    assert torch.equal(torch.tensor(state.full["rollout_log_probs"], dtype=torch.float32), sample.rollout_log_probs)
    assert [entry["kind"] for entry in state.turn_log] == ["model", "tool", "model"]


async def test_state_keeps_unknown_keys_in_raw(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT)
    state = await session.state()
    assert state.moe is None
    assert "session_id" not in state.raw  # known keys are fields, not raw
    assert state.stored_bytes > 0


async def test_reattach_to_existing_session(gw: GatewayClient) -> None:
    created = await moe_session(gw)
    await created.generate({"max_new_tokens": 5})
    attached = await gw.session(created.session_id)
    assert (await attached.state()).turns == 1
    turn = await attached.generate({"max_new_tokens": 5})
    assert turn.turn == 1


async def test_group_fetch_equals_individual_fetches(gw: GatewayClient) -> None:
    sessions = [await moe_session(gw, prompt=[20 + i, 30, 40]) for i in range(3)]
    plain = await gw.create_session(prompt_ids=[7, 8, 9])  # no routing, no top-p: fields differ per sample
    sessions.append(plain)
    for i, session in enumerate(sessions):
        await session.generate({"max_new_tokens": 4 + i, **(TOP_P if i == 0 else {})})
    ids = [s.session_id for s in reversed(sessions)]  # not creation order: the answer follows the request
    group = await gw.fetch_samples(ids)
    singles = [await gw_session.fetch() for gw_session in reversed(sessions)]
    assert [s.session_id for s in group] == ids
    for together, alone in zip(group, singles, strict=True):
        assert_same_sample(together, alone)
    assert group[0].rollout_routed_experts is None and group[-1].rollout_top_p_token_ids is not None
    assert await gw.fetch_samples([]) == []


def assert_same_sample(a: RolloutSample, b: RolloutSample) -> None:
    for name in RolloutSample.__dataclass_fields__:
        left, right = getattr(a, name), getattr(b, name)
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            assert left is not None and right is not None and torch.equal(left, right), name
            assert left.dtype == right.dtype, name
        else:
            assert left == right, name


async def test_delete_then_unknown(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT)
    await session.delete()
    with pytest.raises(NotFoundError):
        await session.state()
    with pytest.raises(NotFoundError):
        await session.delete()  # nothing was retried, so a 404 is a real "not there"


async def test_health_and_list(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT)
    health = await gw.health()
    assert health["status"] == "ok" and health["instance_id"]
    assert session.session_id in {s.session_id for s in await gw.list_sessions()}


# ---- error mapping end to end ---------------------------------------------------------------------------------
async def test_unknown_session_is_not_found(gw: GatewayClient) -> None:
    with pytest.raises(NotFoundError) as caught:
        await gw.session("no-such-session")
    error = caught.value
    assert error.status == 404
    assert error.error_type == "session_not_found"
    assert error.details == {"session_id": "no-such-session"}
    assert "no-such-session" in error.message


async def test_duplicate_session_id_is_conflict(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT, session_id="dup-client-test")
    with pytest.raises(ConflictError) as caught:
        await gw.create_session(prompt_ids=PROMPT, session_id=session.session_id)
    assert caught.value.status == 409
    assert caught.value.error_type == "session_exists"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_ids": []},
        {"prompt_ids": [1, -2]},
        {"prompt_ids": [1], "num_layers": 4},  # half a MoE shape
        {"prompt_ids": [1], "session_id": "has spaces"},
    ],
)
async def test_bad_create_is_bad_request(gw: GatewayClient, kwargs: dict[str, Any]) -> None:
    with pytest.raises(BadRequestError) as caught:
        await gw.create_session(**kwargs)
    assert caught.value.status == 422
    assert caught.value.error_type == "invalid_request"


async def test_routing_on_plain_session_is_bad_request(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT)
    with pytest.raises(BadRequestError):
        await session.generate({"max_new_tokens": 3}, return_routed_experts=True)


@pytest.mark.parametrize(("fault", "error_type"), [("bad_base64", None), ("drop_routing", "replay_data_dropped")])
async def test_invalid_upstream_answer_is_upstream_error(
    gw: GatewayClient, sim: httpx.AsyncClient, sim_faults: Callable[..., Any], fault: str, error_type: str | None
) -> None:
    session = await moe_session(gw)
    before = await session.fetch()
    await sim_faults(fault)
    with pytest.raises(UpstreamError) as caught:
        await session.generate({"max_new_tokens": 6})
    assert caught.value.status == 502
    if error_type:
        assert caught.value.error_type == error_type
    assert len(await generate_requests(sim, session.session_id)) == 1  # a 502 turn is never resubmitted
    assert_same_sample(await session.fetch(), before)  # the failed turn left the session as it was


async def test_gateway_down_is_connection_error_after_retries() -> None:
    attempts = 0

    async def count(request: httpx.Request) -> None:
        nonlocal attempts
        attempts += 1

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with httpx.AsyncClient(event_hooks={"request": [count]}) as http:
        gw = GatewayClient(url, max_retries=2, http_client=http)
        with pytest.raises(GatewayConnectionError) as caught:
            await gw.create_session(prompt_ids=PROMPT)
    assert attempts == 3
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


async def test_503_turn_is_retried_and_succeeds(
    gw: GatewayClient, sim: httpx.AsyncClient, sim_faults: Callable[..., Any]
) -> None:
    session = await moe_session(gw)
    await sim_faults("http_503")
    turn = await session.generate({"max_new_tokens": 6})
    assert turn.turn == 0 and turn.completion_tokens > 0  # one turn folded, not two
    assert len(await generate_requests(sim, session.session_id)) == 2


async def test_503_until_retries_run_out(gw: GatewayClient, sim_faults: Callable[..., Any]) -> None:
    session = await moe_session(gw)
    await sim_faults("http_503", count=gw.max_retries + 1)
    with pytest.raises(ServiceUnavailableError) as caught:
        await session.generate({"max_new_tokens": 6})
    assert caught.value.status == 503
    assert (await session.state()).turns == 0


async def test_gateway_504_on_generate_is_not_retried(
    start_gateway: Any, simulator: Service, sim: httpx.AsyncClient, sim_faults: Callable[..., Any]
) -> None:
    with start_gateway(simulator.url, "--request-timeout-s", "0.3") as slow:
        async with GatewayClient(slow.url) as gw:
            session = await moe_session(gw)
            await sim_faults("delay", delay_s=1.0)
            with pytest.raises(GatewayTimeout) as caught:
                await session.generate({"max_new_tokens": 4})
            assert caught.value.status == 504
            assert len(await generate_requests(sim, session.session_id)) == 1


async def test_client_read_timeout_on_generate_is_not_retried(
    gateway: Service, sim: httpx.AsyncClient, sim_faults: Callable[..., Any]
) -> None:
    async with GatewayClient(gateway.url, timeout=httpx.Timeout(0.3, connect=5.0)) as gw:
        session = await moe_session(gw)
        await sim_faults("delay", delay_s=1.0)
        with pytest.raises(GatewayTimeoutError):
            await session.generate({"max_new_tokens": 4})
    await asyncio.sleep(1.0)  # the gateway still runs (and folds) the turn the client gave up on
    assert len(await generate_requests(sim, session.session_id)) == 1


# ---- connections -------------------------------------------------------------------------------------------------
async def test_no_connection_left_busy_after_failures_and_pool_closed(gateway: Service) -> None:
    async with GatewayClient(gateway.url) as gw:
        session = await gw.create_session(prompt_ids=PROMPT)
        for failing in (gw.session("missing"), session.generate({}, return_routed_experts=True)):
            with pytest.raises(GatewayStatusError):
                await failing
        await session.fetch()
        connections = pool_connections(gw._http)
        assert connections and all(c.is_idle() for c in connections)  # every response was read and released
    assert gw.is_closed
    assert pool_connections(gw._http) == []


async def test_user_http_client_is_not_closed(gateway: Service) -> None:
    async with httpx.AsyncClient() as http:
        async with GatewayClient(gateway.url, http_client=http) as gw:
            await gw.health()
        assert not http.is_closed
        assert (await http.get(f"{gateway.url}/health")).status_code == 200


# ---- retry policy on a MockTransport ----------------------------------------------------------------------------
class Script:
    """A MockTransport handler that plays a list of outcomes (exception classes or responses) and counts calls."""

    def __init__(self, *outcomes: type[httpx.HTTPError] | httpx.Response) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(outcome, type):
            raise outcome("scripted failure", request=request)
        return outcome

    def client(self, **kwargs: Any) -> GatewayClient:
        http = httpx.AsyncClient(transport=httpx.MockTransport(self))
        return GatewayClient("http://gateway.test", http_client=http, **kwargs)


TURN = httpx.Response(200, json={"session_id": "s", "new_token_ids": [1, 2], "completion_tokens": 2})
STATE = httpx.Response(200, json={"session_id": "s", "total_tokens": 3})


def error(status: int, error_type: str = "x") -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": error_type, "message": f"status {status}"}})


async def test_connect_errors_before_sending_are_retried_for_generate() -> None:
    script = Script(httpx.ConnectError, httpx.ConnectTimeout, TURN)
    turn = await Session(script.client(), "s").generate({"max_new_tokens": 2})
    assert turn.new_token_ids == [1, 2]
    assert len(script.calls) == 3


async def test_503_then_success_is_retried() -> None:
    script = Script(error(503, "upstream_unavailable"), TURN)
    await Session(script.client(), "s").generate({})
    assert len(script.calls) == 2


@pytest.mark.parametrize(
    ("failure", "raised"),
    [
        (httpx.ReadTimeout, GatewayTimeoutError),
        (httpx.ReadError, GatewayConnectionError),
        (httpx.RemoteProtocolError, GatewayConnectionError),
        (error(502), UpstreamError),
        (error(504), GatewayTimeout),
    ],
)
async def test_maybe_ran_turns_are_never_resubmitted(
    failure: type[httpx.HTTPError] | httpx.Response, raised: type[GatewayError]
) -> None:
    for call in ("generate", "append"):
        script = Script(failure, TURN)
        session = Session(script.client(), "s")
        with pytest.raises(raised):
            await (session.generate({}) if call == "generate" else session.append([1]))
        assert len(script.calls) == 1, call


@pytest.mark.parametrize("failure", [httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError, error(502)])
async def test_reads_are_retried_on_more(failure: type[httpx.HTTPError] | httpx.Response) -> None:
    script = Script(failure, STATE)
    state = await Session(script.client(), "s").state()
    assert state.total_tokens == 3
    assert len(script.calls) == 2


async def test_retries_are_bounded_and_chain_the_cause() -> None:
    script = Script(httpx.ConnectError)
    with pytest.raises(GatewayConnectionError) as caught:
        await Session(script.client(max_retries=1), "s").state()
    assert len(script.calls) == 2
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


async def test_max_retries_zero_sends_once() -> None:
    script = Script(error(503), TURN)
    with pytest.raises(ServiceUnavailableError):
        await Session(script.client(max_retries=0), "s").generate({})
    assert len(script.calls) == 1


async def test_bad_requests_and_conflicts_are_not_retried() -> None:
    for status in (400, 404, 409, 422, 500):
        script = Script(error(status), STATE)
        with pytest.raises(GatewayStatusError):
            await Session(script.client(), "s").state()
        assert len(script.calls) == 1, status


async def test_delete_retried_after_lost_answer_counts_404_as_done() -> None:
    script = Script(httpx.ReadError, error(404, "session_not_found"))
    await Session(script.client(), "s").delete()
    assert [r.method for r in script.calls] == ["DELETE", "DELETE"]


async def test_request_body_and_path() -> None:
    script = Script(httpx.Response(201, json={"session_id": "a/b", "prompt_length": 2}))
    session = await script.client().create_session(prompt_ids=[1, 2], session_id="a/b", metadata={"k": 1})
    request = script.calls[0]
    assert request.url.path == "/v1/sessions"
    assert request.headers["content-type"] == "application/json"
    assert httpx.Response(200, content=request.content).json() == {
        "prompt_ids": [1, 2],
        "session_id": "a/b",
        "metadata": {"k": 1},
    }
    assert session._path == "/v1/sessions/a%2Fb"  # ids are quoted into the path


async def test_unreadable_success_answers_are_response_errors() -> None:
    not_json = httpx.Response(200, content=b"<html>proxy</html>")
    with pytest.raises(GatewayResponseError):
        await Session(Script(not_json).client(), "s").state()
    wrong_type = httpx.Response(200, json={"not": "safetensors"})
    with pytest.raises(GatewayResponseError):
        await Session(Script(wrong_type).client(), "s").fetch()
    garbage = httpx.Response(200, content=b"\x00" * 16, headers={"content-type": "application/vnd.safetensors"})
    with pytest.raises(GatewayResponseError):
        await Session(Script(garbage).client(), "s").fetch()
    missing_id = httpx.Response(200, json={"status": "pending"})
    with pytest.raises(GatewayResponseError):
        await Session(Script(missing_id).client(), "s").state()


# ---- pure pieces --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, BadRequestError),
        (422, BadRequestError),
        (404, NotFoundError),
        (409, ConflictError),
        (502, UpstreamError),
        (503, ServiceUnavailableError),
        (504, GatewayTimeout),
        (429, GatewayStatusError),
        (500, GatewayStatusError),
    ],
)
def test_make_status_error_maps_status_to_class(status: int, error_class: type[GatewayStatusError]) -> None:
    body = {"error": {"type": "some_type", "message": "what happened", "session_id": "s1"}}
    exc = make_status_error(httpx.Response(status, json=body))
    assert type(exc) is error_class
    assert (exc.status, exc.error_type, exc.message, exc.body) == (status, "some_type", "what happened", body)
    assert exc.details == {"session_id": "s1"}


def test_make_status_error_without_gateway_body() -> None:
    exc = make_status_error(httpx.Response(502, text="Bad Gateway from nginx"))
    assert isinstance(exc, UpstreamError)
    assert exc.error_type is None and exc.message == "Bad Gateway from nginx" and exc.details == {}


def test_retry_delay_grows_caps_and_jitters() -> None:
    no_jitter = [_retry.retry_delay(a, rand=lambda: 0.0) for a in range(16)]
    assert no_jitter[:3] == [_retry.INITIAL_RETRY_DELAY_S * f for f in (1, 2, 4)]
    assert max(no_jitter) == _retry.MAX_RETRY_DELAY_S
    full_jitter = _retry.retry_delay(1, rand=lambda: 1.0)
    assert full_jitter == pytest.approx(no_jitter[1] * (1 - _retry.JITTER_FRACTION))


def test_retry_rules() -> None:
    request = httpx.Request("POST", "http://x")
    for exc in (httpx.ConnectError("x", request=request), httpx.PoolTimeout("x", request=request)):
        assert _retry.retryable_error(exc, idempotent=False)
        assert not _retry.may_have_arrived(exc)
    for exc in (httpx.ReadTimeout("x", request=request), httpx.RemoteProtocolError("x", request=request)):
        assert not _retry.retryable_error(exc, idempotent=False)
        assert _retry.retryable_error(exc, idempotent=True)
    assert not _retry.retryable_error(httpx.UnsupportedProtocol("x", request=request), idempotent=True)
    assert _retry.retryable_status(503, idempotent=False)
    assert not any(_retry.retryable_status(s, idempotent=False) for s in (400, 409, 500, 502, 504))
    assert all(_retry.retryable_status(s, idempotent=True) for s in (502, 503, 504))
