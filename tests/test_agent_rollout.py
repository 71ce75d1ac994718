"""``slime_client.agent.generate`` with Python agents (``SLIME_AGENT=module:function``): the orchestration, several
rollouts at once, the eval path, and every failure path, against the real gateway and simulator.

What a rollout returns must be slime's: samples that pass slime's fan-out checks and hold exactly what the session
held (snapshotted by the reward function just before the finish), or one placeholder with an ``abort_reason``. In
every case the session is deleted: a gateway of its own holds none after 50 rollouts with failures mixed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import agent_fixtures
import httpx
import numpy as np
import pytest
from chat_checks import CALL_TEXT, FINAL_TEXT, hermes_call, script
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway
from procs import free_port, start_process
from slime_shapes import Sample, TrainArgs, check_fan_out

from slime_client.agent import close_runtimes, counters, generate

R3 = TrainArgs(use_rollout_routing_replay=True, num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK, rollout_top_p=0.9)
SAMPLING = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 64, "skip_special_tokens": False, "no_stop_trim": True}


def slime_args(gateway_url: str, **extra: Any) -> SimpleNamespace:
    fields = {
        "gateway_url": gateway_url,
        "use_rollout_routing_replay": True,
        "num_layers": SIM_LAYERS,
        "moe_router_topk": SIM_TOPK,
        "rollout_top_p": 0.9,
        "rollout_max_context_len": 0,
        "rollout_max_response_len": 64,
        "hf_checkpoint": "/models/tiny",
    }
    return SimpleNamespace(**(fields | extra))


@pytest.fixture
def agent_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """A workdir of the test's own, Python agents, short budgets; the runtimes closed afterwards."""
    monkeypatch.setenv("SLIME_AGENT_WORKDIR", str(tmp_path / "agent"))
    monkeypatch.setenv("SLIME_AGENT_TIME_BUDGET_S", "60")
    monkeypatch.setenv("SLIME_AGENT_MODEL", "tiny")
    yield monkeypatch


@pytest.fixture(autouse=True)
async def _close_runtimes() -> Any:
    yield
    await close_runtimes()


def base_sample(sid: str, index: int = 0, **metadata: Any) -> Sample:
    return Sample(index=index, group_index=0, prompt="Weather in Paris?", session_id=sid, metadata=dict(metadata))


def gone(gateway: Service, sid: str) -> bool:
    return httpx.get(f"{gateway.url}/v1/sessions/{sid}").status_code == 404


def assert_placeholder(samples: list[Sample], reason: str) -> Sample:
    (sample,) = samples
    assert sample.remove_sample and sample.status is Sample.Status.ABORTED and sample.tokens == [0, 0]
    assert sample.metadata["abort_reason"] == reason, sample.metadata
    check_fan_out(samples, R3)  # a placeholder passes slime's R3 and top-p checks beside real samples
    return sample


