"""Gateway-wide actions: what one request asks of every replica that shares the session store.

A request reaches one replica (the load balancer chose it); an action on all sessions must reach all of them. The
replica that gets it acts at once on its own turns and publishes the action on the store's channel
(``PREFIX:fleet``, Redis pub/sub: on a Redis Cluster a ``PUBLISH`` reaches every node's subscribers); every other
replica is subscribed (``SessionStore.listen``, started by the app's lifespan) and acts on it when it arrives. On the
in-memory store there is one replica, and the action is only local.

Actions:
- ``abort_all``: every turn running on any replica ends, aborted-but-coherent, its tokens so far folded in (each
  replica's ``TurnRunner.abort_running_turns``): ``POST /v1/abort_all``, and slime's end-of-rollout
  ``abort_request {"abort_all": true}`` through the passthrough, which publishes it before it forwards it to the
  engine. A turn on another replica that the engine aborts before the message arrives may be resubmitted once (it
  looked like a weight update's abort); the message then aborts that continuation, so the turn still ends aborted.

Delivery is Redis pub/sub's: at most once, to the replicas subscribed at that moment. A replica cut off from Redis
misses the message (its turns end by themselves, or the engine's own abort ends them); the answer says how many
subscribers Redis counted (on a Cluster: those of the node that took the ``PUBLISH``).
API keys are not rotated over the store, on purpose: anyone able to write to Redis could then grant themselves
access. A key rotation is a rolling restart (``GATEWAY_API_KEY=old,new``, clients move to ``new``, then
``GATEWAY_API_KEY=new``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.turns import TurnRunner

log = logging.getLogger("gateway.fleet")

ABORT_ALL = "abort_all"


@dataclass(frozen=True, slots=True)
class FleetAbort:
    aborted: int  # turns this replica was running, now aborted
    published: bool  # whether the action went out to the other replicas (a shared store that answered)
    receivers: int  # the other replicas' subscriptions Redis delivered it to

    def to_json(self) -> dict[str, Any]:
        return {"aborted": self.aborted, "published": self.published, "receivers": self.receivers}


async def abort_everywhere(runner: TurnRunner, instance_id: str, reason: str) -> FleetAbort:
    """Abort every running turn on every replica: this one's now (it answers once they ended), the others' as the
    message reaches them. A store that cannot publish (Redis down) still aborts here, and says so."""
    running = len(runner.store.running_turns())
    published, receivers = await publish_abort(runner, instance_id, reason)
    await runner.abort_running_turns(reason)
    return FleetAbort(running, published, receivers)


async def publish_abort(runner: TurnRunner, instance_id: str, reason: str) -> tuple[bool, int]:
    """Tell the other replicas to abort their running turns: (whether it went out, how many subscribers Redis
    counted). Never raises: the caller's own abort must happen whatever the store does."""
    if not runner.store.shared:
        return False, 0
    message = {"action": ABORT_ALL, "reason": reason, "origin": instance_id}
    try:
        return True, await runner.store.broadcast(message)
    except Exception as exc:
        log.warning("abort_all: could not reach the other replicas: %s", exc)
        return False, 0


class FleetListener:
    """Acts on the gateway-wide actions other replicas publish (``SessionStore.listen`` calls ``on_message``)."""

    def __init__(self, runner: TurnRunner, instance_id: str) -> None:
        self.runner = runner
        self.instance_id = instance_id
        self._tasks: set[asyncio.Task[None]] = set()

    def on_message(self, message: dict[str, Any]) -> None:
        if message.get("origin") == self.instance_id:
            return  # its own: acted on when it was sent
        if message.get("action") == ABORT_ALL:
            reason = str(message.get("reason") or "aborted on every gateway replica")
            log.info("abort_all from gateway instance %s: %s", message.get("origin"), reason)
            task = asyncio.create_task(self.runner.abort_running_turns(reason), name="fleet-abort-all")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            log.warning("gateway-wide action %r not known here (a newer replica's?): ignored", message.get("action"))
