"""Row 14: a session turn on the Redis session store against the same turn on the in-memory one, on the big MoE turn.

Two gateways in front of the shared simulator: the one as deployed (``GATEWAY_STORE=memory``, the default) and one
with ``GATEWAY_STORE=redis://...`` on a redis-server of the bench's own (in memory, no persistence, 127.0.0.1).
Each round runs the same session on both, the order alternating:

- ``POST /v1/sessions`` on a ``prompt_tokens`` prompt;
- timed, turn 1: ``POST /generate`` of ``response_tokens`` (routing + top-p replay): the Redis store writes the
  whole sample, as it is the first write of its arrays;
- timed, turn 2: ``POST /append`` of ``tool_tokens`` and ``POST /generate`` of ``second_response_tokens``: each
  write ``APPEND``s only what the request added to the arrays, however long the session already is;
- timed, the ``GET /sample`` fetch (the replica holds the session: one version check, no array read);
- ``DELETE`` (not timed).

Around each timed step: the gateway's CPU and redis-server's (``/proc/<pid>/task/*/schedstat``), and Redis's
``INFO stats`` byte counters (``total_net_input_bytes``: what the gateway wrote; ``total_net_output_bytes``: what
it read), less what the bench's own ``INFO`` calls cost. The turn's new array bytes come from the session's view
(its arrays' shapes and dtypes) before and after the turn, read outside the timed windows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, ratio
from bench.services import RedisServer, ServerProcess, read_body
from bench.workload import TOP_P_FLAG, prompt_ids
from slime_wire.http1 import ConnectionPool

NAME = "Redis store per turn"
GOAL = 1.3
SMALL_GOAL = 1.1
MIB = 2**20


def array_bytes(view: dict[str, Any]) -> int:
    """The bytes of a session's arrays, from its view (shapes and dtypes): what a sample of it holds."""
    return sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize for a in view["arrays"].values())


def sample_tokens(raw: bytes) -> int:
    """The length of ``tokens`` in a safetensors sample (its header only)."""
    size = int.from_bytes(raw[:8], "little")
    return int(orjson.loads(raw[8 : 8 + size])["tokens"]["shape"][0])


