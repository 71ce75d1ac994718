"""Every error in the gateway's JSON schema, including those no route raises: unknown paths (404 ``not_found``),
wrong methods (405 ``method_not_allowed``, with ``Allow``) and unhandled exceptions (500 ``internal_error``).

Starlette answers the first two with its own ``HTTPException`` (FastAPI renders ``{"detail": ...}``) and the last
with a plain-text 500 from uvicorn; here they become ``GatewayError`` bodies like every other error.
"""

from __future__ import annotations

import logging
import uuid

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, InvalidRequest, MethodNotAllowed, NotFound
from gateway.responses import json_response

log = logging.getLogger("gateway")
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def error_response(exc: GatewayError) -> Response:
    response = json_response(exc.to_body(), status_code=exc.status_code)
    response.headers.update(exc.response_headers())
    return response


def from_http_exception(request: Request, exc: HTTPException) -> GatewayError:
    """Starlette's routing errors as gateway errors."""
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        return NotFound(f"no route {path!r}", path=path)
    if exc.status_code == 405:
        allow = allowed_methods(request)
        return MethodNotAllowed(f"{path} does not take {method} (it takes {', '.join(allow)})", allow=allow)
    if exc.status_code < 500:
        return InvalidRequest(str(exc.detail), status_code=exc.status_code)
    return GatewayError(str(exc.detail), status_code=exc.status_code)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route takes on this path, found by asking the router whether each method would match:
    Starlette's own ``Allow`` names only the methods of the first route whose path matched, which is wrong when
    several routes share a path (``GET`` and ``DELETE /v1/sessions/{id}``)."""
    routes = request.app.router.routes
    return [
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    ]


class InternalErrorMiddleware:
    """The outermost layer: an exception no other layer handled becomes a 500 ``internal_error`` whose message says
    nothing of the gateway's internals; the log gets the traceback under a reference the caller also gets.

    A ``GatewayError`` that escaped a middleware is rendered as itself. When the response has started (a stream),
    nothing can be sent any more: the exception is logged and uvicorn closes the connection. A client that hung up
    before its body arrived (``ClientDisconnect``) is no error of the gateway's: nothing is sent or logged above
    debug.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except ClientDisconnect:
            # The client hung up mid-body: there is nobody to answer, and nothing went wrong here (MetricsMiddleware
            # counts it).
            log.debug("%s %s: the client hung up before its request was answered", scope["method"], scope["path"])
        except Exception as exc:
            error = exc if isinstance(exc, GatewayError) else self._internal_error(scope, exc)
            if not started:
                await error_response(error)(scope, receive, send)
            elif error is exc:
                log.warning("%s %s: %s after the response started", scope["method"], scope["path"], error.error_type)

    @staticmethod
    def _internal_error(scope: Scope, exc: Exception) -> GatewayError:
        reference = uuid.uuid4().hex[:12]
        log.error("%s %s -> 500 internal_error (reference %s)", scope["method"], scope["path"], reference, exc_info=exc)
        return GatewayError(f"internal error (reference {reference} in the gateway log)", reference=reference)
