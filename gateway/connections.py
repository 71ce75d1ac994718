"""Client connections: deadlines for the request head and body, a cap on open connections, the open-files limit.

uvicorn (0.54, ``protocols/http/httptools_impl.py``) has no timeout for a connection that never completes a request
head: its only timer is the keep-alive one, armed after a response. A connection that sends nothing, or a partial
head, is held forever, and ``limit_concurrency`` counts those connections too, so at the limit it answers every new
request, ``/health`` included, 503. ``GuardedHttpToolsProtocol`` (uvicorn's httptools protocol, passed as
``uvicorn.run(http=...)``) adds what is missing:

- the head deadline: a connection whose head is not complete ``header_timeout_s`` after it opened (or, on a kept-alive
  connection, after the head's first byte) is closed: silently if nothing came, with a 408 ``header_timeout`` if
  part of a head did;
- the body deadline: a request whose body is not complete ``body_timeout_s`` after its head is answered 408
  ``body_timeout`` and its connection closed (a body that trickles or stalls would otherwise hold its connection,
  and the route waiting for it, for ever);
- the cap: past ``max_client_connections`` a new connection closes the connection idle longest (waiting for a head,
  or kept alive between requests), or, when none is idle, the one whose body has been arriving longest (answered
  503 ``too_many_connections``). A connection that has sent nothing yet is not idle for its first ``FRESH_GRACE_S``
  (its request is likely already on the way: in a burst of new connections, each would otherwise close the one
  accepted just before it, whose bytes the loop had not read yet); it is closed before a receiving one only once
  that has passed. Only a server whose every connection has a whole request in flight refuses the new one (503
  ``too_many_connections``). So a flood of half-open connections or stalled bodies costs the flooder its
  oldest ones, while ``/health`` and real callers keep getting in, and the process never runs out of file
  descriptors;
- a deadline for the rest of a body answered early (a 413 sent before the body was read): uvicorn reads it and
  drops it, so that the client, still sending, gets the answer rather than a reset; if the body has not ended
  ``header_timeout_s`` after the answer (an endless or stalled body), the connection is closed.

``fit_open_files_limit`` raises the process's ``RLIMIT_NOFILE`` soft limit to what the caps need, up to the hard
limit (lowering the client cap to what the hard limit allows).
"""

from __future__ import annotations

import asyncio
import http
import logging
import resource
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import BodyTimeout, GatewayError, HeaderTimeout, TooManyConnections

log = logging.getLogger("gateway.connections")

# File descriptors beyond the client and upstream connections: the listening socket, logs, the event loop's own,
# worker threads, and a burst of accepted connections whose evictions have not been processed yet.
SPARE_FDS = 256
MIN_CLIENT_CONNECTIONS = 16
# Connections whose head or body deadline passed are closed this many per event-loop pass: a flood opened in one burst
# has its deadlines pass together, and closing ten thousand connections (each a write and a close) in one pass held
# the loop for 100-200 ms, /health included.
CLOSE_BATCH = 128
# A new connection that has sent nothing for this long counts as idle (a candidate to close before a body that is
# arriving); before that, it is taken to be a caller whose request is in flight to us.
FRESH_GRACE_S = 0.5


