"""Row 17: short agent sessions per second with 2 and 4 gateway replicas on a 3-master Redis Cluster, against 1
replica on one Redis.

``agents`` agent loops run at once; each runs ``sessions`` short sessions one after another: ``POST /v1/sessions``
(a ``prompt_tokens`` prompt), ``turns`` model turns of ``turn_tokens`` with ``tool_tokens`` appended between them,
``GET /sample`` (checked), ``DELETE``; every request waits for the one before it, as an agent's do. The same load
goes to:

- **1 replica, one Redis**: one gateway with ``GATEWAY_STORE=redis://`` (the rows 14-15 set-up);
- **1 / 2 / 4 replicas, cluster**: gateways with ``GATEWAY_STORE=redis+cluster://`` on a Redis Cluster of 3 masters
  (created with ``redis-cli --cluster create``, in memory only), a session's requests all to replica ``i % n``
  (a load balancer keyed on the session id).

All against one simulator, on 127.0.0.1. The modes take turns, their order rotating every round; each mode's
sessions/s is the median over the rounds, the ratios the median of each round's ratio. CPU per session of every
process (``/proc/<pid>/task/*/schedstat``) and the cores the whole run kept busy say where the machine went: no
goal, since on a machine with few cores the replicas, the Redis nodes, the simulator and the load generator share
them, so the ratio says what this machine does, not what replicas scale to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, ratio, rotation
from bench.rows.redis_turn import sample_tokens
from bench.services import (
    REDIS_SERVER,
    START_TIMEOUT_S,
    RedisServer,
    ServerProcess,
    free_port,
    read_body,
    start_redis,
    start_server,
)
from bench.workload import ClusterShape, prompt_ids
from slime_wire.http1 import ConnectionPool

NAME = "replicas on a Redis Cluster"
REDIS_CLI = REDIS_SERVER.parent / "redis-cli"
MASTERS = 3
ONE = "1 replica, one Redis"
CLUSTER_REPLICAS = (1, 2, 4)


def cluster_mode(replicas: int) -> str:
    return f"{replicas} replica{'s' if replicas > 1 else ''}, cluster"


MODES = (ONE, *(cluster_mode(n) for n in CLUSTER_REPLICAS))


@contextlib.contextmanager
def redis_cluster(masters: int = MASTERS) -> Iterator[tuple[str, list[RedisServer]]]:
    """A Redis Cluster of ``masters`` masters on loopback (its URL, its nodes), in memory only."""
    if not REDIS_CLI.exists():
        raise RuntimeError(f"no redis-cli: `make redis` puts one in {REDIS_CLI.parent} (scripts/redis_server.sh)")
    nodes: list[RedisServer] = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as directory:
        try:
            for number in range(masters):
                node_dir = Path(directory) / str(number + 1)  # each node's nodes.conf
                node_dir.mkdir()
                args = ["--cluster-enabled", "yes", "--cluster-port", str(free_port()), "--dir", str(node_dir)]
                nodes.append(start_redis(f"redis cluster node {number + 1}", args))
            addresses = [f"127.0.0.1:{node.port}" for node in nodes]
            create = [str(REDIS_CLI), "--cluster", "create", *addresses, "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, timeout=60, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]!r}")
            for node in nodes:
                _wait_cluster_ok(node)
            yield f"redis+cluster://127.0.0.1:{nodes[0].port}", nodes
        finally:
            for node in nodes:
                node.stop()


def _wait_cluster_ok(node: RedisServer) -> None:
    """Until the node says ``cluster_state:ok`` (every slot served, the nodes agreeing)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # a node may refuse or say "fail" while the cluster forms
            if node.client.execute_command("CLUSTER INFO")["cluster_state"] == "ok":
                return
        time.sleep(0.05)
    raise RuntimeError("the Redis Cluster did not come up")


