"""``python -m bench.canned_server --port P``: an HTTP/1.1 server that answers with prepared bytes, at no CPU cost.

``GET /bytes/N`` answers N bytes with a Content-Length; ``GET /events/N`` answers about N bytes as a chunked
``text/event-stream`` of 256 KiB events; anything else (``/health``) answers ``{}``. Bodies are built once per size
and then only written, so a client measured against it pays for receiving, not for the server. Requests are parsed
by llhttp (httptools).
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\n%s\r\n"
EVENT_BYTES = 256 * 1024


def content_length_answer(size: int) -> bytes:
    body = b'{"x":"' + b"A" * max(0, size - 8) + b'"}'
    return HEAD % (b"application/json", b"content-length: %d\r\n" % size) + body[:size]


def event_stream_answer(size: int) -> bytes:
    event = b"data: " + b"B" * (EVENT_BYTES - 8) + b"\n\n"
    chunks = [b"%x\r\n%s\r\n" % (len(event), event) for _ in range(max(1, size // len(event)))]
    return HEAD % (b"text/event-stream", b"transfer-encoding: chunked\r\n") + b"".join(chunks) + b"0\r\n\r\n"


def head_length(answer: bytes) -> int:
    return answer.index(b"\r\n\r\n") + 4


class _Canned(asyncio.Protocol):
    cache: dict[bytes, bytes] = {}  # noqa: RUF012 (one process, one cache of prepared answers)

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_message_complete(self) -> None:
        url, self._url = self._url, b""
        answer = self.cache.get(url)
        if answer is None:
            kind, _, size = url.strip(b"/").partition(b"/")
            builders = {b"events": event_stream_answer, b"bytes": content_length_answer}
            answer = self.cache[url] = builders.get(kind, content_length_answer)(int(size or 2))
        assert self._transport is not None
        self._transport.write(answer)


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Canned, "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.canned_server", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    uvloop.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
