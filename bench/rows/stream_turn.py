"""Row 9: a streamed session turn against the same turn unary, wall time, on a big MoE answer.

The shared simulator (started with ``--stream-chunk-tokens`` (SGLang's cumulative chunks every N tokens, the routing and
top-p arrays on the last one) and the gateway in front of it. Each round creates two sessions on the same prompt and
runs one model turn on each, unary and ``"stream": true`` (the order alternating), timing the turn from request
to last byte; deleting the sessions is not timed. Beside it: the simulator answering the same two requests directly
(what the upstream itself takes), and the CPU each process spent per turn.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, ratio
from bench.services import ServerProcess
from bench.workload import TOP_P_FLAG, generate_request, prompt_ids
from slime_wire.http1 import ConnectionPool

NAME = "streamed vs unary turn"
JSON = [(b"content-type", b"application/json")]
TIMEOUT_S = 600.0


def cpu_seconds(process: ServerProcess) -> float:
    with open(f"/proc/{process.pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def call(pool: ConnectionPool, method: str, path: str, body: Any = None) -> bytes:
    """One request, its whole answer read (a stream to its end); returns the last 4 KiB of the body."""
    payload = b"" if body is None else orjson.dumps(body)
    response = await pool.request(method, path.encode(), JSON if body is not None else [], payload, timeout=TIMEOUT_S)
    tail = b""
    try:
        async for piece in response.iter_raw():
            tail = (tail + piece)[-4096:]
    finally:
        await response.aclose()
    if response.status >= 400:
        raise RuntimeError(f"{method} {path} -> {response.status}: {tail[-500:]!r}")
    return tail


async def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.stream_turn
    simulator, gateway = ctx.services.simulator, ctx.services.gateway
    prompt = prompt_ids(shape.prompt_tokens)
    sampling = {"max_new_tokens": shape.response_tokens, "ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
    moe = ctx.suite.moe
    session = {"prompt_ids": prompt, "num_layers": moe.layers, "moe_router_topk": moe.topk}
    gw = ConnectionPool(gateway.url, max_connections=4, connect_timeout_s=5, pool_timeout_s=5)
    sim = ConnectionPool(simulator.url, max_connections=4, connect_timeout_s=5, pool_timeout_s=5)
    walls: dict[str, list[float]] = {"unary": [], "stream": [], "direct unary": [], "direct stream": []}
    cpu: dict[str, list[float]] = {"gateway unary": [], "gateway stream": [], "sim unary": [], "sim stream": []}

    async def turn(stream: bool) -> float:
        created = orjson.loads(await call(gw, "POST", "/v1/sessions", session))
        path = f"/v1/sessions/{created['session_id']}"
        started = time.perf_counter()
        tail = await call(gw, "POST", f"{path}/generate", {"sampling_params": sampling, "stream": stream})
        elapsed = time.perf_counter() - started
        if b'"status":"truncated"' not in tail:  # ignore_eos: the turn ends at max_new_tokens, folded
            raise RuntimeError(f"the turn did not end as expected: {tail[-300:]!r}")
        await call(gw, "DELETE", path)
        return elapsed

    async def direct(stream: bool) -> float:
        body = generate_request(prompt, shape.response_tokens, routing=True, top_p=True) | {"stream": stream}
        started = time.perf_counter()
        await call(sim, "POST", "/generate", body)
        return time.perf_counter() - started

    for warm in (False, True):
        await turn(warm)
    for round_number in range(shape.rounds):
        for stream in (False, True) if round_number % 2 == 0 else (True, False):
            kind = "stream" if stream else "unary"
            gateway_cpu, sim_cpu = cpu_seconds(gateway), cpu_seconds(simulator)
            walls[kind].append(await turn(stream))
            cpu[f"gateway {kind}"].append(cpu_seconds(gateway) - gateway_cpu)
            cpu[f"sim {kind}"].append(cpu_seconds(simulator) - sim_cpu)
            walls[f"direct {kind}"].append(await direct(stream))
        log(
            f"row 9: round {round_number + 1}/{shape.rounds}: unary {walls['unary'][-1] * 1e3:.0f} ms, "
            f"stream {walls['stream'][-1] * 1e3:.0f} ms"
        )
    await gw.aclose()
    await sim.aclose()
    return {"walls": walls, "cpu": cpu}


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.stream_turn
    got = uvloop.run(measure(ctx))
    walls = {kind: median(values) * 1e3 for kind, values in got["walls"].items()}
    cpu = {kind: sum(values) / len(values) * 1e3 for kind, values in got["cpu"].items()}
    answer = f"{shape.prompt_tokens}-token prompt + {shape.response_tokens} generated tokens"
    through_gateway = ratio(walls["stream"], walls["unary"])
    upstream_alone = ratio(walls["direct stream"], walls["direct unary"])
    return RowResult(
        number=9,
        name=NAME,
        measured=(
            f"median wall, unary / streamed: via the gateway {walls['unary']:.0f} / {walls['stream']:.0f} ms "
            f"({through_gateway:.2f}x), the simulator alone {walls['direct unary']:.0f} / "
            f"{walls['direct stream']:.0f} ms ({upstream_alone:.2f}x); CPU per turn: gateway "
            f"{cpu['gateway unary']:.0f} / {cpu['gateway stream']:.0f} ms, simulator {cpu['sim unary']:.0f} / "
            f"{cpu['sim stream']:.0f} ms"
        ),
        checks=[
            Check("streamed/unary over the upstream's own", ratio(through_gateway, upstream_alone), 1.3, False),
        ],
        notes=[
            "the goal: what the gateway adds to a streamed turn, relative to a unary one. The ratio through the "
            "gateway is divided by the same ratio of the upstream alone: SGLang's cumulative chunks repeat every "
            "token so far, so a streamed answer is ~2.2x the bytes of a unary one and the simulator alone takes "
            "~1.8x as long to send it; on real hardware that is the GPU server's work, spread over generation",
            f"turn: {answer}, {ctx.suite.moe.describe()}, routing + top-p replay; a cumulative SSE chunk every "
            f"{shape.chunk_tokens} tokens (the simulator's --stream-chunk-tokens), routing and top-p arrays on the "
            "last",
            f"{shape.rounds} rounds, unary and streamed in alternating order; wall time of POST "
            "/v1/sessions/{id}/generate from request to last byte (slime_wire's client in this process), medians",
            "direct: the same requests to the simulator, read to the end by the same client; CPU per turn from "
            "/proc/<pid>/stat (10 ms ticks, averaged over the rounds)",
        ],
    )
