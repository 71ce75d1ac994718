"""Row 7: resident memory per stored token vs the compact payload's bytes per token.

A fresh subprocess (``bench.memory_worker``) builds the sessions in-process through decode + fold (HTTP would
only add time) and reads its own resident set before and after; the ratio is RSS growth per token over the
bytes per token of one session's safetensors sample (what ``GET /v1/sessions/{id}/sample`` sends).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import orjson

from bench.core import Check, Context, RowResult, log
from bench.services import REPO_ROOT, child_env

NAME = "memory per stored token"
WORKER_TIMEOUT_S = 900


def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.memory
    args = [sys.executable, "-m", "bench.memory_worker", "--sessions", str(shape.sessions)]
    args += ["--prompt-tokens", str(shape.prompt_tokens), "--response-tokens", str(shape.response_tokens)]
    args += ["--layers", str(shape.moe.layers), "--topk", str(shape.moe.topk), "--experts", str(shape.moe.experts)]
    args += ["--distinct-answers", str(shape.distinct_answers)]
    done = subprocess.run(
        args, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, timeout=WORKER_TIMEOUT_S, check=False
    )
    if done.returncode:
        raise RuntimeError(f"the memory worker failed with exit code {done.returncode}")
    result: dict[str, Any] = orjson.loads(done.stdout)
    return result


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.memory
    log(
        f"row 7: {shape.sessions} sessions of {shape.tokens} tokens ({shape.prompt_tokens} prompt + "
        f"{shape.response_tokens} response) in a fresh process"
    )
    got = measure(ctx)
    ratio = got["rss_bytes_per_token"] / got["payload_bytes_per_token"]
    return RowResult(
        number=7,
        name=NAME,
        measured=(
            f"RSS +{got['rss_growth_bytes'] / 2**30:.2f} GiB = {got['rss_bytes_per_token']:.0f} B/token; payload "
            f"{got['payload_bytes_per_token']:.0f} B/token; arrays held {got['stored_bytes_per_token']:.0f} B/token"
        ),
        checks=[Check("RSS/payload", ratio, 1.2, higher_is_better=False)],
        notes=[
            f"{shape.sessions} sessions x {shape.tokens} tokens ({shape.prompt_tokens} prompt + {shape.response_tokens}"
            f" response), {shape.moe.describe()}, routing + top-p replay; each session decoded and folded from a raw "
            f"answer ({got['raw_answer_bytes'] / 2**20:.1f} MiB; {shape.distinct_answers} distinct answers, decoded "
            "afresh every time) and kept in a SessionStore",
            "bench/memory_worker.py in a fresh process: /proc/self/statm resident pages before (after one warm-up "
            "session, dropped) and after, gc.collect() both times; answers decoded one at a time "
            f"(peak RSS {got['peak_rss_bytes'] / 2**30:.2f} GiB)",
        ],
    )
