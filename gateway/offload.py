"""The CPU pool: work big enough to stall the event loop (decoding an answer, encoding a sample) runs in a thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.metrics import GatewayMetrics

T = TypeVar("T")


class CpuPool:
    """Owned by the app lifespan; shut down with it."""

    def __init__(self, threads: int, *, offload_bytes: int, metrics: GatewayMetrics) -> None:
        """``offload_bytes``: the size from which work goes to a thread (``GATEWAY_DECODE_OFFLOAD_BYTES``)."""
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-decode")
        self.offload_bytes = offload_bytes
        self.metrics = metrics

    async def run(self, size: int, fn: Callable[[], T], *, threshold: int | None = None) -> T:
        """``fn()``, in the pool when ``size`` is past ``threshold`` (default: ``offload_bytes``, set for the
        upstream's answers), else right here."""
        if size < (self.offload_bytes if threshold is None else threshold):
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def decode(self, kind: str, size: int, fn: Callable[[], T]) -> T:
        """``run`` for decoding an upstream answer, timed into the decode metrics."""
        started = time.perf_counter()
        try:
            return await self.run(size, fn)
        finally:
            self.metrics.observe_decode(kind, size, time.perf_counter() - started)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
