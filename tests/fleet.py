"""A gateway fleet as plain processes, for the durability, fleet and chaos tests: Redis nodes a test can kill, pause
and restart one by one (a single server, or a Redis Cluster with a replica per master, created with redis-cli as
an operator does), gateway replicas, and HAProxy in front of them with the deployment's own configuration
(``docker/haproxy.cfg``).

Everything runs on 127.0.0.1 on free ports; every process is stopped when its context ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import REPO_ROOT, redis_binary, start_redis_process, stop_process
from procs import RunningProcess, free_port, start_process

HAPROXY_DIR = REPO_ROOT / ".haproxy"
HAPROXY_CONFIG = REPO_ROOT / "docker" / "haproxy.cfg"


def free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


# ---- Redis ---------------------------------------------------------------------------------------------------------
@dataclass
class RedisNode:
    """One redis-server on 127.0.0.1:``port`` with its data in ``directory``: stopped, killed, paused and started
    again on the same port (with its data, where ``args`` ask for persistence; a cluster node with its nodes.conf)."""

    port: int
    directory: Path
    args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = start_redis_process(self.port, "--dir", str(self.directory), *self.args)

    def kill(self) -> None:
        """``kill -9``: nothing is flushed on the way down."""
        self.signal(signal.SIGKILL)
        self.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def wait(self) -> None:
        if self.process is not None:
            self.process.wait(10)
            self.process = None

    def signal(self, sig: int) -> None:
        if self.process is not None:
            self.process.send_signal(sig)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


AOF = ("--appendonly", "yes", "--appendfsync", "always")


@contextmanager
def redis_node(directory: Path, *args: str) -> Iterator[RedisNode]:
    node = RedisNode(free_port(), directory, args)
    node.start()
    try:
        yield node
    finally:
        node.resume()
        node.stop()


@dataclass
class Cluster:
    """A Redis Cluster on 127.0.0.1: ``masters`` masters, each with ``replicas`` replicas; ``url`` names a seed."""

    nodes: list[RedisNode]
    masters: int

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def seeds(self) -> list[int]:
        return [node.port for node in self.nodes]

    def client(self) -> redis.RedisCluster:
        for node in self.nodes:
            if node.process is not None:
                return redis.RedisCluster(host="127.0.0.1", port=node.port)
        raise RuntimeError("no node of the cluster is running")

    def node_on(self, port: int) -> RedisNode:
        return next(node for node in self.nodes if node.port == port)

    def master_of(self, key: str) -> RedisNode:
        """The node serving ``key``'s slot now."""
        with self.client() as client:
            return self.node_on(int(client.get_node_from_key(key).port))

    def replica_of(self, master: RedisNode) -> RedisNode:
        with master.client() as client:
            info = client.info("replication")
        return self.node_on(int(info["slave0"]["port"]))

    def wait_until_ok(self, timeout_s: float = 60.0) -> None:
        """Until every running node says ``cluster_state:ok`` and agrees on who serves each slot."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            if node.process is None:
                continue
            with node.client() as client:
                while True:
                    try:
                        if client.cluster("info")["cluster_state"] == "ok":
                            break
                    except redis.RedisError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the Redis Cluster on {self.seeds} did not come up")
                    time.sleep(0.1)

    def wait_for_promotion(self, replica: RedisNode, timeout_s: float = 60.0) -> None:
        """Until ``replica`` (of a master that was killed) is a master and the cluster is ok again."""
        deadline = time.monotonic() + timeout_s
        with replica.client() as client:
            while True:
                try:
                    promoted = client.info("replication")["role"] == "master"
                    if promoted and client.cluster("info")["cluster_state"] == "ok":
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {replica.port} was not promoted")
                time.sleep(0.1)


@contextmanager
def redis_cluster(directory: Path, *args: str, masters: int = 3, replicas: int = 1) -> Iterator[Cluster]:
    """A real Redis Cluster (``redis-cli --cluster create ... --cluster-replicas``). ``cluster-node-timeout`` is short
    (a failover takes seconds, as tuned deployments do) and a cluster that lost a slot range still serves the
    others (``cluster-require-full-coverage no``)."""
    cli = redis_binary("redis-cli", " (a Redis Cluster is created with it)")
    count = masters * (1 + replicas)
    ports = free_ports(2 * count)
    nodes = []
    for port, bus in zip(ports[:count], ports[count:], strict=True):
        node_args = ("--cluster-enabled", "yes", "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf")
        node_args += ("--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no")
        node_args += ("--repl-diskless-sync-delay", "0", *args)  # a replica (re)syncs at once, not 5 s later
        nodes.append(RedisNode(port, directory / str(port), node_args))
    cluster = Cluster(nodes, masters)
    try:
        for node in nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        created = subprocess.run(
            [str(cli), "--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True,
            timeout=120,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]!r}")
        cluster.wait_until_ok()
        _wait_for_replicas(cluster, replicas)
        yield cluster
    finally:
        for node in nodes:
            node.resume()
            node.stop()


def _wait_for_replicas(cluster: Cluster, replicas: int, timeout_s: float = 60.0) -> None:
    """Until every master has its replicas connected and in sync (a failover needs one that is)."""
    deadline = time.monotonic() + timeout_s
    for node in cluster.nodes:
        with node.client() as client:
            while True:
                info = client.info("replication")
                online = [info[f"slave{n}"] for n in range(info.get("connected_slaves", 0))]
                if info["role"] != "master" or sum(r["state"] == "online" for r in online) >= replicas:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the replicas of node {node.port} did not connect")
                time.sleep(0.1)


# ---- gateway replicas ----------------------------------------------------------------------------------------------
@dataclass
class Replica:
    """One gateway process on ``port``, started with ``args`` and ``env``; stopped, killed and started again."""

    name: str
    port: int
    args: tuple[str, ...]
    env: dict[str, str]
    log_dir: Path | None = None  # where each run's output is kept (appended) once it stops
    running: RunningProcess | None = None
    _stack: ExitStack = field(default_factory=ExitStack)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "gateway", "--port", str(self.port), *self.args]
        self._stack = ExitStack()
        self.running = self._stack.enter_context(start_process(command, self.port, env=self.env, timeout=60))

    @property
    def pid(self) -> int:
        assert self.running is not None
        return self.running.proc.pid

    def kill(self) -> None:
        """``kill -9``."""
        if self.running is None:
            return
        self.running.proc.send_signal(signal.SIGKILL)
        self.running.proc.wait(10)
        self._close()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as an orchestrator stops it (the gateway drains, then exits); its exit code."""
        assert self.running is not None
        proc = self.running.proc
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout_s)
        self._close()
        return code

    def stop(self) -> None:
        self._close()

    def _close(self) -> None:
        if self.running is not None and self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / f"{self.name}.log", "a") as log:
                log.write(self.running.output())
        self._stack.close()
        self.running = None

    def output(self) -> str:
        return "" if self.running is None else self.running.output()


