"""slime_wire.http1: the keep-alive pool against a raw-TCP fake upstream that answers with scripted bytes.

Every network test runs on both event loops the code meets (asyncio's, and uvloop's, which the gateway runs): each
gets a fresh loop of its own through the ``run`` fixture, and a fresh ``RawUpstream`` (tests/raw_upstream.py) whose
``reply`` scripts the bytes of each answer and whose ``requests`` record what arrived, on which connection.
"""

from __future__ import annotations

import asyncio
import mmap
import random
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import uvloop
from raw_upstream import CLOSE, RESET, RawRequest, RawUpstream, Step, chunked, http_response

from slime_wire import http1
from slime_wire.errors import (
    ConnectFailed,
    ConnectionLost,
    NotSent,
    PoolTimeout,
    ProtocolViolation,
    ResponseTimeout,
    SentError,
    TransportError,
)
from slime_wire.http1 import (
    BIG_BODY_BYTES,
    HEAD_READ_BYTES,
    MAX_HEAD_BYTES,
    MAX_QUEUED_BYTES,
    RECEIVE_BUFFER_BYTES,
    SINK_READ_BYTES,
    BodyBuffers,
    ConnectionPool,
    Response,
)

Run = Callable[[Coroutine[Any, Any, Any]], Any]
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


# ---- fixtures and helpers --------------------------------------------------------------------------------------------
@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Iterator[Run]:
    """Runs a test's coroutine on a fresh loop of the parametrized kind."""
    with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
        yield runner.run


def ok(body: bytes, **headers: str) -> bytes:
    return http_response(body, headers={"content-type": "text/plain", **headers})


def echo(request: RawRequest) -> list[Step]:
    return [ok(f"{request.method} {request.path}".encode() + b" " + request.body)]


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with RawUpstream(echo) as server:
        yield server


@asynccontextmanager
async def open_pool(url: str, **options: Any) -> AsyncIterator[ConnectionPool]:
    settings: dict[str, Any] = {"max_connections": 1, "connect_timeout_s": 1.0, "pool_timeout_s": 0.3}
    pool = ConnectionPool(url, **{**settings, **options})
    try:
        yield pool
    finally:
        await pool.aclose()


async def fetch(
    pool: ConnectionPool,
    target: bytes = b"/",
    method: str = "GET",
    body: bytes = b"",
    headers: Sequence[tuple[bytes, bytes]] = (),
    timeout: float = 3.0,
) -> tuple[Response, bytes]:
    response = await pool.request(method, target, headers, body, timeout=timeout)
    try:
        content = await response.read()
    finally:
        await response.aclose()
    return response, bytes(content)


async def fetch_raw(pool: ConnectionPool, target: bytes) -> tuple[Response, Any]:
    """Like ``fetch``, with the body as ``read`` gives it (a pooled map for a big one)."""
    response = await pool.request("GET", target, timeout=3)
    try:
        return response, await response.read()
    finally:
        await response.aclose()


