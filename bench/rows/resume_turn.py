"""Row 20: a turn the engine aborts half-way (a weight update's pause) and the gateway resumes, against the same turn
uninterrupted: what the resume costs the gateway.

The shared simulator and gateway. Each round creates two sessions on the same prompt and runs one token-level model
turn on each with ``"resume": true``, the order alternating: on one, the simulator's ``abort`` fault ends the answer
after half its tokens (with its routing and top-p data, as SGLang's abort does) and the gateway sends the
continuation (the tokens so far after the prompt, the length left, routing rows from where the aborted answer's end),
which the simulator answers with the rest of the same answer; the other runs uninterrupted. Both fold the same
``response_tokens`` tokens. The gateway's CPU per turn (its threads' run time, ``/proc``), unary and streamed; wall
times and the simulator's CPU beside them.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, ratio, rotation
from bench.rows.stream_turn import call
from bench.workload import TOP_P_FLAG, prompt_ids
from slime_wire.http1 import ConnectionPool

NAME = "resumed vs uninterrupted turn"
GOAL = 1.3
KINDS = ("uninterrupted", "resumed")


async def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.resume_turn
    simulator, gateway = ctx.services.simulator, ctx.services.gateway
    sampling = {"max_new_tokens": shape.response_tokens, "ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
    moe = ctx.suite.moe
    session = {"prompt_ids": prompt_ids(shape.prompt_tokens, seed=19), "num_layers": moe.layers}
    session["moe_router_topk"] = moe.topk
    gw = ConnectionPool(gateway.url, max_connections=4, connect_timeout_s=5, pool_timeout_s=5)
    sim = ConnectionPool(simulator.url, max_connections=2, connect_timeout_s=5, pool_timeout_s=5)
    cpu: dict[str, list[float]] = {}
    sim_cpu: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}

    async def turn(stream: bool, resumed: bool) -> float:
        created = orjson.loads(await call(gw, "POST", "/v1/sessions", session))
        path = f"/v1/sessions/{created['session_id']}"
        if resumed:
            await call(sim, "POST", "/sim/faults", {"mode": "abort"})  # the next answer ends half-way
        started = time.perf_counter()
        body = {"sampling_params": sampling, "stream": stream, "resume": True}
        tail = await call(gw, "POST", f"{path}/generate", body)
        elapsed = time.perf_counter() - started
        expected = b'"resumed":%d' % int(resumed)
        if b'"status":"truncated"' not in tail or expected not in tail:
            raise RuntimeError(f"the turn did not end as expected ({expected!r}): {tail[-300:]!r}")
        await call(gw, "DELETE", path)
        return elapsed

    for warm in KINDS:
        await turn(False, warm == "resumed")
        await turn(True, warm == "resumed")
    for round_number in range(shape.rounds):
        for stream in (False, True):
            mode = "stream" if stream else "unary"
            for kind in rotation(KINDS, round_number):
                key = f"{mode} {kind}"
                before, sim_before = gateway.cpu_seconds(), simulator.cpu_seconds()
                walls.setdefault(key, []).append(await turn(stream, kind == "resumed"))
                cpu.setdefault(key, []).append(gateway.cpu_seconds() - before)
                sim_cpu.setdefault(key, []).append(simulator.cpu_seconds() - sim_before)
        last = {key: values[-1] * 1e3 for key, values in cpu.items()}
        log(
            f"row 20: round {round_number + 1}/{shape.rounds}: gateway CPU uninterrupted / resumed: unary "
            f"{last['unary uninterrupted']:.1f} / {last['unary resumed']:.1f} ms, stream "
            f"{last['stream uninterrupted']:.1f} / {last['stream resumed']:.1f} ms"
        )
    await gw.aclose()
    await sim.aclose()
    return {"cpu": cpu, "sim_cpu": sim_cpu, "walls": walls}


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.resume_turn
    got = uvloop.run(measure(ctx))
    cpu = {key: median(values) * 1e3 for key, values in got["cpu"].items()}
    sim_cpu = {key: median(values) * 1e3 for key, values in got["sim_cpu"].items()}
    walls = {key: median(values) * 1e3 for key, values in got["walls"].items()}
    unary = ratio(cpu["unary resumed"], cpu["unary uninterrupted"])
    stream = ratio(cpu["stream resumed"], cpu["stream uninterrupted"])

    def pair(table: dict[str, float], mode: str, digits: int = 1) -> str:
        return f"{table[f'{mode} uninterrupted']:.{digits}f} / {table[f'{mode} resumed']:.{digits}f} ms"

    return RowResult(
        number=20,
        name=NAME,
        measured=(
            f"gateway CPU per turn, uninterrupted / resumed once: unary {pair(cpu, 'unary')} ({unary:.2f}x), "
            f"streamed {pair(cpu, 'stream')} ({stream:.2f}x); wall: unary {pair(walls, 'unary', 0)}, streamed "
            f"{pair(walls, 'stream', 0)}; simulator CPU: unary {pair(sim_cpu, 'unary', 0)}, streamed "
            f"{pair(sim_cpu, 'stream', 0)}"
        ),
        checks=[
            Check("resumed/uninterrupted gateway CPU per turn, unary", unary, GOAL, False),
            Check("resumed/uninterrupted gateway CPU per turn, streamed", stream, GOAL, False),
        ],
        notes=[
            f"turn: {shape.prompt_tokens}-token prompt + {shape.response_tokens} generated tokens, "
            f"{ctx.suite.moe.describe()}, routing + top-p replay, token-level with resume on; the resumed one is "
            "aborted by the simulator after half its tokens (its abort fault: the answer so far with its replay "
            "data) and resubmitted once: two answers decoded, the second request carries the prompt and the first "
            "half, routing rows asked from where the first answer's end, the two folded as one turn",
            f"{shape.rounds} rounds, the two kinds in alternating order, unary and streamed (a cumulative SSE chunk "
            "every --stream-chunk-tokens); gateway CPU from /proc/<pid>/task/*/schedstat around each turn (the event "
            "loop and the decode pool), medians; wall time from request to last byte",
        ],
    )
