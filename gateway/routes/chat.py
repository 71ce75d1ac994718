"""Chat APIs over a session: OpenAI's ``/chat/completions`` and Anthropic's ``/v1/messages``, each under
``/v1/sessions/{id}`` so that the unmodified clients work with ``base_url="{gateway}/v1/sessions/{id}"``.

Thin: each API's module (``gateway.chat.openai``, ``gateway.chat.anthropic``) parses and formats; the turn itself
is ``ChatService``'s. Errors answer in the API's own shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.chat import anthropic, openai
from gateway.chat.messages import ChatRequest
from gateway.chat.service import ChatService, ChatStream, StreamEvent
from gateway.errors import ChatNotConfigured, GatewayError
from gateway.responses import json_response
from gateway.state import GatewayState, StateDep
from gateway.turns import StreamTurn

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["chat"])
SSE_HEADERS = {"cache-control": "no-cache"}


def _service(state: GatewayState) -> ChatService:
    if state.chat is None:
        raise ChatNotConfigured(
            "this gateway has no tokenizer: start it with --tokenizer PATH (GATEWAY_TOKENIZER), the served model's "
            "tokenizer directory, to use the chat routes"
        )
    return state.chat


def _model_name(state: GatewayState, request: ChatRequest) -> str:
    return request.model or Path(_service(state).template.name).name


@router.post("/chat/completions")
async def chat_completions(session_id: str, request: Request, state: StateDep) -> Response:
    raw = await request.body()
    try:
        service = _service(state)
        chat, body = await state.run_cpu(len(raw), lambda: openai.parse_request(raw))
        model = _model_name(state, chat)
        if not chat.stream:
            result = await service.run(state, session_id, chat)
            return json_response(openai.completion_json(result, model))
        stream = await service.open_stream(state, session_id, chat)
    except GatewayError as exc:
        return _error(state, exc, openai.error_body, openai.error_status)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    writer = openai.ChunkWriter(model, include_usage)
    return StreamingResponse(
        _chunks(stream, writer.start, writer.event), media_type="text/event-stream", headers=SSE_HEADERS
    )


@router.post("/v1/messages")
async def anthropic_messages(session_id: str, request: Request, state: StateDep) -> Response:
    raw = await request.body()
    try:
        service = _service(state)
        chat = await state.run_cpu(len(raw), lambda: anthropic.parse_request(raw))
        model = _model_name(state, chat)
        if not chat.stream:
            result = await service.run(state, session_id, chat)
            return json_response(anthropic.message_json(result, model))
        stream = await service.open_stream(state, session_id, chat)
    except GatewayError as exc:
        return _error(state, exc, anthropic.error_body, anthropic.error_status)
    writer = anthropic.EventWriter(model)
    return StreamingResponse(
        _chunks(stream, writer.start, writer.event), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _chunks(
    stream: ChatStream, start: Callable[[StreamTurn], bytes], event: Callable[[StreamEvent], bytes]
) -> AsyncIterator[bytes]:
    assert stream.turn is not None
    yield start(stream.turn)
    async with aclosing(stream.events()) as events:  # a caller that leaves aborts the turn (see StreamTurn)
        async for item in events:
            yield event(item)


def _error(
    state: GatewayState,
    exc: GatewayError,
    body: Callable[[GatewayError], dict[str, Any]],
    status: Callable[[GatewayError], int],
) -> Response:
    state.metrics.record_error(exc)
    response = json_response(body(exc), status_code=status(exc))
    response.headers.update(exc.response_headers())
    return response
