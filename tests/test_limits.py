"""Limits and the error schema end to end: real gateway processes with small GATEWAY_* limits in front of the real
simulator, over 127.0.0.1.

Each limit answers its own status and error type, and a refused request changes nothing: the session's full view is
identical before and after, and other sessions keep working. The store's gauges (kept as counters) equal a walk over
the sessions after a mix of operations. Unknown paths, wrong methods and crashes answer in the JSON error schema.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator
from faulty_gateway import SECRET
from procs import REPO_ROOT, RunningProcess, free_port, start_process

MAX_REQUEST_BYTES = 64 * 1024
MAX_SESSION_TOKENS = 64
HEADER_TIMEOUT_S = 2.0
MAX_STORED_BYTES = 100  # 4 prompts of 6 int32 tokens (24 bytes each) fit, a 5th does not
PROMPT = [5, 6, 7, 8, 9, 10]


# ---- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited(simulator: Service) -> Iterator[Service]:
    env = {
        "GATEWAY_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
        "GATEWAY_MAX_SESSION_TOKENS": str(MAX_SESSION_TOKENS),
        "GATEWAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    }
    with run_gateway(simulator.url, "--log-level", "warning", env=env) as service:
        yield service


@pytest.fixture
async def gw(limited: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=limited.url, timeout=30) as client:
        yield client


async def create(gw: httpx.AsyncClient, prompt: list[int] = PROMPT, moe: bool = True) -> str:
    body: dict[str, Any] = {"prompt_ids": prompt}
    if moe:
        body |= {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


async def full_view(gw: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    response = await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})
    assert response.status_code == 200, response.text
    return response.json()


async def generate(gw: httpx.AsyncClient, sid: str, tokens: int, *, stream: bool = False) -> httpx.Response:
    body = {"stream": stream, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    return await gw.post(f"/v1/sessions/{sid}/generate", json=body)


def assert_error(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == error_type and error["message"]
    return error


def sse_events(raw: bytes) -> list[Any]:
    lines = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    return [orjson.loads(line) for line in lines if line != b"[DONE]"]


async def refused_changes_nothing(gw: httpx.AsyncClient, sid: str, refuse: Any) -> Any:
    """Run ``refuse()`` and check the session's full view is the same after it (``updated_at`` aside: holding a
    session for a turn touches it)."""
    before = await full_view(gw, sid)
    result = await refuse()
    after = await full_view(gw, sid)
    for view in (before, after):
        view.pop("updated_at")
    assert after == before
    return result


def metric(scrape: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels} in the scrape")


# ---- request body size -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/sessions", "/generate"])
async def test_body_over_the_limit_is_413_up_front(gw: httpx.AsyncClient, path: str) -> None:
    sessions_before = (await gw.get("/v1/sessions")).json()["count"]
    # Announced and sent: refused on its Content-Length, before any route reads it. The rest is dropped (up to
    # GATEWAY_MAX_REQUEST_BYTES more), so that the client, still sending, gets the 413 rather than a reset.
    response = await gw.post(path, content=b"x" * (MAX_REQUEST_BYTES + 1))
    error = assert_error(response, 413, "request_too_large")
    assert error["limit"] == MAX_REQUEST_BYTES and error["setting"] == "GATEWAY_MAX_REQUEST_BYTES"
    assert (await gw.get("/v1/sessions")).json()["count"] == sessions_before
    assert (await gw.get("/health")).status_code == 200


@pytest.mark.parametrize("path", ["/v1/sessions", "/generate"])
async def test_chunked_body_is_refused_while_it_arrives(gw: httpx.AsyncClient, path: str) -> None:
    async def body() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while reading
        for _ in range(3):
            yield b" " * (MAX_REQUEST_BYTES // 2)

    assert_error(await gw.post(path, content=body()), 413, "request_too_large")
    assert (await gw.get("/health")).status_code == 200  # on the same (kept-alive) connection


async def test_endless_body_is_cut(limited: Service) -> None:
    """The rest of a refused body is read and dropped for at most GATEWAY_HEADER_TIMEOUT_S, then the connection is
    closed: an endless body is not read forever."""
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        sock.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
        started, sent = time.monotonic(), 0
        with pytest.raises(OSError):  # reset or broken pipe once the gateway closes
            while time.monotonic() - started < 3 * HEADER_TIMEOUT_S:
                sock.sendall(chunk)
                sent += len(chunk)
                await asyncio.sleep(0)
        assert HEADER_TIMEOUT_S * 0.9 < time.monotonic() - started < 2 * HEADER_TIMEOUT_S


async def test_body_at_the_limit_is_served(gw: httpx.AsyncClient) -> None:
    body = orjson.dumps({"prompt_ids": PROMPT})
    padded = body[:-1] + b" " * (MAX_REQUEST_BYTES - len(body)) + b"}"
    assert len(padded) == MAX_REQUEST_BYTES
    assert (await gw.post("/v1/sessions", content=padded)).status_code == 201


async def test_body_refusal_changes_nothing(gw: httpx.AsyncClient) -> None:
    sid = await create(gw)
    append = f"/v1/sessions/{sid}/append"
    huge = {"token_ids": [1] * (MAX_REQUEST_BYTES // 2)}
    response = await refused_changes_nothing(gw, sid, lambda: gw.post(append, json=huge))
    assert_error(response, 413, "request_too_large")
    assert (await gw.post(append, json={"token_ids": [1, 2]})).status_code == 200


# ---- tokens per session ----------------------------------------------------------------------------------------
async def test_prompt_over_the_token_limit_is_refused(gw: httpx.AsyncClient) -> None:
    count = (await gw.get("/v1/sessions")).json()["count"]
    response = await gw.post("/v1/sessions", json={"prompt_ids": list(range(MAX_SESSION_TOKENS + 1))})
    error = assert_error(response, 413, "session_too_long")
    assert error["limit"] == MAX_SESSION_TOKENS and error["setting"] == "GATEWAY_MAX_SESSION_TOKENS"
    assert (await gw.get("/v1/sessions")).json()["count"] == count
    await create(gw, list(range(MAX_SESSION_TOKENS)))  # exactly the limit: fine


async def test_model_answer_over_the_token_limit_changes_nothing(gw: httpx.AsyncClient) -> None:
    sid, other = await create(gw), await create(gw)
    room = MAX_SESSION_TOKENS - len(PROMPT)
    # The turn is admitted (the session has room), the upstream answers room + 1 tokens: refused before the fold.
    response = await refused_changes_nothing(gw, sid, lambda: generate(gw, sid, room + 1))
    assert_error(response, 413, "session_too_long")
    assert (await generate(gw, other, 4)).status_code == 200  # other sessions keep working
    assert (await generate(gw, sid, room)).status_code == 200  # exactly to the limit
    assert (await full_view(gw, sid))["total_tokens"] == MAX_SESSION_TOKENS
    # Full: a turn is refused before anything is sent upstream, an append too.
    response = await refused_changes_nothing(gw, sid, lambda: generate(gw, sid, 1))
    assert_error(response, 413, "session_too_long")
    append = f"/v1/sessions/{sid}/append"
    response = await refused_changes_nothing(gw, sid, lambda: gw.post(append, json={"token_ids": [1]}))
    assert_error(response, 413, "session_too_long")
    assert (await gw.get(f"/v1/sessions/{sid}/sample")).status_code == 200  # reads keep working
    assert (await gw.delete(f"/v1/sessions/{sid}")).status_code == 204


async def test_streamed_answer_over_the_token_limit_changes_nothing(gw: httpx.AsyncClient) -> None:
    sid = await create(gw)
    room = MAX_SESSION_TOKENS - len(PROMPT)
    response = await refused_changes_nothing(gw, sid, lambda: generate(gw, sid, room + 10, stream=True))
    assert response.status_code == 200  # the stream had started: the refusal is its error event
    events = sse_events(response.content)
    assert events[-1]["type"] == "error" and events[-1]["turn"] is None
    assert events[-1]["error"]["type"] == "session_too_long"
    assert sum(len(e["token_ids"]) for e in events if e["type"] == "delta") <= room  # cut at the limit
    assert not (await full_view(gw, sid))["busy"]
    response = await generate(gw, sid, room, stream=True)
    assert sse_events(response.content)[-1]["type"] == "turn"
    assert (await full_view(gw, sid))["total_tokens"] == MAX_SESSION_TOKENS


async def test_append_over_the_token_limit_changes_nothing(gw: httpx.AsyncClient) -> None:
    sid = await create(gw)
    append = f"/v1/sessions/{sid}/append"
    too_many = {"token_ids": [3] * (MAX_SESSION_TOKENS - len(PROMPT) + 1)}
    response = await refused_changes_nothing(gw, sid, lambda: gw.post(append, json=too_many))
    assert_error(response, 413, "session_too_long")
    fits = {"token_ids": [3] * (MAX_SESSION_TOKENS - len(PROMPT))}
    assert (await gw.post(append, json=fits)).status_code == 200


# ---- bytes across all sessions ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_store(simulator: Service) -> Iterator[Service]:
    env = {"GATEWAY_MAX_STORED_BYTES": str(MAX_STORED_BYTES)}
    with run_gateway(simulator.url, "--log-level", "warning", env=env) as service:
        yield service


async def test_full_store_refuses_growth_with_507_and_keeps_reads_and_deletes(small_store: Service) -> None:
    async with httpx.AsyncClient(base_url=small_store.url, timeout=30) as gw:
        sids = [await create(gw) for _ in range(MAX_STORED_BYTES // (4 * len(PROMPT)))]
        error = assert_error(await gw.post("/v1/sessions", json={"prompt_ids": PROMPT}), 507, "store_full")
        assert error["limit"] == MAX_STORED_BYTES and error["setting"] == "GATEWAY_MAX_STORED_BYTES"
        # Below the limit a turn is admitted (its answer is folded even if it crosses the limit) ...
        assert (await generate(gw, sids[0], 8)).status_code == 200
        # ... then the store is full: growth is refused, the session unchanged; reads keep working.
        response = await refused_changes_nothing(gw, sids[1], lambda: generate(gw, sids[1], 8))
        assert_error(response, 507, "store_full")
        append = f"/v1/sessions/{sids[1]}/append"
        response = await refused_changes_nothing(gw, sids[1], lambda: gw.post(append, json={"token_ids": [1]}))
        assert_error(response, 507, "store_full")
        assert (await gw.get(f"/v1/sessions/{sids[1]}/sample")).status_code == 200
        assert (await gw.post("/v1/samples", json={"session_ids": sids})).status_code == 200
        # Deleting makes room again.
        for sid in sids[:2]:
            assert (await gw.delete(f"/v1/sessions/{sid}")).status_code == 204
        await create(gw)
        assert (await generate(gw, sids[2], 4)).status_code == 200


# ---- the store's gauges ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expiring() -> Iterator[Service]:
    """Sessions untouched for 2 s expire (swept every 0.5 s); bodies over 1 KiB take the big-body path. The simulator
    takes 10 ms a token, so that a turn can be caught running."""
    env = {"GATEWAY_SESSION_IDLE_TTL_S": "2", "GATEWAY_DECODE_OFFLOAD_BYTES": "1024"}
    with run_simulator("--token-delay-ms", "10") as sim, run_gateway(sim.url, "--log-level", "warning", env=env) as gw:
        yield gw


GAUGES = ("gateway_sessions_stored", "gateway_sessions_active", "gateway_stored_bytes")


async def walk(gw: httpx.AsyncClient) -> dict[str, float]:
    """The gauges' numbers from a walk over every session's view."""
    views = [
        (await gw.get(f"/v1/sessions/{s['session_id']}")) for s in (await gw.get("/v1/sessions")).json()["sessions"]
    ]
    present = [v.json() for v in views if v.status_code == 200]  # one may expire between the list and its view
    if len(present) != len(views):
        return {}
    return {
        "gateway_sessions_stored": len(present),
        "gateway_sessions_active": sum(v["busy"] for v in present),
        "gateway_stored_bytes": sum(v["stored_bytes"] for v in present),
    }


async def gauges_and_walk(gw: httpx.AsyncClient) -> tuple[dict[str, float], dict[str, float]]:
    """The store gauges and a walk taken around the scrape; retried until nothing changed during the scrape (the
    idle-expiry sweeper runs on its own)."""
    for _ in range(10):
        before = await walk(gw)
        scrape = (await gw.get("/metrics")).text
        after = await walk(gw)
        if before and before == after:
            return {name: metric(scrape, name) for name in GAUGES}, after
    raise AssertionError("the sessions kept changing during every scrape")


async def test_store_gauges_equal_a_walk_after_a_mix_of_operations(expiring: Service) -> None:
    async with httpx.AsyncClient(base_url=expiring.url, timeout=30) as gw:
        sids = [await create(gw) for _ in range(4)] + [await create(gw, list(range(3000)), moe=False)]
        assert (await generate(gw, sids[0], 12)).status_code == 200
        assert sse_events((await generate(gw, sids[1], 9, stream=True)).content)[-1]["type"] == "turn"
        append = {"token_ids": list(range(1000, 1400)), "text": "<tool>"}
        assert (await gw.post(f"/v1/sessions/{sids[2]}/append", json=append)).status_code == 200
        assert (await gw.delete(f"/v1/sessions/{sids[3]}")).status_code == 204
        gauges, walk = await gauges_and_walk(gw)
        assert gauges == walk and walk["gateway_sessions_stored"] == 4

        # A streamed turn in flight (400 tokens: 4 s) counts as active; aborted, the tokens so far are folded.
        body = {"stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        async with gw.stream("POST", f"/v1/sessions/{sids[4]}/generate", json=body) as response:
            chunks = response.aiter_bytes()
            first = await anext(chunks)  # a delta: the turn is running
            gauges, walk = await gauges_and_walk(gw)
            assert gauges == walk and walk["gateway_sessions_active"] == 1
            assert (await gw.post(f"/v1/sessions/{sids[4]}/abort")).json()["aborted"]
            events = sse_events(first + b"".join([chunk async for chunk in chunks]))
        assert events[-1]["type"] == "turn"
        gauges, walk = await gauges_and_walk(gw)
        assert gauges == walk and walk["gateway_sessions_active"] == 0
        assert 0 < (await full_view(gw, sids[4]))["response_length"] < 400

        # Expiry: everything untouched for 2 s goes; a session touched meanwhile stays.
        for _ in range(6):
            await asyncio.sleep(0.5)
            assert (await gw.post(f"/v1/sessions/{sids[0]}/append", json={"token_ids": [7]})).status_code == 200
        gauges, walk = await gauges_and_walk(gw)
        assert gauges == walk and walk["gateway_sessions_stored"] == 1
        assert (await gw.delete(f"/v1/sessions/{sids[0]}")).status_code == 204
        gauges, walk = await gauges_and_walk(gw)
        assert gauges == walk == {"gateway_sessions_stored": 0, "gateway_sessions_active": 0, "gateway_stored_bytes": 0}


async def test_big_bodies_are_parsed_exactly(expiring: Service) -> None:
    """Over GATEWAY_DECODE_OFFLOAD_BYTES the token array is parsed in steps in the worker pool: same result, same
    errors as pydantic's own parse."""
    async with httpx.AsyncClient(base_url=expiring.url, timeout=30) as gw:
        prompt = list(range(100_000, 120_000))
        body = {"metadata": {"prompt_ids": [1]}, "prompt_ids": prompt, "session_id": "big-body"}
        assert (await gw.post("/v1/sessions", json=body)).status_code == 201
        tool = list(range(5000))
        assert (await gw.post("/v1/sessions/big-body/append", json={"token_ids": tool})).status_code == 200
        assert (await full_view(gw, "big-body"))["full"]["tokens"] == prompt + tool
        bad = await gw.post("/v1/sessions", json={"prompt_ids": [*prompt, -1]})
        assert bad.status_code == 422 and "prompt_ids.20000" in bad.json()["error"]["message"]
        bad = await gw.post("/v1/sessions", json={"prompt_ids": prompt, "num_layers": 4})
        assert bad.status_code == 422 and "moe_router_topk" in bad.json()["error"]["message"]
        assert (await gw.delete("/v1/sessions/big-body")).status_code == 204


