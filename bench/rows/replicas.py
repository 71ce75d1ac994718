"""Row 15: model turns per second with two gateway replicas sharing one Redis against one, under concurrent agents.

``sessions`` agent loops run at once, each doing ``loops`` times: ``POST /v1/sessions`` (a ``prompt_tokens``
prompt), ``/generate`` (``turn_tokens``), ``/append`` (``tool_tokens``), ``/generate`` (``turn_tokens``), ``GET
/sample``, ``DELETE``; every request waits for the one before it, as an agent's do. The same load goes to:

- **1 replica**: one gateway on the Redis store;
- **2 replicas, sticky**: two gateways on the same Redis (same prefix), session ``i``'s requests all to replica
  ``i % 2`` (a load balancer keyed on the session id): each replica serves its sessions from its own cached copy;
- **2 replicas, alternating**: request ``j`` of session ``i`` to replica ``(i + j) % 2`` (a load balancer without
  stickiness, at its worst): every request lands on the replica that did not write the session last, which
  reloads it from Redis (its version moved on);
- **1 replica, memory store**: the gateway as deployed, for what the Redis store costs under this load.

All against one simulator. The modes take turns, their order rotating every round; the throughput of each mode is
the median over the rounds. CPU per model turn of every process (``/proc/<pid>/task/*/schedstat``), to show where
the machine's cores went. No goal: on a machine with few cores the replicas, the simulator, Redis and the load
generator share them, so the number says what this machine does, not what replicas scale to.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, percentile, ratio, rotation
from bench.rows.redis_turn import sample_tokens
from bench.services import ServerProcess, read_body
from bench.workload import TOP_P_FLAG, prompt_ids
from slime_wire.http1 import ConnectionPool

NAME = "2 replicas vs 1"
ONE, STICKY, ALTERNATING, MEMORY = "1 replica", "2 replicas, sticky", "2 replicas, alternating", "1 replica, memory"
MODES = (ONE, STICKY, ALTERNATING, MEMORY)


class Load:
    """The agent loops, and where each of their requests goes in each mode."""

    def __init__(self, ctx: Context) -> None:
        shape, moe = ctx.suite.replicas, ctx.suite.moe
        self.shape = shape
        services = ctx.services
        self.replicas = [
            services.redis_gateway("gateway (Redis store, A)"),
            services.redis_gateway("gateway (Redis store, B)"),
        ]
        self.memory = services.gateway
        self.processes: dict[str, ServerProcess] = {
            "replica A": self.replicas[0],
            "replica B": self.replicas[1],
            "memory gateway": self.memory,
            "simulator": services.simulator,
            "redis-server": services.redis,
        }
        self.pools = {
            gw.url: ConnectionPool(gw.url, max_connections=shape.sessions, connect_timeout_s=5, pool_timeout_s=60)
            for gw in (*self.replicas, self.memory)
        }
        sampling = {"ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
        self.create = {"num_layers": moe.layers, "moe_router_topk": moe.topk, "sampling_defaults": sampling}
        self.turn = {"sampling_params": {"max_new_tokens": shape.turn_tokens}}
        self.tool = {"token_ids": prompt_ids(shape.tool_tokens, seed=3)}
        self.total = shape.prompt_tokens + 2 * shape.turn_tokens + shape.tool_tokens

    def pool(self, mode: str, session: int, request: int) -> ConnectionPool:
        if mode == MEMORY:
            gateway = self.memory
        elif mode == ONE:
            gateway = self.replicas[0]
        elif mode == STICKY:
            gateway = self.replicas[session % 2]
        else:
            gateway = self.replicas[(session + request) % 2]
        return self.pools[gateway.url]

    async def agent(self, mode: str, session: int, loops: int, latencies: list[float]) -> None:
        prompt = {"prompt_ids": prompt_ids(self.shape.prompt_tokens, seed=100 + session)}
        for _ in range(loops):
            created = orjson.loads(
                await read_body(self.pool(mode, session, 0), "POST", "/v1/sessions", self.create | prompt)
            )
            path = f"/v1/sessions/{created['session_id']}"
            steps = [("POST", "generate", self.turn), ("POST", "append", self.tool), ("POST", "generate", self.turn)]
            for request, (method, route, body) in enumerate(steps, start=1):
                started = time.perf_counter()
                raw = await read_body(self.pool(mode, session, request), method, f"{path}/{route}", body)
                if route == "generate":
                    latencies.append(time.perf_counter() - started)
            if orjson.loads(raw)["total_tokens"] != self.total:
                raise RuntimeError(f"{mode}: the second turn ended at {raw[-300:]!r}, not {self.total} tokens")
            sample = await read_body(self.pool(mode, session, 4), "GET", f"{path}/sample")
            if sample_tokens(sample) != self.total:
                raise RuntimeError(f"{mode}: the sample holds {sample_tokens(sample)} tokens, not {self.total}")
            await read_body(self.pool(mode, session, 5), "DELETE", path)

    async def phase(self, mode: str, loops: int) -> dict[str, Any]:
        """Every session's ``loops`` loops at once: model turns per second, latencies, CPU per model turn."""
        latencies: list[float] = []
        cpu = {name: process.cpu_seconds() for name, process in self.processes.items()}
        client, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(self.agent(mode, i, loops, latencies) for i in range(self.shape.sessions)))
        wall = time.perf_counter() - started
        turns = len(latencies)
        used = {name: (process.cpu_seconds() - cpu[name]) / turns for name, process in self.processes.items()}
        used["load generator"] = (time.process_time() - client) / turns
        return {"turns per s": turns / wall, "latencies": latencies, "cpu": used, "wall": wall}

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


