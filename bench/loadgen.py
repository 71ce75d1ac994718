"""A lean HTTP/1.1 load generator, run in its own process.

``python -m bench.loadgen --url URL --body-file F --concurrency C --requests N``: keep-alive connections over
asyncio streams (uvloop), one request in flight per connection, the same prepared POST every time. Its CPU cost
per request is the same whichever server it targets, and far below httpx's, so the measured difference between
two targets is the targets'. Prints ``{"requests", "seconds", "rps", "latencies_ms": [...]}`` for the timed phase
(after a warm-up).

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


class HTTPError(RuntimeError):
    pass


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def build_get(host: str, port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


def content_length(head: bytes) -> int:
    at = head.lower().find(b"\r\ncontent-length:")
    if at == -1:
        raise HTTPError(f"answer without Content-Length: {head[:200]!r}")
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end])


async def one_connection(host: str, port: int, request: bytes, count: int, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(count):
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(content_length(head))
            latencies.append(time.perf_counter() - started)
            if head[9:12] != b"200":
                raise HTTPError(f"status {head[9:12].decode()}: {head[:200]!r}")
    finally:
        writer.close()


async def load(url: str, body: bytes, concurrency: int, requests: int, warmup: int) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = build_request(host, port, parts.path or "/", body)
    per_connection = max(1, requests // concurrency)
    warm: list[float] = []
    await asyncio.gather(
        *(one_connection(host, port, request, max(1, warmup // concurrency), warm) for _ in range(concurrency))
    )
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(one_connection(host, port, request, per_connection, latencies) for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "rps": len(latencies) / seconds,
        "latencies_ms": [round(value * 1e3, 4) for value in latencies],
    }


async def probe(url: str, interval_s: float, max_seconds: float) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = build_get(host, port, parts.path or "/")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.call_later(max_seconds, stop.set)
    probes: list[list[float]] = []
    reader, writer = await asyncio.open_connection(host, port)
    print("ready", file=sys.stderr, flush=True)
    try:
        while not stop.is_set():
            started = time.monotonic()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(content_length(head))
            probes.append([started, round((time.monotonic() - started) * 1e3, 4)])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        writer.close()
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
