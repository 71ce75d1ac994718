"""The one upstream transport (SGLang router or server) and its error translation boundary.

Everything the gateway sends upstream (passthrough calls, unary and streamed turns, aborts) goes through one
``slime_wire.http1.ConnectionPool``: llhttp parses every answer, the pool owns deadlines, slots and the rule for
sending again (see that module for the measurements behind it). Transport errors become gateway errors here, and
only here, in ``translated``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import (
    GatewayError,
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from slime_wire.errors import (
    ConnectionLost,
    NotSent,
    ProtocolViolation,
    ResponseTimeout,
    TransportError,
)
from slime_wire.http1 import Body, BodyBuffers, ConnectionPool, Response

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# Request headers a passthrough forwards; everything else (host, content-length, ...) is the client's own. Never
# ``authorization``: the caller's key is for the gateway; the upstream gets the gateway's own (``api_key``).
FORWARDED_REQUEST_HEADERS = ("content-type", "accept")
_ROUTING_KEY_BYTES = ROUTING_KEY_HEADER.encode()
_JSON = (b"content-type", b"application/json")
ABORT_TIMEOUT_S = 2.0


class Upstream:
    """The pooled connections to the upstream; created and closed by the app lifespan."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        pool_timeout_s: float,
        max_connections: int,
        keepalive_s: float,
        metrics: GatewayMetrics | None = None,
        api_key: str | None = None,
    ) -> None:
        """``api_key``: the upstream's own key (SGLang's ``--api-key``), sent as a bearer token on every request."""
        self.base_url = base_url
        self._auth: tuple[tuple[bytes, bytes], ...] = (
            ((b"authorization", b"Bearer " + api_key.encode()),) if api_key else ()
        )
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.buffers = BodyBuffers()
        self.pool = ConnectionPool(
            base_url,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            pool_timeout_s=pool_timeout_s,
            keepalive_expiry_s=keepalive_s,
            buffers=self.buffers,
            user_agent=b"slime-gateway",
        )

    async def aclose(self) -> None:
        await self.pool.aclose()

    def recycle(self, body: object) -> None:
        """Give back the buffer of a big answer (``post_generate``, a big stream event) once nothing uses it."""
        self.buffers.give_back(body)

    async def forward(
        self,
        method: str,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        *,
        timeout_s: float | None = None,
    ) -> Response:
        """A passthrough call: the upstream's answer with its body still to read (read it through ``read`` or
        ``relay``; the caller closes it). HEAD goes upstream as GET: the ASGI server drops the body. ``timeout_s``:
        the call's deadline (default ``timeout_s``, GATEWAY_REQUEST_TIMEOUT_S)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self.translated():
            return await self.pool.request(
                "GET" if method == "HEAD" else method, target, [*headers, *self._auth], body, timeout=timeout
            )

    async def read(self, response: Response) -> Body:
        with self.translated():
            return await response.read()

    async def relay(self, response: Response) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; the response is closed however the iteration ends."""
        try:
            with self.translated():
                async for piece in response.iter_raw():
                    yield piece
        finally:
            await response.aclose()

    async def post_generate(self, body: bytes, *, routing_key: str | None, timeout_s: float | None = None) -> Body:
        """A non-streamed ``/generate`` for a session turn: the answer's bytes (give big ones back with
        ``recycle``), or a ``GatewayError``."""
        started = time.perf_counter()
        try:
            headers = self._generate_headers(routing_key)
            response = await self.forward("POST", b"/generate", headers, body, timeout_s=timeout_s)
            try:
                content = await self.read(response)
            finally:
                await response.aclose()
        finally:
            self._observe("generate", started)
        if response.status >= 400:
            raise status_error(response.status, bytes(content))
        return content

    async def open_generate_stream(
        self, body: bytes, *, routing_key: str | None, timeout_s: float | None = None
    ) -> Response:
        """A streamed ``/generate``: the open response (status checked), which the caller must close."""
        headers = [*self._generate_headers(routing_key), (b"accept", b"text/event-stream")]
        started = time.perf_counter()
        try:
            response = await self.forward("POST", b"/generate", headers, body, timeout_s=timeout_s)
        finally:
            self._observe("generate_stream", started)
        if response.status >= 400:
            try:
                content = await self.read(response)
            finally:
                await response.aclose()
            raise status_error(response.status, bytes(content))
        return response

    async def abort_request(self, rid: str) -> bool:
        """Best effort: SGLang workers abort a rid; routers have no such route (closing the connection aborts)."""
        try:
            response = await self.pool.request(
                "POST", b"/abort_request", [_JSON, *self._auth], orjson.dumps({"rid": rid}), timeout=ABORT_TIMEOUT_S
            )
            try:
                await response.read()
            finally:
                await response.aclose()
        except TransportError:
            return False
        return response.status < 400

    @staticmethod
    def _generate_headers(routing_key: str | None) -> list[tuple[bytes, bytes]]:
        headers = [_JSON]
        if routing_key:
            headers.append((_ROUTING_KEY_BYTES, routing_key.encode()))
        return headers

    @contextmanager
    def translated(self) -> Iterator[None]:
        """Transport errors -> gateway errors: the one place they are translated."""
        try:
            yield
        except TransportError as exc:
            raise translate_transport_error(exc, self.base_url) from exc

    def _observe(self, call: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.upstream_seconds.labels(call).observe(time.perf_counter() - started)


def translate_transport_error(exc: TransportError, base_url: str) -> GatewayError:
    """Only failures before the request left are 503 (safe to retry); the rest may have run upstream."""
    if isinstance(exc, NotSent):
        return UpstreamUnavailable(f"upstream {base_url} is unreachable: {exc}")
    if isinstance(exc, ResponseTimeout):
        return UpstreamTimeout(f"upstream {base_url} did not answer in time: {exc}")
    if isinstance(exc, ProtocolViolation):
        return UpstreamProtocolError(f"upstream {base_url} broke the HTTP protocol: {exc}", reason="http_framing")
    if isinstance(exc, ConnectionLost):
        return UpstreamConnectionLost(f"connection to upstream {base_url} lost after the request was sent: {exc}")
    return UpstreamError(f"upstream request failed: {exc}")


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
