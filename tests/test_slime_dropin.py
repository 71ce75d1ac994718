"""slime_client.slime.generate, the drop-in for slime's default generate, against the real gateway + simulator.

The oracle is slime's own path: the same requests sent straight to the simulator, folded by
``tests/slime_reference.py`` (slime's ``Sample.append_response_tokens`` in slime's style). The simulator is
deterministic in the input ids and sampling params, so both paths see the same answers.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from conftest import SIM_LAYERS, SIM_TOPK, Service
from procs import free_port
from slime_reference import ReferenceArgs, ReferenceSample

from bench.reference import Sample
from slime_client import GatewayClient, NotFoundError, RolloutSample
from slime_client import slime as dropin

PROMPT = [101, 102, 103, 104, 105]
TOOL = [950, 951, 952]
TOP_P = {"custom_params": {"return_top_p_token_ids": True}}
REFERENCE_ARGS = ReferenceArgs(num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)


def append_tool_tokens(sample: Sample, token_ids: list[int], text: str) -> None:
    """What an agent does with slime's ``append_response_tokens(trainable=False)``: mask 0, log-prob 0.0."""
    sample.tokens += token_ids
    sample.response += text
    sample.response_length += len(token_ids)
    sample.loss_mask = (sample.loss_mask or []) + [0] * len(token_ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [0.0] * len(token_ids)
    offsets = sample.rollout_top_p_token_offsets
    if offsets is not None:
        sample.rollout_top_p_token_offsets = torch.cat([offsets, offsets.new_full((len(token_ids),), int(offsets[-1]))])


def make_args(gateway_url: str, *, replay: bool = True, **extra: Any) -> SimpleNamespace:
    defaults = {"partial_rollout": False, "hf_checkpoint": "/no/such/checkpoint"}
    return SimpleNamespace(
        gateway_url=gateway_url,
        use_rollout_routing_replay=replay,
        num_layers=SIM_LAYERS,
        moe_router_topk=SIM_TOPK,
        **(defaults | extra),
    )


def new_sample(prompt: list[int] = PROMPT) -> tuple[Sample, ReferenceSample]:
    return Sample(tokens=list(prompt), session_id=f"dropin-{uuid.uuid4().hex[:12]}"), ReferenceSample(list(prompt))


async def slime_turn(sim: httpx.AsyncClient, ref: ReferenceSample, params: dict[str, Any], *, replay: bool) -> None:
    """slime's own generate: post to SGLang (here the simulator), fold the JSON answer into the sample."""
    params = dict(params, max_new_tokens=params["max_new_tokens"] - ref.response_length)
    payload: dict[str, Any] = {"input_ids": ref.tokens, "sampling_params": params, "return_logprob": True}
    if replay:
        payload["return_routed_experts"] = True
    output = (await sim.post("/generate", json=payload)).json()
    items = output["meta_info"]["output_token_logprobs"]
    ref.append_response_tokens(
        REFERENCE_ARGS,
        tokens=[item[1] for item in items],
        log_probs=[item[0] for item in items],
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )


def assert_like_slime(sample: Sample, ref: ReferenceSample) -> None:
    assert sample.tokens == ref.tokens
    assert sample.response == ref.response
    assert sample.response_length == ref.response_length
    assert sample.loss_mask == ref.loss_mask
    # The gateway keeps float32 log-probs (what training consumes; SGLang computes them in float32).
    assert sample.rollout_log_probs == torch.tensor(ref.rollout_log_probs, dtype=torch.float32).tolist()
    for name in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts"):
        mine, theirs = getattr(sample, name), getattr(ref, name)
        if theirs is None:
            assert mine is None, name
        else:
            assert mine.dtype == torch.int32, name
            assert torch.equal(mine, theirs.to(torch.int32)), name
    assert sample.status == Sample.Status(ref.status)
    assert sample.weight_versions == ref.weight_versions
    # cached_tokens depends on what the simulator's prefix cache saw before: compare the deterministic total.
    assert sample.prefix_cache_info.total_prompt_tokens == ref.total_prompt_tokens
    assert 0 <= sample.prefix_cache_info.cached_tokens <= sample.prefix_cache_info.total_prompt_tokens


@pytest.fixture(autouse=True)
async def shared_clients_closed() -> AsyncIterator[None]:
    yield
    await dropin.close_clients()


@pytest.fixture
async def sim(simulator: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=simulator.url, timeout=30) as client:
        yield client


@pytest.fixture
async def gw(gateway: Service) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(gateway.url, timeout=30) as client:
        yield client


async def sent_sampling_params(sim: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    log = (await sim.get("/sim/requests")).json()
    bodies = [r["body"] for r in log if str((r["body"] or {}).get("rid", "")).startswith(f"{session_id}-")]
    return [body["sampling_params"] | {"_start_len": body.get("routed_experts_start_len", 0)} for body in bodies]


# ---- single and multi turn ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("replay", "top_p"), [(True, True), (True, False), (False, True), (False, False)])
async def test_single_turn_leaves_sample_like_slime(
    gateway: Service, sim: httpx.AsyncClient, gw: GatewayClient, replay: bool, top_p: bool
) -> None:
    sample, ref = new_sample()
    params = {"max_new_tokens": 12, "temperature": 1.0, **(TOP_P if top_p else {})}
    returned = await dropin.generate(make_args(gateway.url, replay=replay), sample, params)
    await slime_turn(sim, ref, params, replay=replay)
    assert returned is sample
    assert_like_slime(sample, ref)
    assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    with pytest.raises(NotFoundError):  # a finished sample's session is deleted
        await gw.session(sample.session_id)


@pytest.mark.parametrize("keep_sessions", [True, False])
async def test_multi_turn_with_tool_tokens_and_routing_replay(
    gateway: Service, sim: httpx.AsyncClient, gw: GatewayClient, keep_sessions: bool
) -> None:
    args = make_args(gateway.url, gateway_keep_sessions=keep_sessions)
    params = {"max_new_tokens": 60, **TOP_P}
    sample, ref = new_sample()
    budgets = []
    for turn in range(3):
        budgets.append(params["max_new_tokens"] - sample.response_length)
        await dropin.generate(args, sample, params)
        await slime_turn(sim, ref, params, replay=True)
        assert_like_slime(sample, ref)
        if turn < 2:
            append_tool_tokens(sample, TOOL, f" <tool {turn}>")
            ref.append_response_tokens(REFERENCE_ARGS, tokens=TOOL, trainable=False, text=f" <tool {turn}>")
    assert sample.loss_mask.count(0) == 2 * len(TOOL)
    assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1

    sent = await sent_sampling_params(sim, sample.session_id)
    # The budget shrinks by the response so far, tool tokens included (as in slime).
    assert [s["max_new_tokens"] for s in sent] == budgets
    if keep_sessions:
        # One session for all turns: the tool tokens were appended to it, routing replay was incremental.
        assert all(s["_start_len"] > 0 for s in sent[1:])
        fetched = await (await gw.session(sample.session_id)).fetch()
        assert fetched.tokens.tolist() == sample.tokens
        assert fetched.loss_mask.tolist() == sample.loss_mask
    else:
        # Each turn finished the sample, so its session was dropped and the next call started a new one.
        assert all(s["_start_len"] == 0 for s in sent)
        with pytest.raises(NotFoundError):
            await gw.session(sample.session_id)


async def test_budget_shrinks_by_response_length(gateway: Service, sim: httpx.AsyncClient) -> None:
    args = make_args(gateway.url, gateway_keep_sessions=True)
    sample, _ = new_sample()
    params = {"max_new_tokens": 40}
    await dropin.generate(args, sample, params)
    append_tool_tokens(sample, TOOL, "")
    first_length = sample.response_length
    await dropin.generate(args, sample, params)
    sent = await sent_sampling_params(sim, sample.session_id)
    assert [s["max_new_tokens"] for s in sent] == [40, 40 - first_length]
    assert params == {"max_new_tokens": 40}  # the caller's dict is not modified


# ---- partial rollout ----------------------------------------------------------------------------------------------
async def test_partial_rollout_resumes_aborted_sample(
    gateway: Service, sim: httpx.AsyncClient, gw: GatewayClient, sim_faults: Callable[..., Any]
) -> None:
    args = make_args(gateway.url, partial_rollout=True)
    params = {"max_new_tokens": 20, "ignore_eos": True, **TOP_P}
    sample, ref = new_sample()

    await sim_faults("abort")
    await dropin.generate(args, sample, params)
    assert sample.status == Sample.Status.ABORTED
    aborted_length = sample.response_length
    assert 0 < aborted_length < 20
    assert (await gw.session(sample.session_id)).session_id == sample.session_id  # kept for the resume

    # slime's generate_and_rm with --mask-offpolicy-in-partial-rollout, before calling generate again:
    sample.loss_mask = [0] * sample.response_length
    await dropin.generate(args, sample, params)

    await sim_faults("abort")
    await slime_turn(sim, ref, params, replay=True)
    ref.loss_mask = [0] * ref.response_length
    await slime_turn(sim, ref, params, replay=True)
    assert_like_slime(sample, ref)
    assert sample.loss_mask == [0] * aborted_length + [1] * (20 - aborted_length)
    assert sample.status == Sample.Status.TRUNCATED and sample.response_length == 20
    sent = await sent_sampling_params(sim, sample.session_id)
    assert [s["max_new_tokens"] for s in sent] == [20, 20 - aborted_length]
    with pytest.raises(NotFoundError):  # finished now: session dropped
        await gw.session(sample.session_id)


async def test_partial_sample_whose_session_is_gone_is_recreated_from_its_tokens(
    gateway: Service, sim: httpx.AsyncClient, gw: GatewayClient, sim_faults: Callable[..., Any]
) -> None:
    args = make_args(gateway.url, partial_rollout=True)
    params = {"max_new_tokens": 20, "ignore_eos": True, **TOP_P}
    sample, ref = new_sample()
    await sim_faults("abort")
    await dropin.generate(args, sample, params)
    await (await gw.session(sample.session_id)).delete()  # e.g. the gateway restarted in between

    await dropin.generate(args, sample, params)
    await sim_faults("abort")
    await slime_turn(sim, ref, params, replay=True)
    await slime_turn(sim, ref, params, replay=True)
    assert_like_slime(sample, ref)


async def test_session_holding_other_tokens_is_recreated(
    gateway: Service, sim: httpx.AsyncClient, gw: GatewayClient
) -> None:
    sample, ref = new_sample()
    await gw.create_session(prompt_ids=[1, 2, 3], session_id=sample.session_id)  # a stale session, same key
    params = {"max_new_tokens": 10}
    await dropin.generate(make_args(gateway.url), sample, params)
    await slime_turn(sim, ref, params, replay=True)
    assert_like_slime(sample, ref)


# ---- no call at all ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_new_tokens", [8, 5])
async def test_exhausted_budget_marks_truncated_without_calling(max_new_tokens: int) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # any request would fail
    sample = Sample(tokens=[*PROMPT, 1, 2, 3, 4, 5, 6, 7, 8], response_length=8, status=Sample.Status.ABORTED)
    before = dict(vars(sample))
    returned = await dropin.generate(make_args(nowhere), sample, {"max_new_tokens": max_new_tokens})
    assert returned is sample and sample.status == Sample.Status.TRUNCATED
    assert {k: v for k, v in vars(sample).items() if k != "status"} == {
        k: v for k, v in before.items() if k != "status"
    }


# ---- configuration ------------------------------------------------------------------------------------------------
async def test_prompt_is_tokenized_when_tokens_are_empty(
    gateway: Service, monkeypatch: pytest.MonkeyPatch, gw: GatewayClient
) -> None:
    loaded: list[str] = []

    def fake_tokenizer(text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def fake_load(path: str) -> Callable[..., dict[str, list[int]]]:
        loaded.append(path)
        return fake_tokenizer

    monkeypatch.setattr(dropin, "_load_tokenizer", fake_load)
    args = make_args(gateway.url, gateway_keep_sessions=True)
    sample = Sample(prompt="hi!", session_id=f"dropin-{uuid.uuid4().hex[:12]}")
    await dropin.generate(args, sample, {"max_new_tokens": 4})
    assert sample.tokens[:3] == [ord("h"), ord("i"), ord("!")]
    assert loaded == [args.hf_checkpoint]
    assert (await (await gw.session(sample.session_id)).state()).prompt_length == 3


def test_missing_transformers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: importing it raises ImportError
    dropin._load_tokenizer.cache_clear()
    with pytest.raises(ImportError, match="transformers"):
        dropin.prompt_token_ids(make_args("http://unused"), "some prompt")
    with pytest.raises(TypeError, match="string"):
        dropin.prompt_token_ids(make_args("http://unused"), [{"role": "user", "content": "hi"}])


async def test_gateway_url_from_environment(gateway: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dropin.GATEWAY_URL_ENV, gateway.url)
    args = make_args(gateway.url)
    del args.gateway_url
    sample, _ = new_sample()
    await dropin.generate(args, sample, {"max_new_tokens": 3})
    assert sample.response_length > 0
    monkeypatch.delenv(dropin.GATEWAY_URL_ENV)
    with pytest.raises(ValueError, match=dropin.GATEWAY_URL_ENV):
        dropin.gateway_url(args)


async def test_session_id_assigned_when_missing(gateway: Service) -> None:
    sample = Sample(tokens=list(PROMPT))
    await dropin.generate(make_args(gateway.url), sample, {"max_new_tokens": 3})
    assert sample.session_id


def test_routing_replay_needs_the_moe_shape() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        dropin.routing_shape(SimpleNamespace(num_layers=None, moe_router_topk=8))


async def test_one_shared_client_per_loop_and_url() -> None:
    first = dropin.client_for("http://a.test")
    assert dropin.client_for("http://a.test") is first
    assert dropin.client_for("http://b.test") is not first
    await dropin.close_clients()
    assert first.is_closed
    assert dropin.client_for("http://a.test") is not first


# ---- RolloutSample.to_slime ---------------------------------------------------------------------------------------
async def test_to_slime_writes_slime_types(gw: GatewayClient) -> None:
    session = await gw.create_session(prompt_ids=PROMPT, num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
    first = await session.generate({"max_new_tokens": 8, **TOP_P})
    await session.append(TOOL, text=" <tool>")
    second = await session.generate({"max_new_tokens": 8})
    fetched: RolloutSample = await session.fetch()

    sample = fetched.to_slime(Sample(prompt="p"))
    assert sample.tokens == fetched.tokens.tolist() and all(type(t) is int for t in sample.tokens)
    assert sample.loss_mask == fetched.loss_mask.tolist() and all(type(m) is int for m in sample.loss_mask)
    assert all(type(p) is float for p in sample.rollout_log_probs)
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.response == first.text + " <tool>" + second.text
    assert sample.rollout_routed_experts.dtype == torch.int32
    assert tuple(sample.rollout_routed_experts.shape) == (len(sample.tokens) - 1, SIM_LAYERS, SIM_TOPK)
    assert sample.rollout_top_p_token_offsets.dtype == torch.int32
    assert len(sample.rollout_top_p_token_offsets) == sample.response_length + 1
    assert sample.status == Sample.Status(second.status)
    assert sample.weight_versions == [first.weight_version, second.weight_version]
    assert sample.prefix_cache_info.total_prompt_tokens == first.prompt_tokens + second.prompt_tokens
    assert sample.prefix_cache_info.cached_tokens == first.cached_tokens + second.cached_tokens
    assert sample.prompt == "p"  # fields the session does not own are left alone

    plain = fetched.to_slime(SimpleNamespace())  # no Status enum, no prefix_cache_info: still works
    assert plain.status == second.status


async def test_concurrent_group_shares_one_client(gateway: Service) -> None:
    args = make_args(gateway.url)
    group = [Sample(tokens=[200 + i, 201, 202], session_id=f"dropin-{uuid.uuid4().hex[:12]}") for i in range(8)]
    await asyncio.gather(*(dropin.generate(args, sample, {"max_new_tokens": 16}) for sample in group))
    for sample in group:
        assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs) > 0
        assert tuple(sample.rollout_routed_experts.shape) == (len(sample.tokens) - 1, SIM_LAYERS, SIM_TOPK)
    assert list(dropin._clients[asyncio.get_running_loop()]) == [(gateway.url, "")]  # (url, API key)


# ---- round trips ----------------------------------------------------------------------------------------------------
async def gateway_requests(gateway: Service) -> dict[str, float]:
    """``gateway_requests_total`` by ``METHOD route``, from the gateway's own /metrics."""
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        text = (await client.get("/metrics")).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_requests_total{"):
            labels, value = line[len("gateway_requests_total{") :].rsplit("} ", 1)
            fields = dict(item.split("=", 1) for item in labels.split(","))
            key = f"{fields['method'].strip(chr(34))} {fields['route'].strip(chr(34))}"
            counts[key] = counts.get(key, 0) + float(value)
    return counts


async def requests_during(gateway: Service, call: Callable[[], Any]) -> dict[str, float]:
    before = await gateway_requests(gateway)
    await call()
    after = await gateway_requests(gateway)
    changed = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    changed.pop("GET /metrics", None)  # the scrape itself
    return changed


GENERATE = "POST /v1/sessions/{session_id}/generate"


async def test_one_request_per_model_turn(gateway: Service, gw: GatewayClient) -> None:
    """A single-turn sample: one request in all (created, generated, deleted). Resumed turns: one each, never a fetch
    of the history; tokens the sample gained locally cost the append they need (after the refused sync)."""
    sample, _ = new_sample()
    single = await requests_during(
        gateway, lambda: dropin.generate(make_args(gateway.url), sample, {"max_new_tokens": 5})
    )
    assert single == {"POST /v1/sessions": 1}
    with pytest.raises(NotFoundError):
        await gw.session(sample.session_id)

    args = make_args(gateway.url, gateway_keep_sessions=True)
    sample, _ = new_sample()

    def turn(budget: int) -> Callable[[], Any]:  # slime's max_new_tokens covers the whole response: 4 more each time
        return lambda: dropin.generate(args, sample, {"max_new_tokens": budget, "ignore_eos": True})

    assert await requests_during(gateway, turn(4)) == {"POST /v1/sessions": 1}
    for budget in (8, 12, 16):
        assert await requests_during(gateway, turn(budget)) == {GENERATE: 1}
    append_tool_tokens(sample, TOOL, " <tool>")
    with_tool = await requests_during(gateway, turn(sample.response_length + 4))
    assert with_tool == {GENERATE: 2, "POST /v1/sessions/{session_id}/append": 1}
    fetched = await (await gw.session(sample.session_id)).fetch()
    assert fetched.tokens.tolist() == sample.tokens and fetched.loss_mask.tolist() == sample.loss_mask