class Load:
    """The agent loops, and which gateway each of their sessions goes to in each mode."""

    def __init__(self, ctx: Context, shape: ClusterShape, gateways: dict[str, list[ServerProcess]]) -> None:
        self.shape = shape
        self.gateways = gateways
        moe = ctx.suite.moe
        self.pools = {
            gw.url: ConnectionPool(gw.url, max_connections=shape.agents, connect_timeout_s=5, pool_timeout_s=60)
            for replicas in gateways.values()
            for gw in replicas
        }
        sampling = {"ignore_eos": True, "temperature": 1.0}
        self.create = {"num_layers": moe.layers, "moe_router_topk": moe.topk, "sampling_defaults": sampling}
        self.turn = {"sampling_params": {"max_new_tokens": shape.turn_tokens}}
        self.tool = {"token_ids": prompt_ids(shape.tool_tokens, seed=5)}
        self.total = shape.prompt_tokens + shape.turns * shape.turn_tokens + (shape.turns - 1) * shape.tool_tokens

    async def agent(self, mode: str, agent: int) -> None:
        replicas = self.gateways[mode]
        pool = self.pools[replicas[agent % len(replicas)].url]
        prompt = {"prompt_ids": prompt_ids(self.shape.prompt_tokens, seed=200 + agent)}
        for _ in range(self.shape.sessions):
            created = orjson.loads(await read_body(pool, "POST", "/v1/sessions", self.create | prompt))
            path = f"/v1/sessions/{created['session_id']}"
            for turn in range(self.shape.turns):
                if turn:
                    await read_body(pool, "POST", f"{path}/append", self.tool)
                await read_body(pool, "POST", f"{path}/generate", self.turn)
            sample = await read_body(pool, "GET", f"{path}/sample")
            if sample_tokens(sample) != self.total:
                raise RuntimeError(f"{mode}: the sample holds {sample_tokens(sample)} tokens, not {self.total}")
            await read_body(pool, "DELETE", path)

    async def phase(self, mode: str, processes: dict[str, list[ServerProcess]]) -> dict[str, Any]:
        """Every agent's sessions at once: sessions per second, CPU per session of each kind of process."""
        cpu = {kind: sum(p.cpu_seconds() for p in group) for kind, group in processes.items()}
        client, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(self.agent(mode, i) for i in range(self.shape.agents)))
        wall = time.perf_counter() - started
        sessions = self.shape.agents * self.shape.sessions
        used = {kind: sum(p.cpu_seconds() for p in group) - cpu[kind] for kind, group in processes.items()}
        used["load generator"] = time.process_time() - client
        return {
            "sessions per s": sessions / wall,
            "cpu": {kind: seconds / sessions for kind, seconds in used.items()},
            "cores": sum(used.values()) / wall,
        }

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


async def measure(
    ctx: Context, shape: ClusterShape, gateways: dict[str, list[ServerProcess]], nodes: list[RedisServer]
) -> dict[str, list[dict[str, Any]]]:
    load = Load(ctx, shape, gateways)
    every = {gw.name: gw for replicas in gateways.values() for gw in replicas}
    processes = {
        "gateways": list(every.values()),
        "redis": [ctx.services.redis, *nodes],
        "simulator": [ctx.services.simulator],
    }
    got: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm-up: connections, first-use costs in every process
            await load.phase(mode, processes)
        for round_number in range(shape.rounds):
            for mode in rotation(MODES, round_number):
                got[mode].append(await load.phase(mode, processes))
            log(
                f"row 17: round {round_number + 1}/{shape.rounds}: sessions/s "
                + ", ".join(f"{mode} {got[mode][-1]['sessions per s']:.1f}" for mode in MODES)
            )
    finally:
        await load.aclose()
    return got


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.cluster
    services = ctx.services
    started: list[ServerProcess] = []
    load_before = os.getloadavg()[0]
    with redis_cluster() as (url, nodes):
        try:
            gateways = {ONE: [services.redis_gateway("gateway (Redis store, A)")]}
            args = ["-m", "gateway", "--upstream-url", services.simulator.url, "--log-level", "warning"]
            for number in range(max(CLUSTER_REPLICAS)):
                log(f"starting gateway (Redis Cluster, {number + 1})")
                env = {"GATEWAY_STORE": url, "GATEWAY_REDIS_PREFIX": "bench-cluster"}
                started.append(start_server(f"gateway (Redis Cluster, {number + 1})", args, env))
            for replicas in CLUSTER_REPLICAS:
                gateways[cluster_mode(replicas)] = started[:replicas]
            got = uvloop.run(measure(ctx, shape, gateways, nodes))
        finally:
            for gateway in started:
                gateway.stop()
    return result(shape, ctx, got, (load_before, os.getloadavg()[0]))


