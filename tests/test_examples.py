"""The example `make demo` runs, against the real gateway and simulator (the README's front door)."""

from __future__ import annotations

import subprocess
import sys

import httpx
from conftest import Service
from procs import REPO_ROOT


def test_agent_loop_example_runs_and_keeps_its_session(gateway: Service) -> None:
    session_id = "example-agent-loop"
    result = subprocess.run(
        [
            sys.executable,
            "examples/agent_loop.py",
            "--gateway-url",
            gateway.url,
            "--session-id",
            session_id,
            "--keep-session",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "[agent] streaming:" in result.stdout and "routed_experts" in result.stdout
    view = httpx.get(f"{gateway.url}/v1/sessions/{session_id}").json()
    assert view["turns"] == 5  # three model turns with two tool results between them
    assert view["replay"]["routed_experts"] and view["replay"]["top_p"]
    httpx.delete(f"{gateway.url}/v1/sessions/{session_id}")
