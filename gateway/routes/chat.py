"""Chat APIs over a session: OpenAI's ``/chat/completions`` and ``/responses``, Anthropic's ``/v1/messages`` (and
its ``/v1/messages/count_tokens``), each under ``/v1/sessions/{id}`` so that unmodified clients and agent harnesses
work with ``base_url="{gateway}/v1/sessions/{id}"``.

Thin: each API's module (``gateway.chat.openai``, ``gateway.chat.anthropic``, ``gateway.chat.responses``) parses and
formats; the turn itself is ``ChatService``'s. Every error under these prefixes, unknown paths and wrong methods
included (``api_for_path``), answers in that API's own shape.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from types import ModuleType
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway import openapi as doc
from gateway.chat import anthropic, openai, responses
from gateway.chat.messages import ChatRequest
from gateway.chat.service import ChatService, ChatStream
from gateway.errors import ChatNotConfigured, GatewayError
from gateway.responses import json_response
from gateway.state import GatewayState, StateDep

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["chat"])
# A chat body is parsed on the event loop up to this size (msgspec: ~1 ms per MB), in the CPU pool past it: an agent's
# history is resent every turn, and a hop to a thread costs more than parsing a few hundred KB in place.
PARSE_OFFLOAD_BYTES = 1 << 20
SSE_HEADERS = {"cache-control": "no-cache"}
# Which API a path under a session belongs to: Anthropic's clients call {base}/v1/..., OpenAI's {base}/chat/...,
# {base}/responses..., {base}/models...
_API_PATH = re.compile(r"^/v1/sessions/[^/]+/(?:(v1)(?:/|$)|(chat|responses|models|completions|embeddings)(?:/|$))")


# The chat routes' request models, whose schemas the OpenAPI document makes together (``gateway.openapi.install``):
# the three APIs' structs of the same name (``MessageIn``) each get a name of their own.
DOCUMENTED_REQUESTS = (
    openai.ChatCompletionRequest,
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    responses.ResponsesRequestDoc,
)


# Every chat route may answer these, in its API's own error shape (an ``error`` object with ``type`` and ``message``).
CHAT_ERRORS = doc.errors(*doc.BODY_ERRORS, *doc.UPSTREAM_ERRORS, 404, 409, 429, 501, 507)


def _answers(description: str, answer: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    return {**doc.answers(200, description, (doc.JSON, answer), (doc.SSE, doc.SSE_EVENT)), **CHAT_ERRORS}


@router.post(
    "/chat/completions",
    operation_id="chat_completions",
    openapi_extra=doc.json_request(openai.ChatCompletionRequest),
    responses=_answers(
        "the completion (OpenAI Chat Completions); with `stream`, its chunks",
        doc.component("gateway.openapi:CHAT_COMPLETION", "ChatCompletion"),
    ),
)
async def chat_completions(session_id: str, request: Request, state: StateDep) -> Response:
    return await _chat(session_id, request, state, openai)


@router.post(
    "/responses",
    operation_id="responses",
    openapi_extra=doc.json_request(responses.ResponsesRequestDoc),
    responses=_answers(
        "the response (OpenAI Responses); with `stream`, its events",
        doc.component("gateway.openapi:RESPONSE", "Response"),
    ),
)
async def openai_responses(session_id: str, request: Request, state: StateDep) -> Response:
    return await _chat(session_id, request, state, responses)


@router.post(
    "/v1/messages",
    operation_id="anthropic_messages",
    openapi_extra=doc.json_request(anthropic.MessagesRequest),
    responses=_answers(
        "the message (Anthropic Messages); with `stream`, its events",
        doc.component("gateway.openapi:ANTHROPIC_MESSAGE", "AnthropicMessage"),
    ),
)
async def anthropic_messages(session_id: str, request: Request, state: StateDep) -> Response:
    return await _chat(session_id, request, state, anthropic)


@router.post(
    "/v1/messages/count_tokens",
    operation_id="anthropic_count_tokens",
    openapi_extra=doc.json_request(anthropic.CountTokensRequest),
    responses={
        **doc.answers(
            200,
            "the prompt's tokens",
            (doc.JSON, doc.component("gateway.openapi:ANTHROPIC_TOKEN_COUNT", "AnthropicTokenCount")),
        ),
        **doc.errors(*doc.BODY_ERRORS, 400, 404, 409, 501),
    },
)
async def anthropic_count_tokens(session_id: str, request: Request, state: StateDep) -> Response:
    """The prompt a turn with these messages would give the model, in tokens: the template's rendering, tokenized,
    after the session's own tokens when the messages extend its record (nothing changes)."""
    raw = await request.body()
    service = _service(state)
    chat = await state.run_cpu(
        len(raw), lambda: anthropic.parse_count_request(raw, service.hosted), threshold=PARSE_OFFLOAD_BYTES
    )
    tokens = await service.count_tokens(session_id, chat)
    return json_response(anthropic.count_json(tokens))


@router.head(
    "",
    operation_id="session_base",
    response_class=Response,
    responses={200: {"description": "the session exists"}, **doc.errors(404)},
)
async def session_base(session_id: str, state: StateDep) -> Response:
    """Clients check their base URL is alive (Claude Code sends ``HEAD {base}``): 200 when the session exists."""
    await state.store.get(session_id)
    return Response(status_code=200)


async def _chat(session_id: str, request: Request, state: GatewayState, api: ModuleType) -> Response:
    """One chat request in ``api``'s format (a module with ``parse_request``, ``answer_json`` and
    ``stream_writer``). A ``GatewayError`` raised before an answer or a stream starts is left to the app's handler,
    which answers it in the shape of the API the path belongs to (``api_error_body``)."""
    raw = await request.body()
    service = _service(state)
    chat: ChatRequest = await state.run_cpu(
        len(raw), lambda: api.parse_request(raw, service.hosted), threshold=PARSE_OFFLOAD_BYTES
    )
    model = chat.model or Path(service.template.name).name
    if not chat.stream:
        result = await service.run(session_id, chat)
        return json_response(api.answer_json(result, model))
    stream = await service.open_stream(session_id, chat)
    writer = api.stream_writer(stream.request, model)
    return StreamingResponse(_events(stream, writer), media_type="text/event-stream", headers=SSE_HEADERS)


def api_for_path(path: str) -> ModuleType | None:
    """The chat API whose clients call ``path`` (None: not under a session's chat prefixes)."""
    match = _API_PATH.match(path)
    if match is None:
        return None
    return anthropic if match.group(1) else openai


def api_error_body(path: str, exc: GatewayError) -> dict | None:
    """``exc`` in the shape of the chat API ``path`` belongs to (its status: ``error_status``), or None outside the
    chat prefixes."""
    api = api_for_path(path)
    return None if api is None else api.error_body(exc)


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
