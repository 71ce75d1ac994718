"""Resources owned by the app lifespan, handed to routes through one typed dependency.

The routes are the only layer that sees the whole of it: each one passes on what a call needs (the turn runner to a
turn, the store to a read), so nothing below the routes imports this module.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, TypeVar

from fastapi import Depends, Request

from gateway.config import Settings
from gateway.drain import Drain
from gateway.metrics import GatewayMetrics
from gateway.offload import CpuPool
from gateway.store import SessionStore
from gateway.turns import TurnRunner
from gateway.upstream import Upstream

if TYPE_CHECKING:
    from gateway.chat.service import ChatService

T = TypeVar("T")


@dataclass
class GatewayState:
    settings: Settings
    upstream: Upstream
    store: SessionStore
    cpu: CpuPool
    metrics: GatewayMetrics
    runner: TurnRunner
    chat: ChatService | None = None  # the chat routes, when a tokenizer is configured
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    drain: Drain = field(default_factory=Drain)  # started by SIGTERM (``gateway.drain``): /health answers 503

    async def run_cpu(self, size: int, fn: Callable[[], T], *, threshold: int | None = None) -> T:
        """``CpuPool.run``: CPU work (decode, encode) in the pool when it is big enough to stall the event loop."""
        return await self.cpu.run(size, fn, threshold=threshold)

    async def aclose(self) -> None:
        await self.abort_running_turns("gateway shutting down")
        await self.store.aclose()
        await self.upstream.aclose()
        self.cpu.shutdown()

    async def abort_running_turns(self, reason: str, timeout_s: float = 4.0) -> None:
        """``TurnRunner.abort_running_turns``: every turn still in flight here ends aborted-but-coherent, never
        half-written and never resumed (shutdown, the gateway-wide abort)."""
        await self.runner.abort_running_turns(reason, timeout_s)


async def get_state(request: Request) -> GatewayState:
    # async: a sync dependency would run in a worker thread on every request

    return request.app.state.gateway


StateDep = Annotated[GatewayState, Depends(get_state)]
