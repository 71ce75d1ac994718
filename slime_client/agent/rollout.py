"""``generate``: slime's custom generate function for agents. Orchestration only: open a session, run the agent,
grade, finish the session into samples; the session is always dropped.

    SLIME_GATEWAY_URL=http://127.0.0.1:8000 SLIME_AGENT=claude_code python train.py ... \\
        --custom-generate-function-path slime_client.agent.generate

For each sample (its own session, workspace, HOME and time budget; ``SLIME_AGENT_CONCURRENCY`` at once):

1. ``open_session``: a chat session with routing and top-p replay as slime's flags ask, the sample's sampling
   params as its defaults (their ``max_new_tokens`` caps every turn), the context budget and the turn cap;
2. the agent (``SLIME_AGENT``: Claude Code, Codex, or a Python ``module:function``) works in the workspace against
   the session's base URL;
3. the reward: the agent's own, else ``SLIME_AGENT_REWARD``'s, else None (slime's ``--custom-rm-path`` scores the
   samples);
4. evaluation: slime's eval placeholder with the reward, no samples fetched. Training: ``finish_session``, one
   sample per branch with a trained token, all with the sample's ``rollout_id`` and the reward.

Whatever fails (the CLI crashes or is missing, the time budget or the wall-clock guard runs out, the agent never
calls the model, the gateway is down or restarted mid-rollout, an exception), the rollout returns slime's
placeholder sample (``remove_sample``, ABORTED, ``metadata["abort_reason"]``), logs a warning naming the session and
counts it (``counters()``); the session is deleted in every case. A rollout cancelled from outside is cleaned up the
same way and the cancellation goes on (its caller will not read a result).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slime_client.agent.adapter import GatewayAdapter
from slime_client.agent.contract import (
    Agent,
    AgentOutcome,
    AgentRun,
    PythonAgent,
    Reward,
    RewardFunction,
    load_callable,
    maybe_await,
    prompt_text,
)
from slime_client.agent.harness import HARNESSES, HarnessNotFound, find_cli
from slime_client.agent.samples import placeholder_sample
from slime_client.agent.sandbox import sandbox_from_spec
from slime_client.agent.settings import AgentSettings
from slime_client.agent.workspace import TaskNotFound, Workspace, prepare_workspace
from slime_client.errors import GatewayConnectionError, GatewayStatusError, GatewayTimeoutError

log = logging.getLogger("slime_client.agent")


async def generate(args: Any, sample: Any, sampling_params: Mapping[str, Any], evaluation: bool = False) -> list[Any]:
    """slime custom generate function (``--custom-generate-function-path slime_client.agent.generate``): one agent
    rollout for ``sample``, as ``list[Sample]`` (see the module docstring)."""
    return await runtime_for(args).rollout(sample, dict(sampling_params), evaluation=evaluation)


def counters() -> dict[str, int]:
    """This event loop's rollout counters (every runtime's): rollouts, samples, placeholders by ``abort_reason``
    (``aborted:REASON``), ``reward_without_trajectory`` (a reward for a session that held nothing to train on)."""
    total: Counter[str] = Counter()
    for runtime in _runtimes.get(asyncio.get_running_loop(), {}).values():
        total.update(runtime.counters)
    return dict(total)


async def close_runtimes() -> None:
    """Close the running loop's runtimes (their gateway connections): the end of training, tests."""
    for runtime in _runtimes.pop(asyncio.get_running_loop(), {}).values():
        await runtime.adapter.aclose()


# The one piece of module state, as in slime_client.slime: a runtime per (event loop, settings). A runtime's
# connections belong to the loop that opened them; slime runs every rollout on one long-lived loop.
_runtimes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[AgentSettings, AgentRuntime]] = (
    weakref.WeakKeyDictionary()
)


def runtime_for(args: Any) -> AgentRuntime:
    settings = AgentSettings.from_args(args)
    per_loop = _runtimes.setdefault(asyncio.get_running_loop(), {})
    runtime = per_loop.get(settings)
    if runtime is None:
        runtime = per_loop[settings] = AgentRuntime.create(settings, args)
    return runtime


