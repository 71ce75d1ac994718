"""The server processes the HTTP rows talk to: one SGLang simulator and gateways in front of it, on 127.0.0.1 (and,
for the Redis store's rows, one redis-server that those gateways share).

Started lazily (a run of only the in-process rows starts nothing), shared by the rows that need them, and stopped
at the end of the run. Each process logs to a temporary file that is shown if it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import orjson

from bench.core import log
from bench.workload import MoE, simulator_args
from slime_wire.http1 import ConnectionPool

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
# `make redis` (scripts/redis_server.sh) unpacks a real redis-server here; one on PATH does too.
REDIS_SERVER = REPO_ROOT / ".redis" / "bin" / "redis-server"
# `make chromium` (scripts/chromium.sh) records Debian's chromium in .chromium/path (or says why not in install.log).
CHROMIUM_DIR = REPO_ROOT / ".chromium"
# What headless chromium needs on these machines: no sandbox as root, no GPU, and none of the background traffic
# (QUIC, component updates, sync) that a closed network refuses. Playwright adds a fresh --user-data-dir per launch.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


@dataclass
class ServerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    _log: IO[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def cpu_seconds(self) -> float:
        """CPU time of all the process's threads (``/proc/<pid>/task/*/schedstat``: run time in nanoseconds, not
        10 ms ticks), in seconds. A thread that ended since the last call takes its time with it: only the
        long-lived ones (an event loop, a decode pool, redis-server's main thread) are counted reliably."""
        total = 0
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{self.pid}/task/{tid}/schedstat") as stat,
            ):
                total += int(stat.read().split()[0])
        return total / 1e9

    def set_nice(self, nice: int) -> None:
        """Every thread's CPU priority (Linux: a thread's nice value is its own; new threads inherit it)."""
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_server(name: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> ServerProcess:
    """Start ``python <args> --port P`` and wait until ``GET /health`` answers 200."""
    port = free_port()
    output = tempfile.TemporaryFile()  # noqa: SIM115 (owned by the ServerProcess, closed in stop())
    proc = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        cwd=REPO_ROOT,
        env=child_env(env),
        stdout=output,
        stderr=subprocess.STDOUT,
    )
    server = ServerProcess(name, proc, port, output)
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                if client.get(server.url + "/health").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    text = server.output()
    server.stop()
    raise RuntimeError(f"{name} did not start (exit code {proc.poll()}):\n{text}")


