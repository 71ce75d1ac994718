"""The SDK through a failover: what it sends again, after what, and for how long (``slime_client._retry``).

Against the raw-TCP stand-in for the gateway of tests/test_client.py (each outcome is what it does with one request),
and the pure rules themselves. The end-to-end runs through HAProxy and real replicas are tests/test_chaos.py.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from raw_upstream import CLOSE, chunked, http_response
from test_client import CUT, HANG_UP, TURN, Outcome, Script, answer, error

from slime_client import Session, _retry
from slime_client.errors import (
    ConflictError,
    GatewayConnectionError,
    ServiceUnavailableError,
    UpstreamError,
)
from slime_client.types import SessionSync
from slime_wire.errors import ConnectionLost, NoAnswer

SYNC = SessionSync(3, (1, 2, 3))
SHIPPED_INITIAL_DELAY_S = _retry.INITIAL_RETRY_DELAY_S  # before the fixture below shortens it
# HAProxy's own answer when the replica it chose died with the request: not the gateway's JSON.
PROXY_502: Outcome = [
    http_response(b"<html><body><h1>502 Bad Gateway</h1></body></html>", 502, {"content-type": "text/html"}),
    CLOSE,
]
SUMMARY = answer(200, {"session_id": "s", "total_tokens": 4})


def busy(retry_after: str = "0") -> Outcome:
    body = {"error": {"type": "session_busy", "message": "held"}}
    return answer(409, body, **{"retry-after": retry_after, "x-should-retry": "true"})


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_retry, "INITIAL_RETRY_DELAY_S", 0.001)


def stream_answer(*events: dict[str, Any]) -> Outcome:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    payload = [b"data: " + orjson.dumps(event) + b"\n\n" for event in events]
    return [head + chunked(*payload, b"data: [DONE]\n\n")]


async def test_a_turn_with_sync_is_sent_again_when_not_a_byte_of_an_answer_came() -> None:
    """The replica died with the request (or the load balancer closed the connection for it): with ``sync`` the
    gateway runs it at most once, so it is re-sent, sync and all; an append too."""
    with Script(HANG_UP, TURN) as script:
        async with script.client() as gw:
            turn = await Session(gw, "s").generate({}, sync=SYNC)
    assert turn.new_token_ids == [1, 2]
    assert [r.json["sync"] for r in script.requests] == [SYNC.to_json()] * 2
    with Script(HANG_UP, SUMMARY) as script:
        async with script.client() as gw:
            await Session(gw, "s").append([4], sync=SYNC)
    assert len(script.requests) == 2


@pytest.mark.parametrize("failure", [HANG_UP, PROXY_502], ids=["no-answer", "proxy-502"])
async def test_without_sync_a_turn_that_may_have_run_is_never_sent_again(failure: Outcome) -> None:
    with Script(failure, TURN) as script:
        async with script.client() as gw:
            with pytest.raises((GatewayConnectionError, UpstreamError)) as caught:
                await Session(gw, "s").generate({})
    assert len(script.requests) == 1
    if failure is HANG_UP:
        assert isinstance(caught.value.__cause__, NoAnswer)


async def test_an_answer_cut_midway_is_not_sent_again_even_with_sync() -> None:
    """Bytes of an answer came: the gateway had the turn done (it answers after the write); a re-send would only be
    refused. The caller decides (the session holds the turn)."""
    with Script(CUT, TURN) as script:
        async with script.client() as gw:
            with pytest.raises(GatewayConnectionError) as caught:
                await Session(gw, "s").generate({}, sync=SYNC)
    assert len(script.requests) == 1
    assert isinstance(caught.value.__cause__, ConnectionLost) and not isinstance(caught.value.__cause__, NoAnswer)


async def test_a_load_balancers_502_is_sent_again_with_sync() -> None:
    with Script(PROXY_502, TURN) as script:
        async with script.client() as gw:
            await Session(gw, "s").generate({}, sync=SYNC)
    assert len(script.requests) == 2
    with Script(error(502, "upstream_protocol_error"), TURN) as script:  # the gateway's own 502: SGLang's fault
        async with script.client() as gw:
            with pytest.raises(UpstreamError):
                await Session(gw, "s").generate({}, sync=SYNC)
    assert len(script.requests) == 1


async def test_a_retry_that_meets_the_earlier_attempts_hold_waits_for_it() -> None:
    """Re-sent after the replica died: the session is busy while the dead replica's hold lasts (nothing ran), so the
    SDK comes back after ``Retry-After``, as often as it takes."""
    with Script(HANG_UP, busy(), busy(), TURN) as script:
        async with script.client() as gw:
            turn = await Session(gw, "s").generate({}, sync=SYNC)
    assert turn.new_token_ids == [1, 2] and len(script.requests) == 4


async def test_a_first_attempts_409_is_the_callers_own_and_raised_at_once_unless_synced() -> None:
    """Without sync a first attempt's 409 is the caller's concurrent use. With sync, the session may be held by the
    caller's own last request, which failed on a replica that died with it: the SDK waits for it to be free (and the
    gateway checks the sync once it is)."""
    with Script(busy(), TURN) as script:
        async with script.client() as gw:
            with pytest.raises(ConflictError):
                await Session(gw, "s").generate({})
    assert len(script.requests) == 1
    with Script(busy(), TURN) as script:
        async with script.client() as gw:
            await Session(gw, "s").generate({}, sync=SYNC)
    assert len(script.requests) == 2


@pytest.mark.parametrize("reason", ["unconfirmed", "unknown"])
async def test_a_503_that_may_have_written_is_sent_again_only_with_sync(reason: str) -> None:
    unconfirmed = answer(503, {"error": {"type": "store_unavailable", "message": "x", "reason": reason}})
    with Script(unconfirmed, TURN) as script:
        async with script.client() as gw:
            with pytest.raises(ServiceUnavailableError):
                await Session(gw, "s").generate({})
    assert len(script.requests) == 1
    with Script(unconfirmed, TURN) as script:
        async with script.client() as gw:
            await Session(gw, "s").generate({}, sync=SYNC)
    assert len(script.requests) == 2


async def test_retries_stop_after_retry_for_s() -> None:
    """However many retries are allowed, none starts past ``retry_for_s`` after the first attempt."""
    with Script(error(503)) as script:
        async with script.client(max_retries=10_000, retry_for_s=0.5) as gw:
            started = time.monotonic()
            with pytest.raises(ServiceUnavailableError):
                await Session(gw, "s").generate({})
            elapsed = time.monotonic() - started
    assert 1 < len(script.requests) < 10_000 and elapsed < 10


def test_the_gateways_retry_after_sets_the_wait() -> None:
    assert _retry.retry_after({"retry-after": "2"}) == 2.0
    assert _retry.retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert _retry.retry_after({}) is None
    assert _retry.retry_delay(0, retry_after=2.0) == 2.0
    assert _retry.retry_delay(0, retry_after=3600.0) <= _retry.MAX_RETRY_DELAY_S  # not waited for as such


def test_the_default_retries_ride_out_a_failover(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis Cluster failover (node timeout + election) and a dead replica's hold take seconds: the default
    schedule keeps trying for most of DEFAULT_RETRY_FOR_S."""
    from slime_client.client import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_FOR_S

    monkeypatch.setattr(_retry, "INITIAL_RETRY_DELAY_S", SHIPPED_INITIAL_DELAY_S)
    shortest = sum(_retry.retry_delay(a, rand=lambda: 1.0) for a in range(DEFAULT_MAX_RETRIES))
    assert shortest >= 15.0 and DEFAULT_RETRY_FOR_S >= 20.0


