"""The curl examples of docs/operations/weight-updates.md run as written against a gateway (its simulator as the
upstream), so the page cannot drift from what the gateway answers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from conftest import Service, run_gateway, run_simulator
from procs import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "operations" / "weight-updates.md"
BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def commands() -> list[str]:
    return [line for block in BLOCK.findall(PAGE.read_text()) for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def gateway() -> Iterator[Service]:
    with run_simulator() as sim, run_gateway(sim.url, "--log-level", "warning") as service:
        yield service


def test_every_curl_example_runs_and_answers_json(gateway: Service) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    found = commands()
    assert len(found) >= 5 and all(command.startswith("curl ") for command in found), found
    outputs = []
    for command in found:
        local = command.replace("localhost:8000", gateway.url.removeprefix("http://"))
        done = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {local.replace('curl -s', 'curl -sf', 1)}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        outputs.append(done.stdout)
    created, resumed, not_resumed = (json.loads(out) for out in outputs[:3])
    assert created["session_id"] == "resumable"
    assert resumed["resumed"] == 0 and not_resumed["resumed"] == 0  # nothing aborted them: one request each
    trained = json.loads(outputs[-1])  # the view's trained_versions
    generated = resumed["completion_tokens"] + not_resumed["completion_tokens"]
    assert trained["count"] == 1 and sum(trained["tokens"].values()) == generated