class RedisMeter:
    """Redis's byte counters, round trips and CPU around a step, less what reading them costs."""

    def __init__(self, redis: RedisServer) -> None:
        self.redis = redis
        first, second = self.before(), self.after()  # back to back: the cost of our own INFO stats
        self.overhead = tuple(b - a for a, b in zip(first, second, strict=True))

    def before(self) -> tuple[int, int, int]:
        """Bytes in, bytes out, and round trips (``trips``), read so that the INFO commandstats calls (whose answers
        vary in size) fall outside the window between ``before`` and ``after``."""
        trips = self.trips()
        return (*self.bytes(), trips)

    def after(self) -> tuple[int, int, int]:
        return (*self.bytes(), self.trips())

    def bytes(self) -> tuple[int, int]:
        stats = self.redis.info("stats")
        return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])

    def trips(self) -> int:
        """The scripts Redis ran: each request of the gateway to Redis is one (EVALSHA, or EVAL the first time), the
        bytes staged beside it riding in the same trip."""
        commands = self.redis.info("commandstats")
        return sum(int(commands.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))

    def delta(self, before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(b - a - o for a, b, o in zip(before, after, self.overhead, strict=True))


class Sides:
    """One session's life on a gateway, its steps timed."""

    def __init__(self, ctx: Context, redis: RedisServer) -> None:
        shape, moe = ctx.suite.redis_turn, ctx.suite.moe
        self.shape = shape
        self.redis = redis
        self.meter = RedisMeter(redis)
        self.session = {"prompt_ids": prompt_ids(shape.prompt_tokens), "num_layers": moe.layers}
        self.session["moe_router_topk"] = moe.topk
        self.session["sampling_defaults"] = {"ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
        self.tool = {"token_ids": prompt_ids(shape.tool_tokens, seed=2), "text": "<tool>ok</tool>"}
        self.total = shape.prompt_tokens + shape.response_tokens + shape.tool_tokens + shape.second_response_tokens

    async def run(self, gateway: ServerProcess, pool: ConnectionPool) -> dict[str, float]:
        """One session: {step: wall s, step cpu: gateway CPU s, step redis cpu: s, step in / out: Redis bytes, step
        new: the array bytes it added}."""
        got: dict[str, float] = {}
        created = orjson.loads(await read_body(pool, "POST", "/v1/sessions", self.session))
        path = f"/v1/sessions/{created['session_id']}"
        try:
            before = array_bytes(orjson.loads(await read_body(pool, "GET", path)))
            first = {"sampling_params": {"max_new_tokens": self.shape.response_tokens}}
            second = {"sampling_params": {"max_new_tokens": self.shape.second_response_tokens}}
            steps: list[tuple[str, list[tuple[str, Any]]]] = [
                ("turn 1", [("generate", first)]),
                ("turn 2", [("append", self.tool), ("generate", second)]),
            ]
            for step, requests in steps:
                raw = await self.timed(got, step, gateway, [(pool, "POST", f"{path}/{r}", b) for r, b in requests])
                summary = orjson.loads(raw)
                if summary["status"] != "truncated":  # ignore_eos: each turn ends at max_new_tokens
                    raise RuntimeError(f"{step} did not end as expected: {raw[-300:]!r}")
                after = array_bytes(orjson.loads(await read_body(pool, "GET", path)))
                got[f"{step} new"], before = after - before, after
            got["session bytes"] = before
            sample = await self.timed(got, "fetch", gateway, [(pool, "GET", f"{path}/sample", None)])
            if sample_tokens(sample) != self.total:
                raise RuntimeError(f"the sample holds {sample_tokens(sample)} tokens, not {self.total}")
        finally:
            await read_body(pool, "DELETE", path)
        return got

    async def timed(
        self, got: dict[str, float], step: str, gateway: ServerProcess, requests: list[tuple[Any, ...]]
    ) -> bytes:
        counters, redis_cpu, cpu = self.meter.before(), self.redis.cpu_seconds(), gateway.cpu_seconds()
        started = time.perf_counter()
        for request in requests:
            raw = await read_body(*request)
        got[step] = time.perf_counter() - started
        got[f"{step} cpu"] = gateway.cpu_seconds() - cpu
        got[f"{step} redis cpu"] = self.redis.cpu_seconds() - redis_cpu
        got[f"{step} in"], got[f"{step} out"], got[f"{step} trips"] = self.meter.delta(counters, self.meter.after())
        return raw


async def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.redis_turn
    gateways = {"memory": ctx.services.gateway, "redis": ctx.services.redis_gateway("gateway (Redis store, A)")}
    pools = {
        kind: ConnectionPool(gw.url, max_connections=4, connect_timeout_s=5, pool_timeout_s=5)
        for kind, gw in gateways.items()
    }
    sides = Sides(ctx, ctx.services.redis)
    rounds: dict[str, list[dict[str, float]]] = {"memory": [], "redis": []}
    try:
        for kind in gateways:  # warm-up
            await sides.run(gateways[kind], pools[kind])
        for round_number in range(shape.rounds):
            for kind in ("memory", "redis") if round_number % 2 == 0 else ("redis", "memory"):
                rounds[kind].append(await sides.run(gateways[kind], pools[kind]))
            mem, red = rounds["memory"][-1], rounds["redis"][-1]
            log(
                f"row 14: round {round_number + 1}/{shape.rounds}: turn 1 memory {mem['turn 1'] * 1e3:.0f} ms, "
                f"Redis {red['turn 1'] * 1e3:.0f} ms; turn 2 memory {mem['turn 2'] * 1e3:.0f} ms, Redis "
                f"{red['turn 2'] * 1e3:.0f} ms ({red['turn 2 in'] / MIB:.2f} MiB written)"
            )
    finally:
        for pool in pools.values():
            await pool.aclose()
    return {kind: {key: [r[key] for r in got] for key in got[0]} for kind, got in rounds.items()}


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.redis_turn
    got = uvloop.run(measure(ctx))
    mem, red = got["memory"], got["redis"]

    def ms(side: dict[str, list[float]], key: str) -> float:
        return median(side[key]) * 1e3

    paired = {
        step: median([ratio(r, m) for r, m in zip(red[step], mem[step], strict=True)])
        for step in ("turn 1", "turn 2", "fetch")
    }
    written = {step: median(red[f"{step} in"]) / MIB for step in ("turn 1", "turn 2")}
    read = {step: median(red[f"{step} out"]) / 1024 for step in ("turn 1", "turn 2", "fetch")}
    new = {step: median(red[f"{step} new"]) / MIB for step in ("turn 1", "turn 2")}
    session_mib = median(red["session bytes"]) / MIB
    walls = "; ".join(
        f"{step} {ms(mem, step):.0f} / {ms(red, step):.0f} ms (paired {paired[step]:.2f}x)"
        for step in ("turn 1", "turn 2", "fetch")
    )
    cpu = "; ".join(
        f"{step} gateway {ms(mem, step + ' cpu'):.1f} / {ms(red, step + ' cpu'):.1f} ms + redis-server "
        f"{ms(red, step + ' redis cpu'):.1f} ms"
        for step in ("turn 1", "turn 2")
    )
    trips = ", ".join(f"{step} {median(red[step + ' trips']):.0f}" for step in ("turn 1", "turn 2"))
    writes = "; ".join(
        f"{step} {written[step]:.2f} MiB written for {new[step]:.2f} MiB of new arrays "
        f"({ratio(written[step], new[step]):.2f}x), {read[step]:.1f} KiB read"
        for step in ("turn 1", "turn 2")
    )
    turn1 = f"{shape.prompt_tokens}-token prompt + {shape.response_tokens} generated tokens"
    turn2 = f"{shape.tool_tokens} tool tokens appended + {shape.second_response_tokens} generated"
    return RowResult(
        number=14,
        name=NAME,
        measured=(
            f"median wall memory / Redis: {walls}; CPU per step memory / Redis: {cpu}; round trips to Redis "
            f"(scripts): {trips}, the fetch one stamp read; to Redis: {writes} (the session then holds "
            f"{session_mib:.2f} MiB); fetch read {read['fetch']:.1f} KiB from Redis"
        ),
        checks=[
            Check("turn 1 Redis/memory", paired["turn 1"], GOAL, higher_is_better=False),
            # A small turn shows the store's fixed cost per request: two round trips (the lease, the write).
            Check("turn 2 Redis/memory", paired["turn 2"], SMALL_GOAL, higher_is_better=False),
        ],
        notes=[
            f"turn 1: {turn1}; turn 2: {turn2}; {ctx.suite.moe.describe()}, routing + top-p replay (ignore_eos, the "
            "top-p flag and temperature in the session's sampling_defaults)",
            "two gateways before the shared simulator: the one as deployed (GATEWAY_STORE=memory) and one with "
            "GATEWAY_STORE=redis://127.0.0.1:PORT/0 on a redis-server 7 of the bench's own (.redis/bin/redis-server, "
            "--save '' --appendonly no: in memory, as the client sees it; persistence would add the server's own "
            "disk writes)",
            f"{shape.rounds} rounds after one warm-up session on each, memory and Redis in alternating order, a fresh "
            "session each time (created, deleted after the fetch; neither timed); wall time from request to last "
            "byte with slime_wire's client in this process, medians; the checks are the medians of the per-round "
            "ratios (each round's two sessions run back to back, so a passing load slows both); turn 2 is the "
            "append and the generate together; fetch: GET /sample (the replica that ran the turn holds the "
            "session, so it checks the version and reads no array)",
            "CPU: the run time of all the process's threads (/proc/<pid>/task/*/schedstat, nanoseconds) around the "
            "timed requests, medians; redis-server's alongside",
            "bytes to and from Redis: INFO stats total_net_input_bytes / total_net_output_bytes around the timed "
            "requests, less the cost of the bench's own INFO calls (everything the gateway sent: the lease with "
            "the stamp read, the write script with the new array bytes, the response text, the turn log and the "
            "small fields that changed, and the big new bytes staged beside it); new arrays: the session view's "
            "arrays (shape x dtype) after the step less before it; round trips: the scripts Redis ran for the "
            "gateway (INFO commandstats, EVALSHA and EVAL calls: each request takes its lease with one and writes "
            "with one, staged bytes riding in the write's trip)",
            "where a small turn's time goes beyond the in-memory store's: per request, two round trips on loopback, "
            "redis-py's client CPU for each (~40-60 us a command on this machine), encoding the write (the small "
            "fields that changed, the turn log entry, the new bytes), and redis-server running the scripts (its CPU "
            "above, during which the request waits)",
        ],
    )
