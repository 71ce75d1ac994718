"""The Docker sandbox (``SLIME_AGENT_SANDBOX=docker:IMAGE``) for real: Claude Code and Codex rollouts through
``slime_client.agent.generate``, each CLI in a fresh container of a plain Debian image with Python (the CLI, the
workspace and the HOME mounted from this machine), against the gateway and simulator on the host: ``make test-docker``.

Opt-in (marker ``docker``): a Docker engine (``scripts/docker_engine.sh up`` starts one where there is none) and the
image (``python:3.11-slim``, or the debootstrap-built ``local/debian-python:bookworm`` where Docker Hub cannot be
reached). Without them every test here is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agent_fixtures
import pytest
from chat_checks import hermes_call, script
from conftest import Service, run_gateway
from slime_shapes import Sample
from test_agent_harnesses import FIX, SAMPLING, TEST, check_against_snapshot, slime_args, task_sample
from test_harnesses import harness

from slime_client.agent import close_runtimes, generate

pytestmark = pytest.mark.docker

KEY = "docker-sandbox-key"
IMAGES = (os.environ.get("SANDBOX_IMAGE", ""), "python:3.11-slim", "local/debian-python:bookworm")


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def sandbox_image() -> str:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI: run `make test-docker` (scripts/docker_engine.sh installs and starts an engine)")
    if docker("info").returncode != 0:
        pytest.skip("no Docker engine answers: run `make test-docker` (scripts/docker_engine.sh up)")
    for image in IMAGES:
        if image and docker("image", "inspect", image).returncode == 0:
            return image
    pytest.skip(
        f"none of the images {[i for i in IMAGES if i]} is here (scripts/docker_engine.sh builds the local one)"
    )


@pytest.fixture(scope="module")
def keyed_gateway(chat_sim: Service, tokenizer_dir: Path) -> Iterator[Service]:
    env = {"GATEWAY_API_KEY": KEY, "GATEWAY_CHAT_CONTEXT_TOKENS": "262144"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as service:
        yield service


@pytest.fixture
def docker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sandbox_image: str) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("SLIME_GATEWAY_API_KEY", KEY)
    monkeypatch.setenv("SLIME_AGENT_WORKDIR", str(tmp_path / "agent"))
    monkeypatch.setenv("SLIME_AGENT_REWARD", "agent_fixtures:snapshot_and_grade")
    monkeypatch.setenv("SLIME_AGENT_TIME_BUDGET_S", "240")
    monkeypatch.setenv("SLIME_AGENT_MODEL", "tiny")
    monkeypatch.setenv("SLIME_AGENT_SANDBOX", f"docker:{sandbox_image}")
    yield monkeypatch


@pytest.fixture(autouse=True)
async def _close_runtimes() -> Any:
    yield
    await close_runtimes()


def sandbox_containers() -> list[str]:
    return docker("ps", "--all", "--quiet", "--filter", "label=slime-agent.sandbox=1").stdout.split()


async def test_claude_code_in_a_container_fixes_the_task(
    docker_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    docker_env.setenv("SLIME_AGENT", "claude_code")
    docker_env.setenv("SLIME_AGENT_CLAUDE", str(harness("claude")))
    sid = "docker-claude-fix"
    answers = [
        "I will fix it.\n" + hermes_call("Bash", {"command": FIX, "description": "Fix add"}),
        hermes_call(
            "Bash",
            {
                "command": f"{TEST} && test -x /opt/slime-agent/node/node && echo in-a-container",
                "description": "Run the test",
            },
        ),
        "Fixed: the test passes.",
    ]
    script(chat_sim, sid, *answers)
    task = agent_fixtures.make_task(tmp_path / "task")
    before = set(sandbox_containers())
    samples = await generate(slime_args(keyed_gateway), task_sample(sid, task, 31), SAMPLING)
    check_against_snapshot(samples, sid, tokenizer, [answers])
    (sample,) = samples
    assert sample.reward == 1.0 and sample.metadata["agent_exit_code"] == 0  # edited in the container, graded here
    results = [m["content"] for m in agent_fixtures.SNAPSHOTS[sid][0]["view"]["chat"]["record"]["messages"]]
    # the command ran in the container: the Node.js the sandbox mounts there is not on this machine's file system
    assert results[-2].strip().endswith("in-a-container")
    assert not Path("/opt/slime-agent/node/node").exists()
    assert set(sandbox_containers()) == before  # --rm: the container is gone


async def test_past_the_time_budget_the_container_is_killed(
    docker_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tmp_path: Path
) -> None:
    docker_env.setenv("SLIME_AGENT", "claude_code")
    docker_env.setenv("SLIME_AGENT_CLAUDE", str(harness("claude")))
    docker_env.setenv("SLIME_AGENT_TIME_BUDGET_S", "15")
    sid = "docker-claude-budget"
    script(
        chat_sim,
        sid,
        hermes_call("Bash", {"command": "python3 -c 'import time; time.sleep(600)'", "description": "Wait"}),
    )
    (sample,) = await generate(
        slime_args(keyed_gateway), task_sample(sid, agent_fixtures.make_task(tmp_path / "t"), 0), SAMPLING
    )
    assert sample.metadata["agent_timed_out"] is True and sum(sample.loss_mask) > 0
    assert sandbox_containers() == [] or all(
        json.loads(docker("inspect", c).stdout)[0]["State"]["Running"] is False for c in sandbox_containers()
    )


async def test_codex_in_a_container_fixes_the_task(
    docker_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    docker_env.setenv("SLIME_AGENT", "codex")
    docker_env.setenv("SLIME_AGENT_CODEX", str(harness("codex")))
    sid = "docker-codex-fix"
    answers = [hermes_call("exec_command", {"cmd": FIX}), hermes_call("exec_command", {"cmd": TEST}), "Fixed."]
    script(chat_sim, sid, *answers)
    task = agent_fixtures.make_task(tmp_path / "task")
    samples = await generate(slime_args(keyed_gateway), task_sample(sid, task, 32), SAMPLING)
    check_against_snapshot(samples, sid, tokenizer, [answers])
    assert samples[0].reward == 1.0 and samples[0].metadata["agent_exit_code"] == 0
    assert isinstance(samples[0], Sample)
