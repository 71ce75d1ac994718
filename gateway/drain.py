"""Draining on SIGTERM, for replicas behind a load balancer (``GATEWAY_DRAIN_S``).

A rolling restart stops replicas one by one with SIGTERM. Stopping at once would refuse the requests a load balancer
still sends this way until its health checks notice (HAProxy: ``inter`` x ``fall``), and close the kept-alive
connections it is about to reuse. So, first, for ``drain_s``:

- ``GET /health`` answers 503 ``{"status": "draining"}``: the balancer's checks take the replica out of rotation;
- every request that still arrives is served as usual, and its answer carries ``Connection: close``, so that the
  balancer's kept-alive connections to this replica end one by one rather than all at once at the exit;

then the usual shutdown (uvicorn's: no new connections, in-flight requests get ``shutdown_grace_s``, then running
turns are aborted coherently). A second SIGTERM, or SIGINT, during the drain shuts down at once.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("gateway")


@dataclass
class Drain:
    """Whether this replica drains (shared by the server, which starts it, and the app, which answers by it)."""

    since: float | None = None  # time.monotonic() of the SIGTERM that started it

    @property
    def draining(self) -> bool:
        return self.since is not None

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains for ``drain_s`` before the shutdown it starts."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_s = drain_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_s > 0 and not self.drain.draining and not self.should_exit:
            self.drain.start()
            log.info("SIGTERM: draining for %.1fs (GET /health answers 503), then shutting down", self.drain_s)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        since = self.drain.since
        if since is not None and not self.should_exit and time.monotonic() - since >= self.drain_s:
            super().handle_exit(signal.SIGTERM, None)  # drained: the shutdown SIGTERM asks for
        return await super().on_tick(counter)


class CloseWhileDraining:
    """While the replica drains, every answer closes its connection (``Connection: close``)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.draining:
            await self.app(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        await self.app(scope, receive, closing)
