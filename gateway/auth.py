"""API-key authentication: one pure-ASGI middleware in front of every route.

It sits outside ``PassthroughMiddleware`` (which serves the SGLang routes before FastAPI's layers) and outside
FastAPI's routing, so no request without a valid key reaches a route, streamed or not: a refused request is
answered 401 here and its body is never read. Pure ASGI rather than ``BaseHTTPMiddleware``: one header scan per
request, no extra task, no wrapping of streamed responses.

The middleware holds the keys only as HMAC digests under a per-process random secret (``KeyRing``): comparing a
presented key costs the same whichever key matches and whatever the lengths involved.

The session inspector (``gateway.routes.ui``) runs in a browser, which cannot send a header on a page load and must
never hold the key where scripts (or a URL) could read it. Its login form sends the key once, in a header, to
``POST /ui/login``, which answers with a cookie (``UI_COOKIE``: HttpOnly, SameSite=Strict) holding not the key but
``cookie_token(key)``, an HMAC of it: every replica can check it (no server-side state), and a key removed from
``GATEWAY_API_KEY`` ends its cookies. The cookie stands in for the key only for what the inspector does
(``UiAccess``): reads (GET/HEAD) of the session list and views, the UI's data routes, and the logout. Anything that
changes a session needs the header, so a forged cross-site request could do nothing with the cookie even if a
browser sent it. The inspector's pages and static files are open: they hold no session data.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from starlette.requests import Request, cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized
from gateway.http_errors import error_response
from gateway.limits import ErrorHandler

log = logging.getLogger("gateway.auth")

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# Open paths are open to reads only: any other method on them needs the key like every route.
_OPEN_METHODS = frozenset({"GET", "HEAD"})
_AUTHORIZATION = b"authorization"
_X_API_KEY = b"x-api-key"
_BEARER = b"bearer"  # compared lower-cased: an auth scheme is case-insensitive (RFC 9110 section 11.1)
_SPACES = b" \t"
_COOKIE = b"cookie"

UI_COOKIE = "slime_gateway_ui"
_COOKIE_CONTEXT = b"slime-gateway inspector cookie v1"


def cookie_token(key: bytes) -> str:
    """What the inspector's cookie holds for ``key``: not the key, a digest of it that only the key produces."""
    return hmac.new(key, _COOKIE_CONTEXT, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class UiAccess:
    """Where the session inspector needs no key (its pages: static shells) and where its cookie stands in for one."""

    open_reads: tuple[str, ...] = ("/ui/static/", "/ui/sessions/")  # path prefixes, GET/HEAD
    open_pages: frozenset[str] = frozenset({"/ui", "/ui/"})
    cookie_reads: tuple[str, ...] = ("/ui/api/", "/v1/sessions/")  # path prefixes, GET/HEAD
    cookie_read_paths: frozenset[str] = frozenset({"/v1/sessions"})
    cookie_posts: frozenset[str] = frozenset({"/ui/logout"})

    def is_open(self, method: str, path: str) -> bool:
        return method in _OPEN_METHODS and (path in self.open_pages or path.startswith(self.open_reads))

    def takes_cookie(self, method: str, path: str) -> bool:
        if method in _OPEN_METHODS:
            return path in self.cookie_read_paths or path.startswith(self.cookie_reads)
        return method == "POST" and path in self.cookie_posts


class KeyRing:
    """The accepted keys (several during a rotation), compared in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._secret = secrets.token_bytes(32)
        self._digests = tuple(self._digest(key.encode()) for key in keys)
        if not self._digests:
            raise ValueError("a KeyRing needs at least one key")
        self._cookie_digests = tuple(self._digest(cookie_token(key.encode()).encode()) for key in keys)

    def __repr__(self) -> str:
        return f"KeyRing(<{len(self._digests)} keys>)"

    def _digest(self, value: bytes) -> bytes:
        return hmac.new(self._secret, value, hashlib.sha256).digest()

    def matches(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the keys. Both sides are 32-byte digests (``compare_digest`` on raw
        values would return early on a length mismatch), and every key is compared: no early exit on a match."""
        return self._among(presented, self._digests)

    def matches_cookie(self, presented: bytes) -> bool:
        """Whether ``presented`` is the inspector cookie (``cookie_token``) of one of the keys."""
        return self._among(presented, self._cookie_digests)

    def _among(self, presented: bytes, digests: tuple[bytes, ...]) -> bool:
        digest = self._digest(presented)
        found = False
        for key in digests:
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


def presented_cookie(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The inspector cookie's value, if the request has one (Starlette's cookie parser, as ``Request.cookies``)."""
    for name, value in headers:
        if name == _COOKIE:
            token = cookie_parser(value.decode("latin-1")).get(UI_COOKIE)
            if token:
                return token.encode("latin-1")
    return None


def _x_api_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    values = [value.strip(_SPACES) for name, value in headers if name == _X_API_KEY]
    if not values:
        raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'", reason="missing")
    if len(values) > 1 or not values[0] or b" " in values[0] or b"\t" in values[0]:
        raise Unauthorized("malformed x-api-key header", reason="malformed")
    return values[0]


class AuthMiddleware:
    """Answers 401 to any request without a valid key, except reads of ``open_paths`` (``/health``, and
    ``/metrics`` unless it is protected) and of the inspector's pages; the inspector's cookie is a key where ``ui``
    says. Install it as the outermost layer that can refuse (inside the metrics middleware only, so refusals are
    counted)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        open_paths: Collection[str] = (HEALTH_PATH,),
        ui: UiAccess = UiAccess(),
        on_error: ErrorHandler | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)
        self.ui = ui
        self.on_error = on_error  # renders the 401 (the chat routes' in their API's shape); default: the gateway's

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        try:
            self._check(scope)
        except Unauthorized as exc:
            await self._refuse(scope, receive, send, exc)
            return
        await self.app(scope, receive, send)

    def _is_open(self, scope: Scope) -> bool:
        if scope["type"] != "http":
            return False
        method, path = scope["method"], scope["path"]
        return (method in _OPEN_METHODS and path in self.open_paths) or self.ui.is_open(method, path)

    def _check(self, scope: Scope) -> None:
        """A key header decides when there is one; without one, the inspector's cookie where it counts."""
        headers = scope["headers"]
        try:
            key = presented_key(headers)
        except Unauthorized as missing:
            cookie = presented_cookie(headers) if missing.details.get("reason") == "missing" else None
            if cookie is None or scope["type"] != "http" or not self.ui.takes_cookie(scope["method"], scope["path"]):
                raise
            if not self.keys.matches_cookie(cookie):
                raise Unauthorized("invalid or expired inspector cookie: log in again", reason="invalid_key") from None
            return
        if not self.keys.matches(key):
            raise Unauthorized("invalid API key", reason="invalid_key")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, exc: Unauthorized) -> None:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "?"
        # Never the presented value: a near-miss key in a log is a leaked key.
        log.info("refused %s %s from %s: %s", scope.get("method", "WEBSOCKET"), scope["path"], where, exc.message)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation; the server answers 403
            return
        if self.on_error is None:
            await error_response(exc)(scope, receive, send)  # with its WWW-Authenticate challenge
            return
        response = await self.on_error(Request(scope, receive), exc)
        await response(scope, receive, send)
