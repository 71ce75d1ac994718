"""slime_client.GatewayClient: end to end against the real gateway + simulator, and the retry policy and transport
boundary against a raw-TCP stand-in for the gateway (tests/raw_upstream.py) that answers with scripted bytes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
import torch
import uvloop
from conftest import SIM_LAYERS, SIM_TOPK, Service
from procs import free_port
from raw_upstream import CLOSE, RawRequest, RawUpstream, Step, chunked, http_response

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
from slime_client import client as client_module
from slime_client.client import DEFAULT_TIMEOUT
from slime_client.errors import make_status_error, translate_transport_error
from slime_wire.errors import (
    ConnectFailed,
    ConnectionLost,
    NotSent,
    PoolTimeout,
    ProtocolViolation,
    ResponseTimeout,
    SentError,
    TransportError,
)

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


async def test_routing_on_plain_session_is_a_conflict(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT)
    with pytest.raises(ConflictError):  # a valid request this session (no MoE shape) cannot take
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


async def test_503_turn_is_retried_and_succeeds(
    gw: GatewayClient, sim: httpx.AsyncClient, sim_faults: Callable[..., Any]
) -> None:
    session = await moe_session(gw)
    await sim_faults("http_503")
    turn = await session.generate({"max_new_tokens": 6})
    assert turn.turn == 0 and turn.completion_tokens > 0  # one turn folded, not two
    assert len(await generate_requests(sim, session.session_id)) == 2


async def test_503_until_retries_run_out(gateway: Service, sim_faults: Callable[..., Any]) -> None:
    """Each 503 says ``Retry-After: 1``: three retries, then the error (the default 30 would take 30 s)."""
    async with GatewayClient(gateway.url, max_retries=3) as gw:
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
    async with GatewayClient(gateway.url, timeout=0.3) as gw:
        session = await moe_session(gw)
        await sim_faults("delay", delay_s=1.0)
        with pytest.raises(GatewayTimeoutError):
            await session.generate({"max_new_tokens": 4})
    await asyncio.sleep(1.0)  # the gateway still runs (and folds) the turn the client gave up on
    assert len(await generate_requests(sim, session.session_id)) == 1


# ---- connections -------------------------------------------------------------------------------------------------
def pool_state(gw: GatewayClient) -> tuple[int, int]:
    """(connections idle in the client's pool, connection slots in use)."""
    pool = gw._pool
    slots = pool._slots
    in_use = 0 if slots is None else pool._max_connections - slots._value
    return len(pool._idle), in_use


async def test_no_connection_left_busy_after_failures_and_pool_closed(gateway: Service) -> None:
    async with GatewayClient(gateway.url) as gw:
        session = await gw.create_session(prompt_ids=PROMPT)
        for failing in (gw.session("missing"), session.generate({}, return_routed_experts=True)):
            with pytest.raises(GatewayStatusError):
                await failing
        await session.fetch()
        idle, in_use = pool_state(gw)
        assert idle >= 1 and in_use == 0  # every answer was read and its connection given back
        assert gw._pool.connections_opened == 1  # ... and reused: one keep-alive connection did it all
    assert gw.is_closed
    assert pool_state(gw) == (0, 0)
    with pytest.raises(RuntimeError):
        await gw.health()


async def test_fetched_tensors_view_a_writable_buffer_of_their_own(gw: GatewayClient) -> None:
    session = await moe_session(gw)
    await session.generate({"max_new_tokens": 8, **TOP_P})
    first, second = await session.fetch(), await session.fetch()
    assert_same_sample(first, second)
    routing = first.rollout_routed_experts
    assert routing is not None
    # zero-copy views of one body per fetch: the same buffer under every tensor, not shared between fetches
    owner = first.tokens.untyped_storage().data_ptr()
    assert first.tokens.data_ptr() - owner < 1 << 20 and routing.data_ptr() - owner < 1 << 20
    assert second.tokens.data_ptr() != first.tokens.data_ptr()
    first.tokens[0] = 7  # writable, without a copy, and without touching the other sample
    assert int(second.tokens[0]) == PROMPT[0]


def test_sdk_runs_on_uvloop_and_on_plain_asyncio(gateway: Service) -> None:
    async def conversation() -> int:
        async with GatewayClient(gateway.url) as gw:
            session = await moe_session(gw)
            streamed = await session.generate({"max_new_tokens": 4}, stream=True).final()
            turn = await session.generate({"max_new_tokens": 4})
            sample = await session.fetch()
            await session.delete()
            assert len(sample.tokens) == len(PROMPT) + streamed.completion_tokens + turn.completion_tokens
            return gw._pool.connections_opened

    for factory in (uvloop.new_event_loop, asyncio.new_event_loop):
        with asyncio.Runner(loop_factory=factory) as runner:
            assert runner.run(conversation()) == 1  # a stream read to its end leaves its connection reusable


def test_keep_freed_memory_is_called_once_and_can_be_opted_out(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(client_module, "keep_freed_memory", lambda: calls.append(True) or True)
    client_module.keep_freed_memory_once.cache_clear()
    try:
        GatewayClient("http://127.0.0.1:9")
        GatewayClient("http://127.0.0.1:9")
        assert calls == [True]
        client_module.keep_freed_memory_once.cache_clear()
        monkeypatch.setenv("SLIME_CLIENT_KEEP_FREED_MEMORY", "0")
        GatewayClient("http://127.0.0.1:9")
        assert calls == [True] and client_module.keep_freed_memory_once() is False
    finally:
        client_module.keep_freed_memory_once.cache_clear()


def test_settings_are_checked() -> None:
    gw = GatewayClient("http://127.0.0.1:9/prefix/", timeout=30, connect_timeout=1.5)
    assert (gw.base_url, gw.timeout, gw._pool.connect_timeout_s) == ("http://127.0.0.1:9/prefix", 30.0, 1.5)
    assert GatewayClient("http://127.0.0.1:9").timeout == DEFAULT_TIMEOUT
    for bad in ({"timeout": 0}, {"connect_timeout": -1}, {"max_retries": -1}):
        with pytest.raises(ValueError):
            GatewayClient("http://127.0.0.1:9", **bad)
    with pytest.raises(ValueError):
        GatewayClient("ftp://127.0.0.1:9")


# ---- the retry policy and the transport boundary, against a raw-TCP stand-in for the gateway --------------------
# Each outcome is the steps of one answer (tests/raw_upstream.py): what the stand-in does with one request.
Outcome = list[Step]
HANG_UP: Outcome = [CLOSE]  # read the request, close without a byte: ConnectionLost (it may have run)
CUT: Outcome = [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{", CLOSE]
GARBAGE: Outcome = [b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n", CLOSE]  # ProtocolViolation
STALL: Outcome = [2.0]  # no answer before the client's deadline: ResponseTimeout


def answer(status: int, body: Any, **headers: str) -> Outcome:
    return [http_response(orjson.dumps(body), status, headers, reason="X")]


def error(status: int, error_type: str = "x") -> Outcome:
    return answer(status, {"error": {"type": error_type, "message": f"status {status}"}})


TURN = answer(200, {"session_id": "s", "new_token_ids": [1, 2], "completion_tokens": 2})
STATE = answer(200, {"session_id": "s", "total_tokens": 3})


class Script:
    """A RawUpstream standing in for the gateway: answers its requests with ``outcomes`` in order (the last one
    repeats) and records what arrived (``requests``, with the connection each came on)."""

    def __init__(self, *outcomes: Outcome, port: int = 0) -> None:
        self.outcomes = list(outcomes)
        self.upstream = RawUpstream(self._reply, port=port)

    def _reply(self, request: RawRequest) -> list[Step]:
        return self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]

    @property
    def requests(self) -> list[RawRequest]:
        return self.upstream.requests

    def __enter__(self) -> Script:
        self.upstream.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.upstream.__exit__(*exc)

    def client(self, **kwargs: Any) -> GatewayClient:
        return GatewayClient(self.upstream.url, **kwargs)


@pytest.fixture
def retries(caplog: pytest.LogCaptureFixture) -> Callable[[], int]:
    """How many retries the SDK logged so far."""
    caplog.set_level(logging.INFO, logger="slime_client")
    return lambda: sum("retry" in record.getMessage() for record in caplog.records)


async def test_not_sent_is_retried_even_for_a_turn(monkeypatch: pytest.MonkeyPatch, retries: Callable[[], int]) -> None:
    """Connection refused (NotSent: nothing left this process) is retried for a POST; the gateway comes up in
    the meantime and gets the turn exactly once."""
    script = Script(TURN, port=free_port())
    wait = GatewayClient._wait_before_retry

    async def come_up_during_the_first_wait(self: GatewayClient, *args: Any) -> None:
        if not script.upstream.port or script.upstream._server is None:
            script.__enter__()
        await wait(self, *args)

    monkeypatch.setattr(GatewayClient, "_wait_before_retry", come_up_during_the_first_wait)
    try:
        async with script.client() as gw:
            turn = await Session(gw, "s").generate({"max_new_tokens": 2})
    finally:
        script.__exit__()
    assert turn.new_token_ids == [1, 2]
    assert [r.method for r in script.requests] == ["POST"] and retries() == 1


async def test_gateway_down_is_connection_error_after_retries(retries: Callable[[], int]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with GatewayClient(url, max_retries=2) as gw:
        with pytest.raises(GatewayConnectionError) as caught:
            await gw.create_session(prompt_ids=PROMPT)
    assert retries() == 2  # three attempts
    assert isinstance(caught.value.__cause__, ConnectFailed) and isinstance(caught.value.__cause__, NotSent)


@pytest.mark.parametrize(
    ("failure", "raised", "cause"),
    [
        (HANG_UP, GatewayConnectionError, ConnectionLost),
        (CUT, GatewayConnectionError, ConnectionLost),
        (GARBAGE, GatewayConnectionError, ProtocolViolation),
        (STALL, GatewayTimeoutError, ResponseTimeout),
        (error(502), UpstreamError, None),
        (error(504), GatewayTimeout, None),
    ],
    ids=["hang-up", "cut", "garbage", "deadline", "502", "504"],
)
async def test_maybe_ran_turns_are_never_resubmitted(
    failure: Outcome, raised: type[GatewayError], cause: type[SentError] | None
) -> None:
    """A SentError (the request may have run) or a 502/504: a POST is not sent again."""
    for call in ("generate", "append"):
        with Script(failure, TURN) as script:
            async with script.client(timeout=0.3) as gw:
                session = Session(gw, "s")
                with pytest.raises(raised) as caught:
                    await (session.generate({}) if call == "generate" else session.append([1]))
            assert len(script.requests) == 1, call
        if cause is not None:
            assert isinstance(caught.value.__cause__, cause) and isinstance(caught.value.__cause__, SentError)


@pytest.mark.parametrize("failure", [HANG_UP, CUT, GARBAGE, STALL, error(502), error(504)])
async def test_reads_and_deletes_are_retried_on_more(failure: Outcome) -> None:
    with Script(failure, STATE) as script:
        async with script.client(timeout=0.3) as gw:
            state = await Session(gw, "s").state()
    assert state.total_tokens == 3
    assert [r.method for r in script.requests] == ["GET", "GET"]
    with Script(failure, answer(204, None)) as script:
        async with script.client(timeout=0.3) as gw:
            await Session(gw, "s").delete()
    assert [r.method for r in script.requests] == ["DELETE", "DELETE"]


async def test_503_is_retried_for_a_turn_and_a_stream() -> None:
    with Script(error(503, "upstream_unavailable"), TURN) as script:
        async with script.client() as gw:
            await Session(gw, "s").generate({})
    assert len(script.requests) == 2
    turn_event = b"data: " + orjson.dumps({"type": "turn", "session_id": "s", "new_token_ids": [5]}) + b"\n\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    stream_answer = head + chunked(turn_event, b"data: [DONE]\n\n")
    with Script(error(503), [stream_answer]) as script:
        async with script.client() as gw:
            result = await Session(gw, "s").generate({}, stream=True).final()
            again = await Session(gw, "s").generate({}, stream=True).final()
    assert result.new_token_ids == again.new_token_ids == [5]
    assert len(script.requests) == 3
    assert script.requests[0].headers["accept"] == "text/event-stream"
    assert script.requests[1].connection == script.requests[2].connection  # a finished stream's connection is reused


async def test_503_until_retries_run_out_and_max_retries_zero() -> None:
    with Script(error(503)) as script:
        async with script.client(max_retries=1) as gw:
            with pytest.raises(ServiceUnavailableError):
                await Session(gw, "s").generate({})
    assert len(script.requests) == 2
    with Script(error(503), TURN) as script:
        async with script.client(max_retries=0) as gw:
            with pytest.raises(ServiceUnavailableError):
                await Session(gw, "s").generate({})
    assert len(script.requests) == 1


async def test_bad_requests_and_conflicts_are_not_retried() -> None:
    for status in (400, 401, 404, 409, 422, 500):
        with Script(error(status), STATE) as script:
            async with script.client() as gw:
                with pytest.raises(GatewayStatusError) as caught:
                    await Session(gw, "s").state()
        assert len(script.requests) == 1, status
        assert caught.value.status == status


async def test_delete_retried_after_lost_answer_counts_404_as_done() -> None:
    with Script(HANG_UP, error(404, "session_not_found")) as script:
        async with script.client() as gw:
            await Session(gw, "s").delete()
    assert [r.method for r in script.requests] == ["DELETE", "DELETE"]


async def test_deadline_covers_the_whole_answer_not_each_read() -> None:
    """An answer that drips in (each byte well within the deadline) is cut at the deadline: a per-call deadline."""
    body = orjson.dumps({"session_id": "s", "total_tokens": 3})
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    drip: Outcome = [head]
    for byte in body:
        drip += [0.05, bytes([byte])]
    with Script(drip) as script:
        async with script.client(timeout=0.4, max_retries=0) as gw:
            started = time.monotonic()
            with pytest.raises(GatewayTimeoutError):
                await Session(gw, "s").state()
            assert time.monotonic() - started < 1.0
    with Script(drip) as script:
        async with script.client(timeout=10) as gw:
            assert (await Session(gw, "s").state()).total_tokens == 3  # the same drip, within a longer deadline


async def test_a_stream_that_stalls_is_cut_at_the_deadline_and_not_resent() -> None:
    delta = orjson.dumps({"type": "delta", "token_ids": [1], "text": "a", "completion_tokens": 1})
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    stalled: Outcome = [head + b"%x\r\n%s\r\n" % (len(delta) + 8, b"data: " + delta + b"\n\n"), 5.0]
    with Script(stalled) as script:
        async with script.client(timeout=0.5) as gw:
            events = []
            with pytest.raises(GatewayTimeoutError) as caught:
                async with Session(gw, "s").generate({}, stream=True) as stream:
                    async for event in stream:
                        events.append(event)
    assert [e.token_ids for e in events] == [[1]]  # what arrived before the deadline was handed out
    assert isinstance(caught.value.__cause__, ResponseTimeout)
    assert len(script.requests) == 1


async def test_request_body_path_and_headers() -> None:
    with Script(answer(201, {"session_id": "a/b", "prompt_length": 2})) as script:
        async with script.client(api_key="k1") as gw:
            session = await gw.create_session(prompt_ids=[1, 2], session_id="a/b", metadata={"k": 1})
            await session.state(full=True)
    create, state = script.requests
    assert (create.method, create.path) == ("POST", "/v1/sessions")
    assert create.headers["content-type"] == "application/json"
    assert create.headers["authorization"] == "Bearer k1"
    assert create.json == {"prompt_ids": [1, 2], "session_id": "a/b", "metadata": {"k": 1}}
    assert session._path == "/v1/sessions/a%2Fb"  # ids are quoted into the path
    assert (state.method, state.path) == ("GET", "/v1/sessions/a%2Fb?full=true")


async def test_big_json_answers_are_read_whole() -> None:
    big = {"session_id": "s", "total_tokens": 3, "pad": "x" * (1 << 20)}  # past the pooled-buffer threshold
    with Script(answer(200, big)) as script:
        async with script.client() as gw:
            for _ in range(3):
                state = await Session(gw, "s").state()
                assert state.raw["pad"] == big["pad"]


async def test_unreadable_success_answers_are_response_errors() -> None:
    safetensors = "application/vnd.safetensors"
    for outcome, call in [
        ([http_response(b"<html>proxy</html>", headers={"content-type": "text/html"})], "state"),
        (answer(200, {"not": "safetensors"}), "fetch"),
        ([http_response(b"\x00" * 16, headers={"content-type": safetensors})], "fetch"),
        (answer(200, {"status": "pending"}), "state"),
    ]:
        with Script(outcome) as script:
            async with script.client() as gw:
                session = Session(gw, "s")
                with pytest.raises(GatewayResponseError):
                    await (session.state() if call == "state" else session.fetch())


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
    exc = make_status_error(status, orjson.dumps(body), [(b"retry-after", b"3"), (b"Retry-After", b"9")])
    assert type(exc) is error_class
    assert (exc.status, exc.error_type, exc.message, exc.body) == (status, "some_type", "what happened", body)
    assert exc.details == {"session_id": "s1"}
    assert exc.headers == {"retry-after": "3"}


def test_make_status_error_without_gateway_body() -> None:
    exc = make_status_error(502, b"Bad Gateway from nginx")
    assert isinstance(exc, UpstreamError)
    assert exc.error_type is None and exc.message == "Bad Gateway from nginx" and exc.details == {}
    assert make_status_error(503, b"").message == "Service Unavailable"


def test_translate_transport_error() -> None:
    expected: dict[type[TransportError], type[GatewayError]] = {
        ConnectFailed: GatewayConnectionError,
        PoolTimeout: GatewayTimeoutError,
        ResponseTimeout: GatewayTimeoutError,
        ConnectionLost: GatewayConnectionError,
        ProtocolViolation: GatewayConnectionError,
        TransportError: GatewayError,
    }
    for transport_error, sdk_error in expected.items():
        translated = translate_transport_error(transport_error("boom"), "GET", "http://gw/x")
        assert type(translated) is sdk_error and "GET http://gw/x" in str(translated)


def test_retry_delay_grows_caps_and_jitters() -> None:
    no_jitter = [_retry.retry_delay(a, rand=lambda: 0.0) for a in range(16)]
    assert no_jitter[:3] == [_retry.INITIAL_RETRY_DELAY_S * f for f in (1, 2, 4)]
    assert max(no_jitter) == _retry.MAX_RETRY_DELAY_S
    full_jitter = _retry.retry_delay(1, rand=lambda: 1.0)
    assert full_jitter == pytest.approx(no_jitter[1] * (1 - _retry.JITTER_FRACTION))


def test_retry_rules() -> None:
    for exc in (ConnectFailed("x"), PoolTimeout("x")):  # NotSent: any method
        assert _retry.retryable_error(exc, idempotent=False)
        assert not _retry.may_have_arrived(exc)
    for exc in (ResponseTimeout("x"), ConnectionLost("x"), ProtocolViolation("x")):  # SentError: idempotent only
        assert not _retry.retryable_error(exc, idempotent=False)
        assert _retry.retryable_error(exc, idempotent=True)
        assert _retry.may_have_arrived(exc)
    assert not _retry.retryable_error(TransportError("x"), idempotent=True)
    assert _retry.retryable_status(503, idempotent=False)
    assert not any(_retry.retryable_status(s, idempotent=False) for s in (400, 409, 500, 502, 504))
    assert all(_retry.retryable_status(s, idempotent=True) for s in (502, 503, 504))
