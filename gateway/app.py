"""The app factory: settings in, a FastAPI app out; every resource is owned by the lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from gateway import __version__, openapi
from gateway.auth import HEALTH_PATH, METRICS_PATH, AuthMiddleware, KeyRing
from gateway.chat.api import error_status
from gateway.chat.service import ChatService, ChatSettings
from gateway.chat.template import ChatTemplate
from gateway.config import Settings, stored_bytes_limit
from gateway.connections import ConnectionGuard
from gateway.drain import CloseWhileDraining, Drain
from gateway.errors import GatewayError, InvalidRequest
from gateway.fleet import FleetListener
from gateway.http_errors import InternalErrorMiddleware, error_response, from_http_exception
from gateway.limits import RequestBodyLimitMiddleware
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.offload import CpuPool
from gateway.responses import json_response
from gateway.routes import chat, fleet, health, passthrough, sessions, ui
from gateway.routes import metrics as metrics_route
from gateway.state import GatewayState
from gateway.store import SessionStore
from gateway.turns import TurnRunner
from gateway.upstream import Upstream

log = logging.getLogger("gateway")


def create_app(settings: Settings, connections: ConnectionGuard | None = None, drain: Drain | None = None) -> FastAPI:
    """``connections``: the guard of the server's client connections (``gateway.connections``), for its metrics;
    ``drain``: whether the server drains (``gateway.drain``, started by its SIGTERM)."""
    metrics = GatewayMetrics()
    drain = drain or Drain()
    if connections is not None:
        metrics.track_connections(open_now=lambda: connections.open, closed=lambda: dict(connections.closed))
    max_stored_bytes = stored_bytes_limit(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        instance_id = uuid.uuid4().hex
        upstream = Upstream(
            settings.upstream_base,
            timeout_s=settings.request_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            pool_timeout_s=settings.pool_timeout_s,
            max_connections=settings.max_connections,
            keepalive_s=settings.upstream_keepalive_s,
            metrics=metrics,
            api_key=settings.upstream_key,
        )
        store = make_store(settings, max_stored_bytes, instance_id)
        cpu = CpuPool(settings.decode_threads, offload_bytes=settings.decode_offload_bytes, metrics=metrics)
        runner = make_runner(settings, upstream, store, cpu, metrics)
        state = GatewayState(settings, upstream, store, cpu, metrics, runner, instance_id=instance_id, drain=drain)
        await state.store.start()
        if settings.tokenizer is not None:
            state.chat = await asyncio.to_thread(load_chat, settings, runner)
        metrics.track_store(
            sessions=lambda: state.store.count,
            running=lambda: state.store.active,
            stored=lambda: state.store.stored_bytes,
        )
        app.state.gateway = state
        # Everything alive now (modules, FastAPI, pydantic: ~70k objects) lives as long as the process: out of the
        # collector's sight, a full collection (triggered by the thousands of small lists of each decoded answer)
        # costs microseconds instead of ~25 ms with the GIL held, i.e. a ~25 ms event-loop stall.
        gc.freeze()
        sweeper = asyncio.create_task(_expire_idle_sessions(state), name="session-ttl")
        fleet = FleetListener(runner, instance_id)
        listener = asyncio.create_task(state.store.listen(fleet.on_message), name="fleet-actions")
        log.info("gateway %s (instance %s) -> upstream %s", __version__, state.instance_id, settings.upstream_base)
        log.info(
            "limits: %d request body bytes, %d tokens per session, %s session bytes in all",
            settings.max_request_bytes,
            settings.max_session_tokens,
            "no limit on" if max_stored_bytes is None else max_stored_bytes,
        )
        try:
            yield
        finally:
            sweeper.cancel()
            listener.cancel()
            await state.aclose()

    app = FastAPI(title="slime-gateway", version=__version__, lifespan=lifespan)
    # The last added is the outermost: internal errors -> metrics -> auth -> body limit -> the passthrough fast path
    # -> FastAPI. Auth refuses before anything serves a route; refusals are still counted.
    app.add_middleware(passthrough.PassthroughMiddleware, on_error=_gateway_error)
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=settings.max_request_bytes, on_error=_gateway_error)
    if settings.api_keys:
        open_paths = (HEALTH_PATH,) if settings.protect_metrics else (HEALTH_PATH, METRICS_PATH)
        app.add_middleware(
            AuthMiddleware, keys=KeyRing(settings.api_keys), open_paths=open_paths, on_error=_gateway_error
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(CloseWhileDraining, drain=drain)
    app.add_middleware(InternalErrorMiddleware)
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.include_router(health.router)
    app.include_router(metrics_route.router)
    app.include_router(passthrough.router)
    app.include_router(sessions.router)
    app.include_router(fleet.router)
    app.include_router(chat.router)
    app.include_router(ui.router)
    # the document the routes describe (gateway.openapi), with the chat routes' msgspec requests and the passthrough's
    openapi.install(app, settings, structs=chat.DOCUMENTED_REQUESTS, paths=passthrough.document_paths())
    return app


def make_runner(
    settings: Settings, upstream: Upstream, store: SessionStore, cpu: CpuPool, metrics: GatewayMetrics
) -> TurnRunner:
    """The one turn runner: the token routes and the chat service run their model turns through it."""
    return TurnRunner(
        upstream,
        store,
        cpu,
        metrics,
        incremental_routing=settings.incremental_routing,
        resume_max=settings.resume_max,
        deadline_s=settings.request_timeout_s,
    )


def make_store(settings: Settings, max_stored_bytes: int | None, instance_id: str) -> SessionStore:
    """The session store ``GATEWAY_STORE`` names: this process's memory, or Redis."""
    if settings.store == "memory":
        return SessionStore(
            settings.max_sessions, max_session_tokens=settings.max_session_tokens, max_stored_bytes=max_stored_bytes
        )
    from gateway.redis_store import RedisSessionStore  # the redis package only where it is used

    return RedisSessionStore(
        settings.store,
        prefix=settings.redis_prefix,
        lease_s=settings.redis_lease_s,
        instance_id=instance_id,
        max_sessions=settings.max_sessions,
        idle_ttl_s=settings.session_idle_ttl_s,
        max_session_tokens=settings.max_session_tokens,
        max_stored_bytes=max_stored_bytes,
        heartbeat_s=settings.redis_heartbeat_s,
        wait_replicas=settings.redis_wait_replicas,
        wait_timeout_ms=settings.redis_wait_timeout_ms,
        retry_s=settings.redis_retry_s,
    )