class RolloutFailed(Exception):
    """A rollout that ends in a placeholder: ``reason`` is its ``abort_reason``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class AgentRuntime:
    """What every rollout of one configuration shares: the adapter (one connection pool), the agent, the reward
    function, the limit on rollouts at once, the counters."""

    settings: AgentSettings
    adapter: GatewayAdapter
    agent: Agent
    reward: RewardFunction | None
    launches: asyncio.Semaphore
    counters: Counter[str] = field(default_factory=Counter)

    @classmethod
    def create(cls, settings: AgentSettings, args: Any) -> AgentRuntime:
        adapter = GatewayAdapter.from_args(
            args,
            api_key=settings.api_key,
            max_turns_per_sid=settings.max_turns,
            split_reward=settings.split_reward,
            staleness=settings.staleness,
        )
        try:
            agent = make_agent(settings)
        except HarnessNotFound as exc:  # every rollout then ends in a placeholder saying so (and a warning)
            agent = missing_harness(exc)
        return cls(
            settings=settings,
            adapter=adapter,
            agent=agent,
            reward=None if settings.reward is None else load_callable(settings.reward),
            launches=asyncio.Semaphore(settings.concurrency),
        )

    # ---- one rollout --------------------------------------------------------------------------------------------
    async def rollout(self, sample: Any, sampling_params: dict[str, Any], *, evaluation: bool) -> list[Any]:
        session_id = getattr(sample, "session_id", None) or uuid.uuid4().hex
        sample.session_id = session_id
        self.counters["rollouts"] += 1
        async with self.launches:  # waiting here holds no session
            space: Workspace | None = None
            owned = True  # whether the session id is this rollout's to drop (not another run's that holds it)
            guard = asyncio.timeout(self.settings.guard_s)
            try:
                async with guard:
                    metadata = getattr(sample, "metadata", None) or {}
                    space = await prepare_workspace(self.settings.workdir, session_id, metadata, self.settings.task_key)
                    return await self._run(sample, session_id, space, sampling_params, evaluation)
            except TimeoutError as exc:
                if not guard.expired():  # the agent's or the reward function's own
                    return self._placeholder(sample, failure_reason(exc), f"{type(exc).__name__}: {exc}")
                return self._placeholder(sample, "wall_clock_timeout", f"past the {self.settings.guard_s:.0f}s guard")
            except RolloutFailed as exc:
                owned = exc.reason != "session_exists"
                return self._placeholder(sample, exc.reason, str(exc))
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    log.warning("agent rollout %s cancelled; its session is dropped", session_id)
                    self.counters["cancelled"] += 1
                    raise
                return self._placeholder(sample, "cancelled", "the agent was cancelled")
            except Exception as exc:
                log.warning("agent rollout %s failed", session_id, exc_info=True)
                return self._placeholder(sample, failure_reason(exc), f"{type(exc).__name__}: {exc}")
            finally:
                await asyncio.shield(self._cleanup(session_id if owned else None, space))

    async def _run(
        self, sample: Any, session_id: str, space: Workspace, sampling_params: dict[str, Any], evaluation: bool
    ) -> list[Any]:
        try:
            await self.adapter.open_session(session_id, sampling_defaults=sampling_params)
        except ValueError as exc:
            raise RolloutFailed("session_exists", str(exc)) from exc
        run = self._run_for(sample, session_id, space, sampling_params, evaluation)
        outcome = await self.agent(run)
        reward = outcome.reward if outcome.reward is not None else await self._grade(run, outcome)
        if evaluation:
            self.counters["evaluations"] += 1
            metadata = {"session_id": session_id, **outcome.metadata()}
            return placeholder_sample(sample, reward=reward, status="completed", metadata=metadata)
        branches = await self.adapter.take_branches(session_id, wait_timeout=self.settings.wait_timeout_s)
        if branches is None:
            raise RolloutFailed("session_lost", "the gateway no longer holds the session (restarted?)")
        fresh = self.adapter.keep_fresh(branches)
        if branches and not fresh:
            raise RolloutFailed("too_stale", f"every branch has trained tokens past {self.adapter.staleness}")
        extra = {"session_id": session_id, "agent": self.settings.agent, **outcome.metadata()}
        samples = self.adapter.to_samples(
            session_id,
            fresh,
            base_sample=sample,
            reward=reward,
            extra_metadata=extra,
            split_reward=self.settings.split_reward,
        )
        if not samples:
            if reward is not None:
                self.counters["reward_without_trajectory"] += 1
                log.warning(
                    "agent rollout %s: a reward (%r) but no trajectory: the agent never got a model answer to train",
                    session_id,
                    reward,
                )
            raise RolloutFailed(empty_reason(outcome), f"no trained token in the session ({outcome.metadata()})")
        self.counters["samples"] += len(samples)
        return samples

    def _run_for(
        self, sample: Any, session_id: str, space: Workspace, sampling_params: dict[str, Any], evaluation: bool
    ) -> AgentRun:
        budget = self.settings.time_budget_s
        return AgentRun(
            session_id=session_id,
            base_url=self.adapter.base_url(session_id),
            api_key=self.adapter.api_key,
            model=self.settings.model,
            prompt=prompt_text(getattr(sample, "prompt", "")),
            workspace=space.work,
            home=space.home,
            log_path=space.log,
            deadline=time.monotonic() + budget,
            time_budget_s=budget,
            sample_prompt=getattr(sample, "prompt", None),
            label=getattr(sample, "label", None),
            metadata=dict(getattr(sample, "metadata", None) or {}),
            sampling_params=sampling_params,
            index=getattr(sample, "index", None),
            group_index=getattr(sample, "group_index", None),
            evaluation=evaluation,
        )

    async def _grade(self, run: AgentRun, outcome: AgentOutcome) -> Reward | None:
        if self.reward is None:
            return None
        try:
            async with asyncio.timeout(self.settings.reward_timeout_s):
                return await maybe_await(self.reward(run, outcome))
        except TimeoutError as exc:
            raise RolloutFailed(
                "reward_timeout", f"the reward function ran past {self.settings.reward_timeout_s}s"
            ) from exc

    def _placeholder(self, sample: Any, reason: str, why: str) -> list[Any]:
        session_id = getattr(sample, "session_id", None)
        self.counters[f"aborted:{reason.split(':')[0]}"] += 1
        log.warning("agent rollout %s aborted (%s): %s", session_id, reason, why)
        return placeholder_sample(
            sample, replay=self.adapter.replay, metadata={"abort_reason": reason, "session_id": session_id}
        )

    async def _cleanup(self, session_id: str | None, space: Workspace | None) -> None:
        """Drop the session (idempotent: finish_session deleted it already) and the workspace, whatever happened."""
        try:
            if session_id is not None:
                await self.adapter.drop_session(session_id, wait_timeout=self.settings.wait_timeout_s)
        except Exception as exc:  # the gateway is down: its idle expiry deletes the session
            self.counters["drop_failed"] += 1
            log.warning("agent rollout %s: could not drop its session: %s", session_id, exc)
        if space is not None and not self.settings.keep_workspaces:
            await space.remove()


def make_agent(settings: AgentSettings) -> Agent:
    """The configured agent: a CLI harness by name, else a Python ``module:function``."""
    harness = HARNESSES.get(settings.agent)
    if harness is None:
        return PythonAgent(load_callable(settings.agent), settings.agent)
    configured = settings.claude if settings.agent == "claude_code" else settings.codex
    extra_args = settings.claude_args if settings.agent == "claude_code" else settings.codex_args
    executable = find_cli("claude" if settings.agent == "claude_code" else "codex", configured, harness.setting)
    return harness(
        executable,
        sandbox=sandbox_from_spec(settings.sandbox),
        extra_args=extra_args,
        extra_env=dict(settings.cli_env),
    )


def missing_harness(error: HarnessNotFound) -> Agent:
    async def agent(run: AgentRun) -> AgentOutcome:
        raise error

    return agent


def empty_reason(outcome: AgentOutcome) -> str:
    """Why a session held nothing to train on, as the placeholder's ``abort_reason`` says it."""
    if outcome.timed_out:
        return "agent_timed_out"
    if outcome.exit_code not in (None, 0):
        return f"agent_failed:exit {outcome.exit_code}"
    return "session_empty"


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, GatewayConnectionError | GatewayTimeoutError):
        return "gateway_unavailable"
    if isinstance(exc, GatewayStatusError):
        return f"gateway_error:{exc.error_type or exc.status}"
    if isinstance(exc, HarnessNotFound):
        return "harness_not_found"
    if isinstance(exc, TaskNotFound):
        return "task_not_found"
    return f"exception:{type(exc).__name__}"
