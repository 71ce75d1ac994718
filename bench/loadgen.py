"""A lean HTTP/1.1 load generator, run in its own process.

``python -m bench.loadgen --url URL --body-file F --concurrency C --requests N``: C callers, each sending the same
prepared POST one after the other over ``slime_wire.http1`` keep-alive connections (uvloop; llhttp parses the
answers). Its CPU cost per request is the same whichever server it targets, and far below httpx's, so the measured
difference between two targets is the targets'. Prints ``{"requests", "seconds", "rps", "latencies_ms": [...]}``
for the timed phase (after a warm-up).

``python -m bench.loadgen --url URL --probe-interval S``: a prober: GET the URL every S seconds on one connection
until SIGTERM (or ``--max-seconds``), then print ``{"probes": [[monotonic start, latency ms], ...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import uvloop

from slime_wire.http1 import ConnectionPool


class HTTPError(RuntimeError):
    pass


JSON = [(b"content-type", b"application/json")]
TIMEOUT_S = 60.0


async def call(pool: ConnectionPool, method: str, path: bytes, body: bytes) -> None:
    response = await pool.request(method, path, JSON if body else [], body, timeout=TIMEOUT_S)
    try:
        await response.read()
    finally:
        await response.aclose()
    if response.status != 200:
        raise HTTPError(f"{method} {path.decode()} answered {response.status}")


async def one_caller(pool: ConnectionPool, path: bytes, body: bytes, count: int, latencies: list[float]) -> None:
    for _ in range(count):
        started = time.perf_counter()
        await call(pool, "POST", path, body)
        latencies.append(time.perf_counter() - started)


async def load(url: str, body: bytes, concurrency: int, requests: int, warmup: int) -> dict[str, object]:
    parts = urlsplit(url)
    base, path = f"{parts.scheme}://{parts.netloc}", (parts.path or "/").encode()
    pool = ConnectionPool(base, max_connections=concurrency, connect_timeout_s=5.0, pool_timeout_s=TIMEOUT_S)
    per_caller = max(1, requests // concurrency)
    warm: list[float] = []
    await asyncio.gather(
        *(one_caller(pool, path, body, max(1, warmup // concurrency), warm) for _ in range(concurrency))
    )
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(one_caller(pool, path, body, per_caller, latencies) for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    await pool.aclose()
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "rps": len(latencies) / seconds,
        "latencies_ms": [round(value * 1e3, 4) for value in latencies],
    }


async def probe(url: str, interval_s: float, max_seconds: float) -> dict[str, object]:
    parts = urlsplit(url)
    base, path = f"{parts.scheme}://{parts.netloc}", (parts.path or "/").encode()
    pool = ConnectionPool(base, max_connections=1, connect_timeout_s=5.0, pool_timeout_s=TIMEOUT_S)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.call_later(max_seconds, stop.set)
    probes: list[list[float]] = []
    await call(pool, "GET", path, b"")  # connected before "ready": the probes time requests, not the handshake
    print("ready", file=sys.stderr, flush=True)
    while not stop.is_set():
        started = time.monotonic()
        await call(pool, "GET", path, b"")
        probes.append([started, round((time.monotonic() - started) * 1e3, 4)])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    await pool.aclose()
    return {"probes": probes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--body-file", type=Path)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--probe-interval", type=float, help="probe mode: GET the URL this often until SIGTERM")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.probe_interval is not None:
        result = uvloop.run(probe(args.url, args.probe_interval, args.max_seconds))
    elif args.body_file is None:
        parser.error("--body-file is required (or --probe-interval)")
    else:
        result = uvloop.run(load(args.url, args.body_file.read_bytes(), args.concurrency, args.requests, args.warmup))
    sys.stdout.buffer.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
