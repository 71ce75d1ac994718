"""What the CLI harnesses share: find the CLI, give the rollout a HOME with the CLI's configuration, an environment
pointed at the session, and run the command in the sandbox to its end or the time budget.

A harness is an agent (``slime_client.agent.contract``): ``await harness(run) -> AgentOutcome``. Each CLI's module
says only what is its own: its configuration files (``write_config``), its environment (``environment``) and its
command line (``command``).
"""

from __future__ import annotations

import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from slime_client.agent.contract import AgentOutcome, AgentRun
from slime_client.agent.sandbox import Sandbox

# What a CLI gets of this process's environment: the basics and the proxy / certificate settings, nothing else (no
# stray API keys or endpoints of the trainer's).
PASSED_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TZ",
    "TMPDIR",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "NODE_EXTRA_CA_CERTS",
)


class HarnessNotFound(FileNotFoundError):
    """The CLI is neither where its setting says nor on PATH."""


def find_cli(name: str, configured: str | None, setting: str) -> Path:
    """The CLI's executable: ``configured`` (its ``SLIME_AGENT_*`` setting), else ``name`` on PATH."""
    found = configured or shutil.which(name)
    if not found or not os.access(found, os.X_OK):
        where = f"{setting}={configured!r} is not an executable" if configured else f"no {name!r} on PATH"
        raise HarnessNotFound(f"{where}: install the CLI, or set {setting} to its path")
    return Path(os.path.abspath(found))  # the CLI runs in the rollout's workspace: a relative path would not hold


def install_root(executable: Path) -> Path:
    """The folder a sandbox must see for the CLI to run: its ``node_modules`` (npm installs the CLI's native binary
    or launcher there, with what they load), else the executable's folder."""
    real = Path(os.path.realpath(executable))
    for parent in real.parents:
        if parent.name == "node_modules":
            return parent
    return real.parent


class CliHarness(ABC):
    """A coding-agent CLI run once per rollout (see the module docstring)."""

    name: ClassVar[str]

    def __init__(
        self,
        executable: Path,
        *,
        sandbox: Sandbox,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        # Its real path: what a sandbox mounts (``install_root``) must hold the very file the command names.
        self.executable = Path(os.path.realpath(executable))
        self.sandbox = sandbox
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})

    @abstractmethod
    def write_config(self, run: AgentRun) -> None:
        """The CLI's configuration files, in ``run.home``."""

    @abstractmethod
    def environment(self, run: AgentRun) -> dict[str, str]:
        """The CLI's own environment variables (pointed at the session)."""

    @abstractmethod
    def command(self, run: AgentRun) -> list[str]:
        """The command line, the executable first."""

    def base_environment(self, run: AgentRun) -> dict[str, str]:
        env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
        env.setdefault("LANG", "C.UTF-8")
        return env | {"HOME": str(run.home), "TERM": "dumb"}

    async def __call__(self, run: AgentRun) -> AgentOutcome:
        run.home.mkdir(parents=True, exist_ok=True)
        self.write_config(run)
        env = self.base_environment(run) | self.environment(run) | self.extra_env
        started = time.monotonic()
        result = await self.sandbox.run(
            self.command(run),
            cwd=run.workspace,
            env=env,
            log_path=run.log_path,
            timeout_s=run.time_left_s,
            mounts=[install_root(self.executable)],
        )
        return AgentOutcome(
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            log_path=run.log_path,
            seconds=time.monotonic() - started,
        )
