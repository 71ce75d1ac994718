"""Real Claude Code and Codex rollouts through ``slime_client.agent.generate``, as a slime user runs them.

``SLIME_AGENT=claude_code`` / ``codex`` with the pinned CLIs of ``.harnesses/`` (``make harnesses``; skipped, quoting
the install log, when they could not be had), a gateway with an API key, the simulator answering with scripted text:
the model fixes a tiny task (a git repository whose test fails: ``calc.add`` subtracts) with the CLI's own shell
tool, runs the test, and says so. The reward is the task's own test, run in the rollout's workspace after the CLI
ended. The returned samples are checked against the session as it was just before the finish (snapshotted by the
reward function), token by token: the tokens are the chat template's rendering of the recorded conversation, the
loss mask 1 exactly on the model's tokens, log-probs, routing rows (``len(tokens) - 1``), top-p spans; and slime's
contract: one ``rollout_id``, the reward on each, the metadata. A Claude Code run with a subagent gives two samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import agent_fixtures
import numpy as np
import pytest
from chat_checks import check_recorded, hermes_call, script
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway
from slime_shapes import Sample, TrainArgs, check_fan_out
from test_harnesses import harness

from slime_client.agent import close_runtimes, generate

KEY = "agent-rollout-key"
R3 = TrainArgs(use_rollout_routing_replay=True, num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK, rollout_top_p=0.9)
SAMPLING = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 512, "skip_special_tokens": False}
FIX = "sed -i 's/a - b/a + b/' calc.py"
TEST = "python3 test_calc.py"


@pytest.fixture(scope="module")
def keyed_gateway(chat_sim: Service, tokenizer_dir: Path) -> Iterator[Service]:
    env = {"GATEWAY_API_KEY": KEY, "GATEWAY_CHAT_CONTEXT_TOKENS": "262144"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as service:
        yield service


@pytest.fixture
def rollout_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("SLIME_GATEWAY_API_KEY", KEY)
    monkeypatch.setenv("SLIME_AGENT_WORKDIR", str(tmp_path / "agent"))
    monkeypatch.setenv("SLIME_AGENT_REWARD", "agent_fixtures:snapshot_and_grade")
    monkeypatch.setenv("SLIME_AGENT_TIME_BUDGET_S", "240")
    monkeypatch.setenv("SLIME_AGENT_MODEL", "tiny")
    yield monkeypatch


@pytest.fixture(autouse=True)
async def _close_runtimes() -> Any:
    yield
    await close_runtimes()


def slime_args(gateway: Service) -> SimpleNamespace:
    return SimpleNamespace(
        gateway_url=gateway.url,
        use_rollout_routing_replay=True,
        num_layers=SIM_LAYERS,
        moe_router_topk=SIM_TOPK,
        rollout_top_p=0.9,
        rollout_max_context_len=0,
        rollout_max_response_len=512,
        hf_checkpoint="/models/tiny",
    )


def task_sample(sid: str, task: Path, index: int) -> Sample:
    prompt = "calc.add is wrong: test_calc.py fails. Fix calc.py and run the test."
    return Sample(index=index, group_index=0, prompt=prompt, session_id=sid, metadata={"task_dir": str(task)})


def check_against_snapshot(samples: list[Sample], sid: str, tokenizer: Any, answers: list[list[str]]) -> None:
    """Each sample holds its branch exactly as the session held it, and that branch is the template's rendering of
    its conversation with the model's tokens (``answers``: each branch's scripted texts) trained, nothing else."""
    check_fan_out(samples, R3)
    snapshots = agent_fixtures.SNAPSHOTS[sid]
    assert len(samples) == len(snapshots) == len(answers)
    for sample, snapshot, texts in zip(samples, snapshots, answers, strict=True):
        arrays = snapshot["sample"]
        check_recorded(snapshot["view"], arrays, tokenizer, texts)
        assert sample.tokens == arrays["tokens"].tolist()
        assert sample.loss_mask == arrays["loss_mask"].tolist()
        assert sample.rollout_log_probs == arrays["rollout_log_probs"].tolist()
        assert np.array_equal(np.asarray(sample.rollout_routed_experts), arrays["rollout_routed_experts"])
        assert np.array_equal(np.asarray(sample.rollout_top_p_token_ids), arrays["rollout_top_p_token_ids"])
        assert np.array_equal(np.asarray(sample.rollout_top_p_token_offsets), arrays["rollout_top_p_token_offsets"])
        assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1


def tool_results(snapshot: dict[str, Any]) -> list[str]:
    return [m["content"] for m in snapshot["view"]["chat"]["record"]["messages"] if m["role"] == "tool"]


# ---- Claude Code -------------------------------------------------------------------------------------------------
def claude_env(env: pytest.MonkeyPatch) -> None:
    env.setenv("SLIME_AGENT", "claude_code")
    env.setenv("SLIME_AGENT_CLAUDE", str(harness("claude")))


async def test_claude_code_fixes_the_task_and_its_samples_hold_the_session(
    rollout_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    claude_env(rollout_env)
    sid = "claude-rollout-fix"
    answers = [
        "I will fix the subtraction.\n" + hermes_call("Bash", {"command": FIX, "description": "Fix add"}),
        hermes_call("Bash", {"command": TEST, "description": "Run the test"}),
        "Fixed: add now adds, and test_calc passes.",
    ]
    script(chat_sim, sid, *answers)
    task = agent_fixtures.make_task(tmp_path / "task")
    samples = await generate(slime_args(keyed_gateway), task_sample(sid, task, 11), SAMPLING)
    check_against_snapshot(samples, sid, tokenizer, [answers])
    (sample,) = samples
    assert sample.reward == 1.0 and sample.rollout_id == 11  # the task's test passed in the workspace
    assert sample.metadata["agent_exit_code"] == 0 and sample.metadata["agent"] == "claude_code"
    assert sample.metadata["use_tool"] is True and sample.metadata["truncated"] is False
    assert Path(sample.metadata["agent_log"]).is_file()  # the CLI's output, kept
    results = tool_results(agent_fixtures.SNAPSHOTS[sid][0])
    assert "test_calc: ok" in results[-1]  # Claude Code ran the test and sent back its output
    assert "a - b" in task.joinpath("calc.py").read_text()  # the task folder itself is untouched: a copy was edited


async def test_a_claude_code_run_with_a_subagent_gives_two_samples(
    rollout_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    claude_env(rollout_env)
    sid = "claude-rollout-subagent"
    explore = {
        "description": "Find the bug",
        "prompt": "Read calc.py and report what add does.",
        "subagent_type": "Explore",
        "run_in_background": False,
    }
    call, report = hermes_call("Agent", explore), "add returns a - b: it subtracts."
    fix = hermes_call("Bash", {"command": f"{FIX} && {TEST}", "description": "Fix and test"})
    final = "Fixed add; the test passes."
    script(chat_sim, sid, call, report, fix, final)
    task = agent_fixtures.make_task(tmp_path / "task")
    samples = await generate(slime_args(keyed_gateway), task_sample(sid, task, 12), SAMPLING)
    check_against_snapshot(samples, sid, tokenizer, [[call, fix, final], [report]])
    main, sub = samples
    assert [s.rollout_id for s in samples] == [12, 12] and [s.reward for s in samples] == [1.0, 1.0]
    assert main.metadata["branch"]["index"] == 0 and sub.metadata["branch"]["cause"] == "new_root"
    assert main.metadata["use_tool"] is True and sub.metadata["use_tool"] is False


@pytest.mark.parametrize(
    ("extra_args", "reason"),
    [("--no-such-flag", "agent_failed:exit 1"), ("--version", "session_empty")],
    ids=["cli-fails", "never-calls-the-model"],
)
async def test_a_claude_code_run_with_nothing_to_train_gives_a_placeholder(
    rollout_env: pytest.MonkeyPatch, keyed_gateway: Service, tmp_path: Path, extra_args: str, reason: str
) -> None:
    """The CLI refuses its command line (it exits 1), or ends without calling the model (``--version``): a
    placeholder that says which, the CLI's log kept, the session gone."""
    claude_env(rollout_env)
    rollout_env.setenv("SLIME_AGENT_CLAUDE_ARGS", extra_args)
    rollout_env.setenv("SLIME_AGENT_REWARD", "")
    sid = f"claude-rollout-{extra_args.strip('-')}"
    task = agent_fixtures.make_task(tmp_path / "task")
    (sample,) = await generate(slime_args(keyed_gateway), task_sample(sid, task, 0), {})
    assert sample.remove_sample and sample.status is Sample.Status.ABORTED
    assert sample.metadata["abort_reason"] == reason
    log = tmp_path / "agent" / "logs" / f"{sid}.log"
    assert log.is_file() and log.stat().st_size > 0


