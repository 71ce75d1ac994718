"""Row 10: the gateway's upstream transport receiving big answers, against a raw-socket floor, per MB of client CPU.

``bench.receive_worker`` runs in a process of its own, set up as the gateway runs (uvloop, ``keep_freed_memory``),
against ``bench.canned_server`` (answers prepared once, so the server costs nothing per request). Two paths of
``slime_wire.http1``: ``read()`` of a Content-Length body (a unary turn's answer: llhttp parses it, the body lands in
a pooled buffer) and ``iter_raw()`` of a chunked event stream (a streamed turn); the floor receives the same bytes
into one reused buffer and parses nothing.
"""

from __future__ import annotations

import subprocess
import sys

import orjson

from bench.core import Check, Context, RowResult, log
from bench.services import REPO_ROOT, child_env, start_server

NAME = "upstream receive cost"
WORKER_TIMEOUT_S = 300


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.receive
    server = start_server("canned server", ["-m", "bench.canned_server"])
    try:
        args = [sys.executable, "-m", "bench.receive_worker", "--url", server.url]
        args += ["--sizes", ",".join(str(size) for size in shape.sizes), "--rounds", str(shape.rounds)]
        done = subprocess.run(
            args, cwd=REPO_ROOT, env=child_env(), capture_output=True, timeout=WORKER_TIMEOUT_S, check=False
        )
    finally:
        server.stop()
    if done.returncode:
        raise RuntimeError(f"receive worker failed: {done.stderr.decode(errors='replace')[-2000:]}")
    per_size: dict[str, dict[str, float]] = orjson.loads(done.stdout)
    biggest = per_size[str(max(shape.sizes))]
    read_ratio = biggest["read"] / biggest["floor_read"]
    stream_ratio = biggest["iter_raw"] / biggest["floor_events"]
    log(f"row 10: {per_size}")
    measured = "; ".join(
        f"{int(size) >> 20} MiB: read {m['read']:.3f}, stream {m['iter_raw']:.3f}, floor {m['floor_read']:.3f} "
        f"ms CPU/MB"
        for size, m in per_size.items()
    )
    return RowResult(
        number=10,
        name=NAME,
        measured=measured,
        checks=[
            Check("unary read vs floor", read_ratio, 2.0, higher_is_better=False),
            Check("stream vs floor", stream_ratio, 2.0, higher_is_better=False),
        ],
        notes=[
            f"bodies of {', '.join(f'{size >> 20} MiB' for size in shape.sizes)} from bench/canned_server.py (its own "
            "process, answers prepared once): Content-Length for read(), a chunked text/event-stream of 256 KiB "
            "events for iter_raw(); the ratios are taken at the biggest size",
            "bench/receive_worker.py in its own process, set up like the gateway (uvloop, "
            "slime_wire.memory.keep_freed_memory); time.process_time per MB over samples of ~100 MB, best of "
            f"{shape.rounds}, the four sides interleaved, each sample after one untimed request on its connection",
            "floor: an asyncio BufferedProtocol receiving the known number of bytes into one reused 256 KiB buffer, "
            "parsing and keeping nothing (the kernel's copy and the loop's callbacks)",
        ],
    )
