"""Chat APIs over a session: OpenAI's ``/chat/completions`` and Anthropic's ``/v1/messages``, each under
``/v1/sessions/{id}`` so that the unmodified clients work with ``base_url="{gateway}/v1/sessions/{id}"``.

Thin: each API's module (``gateway.chat.openai``, ``gateway.chat.anthropic``) parses and formats; the turn itself
is ``ChatService``'s. Errors answer in the API's own shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from types import ModuleType

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.chat import anthropic, openai
from gateway.chat.api import error_status
from gateway.chat.service import ChatService, ChatStream
from gateway.errors import ChatNotConfigured, GatewayError
from gateway.responses import json_response
from gateway.state import GatewayState, StateDep

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["chat"])
SSE_HEADERS = {"cache-control": "no-cache"}


@router.post("/chat/completions")
async def chat_completions(session_id: str, request: Request, state: StateDep) -> Response:
    return await _chat(session_id, request, state, openai)


@router.post("/v1/messages")
async def anthropic_messages(session_id: str, request: Request, state: StateDep) -> Response:
    return await _chat(session_id, request, state, anthropic)


async def _chat(session_id: str, request: Request, state: GatewayState, api: ModuleType) -> Response:
    """One chat request in ``api``'s format (a module with ``parse_request``, ``answer_json``, ``stream_writer`` and
    ``error_body``)."""
    raw = await request.body()
    try:
        service = _service(state)
        chat = await state.run_cpu(len(raw), lambda: api.parse_request(raw))
        model = chat.model or Path(service.template.name).name
        if not chat.stream:
            result = await service.run(state, session_id, chat)
            return json_response(api.answer_json(result, model))
        stream = await service.open_stream(state, session_id, chat)
    except GatewayError as exc:
        state.metrics.record_error(exc)
        response = json_response(api.error_body(exc), status_code=error_status(exc))
        response.headers.update(exc.response_headers())
        return response
    writer = api.stream_writer(chat, model)
    return StreamingResponse(_events(stream, writer), media_type="text/event-stream", headers=SSE_HEADERS)


def _service(state: GatewayState) -> ChatService:
    if state.chat is None:
        raise ChatNotConfigured(
            "this gateway has no tokenizer: start it with --tokenizer PATH (GATEWAY_TOKENIZER), the served model's "
            "tokenizer directory, to use the chat routes"
        )
    return state.chat


async def _events(stream: ChatStream, writer: openai.ChunkWriter | anthropic.EventWriter) -> AsyncIterator[bytes]:
    assert stream.turn is not None
    yield writer.start(stream.turn)
    async with aclosing(stream.events()) as events:  # a caller that leaves aborts the turn (see StreamTurn)
        async for event in events:
            yield writer.event(event)
