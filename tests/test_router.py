"""The router tier: real SGLang routers from the package registry between the gateway and two simulator workers.

    gateway --> smg 1.13.0 (consistent_hashing) --> simulator x2      (replay forwarded, session affinity)
    gateway --> sglang-router 0.3.2 (round_robin) --> simulator x2    (drops replay fields: must fail loudly)

Both workers run the same seed, so an answer is the same whichever worker serves it. The routers come from
`make routers` (.routers/<name>); when one is not installed its tests skip and say why.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator
from routers import SGLANG_ROUTER, SMG, Router, RouterKind, run_router
from safetensors.numpy import load as load_safetensors

pytestmark = pytest.mark.router

PROMPT = [11, 12, 13, 14, 15, 16, 17]
TOOL = [700, 701, 702]
SAMPLING = {"sampling_seed": 4242, "max_new_tokens": 10}
TOP_P = {"custom_params": {"return_top_p_token_ids": True}}
ROUTER_TIMEOUT_S = 1  # the routers' --request-timeout-secs; a worker "delay" fault longer than this times out
SLOW_WORKER_S = 2.5
# Probe workers every second and give up on the first failure: stopped workers are noticed within ~1 s, after which
# the router answers 503 no_available_workers.
HEALTH_FLAGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-check-timeout-secs", "1",
)  # fmt: skip


@dataclass(frozen=True)
class Stack:
    """Two workers, a router in front of them and a gateway in front of the router."""

    workers: tuple[Service, ...]
    router: Router
    gateway: Service


def require(kind: RouterKind) -> None:
    reason = kind.unavailable_reason()
    if reason:
        pytest.skip(reason)


@contextmanager
def run_stack(kind: RouterKind, workers: tuple[Service, ...], policy: str, *extra: str) -> Iterator[Stack]:
    router_flags = ("--request-timeout-secs", str(ROUTER_TIMEOUT_S), *extra)
    with (
        run_router(kind, [w.url for w in workers], policy=policy, extra=router_flags) as router,
        run_gateway(router.url, "--log-level", "error") as gateway,
    ):
        yield Stack(workers, router, gateway)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Service, ...]]:
    with ExitStack() as stack:
        yield tuple(stack.enter_context(run_simulator()) for _ in range(2))


@pytest.fixture(scope="module")
def smg(workers: tuple[Service, ...]) -> Iterator[Stack]:
    require(SMG)
    with run_stack(SMG, workers, "consistent_hashing") as stack:
        yield stack


@pytest.fixture(scope="module")
def sglang_router(workers: tuple[Service, ...]) -> Iterator[Stack]:
    require(SGLANG_ROUTER)
    with run_stack(SGLANG_ROUTER, workers, "round_robin") as stack:
        yield stack


@pytest.fixture(params=["smg", "sglang_router"])
def any_router(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)


@pytest.fixture
async def clean_workers(workers: tuple[Service, ...]) -> AsyncIterator[list[httpx.AsyncClient]]:
    """Clients of the workers with empty request logs and no faults; faults are cleared again afterwards."""
    clients = [httpx.AsyncClient(base_url=w.url, timeout=10) for w in workers]
    try:
        for client in clients:
            await client.post("/sim/reset")
        yield clients
    finally:
        for client in clients:
            await client.delete("/sim/faults")
            await client.aclose()


async def inject_everywhere(workers: list[httpx.AsyncClient], mode: str, count: int = 1, **params: Any) -> None:
    """Queue a fault on every worker, so it hits whichever worker the router picks."""
    for client in workers:
        response = await client.post("/sim/faults", json={"mode": mode, "count": count, **params})
        response.raise_for_status()


async def generate_log(workers: list[httpx.AsyncClient]) -> list[list[dict[str, Any]]]:
    """Each worker's logged /generate requests (bodies summarized by the simulator), oldest first."""
    logs = [(await client.get("/sim/requests")).json() for client in workers]
    return [[entry for entry in log if entry["path"] == "/generate"] for log in logs]