@dataclass
class RedisServer(ServerProcess):
    """A redis-server on 127.0.0.1, in memory only (no snapshots, no append-only file)."""

    _client: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def client(self) -> Any:
        """A synchronous redis client (``redis.Redis``) for the bench's own reads (``INFO``), made once."""
        if self._client is None:
            import redis  # the gateway's redis extra: only the Redis rows need it

            self._client = redis.Redis.from_url(self.url, socket_timeout=5.0)
        return self._client

    def info(self, section: str) -> dict[str, Any]:
        return dict(self.client.info(section))

    def stop(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        super().stop()


def redis_server_binary() -> str:
    if REDIS_SERVER.exists():
        return str(REDIS_SERVER)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(f"no redis-server: `make redis` puts one in {REDIS_SERVER.parent} (scripts/redis_server.sh)")
    return found


def find_chromium() -> str | None:
    """Debian's chromium for Playwright's ``executable_path`` (the inspector's row 16 and tests/test_ui.py): the
    ``CHROMIUM`` environment variable, the one scripts/chromium.sh recorded, or ``chromium`` / ``chromium-browser``
    on PATH, the first that exists; None when there is none."""
    recorded = CHROMIUM_DIR / "path"
    candidates = [os.environ.get("CHROMIUM", ""), recorded.read_text().strip() if recorded.exists() else ""]
    candidates += [shutil.which("chromium") or "", shutil.which("chromium-browser") or ""]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return candidate
    return None


def start_redis(name: str, extra_args: Sequence[str] = ()) -> RedisServer:
    """Start a redis-server on a free loopback port, without persistence, and wait until it answers ``PING``.
    ``extra_args``: more of its flags (a Redis Cluster node's ``--cluster-enabled yes``, its own ``--dir``)."""
    from redis.exceptions import RedisError

    port = free_port()
    output = tempfile.TemporaryFile()  # noqa: SIM115 (owned by the RedisServer, closed in stop())
    args = ["--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1", *extra_args]
    proc = subprocess.Popen(  # the wrapper of scripts/redis_server.sh execs the server: the same pid
        [redis_server_binary(), *args], cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT
    )
    server = RedisServer(name, proc, port, output)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if server.client.ping():
                return server
        except (RedisError, OSError):  # refused until it listens
            time.sleep(0.05)
    text = server.output()
    server.stop()
    raise RuntimeError(f"{name} did not start (exit code {proc.poll()}):\n{text}")


@dataclass
class Services:
    """Lazily started processes: ``services.simulator``, ``services.gateway``, ``services.gateway_full_routing``,
    ``services.chat_gateway``, ``services.redis`` and ``services.redis_gateway(name)``."""

    moe: MoE
    stream_chunk_tokens: int = 1
    _running: dict[str, ServerProcess] = field(default_factory=dict)
    _tokenizer_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def simulator(self) -> ServerProcess:
        args = [*simulator_args(self.moe), "--stream-chunk-tokens", str(self.stream_chunk_tokens)]
        return self._get("simulator", ["-m", "sglang_sim", *args])

    @property
    def gateway(self) -> ServerProcess:
        """The gateway as deployed: incremental routing replay (``routed_experts_start_len``)."""
        return self._gateway("gateway", incremental=True)

    @property
    def gateway_full_routing(self) -> ServerProcess:
        """A second gateway with ``GATEWAY_INCREMENTAL_ROUTING=false``: whole routing history every turn."""
        return self._gateway("gateway (full routing)", incremental=False)

    @property
    def chat_gateway(self) -> ServerProcess:
        """A gateway as deployed for a reasoning coding model, started with ``--tokenizer`` (the tiny chat tokenizer)
        and slime's Qwen3.6 parsers (``qwen3_coder`` tool calls, ``qwen3`` reasoning): its chat routes beside its
        token-level ones. A process of its own, so the other rows' gateway never loads transformers."""
        parsers = {"GATEWAY_CHAT_TOOL_PARSER": "qwen3_coder", "GATEWAY_CHAT_REASONING_PARSER": "qwen3"}
        return self._gateway("gateway (chat)", incremental=True, tokenizer=self.chat_tokenizer, env=parsers)

    @property
    def chat_simulator(self) -> ServerProcess:
        """A simulator speaking the tiny chat tokenizer, for rows whose model must write text the gateway parses
        (tool calls): its answers are scripted (``/sim/script``)."""
        args = [*simulator_args(self.moe), "--tokenizer", str(self.chat_tokenizer)]
        return self._get("simulator (chat)", ["-m", "sglang_sim", *args])

    @property
    def agent_gateway(self) -> ServerProcess:
        """A chat gateway before ``chat_simulator``: an agent's whole loop, tool calls parsed."""
        return self._gateway(
            "gateway (agent)",
            incremental=True,
            tokenizer=self.chat_tokenizer,
            upstream=self.chat_simulator,
            env={"GATEWAY_CHAT_CONTEXT_TOKENS": "262144"},  # the tiny tokenizer states 32k; long episodes pass it
        )

    @property
    def chat_tokenizer(self) -> Path:
        """A tokenizer directory with a chat template (``sglang_sim.tiny_tokenizer``), built once per run in
        a child process (transformers stays out of the bench process) into a temporary directory."""
        if self._tokenizer_dir is None:
            log("building the tiny chat tokenizer")
            directory = tempfile.TemporaryDirectory(prefix="bench-tokenizer-")
            build = [sys.executable, "-m", "sglang_sim.tiny_tokenizer", directory.name]
            done = subprocess.run(build, cwd=REPO_ROOT, env=child_env(), capture_output=True, check=False)
            if done.returncode != 0:
                directory.cleanup()
                raise RuntimeError(f"the tiny tokenizer was not built:\n{done.stderr.decode(errors='replace')}")
            self._tokenizer_dir = directory
        return Path(self._tokenizer_dir.name)

    def extra_gateway(self, name: str) -> ServerProcess:
        """Another gateway before the same simulator, for a row that needs a process of its own (its memory)."""
        return self._gateway(name, incremental=True)

    @property
    def redis(self) -> RedisServer:
        """One redis-server for every gateway on the Redis store (``redis_gateway``)."""
        if "redis" not in self._running:
            log("starting redis-server")
            self._running["redis"] = start_redis("redis-server")
        server = self._running["redis"]
        assert isinstance(server, RedisServer)
        return server

    def redis_gateway(self, name: str) -> ServerProcess:
        """A gateway as deployed, on the Redis store (``GATEWAY_STORE`` = ``services.redis``): the gateways that
        this makes share their sessions, as replicas behind a load balancer do."""
        store = {"GATEWAY_STORE": self.redis.url}
        return self._gateway(name, incremental=True, env=store)

    def _gateway(
        self,
        name: str,
        *,
        incremental: bool,
        tokenizer: Path | None = None,
        env: Mapping[str, str] | None = None,
        upstream: ServerProcess | None = None,
    ) -> ServerProcess:
        upstream_url = (upstream or self.simulator).url
        env = {"GATEWAY_INCREMENTAL_ROUTING": "true" if incremental else "false", **(env or {})}
        args = ["-m", "gateway", "--upstream-url", upstream_url, "--log-level", "warning"]
        if tokenizer is not None:
            args += ["--tokenizer", str(tokenizer)]
        return self._get(name, args, env)

    def _get(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> ServerProcess:
        if name not in self._running:
            log(f"starting {name}")
            self._running[name] = start_server(name, args, env)
        return self._running[name]

    @contextlib.contextmanager
    def deprioritized(self, server: ServerProcess, nice: int = 10) -> Iterator[None]:
        """Run ``server`` at a lower CPU priority for the block: on a small machine, the way to keep the
        simulator's CPU (which real SGLang spends on its own hardware) from being measured as the gateway's."""
        server.set_nice(nice)
        try:
            yield
        finally:
            with contextlib.suppress(PermissionError):  # raising priority back needs CAP_SYS_NICE
                server.set_nice(0)

    def stop(self) -> None:
        for server in reversed(list(self._running.values())):
            server.stop()
        self._running.clear()
        if self._tokenizer_dir is not None:
            self._tokenizer_dir.cleanup()
            self._tokenizer_dir = None


REQUEST_TIMEOUT_S = 600.0


async def read_body(pool: ConnectionPool, method: str, path: str, body: Any = None) -> bytes:
    """One JSON request; its whole answer body, read to the end (a RuntimeError on a 4xx/5xx)."""
    payload = b"" if body is None else orjson.dumps(body)
    headers = [(b"content-type", b"application/json")] if body is not None else []
    response = await pool.request(method, path.encode(), headers, payload, timeout=REQUEST_TIMEOUT_S)
    pieces = []
    try:
        async for piece in response.iter_raw():
            pieces.append(piece)
    finally:
        await response.aclose()
    data = b"".join(pieces)
    if response.status >= 400:
        raise RuntimeError(f"{method} {path} -> {response.status}: {data[-500:]!r}")
    return data
