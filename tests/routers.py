"""Launch the real SGLang routers from the package registry (installed by `make routers`) on 127.0.0.1.

    with run_router(SMG, [w1.url, w2.url], policy="consistent_hashing") as router:
        httpx.post(f"{router.url}/generate", ...)

Each router lives in its own virtual environment under `.routers/<name>` (they pin different versions of the
same Rust core, and neither needs torch). A router listens on a free loopback port, binds its Prometheus
exporter to loopback too (its default is 0.0.0.0), and is ready once `/readiness` reports every worker healthy.
Retries and timeouts are kept small by default so failure tests finish in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from procs import REPO_ROOT, free_port, start_process

ROUTERS_DIR = REPO_ROOT / ".routers"
STAMP_NAME = ".installed-stamp"  # written by the Makefile's `routers` target after a successful install
INSTALL_LOG_NAME = "install.log"  # pip's output when the install failed
READY_TIMEOUT_S = 30.0
# Small retry settings shared by both routers (their default is 5 attempts), a quick exit on SIGTERM (default: a
# 180 s drain), and quiet logs. Tests add --request-timeout-secs (default 1800 s) and health-check flags as needed.
FAST_FAILURE_FLAGS = (
    "--retry-max-retries", "2",
    "--retry-initial-backoff-ms", "10",
    "--retry-max-backoff-ms", "50",
    "--health-check-interval-secs", "60",
    "--shutdown-grace-period-secs", "0",
    "--log-level", "warn",
)  # fmt: skip


@dataclass(frozen=True)
class RouterKind:
    """One router distribution: its pinned version, its venv and how to start it."""

    name: str  # the folder under .routers/ and the PyPI name
    version: str
    launcher: tuple[str, ...]  # argv prefix relative to the venv's bin/ (first item is the executable)

    @property
    def venv(self) -> Path:
        return ROUTERS_DIR / self.name

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"

    def argv(self, *args: str) -> list[str]:
        return [str(self.venv / "bin" / self.launcher[0]), *self.launcher[1:], *args]

    def unavailable_reason(self) -> str | None:
        """None when the router is installed and runnable here, else why not (the skip reason)."""
        executable = self.venv / "bin" / self.launcher[0]
        if (self.venv / STAMP_NAME).exists() and executable.exists():
            return None
        log = self.venv / INSTALL_LOG_NAME
        why = f"{self.pin} is not installed in {self.venv.relative_to(REPO_ROOT)} (run `make routers`)"
        if log.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            why += "; the last install failed: " + " | ".join(tail)
        return why


# smg: the SGLang router's successor; forwards the raw /generate fields and honours X-SMG-Routing-Key.
# Policies include consistent_hashing (hashes the X-SMG-Routing-Key header).
SMG = RouterKind("smg", "1.13.0", ("smg", "launch"))
# sglang-router 0.3.2: re-serializes /generate from a fixed schema (drops return_routed_experts, custom_params,
# routed_experts_start_len and unknown fields). Policies: random, round_robin, cache_aware, power_of_two, manual.
SGLANG_ROUTER = RouterKind("sglang-router", "0.3.2", ("python", "-m", "sglang_router.launch_router"))
ROUTER_KINDS = (SMG, SGLANG_ROUTER)


@dataclass(frozen=True)
class Router:
    kind: RouterKind
    url: str
    port: int
    metrics_port: int


def launch_args(
    kind: RouterKind, worker_urls: Sequence[str], policy: str, port: int, metrics_port: int, *extra: str
) -> list[str]:
    """The full command line of a router listening on 127.0.0.1 only (API and Prometheus exporter)."""
    return kind.argv(
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        *FAST_FAILURE_FLAGS,
        *extra,
    )  # fmt: skip


@contextmanager
def run_router(
    kind: RouterKind, worker_urls: Sequence[str], *, policy: str = "round_robin", extra: Sequence[str] = ()
) -> Iterator[Router]:
    """A router in front of `worker_urls`, ready (every worker registered and healthy) until the block exits."""
    port, metrics_port = free_port(), free_port()
    args = launch_args(kind, worker_urls, policy, port, metrics_port, *extra)
    with start_process(args, port, health_path="/readiness", timeout=READY_TIMEOUT_S) as proc:
        router = Router(kind, proc.url, port, metrics_port)
        wait_for_workers(router.url, len(worker_urls))  # on failure start_process shows the router's output
        yield router


def wait_for_workers(url: str, count: int, timeout: float = READY_TIMEOUT_S) -> None:
    """`/readiness` answers 200 with the first healthy worker; wait until all `count` are."""
    deadline = time.monotonic() + timeout
    last = ""
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            response = client.get(f"{url}/readiness")
            last = response.text
            if response.status_code == 200 and response.json().get("healthy_workers", 0) >= count:
                return
            time.sleep(0.05)
    raise TimeoutError(f"router {url} has not registered {count} healthy workers: {last}")
