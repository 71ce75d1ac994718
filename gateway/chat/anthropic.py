"""The Anthropic Messages API over a session: its request, answer, stream events and error shape.

``POST /v1/sessions/{id}/v1/messages``, the path an unmodified Anthropic client calls with
``base_url="{gateway}/v1/sessions/{id}"``. Content blocks map onto the common messages (``gateway.chat.messages``):
``text`` blocks are content, an assistant's ``tool_use`` blocks its tool calls, a user's ``tool_result`` blocks one
tool message each (before the user's own text, as the API orders them). Images, documents and extended thinking are
refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError

from gateway.chat.api import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ApiModel,
    ChatRequestError,
    Number,
    check_history,
    error_status,
    validation_error,
)
from gateway.chat.messages import AssistantReply, ChatMessage, ChatRequest, Tool, ToolCall
from gateway.chat.service import ChatResult, StreamEvent
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.turns import StreamTurn


class TextBlock(ApiModel):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(ApiModel):
    type: Literal["tool_use"]
    id: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    input: dict[str, Any]


class ToolResultBlock(ApiModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    content: StrictStr | list[TextBlock] = ""
    is_error: StrictBool = False


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageIn(ApiModel):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[Block], Field(max_length=1024)]


class ToolIn(ApiModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: StrictStr = ""
    input_schema: dict[str, Any] = Field(default_factory=dict)


class ToolChoiceIn(ApiModel):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None


class MessagesRequest(ApiModel):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    messages: Annotated[list[MessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]
    model: StrictStr | None = None
    system: StrictStr | list[TextBlock] | None = None
    tools: Annotated[list[ToolIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceIn | None = None
    temperature: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1)] | None = None
    stop_sequences: Annotated[list[StrictStr], Field(max_length=16)] | None = None
    stream: StrictBool = False
    thinking: dict[str, Any] | None = None


def parse_request(raw: bytes) -> ChatRequest:
    try:
        body = MessagesRequest.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise validation_error(exc) from None
    return to_chat_request(body)


def to_chat_request(body: MessagesRequest) -> ChatRequest:
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise ChatRequestError("extended thinking is not supported")
    tools = tuple(Tool(t.name, t.description, t.input_schema) for t in body.tools or ())
    names = {t.name for t in tools}
    if len(names) != len(tools):
        raise ChatRequestError("tools: names must be unique")
    messages: list[ChatMessage] = []
    if body.system:
        messages.append(ChatMessage("system", _text(body.system)))
    for i, message in enumerate(body.messages):
        messages.extend(_messages(message, i))
    history = tuple(messages)
    check_history(history)
    params: dict[str, Any] = {"max_new_tokens": body.max_tokens}
    for key, value in (
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", body.top_k),
        ("stop", body.stop_sequences),
    ):
        if value is not None:
            params[key] = value
    return ChatRequest(
        messages=history,
        tools=tools,
        tool_choice=_tool_choice(body.tool_choice, names),
        sampling_params=params,
        stream=body.stream,
        model=body.model,
    )


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _messages(message: MessageIn, i: int) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(message.role, message.content)]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    if message.role == "assistant":
        if results:
            raise ChatRequestError(f"messages.{i}: tool_result blocks belong in user messages")
        calls = tuple(ToolCall(b.id, b.name, orjson.dumps(b.input).decode()) for b in uses)
        return [ChatMessage("assistant", "\n".join(texts), calls)]
    if uses:
        raise ChatRequestError(f"messages.{i}: tool_use blocks belong in assistant messages")
    out = [ChatMessage("tool", _text(b.content), tool_call_id=b.tool_use_id) for b in results]
    if texts or not results:
        out.append(ChatMessage("user", "\n".join(texts)))
    return out


def _tool_choice(choice: ToolChoiceIn | None, names: set[str]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if choice.type != "none" and not names:
        raise ChatRequestError(f"tool_choice {choice.type!r} needs tools")
    if choice.type == "tool":
        if choice.name not in names:
            raise ChatRequestError(f"tool_choice names an unknown tool {choice.name!r}")
        return choice.name
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# ---- answers -------------------------------------------------------------------------------------------------
def stop_reason(result: ChatResult) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    reply = result.reply
    if reply.finish == "tool_calls":
        return "tool_use", None
    if reply.finish == "length":
        return "max_tokens", None
    matched = (result.folded.plan.turn.finish_reason or {}).get("matched")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def content_blocks(message: ChatMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": message.content}] if message.content else []
    blocks.extend(_tool_use(call) for call in message.tool_calls)
    return blocks


def _tool_use(call: ToolCall) -> dict[str, Any]:
    value = call.arguments_value()
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": value if isinstance(value, dict) else {}}


def usage_json(reply: AssistantReply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens - reply.cached_tokens,
        "output_tokens": reply.completion_tokens,
        "cache_read_input_tokens": reply.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def answer_json(result: ChatResult, model: str) -> dict[str, Any]:
    reason, sequence = stop_reason(result)
    return {
        "id": f"msg_{result.reply.rid}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(result.reply.message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(result.reply),
        "gateway": result.gateway_json(),
    }


def stream_writer(request: ChatRequest, model: str) -> EventWriter:
    return EventWriter(model)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (name.encode(), orjson.dumps(data))


class EventWriter:
    """The stream as Anthropic sends it: ``message_start``, a text block's ``content_block_*`` events, one block per
    tool call (its input as one ``input_json_delta``), ``message_delta`` with the stop reason, ``message_stop``."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._text_open = False
        self._blocks = 0

    def start(self, turn: StreamTurn) -> bytes:
        message = {
            "id": f"msg_{turn.rid}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": turn.plan.prompt_length, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _event("ping", {"type": "ping"})

    def event(self, event: StreamEvent) -> bytes:
        out: list[bytes] = []
        if event.text:
            if not self._text_open:
                out.append(self._block_start({"type": "text", "text": ""}))
                self._text_open = True
            delta = {"type": "text_delta", "text": event.text}
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}))
        if event.end:
            out.append(self._end(event))
        return b"".join(out)

    def _block_start(self, block: dict[str, Any]) -> bytes:
        data = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        return _event("content_block_start", data)

    def _block_stop(self) -> bytes:
        self._blocks += 1
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})

    def _end(self, event: StreamEvent) -> bytes:
        out: list[bytes] = []
        if self._text_open:
            out.append(self._block_stop())
            self._text_open = False
        if event.reply is None:
            out.append(_event("error", error_json(event.error or {})))
            return b"".join(out)
        for call in event.reply.message.tool_calls:
            block = _tool_use(call)
            out.append(self._block_start(block | {"input": {}}))
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
            out.append(
                _event("content_block_delta", {"type": "content_block_delta", "index": self._blocks, "delta": delta})
            )
            out.append(self._block_stop())
        reason = _stream_stop_reason(event.reply)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None}}
        out.append(_event("message_delta", delta | {"usage": {"output_tokens": event.reply.completion_tokens}}))
        if event.error is not None:
            out.append(_event("error", error_json(event.error)))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)


def _stream_stop_reason(reply: AssistantReply) -> str:
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(reply.finish, "end_turn")


# ---- errors --------------------------------------------------------------------------------------------------
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_json(error: dict[str, Any], status: int = 500) -> dict[str, Any]:
    """The gateway's error body in Anthropic's shape; ``gateway_type`` keeps the gateway's own error type."""
    gateway_type = str(error.get("type", "internal_error"))
    kind = gateway_type if gateway_type == "invalid_request_error" else error_type(status)
    return {"type": "error", "error": {"type": kind, "message": error.get("message", ""), "gateway_type": gateway_type}}


def error_body(exc: GatewayError) -> dict[str, Any]:
    return error_json(exc.to_body()["error"], error_status(exc))
