"""The app factory: settings in, a FastAPI app out; every resource is owned by the lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError

from gateway import __version__
from gateway.config import Settings
from gateway.errors import GatewayError, InvalidRequest
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.responses import json_response
from gateway.routes import health, passthrough, sessions
from gateway.routes import metrics as metrics_route
from gateway.state import GatewayState
from gateway.store import SessionStore
from gateway.upstream import Upstream

log = logging.getLogger("gateway")


def create_app(settings: Settings) -> FastAPI:
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = GatewayState(
            settings=settings,
            upstream=Upstream(
                settings.upstream_base,
                timeout_s=settings.request_timeout_s,
                connect_timeout_s=settings.connect_timeout_s,
                pool_timeout_s=settings.pool_timeout_s,
                max_connections=settings.max_connections,
                keepalive_s=settings.upstream_keepalive_s,
                metrics=metrics,
            ),
            store=SessionStore(settings.max_sessions),
            cpu_pool=ThreadPoolExecutor(settings.decode_threads, thread_name_prefix="gateway-decode"),
            metrics=metrics,
        )
        metrics.track_store(
            sessions=lambda: len(state.store),
            running=lambda: sum(1 for s in state.store if s.busy),
            stored=lambda: state.store.stored_bytes,
        )
        app.state.gateway = state
        # Everything alive now (modules, FastAPI, pydantic: ~70k objects) lives as long as the process: out of the
        # collector's sight, a full collection (triggered by the thousands of small lists of each decoded answer)
        # costs microseconds instead of ~25 ms with the GIL held, i.e. a ~25 ms event-loop stall.
        gc.freeze()
        sweeper = asyncio.create_task(_expire_idle_sessions(state), name="session-ttl")
        log.info("gateway %s (instance %s) -> upstream %s", __version__, state.instance_id, settings.upstream_base)
        try:
            yield
        finally:
            sweeper.cancel()
            await state.aclose()

    app = FastAPI(title="slime-gateway", version=__version__, lifespan=lifespan)
    # The last added is the outermost: the passthrough fast path runs inside the metrics middleware.
    app.add_middleware(passthrough.PassthroughMiddleware, on_error=_gateway_error)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.include_router(health.router)
    app.include_router(metrics_route.router)
    app.include_router(passthrough.router)
    app.include_router(sessions.router)
    return app


async def _expire_idle_sessions(state: GatewayState) -> None:
    ttl = state.settings.session_idle_ttl_s
    if not ttl:
        return
    while True:
        await asyncio.sleep(min(60.0, ttl / 4))
        expired = state.store.expire_idle(ttl)
        if expired:
            log.info("expired %d sessions idle for more than %.0fs", len(expired), ttl)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    request.app.state.gateway.metrics.record_error(exc)
    if exc.status_code >= 500:
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code, exc.error_type, exc)
    return json_response(exc.to_body(), status_code=exc.status_code)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    problems = [_describe(err) for err in exc.errors()]
    error = InvalidRequest("invalid request: " + "; ".join(problems), errors=problems)
    return json_response(error.to_body(), status_code=error.status_code)


def _describe(err: dict) -> str:
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    return f"{where}: {err.get('msg', 'invalid')}"
