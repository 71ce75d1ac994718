"""The server processes the HTTP rows talk to: one SGLang simulator and gateways in front of it, on 127.0.0.1.

Started lazily (a run of only the in-process rows starts nothing), shared by the rows that need them, and stopped
at the end of the run. Each process logs to a temporary file that is shown if it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from bench.core import log
from bench.workload import MoE, simulator_args

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0


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
class Services:
    """Lazily started processes: ``services.simulator``, ``services.gateway``, ``services.gateway_full_routing``,
    ``services.chat_gateway``."""

    moe: MoE
    stream_chunk_tokens: int = 1
    _running: dict[str, ServerProcess] = field(default_factory=dict)
    _tokenizer_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def simulator(self) -> ServerProcess:
        args = [*simulator_args(self.moe), "--stream-chunk-tokens", str(self.stream_chunk_tokens)]
        return self._get("simulator", ["-m", "gateway.simulator", *args])

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
        """A gateway as deployed, started with ``--tokenizer`` (the tiny chat tokenizer): its chat routes beside its
        token-level ones. A process of its own, so the other rows' gateway never loads transformers."""
        return self._gateway("gateway (chat)", incremental=True, tokenizer=self.chat_tokenizer)

    @property
    def chat_tokenizer(self) -> Path:
        """A tokenizer directory with a chat template (``gateway.simulator.tiny_tokenizer``), built once per run in
        a child process (transformers stays out of the bench process) into a temporary directory."""
        if self._tokenizer_dir is None:
            log("building the tiny chat tokenizer")
            directory = tempfile.TemporaryDirectory(prefix="bench-tokenizer-")
            build = [sys.executable, "-m", "gateway.simulator.tiny_tokenizer", directory.name]
            done = subprocess.run(build, cwd=REPO_ROOT, env=child_env(), capture_output=True, check=False)
            if done.returncode != 0:
                directory.cleanup()
                raise RuntimeError(f"the tiny tokenizer was not built:\n{done.stderr.decode(errors='replace')}")
            self._tokenizer_dir = directory
        return Path(self._tokenizer_dir.name)

    def extra_gateway(self, name: str) -> ServerProcess:
        """Another gateway before the same simulator, for a row that needs a process of its own (its memory)."""
        return self._gateway(name, incremental=True)

    def _gateway(self, name: str, *, incremental: bool, tokenizer: Path | None = None) -> ServerProcess:
        upstream = self.simulator.url
        env = {"GATEWAY_INCREMENTAL_ROUTING": "true" if incremental else "false"}
        args = ["-m", "gateway", "--upstream-url", upstream, "--log-level", "warning"]
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
