"""Closing a session (``POST /v1/sessions/{id}/close``): what a trainer does before it takes a rollout's samples.

From the close on, every turn asked for is refused (``SessionClosed``, in each chat API's own error shape); the turns
already running get ``wait_timeout_s`` to end by themselves, then are aborted (their tokens so far folded, as an
abort always does), so that the samples read afterwards hold every turn whole: a sample read while a turn runs
would lack that turn's routing rows. slime's adapters do the same in ``shutdown_session``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.store import Session, SessionStore
from gateway.turns import ABORT_SETTLE_S, abort_turns

CLOSE_ABORT_REASON = "session closed"
# How often the drain looks again whether the session is idle: a turn ends (and releases its branch) in steps that
# signal nothing a waiter can hold (the chat reply is recorded after the model turn's end).
POLL_S = 0.02


@dataclass
class Drain:
    """How closing went: the turns aborted, and whether a turn still holds the session (one another replica runs, or
    one that did not end after its abort)."""

    waited_s: float = 0.0
    aborted: list[str] = field(default_factory=list)  # the rids of the turns aborted
    busy: bool = False
    instance_id: str | None = None  # the replica that still runs a turn on it, when another one does

    def to_json(self) -> dict[str, Any]:
        return {
            "closed": True,
            "drained": not self.busy,
            "waited_s": round(self.waited_s, 3),
            "aborted_rids": self.aborted,
            "instance_id": self.instance_id,
        }


async def close_session(
    store: SessionStore, metrics: GatewayMetrics, session_id: str, wait_timeout_s: float
) -> tuple[Session, Drain]:
    """Close the session and drain its turns: wait up to ``wait_timeout_s`` for them, then abort what still runs."""
    started = time.monotonic()
    session = await store.close(session_id)
    drain = Drain()
    idle = await _wait_idle(store, session, started + wait_timeout_s)
    if not idle:
        running = session.running_turns()
        drain.aborted = [turn.rid for turn in running]
        await abort_turns(running, CLOSE_ABORT_REASON)
        idle = await _wait_idle(store, session, time.monotonic() + ABORT_SETTLE_S)
    drain.waited_s = time.monotonic() - started
    drain.busy = not idle
    if not idle:
        drain.instance_id = await store.holder(session_id)
    metrics.sessions_closed.labels("drained" if idle else "busy").inc()
    return session, drain


async def _wait_idle(store: SessionStore, session: Session, deadline: float) -> bool:
    """Until no branch of the session is held here nor by another replica (a shared store), or the deadline."""
    while True:
        if not session.busy and await store.holder(session.session_id) is None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(POLL_S, left))
