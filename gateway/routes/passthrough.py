"""SGLang-compatible passthrough: bodies are forwarded as bytes, never parsed or re-serialized.

One exception: ``/abort_request`` with ``{"abort_all": true}`` (slime's end of a rollout, sent to its router URL,
which may be this gateway's) also ends every session turn running in this gateway and, over the shared store, in
every other replica, never resumed (``TurnRunner.abort_all``, ``gateway.fleet``), before it is forwarded.

This is the gateway's overhead on every plain SGLang call, so it is lean: raw ASGI over ``Upstream.forward`` (the
one upstream transport, see ``gateway.upstream``), and ``PassthroughMiddleware`` serves these routes ahead of FastAPI's
exception, routing and dependency layers (~40 us a call). The routes are also registered on the router, which
serves them when the middleware is not installed and answers 405 to other methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import openapi as doc
from gateway.errors import GatewayError
from gateway.fleet import publish_abort
from gateway.state import GatewayState
from gateway.upstream import FORWARDED_REQUEST_HEADERS, ROUTING_KEY_HEADER

SESSION_HEADER = "x-session-id"
ABORT_PATH = "/abort_request"
GATEWAY_WIDE_ABORT = "aborted by /abort_request with abort_all (the trainer's end of a rollout)"
_ABORT_BODY_BYTES = 64 * 1024  # an abort's body is a few bytes: a bigger one is forwarded, not read
POST_PATHS = ("/generate", "/abort_request", "/flush_cache")
GET_PATHS = ("/health_generate", "/get_model_info", "/get_server_info", "/model_info", "/server_info", "/v1/loads")

router = APIRouter(tags=["sglang passthrough"])

_FORWARDED = frozenset(name.encode() for name in FORWARDED_REQUEST_HEADERS)
_ROUTING_KEY = ROUTING_KEY_HEADER.encode()
_ROUTING_KEY_SOURCES = (SESSION_HEADER.encode(), _ROUTING_KEY.lower())


def forwarded_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers the upstream gets (ASGI names are lower-case), plus the routing-affinity key taken
    from ``X-Session-Id`` (or an ``X-SMG-Routing-Key`` the client set itself)."""
    headers: dict[bytes, bytes] = {}
    found = dict.fromkeys(_ROUTING_KEY_SOURCES, b"")
    for name, value in raw:
        if name in _FORWARDED:
            headers.setdefault(name, value)  # the first one, as Starlette's Headers[name] gives
        elif name in found and not found[name]:
            found[name] = value
    out = list(headers.items())
    routing_key = found[_ROUTING_KEY_SOURCES[0]] or found[_ROUTING_KEY_SOURCES[1]]
    if routing_key:
        out.append((_ROUTING_KEY, routing_key))
    return out


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Forward:
    """One passthrough route, as a raw ASGI endpoint."""

    def __init__(self, path: str, methods: frozenset[str]) -> None:
        self.path = path  # what the metrics middleware labels the request with (``scope["route"].path``)
        self.methods = methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.prepare(scope, receive)
        await response(scope, receive, send)

    async def prepare(self, scope: Scope, receive: Receive) -> Response:
        """Forward the request; the response to send. ``GatewayError`` (upstream unreachable, slow, gone) is raised
        before anything was sent; ``ClientDisconnect`` when the client left before its body arrived (nothing went
        upstream)."""
        scope["route"] = self
        state: GatewayState = scope["app"].state.gateway
        body = await read_body(receive)
        if self.path == ABORT_PATH and aborts_all(body):
            # the other replicas' turns too (``gateway.fleet``)
            await publish_abort(state.runner, state.instance_id, GATEWAY_WIDE_ABORT)
            state.runner.abort_all(GATEWAY_WIDE_ABORT)
        target = scope["path"].encode()
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        response = await state.upstream.forward(scope["method"], target, forwarded_headers(scope["headers"]), body)
        media_type = response.content_type
        if media_type and media_type.startswith("text/event-stream"):
            # Each upstream event reaches the client as it arrives; the upstream response is closed when the
            # client's stream ends, normally or not.
            relay = state.upstream.relay(response)
            return StreamingResponse(relay, status_code=response.status, media_type=media_type)
        try:
            content = await state.upstream.read(response)
        finally:
            await response.aclose()
        # A big body arrives in a pooled buffer (an mmap, see ``slime_wire.http1``); a view of it is sent as is.
        body = content if isinstance(content, bytes) else memoryview(content)
        return Response(body, status_code=response.status, media_type=media_type)


ROUTES: dict[str, Forward] = {
    **{path: Forward(path, frozenset({"POST"})) for path in POST_PATHS},
    **{path: Forward(path, frozenset({"GET", "HEAD"})) for path in GET_PATHS},  # HEAD: as Starlette adds to GET
}
for _route in ROUTES.values():
    router.add_route(_route.path, _route, methods=sorted(_route.methods - {"HEAD"}))


def aborts_all(body: bytes) -> bool:
    """Whether an ``/abort_request`` body is SGLang's abort of every request (``{"abort_all": true}``)."""
    if len(body) > _ABORT_BODY_BYTES or b"abort_all" not in body:
        return False
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and parsed.get("abort_all") is True


def document_paths() -> dict[str, Any]:
    """These routes in the OpenAPI document (``gateway.openapi.install``'s ``paths``)."""
    return doc.passthrough_paths(POST_PATHS, GET_PATHS, SESSION_HEADER)


ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class PassthroughMiddleware:
    """Serves the passthrough routes before FastAPI's own layers; every other request goes on to ``app``.

    Install it inside ``MetricsMiddleware`` (so these calls are counted). ``on_error`` renders a
    ``GatewayError`` as the app's exception handler would.
    """

    def __init__(self, app: ASGIApp, on_error: ErrorHandler) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = ROUTES.get(scope["path"])
            if route is not None and scope["method"] in route.methods:
                try:
                    response = await route.prepare(scope, receive)
                except GatewayError as exc:
                    response = await self.on_error(Request(scope, receive), exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
