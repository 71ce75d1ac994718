"""The agent contract: what a rollout hands an agent (``AgentRun``), and what an agent hands back.

An agent is an async callable ``agent(run) -> reward | None``: it talks to the model through ``run.base_url`` (the
session's: OpenAI and Anthropic clients and agent harnesses take it as their base URL) with ``run.api_key``, works in
``run.workspace``, and ends by ``run.deadline``. It returns the reward, or None to leave it to the reward function
(``SLIME_AGENT_REWARD``) or to slime's ``--custom-rm-path`` (slime scores every sample whose reward is None). Every
model turn it makes is captured by the gateway; nothing here sees them.

The harnesses (Claude Code, Codex: ``slime_client.agent.harness``) are agents too: they run a CLI and report how it
ended (``AgentOutcome``); a Python agent's outcome is its reward.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Reward = float | dict[str, Any]


@dataclass(frozen=True)
class AgentRun:
    """One rollout, as the agent sees it."""

    session_id: str
    base_url: str  # the session's base URL on the gateway
    api_key: str  # the gateway's API key ("" when it has none): clients send it as their API key
    model: str  # the model name the agent advertises (the gateway serves whatever SGLang has loaded)
    prompt: str  # the task, as text (``prompt_text`` of the sample's prompt)
    workspace: Path  # the rollout's own folder: a copy of the task folder, or empty
    home: Path  # the rollout's own HOME (a harness's configuration lives there)
    log_path: Path  # where a harness's output goes (kept after the rollout)
    deadline: float  # ``time.monotonic()`` by which the agent must be done (then it is stopped)
    time_budget_s: float
    sample_prompt: Any = None  # the sample's prompt as slime holds it (a string, or a list of chat messages)
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    sampling_params: Mapping[str, Any] = field(default_factory=dict)  # slime's, for the agent's own use
    index: int | None = None
    group_index: int | None = None
    evaluation: bool = False

    @property
    def time_left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@dataclass
class AgentOutcome:
    """How an agent ended: its reward (a Python agent's return value), or a harness's exit code and log."""

    reward: Reward | None = None
    exit_code: int | None = None  # a harness's (None: a Python agent, or a CLI stopped at the time budget)
    timed_out: bool = False
    log_path: Path | None = None
    seconds: float = 0.0

    def metadata(self) -> dict[str, Any]:
        """What the samples' metadata says of it."""
        out: dict[str, Any] = {"agent_timed_out": self.timed_out, "agent_seconds": round(self.seconds, 3)}
        if self.exit_code is not None or self.log_path is not None:
            out["agent_exit_code"] = -1 if self.timed_out else self.exit_code  # slime's: -1 past the time budget
        if self.log_path is not None:
            out["agent_log"] = str(self.log_path)
        return out


Agent = Callable[[AgentRun], Awaitable[AgentOutcome]]
AgentFunction = Callable[[AgentRun], Awaitable[Reward | None]]
RewardFunction = Callable[[AgentRun, AgentOutcome], Awaitable[Reward | None] | Reward | None]


def load_callable(spec: str) -> Callable[..., Any]:
    """``module:function`` (or ``module.function``, as slime's ``--custom-*-path`` flags name them)."""
    module_name, sep, name = spec.partition(":")
    if not sep:
        module_name, _, name = spec.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{spec!r} is not module:function")
    function = getattr(importlib.import_module(module_name), name, None)
    if not callable(function):
        raise ValueError(f"{spec!r}: {module_name} has no callable {name!r}")
    return function


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def prompt_text(prompt: Any) -> str:
    """The task as text from a sample's prompt: a string as it is; a list of chat messages as its last user
    message's text (else every message's, joined)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        texts = [_content_text(m.get("content")) for m in prompt if isinstance(m, Mapping)]
        users = [_content_text(m.get("content")) for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        return users[-1] if users else "\n\n".join(t for t in texts if t)
    return "" if prompt is None else str(prompt)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


class PythonAgent:
    """An ``async def agent(run) -> reward | None`` (``SLIME_AGENT=module:function``), stopped at the time budget (its
    reward then None: left to the reward function)."""

    def __init__(self, function: AgentFunction, name: str) -> None:
        self.function = function
        self.name = name

    async def __call__(self, run: AgentRun) -> AgentOutcome:
        started = time.monotonic()
        budget = timeout_at_monotonic(run.deadline)
        try:
            async with budget:
                reward = await maybe_await(self.function(run))
        except TimeoutError:
            if not budget.expired():
                raise  # the agent's own timeout, not the budget's
            return AgentOutcome(timed_out=True, seconds=time.monotonic() - started)
        return AgentOutcome(reward=reward, seconds=time.monotonic() - started)


def timeout_at_monotonic(deadline: float) -> asyncio.Timeout:
    """``asyncio.timeout_at`` for a ``time.monotonic()`` deadline (the loop's clock may be another one)."""
    return asyncio.timeout_at(asyncio.get_running_loop().time() + (deadline - time.monotonic()))