async def test_health_answers_while_a_huge_prompt_is_parsed(gateway: Service) -> None:
    """A ~31 MB body (4M token ids, under the default 32 MiB limit, over the 1M-token limit) is parsed in the worker
    pool in GIL-friendly steps: /health keeps answering meanwhile. Measured against the request's own time (a parse on
    the event loop would hold /health for about all of it), so that other work on the machine slows both alike."""
    body = orjson.dumps({"prompt_ids": list(range(1_000_000, 5_000_000))})
    assert len(body) < 32 * 1024 * 1024
    latencies: list[float] = []
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as gw,
        httpx.AsyncClient(base_url=gateway.url, timeout=5) as probe,
    ):
        started_all = time.perf_counter()
        create = asyncio.create_task(gw.post("/v1/sessions", content=body))
        while not create.done():
            started = time.perf_counter()
            assert (await probe.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.005)
        assert_error(await create, 413, "session_too_long")
        elapsed = time.perf_counter() - started_all
    print(
        f"/health while parsing a {len(body) / 1e6:.0f} MB body for {elapsed:.2f} s: {len(latencies)} probes, max "
        f"{max(latencies):.4f} s"
    )
    assert len(latencies) >= 5 and max(latencies) < max(0.1, elapsed / 4), (elapsed, max(latencies))