def seen(upstream: RawUpstream, path: str) -> list[int]:
    """The connections on which requests for ``path`` arrived."""
    return [request.connection for request in upstream.requests if request.path == path]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pattern(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


# ---- keep-alive and what goes on the wire ----------------------------------------------------------------------------
def test_keep_alive_reuses_one_connection(run: Run, upstream: RawUpstream) -> None:
    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for i in range(30):
                method = ("GET", "POST", "PUT", "DELETE")[i % 4]
                body = b"" if method == "GET" else b"body%d" % i
                response, content = await fetch(pool, b"/n/%d?q=1" % i, method, body)
                assert response.status == 200 and response.http_version == "1.1"
                assert content == f"{method} /n/{i}?q=1 ".encode() + body
            assert pool.connections_opened == 1
        assert [request.connection for request in upstream.requests] == [1] * 30

    run(main())


def test_request_bytes(run: Run, upstream: RawUpstream) -> None:
    async def main() -> None:
        async with open_pool(upstream.url + "/prefix/", user_agent=b"tester") as pool:
            await fetch(pool, b"/a", "POST", b'{"x": 1}', headers=[(b"Content-Type", b"application/json")])
            await fetch(pool, b"/b")
            await fetch(pool, b"/c", "DELETE")
        post, get, delete = upstream.requests
        assert (post.method, post.path, post.body) == ("POST", "/prefix/a", b'{"x": 1}')
        assert post.headers["host"] == f"127.0.0.1:{upstream.port}"
        assert post.headers["user-agent"] == "tester"
        assert post.headers["accept-encoding"] == "identity"
        assert post.headers["content-length"] == "8"
        assert post.headers["content-type"] == "application/json"
        assert (get.method, get.path, get.body) == ("GET", "/prefix/b", b"")
        assert "content-length" not in get.headers  # a GET without a body sends no length
        assert delete.headers["content-length"] == "0"  # any other method always does

    run(main())


def test_response_headers(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [
        b"HTTP/1.1 201 Created\r\nX-One: 1\r\nx-one: 2\r\nContent-Type: a/b\r\nContent-Length: 2\r\n\r\nhi"
    ]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            response, content = await fetch(pool)
        assert (response.status, content, response.content_type) == (201, b"hi", "a/b")
        assert response.header(b"x-one") == b"1"  # the first value; names in lower case
        assert response.header(b"x-missing") is None
        assert response.headers[:2] == [(b"x-one", b"1"), (b"x-one", b"2")]

    run(main())


def test_keepalive_expiry_opens_a_fresh_connection(run: Run, upstream: RawUpstream) -> None:
    async def main() -> None:
        async with open_pool(upstream.url, keepalive_expiry_s=0.05) as pool:
            await fetch(pool, b"/1")
            await asyncio.sleep(0.15)
            await fetch(pool, b"/2")
            assert pool.connections_opened == 2
        assert seen(upstream, "/2") == [2]

    run(main())


def test_connection_close_answer_is_not_reused(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [ok(b"bye", connection="close")]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for _ in range(3):
                assert (await fetch(pool))[1] == b"bye"
            assert pool.connections_opened == 3

    run(main())


def test_bad_base_urls() -> None:
    for url in ("ftp://host/", "http://", "127.0.0.1:80"):
        with pytest.raises(ValueError):
            ConnectionPool(url, max_connections=1, connect_timeout_s=1, pool_timeout_s=1)


# ---- bodies ----------------------------------------------------------------------------------------------------------
def test_small_content_length_body_is_bytes(run: Run, upstream: RawUpstream) -> None:
    body = pattern(BIG_BODY_BYTES - 1)
    upstream.reply = lambda request: [ok(body)]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            response = await pool.request("GET", b"/", timeout=3)
            content = await response.read()
            await response.aclose()
            assert type(content) is bytes and content == body

    run(main())


def test_empty_bodies(run: Run, upstream: RawUpstream) -> None:
    answers = {
        "/zero": b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        "/204": b"HTTP/1.1 204 No Content\r\n\r\n",
        "/304": b"HTTP/1.1 304 Not Modified\r\n\r\n",
    }
    upstream.reply = lambda request: [answers[request.path]]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for path in answers:
                response, content = await fetch(pool, path.encode())
                assert content == b""
                assert response.status == (200 if path == "/zero" else int(path[1:]))
            assert pool.connections_opened == 1  # none of these bodies runs to the end of the connection

    run(main())


def test_big_body_comes_in_a_pooled_buffer_that_is_reused(run: Run, upstream: RawUpstream) -> None:
    bodies = {"/a": pattern(3 * BIG_BODY_BYTES, 1), "/b": pattern(3 * BIG_BODY_BYTES, 2), "/c": pattern(BIG_BODY_BYTES)}
    upstream.reply = lambda request: [ok(bodies[request.path])]

    async def main() -> None:
        buffers = BodyBuffers()
        async with open_pool(upstream.url, buffers=buffers) as pool:
            assert pool.buffers is buffers
            _, first = await fetch_raw(pool, b"/a")
            assert isinstance(first, mmap.mmap) and first[:] == bodies["/a"]
            pool.buffers.give_back(first)
            _, second = await fetch_raw(pool, b"/b")
            assert second is first  # the same map, refilled
            assert second[:] == bodies["/b"]
            view = memoryview(second)
            pool.buffers.give_back(second)  # refused: a view of it is alive, it could be overwritten under it
            _, third = await fetch_raw(pool, b"/c")
            assert third is not second and third[:] == bodies["/c"]
            assert view[:16] == bodies["/b"][:16]
            view.release()
            pool.buffers.give_back(second)
            _, fourth = await fetch_raw(pool, b"/c")  # a smaller body: the spare map, resized
            assert fourth is second and len(fourth) == BIG_BODY_BYTES and fourth[:] == bodies["/c"]
            assert pool.connections_opened == 1

    run(main())


def test_big_body_arriving_slowly_in_pieces(run: Run, upstream: RawUpstream) -> None:
    body = pattern(1 << 20)
    answer = ok(body)
    steps: list[Step] = []
    for start in range(0, len(answer), 100_000):
        steps += [answer[start : start + 100_000], 0.002]
    upstream.reply = lambda request: steps

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            _, content = await fetch_raw(pool, b"/")
            assert isinstance(content, mmap.mmap) and content[:] == body
            assert (await fetch(pool))[1] == body and pool.connections_opened == 1

    run(main())


# ---- read(into=...): the body straight into the caller's buffer -----------------------------------------------------
def test_read_into_a_callers_buffer(run: Run, upstream: RawUpstream) -> None:
    pieces = [pattern(n, n) for n in (10, 70_000, 3)]
    answers = {
        "/big": ok(pattern(3 * RECEIVE_BUFFER_BYTES + 5, 1)),
        "/small": ok(b"tiny"),
        "/empty": ok(b""),
        "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(*pieces),
    }
    bodies = {
        "/big": pattern(3 * RECEIVE_BUFFER_BYTES + 5, 1),
        "/small": b"tiny",
        "/empty": b"",
        "/chunked": b"".join(pieces),
    }
    upstream.reply = lambda request: [answers[request.path]]

    async def main() -> None:
        asked: list[int] = []

        def allocate(size: int) -> np.ndarray:
            asked.append(size)
            return np.empty(size, np.uint8)

        async with open_pool(upstream.url) as pool:
            for _ in range(2):
                for path, body in bodies.items():
                    response = await pool.request("GET", path.encode(), timeout=3)
                    got = await response.read(into=allocate)
                    assert isinstance(got, np.ndarray) and got.tobytes() == body, path
                    assert asked[-1] == len(body)  # once, with the Content-Length (the chunked one: when all is in)
            response = await pool.request("GET", b"/big", timeout=3)
            buffer = await response.read(into=bytearray)
            assert buffer == bodies["/big"]
            buffer.extend(b"!")  # no view of it is left behind: it can be resized
            assert len(asked) == 8 and pool.connections_opened == 1  # every answer read whole, the connection kept
            assert pool.buffers._spare == []  # nothing of the caller's goes to the pool

    run(main())


def test_read_into_a_body_arriving_slowly_then_more_answers_on_the_connection(run: Run, upstream: RawUpstream) -> None:
    """A Content-Length body received into its buffer is counted, not handed to llhttp: the connection's next answers
    (any framing) are read by a fresh parser, and read right."""
    body = pattern(1 << 20)
    answer = ok(body)
    steps: list[Step] = []
    for start in range(0, len(answer), 100_000):
        steps += [answer[start : start + 100_000], 0.002]
    chunked_answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"ab", b"cd")
    upstream.reply = lambda request: {"/slow": steps, "/chunked": [chunked_answer]}.get(request.path) or echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for _ in range(2):
                response = await pool.request("GET", b"/slow", timeout=3)
                assert (await response.read(into=bytearray)) == body
                assert (await fetch(pool, b"/chunked"))[1] == b"abcd"
                assert (await fetch(pool, b"/next", "POST", b"x"))[1] == b"POST /next x"
                _, pooled = await fetch_raw(pool, b"/slow")  # the pooled-buffer path is counted alike
                assert pooled[:] == body
            assert pool.connections_opened == 1

    run(main())


def low_water(pool: ConnectionPool) -> list[int]:
    """SO_RCVLOWAT of each idle connection's socket."""
    values = []
    for connection in pool._idle:
        assert connection._transport is not None
        sock = connection._transport.get_extra_info("socket")
        values.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
    return values


@pytest.mark.parametrize("size", [1 << 20, SINK_READ_BYTES + 3 * RECEIVE_BUFFER_BYTES + 7], ids=["1MB", "over-cap"])
def test_a_counted_body_wakes_the_loop_once_what_is_missing_is_there(
    run: Run, upstream: RawUpstream, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A body received into its buffer sets SO_RCVLOWAT to the bytes still missing (at most SINK_READ_BYTES), lowers
    it as they arrive (a mark above what is missing would never wake the loop), and puts it back to 1 for the next
    answer's head. The head's own read is at most HEAD_READ_BYTES: body bytes in it are copied twice more."""
    body = pattern(size, 3)
    answer = ok(body)
    steps: list[Step] = []
    for start in range(0, len(answer), 300_000):  # in pieces, so that the loop would otherwise wake for each
        steps += [answer[start : start + 300_000], 0.001]
    upstream.reply = lambda request: steps if request.path == "/big" else echo(request)
    marks: list[int] = []
    head_reads: list[int] = []
    wake_at, get_buffer = http1._Connection.wake_at, http1._Connection.get_buffer

    def record_mark(self: Any, nbytes: int) -> None:
        wake_at(self, nbytes)
        sock = self._transport.get_extra_info("socket")
        marks.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))  # what the kernel was told

    def record_read(self: Any, sizehint: int) -> memoryview:
        view = get_buffer(self, sizehint)
        if self._exchange is not None and not self._exchange.head_complete:
            head_reads.append(len(view))
        return view

    monkeypatch.setattr(http1._Connection, "wake_at", record_mark)
    monkeypatch.setattr(http1._Connection, "get_buffer", record_read)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for into in (True, False):
                marks.clear()
                response = await pool.request("GET", b"/big", timeout=5)
                got = await (response.read(into=bytearray) if into else response.read())
                assert bytes(got[:]) == body
                assert marks[0] <= SINK_READ_BYTES and marks[-1] == 1  # set, then back to 1 at the end
                missing = [mark for mark in marks[:-1] if mark > 1]
                assert missing and missing == sorted(missing, reverse=True)  # lowered as the body arrives
                assert low_water(pool) == [1]
                assert (await fetch(pool, b"/next", "POST", b"x"))[1] == b"POST /next x"  # the next head is read
            assert pool.connections_opened == 1
        assert head_reads and max(head_reads) <= HEAD_READ_BYTES

    run(main())


def test_a_counted_body_cut_short_or_stalled_still_ends(run: Run, upstream: RawUpstream) -> None:
    """With SO_RCVLOWAT set for the missing bytes, an upstream that closes mid-body is still noticed at once (the
    kernel wakes the loop for the end of the stream), and one that stalls times out at the deadline."""
    body = pattern(2 << 20, 4)
    answer = ok(body)
    replies = {"/cut": [answer[: len(answer) // 2], 0.05, CLOSE], "/stall": [answer[: len(answer) // 2], 5.0]}
    upstream.reply = lambda request: replies.get(request.path) or echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            started = time.monotonic()
            response = await pool.request("GET", b"/cut", timeout=5)
            with pytest.raises(ConnectionLost):
                await response.read(into=bytearray)
            assert time.monotonic() - started < 2
            started = time.monotonic()
            response = await pool.request("GET", b"/stall", timeout=0.5)
            with pytest.raises(ResponseTimeout):
                await response.read(into=bytearray)
            assert 0.4 < time.monotonic() - started < 2
            assert (await fetch(pool, b"/after"))[1] == b"GET /after "

    run(main())


@pytest.mark.parametrize("into", [True, False], ids=["into", "pooled"])
def test_a_counted_body_keeps_the_heads_verdict_and_what_follows_it_poisons(
    run: Run, upstream: RawUpstream, into: bool
) -> None:
    body = pattern(3 * BIG_BODY_BYTES)
    answers: dict[str, list[Step]] = {
        "/close": [ok(body, connection="close")],
        "/http10": [b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body],
        "/http10-keep": [b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body) + body],
        "/then-more": [ok(body) + ok(b"stale")],
        "/then-more-later": [ok(body), 0.05, ok(b"stale")],
    }
    upstream.reply = lambda request: answers.get(request.path) or echo(request)

    async def main() -> None:
        for path, reused in [
            ("/close", False),
            ("/http10", False),
            ("/http10-keep", True),
            ("/then-more", False),
            ("/then-more-later", False),
        ]:
            async with open_pool(upstream.url) as pool:
                response = await pool.request("GET", path.encode(), timeout=3)
                got = await (response.read(into=bytearray) if into else response.read())
                assert got[:] == body, path
                if not isinstance(got, bytearray):
                    pool.buffers.give_back(got)
                await asyncio.sleep(0.1)
                assert (await fetch(pool, b"/next"))[1] == b"GET /next "
                assert pool.connections_opened == (1 if reused else 2), path

    run(main())


def test_read_into_refuses_a_buffer_it_cannot_fill(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [ok(b"hello")]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for into, error in [(bytes, TypeError), (lambda size: bytearray(size + 1), ValueError)]:
                response = await pool.request("GET", b"/", timeout=3)
                with pytest.raises(error):
                    await response.read(into=into)
            two_bytes = await pool.request("GET", b"/", timeout=3)  # any C-contiguous layout: counted in bytes
            assert bytes(await two_bytes.read(into=lambda size: np.zeros((1, size), np.uint8))) == b"hello"

    run(main())


def test_chunked_bodies(run: Run, upstream: RawUpstream) -> None:
    pieces = [pattern(n, n) for n in (1, 10, 4096, 70_000, 300_000, 3)]
    answers = {
        "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(*pieces),
        "/ext": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"5;name=value\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n",
        "/empty": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    }
    upstream.reply = lambda request: [answers[request.path]]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            assert (await fetch(pool, b"/chunked"))[1] == b"".join(pieces)
            assert (await fetch(pool, b"/ext"))[1] == b"hello"
            assert (await fetch(pool, b"/empty"))[1] == b""
            response = await pool.request("GET", b"/chunked", timeout=3)
            streamed = [piece async for piece in response.iter_raw()]
            await response.aclose()
            assert b"".join(streamed) == b"".join(pieces)
            assert all(len(piece) <= RECEIVE_BUFFER_BYTES for piece in streamed)
            assert pool.connections_opened == 1

    run(main())


def test_iter_raw_backpressure_on_a_slow_reader(run: Run, upstream: RawUpstream) -> None:
    body = pattern(8 * MAX_QUEUED_BYTES)
    upstream.reply = lambda request: [ok(body)]
    bound = MAX_QUEUED_BYTES + RECEIVE_BUFFER_BYTES  # one read may land past the limit, then reading stops

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            response = await pool.request("GET", b"/", timeout=10)
            exchange, connection = response._exchange, response._connection
            pieces = response.iter_raw()
            received = [await anext(pieces)]
            await asyncio.sleep(0.3)  # the upstream has all 8 MB to send; the pool must stop reading
            assert connection._paused
            assert exchange._queued <= bound
            at_pause = exchange.bytes_received
            await asyncio.sleep(0.1)
            assert exchange.bytes_received == at_pause  # nothing read while paused
            assert at_pause < len(body)
            most_queued = 0
            async for piece in pieces:
                received.append(piece)
                most_queued = max(most_queued, exchange._queued)
                if len(received) % 8 == 0:
                    await asyncio.sleep(0.002)
            await response.aclose()
            assert most_queued <= bound
            assert b"".join(received) == body  # complete and in order
            assert (await fetch(pool))[1] == body and pool.connections_opened == 1

    run(main())


def test_http10_without_length_is_read_until_close(run: Run, upstream: RawUpstream) -> None:
    answers: dict[str, list[Step]] = {
        "/1.0": [b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"abc", 0.05, b"def", CLOSE],
        "/1.1-close": [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nxyz", 0.05, b"!", CLOSE],
        "/1.0-reset": [b"HTTP/1.0 200 OK\r\n\r\nabc", 0.05, RESET],
    }
    upstream.reply = lambda request: answers.get(request.path, echo(request))

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            response, content = await fetch(pool, b"/1.0")
            assert (response.http_version, content) == ("1.0", b"abcdef")
            response = await pool.request("GET", b"/1.1-close", timeout=3)
            assert b"".join([piece async for piece in response.iter_raw()]) == b"xyz!"
            await response.aclose()
            with pytest.raises(ConnectionLost):  # a reset is no end of the body
                await fetch(pool, b"/1.0-reset")
            assert (await fetch(pool, b"/after"))[1] == b"GET /after "
            assert pool.connections_opened == 4  # none of these connections is reused
        assert seen(upstream, "/after") == [4]

    run(main())


def test_interim_answers_are_skipped(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n",
        ok(b"final", **{"x-final": "1"}),
    ]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            for _ in range(2):
                response, content = await fetch(pool)
                assert (response.status, content) == (200, b"final")
                assert response.header(b"link") is None and response.header(b"x-final") == b"1"
            assert pool.connections_opened == 1

    run(main())


# ---- deadlines and pool slots ----------------------------------------------------------------------------------------
def test_a_dripping_body_times_out_at_the_deadline(run: Run, upstream: RawUpstream) -> None:
    drip: list[Step] = [b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"]
    drip += [b"x" * 10, 0.05] * 40  # a steady trickle: never idle long, never done
    upstream.reply = lambda request: drip if request.path == "/drip" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            started = time.monotonic()
            response = await pool.request("GET", b"/drip", timeout=0.3)
            with pytest.raises(ResponseTimeout):
                await response.read()
            elapsed = time.monotonic() - started
            assert 0.25 <= elapsed < 1.2
            await response.aclose()
            started = time.monotonic()
            response = await pool.request("GET", b"/drip", timeout=0.3)
            pieces = []
            with pytest.raises(ResponseTimeout):
                async for piece in response.iter_raw():
                    pieces.append(piece)
            assert 0.25 <= time.monotonic() - started < 1.2
            assert pieces and set(b"".join(pieces)) == {ord("x")}
            await response.aclose()
            assert (await fetch(pool, b"/next"))[1] == b"GET /next "

    run(main())


def test_a_slow_head_times_out_at_the_deadline(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [1.5, ok(b"late")] if request.path == "/slow" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            started = time.monotonic()
            with pytest.raises(ResponseTimeout):
                await pool.request("GET", b"/slow", timeout=0.3)
            assert 0.25 <= time.monotonic() - started < 1.2
            assert (await fetch(pool, b"/next"))[1] == b"GET /next "
        assert len(seen(upstream, "/slow")) == 1  # a timed-out call is never sent again

    run(main())


def test_the_deadline_includes_the_wait_for_a_slot(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [1.5, ok(b"late")] if request.path == "/slow" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url, pool_timeout_s=5.0) as pool:
            holder = await pool.request("GET", b"/hold", timeout=3)

            async def release_later() -> None:
                await asyncio.sleep(0.5)
                await holder.read()

            releaser = asyncio.create_task(release_later())
            started = time.monotonic()
            with pytest.raises(ResponseTimeout):
                await pool.request("GET", b"/slow", timeout=0.8)  # ~0.5 s waiting for the slot, ~0.3 s for a head
            elapsed = time.monotonic() - started
            await releaser
            assert 0.7 <= elapsed < 1.2, elapsed  # a clock started after the wait would end at ~1.3 s

    run(main())


def test_pool_timeout_when_every_connection_is_busy(run: Run, upstream: RawUpstream) -> None:
    async def main() -> None:
        async with open_pool(upstream.url, max_connections=2, pool_timeout_s=0.2) as pool:
            busy = [await pool.request("GET", b"/busy", timeout=3) for _ in range(2)]
            started = time.monotonic()
            with pytest.raises(PoolTimeout) as caught:
                await pool.request("POST", b"/waits", body=b"x", timeout=3)
            assert 0.15 <= time.monotonic() - started < 1.5
            assert isinstance(caught.value, NotSent)
            pool.pool_timeout_s = 30.0
            started = time.monotonic()
            with pytest.raises(PoolTimeout):  # the call's own timeout bounds the wait too
                await pool.request("GET", b"/waits", timeout=0.2)
            assert time.monotonic() - started < 1.5
            await busy[0].aclose()  # unread: its connection is closed, its slot given back
            assert (await fetch(pool, b"/now"))[1] == b"GET /now "
            await busy[1].read()
            assert pool.connections_opened == 3
        assert seen(upstream, "/waits") == []

    run(main())


def test_many_concurrent_callers_share_the_slots(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [0.01, *echo(request)]

    async def main() -> None:
        async with open_pool(upstream.url, max_connections=3, pool_timeout_s=5.0) as pool:
            results = await asyncio.gather(*(fetch(pool, b"/%d" % i) for i in range(30)))
            assert [content for _, content in results] == [b"GET /%d " % i for i in range(30)]
            assert pool.connections_opened <= 3

    run(main())


# ---- slots are never lost --------------------------------------------------------------------------------------------
async def fail_protocol(pool: ConnectionPool) -> None:
    with pytest.raises(ProtocolViolation):
        await fetch(pool, b"/garbage")


async def fail_protocol_in_body(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/bad-chunk", timeout=3)
    with pytest.raises(ProtocolViolation):
        await response.read()  # closes the response itself on an error


async def fail_head_timeout(pool: ConnectionPool) -> None:
    with pytest.raises(ResponseTimeout):
        await pool.request("GET", b"/slow-head", timeout=0.2)


async def fail_body_timeout(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/slow-body", timeout=0.2)
    with pytest.raises(ResponseTimeout):
        await response.read()


async def fail_lost_mid_body(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/cut", timeout=3)
    with pytest.raises(ConnectionLost):
        await response.read()


async def fail_lost_before_answer(pool: ConnectionPool) -> None:
    with pytest.raises(ConnectionLost):
        await pool.request("POST", b"/reset", body=b"x", timeout=3)


async def fail_lost_in_iter_raw(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/cut", timeout=3)
    with pytest.raises(ConnectionLost):
        async for _ in response.iter_raw():
            pass


async def cancel_waiting_for_head(pool: ConnectionPool) -> None:
    task = asyncio.create_task(pool.request("GET", b"/slow-head", timeout=3))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def cancel_in_read(pool: ConnectionPool) -> None:
    async def call() -> None:
        response = await pool.request("GET", b"/slow-body", timeout=3)
        await response.read()

    task = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def cancel_in_iter_raw(pool: ConnectionPool) -> None:
    async def call() -> None:
        response = await pool.request("GET", b"/slow-body", timeout=3)
        async for _ in response.iter_raw():
            pass

    task = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def close_unread(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/slow-body", timeout=3)
    await response.aclose()
    await response.aclose()  # twice is harmless: one slot, given back once


async def break_out_of_iter_raw(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/slow-body", timeout=3)
    async for _ in response.iter_raw():
        break
    await response.aclose()


async def fail_unbufferable_length(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/huge-length", timeout=3)
    with pytest.raises(ProtocolViolation):
        await response.read()  # no map holds 2**63 bytes: a TransportError, and the response closed by read


async def fail_into_lost_mid_body(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/cut", timeout=3)
    with pytest.raises(ConnectionLost):
        await response.read(into=bytearray)


async def fail_into_body_timeout(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/slow-body", timeout=0.2)
    with pytest.raises(ResponseTimeout):
        await response.read(into=bytearray)


async def fail_into_unbufferable_length(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/huge-length", timeout=3)
    with pytest.raises(ProtocolViolation):
        await response.read(into=bytearray)  # the allocator cannot: a TransportError, and the response closed


async def fail_into_wrong_buffer(pool: ConnectionPool) -> None:
    response = await pool.request("GET", b"/slow-body", timeout=3)
    with pytest.raises(ValueError):
        await response.read(into=lambda size: bytearray(size + 1))  # the caller's bug: raised as is, slot freed


async def cancel_in_read_into(pool: ConnectionPool) -> None:
    async def call() -> None:
        response = await pool.request("GET", b"/slow-body", timeout=3)
        await response.read(into=bytearray)

    task = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def fail_head_too_big(pool: ConnectionPool) -> None:
    with pytest.raises(ProtocolViolation):
        await pool.request("GET", b"/big-head", timeout=3)


async def fail_refused_header(pool: ConnectionPool) -> None:
    with pytest.raises(ValueError):
        await pool.request("GET", b"/", [(b"x", b"a\r\nb")], timeout=3)


FAILURES: dict[str, Callable[[ConnectionPool], Awaitable[None]]] = {
    name.__name__: name
    for name in (
        fail_protocol,
        fail_protocol_in_body,
        fail_head_timeout,
        fail_body_timeout,
        fail_lost_mid_body,
        fail_lost_before_answer,
        fail_lost_in_iter_raw,
        cancel_waiting_for_head,
        cancel_in_read,
        cancel_in_iter_raw,
        close_unread,
        break_out_of_iter_raw,
        fail_unbufferable_length,
        fail_into_lost_mid_body,
        fail_into_body_timeout,
        fail_into_unbufferable_length,
        fail_into_wrong_buffer,
        cancel_in_read_into,
        fail_head_too_big,
        fail_refused_header,
    )
}
FAILING_ANSWERS: dict[str, list[Step]] = {
    "/garbage": [b"not http at all\r\n\r\n"],
    "/bad-chunk": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", 0.02, b"zz\r\nabc\r\n0\r\n\r\n"],
    "/slow-head": [0.6, ok(b"late")],
    "/slow-body": [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab", 0.6, b"cdefghij"],
    "/cut": [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab", 0.02, CLOSE],
    "/reset": [RESET],
    "/huge-length": [b"HTTP/1.1 200 OK\r\nContent-Length: 9223372036854775807\r\n\r\nabc"],
    "/big-head": [ok(b"x", **{"x-big": "h" * (2 * MAX_HEAD_BYTES)})],
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_no_failure_loses_a_slot(run: Run, upstream: RawUpstream, failure: str) -> None:
    upstream.reply = lambda request: FAILING_ANSWERS.get(request.path) or echo(request)

    async def main() -> None:
        async with open_pool(upstream.url, max_connections=1, pool_timeout_s=0.3) as pool:
            for i in range(2):
                await FAILURES[failure](pool)
                # one slot in all: had the failure kept it, this would be a PoolTimeout
                assert (await fetch(pool, b"/after%d" % i))[1] == b"GET /after%d " % i
                # nor was it given back twice: with one response open, no slot is left
                held = await pool.request("GET", b"/held", timeout=3)
                assert pool._slots is not None and pool._slots.locked()
                await held.aclose()

    run(main())


# ---- when a connection may be reused, when a request may be sent again -----------------------------------------------
def test_a_connection_closed_while_idle_is_not_used(run: Run, upstream: RawUpstream) -> None:
    """The loop has already seen the end of the connection."""

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            await fetch(pool, b"/first")
            upstream.drop_connections()
            await asyncio.sleep(0.1)
            _, content = await fetch(pool, b"/post", "POST", b"once")
            assert content == b"POST /post once"
            assert pool.connections_opened == 2
        assert seen(upstream, "/post") == [2]

    run(main())


def test_a_connection_closed_while_idle_is_noticed_before_the_loop_sees_it(run: Run, upstream: RawUpstream) -> None:
    """The end of the connection waits in the socket, unread by the event loop: ``quiet`` polls for it."""

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            await fetch(pool, b"/first")
            upstream.drop_connections()
            time.sleep(0.1)  # blocks this loop: the FIN arrives but is not read
            # a POST is never sent again, so had it gone out on the dead connection it would fail
            _, content = await fetch(pool, b"/post", "POST", b"once")
            assert content == b"POST /post once"
            assert pool.connections_opened == 2
        assert seen(upstream, "/post") == [2]

    run(main())


def test_a_post_written_into_a_connection_the_server_had_closed_goes_out_again(
    run: Run, upstream: RawUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race ``quiet`` narrows but cannot close (the server's FIN still on its way when the request is written):
    the server's TCP stack never acknowledged the request, so no application can have read it, and even a POST is
    sent again, once, on a fresh connection."""
    monkeypatch.setattr(http1._Connection, "quiet", lambda self: self.reusable())  # as if the FIN were late

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            await fetch(pool, b"/first")
            upstream.drop_connections()
            time.sleep(0.1)  # the server's end is closed before the request is written
            _, content = await fetch(pool, b"/post", "POST", b"once")
            assert content == b"POST /post once"
            assert pool.connections_opened == 2
        assert seen(upstream, "/post") == [2]  # it reached the server once: on the fresh connection

    run(main())


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS"])
def test_an_idempotent_request_is_resent_once_when_a_reused_connection_dies_unanswered(
    run: Run, upstream: RawUpstream, method: str
) -> None:
    def reply(request: RawRequest) -> list[Step]:
        if request.path == "/dies-once" and request.connection == 1:
            return [CLOSE]  # read the request, then closed without a byte of answer
        if request.path == "/always-dies":
            return [CLOSE]
        return echo(request)

    upstream.reply = reply

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            await fetch(pool, b"/warm")
            _, content = await fetch(pool, b"/dies-once", method)
            assert content == f"{method} /dies-once ".encode()
            assert pool.connections_opened == 2
            with pytest.raises(ConnectionLost):
                await fetch(pool, b"/always-dies", method)  # sent again once, not twice
        assert seen(upstream, "/dies-once") == [1, 2]
        assert seen(upstream, "/always-dies") == [2, 3]

    run(main())


def test_a_resent_request_is_not_resent_again_on_another_reused_connection(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [CLOSE] if request.path == "/always-dies" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url, max_connections=2) as pool:
            warm = [await pool.request("GET", b"/warm", timeout=3) for _ in range(2)]
            for response in warm:
                await response.read()  # two idle connections, both reused next
            with pytest.raises(ConnectionLost):
                await fetch(pool, b"/always-dies")
            assert pool.connections_opened == 2
        assert sorted(seen(upstream, "/always-dies")) == [1, 2]  # sent again once, on the other idle connection

    run(main())


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_non_idempotent_request_is_never_resent(run: Run, upstream: RawUpstream, method: str) -> None:
    upstream.reply = lambda request: [CLOSE] if request.path == "/dies" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            await fetch(pool, b"/warm")
            with pytest.raises(ConnectionLost) as caught:
                await fetch(pool, b"/dies", method, b"payload")
            assert isinstance(caught.value, SentError)
            assert pool.connections_opened == 1
        assert seen(upstream, "/dies") == [1]

    run(main())


def test_no_resend_on_a_fresh_connection_or_after_answer_bytes(run: Run, upstream: RawUpstream) -> None:
    answers: dict[str, list[Step]] = {
        "/dies": [CLOSE],
        "/half": [b"HTTP/1.1 200 OK\r\n", 0.02, CLOSE],
    }
    upstream.reply = lambda request: answers.get(request.path) or echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            with pytest.raises(ConnectionLost):
                await fetch(pool, b"/dies")  # a fresh connection: the server did read it
            await fetch(pool, b"/warm")
            with pytest.raises(ConnectionLost):
                await fetch(pool, b"/half")  # reused, but an answer had begun
        assert seen(upstream, "/dies") == [1]
        assert seen(upstream, "/half") == [2]

    run(main())


def test_a_second_answer_in_the_same_bytes_poisons_the_connection(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [ok(b"first") + ok(b"stale")] if request.path == "/twice" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            assert (await fetch(pool, b"/twice"))[1] == b"first"
            assert (await fetch(pool, b"/next", "POST", b"x"))[1] == b"POST /next x"
            assert pool.connections_opened == 2
        assert seen(upstream, "/next") == [2]

    run(main())


@pytest.mark.parametrize("loop_reads_it", [True, False], ids=["read-by-loop", "waiting-in-socket"])
def test_a_late_unsolicited_answer_poisons_the_connection(run: Run, upstream: RawUpstream, loop_reads_it: bool) -> None:
    upstream.reply = lambda request: [ok(b"first"), 0.05, ok(b"stale")] if request.path == "/late" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            assert (await fetch(pool, b"/late"))[1] == b"first"
            if loop_reads_it:
                await asyncio.sleep(0.2)
            else:
                time.sleep(0.2)  # the stale answer waits in the socket: quiet() must see it
            assert (await fetch(pool, b"/next", "POST", b"x"))[1] == b"POST /next x"
            assert pool.connections_opened == 2
        assert seen(upstream, "/next") == [2]

    run(main())


def test_garbage_after_a_complete_answer_keeps_the_answer_drops_the_connection(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [ok(b"fine") + b"\x00garbage\r\n"] if request.path == "/g" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            assert (await fetch(pool, b"/g"))[1] == b"fine"
            assert (await fetch(pool, b"/next"))[1] == b"GET /next "
            assert pool.connections_opened == 2

    run(main())


# ---- protocol violations ---------------------------------------------------------------------------------------------
MALFORMED: dict[str, bytes] = {
    "negative-length": b"HTTP/1.1 200 OK\r\nContent-Length: -10\r\n\r\n",
    "letters-in-length": b"HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\nabcdefghijkl",
    "two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "length-and-chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "chunk-longer-than-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n",
    "status-not-a-number": b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n",
    "bad-protocol-name": b"HTXP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "not-http": b"hello there\r\n\r\n",
    "header-without-colon": b"HTTP/1.1 200 OK\r\nBad Header\r\nContent-Length: 0\r\n\r\n",
    "switching-protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_answers_are_protocol_violations(run: Run, upstream: RawUpstream, case: str) -> None:
    upstream.reply = lambda request: [MALFORMED[case]] if request.path == "/bad" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            with pytest.raises(ProtocolViolation):
                await fetch(pool, b"/bad")
            assert (await fetch(pool, b"/next"))[1] == b"GET /next "
            assert pool.connections_opened == 2  # the broken connection is not reused
        assert seen(upstream, "/bad") == [1]  # nor is the request sent again

    run(main())


def test_a_body_shorter_than_its_length_is_connection_lost(run: Run, upstream: RawUpstream) -> None:
    upstream.reply = lambda request: [b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\nabc", CLOSE]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            with pytest.raises(ConnectionLost):
                await fetch(pool)  # a big length: the pooled-buffer path

    run(main())


def over_the_limit(how: str) -> list[Step]:
    if how == "many-headers-in-one-write":
        return [ok(b"", **{f"x-{i}": "v" * 60 for i in range(1200)})]  # ~80 KB of headers, none of them long
    if how == "long-header-in-one-write":
        # the whole head arrives in one read of the receive buffer: only counting parsed bytes sees it
        return [ok(b"body", **{"x-big": "h" * (MAX_HEAD_BYTES + 100)})]
    # still arriving when the limit passes: counting received bytes stops it before the head ends
    head = ok(b"body", **{"x-big": "h" * (2 * MAX_HEAD_BYTES)})
    return [step for at in range(0, len(head), 8192) for step in (head[at : at + 8192], 0.001)]


@pytest.mark.parametrize("how", ["long-header-in-one-write", "long-header-dripped", "many-headers-in-one-write"])
def test_a_head_over_the_limit_is_a_protocol_violation(run: Run, upstream: RawUpstream, how: str) -> None:
    upstream.reply = lambda request: over_the_limit(how) if request.path == "/big" else echo(request)

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            with pytest.raises(ProtocolViolation):
                await fetch(pool, b"/big")
            assert (await fetch(pool, b"/next"))[1] == b"GET /next "

    run(main())


def test_a_long_reason_phrase_counts_towards_the_head(run: Run, upstream: RawUpstream) -> None:
    reason = "r" * (MAX_HEAD_BYTES + 10)
    upstream.reply = lambda request: [f"HTTP/1.1 200 {reason}\r\nContent-Length: 0\r\n\r\n".encode()]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            with pytest.raises(ProtocolViolation):
                await fetch(pool)

    run(main())


def test_a_head_under_the_limit_is_fine(run: Run, upstream: RawUpstream) -> None:
    value = "h" * (MAX_HEAD_BYTES - 1024)
    upstream.reply = lambda request: [ok(b"body", **{"x-big": value})]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            response, content = await fetch(pool)
            assert content == b"body" and response.header(b"x-big") == value.encode()

    run(main())


# ---- refused before anything is sent ---------------------------------------------------------------------------------
REFUSED: dict[str, tuple[str, bytes, list[tuple[bytes, bytes]]]] = {
    "crlf-in-header-value": ("GET", b"/", [(b"x-a", b"1\r\nx-injected: 2")]),
    "lf-in-header-value": ("GET", b"/", [(b"x-a", b"1\nx-injected: 2")]),
    "cr-in-header-value": ("GET", b"/", [(b"x-a", b"1\rx")]),
    "nul-in-header-value": ("GET", b"/", [(b"x-a", b"1\0")]),
    "crlf-in-header-name": ("GET", b"/", [(b"x-a\r\nx-b", b"1")]),
    "colon-in-header-name": ("GET", b"/", [(b"x-a: 1\r\nx-b", b"1")]),
    "empty-header-name": ("GET", b"/", [(b"", b"1")]),
    "space-in-target": ("GET", b"/a HTTP/1.1\r\nx: y", []),
    "plain-space-in-target": ("GET", b"/a b", []),
    "crlf-in-target": ("GET", b"/a\r\nx: y", []),
    "target-without-slash": ("GET", b"a", []),
    "absolute-target": ("GET", b"http://evil/", []),
    "head": ("HEAD", b"/", []),
    "space-in-method": ("GET / HTTP/1.1\r\nX: y\r\n\r\nGET", b"/", []),
    "empty-method": ("", b"/", []),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_requests_that_could_smuggle_are_refused_before_sending(run: Run, upstream: RawUpstream, case: str) -> None:
    method, target, headers = REFUSED[case]

    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            with pytest.raises(ValueError):
                await pool.request(method, target, headers, timeout=1)
            assert pool.connections_opened == 0
            assert (await fetch(pool, b"/ok"))[1] == b"GET /ok "
        assert [request.path for request in upstream.requests] == ["/ok"]

    run(main())


def test_odd_but_valid_methods_and_headers_are_sent(run: Run, upstream: RawUpstream) -> None:
    async def main() -> None:
        async with open_pool(upstream.url) as pool:
            await fetch(pool, b"/x", "M-SEARCH", headers=[(b"x-empty", b""), (b"x-tab", b"a\tb")])
        [request] = upstream.requests
        assert request.method == "M-SEARCH"
        assert request.headers["x-empty"] == "" and request.headers["x-tab"] == "a\tb"

    run(main())


# ---- connecting ------------------------------------------------------------------------------------------------------
def test_connect_failed_for_a_closed_port(run: Run) -> None:
    async def main() -> None:
        async with open_pool(f"http://127.0.0.1:{closed_port()}", max_connections=1) as pool:
            for _ in range(3):  # the slot comes back each time
                with pytest.raises(ConnectFailed) as caught:
                    await pool.request("POST", b"/", body=b"x", timeout=1)
                assert isinstance(caught.value, NotSent) and isinstance(caught.value, TransportError)
            assert pool.connections_opened == 0

    run(main())


@pytest.mark.skipif(sys.platform != "linux", reason="relies on Linux dropping SYNs to a full accept queue")
def test_connect_timeout_is_connect_failed(run: Run) -> None:
    """A listening socket whose backlog is full never completes the handshake (on Linux, SYNs are dropped)."""

    async def main() -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            port = listener.getsockname()[1]
            fillers = []
            try:
                for _ in range(8):  # fill the accept queue (never accepted)
                    filler = socket.socket()
                    filler.setblocking(False)
                    filler.connect_ex(("127.0.0.1", port))
                    fillers.append(filler)
                await asyncio.sleep(0.05)
                async with open_pool(f"http://127.0.0.1:{port}", connect_timeout_s=0.2) as pool:
                    started = time.monotonic()
                    with pytest.raises(ConnectFailed):
                        await pool.request("GET", b"/", timeout=3)
                    assert time.monotonic() - started < 1.5
            finally:
                for filler in fillers:
                    filler.close()

    run(main())


# ---- BodyBuffers on its own ------------------------------------------------------------------------------------------
def test_body_buffers_pick_the_smallest_that_fits_else_the_largest() -> None:
    buffers = BodyBuffers()
    small, large = buffers.take(100), buffers.take(1000)
    assert isinstance(small, mmap.mmap) and (len(small), len(large)) == (100, 1000)
    buffers.give_back(small)
    buffers.give_back(large)
    assert buffers.take(50) is small and len(small) == 50
    buffers.give_back(small)
    grown = buffers.take(5000)  # none fits: the largest, resized
    assert grown is large and len(grown) == 5000
    grown[4990:5000] = b"0123456789"
    assert grown[4990:5000] == b"0123456789"


def test_body_buffers_keep_at_most_keep_bytes_and_ignore_what_is_not_theirs() -> None:
    buffers = BodyBuffers(keep_bytes=1500)
    first, second = buffers.take(1000), buffers.take(1000)
    buffers.give_back(first)
    buffers.give_back(second)  # over keep_bytes: dropped
    buffers.give_back(b"bytes")
    buffers.give_back(bytearray(10))
    assert buffers.take(1000) is first
    assert buffers.take(1000) is not second
