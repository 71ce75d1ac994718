"""Row 6: does decoding big answers stall the gateway's event loop? ``/health`` latency under that load.

A prober process (``bench.loadgen --probe-interval``) GETs ``/health`` every few milliseconds on one keep-alive
connection while this process runs waves of concurrent session turns of the realistic shape through the gateway
(each answer: a multi-MB JSON with routing + top-p replay, received, decoded and folded by the gateway). Only the
probes that start while a wave is in flight count (pooled over the waves); an idle baseline is measured first.

The simulator builds those answers with ~0.6 s of CPU per wave, CPU that SGLang spends on its own machine. On a
small bench machine it competes with the gateway for the same cores, and /health would then measure that
contention rather than the gateway's event loop. So the goal is checked with the simulator at a lower CPU
priority (nice 10: it still gets every idle cycle); the same run at equal priority is reported next to it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

import orjson

from bench.core import Check, Context, RowResult, log, percentile
from bench.services import REPO_ROOT, child_env
from bench.workload import TOP_P_FLAG, AnswerShape, prompt_ids
from slime_client import GatewayClient

NAME = "event loop under load"
IDLE_PROBE_S = 1.0


def start_prober(url: str, interval_s: float) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "bench.loadgen", "--url", url, "--probe-interval", str(interval_s)]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "ready": connected, probing
    if b"ready" not in line:
        proc.kill()
        raise RuntimeError(f"the prober did not start: {line!r} {proc.stderr.read()!r}")
    return proc


def stop_prober(proc: subprocess.Popen[bytes]) -> list[tuple[float, float]]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    if proc.returncode:
        raise RuntimeError(f"the prober failed: {err.decode(errors='replace')[-2000:]}")
    return [(start, latency) for start, latency in orjson.loads(out)["probes"]]


async def concurrent_turns(url: str, shape: AnswerShape, count: int, wave: int = 0) -> tuple[float, float]:
    """``count`` sessions, one model turn each, all at once; returns the monotonic (start, end) of the turns."""
    sampling = {"max_new_tokens": shape.response_tokens, "ignore_eos": True, "temperature": 1.0}
    if shape.top_p:
        sampling |= TOP_P_FLAG
    moe = shape.moe
    async with GatewayClient(url) as gateway:
        sessions = [
            await gateway.create_session(
                prompt_ids=prompt_ids(shape.prompt_tokens, seed=100 * wave + i),
                num_layers=moe.layers,
                moe_router_topk=moe.topk,
            )
            for i in range(count)
        ]
        started = time.monotonic()
        turns = await asyncio.gather(*(session.generate(sampling) for session in sessions))
        ended = time.monotonic()
        assert all(turn.completion_tokens == shape.response_tokens for turn in turns)
        for session in sessions:
            await session.delete()
    return started, ended


def probe_waves(ctx: Context, waves: int) -> tuple[dict[str, Any], dict[str, Any], float]:
    """(idle stats, loaded stats, seconds under load) for ``waves`` bursts of concurrent turns."""
    shape = ctx.suite.event_loop
    gateway = ctx.services.gateway
    prober = start_prober(gateway.url + "/health", shape.probe_interval_s)
    try:
        idle_from = time.monotonic()
        time.sleep(IDLE_PROBE_S)
        idle_to = time.monotonic()
        windows = []
        for wave in range(waves):
            turns = f"{shape.concurrent_turns} concurrent turns of {shape.answer.describe()}"
            log(f"row 6: wave {wave + 1}/{waves}: {turns}")
            windows.append(asyncio.run(concurrent_turns(gateway.url, shape.answer, shape.concurrent_turns, wave)))
    finally:
        probes = stop_prober(prober)
    idle = summarize([lat for at, lat in probes if idle_from <= at < idle_to])
    loaded = summarize([lat for at, lat in probes if any(start <= at < end for start, end in windows)])
    return idle, loaded, sum(end - start for start, end in windows)


def summarize(latencies: list[float]) -> dict[str, Any]:
    return {
        "count": len(latencies),
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "max": max(latencies, default=float("nan")),
    }


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.event_loop
    simulator = ctx.services.simulator
    ctx.services.gateway  # noqa: B018 (started before the prober, so startup is not measured)
    log("row 6: simulator at equal CPU priority")
    _, contended, _ = probe_waves(ctx, max(1, shape.waves // 2))
    log("row 6: simulator at lower CPU priority (nice 10)")
    with ctx.services.deprioritized(simulator):
        idle, loaded, busy_s = probe_waves(ctx, shape.waves)
    return RowResult(
        number=6,
        name=NAME,
        measured=(
            f"/health p50 {loaded['p50']:.2f} ms, p99 {loaded['p99']:.2f} ms, max {loaded['max']:.1f} ms over "
            f"{loaded['count']} probes in {busy_s:.1f} s (idle p99 {idle['p99']:.2f} ms); simulator at equal "
            f"priority: p99 {contended['p99']:.1f} ms"
        ),
        checks=[Check("/health p99", loaded["p99"], 50.0, higher_is_better=False, unit="ms")],
        notes=[
            f"load: waves of {shape.concurrent_turns} concurrent POST /v1/sessions/{{id}}/generate of "
            f"{shape.answer.describe()} through the gateway (the simulator builds, the gateway receives, decodes and "
            "folds each answer)",
            f"probe: GET /health every {shape.probe_interval_s * 1e3:.0f} ms on one keep-alive connection from its own "
            "process (bench/loadgen.py); percentiles over the probes started while a wave was in flight",
            f"the goal's number: {shape.waves} waves with the simulator at nice 10 (its answer building, ~0.6 s of CPU "
            "per wave, is SGLang's own machine's work, not the gateway's); also shown: "
            f"{max(1, shape.waves // 2)} wave(s) with the simulator at equal priority, where the 2 cores are saturated",
        ],
    )
