"""Staleness you can see and bound: a branch's trained versions in its view, its sample's metadata and the SDK, and
``slime_client.staleness`` (drop the sample, or zero the loss mask of its too-stale tokens).

The policy's own unit tests run on samples made here; the end-to-end ones on a gateway whose simulator updates its
weights mid-answer (``/sim/weight_version`` with ``after_tokens``) and between turns."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator

from bench.reference import Sample
from slime_client import GatewayClient, RolloutSample, StalenessBound, within_bound
from slime_client.agent import GatewayAdapter
from slime_client.agent.settings import AgentSettings
from slime_client.staleness import keep_within, too_stale, versions_behind


# ---- the policy -------------------------------------------------------------------------------------------------
def made_sample(ids: list[int], mask: list[int], table: list[str]) -> RolloutSample:
    n = len(ids)
    return RolloutSample(
        session_id="s",
        status="completed",
        tokens=torch.arange(3 + n, dtype=torch.int32),
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
        rollout_log_probs=torch.full((n,), -0.5),
        response="",
        response_length=n,
        prompt_length=3,
        rollout_weight_version_ids=torch.tensor(ids, dtype=torch.int32),
        weight_version_table=table,
    )


@pytest.mark.parametrize(
    ("table", "newest", "behind"),
    [
        (["5", "7", "8"], None, [3, 1, 0]),  # integers: counted as updates, the newest met being 8
        (["5", "7", "8"], "10", [5, 3, 2]),  # the trainer's current version
        (["7", "5"], None, [0, 2]),  # met out of order: still the integers' distance
        (["a", "b", "c"], None, [2, 1, 0]),  # not integers: the order the sample met them
        (["a", "b", "c"], "b", [1, 0, 0]),  # a newest it met: the ones after it are not behind
        (["a", "b"], "z", [2, 1]),  # a newest it never met: one after the last
        (["3", "v4"], None, [1, 0]),  # one non-integer: order, for all
        ([], None, []),
    ],
)
def test_versions_behind(table: list[str], newest: str | None, behind: list[int]) -> None:
    assert versions_behind(table, newest) == behind


def test_the_mask_policy_zeroes_only_trained_tokens_past_the_bound() -> None:
    # tokens: v0 v0 tool v1 v2 unknown; versions "1", "2", "3"
    sample = made_sample([0, 0, -1, 1, 2, -1], [1, 1, 0, 1, 1, 1], ["1", "2", "3"])
    bound = StalenessBound(max_behind=1, policy="mask")
    stale = too_stale(sample, bound)
    assert stale is not None and stale.tolist() == [True, True, False, False, False, False]
    kept = within_bound(sample, bound)
    assert kept is not None and kept is not sample
    assert kept.loss_mask.tolist() == [0, 0, 0, 1, 1, 1]
    assert sample.loss_mask.tolist() == [1, 1, 0, 1, 1, 1]  # the fetched sample itself unchanged
    assert torch.equal(kept.rollout_log_probs, sample.rollout_log_probs) and torch.equal(kept.tokens, sample.tokens)
    kept.check_invariants()


def test_the_drop_policy_drops_a_sample_past_the_bound_and_keeps_one_within() -> None:
    old = made_sample([0, 1], [1, 1], ["1", "4"])
    fresh = made_sample([0, 1], [1, 1], ["3", "4"])
    bound = StalenessBound(max_behind=1)
    assert within_bound(old, bound) is None
    assert within_bound(fresh, bound) is fresh
    assert keep_within([old, fresh, old], bound) == [fresh]
    assert keep_within([old], None) == [old]


def test_a_stale_tool_token_or_an_unknown_version_is_never_too_stale() -> None:
    sample = made_sample([0, -1, 1], [0, 1, 1], ["1", "9"])
    assert within_bound(sample, StalenessBound(max_behind=0)) is sample
    no_versions = made_sample([0], [1], ["1"])
    no_versions.rollout_weight_version_ids = None
    assert within_bound(no_versions, StalenessBound(max_behind=0)) is no_versions


@pytest.mark.parametrize(("max_behind", "policy"), [(-1, "drop"), (True, "drop"), (1.0, "drop"), (1, "keep")])
def test_a_bad_bound_is_refused(max_behind: object, policy: str) -> None:
    with pytest.raises(ValueError, match=r"max_behind|policy"):
        StalenessBound(max_behind=max_behind, policy=policy)  # type: ignore[arg-type]


# ---- end to end: the gateway's view and metadata, the SDK's fetch -----------------------------------------------
@pytest.fixture(scope="module")
def services() -> Iterator[tuple[Service, Service]]:
    with run_simulator() as sim, run_gateway(sim.url, "--log-level", "warning") as gateway:
        yield sim, gateway


@pytest.fixture
async def gw(services: tuple[Service, Service]) -> AsyncIterator[GatewayClient]:
    sim, gateway = services
    assert httpx.post(f"{sim.url}/sim/reset").status_code == 200
    async with GatewayClient(gateway.url) as client:
        yield client


def update(sim: Service, version: str, after_tokens: int | None = None) -> None:
    body: dict[str, object] = {"weight_version": version}
    if after_tokens is not None:
        body["after_tokens"] = after_tokens
    assert httpx.post(f"{sim.url}/sim/weight_version", json=body).status_code == 200


async def test_a_branch_reports_and_the_sdk_bounds_the_versions_its_trained_tokens_span(
    gw: GatewayClient, services: tuple[Service, Service]
) -> None:
    sim, gateway = services
    session = await gw.create_session(prompt_ids=[4, 5, 6], num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
    exactly = {"ignore_eos": True}
    update(sim, "3", after_tokens=4)  # the first answer: 4 tokens on "sim-v0", then "3"
    await session.generate({"max_new_tokens": 6, **exactly})
    await session.append([7, 8])
    update(sim, "5")
    await session.generate({"max_new_tokens": 3, **exactly})
    trained = {"first": "sim-v0", "last": "5", "count": 3, "tokens": {"sim-v0": 4, "3": 2, "5": 3}, "unknown_tokens": 0}
    view = httpx.get(f"{gateway.url}/v1/sessions/{session.session_id}").json()
    assert view["trained_versions"] == trained and view["branches"][0]["trained_versions"] == trained
    sample = await session.fetch()
    assert sample.trained_versions == trained
    # "sim-v0" is not an integer: the order met (sim-v0, 3, 5); 2 behind the newest, "5".
    assert await session.fetch(staleness=StalenessBound(max_behind=2)) is not None
    assert await session.fetch(staleness=StalenessBound(max_behind=1)) is None
    masked = await session.fetch(staleness=StalenessBound(max_behind=1, policy="mask"))
    assert masked is not None
    assert masked.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert await session.fetch_all(staleness=StalenessBound(max_behind=0)) == []
    (kept,) = await session.fetch_all(staleness=StalenessBound(max_behind=0, policy="mask", newest="5"))
    assert int(kept.loss_mask.sum()) == 3


async def test_integer_versions_count_updates_and_a_fresh_session_has_none(
    gw: GatewayClient, services: tuple[Service, Service]
) -> None:
    sim, gateway = services
    update(sim, "7")
    session = await gw.create_session(prompt_ids=[1, 2])
    await session.generate({"max_new_tokens": 2, "ignore_eos": True})
    update(sim, "10")
    await session.generate({"max_new_tokens": 2, "ignore_eos": True})
    assert (await session.fetch()).trained_versions["count"] == 2
    # 10 - 7 = 3 updates behind: within 3, past 2
    assert await session.fetch(staleness=StalenessBound(max_behind=3)) is not None
    assert await session.fetch(staleness=StalenessBound(max_behind=2)) is None
    # behind the trainer's own version 11: 4 and 1
    masked = await session.fetch(staleness=StalenessBound(max_behind=2, policy="mask", newest="11"))
    assert masked is not None and masked.loss_mask.tolist() == [0, 0, 1, 1]
    empty = await gw.create_session(prompt_ids=[1, 2])
    none = {"first": None, "last": None, "count": 0, "tokens": {}, "unknown_tokens": 0}
    assert httpx.get(f"{gateway.url}/v1/sessions/{empty.session_id}").json()["trained_versions"] == none


# ---- the slime adapter: finish_session and generate's settings ------------------------------------------------------
async def test_finish_session_keeps_within_the_bound_it_is_given_or_the_adapters(
    gw: GatewayClient, services: tuple[Service, Service]
) -> None:
    """A session whose two answers come from weights "1" and "2": the adapter's bound (mask, 0 behind) stops
    training the first answer; a bound given to ``finish_session`` wins over it (drop: no sample; 1 behind: all)."""
    sim, gateway = services
    adapter = GatewayAdapter(gateway.url, staleness=StalenessBound(max_behind=0, policy="mask"), client=gw)

    async def two_versions() -> str:
        update(sim, "1")
        session = await gw.create_session(prompt_ids=[1, 2])
        await session.generate({"max_new_tokens": 2, "ignore_eos": True})
        update(sim, "2")
        await session.generate({"max_new_tokens": 2, "ignore_eos": True})
        return session.session_id

    (masked,) = await adapter.finish_session(await two_versions(), base_sample=Sample(), reward=1.0)
    assert list(masked.loss_mask) == [0, 0, 1, 1] and masked.reward == 1.0
    dropped = await adapter.finish_session(
        await two_versions(), base_sample=Sample(), staleness=StalenessBound(max_behind=0)
    )
    assert dropped == []
    (whole,) = await adapter.finish_session(
        await two_versions(), base_sample=Sample(), staleness=StalenessBound(max_behind=1)
    )
    assert list(whole.loss_mask) == [1, 1, 1, 1]


def test_generate_reads_its_bound_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = SimpleNamespace(gateway_url="http://127.0.0.1:1")
    assert AgentSettings.from_args(args).staleness is None
    monkeypatch.setenv("SLIME_AGENT_MAX_STALENESS", "2")
    monkeypatch.setenv("SLIME_AGENT_STALENESS_POLICY", "mask")
    assert AgentSettings.from_args(args).staleness == StalenessBound(2, "mask")
    for name, value in (("SLIME_AGENT_MAX_STALENESS", "-1"), ("SLIME_AGENT_STALENESS_POLICY", "zero")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            AgentSettings.from_args(args)
        monkeypatch.setenv(name, {"SLIME_AGENT_MAX_STALENESS": "2", "SLIME_AGENT_STALENESS_POLICY": "mask"}[name])
