"""The pooled HTTP clients to SGLang (router or server), and their error translation boundary.

The SGLang passthrough and the unary session turns use ``Http11Pool``, a minimal keep-alive HTTP/1.1 client on an
asyncio buffered protocol: httpx costs ~1 ms of CPU per call (anyio, httpcore, h11 and, without sniffio installed,
a failing ``import sniffio`` per request), several times what the upstream itself spends on a small ``/generate``,
and ~4 ms per MB of a big answer. Streamed turns, aborts and the rest use the ``httpx.AsyncClient``.
"""

from __future__ import annotations

import asyncio
import mmap
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

import httpx
import orjson

from gateway.codec import AnswerBytes
from gateway.errors import (
    GatewayError,
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# Request headers a passthrough forwards; everything else (host, content-length, ...) is the client's own.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "authorization")
_ROUTING_KEY_BYTES = ROUTING_KEY_HEADER.encode()
ABORT_TIMEOUT_S = 2.0
T = TypeVar("T")


class Upstream:
    """Owns the ``httpx.AsyncClient``; created and closed by the app lifespan."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.base_url = base_url
        self.metrics = metrics
        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # Bodies are proxied as-is; let the upstream's Content-Encoding never be touched by us.
            headers={"accept-encoding": "identity"},
        )
        self.pool = Http11Pool(
            base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, max_connections=max_connections
        )

    async def aclose(self) -> None:
        self.pool.close()
        await self.client.aclose()

    def recycle(self, answer: AnswerBytes) -> None:
        """Give back the bytes of a ``post_generate`` answer that nothing uses any more (see ``Http11Pool``)."""
        self.pool.recycle(answer)

    async def forward(
        self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> RawResponse:
        """A passthrough call: the upstream's answer with its body still to read (the caller closes it)."""
        return await self.pool.request(method, target, headers, body)

    async def post_generate(self, body: bytes, *, routing_key: str | None) -> AnswerBytes:
        """A non-streamed ``/generate`` for a session turn: the raw answer bytes, or a ``GatewayError``.

        Through the lean pool too: an answer can be tens of MB, which httpx receives at ~4 ms of event-loop CPU
        per MB (64 KB reads, each through anyio, httpcore and h11); the pool receives it straight into one buffer.
        Give the bytes back with ``recycle`` once decoded."""
        headers = [(b"content-type", b"application/json")]
        if routing_key:
            headers.append((_ROUTING_KEY_BYTES, routing_key.encode()))
        started = time.perf_counter()
        try:
            response = await self.pool.request("POST", b"/generate", headers, body)
            try:
                content = await response.read()
            finally:
                await response.aclose()
        finally:
            self._observe("generate", started)
        if response.status >= 400:
            raise status_error(response.status, content if isinstance(content, bytes) else bytes(content))
        return content

    async def open_generate_stream(self, body: bytes, *, routing_key: str | None) -> httpx.Response:
        """A streamed ``/generate``: the open response (status checked), which the caller must close."""
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if routing_key:
            headers[ROUTING_KEY_HEADER] = routing_key
        started = time.perf_counter()
        try:
            response = await self.send(self.client.build_request("POST", "/generate", content=body, headers=headers))
        finally:
            self._observe("generate_stream", started)
        if response.status_code >= 400:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            raise status_error(response.status_code, content)
        return response

    async def abort_request(self, rid: str) -> bool:
        """Best effort: SGLang workers abort a rid; routers have no such route (closing the stream aborts)."""
        try:
            response = await self.client.post("/abort_request", json={"rid": rid}, timeout=ABORT_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code < 400

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send a prepared request with the body left streaming (the caller closes the response)."""
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise translate_transport_error(exc, self.base_url) from exc

    def _observe(self, call: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.upstream_seconds.labels(call).observe(time.perf_counter() - started)


def translate_transport_error(exc: httpx.HTTPError, base_url: str) -> GatewayError:
    """httpx errors -> gateway errors. Only failures before the request left us are 503 (safe to retry)."""
    name = type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamUnavailable(f"upstream {base_url} is unreachable: {name}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"upstream {base_url} did not answer in time ({name})")
    if isinstance(exc, httpx.TransportError):
        return UpstreamConnectionLost(f"connection to upstream {base_url} lost after the request was sent: {name}")
    return UpstreamError(f"upstream request failed: {name}: {exc}")


# ``error.code`` values of the SGLang routers (smg, sglang-router) that say more than their HTTP status: smg answers
# 500 call_upstream_connection_failed when no worker accepts the connection (before its health checks notice).
ROUTER_UNAVAILABLE_CODES = frozenset({"no_available_workers", "call_upstream_connection_failed"})
ROUTER_TIMEOUT_CODES = frozenset({"call_upstream_timeout"})


def status_error(status: int, body: bytes) -> GatewayError:
    """An upstream error status -> the gateway error the caller sees (openai-python's ``_make_status_error``)."""
    message = upstream_error_message(body)
    code = router_error_code(body)
    detail = f"upstream answered {status}{f' ({code})' if code else ''}: {message}"
    if status in (429, 503) or code in ROUTER_UNAVAILABLE_CODES or "No available workers" in message:
        return UpstreamUnavailable(detail, upstream_status=status)
    if 400 <= status < 500:
        return UpstreamRejected(detail, upstream_status=status)
    if status == 504 or code in ROUTER_TIMEOUT_CODES:
        return UpstreamTimeout(detail, upstream_status=status)
    return UpstreamError(detail, upstream_status=status)


def router_error_code(body: bytes) -> str | None:
    """The machine-readable ``{"error": {"code": str}}`` of a router error body, if there is one."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code[:100] if isinstance(code, str) and code else None


def upstream_error_message(body: bytes) -> str:
    """Best-effort message from SGLang/router error bodies (``{"error": {"message"}}``, ``{"message"}``, text)."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
        if parsed.get("message"):
            return str(parsed["message"])[:500]
    return body[:500].decode("utf-8", "replace")


# ---- the lean HTTP/1.1 client -----------------------------------------------------------------------------------
# Idle connections older than this are not reused: below uvicorn's default 5 s keep-alive, so that a reused
# connection is not being closed by the server at that very moment (httpx's default expiry is 5 s too).
KEEPALIVE_EXPIRY_S = 4.0
READ_CHUNK_BYTES = 1 << 16  # the most a streamed body yields at once
MAX_HEAD_BYTES = 1 << 16  # an answer head (status line + headers) longer than this is refused
RECEIVE_BUFFER_BYTES = 1 << 18  # a connection's receive buffer, reused (and the most one read hands over)
MIN_FREE_BYTES = 1 << 14  # reading pauses while the buffer has less room than this
SPARE_BUFFER_BYTES = 1 << 28  # big-body buffers kept for reuse (see ``Http11Pool.recycle``), in all
NO_BODY_STATUSES = frozenset({204, 304})


class Http11Pool:
    """Keep-alive HTTP/1.1 connections to one origin, one request at a time per connection.

    Bodies framed by Content-Length, chunked transfer encoding or the end of the connection. Errors are
    translated here into the gateway's own, as ``translate_transport_error`` does for httpx: a failure to
    connect is ``UpstreamUnavailable`` (nothing was sent), no answer within ``timeout_s`` ``UpstreamTimeout``,
    and a connection that breaks after the request went out ``UpstreamConnectionLost``.
    """

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float, max_connections: int) -> None:
        parts = urlsplit(base_url)
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._ssl else 80)
        self._prefix = parts.path.rstrip("/").encode()
        default_port = self._port == (443 if self._ssl else 80)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = (host if default_port else f"{host}:{self._port}").encode()
        self._max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the running loop
        self._idle: list[_Connection] = []
        self._spare: list[mmap.mmap] = []  # big-body buffers given back by ``recycle``
        self._spare_bytes = 0

    async def request(
        self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> RawResponse:
        """Send one request; the answer's status and headers are read, its body is left to the caller."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        await self._slots.acquire()
        try:
            connection = await self._connection()
        except BaseException:
            self._slots.release()
            raise
        try:
            connection.write(self._head(method, target, headers, len(body)) + body)
            status, response_headers, keep_alive = await self._timed(connection, self._read_head(connection))
        except BaseException as exc:
            self._finish(connection, reuse=False)
            if isinstance(exc, OSError):  # the write failed
                raise self._lost(exc) from exc
            raise
        return RawResponse(self, connection, method, status, response_headers, keep_alive)

    def body_buffer(self, size: int) -> mmap.mmap:
        """A buffer of exactly ``size`` bytes for a big body: a recycled one when there is one (the smallest that
        holds ``size``, else the largest, resized: mremap keeps the pages both sizes share), else a new one."""
        if self._spare:
            fits = [buf for buf in self._spare if len(buf) >= size]
            buf = min(fits, key=len) if fits else max(self._spare, key=len)
            self._spare.remove(buf)
            self._spare_bytes -= len(buf)
            if len(buf) != size:
                buf.resize(size)
            return buf
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # private: a shared anonymous map cannot grow

    def recycle(self, body: AnswerBytes) -> None:
        """Take back a big body's buffer (from ``RawResponse.read``) once its reader is done with it: fresh memory
        costs ~1 ms of page faults per MB on a VM, and a 20 MB answer arrives for every turn. Kept up to
        ``SPARE_BUFFER_BYTES`` in all; a buffer that still has a view alive somewhere is not taken."""
        if not isinstance(body, mmap.mmap) or self._spare_bytes + len(body) > SPARE_BUFFER_BYTES:
            return
        try:
            body.resize(len(body))  # fails while a memoryview of it is alive
        except BufferError:
            return
        self._spare.append(body)
        self._spare_bytes += len(body)

    def close(self) -> None:
        """Close the idle connections (responses still being read close their own)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    # -- connections
    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable(now):
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self.body_buffer), self._host, self._port, ssl=self._ssl
                ),
                self.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            name = "ConnectTimeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            raise UpstreamUnavailable(f"upstream {self.base_url} is unreachable: {name}: {exc}") from exc
        return connection

    def _finish(self, connection: _Connection, *, reuse: bool) -> None:
        """The response is done with its connection: back to the pool, or closed."""
        if reuse and connection.reusable(time.monotonic()):
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        assert self._slots is not None
        self._slots.release()

    # -- the wire
    def _head(self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], length: int) -> bytes:
        lines = [method.encode(), b" ", self._prefix, target, b" HTTP/1.1\r\nHost: ", self._host_header, b"\r\n"]
        lines.append(b"Accept-Encoding: identity\r\nUser-Agent: slime-gateway\r\n")
        if length or method not in ("GET", "HEAD"):
            lines.append(b"Content-Length: %d\r\n" % length)
        if not any(name == b"accept" for name, _ in headers):
            lines.append(b"Accept: */*\r\n")
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _read_head(self, connection: _Connection) -> tuple[int, list[tuple[bytes, bytes]], bool]:
        while True:
            head = await connection.read_until(b"\r\n\r\n", MAX_HEAD_BYTES)
            status_line, _, rest = head.partition(b"\r\n")
            version, _, tail = status_line.partition(b" ")
            if not version.startswith(b"HTTP/1."):
                raise UpstreamConnectionLost(f"upstream {self.base_url} answered something that is not HTTP/1.x")
            try:
                status = int(tail[:3])
            except ValueError:
                raise UpstreamConnectionLost(f"upstream {self.base_url} sent a malformed status line") from None
            if 100 <= status < 200:
                continue  # an interim answer: the real one follows
            headers = []
            for line in rest[:-4].split(b"\r\n"):
                if line:
                    name, _, value = line.partition(b":")
                    headers.append((name.strip().lower(), value.strip()))
            connection_header = next((v.lower() for n, v in headers if n == b"connection"), b"")
            persistent = version != b"HTTP/1.0" or b"keep-alive" in connection_header
            return status, headers, persistent and b"close" not in connection_header

    async def _timed(self, connection: _Connection, step: Awaitable[T]) -> T:
        """Await one read step; past ``timeout_s`` the connection is aborted and the step fails as a timeout."""
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            connection.abort()

        timer = asyncio.get_running_loop().call_later(self.timeout_s, expire)
        try:
            return await step
        except (OSError, EOFError, ValueError) as exc:
            if expired:
                raise UpstreamTimeout(f"upstream {self.base_url} did not answer in time (ReadTimeout)") from exc
            raise self._lost(exc) from exc
        finally:
            timer.cancel()

    def _lost(self, exc: BaseException) -> UpstreamConnectionLost:
        return UpstreamConnectionLost(
            f"connection to upstream {self.base_url} lost after the request was sent: {type(exc).__name__}"
        )