# ---- the happy paths ---------------------------------------------------------------------------------------------
async def test_a_python_agent_rollout_becomes_samples_that_hold_the_session(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, chat_sim: Service
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    agent_env.setenv("SLIME_AGENT_REWARD", "agent_fixtures:snapshot_reward")
    sid = "rollout-weather"
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    samples = await generate(slime_args(chat_gateway.url), base_sample(sid, 4, grade=0.5), SAMPLING)
    check_fan_out(samples, R3)
    (sample,) = samples
    (snapshot,) = agent_fixtures.SNAPSHOTS[sid]
    arrays = snapshot["sample"]
    assert sample.tokens == arrays["tokens"].tolist() and sample.loss_mask == arrays["loss_mask"].tolist()
    assert sample.rollout_log_probs == arrays["rollout_log_probs"].tolist()
    assert np.array_equal(np.asarray(sample.rollout_routed_experts), arrays["rollout_routed_experts"])
    assert np.array_equal(np.asarray(sample.rollout_top_p_token_offsets), arrays["rollout_top_p_token_offsets"])
    assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1
    # the loss mask is 1 exactly on the model's tokens: its two turns, as the turn log says
    log = snapshot["view"]["turn_log"]
    assert [t["kind"] for t in log] == ["model", "tool", "model"]
    assert sample.loss_mask == [int(t["kind"] == "model") for t in log for _ in range(t["num_tokens"])]
    assert sample.reward == 0.5 and sample.rollout_id == 4 and sample.status is Sample.Status.COMPLETED
    assert sample.metadata["use_tool"] is True and sample.metadata["session_id"] == sid
    assert sample.metadata["agent"] == "agent_fixtures:weather_agent" and sample.metadata["agent_timed_out"] is False
    assert gone(chat_gateway, sid)


async def test_an_openai_agents_sdk_agent(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, chat_sim: Service
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:agents_sdk_agent")
    sid = "rollout-agents-sdk"
    script(chat_sim, sid, hermes_call("get_weather", {"city": "Paris"}), "It is sunny in Paris.")
    samples = await generate(slime_args(chat_gateway.url), base_sample(sid, 9), SAMPLING)
    check_fan_out(samples, R3)
    (sample,) = samples
    assert sample.reward == 1.0 and sample.metadata["use_tool"] is True
    assert sum(sample.loss_mask) > 0 and gone(chat_gateway, sid)


async def test_the_reward_left_to_slimes_reward_model(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, chat_sim: Service
) -> None:
    """No reward from the agent nor a reward function: None on every sample (slime runs --custom-rm-path)."""
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    sid = "rollout-rm"
    script(chat_sim, sid, "Sunny.")
    (sample,) = await generate(slime_args(chat_gateway.url), base_sample(sid), SAMPLING)
    assert sample.reward is None and sample.status is Sample.Status.COMPLETED


async def test_several_rollouts_at_once(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, chat_sim: Service
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    agent_env.setenv("SLIME_AGENT_CONCURRENCY", "3")
    sids = [f"rollout-many-{i}" for i in range(8)]
    for sid in sids:
        script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    args = slime_args(chat_gateway.url)
    results = await asyncio.gather(
        *(generate(args, base_sample(sid, i, reward=1.0), SAMPLING) for i, sid in enumerate(sids))
    )
    for i, samples in enumerate(results):
        check_fan_out(samples, R3)
        assert [s.rollout_id for s in samples] == [i] and samples[0].reward == 1.0
    assert all(gone(chat_gateway, sid) for sid in sids)


async def test_the_eval_path_returns_the_reward_without_samples(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, chat_sim: Service
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    sid = "rollout-eval"
    script(chat_sim, sid, "Sunny.")
    (sample,) = await generate(slime_args(chat_gateway.url), base_sample(sid, reward=0.25), SAMPLING, evaluation=True)
    assert sample.reward == 0.25 and sample.status is Sample.Status.COMPLETED and sample.remove_sample
    assert sample.tokens == [0, 0] and gone(chat_gateway, sid)


# ---- failures: one placeholder each, a warning naming the session, a counter, no session left --------------------
@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [("crash", "exception:RuntimeError"), ("idle", "session_empty"), ("cancel", "cancelled")],
)
async def test_an_agent_that_fails_gives_a_placeholder(
    agent_env: pytest.MonkeyPatch,
    chat_gateway: Service,
    caplog: pytest.LogCaptureFixture,
    behaviour: str,
    reason: str,
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
    sid = f"rollout-fails-{behaviour}"
    before = counters().get(f"aborted:{reason.split(':')[0]}", 0)
    with caplog.at_level(logging.WARNING, logger="slime_client.agent"):
        samples = await generate(slime_args(chat_gateway.url), base_sample(sid, behaviour=behaviour), SAMPLING)
    assert_placeholder(samples, reason)
    assert any(sid in record.getMessage() and reason in record.getMessage() for record in caplog.records)
    assert counters()[f"aborted:{reason.split(':')[0]}"] == before + 1
    assert gone(chat_gateway, sid)


async def test_a_reward_without_a_trajectory_raises_the_alarm(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, caplog: pytest.LogCaptureFixture
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
    sid = "rollout-reward-no-trajectory"
    before = counters().get("reward_without_trajectory", 0)
    with caplog.at_level(logging.WARNING, logger="slime_client.agent"):
        await generate(slime_args(chat_gateway.url), base_sample(sid, behaviour="idle"), SAMPLING)
    assert counters()["reward_without_trajectory"] == before + 1
    assert any("a reward" in r.getMessage() and "no trajectory" in r.getMessage() for r in caplog.records)


async def test_past_the_time_budget_the_turns_so_far_are_samples(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, chat_sim: Service
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
    agent_env.setenv("SLIME_AGENT_TIME_BUDGET_S", "2")
    sid = "rollout-slow"
    script(chat_sim, sid, "A first answer.")
    (sample,) = await generate(slime_args(chat_gateway.url), base_sample(sid, behaviour="slow"), SAMPLING)
    assert sample.status is Sample.Status.COMPLETED and sum(sample.loss_mask) > 0
    assert sample.metadata["agent_timed_out"] is True and sample.reward is None
    assert gone(chat_gateway, sid)


async def test_past_the_wall_clock_guard_a_placeholder(agent_env: pytest.MonkeyPatch, chat_gateway: Service) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
    agent_env.setenv("SLIME_AGENT_GUARD_S", "1.5")
    sid = "rollout-guard"
    samples = await generate(slime_args(chat_gateway.url), base_sample(sid, behaviour="slow"), SAMPLING)
    assert_placeholder(samples, "wall_clock_timeout")
    assert gone(chat_gateway, sid)


async def test_a_rollout_cancelled_from_outside_drops_its_session(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
    sid = "rollout-cancelled-outside"
    task = asyncio.create_task(generate(slime_args(chat_gateway.url), base_sample(sid, behaviour="slow"), SAMPLING))
    while gone(chat_gateway, sid) or not httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").json()["turns"]:
        await asyncio.sleep(0.05)  # the agent's first turn is done; it sleeps now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone(chat_gateway, sid)


async def test_the_gateway_down_gives_a_placeholder(agent_env: pytest.MonkeyPatch) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    agent_env.setenv("SLIME_GATEWAY_RETRY_FOR_S", "2")  # the SDK rides out a down gateway this long (30 s by default)
    samples = await generate(slime_args(f"http://127.0.0.1:{free_port()}"), base_sample("rollout-down"), SAMPLING)
    assert_placeholder(samples, "gateway_unavailable")
    assert counters().get("drop_failed", 0) >= 1


async def test_a_gateway_restarted_mid_rollout_gives_a_placeholder(
    agent_env: pytest.MonkeyPatch, chat_sim: Service, tokenizer_dir: Path
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "gateway", "--upstream-url", chat_sim.url, "--port", str(port)]
    command += ["--tokenizer", str(tokenizer_dir), "--log-level", "warning"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(start_process(command, port))

        def restart() -> None:  # the agent's first turn is done: the gateway goes away and comes back empty
            stack.close()
            stack.enter_context(start_process(command, port))

        agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
        sid = "rollout-restart"
        script(chat_sim, sid, "Before the restart.")
        sample = base_sample(sid, behaviour="restart", between_turns=restart)
        samples = await generate(slime_args(f"http://127.0.0.1:{port}"), sample, SAMPLING)
        assert_placeholder(samples, "session_lost")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/sessions").json()["count"] == 0


async def test_a_missing_cli_or_task_gives_a_placeholder(
    agent_env: pytest.MonkeyPatch, chat_gateway: Service, tmp_path: Path
) -> None:
    agent_env.setenv("SLIME_AGENT", "claude_code")
    agent_env.setenv("SLIME_AGENT_CLAUDE", str(tmp_path / "no-such-claude"))
    samples = await generate(slime_args(chat_gateway.url), base_sample("rollout-no-cli"), SAMPLING)
    assert_placeholder(samples, "harness_not_found")
    assert gone(chat_gateway, "rollout-no-cli")
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    sample = base_sample("rollout-no-task", task_dir=str(tmp_path / "no-such-task"))
    assert_placeholder(await generate(slime_args(chat_gateway.url), sample, SAMPLING), "task_not_found")


async def test_a_session_id_in_use_is_left_alone(agent_env: pytest.MonkeyPatch, chat_gateway: Service) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:weather_agent")
    sid = "rollout-taken"
    assert httpx.post(f"{chat_gateway.url}/v1/sessions", json={"session_id": sid}).status_code == 201
    assert_placeholder(await generate(slime_args(chat_gateway.url), base_sample(sid), SAMPLING), "session_exists")
    assert not gone(chat_gateway, sid)  # another run's session: not this rollout's to drop
    httpx.delete(f"{chat_gateway.url}/v1/sessions/{sid}")


async def test_fifty_rollouts_with_failures_leave_no_session(
    agent_env: pytest.MonkeyPatch, chat_sim: Service, tokenizer_dir: Path
) -> None:
    agent_env.setenv("SLIME_AGENT", "agent_fixtures:mixed_agent")
    agent_env.setenv("SLIME_AGENT_TIME_BUDGET_S", "3")
    behaviours = ["ok", "crash", "idle", "slow", "cancel"] * 10
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning") as gateway:
        args = slime_args(gateway.url)
        results = await asyncio.gather(
            *(generate(args, base_sample(f"fifty-{i}", i, behaviour=b), SAMPLING) for i, b in enumerate(behaviours))
        )
        assert httpx.get(f"{gateway.url}/v1/sessions").json()["count"] == 0
    reasons = [samples[0].metadata.get("abort_reason") for samples in results]
    assert reasons.count("exception:RuntimeError") == 10 and reasons.count("session_empty") == 10
    assert reasons.count("cancelled") == 10
    for samples, behaviour in zip(results, behaviours, strict=True):
        check_fan_out(samples, R3)
        if behaviour in ("ok", "slow"):
            assert samples[0].status is Sample.Status.COMPLETED and sum(samples[0].loss_mask) > 0
