"""Row 12: a training step's group in one call: ``GatewayClient.fetch_samples`` of many big samples.

A gateway process of its own holds ``samples`` sessions of the big shape (made with ``start_session``, one request
each). Then, in this process: trainer CPU of one ``fetch_samples`` of all of them, per sample, against slime's own
path for one such sample (httpx POST /generate to the simulator + ``bench.reference``'s fold, best of a few); and
memory on both sides while the group travels: the gateway's peak resident set (``VmHWM``) over its resident set
before the call, and this process's peak of traced allocations (``tracemalloc``: numpy's buffers are traced) over
the group's size.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from typing import Any

import httpx
import torch

from bench.core import Check, Context, RowResult, log, ratio
from bench.reference import ReferenceSample
from bench.services import ServerProcess
from bench.workload import TOP_P_FLAG, generate_request, prompt_ids
from slime_client import GatewayClient

NAME = "group fetch"
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
GOAL_RATIO = 50.0
GOAL_GATEWAY_EXTRA = 0.10  # the gateway's peak while sending, over its resident set before: of the group's bytes
# This process's peak of allocations during the first fetch, over the group's bytes: the receive buffer is the group
# once (1.0x); parsing the safetensors header (orjson's working memory for a JSON of every sample's metadata and text)
# adds ~0.2x for a moment. Two copies of the group would be 2x.
GOAL_CLIENT_PEAK = 1.5
REFERENCE_REPEAT = 3


def memory_kib(server: ServerProcess, key: str) -> int:
    with open(f"/proc/{server.pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{server.pid}/status")


def reset_peak(server: ServerProcess) -> None:
    """Start the process's VmHWM afresh from its current resident set (Linux: ``5`` to ``clear_refs``)."""
    with open(f"/proc/{server.pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


async def measure(ctx: Context, gateway: ServerProcess) -> dict[str, Any]:
    shape, moe = ctx.suite.group, ctx.suite.moe
    answer = ctx.suite.answer
    sampling = {"max_new_tokens": answer.response_tokens, "ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
    async with GatewayClient(gateway.url) as client:
        session_ids = []
        for i in range(shape.samples):
            turn = await client.start_session(
                prompt_ids=prompt_ids(answer.prompt_tokens, seed=100 + i),
                sampling_params=sampling,
                num_layers=moe.layers,
                moe_router_topk=moe.topk,
            )
            session_ids.append(turn.result.session_id)
        log(f"row 12: {shape.samples} sessions made")
        await client.fetch_samples(session_ids[:1])  # a connection open and warm
        reset_peak(gateway)
        rss_before = memory_kib(gateway, "VmRSS")
        tracemalloc.start()
        samples = await client.fetch_samples(session_ids)  # the first step: receive memory is new
        _, client_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        hwm_after = memory_kib(gateway, "VmHWM")
        cpu = float("inf")
        for _ in range(shape.steps):  # later steps, as a training loop runs: the last step's samples dropped first
            del samples
            started = time.process_time()
            samples = await client.fetch_samples(session_ids)
            cpu = min(cpu, time.process_time() - started)
        group_bytes = sum(
            sum(t.numel() * t.element_size() for t in (s.tokens, s.loss_mask, s.rollout_log_probs)) for s in samples
        ) + sum(
            t.numel() * t.element_size()
            for s in samples
            for t in (s.rollout_routed_experts, s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets)
            if t is not None
        )
        assert [s.session_id for s in samples] == session_ids
    gateway_extra = max(0, hwm_after - rss_before)
    async with httpx.AsyncClient(base_url=ctx.services.simulator.url, timeout=HTTP_TIMEOUT) as http:
        prompt = prompt_ids(answer.prompt_tokens, seed=100)
        body = generate_request(prompt, answer.response_tokens, routing=True, top_p=True)
        reference = float("inf")
        for _ in range(REFERENCE_REPEAT):
            started = time.process_time()
            response = await http.post("/generate", json=body)
            response.raise_for_status()
            sample = ReferenceSample(tokens=list(prompt), num_layers=moe.layers, topk=moe.topk)
            sample.append_answer(response.content)
            sample.tensors()
            reference = min(reference, time.process_time() - started)
    return {
        "cpu_per_sample": cpu / shape.samples,
        "reference": reference,
        "group_bytes": group_bytes,
        "client_peak": client_peak,
        "gateway_extra": gateway_extra * 1024,
    }


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.group
    gateway = ctx.services.extra_gateway("gateway (group fetch)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as row 11: no intra-op threads spinning on either side
    try:
        got = asyncio.run(measure(ctx, gateway))
    finally:
        torch.set_num_threads(threads)
    mib = got["group_bytes"] / 2**20
    return RowResult(
        number=12,
        name=NAME,
        measured=(
            f"{shape.samples} samples ({mib:.0f} MiB of tensors) in one call: {got['cpu_per_sample'] * 1e3:.2f} ms of "
            f"trainer CPU per sample vs slime's path {got['reference'] * 1e3:.1f} ms; gateway peak +"
            f"{got['gateway_extra'] / 2**20:.1f} MiB while sending, client peak {got['client_peak'] / 2**20:.0f} MiB"
        ),
        checks=[
            Check("less trainer CPU per sample", ratio(got["reference"], got["cpu_per_sample"]), GOAL_RATIO, True),
            Check("gateway extra / group", ratio(got["gateway_extra"], got["group_bytes"]), GOAL_GATEWAY_EXTRA, False),
            Check("client peak / group", ratio(got["client_peak"], got["group_bytes"]), GOAL_CLIENT_PEAK, False),
        ],
        notes=[
            f"{shape.samples} sessions of {ctx.suite.answer.describe()}, made with start_session on a gateway process "
            "of its own (so its peak resident set belongs to this row)",
            "trainer CPU: time.process_time of one GatewayClient.fetch_samples (POST /v1/samples, the group streamed "
            "by the gateway from the sessions' arrays, received into one numpy buffer that every tensor views), "
            f"divided by the group's size, best of {shape.steps} steps after the first, each after the previous "
            "step's samples were dropped (as a training loop does: the SDK then reuses that receive memory warm); "
            "slime's path: httpx POST /generate to the simulator + bench/reference.py's "
            f"fold + tensors for one sample of the same shape, best of {REFERENCE_REPEAT}; torch on one thread",
            "memory: the gateway's VmHWM after the call minus its VmRSS before (what sending the group added at its "
            "peak; an encoded copy of the group would add its whole size); this process: tracemalloc's peak during "
            "the first call (the one receive buffer, plus for a moment orjson's working memory for the header's JSON "
            "of every sample's metadata and response text, ~13x that JSON's size: ~0.8 MB per big sample)",
        ],
    )