def result(
    shape: ClusterShape, ctx: Context, got: dict[str, list[dict[str, Any]]], load: tuple[float, float]
) -> RowResult:
    rate = {mode: median([phase["sessions per s"] for phase in phases]) for mode, phases in got.items()}
    cores = {mode: median([phase["cores"] for phase in phases]) for mode, phases in got.items()}

    def paired(mode: str) -> float:
        """The median over the rounds of each round's ratio to one replica on one Redis."""
        pairs = zip(got[mode], got[ONE], strict=True)
        return median([ratio(a["sessions per s"], b["sessions per s"]) for a, b in pairs])

    def cpu(mode: str, kind: str) -> float:
        return median([phase["cpu"][kind] for phase in got[mode]]) * 1e3

    kinds = ("gateways", "redis", "simulator", "load generator")
    rates = ", ".join(f"{mode} {rate[mode]:.1f}" for mode in MODES)
    spent = "; ".join(
        f"{mode}: " + ", ".join(f"{kind} {cpu(mode, kind):.1f}" for kind in kinds) + " ms" for mode in MODES
    )
    busy = ", ".join(f"{mode} {cores[mode]:.2f}" for mode in MODES)
    requests = 1 + shape.turns + (shape.turns - 1) + 2
    return RowResult(
        number=17,
        name=NAME,
        measured=(
            f"{shape.agents} concurrent agents, sessions/s (median of {shape.rounds} rounds): {rates}; CPU per "
            f"session: {spent}; cores busy (these processes' CPU over the wall time, of {os.cpu_count()}): {busy}; "
            f"the machine's load average (1 min) {load[0]:.1f} before the row, {load[1]:.1f} after"
        ),
        checks=[
            Check("2 on cluster/1 on Redis", paired(cluster_mode(2)), None, higher_is_better=True),
            Check("4 on cluster/1 on Redis", paired(cluster_mode(4)), None, higher_is_better=True),
            Check("1 on cluster/1 on Redis", paired(cluster_mode(1)), None, higher_is_better=True),
        ],
        notes=[
            f"a short agent session: a {shape.prompt_tokens}-token prompt, {shape.turns} model turns of "
            f"{shape.turn_tokens} tokens with {shape.tool_tokens} tool tokens appended between them, the sample "
            f"fetched and checked, the session deleted ({requests} requests, each after the one before); "
            f"{ctx.suite.moe.describe()}, routing replay; {shape.agents} agents at once, {shape.sessions} sessions "
            "each per measurement",
            f"one Redis: the redis-server of rows 14-15 (in memory); the cluster: {MASTERS} redis-server masters "
            "in cluster mode, no replicas, in memory, created with redis-cli --cluster create; the gateways on it: "
            "GATEWAY_STORE=redis+cluster://127.0.0.1:PORT (a seed node), a session's requests all to one replica "
            "(agent i to replica i % n)",
            "no goal: the ratios are reported. On this machine (see Machine) the replicas, the Redis processes, the "
            "simulator and the load generator (this process) share the cores: once they are all busy (cores busy "
            "near the machine's count, or below it with other jobs on the machine: the load average), more "
            "replicas only share the same cores; what a replica costs per session is in the CPU figures",
            f"{shape.rounds} rounds after one warm-up phase in each mode, the modes' order rotating every round; "
            "sessions/s: sessions over the phase's wall time, the median over the rounds; the ratios: the median of "
            "each round's ratio; CPU per session: each kind of process's run time (/proc/<pid>/task/*/schedstat; "
            "time.process_time for the load generator) over the phase, divided by its sessions, medians (idle "
            "processes of the other modes count too: their background work is small)",
        ],
    )
