"""Row 3: trainer-side CPU to get one sample's training tensors: the SDK vs slime's path from the raw JSON.

The goal's ratio is measured from bytes in memory on both sides (the materialization itself; what travels is row
2): the reference turns the raw ``/generate`` JSON into the sample's tensors (``bench.reference``: json.loads, list
comprehensions, pybase64 + torch.frombuffer, list appends, torch.tensor of the lists), the SDK turns the gateway's
safetensors bytes for the same sample into ``RolloutSample`` tensors. CPU time (``time.process_time``), best of
N, interleaved. Next to it, the same over real HTTP on 127.0.0.1 (httpx in this process, the servers in their
own): the reference's POST /generate to the simulator vs the SDK's ``Session.fetch`` (and its whole
create + generate + fetch conversation), where httpx's receive cost per byte weighs on both sides.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx
import torch

from bench.core import Check, Context, RowResult, interleaved_best, log, ratio
from bench.reference import ReferenceSample
from bench.workload import TOP_P_FLAG, generate_request, prompt_ids
from gateway.codec import decode_generate_response
from gateway.sample import MoEShape, SessionSample
from gateway.store import Session as GatewaySession
from gateway.views import sample_payload
from slime_client import GatewayClient
from slime_client.sample import RolloutSample

NAME = "trainer-side materialization"
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


def check_same(sdk: RolloutSample, reference: dict[str, torch.Tensor]) -> None:
    assert torch.equal(sdk.tokens, reference["tokens"])
    assert torch.equal(sdk.loss_mask, reference["loss_mask"])
    assert torch.equal(sdk.rollout_log_probs, reference["rollout_log_probs"])
    routed = sdk.routed_experts_int32()
    assert routed is not None and torch.equal(routed, reference["rollout_routed_experts"])
    if "rollout_top_p_token_ids" in reference:
        assert sdk.rollout_top_p_token_ids is not None and sdk.rollout_top_p_token_offsets is not None
        assert torch.equal(sdk.rollout_top_p_token_ids, reference["rollout_top_p_token_ids"])
        assert torch.equal(sdk.rollout_top_p_token_offsets, reference["rollout_top_p_token_offsets"])


async def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.answer
    moe = shape.moe
    prompt = prompt_ids(shape.prompt_tokens)
    body = generate_request(prompt, shape.response_tokens, routing=True, top_p=shape.top_p)
    sampling = {"max_new_tokens": shape.response_tokens, "ignore_eos": True, "temperature": 1.0}
    if shape.top_p:
        sampling |= TOP_P_FLAG
    sim_url, gw_url = ctx.services.simulator.url, ctx.services.gateway.url
    best = {"reference": math.inf, "sdk_turn": math.inf, "sdk_fetch": math.inf}
    raw_size = sample_size = 0
    raw_answer = b""
    async with GatewayClient(gw_url) as gateway, httpx.AsyncClient(base_url=sim_url, timeout=HTTP_TIMEOUT) as sglang:
        for i in range(ctx.suite.materialize_repeat):
            log(f"row 3: round {i + 1}/{ctx.suite.materialize_repeat}")
            # reference: what slime's rollout process does per sample
            start = time.process_time()
            response = await sglang.post("/generate", json=body)
            response.raise_for_status()
            reference = ReferenceSample(tokens=list(prompt), num_layers=moe.layers, topk=moe.topk)
            reference.append_answer(response.content)
            tensors = reference.tensors()
            best["reference"] = min(best["reference"], time.process_time() - start)
            raw_answer = response.content
            raw_size = len(raw_answer)

            # SDK: the same sample through the gateway
            start = time.process_time()
            session = await gateway.create_session(prompt_ids=prompt, num_layers=moe.layers, moe_router_topk=moe.topk)
            await session.generate(sampling)
            sample = await session.fetch()
            best["sdk_turn"] = min(best["sdk_turn"], time.process_time() - start)

            start = time.process_time()
            sample = await session.fetch()
            best["sdk_fetch"] = min(best["sdk_fetch"], time.process_time() - start)
            check_same(sample, tensors)
            compact = await sglang.get(f"{gw_url}/v1/sessions/{session.session_id}/sample")
            sample_size = len(compact.content)
            await session.delete()
    return {**best, "raw_bytes": raw_size, "sample_bytes": sample_size, "raw_answer": raw_answer, "prompt": prompt}


def in_memory(ctx: Context, raw_answer: bytes, prompt: list[int], repeat: int) -> tuple[float, float]:
    """From bytes already in memory: (reference, SDK) best-of-``repeat`` CPU seconds, interleaved."""
    moe = ctx.suite.moe
    sample = SessionSample.from_prompt(prompt, MoEShape(moe.layers, moe.topk))
    sample.fold_model_turn(decode_generate_response(raw_answer, want_routing=True, want_top_p=ctx.suite.answer.top_p))
    compact = sample_payload(GatewaySession(session_id="bench", sample=sample)).encode()

    def reference() -> dict[str, torch.Tensor]:
        ref = ReferenceSample(tokens=list(prompt), num_layers=moe.layers, topk=moe.topk)
        ref.append_answer(raw_answer)
        return ref.tensors()

    check_same(RolloutSample.from_safetensors(compact), reference())
    best = interleaved_best({"reference": reference, "sdk": lambda: RolloutSample.from_safetensors(compact)}, repeat)
    return best["reference"], best["sdk"]


def run(ctx: Context) -> RowResult:
    log(f"row 3: {ctx.suite.answer.describe()}, over HTTP")
    got = asyncio.run(measure(ctx))
    log(f"row 3: in memory, best of {ctx.suite.decode_repeat}, interleaved")
    mem_reference, mem_sdk = in_memory(ctx, got["raw_answer"], got["prompt"], ctx.suite.decode_repeat)
    return RowResult(
        number=3,
        name=NAME,
        measured=(
            f"in memory: reference {mem_reference * 1e3:.1f} ms, SDK {mem_sdk * 1e3:.2f} ms; over HTTP: reference "
            f"{got['reference'] * 1e3:.1f} ms, SDK fetch {got['sdk_fetch'] * 1e3:.2f} ms "
            f"({ratio(got['reference'], got['sdk_fetch']):.0f}x), SDK create+generate+fetch "
            f"{got['sdk_turn'] * 1e3:.2f} ms ({ratio(got['reference'], got['sdk_turn']):.0f}x) (trainer CPU)"
        ),
        checks=[Check("less trainer CPU", ratio(mem_reference, mem_sdk), 50.0, higher_is_better=True)],
        notes=[
            f"sample: {ctx.suite.answer.describe()}; raw answer {got['raw_bytes'] / 2**20:.1f} MiB, compact sample "
            f"{got['sample_bytes'] / 2**20:.2f} MiB; both paths produce equal tensors (checked)",
            "the ratio: from bytes in memory (the materialization itself), time.process_time, best of "
            f"{ctx.suite.decode_repeat}, interleaved: reference = bench/reference.py on the raw JSON + torch.tensor of "
            "its lists; SDK = RolloutSample.from_safetensors on the gateway's sample bytes",
            "over HTTP on 127.0.0.1 (httpx in this process, the simulator and the gateway in their own; best of "
            f"{ctx.suite.materialize_repeat} interleaved rounds): reference = POST /generate + the same "
            "materialization; SDK = Session.fetch, and GatewayClient.create_session + Session.generate + "
            "Session.fetch for the whole conversation. Over HTTP, httpx's receive (~2-4 ms of CPU per MB here, on "
            "both sides) dominates: the SDK's CPU is then its transport, not the materialization",
        ],
    )
