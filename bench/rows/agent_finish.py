"""Row 19: what an agent rollout costs the trainer: ``finish_session``, and a whole rollout per model turn.

A Claude-Code-shaped session on the agent gateway (Anthropic Messages, a big system prompt and tool schemas, each
answer a tool call, each tool result ``tool_result_bytes`` of text, the whole history sent every turn): ``main_turns``
turns of the main conversation and ``sub_turns`` of a subagent's (a second root branch), the MoE shape's routing
replay and top-p replay, about 100k tokens over the two branches. Then, in this process (the trainer's):

- ``GatewayAdapter.finish_session`` (close and drain, fetch both branches in one round trip, two slime samples with
  their metadata, delete) against fetching the same branches raw (``GatewayClient.fetch_samples``: the tensors):
  trainer CPU (``time.process_time``), goal <= 1.3x. Also reported: the branch -> Sample conversion alone.
- a whole agent rollout through ``slime_client.agent.generate`` with an agent that runs in a process of its own, as a
  CLI harness does (open, the agent's ``rollout_turns`` turns, finish, drop): this process's CPU per model turn,
  reported (the chat work runs in the gateway, not in the trainer).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import orjson
import torch
import uvloop

from bench.core import Check, Context, RowResult, log, ratio
from bench.reference import Sample
from bench.services import REPO_ROOT, child_env, read_body
from slime_client import GatewayClient
from slime_client.agent import GatewayAdapter, branches_to_samples, close_runtimes, generate
from slime_wire.http1 import ConnectionPool

NAME = "agent finish"
GOAL = 1.3
TOOLS = [
    {
        "name": name,
        "description": f"{name}: " + "a tool of the coding agent, described as Claude Code describes its own. " * 12,
        "input_schema": {
            "type": "object",
            "properties": {key: {"type": "string", "description": f"the {key}"} for key in keys},
            "required": list(keys),
        },
    }
    for name, keys in (
        ("Bash", ("command", "description")),
        ("Read", ("file_path",)),
        ("Edit", ("file_path", "old_string", "new_string")),
        ("Grep", ("pattern", "path")),
        ("Agent", ("description", "prompt", "subagent_type")),
    )
]
_CODE = "def add(a, b):\n    return a + b  # the sum of two numbers, as the tests of module {n} expect\n"


def call_text(turn: int) -> str:
    """The model's answer: a tool call, as the tiny template renders one (Hermes)."""
    call = json.dumps({"name": "Read", "arguments": {"file_path": f"src/module_{turn}.py"}})
    return f"I will read the next module.\n<tool_call>\n{call}\n</tool_call>"


