"""The request body limit: one pure-ASGI middleware in front of every route (v1 and passthrough alike).

A body larger than ``max_request_bytes`` is refused with 413 ``request_too_large``: up front when its
Content-Length says so (no route reads any of it), otherwise as soon as the bytes received pass the limit, so no
route ever holds more than the limit plus one network read.

The connection stays open: uvicorn reads the rest of the body and drops it. Closing instead would make the kernel
reset the connection (unread bytes in its receive buffer), and a client still sending would often lose the 413 and
see only a reset. ``gateway.connections`` bounds how long: a body that has not ended ``header_timeout_s`` after
the 413 is cut (the connection closed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import RequestTooLarge

SETTING = "GATEWAY_MAX_REQUEST_BYTES"
_CONTENT_LENGTH = b"content-length"

ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length, or None (chunked, or absent; uvicorn's parser already refused a malformed one)."""
    for name, value in headers:
        if name == _CONTENT_LENGTH:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"the request body is larger than {limit} bytes", setting=SETTING, limit=limit)


class RequestBodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes``; ``on_error`` renders the ``RequestTooLarge`` as the app's
    exception handler would (its JSON body, metrics and headers)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: ErrorHandler) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope["headers"])
        if length is not None and length > self.max_bytes:
            response = await self.on_error(Request(scope, receive), too_large(self.max_bytes))
            await response(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        """``receive`` that raises ``RequestTooLarge`` (a ``GatewayError``: every route renders it) once the body
        passes the limit, before the route sees the chunk that did it."""
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        return limited
