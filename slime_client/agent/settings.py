"""The settings of ``slime_client.agent.generate``: slime's arguments where it has one, ``SLIME_AGENT_*`` environment
variables for the rest (slime launches rollouts with its own command line; the environment is how a custom generate
function is configured there, as slime's own agent examples do).

| Variable | Default | Meaning |
| --- | --- | --- |
| ``SLIME_AGENT`` (or ``args.agent``) | ``claude_code`` | ``claude_code``, ``codex``, or ``module:function`` |
| ``SLIME_AGENT_REWARD`` | none | ``module:function`` called with ``(run, outcome)`` after the agent: the reward |
| ``SLIME_AGENT_TIME_BUDGET_S`` | 1800 | the agent's time; then the CLI's whole process group is ended |
| ``SLIME_AGENT_REWARD_TIMEOUT_S`` | 600 | the reward function's time |
| ``SLIME_AGENT_GUARD_S`` | budget + reward + 180 | the whole rollout's wall clock; past it, a placeholder |
| ``SLIME_AGENT_CLAUDE`` / ``SLIME_AGENT_CODEX`` | on PATH | the CLI's executable |
| ``SLIME_AGENT_CLAUDE_ARGS`` / ``SLIME_AGENT_CODEX_ARGS`` | none | more CLI arguments (shell words) |
| ``SLIME_AGENT_ENV`` | none | more environment for the CLI (a JSON object) |
| ``SLIME_AGENT_MODEL`` | the checkpoint's folder name | the model name the agent advertises |
| ``SLIME_AGENT_SANDBOX`` | ``local`` | ``local`` (a process group) or ``docker:IMAGE`` |
| ``SLIME_AGENT_CONCURRENCY`` | 16 | rollouts at once in this process (the rest wait, no session open) |
| ``SLIME_AGENT_WORKDIR`` | ``$TMPDIR/slime-agent`` | rollouts' workspaces and HOMEs (deleted after), logs (kept) |
| ``SLIME_AGENT_KEEP_WORKSPACES`` | off | keep each rollout's workspace and HOME |
| ``SLIME_AGENT_TASK_KEY`` | ``task_dir`` | the sample metadata key naming the task folder copied into the workspace |
| ``SLIME_AGENT_MAX_TURNS`` (or ``args.max_turns_per_sid``) | none | model turns per session; past it a 429 |
| ``SLIME_AGENT_SPLIT_REWARD`` | off | divide the reward evenly over a rollout's samples (slime gives each all of it) |
| ``SLIME_AGENT_WAIT_TIMEOUT_S`` | 5 | at the end, how long running turns may take before they are aborted |
| ``SLIME_AGENT_MAX_STALENESS`` | none | weight versions a trained token may be behind the newest the sample met |
| ``SLIME_AGENT_STALENESS_POLICY`` | ``drop`` | past that bound: ``drop`` the branch, or ``mask`` its too-stale tokens |
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from slime_client.slime import gateway_api_key, gateway_url
from slime_client.staleness import POLICIES, StalenessBound, StalePolicy

DEFAULT_AGENT = "claude_code"
DEFAULT_TIME_BUDGET_S = 1800.0
DEFAULT_REWARD_TIMEOUT_S = 600.0
GUARD_MARGIN_S = 180.0  # slime's coding agent: budget + eval timeout + 180
DEFAULT_CONCURRENCY = 16
DEFAULT_MODEL = "slime-actor"


def _env(name: str, default: str = "") -> str:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else default


def _flag(name: str) -> bool:
    return _env(name).lower() in ("1", "true", "yes", "on")


def _positive(name: str, default: float) -> float:
    raw = _env(name)
    if not raw:
        return default
    value = float(raw)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {raw!r}")
    return value


@dataclass(frozen=True)
class AgentSettings:
    """Everything ``generate`` reads from slime's arguments and the environment, read once per process and loop."""

    gateway_url: str
    api_key: str
    agent: str
    reward: str | None
    time_budget_s: float
    reward_timeout_s: float
    guard_s: float
    claude: str | None
    codex: str | None
    claude_args: tuple[str, ...]
    codex_args: tuple[str, ...]
    cli_env: tuple[tuple[str, str], ...]
    model: str
    sandbox: str
    concurrency: int
    workdir: Path
    keep_workspaces: bool
    task_key: str
    max_turns: int | None
    split_reward: bool
    wait_timeout_s: float
    staleness: StalenessBound | None = None

    @classmethod
    def from_args(cls, args: Any) -> AgentSettings:
        budget = _positive("SLIME_AGENT_TIME_BUDGET_S", DEFAULT_TIME_BUDGET_S)
        reward_timeout = _positive("SLIME_AGENT_REWARD_TIMEOUT_S", DEFAULT_REWARD_TIMEOUT_S)
        max_turns = getattr(args, "max_turns_per_sid", None) or _env("SLIME_AGENT_MAX_TURNS") or None
        cli_env = json.loads(_env("SLIME_AGENT_ENV", "{}"))
        if not isinstance(cli_env, dict) or not all(isinstance(v, str) for v in cli_env.values()):
            raise ValueError("SLIME_AGENT_ENV must be a JSON object of strings")
        return cls(
            gateway_url=gateway_url(args),
            api_key=gateway_api_key(args),
            agent=getattr(args, "agent", None) or _env("SLIME_AGENT", DEFAULT_AGENT),
            reward=_env("SLIME_AGENT_REWARD") or None,
            time_budget_s=budget,
            reward_timeout_s=reward_timeout,
            guard_s=_positive("SLIME_AGENT_GUARD_S", budget + reward_timeout + GUARD_MARGIN_S),
            claude=_env("SLIME_AGENT_CLAUDE") or None,
            codex=_env("SLIME_AGENT_CODEX") or None,
            claude_args=tuple(shlex.split(_env("SLIME_AGENT_CLAUDE_ARGS"))),
            codex_args=tuple(shlex.split(_env("SLIME_AGENT_CODEX_ARGS"))),
            cli_env=tuple(sorted(cli_env.items())),
            model=_env("SLIME_AGENT_MODEL") or _checkpoint_name(args),
            sandbox=_env("SLIME_AGENT_SANDBOX", "local"),
            concurrency=int(_positive("SLIME_AGENT_CONCURRENCY", DEFAULT_CONCURRENCY)),
            workdir=Path(_env("SLIME_AGENT_WORKDIR") or Path(tempfile.gettempdir()) / "slime-agent"),
            keep_workspaces=_flag("SLIME_AGENT_KEEP_WORKSPACES"),
            task_key=_env("SLIME_AGENT_TASK_KEY", "task_dir"),
            max_turns=None if max_turns is None else int(max_turns),
            split_reward=_flag("SLIME_AGENT_SPLIT_REWARD"),
            wait_timeout_s=_positive("SLIME_AGENT_WAIT_TIMEOUT_S", 5.0),
            staleness=_staleness(),
        )


def _staleness() -> StalenessBound | None:
    """``SLIME_AGENT_MAX_STALENESS`` (an int >= 0) with ``SLIME_AGENT_STALENESS_POLICY``; none set: no bound."""
    raw, policy = _env("SLIME_AGENT_MAX_STALENESS"), _env("SLIME_AGENT_STALENESS_POLICY", "drop")
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"SLIME_AGENT_MAX_STALENESS must be a whole number of weight versions >= 0, not {raw!r}")
    if policy not in POLICIES:
        raise ValueError(f"SLIME_AGENT_STALENESS_POLICY must be one of {', '.join(POLICIES)}, not {policy!r}")
    return StalenessBound(int(raw), cast(StalePolicy, policy))


def _checkpoint_name(args: Any) -> str:
    checkpoint = getattr(args, "hf_checkpoint", None)
    return Path(str(checkpoint)).name if checkpoint else DEFAULT_MODEL
