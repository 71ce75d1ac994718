"""A raw-TCP fake upstream for protocol tests: it answers each request with whatever bytes its test scripts.

    with RawUpstream() as upstream:                     # a server on 127.0.0.1, in a thread of its own
        upstream.reply = lambda req: [http_response(sglang_answer(req))]
        ...                                             # point a gateway at upstream.url
        upstream.reply = lambda req: [b"HTTP/1.1 200 OK\\r\\nContent-Length: -10\\r\\n\\r\\n", CLOSE]
        assert upstream.requests[-1].path == "/generate"

A reply is a list of steps, run in order on the request's connection: ``bytes`` are written, a ``float`` is slept,
``CLOSE`` closes the connection at once (``RESET`` aborts it with a TCP reset). Requests are parsed with llhttp
(httptools), so the fake itself never misreads what the gateway sends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
import numpy as np
import orjson

CLOSE = "close"
RESET = "reset"
Step = bytes | float | str
Reply = Callable[["RawRequest"], list[Step]]


@dataclass
class RawRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int  # which connection it came on (1, 2, ...): tells reuse apart from fresh connections

    @property
    def json(self) -> Any:
        return orjson.loads(self.body) if self.body else None


def http_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None, *, reason: str = "OK"
) -> bytes:
    """A well-formed HTTP/1.1 answer with a Content-Length."""
    head = {"content-type": "application/json", "content-length": str(len(body)), **(headers or {})}
    lines = "".join(f"{name}: {value}\r\n" for name, value in head.items())
    return f"HTTP/1.1 {status} {reason}\r\n{lines}\r\n".encode() + body


def chunked(*pieces: bytes) -> bytes:
    """A chunked body of ``pieces``, with its last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"


def sglang_answer(
    request: RawRequest,
    *,
    tokens: int = 2,
    first_token: int = 10,
    num_layers: int = 0,
    topk: int = 0,
    rid: str | None = None,
    finish: dict[str, Any] | None = None,
) -> bytes:
    """A valid SGLang ``/generate`` answer to ``request`` (routing rows when it asks for them)."""
    asked = request.json or {}
    prompt = len(asked.get("input_ids", []))
    ids = list(range(first_token, first_token + tokens))
    meta: dict[str, Any] = {
        "id": asked.get("rid") if rid is None else rid,
        "finish_reason": finish or {"type": "length", "length": tokens},
        "prompt_tokens": prompt,
        "completion_tokens": tokens,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.5, token, None] for token in ids],
    }
    if asked.get("return_routed_experts") and num_layers:
        start = asked.get("routed_experts_start_len", 0)
        rows = prompt + tokens - 1 - start
        routing = (np.arange(rows * num_layers * topk) % 4).astype("<i4").tobytes()
        meta["routed_experts"] = base64.b64encode(routing).decode()
    return orjson.dumps({"text": "".join(f" w{t}" for t in ids), "output_ids": ids, "meta_info": meta})


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class RawUpstream:
    """The server. ``reply`` (settable any time) scripts the answer to each request; ``requests`` lists them."""

    def __init__(self, reply: Reply | None = None, *, port: int = 0) -> None:
        self.reply: Reply = reply or (lambda request: [http_response(sglang_answer(request))])
        self.requests: list[RawRequest] = []
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="raw-upstream", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = port  # 0: any free port, known once it listens

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self._loop
        ).result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def drop_connections(self) -> None:
        """Close every open connection (the next request needs a new one)."""
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(5)

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._close_all()

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._writers.add(writer)
        parsed: list[RawRequest] = []
        collector = _Collector(parsed, number)
        parser = collector.parser = httptools.HttpRequestParser(collector)
        try:
            while data := await reader.read(1 << 16):
                parser.feed_data(data)
                while parsed:
                    request = parsed.pop(0)
                    self.requests.append(request)
                    if not await self._run(self.reply(request), writer):
                        return
        except (httptools.HttpParserError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()

    @staticmethod
    async def _run(steps: list[Step], writer: asyncio.StreamWriter) -> bool:
        """Run a reply's steps; False once the connection is closed."""
        sock = writer.get_extra_info("socket")
        for number, step in enumerate(steps):
            if isinstance(step, bytes):
                if steps[number + 1 : number + 2] == [CLOSE]:
                    # Bytes and the close that follows them leave together, as from a server that closes in the
                    # same breath: this thread can lose the GIL between two syscalls for milliseconds, which a
                    # server process of its own does not.
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
                writer.write(step)
                await writer.drain()
            elif isinstance(step, float | int):
                await asyncio.sleep(step)
            elif step == CLOSE:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # now, not at this thread's next loop turn (writer.close)
                writer.close()
                return False
            elif step == RESET:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return False
        return True


@dataclass
class _Collector:
    """httptools callbacks: complete requests go to ``out``."""

    out: list[RawRequest]
    connection: int
    _url: bytes = b""
    _headers: dict[str, str] = field(default_factory=dict)
    _body: list[bytes] = field(default_factory=list)
    parser: Any = None

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self.out.append(RawRequest(method, self._url.decode(), self._headers, b"".join(self._body), self.connection))
        self._url, self._headers, self._body = b"", {}, []