# transformers' default model_max_length when a tokenizer states none (1e30): not a context length.
_NO_STATED_CONTEXT = 10**12


def load_chat(settings: Settings, runner: TurnRunner) -> ChatService:
    """The chat routes' tokenizer and template (a bad directory stops the start: the operator asked for chat)."""
    assert settings.tokenizer is not None
    template = ChatTemplate.load(settings.tokenizer)
    context = settings.chat_context_tokens
    stated = getattr(template.tokenizer, "model_max_length", None)
    if context is None and isinstance(stated, int) and stated < _NO_STATED_CONTEXT:
        context = stated
    chosen = ChatSettings(
        tool_parser=settings.chat_tool_parser,
        reasoning_parser=settings.chat_reasoning_parser,
        drift_policy=settings.chat_drift_policy,
        rewrite_policy=settings.chat_rewrite_policy,
        context_tokens=context,
        default_max_tokens=settings.chat_default_max_tokens,
        max_tools_bytes=settings.chat_max_tools_bytes,
    )
    log.info(
        "chat: tool parser %s, reasoning parser %s, drift policy %s, rewrite policy %s, context %s tokens, default "
        "answer length %s",
        chosen.tool_parser,
        chosen.reasoning_parser,
        chosen.drift_policy,
        chosen.rewrite_policy,
        "unknown" if context is None else context,
        chosen.default_max_tokens or "the context left",
    )
    return ChatService(template, runner, chosen)


async def _expire_idle_sessions(state: GatewayState) -> None:
    ttl = state.settings.session_idle_ttl_s
    if not ttl:
        return
    while True:
        await asyncio.sleep(min(60.0, ttl / 4))
        expired = await state.store.expire_idle(ttl)
        if expired:
            log.info("expired %d sessions idle for more than %.0fs", len(expired), ttl)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    request.app.state.gateway.metrics.record_error(exc)
    if exc.status_code >= 500:
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code, exc.error_type, exc)
    body = chat.api_error_body(request.url.path, exc)  # under a chat API's prefix: in that API's shape
    if body is None:
        return error_response(exc)
    response = json_response(body, status_code=error_status(exc))  # the chat APIs answer a bad request 400
    response.headers.update(exc.response_headers())
    return response


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return await _gateway_error(request, from_http_exception(request, exc))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    problems = [_describe(err) for err in exc.errors()]
    error = InvalidRequest("invalid request: " + "; ".join(problems), errors=problems)
    return json_response(error.to_body(), status_code=error.status_code)


def _describe(err: dict) -> str:
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    return f"{where}: {err.get('msg', 'invalid')}"