@asynccontextmanager
async def gateway_client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
        yield client


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def create_session(gw: httpx.AsyncClient, sid: str, *, moe: bool = True) -> str:
    body: dict[str, Any] = {"prompt_ids": PROMPT, "session_id": sid, "sampling_defaults": SAMPLING}
    if moe:
        body |= {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return sid


async def model_turn(gw: httpx.AsyncClient, sid: str, **body: Any) -> dict[str, Any]:
    response = await gw.post(f"/v1/sessions/{sid}/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def append_tool(gw: httpx.AsyncClient, sid: str, tokens: list[int]) -> None:
    response = await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": tokens, "text": " <tool>"})
    assert response.status_code == 200, response.text


async def full_view(gw: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    response = await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})
    assert response.status_code == 200, response.text
    view = response.json()
    view.pop("updated_at")
    return view


async def sample_arrays(gw: httpx.AsyncClient, sid: str) -> dict[str, np.ndarray]:
    response = await gw.get(f"/v1/sessions/{sid}/sample")
    assert response.status_code == 200, response.text
    return load_safetensors(response.content)


async def play_replay_session(gw: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    """Three model turns with routing and top-p replay, tool tokens in between; the turn summaries."""
    await create_session(gw, sid)
    first = await model_turn(gw, sid, sampling_params=TOP_P)
    await append_tool(gw, sid, TOOL)
    second = await model_turn(gw, sid)
    await append_tool(gw, sid, TOOL[:1])
    third = await model_turn(gw, sid, sampling_params={"max_new_tokens": 6})
    return [first, second, third]


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """A turn summary without what legitimately differs between two runs (ids, prefix-cache hits)."""
    return {k: v for k, v in summary.items() if k not in {"session_id", "rid", "cached_tokens"}}


# ---- smg: replay data forwarded, sessions sticky -------------------------------------------------------------------
async def test_replay_session_through_smg_matches_direct(
    smg: Stack, gateway: Service, clean_workers: list[httpx.AsyncClient]
) -> None:
    async with gateway_client(smg.gateway) as via_router, gateway_client(gateway) as direct:
        routed_sid, direct_sid = new_id("smg"), new_id("direct")
        routed_turns = await play_replay_session(via_router, routed_sid)
        direct_turns = await play_replay_session(direct, direct_sid)
        assert [comparable(t) for t in routed_turns] == [comparable(t) for t in direct_turns]
        assert routed_turns[1]["routed_experts_start_len"] > 0  # incremental replay went through the router
        routed, reference = await sample_arrays(via_router, routed_sid), await sample_arrays(direct, direct_sid)
    assert set(routed) == set(reference)
    assert {"rollout_routed_experts", "rollout_top_p_token_ids", "rollout_top_p_token_offsets"} <= set(routed)
    for name, array in reference.items():
        assert routed[name].dtype == array.dtype, name
        np.testing.assert_array_equal(routed[name], array, err_msg=name)
    # The worker saw the replay fields exactly as the gateway sent them (smg forwards them).
    sent = [
        e["body"] for log in await generate_log(clean_workers) for e in log if e["body"]["rid"].startswith(routed_sid)
    ]
    assert [b.get("routed_experts_start_len", 0) for b in sent] == [t["routed_experts_start_len"] for t in routed_turns]
    assert all(
        b["return_routed_experts"] and b["sampling_params"]["custom_params"] == TOP_P["custom_params"] for b in sent
    )


async def test_smg_keeps_each_session_on_one_worker(smg: Stack, clean_workers: list[httpx.AsyncClient]) -> None:
    sids = [new_id(f"sticky{i}") for i in range(24)]

    async def play(gw: httpx.AsyncClient, sid: str) -> None:
        await create_session(gw, sid)
        await model_turn(gw, sid)
        await append_tool(gw, sid, TOOL)
        await model_turn(gw, sid)
        await model_turn(gw, sid, sampling_params={"max_new_tokens": 3})

    async with gateway_client(smg.gateway) as gw:
        await asyncio.gather(*(play(gw, sid) for sid in sids))
    logs = await generate_log(clean_workers)
    placement: dict[str, list[int]] = {}
    for index, log in enumerate(logs):
        for entry in log:
            key = entry["headers"].get("x-smg-routing-key")
            assert key and entry["body"]["rid"].startswith(f"{key}-"), entry
            placement.setdefault(key, []).append(index)
    assert sorted(placement) == sorted(sids)
    for sid, where in placement.items():
        assert len(where) == 3 and len(set(where)) == 1, f"{sid} was served by workers {where}"
    assert {where[0] for where in placement.values()} == {0, 1}, "24 sessions should spread over both workers"


# ---- sglang-router 0.3.2: replay fields dropped, the gateway says so ------------------------------------------------
@pytest.mark.parametrize("replay", ["routed_experts", "top_p"])
async def test_sglang_router_dropping_replay_data_is_a_clear_502(
    sglang_router: Stack, clean_workers: list[httpx.AsyncClient], replay: str
) -> None:
    routing = replay == "routed_experts"
    async with gateway_client(sglang_router.gateway) as gw:
        sid = await create_session(gw, new_id("dropped"), moe=routing)
        if routing:  # (top-p replay must start with the first response token: no turn before it)
            await model_turn(gw, sid, return_routed_experts=False)  # what the old router does forward works
            await append_tool(gw, sid, TOOL)
        before = await full_view(gw, sid)
        response = await gw.post(f"/v1/sessions/{sid}/generate", json={} if routing else {"sampling_params": TOP_P})
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["type"] == "replay_data_dropped"
        assert "dropped upstream" in error["message"]
        assert error["missing"] == ("routed_experts" if routing else "top_p_token_ids")
        assert await full_view(gw, sid) == before
    sent = [e["body"] for log in await generate_log(clean_workers) for e in log if e["body"]["rid"].startswith(sid)]
    assert "return_routed_experts" not in sent[-1]
    assert "custom_params" not in sent[-1]["sampling_params"]


# ---- router failures reach the caller as clear gateway errors ------------------------------------------------------
async def test_worker_400_passes_through_as_client_error(
    any_router: Stack, clean_workers: list[httpx.AsyncClient]
) -> None:
    async with gateway_client(any_router.gateway) as gw:
        sid = await create_session(gw, new_id("rejected"), moe=False)
        await model_turn(gw, sid)
        before = await full_view(gw, sid)
        await inject_everywhere(clean_workers, "http_400")
        response = await gw.post(f"/v1/sessions/{sid}/generate", json={})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "upstream_rejected"
        assert error["upstream_status"] == 400
        assert "upstream answered 400" in error["message"] and "simulated bad request" in error["message"]
        assert await full_view(gw, sid) == before
        for client in clean_workers:
            await client.delete("/sim/faults")
        await model_turn(gw, sid)


# (router, status the gateway answers, its error type, status the router answered, the router's error code)
TIMEOUT_OUTCOMES = {
    "smg": (504, "upstream_timeout", 504, "call_upstream_timeout"),
    "sglang-router": (502, "upstream_error", 500, "call_upstream_request_error"),
}


async def test_worker_timeout_is_a_clear_5xx(any_router: Stack, clean_workers: list[httpx.AsyncClient]) -> None:
    status, error_type, upstream_status, code = TIMEOUT_OUTCOMES[any_router.router.kind.name]
    async with gateway_client(any_router.gateway) as gw:
        sid = await create_session(gw, new_id("slow"), moe=False)
        before = await full_view(gw, sid)
        await inject_everywhere(clean_workers, "delay", count=-1, delay_s=SLOW_WORKER_S)
        response = await gw.post(f"/v1/sessions/{sid}/generate", json={})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == error_type
        assert error["upstream_status"] == upstream_status
        assert f"upstream answered {upstream_status} ({code})" in error["message"]
        assert await full_view(gw, sid) == before
    attempts = sum(len(log) for log in await generate_log(clean_workers))
    assert attempts == 2, "the router tries twice (--retry-max-retries 2) before giving up"


@pytest.mark.parametrize("kind", [SMG, SGLANG_ROUTER], ids=lambda kind: kind.name)
async def test_all_workers_down_is_503(kind: RouterKind) -> None:
    require(kind)
    policy = "consistent_hashing" if kind is SMG else "round_robin"
    with ExitStack() as worker_processes:
        workers = tuple(worker_processes.enter_context(run_simulator()) for _ in range(2))
        with run_stack(kind, workers, policy, *HEALTH_FLAGS) as stack:
            async with gateway_client(stack.gateway) as gw:
                sid = await create_session(gw, new_id("down"), moe=False)
                await model_turn(gw, sid)
                before = await full_view(gw, sid)
                worker_processes.close()
                if kind is SMG:  # before its health checks notice, smg says it could not connect: still a 503
                    response = await gw.post(f"/v1/sessions/{sid}/generate", json={})
                    assert response.status_code == 503, response.text
                    assert response.json()["error"]["type"] == "upstream_unavailable"
                await wait_not_ready(stack.router)
                response = await gw.post(f"/v1/sessions/{sid}/generate", json={})
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["type"] == "upstream_unavailable"
                assert error["upstream_status"] == 503
                assert "(no_available_workers)" in error["message"]
                assert await full_view(gw, sid) == before


async def wait_not_ready(router: Router, timeout: float = 10.0) -> None:
    """Until the router's health checks have marked every worker down (`/readiness` stops answering 200)."""
    async with httpx.AsyncClient(base_url=router.url, timeout=2) as client:
        for _ in range(int(timeout / 0.1)):
            if (await client.get("/readiness")).status_code != 200:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"router {router.url} still ready {timeout} s after its workers stopped")