async def test_a_stream_with_sync_is_sent_again_when_no_answer_came() -> None:
    done = {"type": "turn", "session_id": "s", "new_token_ids": [5]}
    with Script(HANG_UP, stream_answer(done)) as script:
        async with script.client() as gw:
            result = await Session(gw, "s").generate({}, sync=SYNC, stream=True).final()
    assert result.new_token_ids == [5] and len(script.requests) == 2
    with Script(HANG_UP, stream_answer(done)) as script:
        async with script.client() as gw:
            with pytest.raises(GatewayConnectionError):
                await Session(gw, "s").generate({}, stream=True).final()
    assert len(script.requests) == 1


async def test_a_stream_whose_write_failed_raises_a_503_with_nothing_kept() -> None:
    """The store could not keep the turn: its error event has no ``turn``; the SDK raises what a unary turn would
    (503 ``store_unavailable``), with no partial turn: the deltas received are void."""
    delta = {"type": "delta", "token_ids": [1], "text": "a", "completion_tokens": 1}
    failed = {"type": "error", "error": {"type": "store_unavailable", "message": "x"}, "turn": None}
    with Script(stream_answer(delta, failed)) as script:
        async with script.client() as gw:
            with pytest.raises(ServiceUnavailableError) as caught:
                await Session(gw, "s").generate({}, sync=SYNC, stream=True).final()
    assert caught.value.error_type == "store_unavailable" and caught.value.partial_turn is None
