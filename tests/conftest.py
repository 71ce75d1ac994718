"""Shared fixtures: the real simulator and gateway processes on 127.0.0.1 (session-scoped, started once)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import free_port, start_process

# The MoE shape the shared simulator runs with (small so tests stay fast; shapes are parameters everywhere).
SIM_LAYERS, SIM_TOPK, SIM_EXPERTS = 4, 2, 8


@dataclass(frozen=True)
class Service:
    url: str
    port: int


@contextmanager
def run_simulator(*extra: str) -> Iterator[Service]:
    port = free_port()
    args = [sys.executable, "-m", "gateway.simulator", "--port", str(port)]
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
    from gateway.simulator.tiny_tokenizer import build_tiny_chat_tokenizer

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
