"""Row 18: a long agent episode's per-turn cost stays flat.

One chat session (OpenAI Chat Completions, the MoE shape, routing and top-p replay), driven as an agent harness
drives it: ``turns`` requests, each carrying the whole history (the API is stateless), each answered by a tool call
(scripted text on a simulator speaking the tiny chat tokenizer) whose ``tool_result_bytes`` result comes back in the
next request. The gateway's CPU per turn (all its threads, ``/proc``) at the last ``window`` turns against the first
ones (turn 1, which renders the whole prompt, left out): the gateway checks a request against the session's record
and renders only its new messages, so a turn's cost must not grow with the history (only the body's parse and the
token ids sent upstream do, at memcpy speeds). Also reported: the episode's total gateway CPU against the time it
spent decoding the upstream's answers (``gateway_decode_duration_seconds``), and ``render_ms`` early and late.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, ratio
from bench.services import read_body
from bench.workload import TOP_P_FLAG
from slime_wire.http1 import ConnectionPool

NAME = "agent loop per-turn cost"
GOAL = 1.5
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
_WORDS = "def add(a, b): return a + b  # the weather in Paris is sunny, 21 degrees; print(add(2, 3))\n"


def call_text(turn: int) -> str:
    """What the model writes: a tool call, as the template renders one (Hermes)."""
    call = json.dumps({"name": "read_file", "arguments": {"path": f"src/module_{turn}.py"}})
    return f"<tool_call>\n{call}\n</tool_call>"


def tool_result(turn: int, size: int) -> str:
    text = f"# module_{turn}.py\n" + _WORDS * (size // len(_WORDS) + 1)
    return text[:size]


async def decode_seconds(pool: ConnectionPool) -> float:
    metrics = (await read_body(pool, "GET", "/metrics")).decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("gateway_decode_duration_seconds_sum")
    )


async def measure(ctx: Context) -> dict[str, Any]:
    shape, moe = ctx.suite.agent_loop, ctx.suite.moe
    services = ctx.services
    gateway, simulator = services.agent_gateway, services.chat_simulator
    pool = ConnectionPool(gateway.url, max_connections=2, connect_timeout_s=5, pool_timeout_s=5)
    sim = ConnectionPool(simulator.url, max_connections=2, connect_timeout_s=5, pool_timeout_s=5)
    sid = f"agent-loop-{uuid.uuid4().hex[:8]}"
    answers = [{"text": call_text(turn)} for turn in range(shape.turns)]
    await read_body(sim, "POST", "/sim/script", {"rid_prefix": f"{sid}-", "answers": answers})
    sampling = {"temperature": 1.0, **TOP_P_FLAG}
    create = {"session_id": sid, "num_layers": moe.layers, "moe_router_topk": moe.topk, "sampling_defaults": sampling}
    await read_body(pool, "POST", "/v1/sessions", create)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Read the files you need, then answer."},
        {"role": "user", "content": "Summarize what each module of the repository does."},
    ]
    cpu, render, tokens = [], [], []
    decode_before, episode_cpu = await decode_seconds(pool), gateway.cpu_seconds()
    try:
        for turn in range(shape.turns):
            body = {"model": "tiny", "messages": messages, "tools": [TOOL], "max_tokens": 256}
            started = gateway.cpu_seconds()
            answer = orjson.loads(await read_body(pool, "POST", f"/v1/sessions/{sid}/chat/completions", body))
            cpu.append(gateway.cpu_seconds() - started)
            render.append(float(answer["gateway"]["render_ms"]))
            tokens.append(int(answer["gateway"]["total_tokens"]))
            message = answer["choices"][0]["message"]
            (call,) = message["tool_calls"]
            result = tool_result(turn, shape.tool_result_bytes)
            messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": result}]
            if (turn + 1) % 16 == 0:
                log(f"row 18: turn {turn + 1}/{shape.turns}: {tokens[-1]} tokens, {cpu[-1] * 1e3:.1f} ms CPU")
        episode_cpu = gateway.cpu_seconds() - episode_cpu
        decoded = await decode_seconds(pool) - decode_before
        view = orjson.loads(await read_body(pool, "GET", f"/v1/sessions/{sid}"))
    finally:
        await read_body(pool, "DELETE", f"/v1/sessions/{sid}")
        await pool.aclose()
        await sim.aclose()
    if len(view["branches"]) != 1 or view["turns"] != 2 * shape.turns - 1:
        raise RuntimeError(f"the episode did not stay one trajectory: {view['branches']}, {view['turns']} turns")
    return {"cpu": cpu, "render": render, "tokens": tokens, "episode_cpu": episode_cpu, "decoded": decoded}


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.agent_loop
    started = time.perf_counter()
    got = uvloop.run(measure(ctx))
    w = shape.window
    early, late = got["cpu"][1 : 1 + w], got["cpu"][-w:]
    growth = ratio(median(late), median(early))
    render_early, render_late = median(got["render"][1 : 1 + w]), median(got["render"][-w:])
    tokens = got["tokens"]
    return RowResult(
        number=18,
        name=NAME,
        measured=(
            f"gateway CPU per turn, median of turns 2-{1 + w} / {shape.turns - w + 1}-{shape.turns}: "
            f"{median(early) * 1e3:.2f} / {median(late) * 1e3:.2f} ms ({growth:.2f}x; the session at "
            f"{tokens[w]} / {tokens[-1]} tokens); render_ms {render_early:.2f} / {render_late:.2f}; the episode: "
            f"{got['episode_cpu']:.2f} s of gateway CPU, {got['decoded']:.2f} s of it decoding the upstream's answers "
            f"({ratio(got['episode_cpu'], got['decoded']):.1f}x)"
        ),
        checks=[Check("late/early turn CPU", growth, GOAL, higher_is_better=False)],
        notes=[
            f"one session, {shape.turns} chat completions of a tool loop: each answer a ~30-token tool call (scripted "
            f"on a simulator with the tiny chat tokenizer), each result {shape.tool_result_bytes} bytes of text, the "
            f"whole history sent each turn, {ctx.suite.moe.describe()}, "
            "routing + top-p replay",
            "gateway CPU: all its threads' run time (/proc/<pid>/task/*/schedstat) around each request; turn 1 (the "
            "whole prompt rendered) is left out of the early window",
            "decode: the gateway's own gateway_decode_duration_seconds_sum over the episode (the upstream answers' "
            "parse, base64 and checks): the part of a turn's cost that the answer's size sets",
            f"{time.perf_counter() - started:.0f} s for the row",
        ],
    )
