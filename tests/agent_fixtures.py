"""Agents, reward functions and a task for the agent rollout tests (``SLIME_AGENT=agent_fixtures:NAME``).

The agents are what users write: async functions that get an ``AgentRun`` and talk to the model through its base
URL with the real client libraries (openai, the OpenAI Agents SDK). ``snapshot_and_grade`` is a reward function that
grades the task and, for the tests, keeps what the session held just before ``finish_session`` took it (each
branch's full view and sample), so that the returned samples can be checked against the session token by token.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import load

from slime_client.agent import AgentOutcome, AgentRun

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# What a test keeps per session id: every branch's full view and sample as the session held them before the finish.
SNAPSHOTS: dict[str, list[dict[str, Any]]] = {}


def _client(run: AgentRun) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=run.base_url, api_key=run.api_key or "unused", max_retries=0)


async def weather_agent(run: AgentRun) -> float | None:
    """A two-turn tool loop with the OpenAI client: the model calls get_weather, gets its result, answers. Returns
    ``metadata["reward"]`` when the sample says one (else None: left to the reward function)."""
    client = _client(run)
    messages: list[dict[str, Any]] = [{"role": "user", "content": run.prompt}]
    for _ in range(4):
        completion = await client.chat.completions.create(
            model=run.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=64
        )
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            city = json.loads(call.function.arguments).get("city", "?")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"})
    await client.close()
    reward = run.metadata.get("reward")
    return None if reward is None else float(reward)


async def agents_sdk_agent(run: AgentRun) -> float:
    """The OpenAI Agents SDK's own loop (its Responses model), a function tool."""
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny-in-{city}"

    client = _client(run)
    agent = Agent(name="weather", instructions="You answer weather questions.", model=run.model, tools=[get_weather])
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True), tracing_disabled=True)
    result = await Runner.run(agent, run.prompt, run_config=config)
    await client.close()
    return 1.0 if "sunny" in str(result.final_output) else 0.0


async def one_turn(run: AgentRun) -> None:
    client = _client(run)
    await client.chat.completions.create(
        model=run.model, messages=[{"role": "user", "content": run.prompt}], max_tokens=16
    )
    await client.close()


async def mixed_agent(run: AgentRun) -> float | None:
    """What ``metadata["behaviour"]`` says: ``ok`` (a tool loop), ``crash`` (one turn, then an exception), ``idle``
    (a reward without calling the model), ``slow`` (one turn, then past the time budget), ``cancel`` (one turn, then
    the agent is cancelled from inside), ``restart`` (one turn, then ``metadata["between_turns"]`` runs: a gateway
    restart, then another turn that fails)."""
    behaviour = run.metadata.get("behaviour", "ok")
    if behaviour == "ok":
        return await weather_agent(run)
    if behaviour == "idle":
        return 1.0
    await one_turn(run)
    if behaviour == "crash":
        raise RuntimeError("the agent crashed")
    if behaviour == "slow":
        await asyncio.sleep(3600)
    if behaviour == "cancel":
        raise asyncio.CancelledError
    if behaviour == "restart":
        await asyncio.to_thread(run.metadata["between_turns"])
        try:
            await one_turn(run)
        except Exception:
            return 1.0
    return 1.0


def _snapshot(run: AgentRun) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {run.api_key}"} if run.api_key else {}
    view = httpx.get(run.base_url, params={"full": "true"}, headers=headers, timeout=30).json()
    branches = []
    for index in range(len(view["branches"])):
        full = httpx.get(run.base_url, params={"full": "true", "branch": index}, headers=headers, timeout=30).json()
        raw = httpx.get(f"{run.base_url}/sample", params={"branch": index}, headers=headers, timeout=30).content
        branches.append({"view": full, "sample": load(raw)})
    return branches


def run_task_test(workspace: Path) -> bool:
    """The task's own test (``test_calc.py`` of ``make_task``): whether it passes in ``workspace``."""
    done = subprocess.run(
        [sys.executable, "test_calc.py"], cwd=workspace, capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode == 0


async def snapshot_reward(run: AgentRun, outcome: AgentOutcome) -> float | None:
    """Keeps the session's snapshot (``SNAPSHOTS``); the reward is ``metadata["grade"]`` (None: slime's RM)."""
    SNAPSHOTS[run.session_id] = await asyncio.to_thread(_snapshot, run)
    reward = run.metadata.get("grade")
    return None if reward is None else float(reward)


async def snapshot_and_grade(run: AgentRun, outcome: AgentOutcome) -> float:
    """The reward: 1.0 when the task's test passes in the workspace. Keeps the session's snapshot (``SNAPSHOTS``)."""
    SNAPSHOTS[run.session_id] = await asyncio.to_thread(_snapshot, run)
    return 1.0 if await asyncio.to_thread(run_task_test, run.workspace) else 0.0


def make_task(folder: Path) -> Path:
    """A git repository with a failing test: ``calc.add`` subtracts; ``test_calc.py`` checks it adds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "test_calc.py").write_text(
        "from calc import add\n\nassert add(2, 3) == 5, f'add(2, 3) = {add(2, 3)}'\nprint('test_calc: ok')\n"
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "a failing test"]):
        subprocess.run([*git, *args], cwd=folder, check=True, capture_output=True)
    return folder


def sample_arrays(snapshot: dict[str, Any]) -> dict[str, np.ndarray]:
    return snapshot["sample"]
