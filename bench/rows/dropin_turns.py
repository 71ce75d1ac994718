"""Row 11: the slime drop-in, turn by turn, against slime's own path: trainer CPU per model turn over real HTTP.

One multi-turn sample per round, both ways on the same prompt and shapes, turns interleaved:
- the drop-in (``slime_client.slime.generate``) on a slime-like ``Sample``, through the gateway: each call is one
  request answered with the turn's own tensors (the first one creates the session);
- slime's own path: ``POST /generate`` to the simulator through httpx (as slime sends it) with the whole sequence and
  full routing replay (``routed_experts_start_len`` 0, as slime asks), then ``bench.reference`` folds the answer.
Trainer CPU (``time.process_time``) of each call; the medians over the rounds, per turn index.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from types import SimpleNamespace

import httpx
import torch

from bench.core import Check, Context, RowResult, log, ratio
from bench.reference import ReferenceSample, Sample
from bench.workload import TOP_P_FLAG, generate_request, prompt_ids
from slime_client import slime as dropin

NAME = "drop-in per turn"
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
GOAL_RATIO = 20.0
GOAL_FLAT = 1.2


async def one_round(ctx: Context, http: httpx.AsyncClient) -> tuple[list[float], list[float]]:
    """(drop-in CPU seconds per turn, reference CPU seconds per turn) for one sample of ``turns`` model turns."""
    shape, moe = ctx.suite.dropin, ctx.suite.moe
    prompt = prompt_ids(shape.prompt_tokens, seed=11)
    args = SimpleNamespace(
        gateway_url=ctx.services.gateway.url,
        use_rollout_routing_replay=True,
        num_layers=moe.layers,
        moe_router_topk=moe.topk,
        gateway_keep_sessions=True,  # a multi-turn sample (an agent): its session carries on between calls
    )
    sample = Sample(tokens=list(prompt))
    reference = ReferenceSample(tokens=list(prompt), num_layers=moe.layers, topk=moe.topk)
    mine, theirs = [], []
    for turn in range(shape.turns):
        budget = (turn + 1) * shape.turn_tokens  # slime's max_new_tokens covers the whole response
        params = {"max_new_tokens": budget, "ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
        started = time.process_time()
        await dropin.generate(args, sample, params)
        mine.append(time.process_time() - started)

        body = generate_request(reference.tokens, shape.turn_tokens, routing=True, top_p=True)
        started = time.process_time()
        response = await http.post("/generate", json=body)
        response.raise_for_status()
        reference.append_answer(response.content)
        theirs.append(time.process_time() - started)
    assert sample.tokens[: len(prompt)] == prompt and len(sample.tokens) == len(reference.tokens)
    assert tuple(sample.rollout_routed_experts.shape) == (len(sample.tokens) - 1, moe.layers, moe.topk)
    return mine, theirs


async def measure(ctx: Context) -> tuple[list[float], list[float]]:
    shape = ctx.suite.dropin
    per_turn_mine: list[list[float]] = [[] for _ in range(shape.turns)]
    per_turn_theirs: list[list[float]] = [[] for _ in range(shape.turns)]
    async with httpx.AsyncClient(base_url=ctx.services.simulator.url, timeout=HTTP_TIMEOUT) as http:
        for round_number in range(shape.rounds):
            mine, theirs = await one_round(ctx, http)
            for turn in range(shape.turns):
                per_turn_mine[turn].append(mine[turn])
                per_turn_theirs[turn].append(theirs[turn])
            log(
                f"row 11: round {round_number + 1}/{shape.rounds}: drop-in {sum(mine) * 1e3:.0f} ms, "
                f"slime's path {sum(theirs) * 1e3:.0f} ms of trainer CPU"
            )
    await dropin.close_clients()
    return [statistics.median(t) for t in per_turn_mine], [statistics.median(t) for t in per_turn_theirs]


def run(ctx: Context) -> RowResult:
    shape, moe = ctx.suite.dropin, ctx.suite.moe
    threads = torch.get_num_threads()
    # One torch thread on both sides: torch's intra-op workers spin after every parallel copy, and the spinning
    # (CPU time of the process, but no work) would be charged to whichever side called torch last.
    torch.set_num_threads(1)
    try:
        mine, theirs = asyncio.run(measure(ctx))
    finally:
        torch.set_num_threads(threads)
    # Turn 1 creates the session and carries the prompt's routing rows: later turns are compared with turn 2.
    first, last = mine[1], mine[-1]
    per_turn = ratio(sum(theirs), sum(mine))
    total_tokens = shape.prompt_tokens + shape.turns * shape.turn_tokens
    return RowResult(
        number=11,
        name=NAME,
        measured=(
            f"trainer CPU per turn, drop-in vs slime's path: turn 1 {mine[0] * 1e3:.2f} vs {theirs[0] * 1e3:.1f} ms, "
            f"turn 2 {first * 1e3:.2f} vs {theirs[1] * 1e3:.1f} ms, turn {shape.turns} {last * 1e3:.2f} vs "
            f"{theirs[-1] * 1e3:.1f} ms; all {shape.turns} turns {sum(mine) * 1e3:.1f} vs {sum(theirs) * 1e3:.0f} ms"
        ),
        checks=[
            Check("less trainer CPU per turn", per_turn, GOAL_RATIO, higher_is_better=True),
            Check(f"turn {shape.turns} / turn 2", ratio(last, first), GOAL_FLAT, higher_is_better=False),
        ],
        notes=[
            f"one sample: a {shape.prompt_tokens}-token prompt, {shape.turns} model turns of {shape.turn_tokens} "
            f"tokens ({total_tokens} tokens at the end), {moe.describe()}, routing + top-p replay; "
            f"{shape.rounds} rounds (a fresh sample each), medians per turn index",
            "drop-in: slime_client.slime.generate on a slime-like Sample (lists for tokens, loss mask and log-probs; "
            "torch tensors for top-p spans and routing, as slime keeps them) with gateway_keep_sessions (a "
            "multi-turn agent sample), so the session carries on between calls; each call is one request: the "
            "first creates the session with its turn, the others send a sync and are answered with the turn's own "
            "tensors (no history fetched; only the routing rows the turn brought)",
            "trainer CPU: time.process_time of each call, torch.set_num_threads(1) on both sides",
            "slime's path: httpx POST /generate to the simulator with the whole sequence, return_logprob, full "
            "routing replay and top-p replay, then bench/reference.py (slime's json.loads + list comprehensions + "
            "pybase64/torch.frombuffer + torch.cat fold); its cost grows with the sequence (the whole routing each "
            "turn)",
            "the flatness check compares turn 2 with the last turn (turn 1 also creates the session and carries "
            "the prompt's routing rows)",
        ],
    )
