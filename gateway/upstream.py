"""The one pooled HTTP client to SGLang (router or server), and its error translation boundary."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

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
ABORT_TIMEOUT_S = 2.0


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

    async def aclose(self) -> None:
        await self.client.aclose()

    async def post_generate(self, body: bytes, *, routing_key: str | None) -> bytes:
        """A non-streamed ``/generate`` for a session turn: the raw answer bytes, or a ``GatewayError``."""
        headers = {"content-type": "application/json"}
        if routing_key:
            headers[ROUTING_KEY_HEADER] = routing_key
        started = time.perf_counter()
        try:
            response = await self.client.post("/generate", content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise translate_transport_error(exc, self.base_url) from exc
        finally:
            self._observe("generate", started)
        if response.status_code >= 400:
            raise status_error(response.status_code, response.content)
        return response.content

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
