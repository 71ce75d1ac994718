"""Run real server processes on 127.0.0.1 for end-to-end tests.

    port = free_port()
    with start_process([sys.executable, "-m", "sglang_sim", "--port", str(port)], port) as proc:
        httpx.get(f"{proc.url}/health")

`start_process` launches the command with the repository root as working directory and on PYTHONPATH, waits
until `GET http://127.0.0.1:<port><health_path>` answers 200, yields a `RunningProcess`, and on exit terminates
it (SIGTERM, then SIGKILL after a grace period). The process's stdout and stderr go to a temporary file, so
a chatty server can never block on a full pipe; when startup fails or the body of the `with` raises, the
captured output is printed, which pytest shows next to the failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
POLL_INTERVAL_S = 0.05
STOP_GRACE_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny race with other processes remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningProcess:
    proc: subprocess.Popen[bytes]
    port: int
    host: str
    _log: IO[bytes]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self) -> str:
        """Everything the process wrote to stdout and stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")


class ProcessStartError(RuntimeError):
    """The process exited or never became healthy within the timeout."""


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # so output() shows log lines as they happen
    env.update(extra or {})
    return env


def _wait_healthy(running: RunningProcess, health_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if running.proc.poll() is not None:
                raise ProcessStartError(f"process exited with code {running.proc.returncode} during startup")
            try:
                if client.get(running.url + health_path).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(POLL_INTERVAL_S)
    raise ProcessStartError(f"{running.url}{health_path} not healthy after {timeout} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _report(args: Sequence[str], running: RunningProcess) -> None:
    print(f"--- output of {' '.join(args)} (exit code {running.proc.poll()}) ---", file=sys.stderr)
    print(running.output(), file=sys.stderr)


@contextmanager
def start_process(
    args: Sequence[str],
    port: int,
    health_path: str = "/health",
    env: Mapping[str, str] | None = None,
    timeout: float = 20.0,
    host: str = "127.0.0.1",
) -> Iterator[RunningProcess]:
    """Run `args` (a full argv, e.g. `[sys.executable, "-m", "sglang_sim", ...]`) until the block exits.

    `env` adds to (and overrides) the current environment. Raises ProcessStartError if the process exits or is
    not healthy within `timeout` seconds.
    """
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(list(args), cwd=REPO_ROOT, env=_env(env), stdout=log, stderr=subprocess.STDOUT)
        running = RunningProcess(proc, port, host, log)
        try:
            _wait_healthy(running, health_path, timeout)
            yield running
        except GeneratorExit:
            raise
        except BaseException:
            _stop(proc)
            _report(args, running)
            raise
        finally:
            _stop(proc)
