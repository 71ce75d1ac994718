"""Row 5: the cost of the gateway in front of SGLang: small ``/generate`` calls via the gateway vs direct.

Three processes: the simulator, the gateway in front of it, and the load generator (``bench.loadgen``, its own
process). Concurrency 1 (latency: what the gateway adds per call) and 32 (throughput: how much of the direct rate
survives the extra hop). Rounds alternate the target order; each figure is the median over the rounds of the
paired (same round) comparison.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.core import Check, Context, RowResult, log, median, percentile
from bench.services import REPO_ROOT, child_env
from bench.workload import PassthroughShape, prompt_ids

NAME = "passthrough overhead"
LOADGEN_TIMEOUT_S = 300


def small_generate_body(shape: PassthroughShape) -> bytes:
    body = {
        "input_ids": prompt_ids(shape.prompt_tokens, seed=5),
        "sampling_params": {"max_new_tokens": shape.max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
    }
    return orjson.dumps(body)


def run_loadgen(url: str, body_file: Path, concurrency: int, requests: int, warmup: int) -> dict[str, Any]:
    args = [sys.executable, "-m", "bench.loadgen", "--url", url, "--body-file", str(body_file)]
    args += ["--concurrency", str(concurrency), "--requests", str(requests), "--warmup", str(warmup)]
    done = subprocess.run(
        args, cwd=REPO_ROOT, env=child_env(), capture_output=True, timeout=LOADGEN_TIMEOUT_S, check=False
    )
    if done.returncode:
        raise RuntimeError(f"load generator failed: {done.stderr.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = orjson.loads(done.stdout)
    latencies = result.pop("latencies_ms")
    result["p50_ms"] = percentile(latencies, 50)
    result["p99_ms"] = percentile(latencies, 99)
    return result


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.passthrough
    targets = {"direct": ctx.services.simulator.url, "gateway": ctx.services.gateway.url}
    per_round: dict[int, list[dict[str, dict[str, Any]]]] = {1: [], 32: []}
    with tempfile.NamedTemporaryFile(suffix=".json") as body_file:
        Path(body_file.name).write_bytes(small_generate_body(shape))
        for round_number in range(shape.rounds):
            order = list(targets) if round_number % 2 == 0 else list(reversed(targets))
            for concurrency, requests in ((1, shape.requests_c1), (32, shape.requests_c32)):
                got: dict[str, dict[str, Any]] = {}
                for name in order:
                    got[name] = run_loadgen(
                        targets[name] + "/generate", Path(body_file.name), concurrency, requests, shape.warmup
                    )
                per_round[concurrency].append(got)
                log(
                    f"row 5: round {round_number + 1}/{shape.rounds} c={concurrency}: "
                    + ", ".join(f"{n} p50 {g['p50_ms']:.3f} ms {g['rps']:.0f}/s" for n, g in got.items())
                )

    def added_p50(concurrency: int) -> float:
        return median([r["gateway"]["p50_ms"] - r["direct"]["p50_ms"] for r in per_round[concurrency]])

    def throughput(concurrency: int) -> float:
        return median([r["gateway"]["rps"] / r["direct"]["rps"] for r in per_round[concurrency]])

    def stat(concurrency: int, target: str, key: str) -> float:
        return median([r[target][key] for r in per_round[concurrency]])

    return RowResult(
        number=5,
        name=NAME,
        measured=(
            f"c=1: p50 direct {stat(1, 'direct', 'p50_ms'):.3f} ms, via gateway {stat(1, 'gateway', 'p50_ms'):.3f} ms, "
            f"throughput {throughput(1):.0%}; c=32: {stat(32, 'direct', 'rps'):.0f} vs {stat(32, 'gateway', 'rps'):.0f}"
            f" req/s, p50 +{added_p50(32):.2f} ms"
        ),
        checks=[
            Check("p50 added (c=1)", added_p50(1), 1.0, higher_is_better=False, unit="ms"),
            Check("throughput (c=32)", throughput(32), 0.70, higher_is_better=True),
        ],
        notes=[
            f"request: /generate with a {shape.prompt_tokens}-token prompt, {shape.max_new_tokens} new tokens, "
            "return_logprob; the simulator answers at once (no simulated latency), so the gateway's overhead is all "
            "there is to see",
            f"load generator: bench/loadgen.py in its own process (uvloop, raw HTTP/1.1 keep-alive connections); "
            f"{shape.requests_c1} requests at c=1 and {shape.requests_c32} at c=32 per run after {shape.warmup} "
            f"warm-up, {shape.rounds} rounds with the target order alternating; medians of the per-round paired "
            "differences / ratios",
            "2 CPU cores for 3 busy processes (load generator, gateway, simulator) at c=32: the gateway's CPU per "
            "request competes with the simulator's",
        ],
    )
