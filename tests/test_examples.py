"""The examples `make demo` runs, against the real gateway and simulator (the README's front door)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service
from procs import REPO_ROOT


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_agent_loop_example_runs_and_keeps_its_session(gateway: Service) -> None:
    session_id = "example-agent-loop"
    result = run_example(
        "examples/agent_loop.py", "--gateway-url", gateway.url, "--session-id", session_id, "--keep-session"
    )
    assert result.returncode == 0, result.stderr
    assert "[agent] streaming:" in result.stdout and "routed_experts" in result.stdout
    view = httpx.get(f"{gateway.url}/v1/sessions/{session_id}").json()
    assert view["turns"] == 5  # three model turns with two tool results between them
    assert view["replay"]["routed_experts"] and view["replay"]["top_p"]
    httpx.delete(f"{gateway.url}/v1/sessions/{session_id}")


# ---- examples/chat_agent.py: the OpenAI client on a chat session ----------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_chat_agent_example_runs_a_tool_loop(
    chat_gateway: Service, chat_sim: Service, tokenizer_dir: Path, stream: bool
) -> None:
    from transformers import AutoTokenizer

    session_id = f"example-chat-agent-{'stream' if stream else 'unary'}"
    args = ["--gateway", chat_gateway.url, "--script-simulator", chat_sim.url, "--session-id", session_id]
    args += ["--num-layers", str(SIM_LAYERS), "--topk", str(SIM_TOPK), "--fetch-sample", "--keep-session"]
    scripted_before = httpx.get(f"{chat_sim.url}/sim/stats").json()["scripted"]
    result = run_example("examples/chat_agent.py", *args, *(["--stream"] if stream else []))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert 'tool call get_weather({"city":"Paris"}) -> {"city": "Paris"' in out
    assert '"result": 84}' in out  # the calculator ran on the model's arguments
    assert "[chat] assistant: It is sunny and 21 degrees in Paris" in out
    assert "rollout_routed_experts" in out and "[chat] done (session kept)" in out
    assert httpx.get(f"{chat_sim.url}/sim/stats").json()["scripted"] == scripted_before + 3

    view: dict[str, Any] = httpx.get(f"{chat_gateway.url}/v1/sessions/{session_id}", params={"full": "true"}).json()
    try:
        assert view["status"] == "completed"
        assert [t["kind"] for t in view["turn_log"]] == ["model", "tool", "model", "tool", "model"]
        # The model's tokens are trained (loss mask 1), the rendered tool results are not (0): span by span.
        expected_mask = [int(t["kind"] == "model") for t in view["turn_log"] for _ in range(t["num_tokens"])]
        assert view["full"]["loss_mask"] == expected_mask
        # Routing replay over every token the model was given; top-p replay on every response token.
        assert view["replay"] == {
            "routed_experts": True,
            "routed_experts_rows": view["total_tokens"] - 1,
            "top_p": True,
        }
        assert len(view["full"]["rollout_top_p_token_offsets"]) == view["response_length"] + 1
        messages = view["chat"]["messages"]
        assert [m["role"] for m in messages] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
        ]
        assert [[c["name"] for c in m.get("tool_calls", [])] for m in messages if m["role"] == "assistant"] == [
            ["get_weather"],
            ["calculator"],
            [],
        ]
        # Token-in-token-out: the first model span is the scripted tool call, the tool spans hold the tool results.
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        tokens, start, spans = view["full"]["tokens"], view["prompt_length"], []
        for turn in view["turn_log"]:
            spans.append(tokenizer.decode(tokens[start : start + turn["num_tokens"]]))
            start += turn["num_tokens"]
        assert spans[0].startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}')
        assert "<tool_response>" in spans[1] and '"temperature_c": 21' in spans[1]
        assert "<tool_response>" in spans[3] and '"result": 84' in spans[3]
        assert not any("<tool_response>" in spans[i] for i in (0, 2, 4))
    finally:
        httpx.delete(f"{chat_gateway.url}/v1/sessions/{session_id}")


# ---- examples/agent_rl.py: slime_client.agent.generate as slime calls it -------------------------------------------
def test_agent_rl_example_turns_rollouts_into_slimes_samples(chat_gateway: Service, chat_sim: Service) -> None:
    args = ["--gateway", chat_gateway.url, "--script-simulator", chat_sim.url, "--samples", "2"]
    args += ["--num-layers", str(SIM_LAYERS), "--topk", str(SIM_TOPK)]
    result = run_example("examples/agent_rl.py", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    samples = [line for line in out.splitlines() if "-> sample:" in line]
    assert len(samples) == 2
    for line in samples:
        assert "reward=1.0" in line and "status=completed" in line and "use_tool=True" in line
        tokens = int(line.split(" tokens=")[1].split()[0])
        assert f"rollout_routed_experts=({tokens - 1}, {SIM_LAYERS}, {SIM_TOPK})" in line
    assert "the samples pass slime's checks" in out
    assert "sessions left on the gateway by these rollouts: 0" in out
