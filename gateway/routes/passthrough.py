"""SGLang-compatible passthrough: bodies are forwarded as bytes, never parsed or re-serialized."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.state import StateDep
from gateway.upstream import FORWARDED_REQUEST_HEADERS, ROUTING_KEY_HEADER

SESSION_HEADER = "x-session-id"

router = APIRouter(tags=["sglang passthrough"])


async def forward(request: Request, state: StateDep) -> Response:
    headers = {name: request.headers[name] for name in FORWARDED_REQUEST_HEADERS if name in request.headers}
    routing_key = request.headers.get(SESSION_HEADER) or request.headers.get(ROUTING_KEY_HEADER)
    if routing_key:
        headers[ROUTING_KEY_HEADER] = routing_key
    body = await request.body()
    upstream_request = state.upstream.client.build_request(
        request.method, request.url.path, params=request.query_params, content=body, headers=headers
    )
    response = await state.upstream.send(upstream_request)
    media_type = response.headers.get("content-type")
    if media_type and media_type.startswith("text/event-stream"):
        # Each upstream event reaches the client as it arrives; the upstream response is closed when the
        # client's stream ends, normally or not.
        return StreamingResponse(_relay(response), status_code=response.status_code, media_type=media_type)
    try:
        content = await response.aread()
    finally:
        await response.aclose()
    return Response(content, status_code=response.status_code, media_type=media_type)


async def _relay(response: httpx.Response) -> AsyncIterator[bytes]:
    """Upstream bytes as they arrive; the upstream response is closed however the client's stream ends."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


for path in ("/generate", "/abort_request", "/flush_cache"):
    router.add_api_route(path, forward, methods=["POST"], include_in_schema=True)
for path in ("/health_generate", "/get_model_info", "/get_server_info", "/model_info", "/server_info", "/v1/loads"):
    router.add_api_route(path, forward, methods=["GET"], include_in_schema=True)