class _Connection(asyncio.BufferedProtocol):
    """One upstream connection: a buffered protocol, the event loop receives into our memory.

    ``StreamReader`` copies every byte three times on the event loop (~2 ms per MB here). Here heads and small or
    streamed bodies go through one reused buffer, and a big Content-Length body is received straight into its
    final buffer (``read_body``), at most ``RECEIVE_BUFFER_BYTES`` per event-loop callback so that a 20 MB answer
    never stalls the loop for the milliseconds one big copy would take. Reading pauses while the buffer is full.
    Reads raise ``EOFError`` once the connection has ended.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, new_buffer: Callable[[int], mmap.mmap]) -> None:
        self._loop = loop
        self._new_buffer = new_buffer
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(RECEIVE_BUFFER_BYTES)  # unconsumed bytes: _buffer[_start:_end]
        self._start = self._end = 0
        self._sink: memoryview | None = None  # while set, a body is received straight into it
        self._sink_filled = 0
        self._into_sink = False  # where the last get_buffer pointed
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._paused = False
        self.idle_since = time.monotonic()

    # -- the protocol side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def get_buffer(self, sizehint: int) -> memoryview:
        sink = self._sink
        self._into_sink = sink is not None and self._sink_filled < len(sink)
        if self._into_sink:
            assert sink is not None
            return sink[self._sink_filled : self._sink_filled + RECEIVE_BUFFER_BYTES]
        if self._start and len(self._buffer) - self._end < MIN_FREE_BYTES:
            self._compact()
        if self._end == len(self._buffer):  # only if reading was not paused in time
            self._buffer.extend(bytes(len(self._buffer)))
        return memoryview(self._buffer)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_sink:
            self._sink_filled += nbytes
            assert self._sink is not None
            if self._sink_filled == len(self._sink):  # the reader waits for the whole body: wake it once
                self._wake()
            return
        self._end += nbytes
        if len(self._buffer) - self._end + self._start < MIN_FREE_BYTES:
            self._pause()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()

    # -- the caller side
    def write(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self._transport.write(data)

    def reusable(self, now: float) -> bool:
        transport = self._transport
        return (
            now - self.idle_since < KEEPALIVE_EXPIRY_S
            and not self._eof
            and self._start == self._end
            and transport is not None
            and not transport.is_closing()
        )

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def read_until(self, delimiter: bytes, limit: int) -> bytes:
        while True:
            found = self._buffer.find(delimiter, self._start, self._end)
            if found != -1:
                return self._take(found + len(delimiter) - self._start)
            if self._end - self._start > limit:
                raise ValueError(f"no {delimiter!r} within {limit} bytes")
            await self._more()

    async def read_some(self, size: int) -> bytes:
        """Up to ``size`` bytes, as soon as there are any; ``b""`` at the end of the connection."""
        while self._start == self._end:
            if self._eof:
                return b""
            await self._more()
        return self._take(min(size, self._end - self._start))

    async def read_body(self, size: int) -> AnswerBytes:
        """Exactly ``size`` bytes: bytes when they have all arrived already (a small answer), else received
        straight into an anonymous mmap from the pool (recycled when the caller gives it back). Not a bytearray:
        ``bytearray(size)`` zero-fills, touching every page of fresh memory in one go (~20 ms for a 20 MB answer
        here, a stall of the event loop); a fresh mmap's pages are faulted in a receive step at a time."""
        if self._end - self._start >= size:
            return self._take(size)
        body = self._new_buffer(size)
        filled = self._end - self._start
        body[:filled] = memoryview(self._buffer)[self._start : self._end]
        self._consumed(filled)
        self._sink, self._sink_filled = memoryview(body), filled
        try:
            while self._sink_filled < size:
                await self._more()
        finally:
            self._sink = None  # releases the export of ``body``
        return body

    def _take(self, size: int) -> bytes:
        data = bytes(self._buffer[self._start : self._start + size])
        self._consumed(size)
        return data

    def _consumed(self, size: int) -> None:
        self._start += size
        if self._start == self._end:
            self._start = self._end = 0
        if self._paused and len(self._buffer) - self._end + self._start >= MIN_FREE_BYTES:
            self._resume()

    def _compact(self) -> None:
        size = self._end - self._start
        self._buffer[:size] = self._buffer[self._start : self._end]
        self._start, self._end = 0, size

    def _pause(self) -> None:
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    async def _more(self) -> None:
        """Wait until more bytes (or the end of the connection) arrive."""
        if self._eof:
            raise EOFError("the upstream closed the connection")
        if self._paused:  # the caller needs more than the full buffer holds (a long head), or a body sink is set
            if self._sink is None:
                if self._start:
                    self._compact()
                else:
                    self._buffer.extend(bytes(len(self._buffer)))
            self._resume()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class RawResponse:
    """An upstream answer from ``Http11Pool``: status and headers read, the body read with ``read`` or
    ``iter_raw`` (once). ``aclose`` must follow (a body not read to its end closes the connection)."""

    __slots__ = ("_chunked", "_connection", "_done", "_keep_alive", "_pool", "_remaining", "headers", "status")

    def __init__(
        self,
        pool: Http11Pool,
        connection: _Connection,
        method: str,
        status: int,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> None:
        self._pool = pool
        self._connection = connection
        self.status = status
        self.headers = headers
        self._done = False
        self._keep_alive = keep_alive
        self._chunked = False
        self._remaining: int | None = None  # None: until the connection ends
        if method == "HEAD" or status in NO_BODY_STATUSES:
            self._remaining = 0
        elif b"chunked" in (self.header(b"transfer-encoding") or b"").lower():
            self._chunked = True
        elif (length := self.header(b"content-length")) is not None:
            self._remaining = int(length)
        else:
            self._keep_alive = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def content_type(self) -> str | None:
        value = self.header(b"content-type")
        return None if value is None else value.decode("latin-1")

    async def read(self) -> AnswerBytes:
        """The whole body (bytes, or an mmap for a big one: see ``_Connection.read_body``)."""
        if self._remaining is not None:
            body: AnswerBytes = await self._pool._timed(self._connection, self._connection.read_body(self._remaining))
            self._remaining = 0
        else:
            body = b"".join([piece async for piece in self._pieces()])
        self._end()
        return body

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed)."""
        async for piece in self._pieces():
            yield piece
        self._end()

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._pool._finish(self._connection, reuse=False)

    async def _pieces(self) -> AsyncIterator[bytes]:
        connection, timed = self._connection, self._pool._timed
        if self._chunked:
            # pieces of each chunk as they arrive: a chunk (the last SSE event of a big turn) can be tens of MB
            while size := await timed(connection, self._chunk_size(connection)):
                while size:
                    piece = await timed(connection, connection.read_some(min(size, READ_CHUNK_BYTES)))
                    if not piece:
                        raise self._pool._lost(EOFError("a chunk ended early"))
                    size -= len(piece)
                    yield piece
                if await timed(connection, connection.read_until(b"\r\n", 2)) != b"\r\n":
                    raise self._pool._lost(ValueError("chunk not followed by CRLF"))
        elif self._remaining is None:
            while piece := await timed(connection, connection.read_some(READ_CHUNK_BYTES)):
                yield piece
        else:
            while self._remaining:
                piece = await timed(connection, connection.read_some(min(self._remaining, READ_CHUNK_BYTES)))
                if not piece:
                    raise self._pool._lost(EOFError("the body ended early"))
                self._remaining -= len(piece)
                yield piece

    @staticmethod
    async def _chunk_size(connection: _Connection) -> int:
        """The size line of the next chunk; after the last one (size 0), its trailers are read too."""
        size = int((await connection.read_until(b"\r\n", MAX_HEAD_BYTES)).split(b";", 1)[0], 16)
        if size == 0:
            while await connection.read_until(b"\r\n", MAX_HEAD_BYTES) != b"\r\n":
                pass
        return size

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._pool._finish(self._connection, reuse=self._keep_alive)