async def measure(ctx: Context) -> dict[str, list[dict[str, Any]]]:
    shape = ctx.suite.replicas
    load = Load(ctx)
    got: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm-up: connections, first-use costs in every process
            await load.phase(mode, 1)
        for round_number in range(shape.rounds):
            for mode in rotation(MODES, round_number):
                got[mode].append(await load.phase(mode, shape.loops))
            log(
                f"row 15: round {round_number + 1}/{shape.rounds}: model turns/s "
                + ", ".join(f"{mode} {got[mode][-1]['turns per s']:.1f}" for mode in MODES)
            )
    finally:
        await load.aclose()
    return got


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.replicas
    got = uvloop.run(measure(ctx))
    rate = {mode: median([phase["turns per s"] for phase in phases]) for mode, phases in got.items()}

    def paired(mode: str, base: str) -> float:
        """The median over the rounds of each round's ratio: a slow spell on the machine hits one round's modes,
        not one mode."""
        pairs = zip(got[mode], got[base], strict=True)
        return median([ratio(a["turns per s"], b["turns per s"]) for a, b in pairs])

    p50 = {mode: percentile([x for p in phases for x in p["latencies"]], 50) * 1e3 for mode, phases in got.items()}
    p99 = {mode: percentile([x for p in phases for x in p["latencies"]], 99) * 1e3 for mode, phases in got.items()}

    def cpu(mode: str, name: str) -> float:
        return median([phase["cpu"][name] for phase in got[mode]]) * 1e3

    def gateways(mode: str) -> float:
        return sum(cpu(mode, name) for name in ("replica A", "replica B", "memory gateway"))

    rates = ", ".join(f"{mode} {rate[mode]:.1f}" for mode in MODES)
    latency = ", ".join(f"{mode} {p50[mode]:.0f} / {p99[mode]:.0f} ms" for mode in MODES)
    spent = "; ".join(
        f"{mode}: gateways {gateways(mode):.1f}, Redis {cpu(mode, 'redis-server'):.1f}, simulator "
        f"{cpu(mode, 'simulator'):.1f}, load generator {cpu(mode, 'load generator'):.1f} ms"
        for mode in MODES
    )
    tokens = shape.prompt_tokens + 2 * shape.turn_tokens + shape.tool_tokens
    return RowResult(
        number=15,
        name=NAME,
        measured=(
            f"{shape.sessions} concurrent agents, model turns/s (median of {shape.rounds} rounds): {rates}; turn "
            f"latency p50 / p99: {latency}; CPU per model turn: {spent}"
        ),
        checks=[
            Check("2 sticky/1", paired(STICKY, ONE), None, higher_is_better=True),
            Check("2 alternating/1", paired(ALTERNATING, ONE), None, higher_is_better=True),
            Check("1 Redis/1 memory", paired(ONE, MEMORY), None, higher_is_better=True),
        ],
        notes=[
            f"each agent loop: a {shape.prompt_tokens}-token prompt, a {shape.turn_tokens}-token model turn, "
            f"{shape.tool_tokens} tool tokens appended, a second {shape.turn_tokens}-token model turn ({tokens} "
            f"tokens), the sample fetched and checked, the session deleted; {ctx.suite.moe.describe()}, routing + "
            f"top-p replay; {shape.sessions} agents at once, {shape.loops} loops each per measurement, every "
            "request after the one before it",
            "the replicas: two gateway processes with GATEWAY_STORE on the same redis-server (in memory, no "
            "persistence) and the default prefix, before the one simulator; sticky: a session's requests all to "
            "one replica (half the sessions each); alternating: each request of a session to the other replica "
            "than the one before, so each one reloads the session from Redis (the cross-replica path at its "
            "worst); 1 replica: replica A alone; memory: the in-memory gateway as deployed",
            "no goal: the ratios are reported. On this machine (see Machine) the replicas, the simulator, "
            "redis-server and the load generator (this process, uvloop, slime_wire's client) share the cores; a "
            "second replica helps only where the gateways' CPU, not the simulator's or the cores', is the limit",
            f"{shape.rounds} rounds after one warm-up loop in each mode, the modes' order rotating every round; "
            "throughput: model turns over the phase's wall time, the median over the rounds; the ratios: the median "
            "of each round's ratio (a slow spell on the machine slows one round, not one mode); latency: the "
            "generate requests, all rounds; CPU per model turn: each process's run time "
            "(/proc/<pid>/task/*/schedstat; this process's time.process_time for the load generator) over the "
            "phase, divided by its model turns (each figure covers every request of the loop, not only the "
            "turns), medians",
        ],
    )
