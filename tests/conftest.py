"""Shared fixtures: the real simulator and gateway processes on 127.0.0.1 (session-scoped, started once)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import REPO_ROOT, free_port, start_process

# The MoE shape the shared simulator runs with (small so tests stay fast; shapes are parameters everywhere).
SIM_LAYERS, SIM_TOPK, SIM_EXPERTS = 4, 2, 8


@dataclass(frozen=True)
class Service:
    url: str
    port: int


@contextmanager
def run_simulator(*extra: str) -> Iterator[Service]:
    port = free_port()
    args = [sys.executable, "-m", "sglang_sim", "--port", str(port)]
    args += ["--num-layers", str(SIM_LAYERS), "--topk", str(SIM_TOPK), "--num-experts", str(SIM_EXPERTS)]
    args += ["--seed", "0", *extra]
    with start_process(args, port):
        yield Service(f"http://127.0.0.1:{port}", port)


@contextmanager
def run_gateway(upstream_url: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[Service]:
    port = free_port()
    args = [sys.executable, "-m", "gateway", "--upstream-url", upstream_url, "--port", str(port), *extra]
    with start_process(args, port, env=env):
        yield Service(f"http://127.0.0.1:{port}", port)


@pytest.fixture(scope="session")
def simulator() -> Iterator[Service]:
    with run_simulator() as service:
        yield service


@pytest.fixture(scope="session")
def gateway(simulator: Service) -> Iterator[Service]:
    with run_gateway(simulator.url, "--log-level", "warning") as service:
        yield service


# ---- chat: a tiny real tokenizer, a simulator speaking it, a gateway with the chat routes ---------------------------
@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sglang_sim.tiny_tokenizer import build_tiny_chat_tokenizer

    return build_tiny_chat_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="session")
def chat_sim(tokenizer_dir: Path) -> Iterator[Service]:
    with run_simulator("--tokenizer", str(tokenizer_dir)) as service:
        yield service


@pytest.fixture(scope="session")
def chat_gateway(chat_sim: Service, tokenizer_dir: Path) -> Iterator[Service]:
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning") as service:
        yield service


# ---- Redis: the real server `make test` unpacks into .redis/ (scripts/redis_server.sh) -------------------------------
REDIS_DIR = REPO_ROOT / ".redis"


def redis_binary(name: str, note: str = "") -> Path:
    """``.redis/bin/<name>``; a skip naming why when it is not there (``note``: what it is needed for)."""
    binary = REDIS_DIR / "bin" / name
    if not binary.exists():
        log = REDIS_DIR / "install.log"
        why = log.read_text().strip()[-500:] if log.exists() else "run `make redis` (scripts/redis_server.sh)"
        pytest.skip(f"no {name} in {binary.parent}{note}: {why}")
    return binary


@dataclass(frozen=True)
class RedisServer:
    url: str
    port: int
    process: Any


def start_redis_process(port: int, *args: str) -> subprocess.Popen[bytes]:
    """redis-server on 127.0.0.1:``port`` with ``args`` (no persistence unless they ask for it), once it answers."""
    command = [str(redis_binary("redis-server")), "--port", str(port), "--bind", "127.0.0.1"]
    command += ["--save", "", "--appendonly", "no", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return process
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
    process.wait(10)


@contextmanager
def run_redis(*extra: str, port: int | None = None) -> Iterator[RedisServer]:
    """A real redis-server on 127.0.0.1 (no persistence unless ``extra`` asks for it)."""
    port = port or free_port()
    process = start_redis_process(port, *extra)
    try:
        yield RedisServer(f"redis://127.0.0.1:{port}/0", port, process)
    finally:
        stop_process(process)


@dataclass
class RedisClusterNodes:
    """A Redis Cluster of masters on 127.0.0.1 (``url``: ``redis+cluster://`` a seed node), each node in a directory
    of its own under ``directory`` (its nodes.conf, and its data where ``extra`` asks for persistence): ``stop`` and
    ``start`` them, and the cluster comes back as it was."""

    url: str
    ports: list[int]
    bus_ports: list[int]
    directory: Path
    extra: tuple[str, ...]
    processes: list[subprocess.Popen[bytes]]

    def start(self) -> None:
        for port, bus in zip(self.ports, self.bus_ports, strict=True):
            (self.directory / str(port)).mkdir(parents=True, exist_ok=True)
            args = ["--cluster-enabled", "yes", "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf"]
            args += ["--dir", str(self.directory / str(port)), *self.extra]
            self.processes.append(start_redis_process(port, *args))

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process)
        self.processes.clear()

    def wait_until_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node says ``cluster_state:ok`` (all slots served, the nodes agree)."""
        import redis

        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            with redis.Redis(port=port) as client:
                while client.cluster("info")["cluster_state"] != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the Redis Cluster on {self.ports} did not come up")
                    time.sleep(0.1)


@contextmanager
def run_redis_cluster(directory: Path, *extra: str, masters: int = 3) -> Iterator[RedisClusterNodes]:
    """A real Redis Cluster of ``masters`` masters (no replicas) on loopback, created with ``redis-cli --cluster
    create`` as an operator would."""
    cli = redis_binary("redis-cli", " (a Redis Cluster is created with it)")
    ports: list[int] = []
    while len(ports) < 2 * masters:  # a client port and a cluster bus port per node, all distinct
        if (port := free_port()) not in ports:
            ports.append(port)
    url = f"redis+cluster://127.0.0.1:{ports[0]}"
    nodes = RedisClusterNodes(url, ports[:masters], ports[masters:], directory, extra, [])
    try:
        nodes.start()
        addresses = [f"127.0.0.1:{port}" for port in nodes.ports]
        created = subprocess.run(
            [str(cli), "--cluster", "create", *addresses, "--cluster-yes"], capture_output=True, timeout=60
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]!r}")
        nodes.wait_until_ok()
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with run_redis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-master Redis Cluster shared by the tests (in memory only)."""
    with run_redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes


@pytest.fixture(scope="session")
def redis_gateway(simulator: Service, redis_server: RedisServer) -> Iterator[Service]:
    """A gateway on the Redis store, beside the ``gateway`` fixture's in-memory one (same simulator)."""
    env = {"GATEWAY_STORE": redis_server.url, "GATEWAY_REDIS_PREFIX": "shared"}
    with run_gateway(simulator.url, "--log-level", "warning", env=env) as service:
        yield service


@pytest.fixture(scope="session", params=["memory", "redis"])
def any_gateway(request: pytest.FixtureRequest) -> Service:
    """The tests that take it run against both session stores."""
    return request.getfixturevalue("gateway" if request.param == "memory" else "redis_gateway")


@pytest.fixture
def start_gateway() -> Callable[..., AbstractContextManager[Service]]:
    """For tests that need a gateway of their own (other upstream, short timeouts)."""
    return run_gateway


@pytest.fixture
def start_simulator() -> Callable[..., AbstractContextManager[Service]]:
    return run_simulator


@pytest.fixture
async def sim_faults(simulator: Service) -> Iterator[Callable[..., object]]:
    """Queue simulator faults for the next /generate calls; cleared after the test."""
    async with httpx.AsyncClient(base_url=simulator.url) as client:

        async def inject(mode: str, count: int = 1, **params: object) -> None:
            response = await client.post("/sim/faults", json={"mode": mode, "count": count, **params})
            response.raise_for_status()

        yield inject
        await client.delete("/sim/faults")