async def test_past_the_time_budget_claude_code_is_ended_and_its_turns_so_far_are_samples(
    rollout_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tmp_path: Path
) -> None:
    """The model starts a command that outlasts the time budget: the CLI and everything it started are ended; the
    turn it made is a sample (``agent_exit_code`` -1, as slime's harness reports it)."""
    claude_env(rollout_env)
    rollout_env.setenv("SLIME_AGENT_TIME_BUDGET_S", "8")
    sid = "claude-rollout-budget"
    marker = "import time; time.sleep(73.25)"  # a command line no other process has
    script(chat_sim, sid, hermes_call("Bash", {"command": f"python3 -c '{marker}'", "description": "Wait"}))
    task = agent_fixtures.make_task(tmp_path / "task")
    (sample,) = await generate(slime_args(keyed_gateway), task_sample(sid, task, 3), SAMPLING)
    assert sample.status is Sample.Status.COMPLETED and sum(sample.loss_mask) > 0
    assert sample.metadata["agent_timed_out"] is True and sample.metadata["agent_exit_code"] == -1
    assert sample.reward == 0.0  # the task's test still fails
    assert not processes_running(marker), "the CLI's command outlived the time budget"


def processes_running(command_line: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if command_line in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


# ---- Codex -------------------------------------------------------------------------------------------------------
async def test_codex_fixes_the_task_and_its_samples_hold_the_session(
    rollout_env: pytest.MonkeyPatch, keyed_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    rollout_env.setenv("SLIME_AGENT", "codex")
    rollout_env.setenv("SLIME_AGENT_CODEX", str(harness("codex")))
    sid = "codex-rollout-fix"
    answers = [
        hermes_call("exec_command", {"cmd": FIX}),
        hermes_call("exec_command", {"cmd": TEST}),
        "Fixed: add now adds, and test_calc passes.",
    ]
    script(chat_sim, sid, *answers)
    task = agent_fixtures.make_task(tmp_path / "task")
    samples = await generate(slime_args(keyed_gateway), task_sample(sid, task, 21), SAMPLING)
    check_against_snapshot(samples, sid, tokenizer, [answers])
    (sample,) = samples
    assert sample.reward == 1.0 and sample.rollout_id == 21
    assert sample.metadata["agent_exit_code"] == 0 and sample.metadata["agent"] == "codex"
    assert sample.metadata["use_tool"] is True
    assert "test_calc: ok" in tool_results(agent_fixtures.SNAPSHOTS[sid][0])[-1]