# ---- the error schema for what no route raises -------------------------------------------------------------------
async def test_unknown_path_is_a_json_404(gw: httpx.AsyncClient) -> None:
    error = assert_error(await gw.get("/no/such/path"), 404, "not_found")
    assert error["path"] == "/no/such/path"
    assert_error(await gw.post("/v1/nothing", json={}), 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        # routes share the path (the view, the delete, the chat clients' HEAD probe): every method is listed
        ("PUT", "/v1/sessions/abc", ["GET", "HEAD", "DELETE"]),
        ("DELETE", "/v1/sessions", ["GET", "POST"]),
        ("GET", "/generate", ["POST"]),  # a passthrough route
        ("POST", "/health", ["GET"]),
    ],
)
async def test_wrong_method_is_a_json_405_with_allow(
    gw: httpx.AsyncClient, method: str, path: str, allow: list[str]
) -> None:
    response = await gw.request(method, path)
    error = assert_error(response, 405, "method_not_allowed")
    assert error["allow"] == allow and response.headers["allow"] == ", ".join(allow)


@pytest.fixture(scope="module")
def faulty(simulator: Service) -> Iterator[RunningProcess]:
    port = free_port()
    args = [sys.executable, str(REPO_ROOT / "tests" / "faulty_gateway.py"), "--upstream-url", simulator.url]
    with start_process([*args, "--port", str(port)], port) as process:
        yield process


@pytest.mark.parametrize("path", ["/test/crash", "/get_server_info"])
async def test_crash_is_a_json_500_logged_with_its_traceback(faulty: RunningProcess, path: str) -> None:
    async with httpx.AsyncClient(base_url=faulty.url, timeout=10) as client:
        error = assert_error(await client.get(path), 500, "internal_error")
        assert SECRET not in error["message"]
        reference = error["reference"]
        assert reference in error["message"]
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/get_model_info")).status_code == 200  # the passthrough still works
    deadline = time.monotonic() + 5
    while reference not in faulty.output() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log = faulty.output()
    line = next(line for line in log.splitlines() if reference in line)
    assert f"GET {path} -> 500 internal_error" in line
    assert "Traceback (most recent call last)" in log and f"RuntimeError: {SECRET}" in log
    assert "Exception in ASGI application" not in log  # logged once, by the gateway