class ConnectionGuard:
    """The client connections of one server, each in one of four states: fresh (accepted, nothing received yet),
    idle (part of a head, or kept alive between requests), receiving (its head is complete, its body is not) and
    busy (a whole request in flight). The fresh, idle and receiving ones are kept in the order they entered that
    state. Every operation is O(1)."""

    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        body_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        # The fresh and idle ones -> when they entered that state.
        self._fresh: OrderedDict[GuardedHttpToolsProtocol, float] = OrderedDict()
        self._idle: OrderedDict[GuardedHttpToolsProtocol, float] = OrderedDict()
        self._receiving: OrderedDict[GuardedHttpToolsProtocol, None] = OrderedDict()
        self._busy: set[GuardedHttpToolsProtocol] = set()
        self.closed = {"header_timeout": 0, "body_timeout": 0, "evicted": 0, "evicted_mid_body": 0, "refused": 0}
        self._expired: deque[Callable[[], None]] = deque()
        self._closer: asyncio.Task[None] | None = None

    @property
    def open(self) -> int:
        return len(self._fresh) + len(self._idle) + len(self._receiving) + len(self._busy)

    def admit(self, connection: GuardedHttpToolsProtocol) -> bool:
        """Take a new connection (fresh until its first byte). At the cap one is closed to make room: the connection
        idle longest (a fresh one past its grace included), else the one receiving its body longest, else the oldest
        fresh one; False if every connection is busy: the caller refuses the new one."""
        now = self._clock()
        if self.open >= self.max_connections and not self._make_room(now):
            self.closed["refused"] += 1
            return False
        self._fresh[connection] = now
        return True

    def _make_room(self, now: float) -> bool:
        accepted = next(iter(self._fresh.values()), now)  # when the oldest fresh connection was
        idle_since = next(iter(self._idle.values()), now)
        if now - accepted >= FRESH_GRACE_S and accepted <= idle_since:  # silent past its grace, and longest waiting
            self._evict_idle(self._fresh.popitem(last=False)[0])
        elif self._idle:
            self._evict_idle(self._idle.popitem(last=False)[0])
        elif self._receiving:
            oldest, _ = self._receiving.popitem(last=False)
            self.closed["evicted_mid_body"] += 1
            oldest.evict_mid_body()
        elif self._fresh:  # only new connections and whole requests: the oldest new one goes
            self._evict_idle(self._fresh.popitem(last=False)[0])
        else:
            return False
        return True

    def _evict_idle(self, connection: GuardedHttpToolsProtocol) -> None:
        self.closed["evicted"] += 1
        connection.evict()

    def spoke(self, connection: GuardedHttpToolsProtocol) -> None:
        """Its first bytes of a request head arrived: idle from now on (a partial head is no request yet)."""
        if connection in self._fresh:
            del self._fresh[connection]
            self._idle[connection] = self._clock()

    def is_busy(self, connection: GuardedHttpToolsProtocol) -> bool:
        return connection in self._busy or connection in self._receiving

    def receiving(self, connection: GuardedHttpToolsProtocol) -> bool:
        """Its head is complete (its first bytes made it idle). False for a pipelined request that follows one in
        flight: that connection stays busy, and the request waits unread until the one before it is answered."""
        if connection not in self._idle:
            return False
        del self._idle[connection]
        self._receiving[connection] = None
        return True

    def busy(self, connection: GuardedHttpToolsProtocol) -> None:
        """Its body is complete (or it had none)."""
        if connection in self._receiving:
            del self._receiving[connection]
            self._busy.add(connection)

    def idle(self, connection: GuardedHttpToolsProtocol) -> None:
        """Its response is complete (its body may not be: the rest is dropped, under the drop deadline)."""
        if connection in self._busy or connection in self._receiving:
            self._busy.discard(connection)
            self._receiving.pop(connection, None)
            self._idle[connection] = self._clock()

    def forget(self, connection: GuardedHttpToolsProtocol) -> None:
        self._fresh.pop(connection, None)
        self._idle.pop(connection, None)
        self._receiving.pop(connection, None)
        self._busy.discard(connection)

    def deadline_passed(self, close: Callable[[], None]) -> None:
        """Queue ``close`` (a connection's late head or body); the queue is worked ``CLOSE_BATCH`` per loop pass."""
        self._expired.append(close)
        if self._closer is None or self._closer.done():
            self._closer = asyncio.get_running_loop().create_task(self._close_expired(), name="close-late-requests")

    async def _close_expired(self) -> None:
        while self._expired:
            for _ in range(min(CLOSE_BATCH, len(self._expired))):
                self._expired.popleft()()
            await asyncio.sleep(0)

    def protocol_class(self) -> type[GuardedHttpToolsProtocol]:
        """The protocol class for ``uvicorn.run(http=...)``, bound to this guard."""
        return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"guard": self})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head and body deadlines and the connection cap of ``guard``."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_started = False
        self._body_deadline: asyncio.TimerHandle | None = None
        self._drop_deadline: asyncio.TimerHandle | None = None

    # ---- the connection's life -----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            self._close_with(
                TooManyConnections(
                    f"the gateway holds {self.guard.max_connections} client connections, each with a request in flight",
                    setting="GATEWAY_MAX_CLIENT_CONNECTIONS",
                    limit=self.guard.max_connections,
                )
            )
            return
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self._disarm_body_deadline()
        self._disarm_drop_deadline()
        self.guard.forget(self)
        super().connection_lost(exc)

    def evict(self) -> None:
        """Closed to make room for a new connection (it had no request in flight)."""
        self._disarm_head_deadline()
        self.transport.close()

    def evict_mid_body(self) -> None:
        """Closed to make room for a new connection: its request's body was still arriving."""
        self._disarm_body_deadline()
        self._answer_unread_request(
            TooManyConnections(
                f"the request body was still arriving when the gateway, holding {self.guard.max_connections} client "
                "connections, needed room for a new one",
                setting="GATEWAY_MAX_CLIENT_CONNECTIONS",
                limit=self.guard.max_connections,
            )
        )

    # ---- request heads and bodies (httptools parser callbacks) -----------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.guard.spoke(self)
        self._head_started = True
        if self._head_deadline is None:  # a next request on a kept-alive connection: its head's deadline starts now
            self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_head_deadline()
        self._head_started = False
        receiving = self.guard.receiving(self)
        super().on_headers_complete()
        if receiving:  # (a pipelined request's body is not read before its turn: no deadline runs for it)
            # A request without a body completes in the same parser pass (on_message_complete disarms this at once).
            self._body_deadline = self.loop.call_later(self.guard.body_timeout_s, self._body_deadline_passed)

    def on_message_complete(self) -> None:
        self._disarm_body_deadline()
        self._disarm_drop_deadline()
        self.guard.busy(self)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._disarm_body_deadline()  # answered: what is left of the body is dropped, under the drop deadline
        if self.cycle.more_body and not self.transport.is_closing():
            # Answered before its body ended (a 413): the rest is read and dropped, for a while.
            self._drop_deadline = self.loop.call_later(self.guard.header_timeout_s, self.transport.close)
        super().on_response_complete()
        if self.cycle is None or self.cycle.response_complete:  # not a pipelined request started in its place
            self.guard.idle(self)

    # ---- the deadlines -----------------------------------------------------------------------------------------------
    def _arm_head_deadline(self) -> None:
        self._head_deadline = self.loop.call_later(self.guard.header_timeout_s, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        self._head_deadline = None
        self.guard.deadline_passed(self.close_late_head)

    def _body_deadline_passed(self) -> None:
        self._body_deadline = None
        self.guard.deadline_passed(self.close_late_body)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _disarm_drop_deadline(self) -> None:
        if self._drop_deadline is not None:
            self._drop_deadline.cancel()
            self._drop_deadline = None

    def close_late_head(self) -> None:
        """The head deadline passed (``ConnectionGuard`` calls this in batches): close, unless the head completed
        meanwhile or the connection is gone."""
        if self.transport.is_closing() or self._head_deadline is not None or self.guard.is_busy(self):
            return
        self.guard.closed["header_timeout"] += 1
        if not self._head_started:
            # Nothing came: no request to answer (a client that opened a connection ahead of time sees it closed,
            # never a response to a request it has not sent yet).
            self.transport.close()
            return
        timeout = self.guard.header_timeout_s
        self._close_with(
            HeaderTimeout(
                f"the request head was not complete within {timeout:g} s",
                setting="GATEWAY_HEADER_TIMEOUT_S",
                limit=timeout,
            )
        )

    def close_late_body(self) -> None:
        """The body deadline passed (in batches, as heads): answer 408 and close, unless the body completed, the
        request was answered meanwhile or the connection is gone."""
        if self.transport.is_closing() or self._body_deadline is not None or self.cycle is None:
            return
        if not self.cycle.more_body or self.cycle.response_complete:  # complete, or answered early (the drop deadline)
            return
        self.guard.closed["body_timeout"] += 1
        timeout = self.guard.body_timeout_s
        self._answer_unread_request(
            BodyTimeout(
                f"the request body was not complete within {timeout:g} s of its head",
                setting="GATEWAY_BODY_TIMEOUT_S",
                limit=timeout,
            )
        )

    def _answer_unread_request(self, error: GatewayError) -> None:
        """Close a connection whose request body never completed, with ``error`` unless its route has started a
        response already. The route, still waiting for the body, sees the client gone (its answer goes nowhere)."""
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
        else:
            self._close_with(error)

    def _close_with(self, error: GatewayError) -> None:
        self.transport.write(raw_error_response(error))
        self.transport.close()


def raw_error_response(error: GatewayError) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``'s JSON body, for refusals made below the ASGI app."""
    body = orjson.dumps(error.to_body())
    phrase = http.HTTPStatus(error.status_code).phrase
    extra = "".join(f"{name}: {value}\r\n" for name, value in error.response_headers().items())
    head = (
        f"HTTP/1.1 {error.status_code} {phrase}\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def fit_open_files_limit(client_connections: int, upstream_connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to what ``client_connections`` + ``upstream_connections`` + ``SPARE_FDS``
    need, up to the hard limit. Returns the client-connection cap the limit allows (``client_connections``, or less
    when the hard limit is too low, with a warning)."""
    needed = client_connections + upstream_connections + SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        log.info("open files limit %s: room for %d client connections", _fds(soft), client_connections)
        return client_connections
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info(
            "open files limit raised from %d to %d (hard limit %s): %d client + %d upstream connections + %d spare",
            soft,
            target,
            _fds(hard),
            client_connections,
            upstream_connections,
            SPARE_FDS,
        )
    allowed = max(MIN_CLIENT_CONNECTIONS, target - upstream_connections - SPARE_FDS)
    if allowed < client_connections:
        log.warning(
            "the open files hard limit (%d) leaves room for %d client connections: GATEWAY_MAX_CLIENT_CONNECTIONS=%d "
            "lowered to %d (raise the hard limit, e.g. `ulimit -Hn` or docker --ulimit nofile=, to keep it)",
            hard,
            allowed,
            client_connections,
            allowed,
        )
        return allowed
    return client_connections


def _fds(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)
