"""Each rollout's own folders: a workspace (a copy of the task folder the sample's metadata names, or an empty folder),
a HOME, and a log file that outlives them.

    WORKDIR/runs/SESSION_ID/work    the agent's working folder (deleted after the rollout unless kept)
    WORKDIR/runs/SESSION_ID/home    its HOME (a harness's configuration)
    WORKDIR/logs/SESSION_ID.log     the CLI's output (kept: the path is in the samples' metadata)
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TaskNotFound(FileNotFoundError):
    """The sample's metadata names a task folder that is not there."""


@dataclass(frozen=True)
class Workspace:
    root: Path  # WORKDIR/runs/SESSION_ID
    work: Path
    home: Path
    log: Path

    async def remove(self) -> None:
        await asyncio.to_thread(shutil.rmtree, self.root, True)


async def prepare_workspace(workdir: Path, session_id: str, metadata: Mapping[str, Any], task_key: str) -> Workspace:
    """The rollout's folders, its workspace a copy of ``metadata[task_key]`` (a folder: a git repository keeps its
    history) when the sample names one. Copied off the event loop."""
    root = workdir / "runs" / session_id
    space = Workspace(root, root / "work", root / "home", workdir / "logs" / f"{session_id}.log")
    task = metadata.get(task_key) if isinstance(metadata, Mapping) else None

    def build() -> None:
        shutil.rmtree(root, ignore_errors=True)  # an earlier run's leftovers under the same id
        space.home.mkdir(parents=True)
        space.log.parent.mkdir(parents=True, exist_ok=True)
        if task is None:
            space.work.mkdir()
            return
        source = Path(str(task)).expanduser()
        if not source.is_dir():
            raise TaskNotFound(f"the sample's metadata[{task_key!r}] = {str(task)!r} is not a folder")
        if space.work.resolve().is_relative_to(source.resolve()):
            raise TaskNotFound(f"the task folder {str(source)!r} holds the workspaces ({workdir}): it cannot be copied")
        shutil.copytree(source, space.work, symlinks=True)

    await asyncio.to_thread(build)
    return space