def tool_result(turn: int, size: int) -> str:
    text = "".join(_CODE.format(n=turn) for _ in range(size // len(_CODE) + 1))
    return text[:size]


async def conversation(
    pool: ConnectionPool, path: str, system: str, messages: list[dict[str, Any]], turns: int, result_bytes: int
) -> list[dict[str, Any]]:
    """``turns`` more Messages requests of a tool loop after ``messages``, each with the whole history (the API is
    stateless); the history."""
    messages = list(messages)
    first_turn = len(messages) // 2
    for turn in range(first_turn, first_turn + turns):
        body = {"model": "tiny", "max_tokens": 256, "system": system, "tools": TOOLS, "messages": messages}
        answer = orjson.loads(await read_body(pool, "POST", path, body))
        uses = [block for block in answer["content"] if block["type"] == "tool_use"]
        if not uses:
            raise RuntimeError(f"turn {turn}: the model's answer held no tool call: {answer['content']!r:.300}")
        messages.append({"role": "assistant", "content": answer["content"]})
        results = [
            {"type": "tool_result", "tool_use_id": use["id"], "content": tool_result(turn, result_bytes)}
            for use in uses
        ]
        messages.append({"role": "user", "content": results})
    return messages


def system_prompt(size: int, who: str) -> str:
    line = f"You are {who}. Use the tools to read, edit and test the repository; answer concisely. "
    return (line * (size // len(line) + 1))[:size]


async def script(ctx: Context, sid: str, turns: int) -> None:
    sim = ConnectionPool(ctx.services.chat_simulator.url, max_connections=1, connect_timeout_s=5, pool_timeout_s=5)
    try:
        answers = [{"text": call_text(turn)} for turn in range(turns)]
        await read_body(sim, "POST", "/sim/script", {"rid_prefix": f"{sid}-", "answers": answers})
    finally:
        await sim.aclose()


async def build_session(ctx: Context, adapter: GatewayAdapter, sid: str) -> int:
    """The Claude-Code-shaped session: half the main conversation, the subagent's, the rest of the main one."""
    shape = ctx.suite.agent_finish
    await adapter.open_session(sid, sampling_defaults={"temperature": 1.0, "max_new_tokens": 256})
    await script(ctx, sid, shape.main_turns + shape.sub_turns)
    pool = ConnectionPool(adapter.gateway_url, max_connections=2, connect_timeout_s=5, pool_timeout_s=60)
    path = f"/v1/sessions/{sid}/v1/messages"
    main = system_prompt(shape.system_bytes, "a coding agent")
    sub = system_prompt(shape.system_bytes // 4, "a read-only explore subagent")
    size = shape.tool_result_bytes
    try:
        half = shape.main_turns // 2
        history = await conversation(pool, path, main, [{"role": "user", "content": "Fix the tests."}], half, size)
        task = [{"role": "user", "content": "Find where add is defined."}]
        await conversation(pool, path, sub, task, shape.sub_turns, size)
        await conversation(pool, path, main, history, shape.main_turns - half, size)  # the main one goes on
        view = orjson.loads(await read_body(pool, "GET", f"/v1/sessions/{sid}"))
    finally:
        await pool.aclose()
    branches = [(b["cause"], b["total_tokens"]) for b in view["branches"]]
    if [cause for cause, _ in branches] != [None, "new_root"]:
        raise RuntimeError(f"expected the main conversation and a subagent's branch, got {branches}")
    return sum(tokens for _, tokens in branches)


async def measure_finish(ctx: Context) -> dict[str, Any]:
    shape, moe = ctx.suite.agent_finish, ctx.suite.moe
    gateway = ctx.services.agent_gateway
    async with GatewayClient(gateway.url) as client:
        adapter = GatewayAdapter(
            gateway.url, num_layers=moe.layers, moe_router_topk=moe.topk, top_p_replay=True, client=client
        )
        raw, tensors, finish, convert, tokens, counts = [], [], [], [], [], []
        for i in range(shape.sessions):
            sid = f"agent-finish-{os.getpid()}-{i}"
            tokens.append(await build_session(ctx, adapter, sid))
            await client.fetch_samples([sid])  # connections warm, the session's arrays in the gateway's cache
            # once per session, as finish: the best of as many of each (a best of more would be lower by chance)
            started = time.process_time()
            branches = await client.fetch_samples([sid])
            fetched = time.process_time()
            written = [branch.to_slime(Sample(index=i), narrow_routing=True) for branch in branches]
            raw.append(time.process_time() - started)
            tensors.append(fetched - started)
            del written
            started = time.process_time()
            for _ in range(shape.raw_repeat):
                samples = branches_to_samples(branches, Sample(index=i), reward=1.0)
            convert.append((time.process_time() - started) / shape.raw_repeat)
            del samples, branches
            started = time.process_time()
            samples = await adapter.finish_session(sid, base_sample=Sample(index=i), reward=1.0)
            finish.append(time.process_time() - started)
            counts.append(len(samples))
            log(f"row 19: session {i + 1}/{shape.sessions}: {tokens[-1]} tokens, {len(samples)} samples")
            del samples
    return {
        "raw": min(raw),
        "tensors": min(tensors),
        "finish": min(finish),
        "convert": min(convert),
        "tokens": tokens,
        "samples": counts,
    }


# ---- a whole rollout, the agent in a process of its own ---------------------------------------------------------
async def process_agent(run: Any) -> float:
    """``SLIME_AGENT`` for the rollout measurement: the agent loop in a child process (as a CLI harness runs)."""
    turns, size = run.metadata["turns"], run.metadata["tool_result_bytes"]
    command = [sys.executable, "-m", "bench.rows.agent_finish", run.base_url, str(turns), str(size)]
    child = await asyncio.create_subprocess_exec(*command, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.DEVNULL)
    if await child.wait() != 0:
        raise RuntimeError(f"the agent process exited with {child.returncode}")
    return 1.0


@contextmanager
def environment(values: dict[str, str]) -> Any:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def measure_rollout(ctx: Context) -> dict[str, Any]:
    shape, moe = ctx.suite.agent_finish, ctx.suite.moe
    gateway = ctx.services.agent_gateway
    args = SimpleNamespace(
        gateway_url=gateway.url,
        use_rollout_routing_replay=True,
        num_layers=moe.layers,
        moe_router_topk=moe.topk,
        rollout_top_p=0.9,
        rollout_max_response_len=256,
    )
    workdir = tempfile.mkdtemp(prefix="bench-agent-")
    settings = {"SLIME_AGENT": "bench.rows.agent_finish:process_agent", "SLIME_AGENT_WORKDIR": workdir}
    cpu, samples = [], 0
    with environment(settings):
        for i in range(shape.rollouts):
            sid = f"agent-rollout-{os.getpid()}-{i}"
            await script(ctx, sid, shape.rollout_turns)
            metadata = {"turns": shape.rollout_turns, "tool_result_bytes": shape.tool_result_bytes}
            sample = Sample(index=i, session_id=sid, metadata=metadata)
            started = time.process_time()
            result = await generate(args, sample, {"temperature": 1.0, "top_p": 0.9})
            cpu.append(time.process_time() - started)
            if result[0].remove_sample:
                raise RuntimeError(f"the rollout failed: {result[0].metadata}")
            samples += len(result)
        await close_runtimes()
    return {"per_turn": min(cpu) / shape.rollout_turns, "rollout": min(cpu), "samples": samples}


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.agent_finish
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as rows 11 and 12: no intra-op threads spinning
    try:
        got = uvloop.run(measure_finish(ctx))
        rollout = uvloop.run(measure_rollout(ctx))
    finally:
        torch.set_num_threads(threads)
    tokens = max(got["tokens"])
    return RowResult(
        number=19,
        name=NAME,
        measured=(
            f"finish_session of a {shape.main_turns + shape.sub_turns}-turn two-branch session ({tokens} tokens): "
            f"{got['finish'] * 1e3:.1f} ms of trainer CPU vs {got['raw'] * 1e3:.1f} ms to fetch its branches raw "
            f"and write them onto slime samples ({ratio(got['finish'], got['raw']):.2f}x; the fetch alone, as tensors: "
            f"{got['tensors'] * 1e3:.1f} ms; the conversion to samples alone, timed apart: {got['convert'] * 1e3:.1f} "
            f"ms); a whole rollout of {shape.rollout_turns} model turns (the agent in a process of its own): "
            f"{rollout['per_turn'] * 1e3:.2f} ms of trainer CPU per model turn"
        ),
        checks=[
            Check("finish / raw fetch", ratio(got["finish"], got["raw"]), GOAL, higher_is_better=False),
            Check("finish / tensors only", ratio(got["finish"], got["tensors"]), None, higher_is_better=False),
            Check("trainer CPU per model turn", rollout["per_turn"] * 1e3, None, higher_is_better=False, unit="ms"),
        ],
        notes=[
            f"the session: {shape.main_turns} turns of a main conversation and {shape.sub_turns} of a subagent's "
            f"(Anthropic Messages, a {shape.system_bytes}-byte system prompt and {len(TOOLS)} tool schemas, each "
            f"answer a tool call, each result {shape.tool_result_bytes} bytes), {ctx.suite.moe.describe()}, "
            f"routing + top-p replay, on the tiny chat tokenizer; {got['samples'][0]} samples per finish",
            "finish: time.process_time of GatewayAdapter.finish_session (POST close, POST /v1/samples, the branches as "
            "slime samples: token lists, uint8 routing copied out of the received body, metadata; DELETE), best of "
            f"{shape.sessions} sessions; raw: GatewayClient.fetch_samples of the same session just before its "
            "finish, then RolloutSample.to_slime of each branch onto a Sample (the same lists and uint8 routing "
            f"copy), best of {shape.sessions}; tensors only: fetch_samples alone (what slime's Sample needs beyond "
            "it: token, mask and log-prob lists, ~2-4 ms per 100k tokens each, and the routing copied out of the "
            "received body, which the samples would otherwise all pin when pickled); torch on one thread",
            "rollout: time.process_time of slime_client.agent.generate (a Python agent that runs the "
            f"{shape.rollout_turns}-turn loop in a child process: its CPU is not this process's), best of "
            f"{shape.rollouts}, divided by the model turns",
        ],
    )


async def _agent_process(base_url: str, turns: int, result_bytes: int) -> None:
    """The child process's agent loop (``process_agent``)."""
    pool = ConnectionPool(base_url.split("/v1/sessions/")[0], max_connections=1, connect_timeout_s=5, pool_timeout_s=60)
    path = base_url[len(base_url.split("/v1/sessions/")[0]) :] + "/v1/messages"
    task = [{"role": "user", "content": "Fix the tests."}]
    try:
        await conversation(pool, path, system_prompt(8_000, "a coding agent"), task, turns, result_bytes)
    finally:
        await pool.aclose()


if __name__ == "__main__":
    uvloop.run(_agent_process(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
