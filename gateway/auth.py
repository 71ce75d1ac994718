"""API-key authentication: one pure-ASGI middleware in front of every route.

It sits outside ``PassthroughMiddleware`` (which serves the SGLang routes before FastAPI's layers) and outside
FastAPI's routing, so no request without a valid key reaches a route, streamed or not: a refused request is
answered 401 here and its body is never read. Pure ASGI rather than ``BaseHTTPMiddleware``: one header scan per
request, no extra task, no wrapping of streamed responses.

The middleware holds the keys only as HMAC digests under a per-process random secret (``KeyRing``): comparing a
presented key costs the same whichever key matches and whatever the lengths involved.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Collection, Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized
from gateway.http_errors import error_response

log = logging.getLogger("gateway.auth")

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# Open paths are open to reads only: any other method on them needs the key like every route.
_OPEN_METHODS = frozenset({"GET", "HEAD"})
_AUTHORIZATION = b"authorization"
_X_API_KEY = b"x-api-key"
_BEARER = b"bearer"  # compared lower-cased: an auth scheme is case-insensitive (RFC 9110 section 11.1)
_SPACES = b" \t"


class KeyRing:
    """The accepted keys (several during a rotation), compared in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._secret = secrets.token_bytes(32)
        self._digests = tuple(self._digest(key.encode()) for key in keys)
        if not self._digests:
            raise ValueError("a KeyRing needs at least one key")

    def __repr__(self) -> str:
        return f"KeyRing(<{len(self._digests)} keys>)"

    def _digest(self, value: bytes) -> bytes:
        return hmac.new(self._secret, value, hashlib.sha256).digest()

    def matches(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the keys. Both sides are 32-byte digests (``compare_digest`` on raw
        values would return early on a length mismatch), and every key is compared: no early exit on a match."""
        digest = self._digest(presented)
        found = False
        for key in self._digests:
            found |= hmac.compare_digest(digest, key)
        return found


def presented_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The key of ``Authorization: Bearer KEY`` (ASGI header names are lower-case), or ``Unauthorized``.

    Exactly one Authorization header, scheme ``Bearer`` in any case, one token without inner whitespace. Without
    one, an ``x-api-key: KEY`` header (what Anthropic's clients send), exactly one.
    """
    values = [value for name, value in headers if name == _AUTHORIZATION]
    if not values:
        return _x_api_key(headers)
    if len(values) > 1:
        raise Unauthorized("more than one Authorization header", reason="malformed")
    scheme, _, token = values[0].strip(_SPACES).partition(b" ")
    token = token.lstrip(_SPACES)
    if scheme.lower() != _BEARER or not token or b" " in token or b"\t" in token:
        raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'", reason="malformed")
    return token


def _x_api_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    values = [value.strip(_SPACES) for name, value in headers if name == _X_API_KEY]
    if not values:
        raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'", reason="missing")
    if len(values) > 1 or not values[0] or b" " in values[0] or b"\t" in values[0]:
        raise Unauthorized("malformed x-api-key header", reason="malformed")
    return values[0]


class AuthMiddleware:
    """Answers 401 to any request without a valid key, except reads of ``open_paths`` (``/health``, and
    ``/metrics`` unless it is protected). Install it as the outermost layer that can refuse (inside the metrics
    middleware only, so refusals are counted)."""

    def __init__(self, app: ASGIApp, keys: KeyRing, open_paths: Collection[str] = (HEALTH_PATH,)) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        try:
            self._check(scope["headers"])
        except Unauthorized as exc:
            await self._refuse(scope, receive, send, exc)
            return
        await self.app(scope, receive, send)

    def _is_open(self, scope: Scope) -> bool:
        return scope["type"] == "http" and scope["method"] in _OPEN_METHODS and scope["path"] in self.open_paths

    def _check(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        if not self.keys.matches(presented_key(headers)):
            raise Unauthorized("invalid API key", reason="invalid_key")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, exc: Unauthorized) -> None:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "?"
        # Never the presented value: a near-miss key in a log is a leaked key.
        log.info("refused %s %s from %s: %s", scope.get("method", "WEBSOCKET"), scope["path"], where, exc.message)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation; the server answers 403
            return
        await error_response(exc)(scope, receive, send)  # with its WWW-Authenticate challenge
