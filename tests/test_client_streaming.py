"""SDK streamed turns against the real gateway and a paced simulator: deltas, the final turn, early exits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator

from slime_client import GatewayClient, NotFoundError, Session, TurnDelta, TurnResult, UpstreamError

TOP_P = {"custom_params": {"return_top_p_token_ids": True}}


@pytest.fixture(scope="module")
def paced() -> Iterator[tuple[Service, Service]]:
    with run_simulator("--token-delay-ms", "4") as sim, run_gateway(sim.url) as gateway:
        yield sim, gateway


@pytest.fixture
async def gw(paced: tuple[Service, Service]) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(paced[1].url) as client:
        yield client


@pytest.fixture
async def sim(paced: tuple[Service, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=paced[0].url) as client:
        yield client
        await client.delete("/sim/faults")


async def wait_idle(gw: GatewayClient, session_id: str) -> None:
    session = await gw.session(session_id)
    for _ in range(200):
        if not (await session.state()).busy:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("session still busy")


async def test_stream_yields_deltas_then_the_folded_turn(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=[1, 2, 3], num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
    deltas: list[TurnDelta] = []
    async with session.generate({"max_new_tokens": 16, **TOP_P}, stream=True) as stream:
        async for event in stream:
            if isinstance(event, TurnDelta):
                deltas.append(event)
            else:
                assert isinstance(event, TurnResult)
    result = stream.result
    assert result is not None and len(deltas) >= 2
    assert [t for d in deltas for t in d.token_ids] == result.new_token_ids
    assert "".join(d.text for d in deltas) == result.text
    sample = await session.fetch()
    assert sample.tokens.tolist() == [1, 2, 3, *result.new_token_ids]
    sample.check_invariants()


async def test_final_helper_consumes_the_stream(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=[4, 5])
    result = await session.generate({"max_new_tokens": 6}, stream=True).final()
    assert result.completion_tokens == len(result.new_token_ids) > 0


async def test_breaking_out_leaves_the_session_aborted_but_coherent(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=[7, 8, 9], num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
    seen = 0
    async with session.generate({"max_new_tokens": 300, "ignore_eos": True, **TOP_P}, stream=True) as stream:
        async for event in stream:
            assert isinstance(event, TurnDelta)
            seen += len(event.token_ids)
            if seen >= 10:
                break
    await wait_idle(gw, session.session_id)
    state = await session.state()
    assert state.status == "aborted"
    assert seen <= state.response_length < 300
    sample = await session.fetch()
    sample.check_invariants()
    # The next turn continues from the partial state, and routing replay re-covers the aborted tokens.
    result = await session.generate({"max_new_tokens": 4})
    assert result.prompt_length == 3 + state.response_length
    sample = await session.fetch()
    sample.check_invariants()
    assert sample.rollout_routed_experts.shape[0] == len(sample.tokens) - 1


async def test_stream_errors_are_typed_with_the_partial_turn(gw: GatewayClient, sim: httpx.AsyncClient) -> None:
    session = await gw.create_session(prompt_ids=[1, 2])
    await sim.post("/sim/faults", json={"mode": "cut_stream"})
    with pytest.raises(UpstreamError) as caught:
        await session.generate({"max_new_tokens": 40, "ignore_eos": True}, stream=True).final()
    partial = caught.value.partial_turn
    assert isinstance(partial, TurnResult)
    assert partial.status == "aborted" and partial.completion_tokens > 0
    missing = Session(gw, "missing-session")
    with pytest.raises(NotFoundError):
        await missing.generate({}, stream=True).final()
