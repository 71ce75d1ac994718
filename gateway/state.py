"""Resources owned by the app lifespan, handed to routes through one typed dependency."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, TypeVar

from fastapi import Depends, Request

from gateway.config import Settings
from gateway.drain import Drain
from gateway.metrics import GatewayMetrics
from gateway.store import SessionStore
from gateway.upstream import Upstream

if TYPE_CHECKING:
    from gateway.chat.service import ChatService

T = TypeVar("T")


@dataclass
class GatewayState:
    settings: Settings
    upstream: Upstream
    store: SessionStore
    cpu_pool: ThreadPoolExecutor
    metrics: GatewayMetrics
    chat: ChatService | None = None  # the chat routes, when a tokenizer is configured
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    drain: Drain = field(default_factory=Drain)  # started by SIGTERM (``gateway.drain``): /health answers 503

    async def run_cpu(self, size: int, fn: Callable[[], T], *, threshold: int | None = None) -> T:
        """Run CPU work (decode, encode) in the pool when it is big enough to stall the event loop: ``size`` past
        ``threshold`` (default: decode_offload_bytes, set for the upstream's answers)."""
        if size < (self.settings.decode_offload_bytes if threshold is None else threshold):
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn)

    async def decode(self, kind: str, size: int, fn: Callable[[], T]) -> T:
        """``run_cpu`` for decoding an upstream answer, timed into the decode metrics."""
        started = time.perf_counter()
        try:
            return await self.run_cpu(size, fn)
        finally:
            self.metrics.observe_decode(kind, size, time.perf_counter() - started)

    async def aclose(self) -> None:
        await self.abort_running_turns("gateway shutting down")
        await self.store.aclose()
        await self.upstream.aclose()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)

    async def abort_running_turns(self, reason: str, timeout_s: float = 4.0) -> None:
        """Shutdown: every turn still in flight ends aborted-but-coherent, never half-written."""
        running = self.store.running_turns()
        for turn in running:
            turn.abort(reason)
        await asyncio.gather(*(turn.wait(timeout_s) for turn in running))


async def get_state(request: Request) -> GatewayState:
    # async: a sync dependency would run in a worker thread on every request

    return request.app.state.gateway


StateDep = Annotated[GatewayState, Depends(get_state)]
