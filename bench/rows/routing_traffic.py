"""Row 4: upstream answer bytes over a multi-turn session, incremental routing replay vs the whole history.

Two gateway processes in front of the same simulator, identical but for ``GATEWAY_INCREMENTAL_ROUTING``; the
same session (prompt, model turns, tool turns between) runs through each. The bytes are the gateways' own count
of the upstream answers they decoded, ``gateway_decoded_bytes_total{kind="answer"}`` from ``/metrics`` (read
before and after, so earlier traffic does not count). Both sessions must end with the same sample.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
from safetensors.numpy import load as load_safetensors

from bench.core import Check, Context, RowResult, log
from bench.workload import TOP_P_FLAG, MultiTurnShape, prompt_ids
from slime_client import GatewayClient

NAME = "multi-turn routing traffic"
DECODED_ANSWER_BYTES = re.compile(rb'^gateway_decoded_bytes_total\{kind="answer"\} (\S+)$', re.MULTILINE)


async def decoded_answer_bytes(client: httpx.AsyncClient, url: str) -> float:
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    found = DECODED_ANSWER_BYTES.search(response.content)
    return float(found.group(1)) if found else 0.0


async def run_session(url: str, shape: MultiTurnShape, layers: int, topk: int) -> bytes:
    """One agent rollout: model turn, tool turn, model turn, ...; returns the compact sample's bytes."""
    sampling = {"max_new_tokens": shape.turn_tokens, "ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
    async with GatewayClient(url) as gateway:
        session = await gateway.create_session(
            prompt_ids=prompt_ids(shape.prompt_tokens, seed=4), num_layers=layers, moe_router_topk=topk
        )
        for turn in range(shape.turns):
            if turn:
                await session.append(prompt_ids(shape.tool_tokens, seed=100 + turn), text="<tool>...</tool>")
            await session.generate(sampling)
        async with httpx.AsyncClient(timeout=60) as raw:
            sample = await raw.get(f"{url}/v1/sessions/{session.session_id}/sample")
        await session.delete()
    return sample.content


async def measure(ctx: Context) -> dict[str, float]:
    shape, moe = ctx.suite.multiturn, ctx.suite.moe
    urls = {"incremental": ctx.services.gateway.url, "full": ctx.services.gateway_full_routing.url}
    out: dict[str, float] = {}
    samples: dict[str, bytes] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for name, url in urls.items():
            log(f"row 4: {shape.turns}-turn session through the gateway with {name} routing")
            before = await decoded_answer_bytes(client, url)
            samples[name] = await run_session(url, shape, moe.layers, moe.topk)
            out[name] = await decoded_answer_bytes(client, url) - before
    out["same_sample"] = float(same_tensors(samples["incremental"], samples["full"]))
    return out


def same_tensors(a: bytes, b: bytes) -> bool:
    """Equal sample tensors (the metadata differs: session ids, and the simulator's prefix-cache counters)."""
    left, right = load_safetensors(a), load_safetensors(b)
    return left.keys() == right.keys() and all(np.array_equal(left[k], right[k]) for k in left)


def run(ctx: Context) -> RowResult:
    got = asyncio.run(measure(ctx))
    share = got["incremental"] / got["full"] if got["full"] else float("nan")
    if not got["same_sample"]:
        raise AssertionError("the two gateways ended with different samples")
    shape = ctx.suite.multiturn
    return RowResult(
        number=4,
        name=NAME,
        measured=(
            f"incremental {got['incremental'] / 2**20:.1f} MiB, full history {got['full'] / 2**20:.1f} MiB "
            f"of upstream answers"
        ),
        checks=[Check("incremental/full", share, 1 / 3, higher_is_better=False)],
        notes=[
            f"session: {shape.describe(ctx.suite.moe)}, top-p replay on",
            "two gateway processes against one simulator process, one with GATEWAY_INCREMENTAL_ROUTING=false; bytes "
            'from each gateway\'s gateway_decoded_bytes_total{kind="answer"} (before/after delta); both sessions end '
            "with identical sample tensors (checked)",
        ],
    )
