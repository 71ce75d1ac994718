"""Row 10's measurement, in a process of its own set up as the gateway's (``keep_freed_memory``, uvloop):
``python -m bench.receive_worker --url URL --sizes 4194304,20971520 --rounds N`` prints JSON.

Client CPU (``time.process_time``) per MB received from ``bench.canned_server``, best of ``rounds`` samples of
~100 MB each, the sides interleaved: the gateway's transport (``slime_wire.http1.ConnectionPool``: ``read()`` of a
Content-Length body, the unary turn's path; ``iter_raw()`` of a chunked event stream, the streamed turn's path)
against a raw-socket floor that parses and keeps nothing (a ``BufferedProtocol`` receiving the known number of
bytes into one reused 256 KiB buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import orjson
import uvloop

from bench.canned_server import content_length_answer, event_stream_answer
from slime_wire.http1 import ConnectionPool
from slime_wire.memory import keep_freed_memory

MB = 1 << 20
BATCH_BYTES = 100 * MB  # received per timed sample: single requests are too short for a steady reading


class Floor(asyncio.BufferedProtocol):
    """Receives ``expect`` bytes per request into one reused 256 KiB buffer and keeps none of them: the kernel's
    copy and the event loop's callbacks, the least any client can do."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._buffer = bytearray(256 * 1024)
        self._filled = 0
        self._expect = 0
        self._done: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled >= self._expect and self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def get(self, request: bytes, expect: int) -> int:
        assert self._transport is not None
        self._filled, self._expect = 0, expect
        self._done = self._loop.create_future()
        self._transport.write(request)
        await self._done
        return self._filled


async def measure(url: str, sizes: list[int], rounds: int) -> dict[str, dict[str, float]]:
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    pool = ConnectionPool(url, max_connections=4, connect_timeout_s=5, pool_timeout_s=5)
    _, floor = await loop.create_connection(lambda: Floor(loop), parts.hostname, parts.port)

    async def read(path: bytes) -> int:
        response = await pool.request("GET", path, timeout=60)
        try:
            body = await response.read()
        finally:
            await response.aclose()
        pool.buffers.give_back(body)
        return len(body)

    async def stream(path: bytes) -> int:
        response = await pool.request("GET", path, timeout=60)
        try:
            return sum([len(piece) async for piece in response.iter_raw()])
        finally:
            await response.aclose()

    def sides_for(size: int) -> dict[str, Callable[[], Awaitable[int]]]:
        cl_path, ev_path = b"/bytes/%d" % size, b"/events/%d" % size
        cl_request, ev_request = (b"GET %s HTTP/1.1\r\nHost: bench\r\n\r\n" % path for path in (cl_path, ev_path))
        cl_bytes, ev_bytes = len(content_length_answer(size)), len(event_stream_answer(size))
        return {
            "read": lambda: read(cl_path),
            "iter_raw": lambda: stream(ev_path),
            "floor_read": lambda: floor.get(cl_request, cl_bytes),
            "floor_events": lambda: floor.get(ev_request, ev_bytes),
        }

    results: dict[str, dict[str, float]] = {}
    for size in sizes:
        sides = sides_for(size)
        best = dict.fromkeys(sides, float("inf"))
        for side in sides.values():  # warm: the server builds its answers, buffers get mapped
            await side()
        repeat = max(1, BATCH_BYTES // size)
        for _ in range(rounds):
            for name, side in sides.items():
                await side()  # untimed: a connection idle for a while restarts TCP slow start, costing wake-ups
                started = time.process_time()
                received = sum([await side() for _ in range(repeat)])
                best[name] = min(best[name], (time.process_time() - started) / (received / MB))
        results[str(size)] = {name: value * 1e3 for name, value in best.items()}  # ms of CPU per MB
    await pool.aclose()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.receive_worker", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--sizes", default=f"{4 * MB},{20 * MB}")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    keep_freed_memory()
    gc.freeze()
    sizes = [int(size) for size in args.sizes.split(",")]
    result = uvloop.run(measure(args.url, sizes, args.rounds))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