def health(url: str, timeout: float = 2.0) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


# ---- HAProxy -------------------------------------------------------------------------------------------------------
def haproxy_binary() -> Path:
    """``.haproxy/bin/haproxy`` (``make haproxy``: Debian's package unpacked); a skip naming why when absent."""
    binary = HAPROXY_DIR / "bin" / "haproxy"
    if not binary.exists():
        log = HAPROXY_DIR / "install.log"
        why = log.read_text().strip()[-500:] if log.exists() else "run `make haproxy` (scripts/haproxy.sh)"
        pytest.skip(f"no haproxy in {binary.parent}: {why}")
    return binary


@dataclass
class HAProxy:
    port: int
    stats_port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def server_states(self) -> dict[str, str]:
        """Each gateway server's state as HAProxy sees it (``UP``, ``DOWN``, ``MAINT`` ...), from its stats CSV."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = [line.split(",") for line in text.splitlines() if line and not line.startswith("#")]
        return {row[1]: row[17] for row in rows if row[0] == "gateways" and row[1] not in ("BACKEND", "FRONTEND")}

    def wait_for(self, wanted: Mapping[str, str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (states := self.server_states()) and any(
            not states.get(name, "").startswith(state) for name, state in wanted.items()
        ):
            if time.monotonic() > deadline:
                raise AssertionError(f"HAProxy's servers are {states}, not {dict(wanted)}")
            time.sleep(0.05)


def haproxy_env(replicas: list[Replica], port: int, stats_port: int) -> dict[str, str]:
    """The variables ``docker/haproxy.cfg`` reads: where it listens and where each replica is."""
    env = {"HAPROXY_BIND": f"127.0.0.1:{port}", "HAPROXY_STATS_BIND": f"127.0.0.1:{stats_port}"}
    for number, replica in enumerate(replicas, start=1):
        env[f"GATEWAY_REPLICA_{number}"] = f"127.0.0.1:{replica.port}"
    return env


@contextmanager
def haproxy(replicas: list[Replica], directory: Path) -> Iterator[HAProxy]:
    """HAProxy with the deployment's configuration (docker/haproxy.cfg) in front of ``replicas``."""
    binary = haproxy_binary()
    port, stats_port = free_ports(2)
    log = directory / "haproxy.log"
    env = {**os.environ, **haproxy_env(replicas, port, stats_port)}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(binary), "-db", "-f", str(HAPROXY_CONFIG)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    proxy = HAProxy(port, stats_port, process, log)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", stats_port), timeout=0.5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"haproxy did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.05)
        proxy.wait_for({f"gw{n}": "UP" for n in range(1, len(replicas) + 1) if replicas[n - 1].running})
        yield proxy
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
