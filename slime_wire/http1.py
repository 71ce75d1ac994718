"""Keep-alive HTTP/1.1 connections to one origin. llhttp (through ``httptools``) does all the protocol parsing.

llhttp, the parser of Node.js, reads every answer: status line, headers, Content-Length and chunked framing,
keep-alive, and every byte of a body it has to frame (chunked, delimited by the end of the connection, streamed).
One exception: a body with a Content-Length that ``read()`` receives whole into a buffer. Once the head is parsed,
the rest is received straight into the buffer, never past its length, and counted here: llhttp would only count it
too, after copying each read into a bytes object for ``on_body`` (~0.13 ms per 4 MB). The head's keep-alive verdict
stands, and a fresh parser reads the connection's next answer. What this module adds is what a pool is for, with
the rules a caller can rely on:

- ``timeout`` is a deadline for the whole call: connecting, sending, the head and the body. Past it the connection
  is aborted and the call raises ``ResponseTimeout``.
- Waiting for a free connection slot is bounded by ``pool_timeout_s`` (``PoolTimeout``, nothing was sent).
- A pooled connection is reused only when it is quiet: no byte and no end-of-stream waits in its socket (an
  upstream that closed it, or sent something nobody asked for, is noticed before the request is written, and the
  request goes out on a fresh connection instead). A request is sent again only when it cannot have reached the
  server (its connection ended before any answer, with bytes of the request never acknowledged by the server's TCP
  stack), or when it is idempotent (GET, PUT, DELETE) and its reused connection died before any byte of an answer.
- Any byte llhttp refuses, an answer head over ``MAX_HEAD_BYTES``, or bytes after an answer that nobody asked for
  discard the connection (``ProtocolViolation``); its slot is always given back.

Why not aiohttp or httpx: measured on the event loop the gateway runs (uvloop), client CPU per call against a
canned upstream: a 20 MB body costs 5.4 ms here, 8.9 ms with aiohttp (three copies of every byte; 49 ms with
``read()``, which joins into fresh memory) and ~29 ms with httpx; a small call 41 us here, ~270 us with aiohttp,
~900 us with httpx. Those costs sink the gateway's passthrough and decode budgets and the trainer's fetch budget.
aiohttp also hands an answer that arrived late on an idle connection to the next request on it.
The receive path: one receive buffer per pool (the event loop fills it, llhttp reads it in the same callback); a
body read whole with a Content-Length is received straight into its buffer: a pooled one for a big body
(``BodyBuffers``, whose pages are already mapped), or the caller's own (``read(into=...)``, e.g. memory that tensors
will view); meanwhile the socket's SO_RCVLOWAT holds the loop's wake-up until the missing bytes are in (``wake_at``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import select
import socket
import ssl
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast, overload
from urllib.parse import urlsplit

import httptools

from slime_wire.errors import (
    ConnectFailed,
    ConnectionLost,
    NoAnswer,
    PoolTimeout,
    ProtocolViolation,
    ResponseTimeout,
    TransportError,
)

log = logging.getLogger("slime_wire.http1")

DEFAULT_KEEPALIVE_EXPIRY_S = 4.0  # below uvicorn's (and so SGLang's) 5 s keep-alive: never reuse one it is closing
MAX_HEAD_BYTES = 64 * 1024  # status line + headers of one answer
RECEIVE_BUFFER_BYTES = 256 * 1024  # what one read hands over
# What one read hands over while an answer's head is still incomplete: the head (at most MAX_HEAD_BYTES) and the start
# of the body. Bytes of a body read whole that arrive in that read are copied twice more (into a bytes object for
# llhttp's on_body, then into the body's buffer); once the head is in, the body goes straight to its buffer. A 256 KiB
# first read cost a 4 MB sample fetch ~0.05 ms of CPU (bench row 3); small answers still come in one read.
HEAD_READ_BYTES = MAX_HEAD_BYTES
SINK_READ_BYTES = 4 << 20  # what one read may place straight into a body's buffer (``read()`` of a Content-Length)
MAX_QUEUED_BYTES = 1 << 20  # a streamed body stops reading past this many unread bytes
BIG_BODY_BYTES = 64 * 1024  # ``read()`` of a body with a Content-Length of at least this goes into a pooled buffer
SPARE_BUFFER_BYTES = 1 << 28  # pooled body buffers kept for reuse, in all
IDEMPOTENT_METHODS = frozenset({"GET", "OPTIONS", "PUT", "DELETE"})
FRESH_CONNECTION_ATTEMPTS = 3  # connections that close before the request is written, in a row, before giving up
_FORBIDDEN_IN_HEADERS = (b"\r", b"\n", b"\0")
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, a u64 at this offset since Linux 4.1
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCP_INFO_BYTES_ACKED = 120
_TCP_INFO_BYTES = 192
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")  # RFC 9110

Body = bytes | mmap.mmap
_B = TypeVar("_B")  # a caller's body buffer (``Response.read(into=...)``)


class BodyBuffers:
    """Recycled anonymous maps for big bodies. Fresh memory costs ~1 ms of page faults per MB on a VM, and a
    gateway receives a 20 MB answer per big MoE turn; a buffer given back is reused (the smallest that fits, else
    the largest, resized: mremap keeps the pages both sizes share)."""

    def __init__(self, keep_bytes: int = SPARE_BUFFER_BYTES) -> None:
        self._keep_bytes = keep_bytes
        self._spare: list[mmap.mmap] = []
        self._spare_bytes = 0

    def take(self, size: int) -> mmap.mmap:
        """A buffer of exactly ``size`` bytes (contents undefined)."""
        if self._spare:
            fits = [buf for buf in self._spare if len(buf) >= size]
            buf = min(fits, key=len) if fits else max(self._spare, key=len)
            self._spare.remove(buf)
            self._spare_bytes -= len(buf)
            if len(buf) != size:
                buf.resize(size)
            return buf
        # private: a shared anonymous map cannot be resized; not a bytearray, which zero-fills (touches) every page
        return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE) if size else mmap.mmap(-1, 1)

    def give_back(self, body: object) -> None:
        """Keep ``body`` for reuse if it is a buffer of ours that nothing views any more; anything else is ignored."""
        if not isinstance(body, mmap.mmap) or self._spare_bytes + len(body) > self._keep_bytes:
            return
        try:
            body.resize(len(body))  # fails while a memoryview of it is alive
        except (BufferError, ValueError):
            return
        self._spare.append(body)
        self._spare_bytes += len(body)


class ConnectionPool:
    """Connections to ``base_url`` (http or https), at most ``max_connections`` at once, one request each."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        connect_timeout_s: float,
        pool_timeout_s: float,
        keepalive_expiry_s: float = DEFAULT_KEEPALIVE_EXPIRY_S,
        buffers: BodyBuffers | None = None,
        user_agent: bytes = b"slime-wire",
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base_url = base_url
        self.connect_timeout_s = connect_timeout_s
        self.pool_timeout_s = pool_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self.buffers = buffers or BodyBuffers()
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host = parts.hostname
        self._port = parts.port or (443 if self._ssl else 80)
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = self._port == (443 if self._ssl else 80)
        self._fixed_head = b"Host: %s\r\nUser-Agent: %s\r\nAccept-Encoding: identity\r\n" % (
            (host if default_port else f"{host}:{self._port}").encode(),
            user_agent,
        )
        self._prefix = parts.path.rstrip("/").encode()
        self._max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the running loop
        self._idle: list[_Connection] = []
        self._receive_buffer = bytearray(RECEIVE_BUFFER_BYTES)
        self.connections_opened = 0  # for tests and metrics: how often a fresh connection was needed

    async def request(
        self,
        method: str,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        *,
        timeout: float,
    ) -> Response:
        """Send one request; returns once the answer's status and headers are in (the body is read from the
        ``Response``, which must be closed). Raises a ``slime_wire.errors.TransportError``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        request = self._serialize(method, target, headers, body)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        try:
            if self._slots.locked():  # no slot free (or others wait for one): wait, within the pool timeout
                async with asyncio.timeout(min(self.pool_timeout_s, timeout)):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()  # a free slot, taken at once: no timer to set and cancel
        except TimeoutError:
            raise PoolTimeout(
                f"no free connection to {self.base_url} within {min(self.pool_timeout_s, timeout):g} s "
                f"({self._max_connections} in use)"
            ) from None
        try:
            return await self._send(method, request, deadline)
        except BaseException:
            self._slots.release()
            raise

    async def aclose(self) -> None:
        """Close the idle connections (a response still being read closes its own)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    # ---- sending ---------------------------------------------------------------------------------------------------
    async def _send(self, method: str, request: bytes, deadline: float) -> Response:
        resent = False
        for _ in range(FRESH_CONNECTION_ATTEMPTS):
            connection = self._reusable_connection() or await self._connect(deadline)
            exchange = connection.start(request, deadline)
            if exchange is None:  # closed under us before a byte went out: on to another connection
                connection.close()
                continue
            try:
                await exchange.head_received()
            except ConnectionLost:
                connection.close()
                if resent or not _may_resend(method, connection, exchange):
                    raise
                resent = True
                continue
            except BaseException:
                connection.close()
                raise
            return Response(self, connection, exchange, method)
        raise ConnectFailed(f"{self.base_url} closed {FRESH_CONNECTION_ATTEMPTS} new connections before a request")

    def _reusable_connection(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recent: the least likely to have been closed by the server
            if now - connection.idle_since < self.keepalive_expiry_s and connection.quiet():
                return connection
            connection.close()
        return None

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = min(self.connect_timeout_s, max(0.0, deadline - loop.time()))
        try:
            async with asyncio.timeout(timeout):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(loop, self._receive_buffer), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError:
            raise ConnectFailed(f"could not connect to {self.base_url} within {timeout:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"could not connect to {self.base_url}: {exc}") from exc
        self.connections_opened += 1
        return cast(_Connection, protocol)

    def _serialize(self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The request's bytes (serializing is not parsing: what can go wrong is a header that smuggles a line
        break, which is refused here)."""
        if method == "HEAD":
            # llhttp cannot be told that an answer to HEAD has no body (httptools gives no way to skip it); send GET
            raise ValueError("HEAD is not supported: send GET and drop the body")
        if not method or not _TOKEN_CHARS.issuperset(method):
            # a method is a token: one with a space or a line break would smuggle a request line of its own
            raise ValueError(f"refusing a method that is not a token: {method!r}")
        for name, value in headers:
            if any(bad in name or bad in value for bad in _FORBIDDEN_IN_HEADERS) or b":" in name or not name:
                raise ValueError(f"refusing a header that is not a single line: {name!r}")
        if any(bad in target for bad in (*_FORBIDDEN_IN_HEADERS, b" ")) or not target.startswith(b"/"):
            raise ValueError(f"refusing a request target that is not a single path: {target!r}")
        parts = [method.encode("ascii"), b" ", self._prefix, target, b" HTTP/1.1\r\n", self._fixed_head]
        if body or method != "GET":
            parts.append(b"Content-Length: %d\r\n" % len(body))
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"\r\n", body)
        return b"".join(parts)

    # ---- giving back -----------------------------------------------------------------------------------------------
    def _finish(self, connection: _Connection, *, reuse: bool) -> None:
        if reuse and connection.reusable():
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        assert self._slots is not None
        self._slots.release()


class Response:
    """An answer whose status and headers are in. Read the body once (``read`` or ``iter_raw``), then ``aclose``
    (also after an error): the connection goes back to the pool only when the answer was read to its end."""

    __slots__ = ("_connection", "_exchange", "_pool", "_released", "headers", "http_version", "method", "status")

    def __init__(self, pool: ConnectionPool, connection: _Connection, exchange: _Exchange, method: str) -> None:
        self._pool = pool
        self._connection = connection
        self._exchange = exchange
        self._released = False
        self.method = method
        self.status = exchange.status
        self.headers = exchange.headers  # (lower-case name, value), in the order received
        self.http_version = exchange.http_version

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (``name`` in lower case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def content_type(self) -> str | None:
        value = self.header(b"content-type")
        return None if value is None else value.decode("latin-1")

    @overload
    async def read(self) -> Body: ...

    @overload
    async def read(self, into: Callable[[int], _B]) -> _B: ...

    async def read(self, into: Callable[[int], Any] | None = None) -> Any:
        """The whole body: bytes, or for a big one a pooled buffer (``BodyBuffers``; give it back once done).

        ``into``: an allocator for the body, called once with its length in bytes (as soon as the head gives a
        Content-Length; for a chunked body or one delimited by the end of the connection, once all of it is in).
        It returns a writable, C-contiguous buffer of exactly that many bytes (the buffer protocol: ``bytearray``,
        ``numpy.empty(n, numpy.uint8)``, an ``mmap``, ...); the body is received straight into it (llhttp parses it
        there) and ``read`` returns that object, which belongs to the caller: nothing of it is pooled. For a caller
        that keeps views of the body (tensors over a sample) in memory of its own choosing, with no extra copy.
        """
        exchange = self._exchange
        length = exchange.content_length
        try:
            if into is not None:
                if length is not None:
                    buffer = _allocate(into, length)
                    exchange.collect_into(_writable_bytes(buffer, length), owner=buffer)
                    return await self._read_body(exchange)
                pieces = await self._read_body(exchange, joined=False)
                size = sum(map(len, pieces))
                buffer = _allocate(into, size)
                target, at = _writable_bytes(buffer, size), 0
                for piece in pieces:  # each piece copied once, straight to its place (no joined copy in between)
                    target[at : at + len(piece)] = piece
                    at += len(piece)
                return buffer
            if length is not None and length >= BIG_BODY_BYTES:
                exchange.collect_into(self._take_buffer(length))
            return await self._read_body(exchange)
        except BaseException:
            await self.aclose()
            raise

    async def _read_body(self, exchange: _Exchange, *, joined: bool = True) -> Any:
        body = await exchange.body(joined=joined)
        self._release(reuse=True)
        return body

    def _take_buffer(self, length: int) -> mmap.mmap:
        # A Content-Length no map can hold (llhttp accepts up to 2**64 - 1) made ``read`` raise OSError or
        # OverflowError, which is no TransportError, before the try that gives the slot back.
        try:
            return self._pool.buffers.take(length)
        except (OSError, OverflowError, MemoryError) as exc:
            raise ProtocolViolation(f"a Content-Length of {length} bytes cannot be buffered ({exc})") from None

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed), in pieces of at most ``RECEIVE_BUFFER_BYTES``."""
        try:
            while (piece := await self._exchange.next_piece()) is not None:
                yield piece
        except BaseException:
            await self.aclose()
            raise
        self._release(reuse=True)

    async def aclose(self) -> None:
        self._release(reuse=False)

    def _release(self, *, reuse: bool) -> None:
        if self._released:
            return
        self._released = True
        self._exchange.stop_clock()
        self._pool._finish(self._connection, reuse=reuse and self._exchange.complete)


class _Exchange:
    """One request's answer as it arrives: head, body pieces (or a body buffer), completion or failure."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connection: _Connection, deadline: float) -> None:
        self._loop = loop
        self._connection = connection
        self.status = 0
        self.http_version = ""
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.ends_at_close = False
        self.head_complete = False
        self.complete = False
        self.keep_alive = False
        self.bytes_received = 0
        self.error: TransportError | None = None
        self._pieces: deque[bytes] = deque()
        self._queued = 0
        self._sink: mmap.mmap | memoryview | None = None
        self._sink_owner: object = None
        self._sink_filled = 0
        self._waiter: asyncio.Future[None] | None = None
        self._timer = loop.call_at(deadline, self._expire)

    # -- the reading side
    async def head_received(self) -> None:
        while not self.head_complete:
            await self._wait()

    def collect_into(self, sink: mmap.mmap | memoryview, owner: object = None) -> None:
        """Receive the rest of the body straight into ``sink`` (its size is the Content-Length); ``body()`` then
        returns ``owner`` (a caller's buffer that ``sink``, a byte view, writes into), or ``sink`` itself."""
        self._sink = sink
        self._sink_owner = owner
        while self._pieces:
            self._copy_to_sink(self._pieces.popleft())
        self._queued = 0
        self._connection.resume()
        self._connection.wake_at(self.sink_missing())

    async def body(self, *, joined: bool = True) -> object:
        """The body: the sink's owner, the sink, or the pieces joined (bytes; with ``joined=False`` the pieces)."""
        while not self.complete:
            await self._wait()
        sink = self._sink
        if sink is not None:
            if self._sink_filled != len(sink):
                raise ProtocolViolation("the body does not match its Content-Length")
            owner = self._sink_owner
            if owner is None:
                return sink
            self._sink, self._sink_owner = None, None
            if isinstance(sink, memoryview):
                with contextlib.suppress(BufferError):
                    sink.release()  # the caller's buffer is free to be resized (a bytearray), no export left
            return owner
        pieces, self._pieces = self._pieces, deque()
        if not joined:
            return pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def next_piece(self) -> bytes | None:
        while not self._pieces:
            if self.complete:
                return None
            await self._wait()
        piece = self._pieces.popleft()
        self._queued -= len(piece)
        if self._queued < MAX_QUEUED_BYTES // 2:
            self._connection.resume()
        return piece

    def stop_clock(self) -> None:
        self._timer.cancel()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    # -- the receiving side (called from the connection's protocol callbacks)
    def on_head(self, status: int, http_version: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.http_version, self.headers = status, http_version, headers
        self.head_complete = True
        length = _first(headers, b"content-length")
        self.content_length = None if length is None else int(length)  # digits only: llhttp checked them
        self.ends_at_close = _ends_at_close(headers, status)
        self._wake()

    def on_body(self, piece: bytes) -> None:
        if self._sink is not None:
            self._copy_to_sink(piece)
            return
        self._pieces.append(piece)
        self._queued += len(piece)
        if self._queued > MAX_QUEUED_BYTES:
            self._connection.pause()
        self._wake()

    def on_complete(self) -> None:
        self.complete = True
        self._timer.cancel()
        self._wake()

    def fail(self, error: TransportError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._timer.cancel()
        self._wake()

    def sink_space(self, most: int) -> memoryview | None:
        """Where the next read may go straight into the body's buffer (never past its end), or None."""
        sink = self._sink
        if sink is None or self.complete or self.error is not None:
            return None
        free = len(sink) - self._sink_filled
        return memoryview(sink)[self._sink_filled : self._sink_filled + min(free, most)] if free > 0 else None

    def received_into_sink(self, nbytes: int) -> bool:
        """``nbytes`` of the body arrived at the sink's free end (never past it: ``sink_space``); True once the
        body is complete."""
        assert self._sink is not None
        self._sink_filled += nbytes
        return self._sink_filled == len(self._sink)

    def sink_missing(self) -> int:
        """Bytes of the body its buffer still waits for."""
        return 0 if self._sink is None else len(self._sink) - self._sink_filled

    def _copy_to_sink(self, piece: bytes) -> None:
        sink = self._sink
        assert sink is not None
        end = self._sink_filled + len(piece)
        if end > len(sink):
            self.fail(ProtocolViolation("the body is longer than its Content-Length"))
            self._connection.abort()
            return
        sink[self._sink_filled : end] = piece
        self._sink_filled = end

    def _expire(self) -> None:
        what = "the rest of the answer" if self.head_complete else "an answer"
        self.fail(ResponseTimeout(f"no complete answer within the deadline (waiting for {what})"))
        self._connection.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.BufferedProtocol):
    """One connection: the event loop receives into the pool's buffer and llhttp parses it in the same callback (or,
    for a Content-Length body read whole, into the body's buffer, counted)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, receive_buffer: bytearray) -> None:
        self._loop = loop
        self._receive_buffer = receive_buffer
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._exchange: _Exchange | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # bytes received while the head is incomplete (catches a head still arriving)
        self._head_size = 0  # bytes of the status line and headers parsed (catches a head that came in one read)
        self._closed = False
        self._into_sink = False  # where the last get_buffer pointed
        self._paused = False
        self._poisoned = False  # bytes arrived that no request asked for
        self._bytes_written = 0
        self._acked_at_start = 0  # the peer's acknowledged byte count once connected (the SYN counts as one)
        self._low_water = 1  # the socket's SO_RCVLOWAT (see ``wake_at``)
        self.reused = False
        self.request_undelivered = False  # the server closed it with bytes of the request never acknowledged
        self.idle_since = time.monotonic()

    # -- used by the pool
    def start(self, request: bytes, deadline: float) -> _Exchange | None:
        """Write ``request``; None if the connection is already closing (nothing was sent)."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._closed:
            return None
        self.reused = self._exchange is not None
        self._exchange = exchange = _Exchange(self._loop, self, deadline)
        self._headers, self._head_bytes, self._head_size = [], 0, 0
        transport.write(request)
        self._bytes_written += len(request)
        return exchange

    def reusable(self) -> bool:
        exchange = self._exchange
        return (
            not self._closed
            and not self._poisoned
            and exchange is not None
            and exchange.complete
            and exchange.keep_alive
            and self._transport is not None
            and not self._transport.is_closing()
        )

    def quiet(self) -> bool:
        """Nothing waits in the socket: no end-of-stream, no unsolicited byte the event loop has not read yet."""
        if not self.reusable():
            return False
        assert self._transport is not None
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return not poller.poll(0)

    def wake_at(self, nbytes: int) -> None:
        """Have the event loop wake this connection only once ``nbytes`` have arrived (or the peer closed, failed or
        filled the receive window): the kernel's SO_RCVLOWAT, capped at ``SINK_READ_BYTES``. For a body received
        straight into its buffer: the loop otherwise wakes for whatever few hundred KB lie in the socket, and each
        wake (a loop turn, a recv, the callbacks) costs more than the bytes it copies. Plain TCP only (over TLS the
        socket holds encrypted records, not the body's bytes); the kernel caps it by the receive buffer itself."""
        nbytes = max(1, min(nbytes, SINK_READ_BYTES))
        if nbytes == self._low_water or self._transport is None or self._transport.get_extra_info("sslcontext"):
            return
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except (OSError, AttributeError):  # a transport whose socket refuses options
            return
        self._low_water = nbytes

    def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.abort()

    def pause(self) -> None:
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self._transport is not None and not self._transport.is_closing():
            self._paused = False
            self._transport.resume_reading()

    # -- asyncio protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self._acked_at_start = self._peer_acked_bytes() or 0

    def get_buffer(self, sizehint: int) -> memoryview:
        # A big body being read whole is received straight into its buffer (llhttp then reads it there); anything
        # else goes through the pool's receive buffer, which llhttp empties in buffer_updated.
        exchange = self._exchange
        direct = None if exchange is None else exchange.sink_space(SINK_READ_BYTES)
        self._into_sink = direct is not None
        if direct is not None:
            return direct
        if exchange is not None and not exchange.head_complete:
            return memoryview(self._receive_buffer)[:HEAD_READ_BYTES]
        return memoryview(self._receive_buffer)

    def buffer_updated(self, nbytes: int) -> None:
        exchange = self._exchange
        if exchange is None or exchange.complete or exchange.error is not None:
            self._poisoned = True  # an answer nobody asked for (or after one that failed): never reuse
            self.abort()
            return
        exchange.bytes_received += nbytes
        if self._into_sink:
            if exchange.received_into_sink(nbytes):
                self._counted_body_complete(exchange)
            else:
                self.wake_at(exchange.sink_missing())
            return
        if not exchange.head_complete:
            self._head_bytes += nbytes
        try:
            self._parser.feed_data(memoryview(self._receive_buffer)[:nbytes])
        except httptools.HttpParserUpgrade:
            self._violation(exchange, "the upstream switched protocols")
        except httptools.HttpParserError as exc:
            if exchange.complete:
                self._poisoned = True  # garbage after a complete answer: the answer stands, the connection goes
                self.abort()
            else:
                self._violation(exchange, f"malformed HTTP answer: {exc}")
        if not exchange.head_complete and self._head_bytes > MAX_HEAD_BYTES and exchange.error is None:
            self._violation(exchange, f"the answer's status line and headers exceed {MAX_HEAD_BYTES} bytes")

    def _counted_body_complete(self, exchange: _Exchange) -> None:
        """The last byte of a Content-Length body arrived in its buffer. llhttp read the head (and the first bytes
        of the body) and was left in the middle of the body: within a Content-Length it only counts bytes, and
        handing them to it would copy each into a bytes object for ``on_body`` (~0.13 ms per 4 MB). Its verdict on
        keep-alive stands from the head; a fresh parser reads the connection's next answer."""
        exchange.keep_alive = self._parser.should_keep_alive()
        self._parser = httptools.HttpResponseParser(self)
        self.wake_at(1)  # the next answer's head: every byte counts again
        exchange.on_complete()

    def eof_received(self) -> bool:
        exchange = self._exchange
        if exchange is not None and not exchange.complete and not exchange.bytes_received:
            # The server's FIN acknowledges every byte its TCP stack had received when it closed: bytes of the
            # request still unacknowledged had not arrived, so no application read the request. (A reset proves
            # nothing of the kind: data read just before it may be unacknowledged, its ACK delayed and then lost.)
            acked = self._peer_acked_bytes()
            self.request_undelivered = acked is not None and acked < self._acked_at_start + self._bytes_written
        return False  # close the transport; connection_lost settles the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        exchange = self._exchange
        if exchange is None or exchange.complete or exchange.error is not None:
            return
        if exchange.head_complete and exchange.ends_at_close and exc is None:
            exchange.on_complete()  # a body delimited by the end of the connection (RFC 9112 section 6.3)
            return
        if not exchange.bytes_received:
            error: ConnectionLost = NoAnswer("the upstream closed the connection without answering")
        else:
            error = ConnectionLost("the connection ended in the middle of the answer")
        if exc:
            error.args = (f"{error.args[0]} ({exc})",)
        exchange.fail(error)

    def _peer_acked_bytes(self) -> int | None:
        """How many bytes the peer's TCP stack has acknowledged (Linux ``TCP_INFO``), None where unknown."""
        sock = None if self._transport is None else self._transport.get_extra_info("socket")
        if sock is None or _TCP_INFO is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None
        if len(info) < _TCP_INFO_BYTES_ACKED + 8:
            return None  # a kernel older than 4.1
        return int.from_bytes(info[_TCP_INFO_BYTES_ACKED : _TCP_INFO_BYTES_ACKED + 8], sys.byteorder)

    # -- llhttp callbacks
    def on_message_begin(self) -> None:
        exchange = self._exchange
        if exchange is None or exchange.complete:
            self._poisoned = True  # a second answer to one request

    def on_status(self, reason: bytes) -> None:
        self._head_size += len(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        exchange = self._exchange
        if exchange is None or exchange.complete:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._headers = []  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self._head_bytes = self._head_size = 0
            return
        if status == 101:
            # httptools raises HttpParserUpgrade only after on_message_complete, when the exchange is complete and
            # failing it does nothing: the caller got a 101 with an empty body. No request here asks to switch.
            self._violation(exchange, "the upstream switched protocols, which no request asks for")
            return
        if self._head_size > MAX_HEAD_BYTES:
            # counting received bytes alone (in buffer_updated) missed a head that completed within one read of up
            # to RECEIVE_BUFFER_BYTES: a 200 KB head arriving at once was accepted
            self._violation(exchange, f"the answer's status line and headers exceed {MAX_HEAD_BYTES} bytes")
            return
        exchange.on_head(status, self._parser.get_http_version(), self._headers)

    def on_body(self, body: bytes) -> None:
        exchange = self._exchange
        if exchange is not None and not exchange.complete:
            exchange.on_body(body)

    def on_message_complete(self) -> None:
        exchange = self._exchange
        if exchange is None or exchange.complete or not exchange.head_complete:
            return  # after an interim answer, or a second answer (poisoned in on_message_begin)
        exchange.keep_alive = self._parser.should_keep_alive()  # llhttp resets its flags right after this callback
        exchange.on_complete()

    def _violation(self, exchange: _Exchange, message: str) -> None:
        exchange.fail(ProtocolViolation(message))
        self.abort()


def _allocate(into: Callable[[int], Any], length: int) -> Any:
    """A caller's buffer for a body of ``length`` bytes. A Content-Length no allocator can satisfy is the server's
    fault, raised as a ``ProtocolViolation`` (a TransportError) like the pooled buffer's."""
    try:
        return into(length)
    except (OSError, OverflowError, MemoryError, ValueError) as exc:
        raise ProtocolViolation(f"a Content-Length of {length} bytes cannot be buffered ({exc})") from None


def _writable_bytes(buffer: Any, length: int) -> memoryview:
    """``buffer`` as a flat writable byte view of exactly ``length`` bytes (what ``read(into=...)`` promises)."""
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        raise TypeError(f"read(into=...) needs a writable, C-contiguous buffer, got {type(buffer).__name__}")
    view = view.cast("B")
    if len(view) != length:
        raise ValueError(f"read(into=...): asked for {length} bytes, the allocator gave {len(view)}")
    return view


def _may_resend(method: str, connection: _Connection, exchange: _Exchange) -> bool:
    """Whether a request whose connection ended before any byte of an answer is sent once more.

    Only when it cannot have run, or running it twice does no harm (RFC 9112 section 9.3.1): the server's FIN did not
    acknowledge all of its bytes (the server had closed the connection before the request arrived, so no application
    can have read it: the race of reusing a connection the server is closing at that moment), or the
    method is idempotent and the connection was a reused one. A POST (a ``/generate``) the server received may
    have run, so it is never sent again."""
    if exchange.bytes_received:
        return False
    return connection.request_undelivered or (connection.reused and method in IDEMPOTENT_METHODS)


def _first(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _ends_at_close(headers: list[tuple[bytes, bytes]], status: int) -> bool:
    """Whether the body runs until the server closes the connection (RFC 9112 section 6.3): no Content-Length and
    no chunked final transfer coding, on an answer that has a body. llhttp frames such a body the same way, but
    only ``llhttp_finish`` (which httptools does not expose) tells it that the end of the connection came."""
    if status in (204, 304) or 100 <= status < 200:
        return False
    if _first(headers, b"content-length") is not None:
        return False
    codings = b",".join(value for key, value in headers if key == b"transfer-encoding")
    return not codings or codings.rsplit(b",", 1)[-1].strip().lower() != b"chunked"
