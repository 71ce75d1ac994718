"""Where a harness's CLI runs: one small interface, two backends.

``Sandbox.run(command, cwd=..., env=..., log_path=..., timeout_s=...)`` runs a command to its end or to the time
budget, its output (stdout and stderr) into ``log_path``, and says how it ended (``ProcessResult``). Past the budget,
or when the rollout is cancelled, everything it started is ended.

- ``LocalSandbox``: a process group of its own on this machine (``start_new_session``); ended with SIGTERM to the
  whole group, then SIGKILL after a grace.
- ``DockerSandbox``: the same command in a fresh container of the user's image (``docker run --rm``), the workspace,
  the HOME and the CLI's install folder mounted at the paths they have here (so every path in the command and the
  environment holds inside), host networking (the gateway on 127.0.0.1 stays reachable); ended with ``docker kill``.

slime's own interface (``slime.agent.sandbox.Sandbox``: exec / read_file / write_file against a remote E2B sandbox)
is for a sandbox far away; here the workspace is a folder on this machine that the sandbox sees, so the harness
writes its files directly and the sandbox only runs the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("slime_client.agent")

KILL_GRACE_S = 5.0  # SIGTERM, then this long before SIGKILL


@dataclass(frozen=True, slots=True)
class ProcessResult:
    exit_code: int | None  # None: stopped at the time budget
    timed_out: bool
    seconds: float


class Sandbox(Protocol):
    """Runs one command for a rollout (see the module docstring)."""

    runs_as_root: bool  # whether the command runs as root there (Claude Code then needs IS_SANDBOX=1)

    async def run(
        self,
        command: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        log_path: Path,
        timeout_s: float,
        mounts: Sequence[Path] = (),
    ) -> ProcessResult: ...


class LocalSandbox:
    """A process group of its own on this machine."""

    def __init__(self) -> None:
        self.runs_as_root = os.geteuid() == 0

    async def run(
        self,
        command: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        log_path: Path,
        timeout_s: float,
        mounts: Sequence[Path] = (),
    ) -> ProcessResult:
        started = time.monotonic()
        # its own process group: the budget ends everything it started
        process = await _start(command, log_path, cwd=cwd, env=dict(env), start_new_session=True)
        try:
            return await _wait_or_end(process, timeout_s, lambda: _end_group(process), started)
        finally:
            _kill_group(process.pid, signal.SIGKILL)  # what the CLI left behind in its group (background jobs)


async def _start(args: Sequence[str], log_path: Path, **options: Any) -> asyncio.subprocess.Process:
    """``args`` started, no stdin, its stdout and stderr appended to ``log_path``."""
    with open(log_path, "ab") as out:
        return await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT, **options
        )


async def _wait_or_end(
    process: asyncio.subprocess.Process, timeout_s: float, end: Callable[[], Awaitable[None]], started: float
) -> ProcessResult:
    """The process's end, or ``timeout_s``: past it, or when the rollout is cancelled, ``end()`` ends everything it
    started."""
    try:
        async with asyncio.timeout(timeout_s):
            code = await process.wait()
    except TimeoutError:
        await end()
        return ProcessResult(None, True, time.monotonic() - started)
    except BaseException:  # cancelled: nothing may outlive the rollout
        await asyncio.shield(end())
        raise
    return ProcessResult(code, False, time.monotonic() - started)


async def _end_group(process: asyncio.subprocess.Process) -> None:
    _kill_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), KILL_GRACE_S)
    except TimeoutError:
        _kill_group(process.pid, signal.SIGKILL)
        await process.wait()


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class DockerSandbox:
    """The command in a fresh container of ``image`` (``docker run --rm``): the workspace, the HOME and ``mounts`` (a
    CLI's install folder) mounted at their own paths, ``--network host``, the environment passed by name (values stay
    out of the process list). ``node``: a Node.js binary to mount for CLIs that are Node scripts (Codex's launcher);
    found on PATH when not given. ``docker_args``: more ``docker run`` options (``--user``, ``--memory``, ...)."""

    runs_as_root = True  # the image's default user; ``docker_args`` may say otherwise

    NODE_DIR = "/opt/slime-agent/node"

    def __init__(
        self,
        image: str,
        *,
        docker: str = "docker",
        docker_args: Sequence[str] = (),
        node: str | None = None,
    ) -> None:
        self.image = image
        self.docker = docker
        self.docker_args = tuple(docker_args)
        self.node = node if node is not None else shutil.which("node")

    def docker_command(
        self,
        name: str,
        command: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        writable: Sequence[Path],
        readonly: Sequence[Path],
    ) -> list[str]:
        """``docker run`` for ``command``: ``writable`` and ``readonly`` folders mounted at their own paths, the
        environment's names (``docker run`` reads their values from its own environment)."""
        args = [self.docker, "run", "--rm", "--name", name, "--network", "host", "--workdir", str(cwd)]
        args += ["--label", "slime-agent.sandbox=1"]
        for path in dict.fromkeys(writable):
            args += ["--volume", f"{path}:{path}"]
        for path in dict.fromkeys(p for p in readonly if p not in writable):
            args += ["--volume", f"{path}:{path}:ro"]
        path_dirs = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        if self.node:
            args += ["--volume", f"{os.path.realpath(self.node)}:{self.NODE_DIR}/node:ro"]
            path_dirs.insert(0, self.NODE_DIR)
        for key in env:
            if key != "PATH":
                args += ["--env", key]
        args += ["--env", f"PATH={':'.join(path_dirs)}", *self.docker_args, self.image, *command]
        return args

    async def run(
        self,
        command: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        log_path: Path,
        timeout_s: float,
        mounts: Sequence[Path] = (),
    ) -> ProcessResult:
        started = time.monotonic()
        name = f"slime-agent-{uuid.uuid4().hex[:12]}"
        writable = [cwd, *([Path(env["HOME"])] if "HOME" in env else [])]
        args = self.docker_command(name, command, cwd=cwd, env=env, writable=writable, readonly=mounts)
        docker_env = {k: v for k, v in env.items() if k != "PATH"}
        for key in ("PATH", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT"):  # what the docker CLI itself needs
            if key in os.environ:
                docker_env[key] = os.environ[key]
        process = await _start(args, log_path, env=docker_env)
        return await _wait_or_end(process, timeout_s, lambda: self._kill(name, process), started)

    async def _kill(self, name: str, process: asyncio.subprocess.Process) -> None:
        killer = await asyncio.create_subprocess_exec(
            self.docker, "kill", name, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        await killer.wait()
        try:
            await asyncio.wait_for(process.wait(), KILL_GRACE_S * 4)
        except TimeoutError:
            process.kill()
            await process.wait()
            log.warning("container %s: docker run did not end after docker kill", name)


def sandbox_from_spec(spec: str) -> Sandbox:
    """``local`` (the default), or ``docker:IMAGE``."""
    spec = spec.strip()
    if spec in ("", "local"):
        return LocalSandbox()
    kind, _, image = spec.partition(":")
    if kind == "docker" and image:
        return DockerSandbox(image)
    raise ValueError(f"unknown sandbox {spec!r}: use 'local' or 'docker:IMAGE'")
