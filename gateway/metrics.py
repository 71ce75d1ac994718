"""Prometheus metrics, one registry per app (no process-global state), and the ASGI middleware that times routes.

The middleware is plain ASGI rather than ``BaseHTTPMiddleware``: it adds no task or body copy to the
passthrough's hot path, and it sees streamed responses end to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, UpstreamError

# nginx's status for a request whose client closed the connection before the answer: no response was sent.
CLIENT_CLOSED_REQUEST = 499
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DECODE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "HTTP requests served, by route template and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "gateway_request_duration_seconds",
            "Time to serve a request (streams: until the last byte)",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "gateway_upstream_duration_seconds",
            "Upstream call latency (streams: until the response headers)",
            ["call"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Upstream failures by kind (the gateway error type)", ["kind"], registry=r
        )
        self.replay_failures = Counter(
            "gateway_replay_validation_failures",
            "Upstream answers rejected by validation, by reason",
            ["reason"],
            registry=r,
        )
        self.decode_seconds = Histogram(
            "gateway_decode_duration_seconds",
            "Time to decode and validate one upstream answer",
            ["kind"],
            buckets=DECODE_BUCKETS,
            registry=r,
        )
        self.decode_bytes = Counter("gateway_decoded_bytes", "Upstream answer bytes decoded", ["kind"], registry=r)
        self.turns = Counter(
            "gateway_turns", "Session turns folded, by kind and outcome", ["kind", "outcome"], registry=r
        )
        self.folded_tokens = Counter("gateway_folded_tokens", "Tokens folded into sessions", ["trainable"], registry=r)
        self.turn_resumes = Counter(
            "gateway_turn_resumes",
            "Model turns resubmitted after the engine aborted them mid-answer (a weight update's pause), by mode "
            "(unary, stream); a turn resumed twice counts twice",
            ["mode"],
            registry=r,
        )
        self.resumed_tokens = Counter(
            "gateway_resumed_tokens",
            "Tokens generated before an engine abort and carried into the resumed turn (not generated again)",
            registry=r,
        )
        self.turns_interrupted = Counter(
            "gateway_turns_interrupted",
            "Model turns that ended before the model ended them, by reason: aborted (the trainer or the client "
            "ended it), or an engine abort not resumed (resume_max, deadline, refused, resume_failed, "
            "max_session_tokens, off, engine_abort)",
            ["reason"],
            registry=r,
        )
        self.chat_turns = Counter(
            "gateway_chat_turns",
            "Chat turns (OpenAI chat, Anthropic messages, OpenAI responses), by API, mode and finish",
            ["api", "mode", "finish"],
            registry=r,
        )
        self.client_disconnected = Counter(
            "gateway_client_disconnected",
            "Requests whose client hung up before they were answered (its body cut short, or gone while the gateway "
            "worked): nothing could be sent; counted as status 499 in gateway_requests",
            ["route", "method"],
            registry=r,
        )
        self.chat_drift = Counter(
            "gateway_chat_drift",
            "Chat requests that did not simply extend a branch's record, by cause: edited_history (forked from a "
            "message the model wrote), new_root (nothing in common: a new root branch), rewrite (the template renders "
            "earlier messages differently once new ones follow)",
            ["cause"],
            registry=r,
        )
        self.chat_tool_parse_failures = Counter(
            "gateway_chat_tool_parse_failures",
            "Completions with tool-call markup the tool parser could not read (returned as the model's text)",
            ["parser"],
            registry=r,
        )

        self.sessions_closed = Counter(
            "gateway_sessions_closed",
            "Sessions closed for their samples (POST /v1/sessions/{id}/close), by outcome: drained (no turn left), "
            "busy (a turn still held it after the wait and the abort)",
            ["outcome"],
            registry=r,
        )
        self.chat_refused = Counter(
            "gateway_chat_refused",
            "Chat requests refused by a session's own caps or state: closed, turn_limit, context_budget",
            ["reason"],
            registry=r,
        )

    def track_store(self, sessions: Callable[[], int], running: Callable[[], int], stored: Callable[[], int]) -> None:
        self.registry.register(_StoreCollector(sessions, running, stored))

    def track_connections(self, open_now: Callable[[], int], closed: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_ConnectionCollector(open_now, closed))

    def record_error(self, exc: GatewayError) -> None:
        if isinstance(exc, UpstreamError):
            self.upstream_errors.labels(exc.error_type).inc()
            reason = exc.details.get("reason") or exc.details.get("missing")
            if exc.error_type in ("upstream_protocol_error", "replay_data_dropped"):
                self.replay_failures.labels(str(reason or exc.error_type)).inc()

    def observe_decode(self, kind: str, size: int, seconds: float) -> None:
        self.decode_seconds.labels(kind).observe(seconds)
        self.decode_bytes.labels(kind).inc(size)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    """Session gauges read at scrape time from the counters the store keeps (O(1): no walk over the sessions)."""

    def __init__(self, sessions: Callable[[], int], running: Callable[[], int], stored: Callable[[], int]) -> None:
        self._sessions, self._running, self._stored = sessions, running, stored

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily("gateway_sessions_stored", "Sessions held by this gateway", value=self._sessions())
        yield GaugeMetricFamily("gateway_sessions_active", "Sessions with a turn running", value=self._running())
        yield GaugeMetricFamily(
            "gateway_stored_bytes", "Bytes of session arrays held (slack included)", value=self._stored()
        )


class _ConnectionCollector(Collector):
    """Client connections (``gateway.connections``), read at scrape time."""

    def __init__(self, open_now: Callable[[], int], closed: Callable[[], dict[str, int]]) -> None:
        self._open, self._closed = open_now, closed

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("gateway_client_connections", "Client connections open", value=self._open())
        closed = CounterMetricFamily(
            "gateway_client_connections_closed",
            "Client connections the gateway closed: head or body not complete in time, evicted for a new one at the "
            "cap (idle, or mid-body), refused at the cap",
            labels=["reason"],
        )
        for reason, count in self._closed().items():
            closed.add_metric([reason], count)
        yield closed


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except ClientDisconnect:
            status = CLIENT_CLOSED_REQUEST
            self.metrics.client_disconnected.labels(_route(scope), scope["method"]).inc()
            raise
        finally:
            route = _route(scope)
            method = scope["method"]
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.request_seconds.labels(route, method).observe(time.perf_counter() - started)


def _route(scope: Scope) -> str:
    return getattr(scope.get("route"), "path", "unmatched")
