"""The Anthropic Messages API over a session: its request, answer, stream events and error shape.

``POST /v1/sessions/{id}/v1/messages`` (and ``.../v1/messages/count_tokens``), the paths an unmodified Anthropic
client calls with ``base_url="{gateway}/v1/sessions/{id}"``. Content blocks map onto the common messages
(``gateway.chat.messages``): ``text`` blocks are content; an assistant's ``thinking`` blocks its reasoning and its
``tool_use`` blocks its tool calls; a user's ``tool_result`` blocks one tool message each (before the user's own text,
as the API orders them; ``is_error`` kept). ``system`` messages inside ``messages`` (Claude Code sends them) stand
where they are. Images and documents are refused (the served model reads text).

``thinking`` (``enabled``, ``adaptive``, ``disabled``) is accepted: with a reasoning parser configured the model's
reasoning comes back as ``thinking`` blocks when thinking is on; otherwise the answer is the model's text. Server
tools (``web_search_*``, ``code_execution_*``, ...) are hosted by Anthropic and cannot be called here: they are left
out of the prompt (logged once). ``metadata``, ``context_management``, ``output_config``, ``service_tier`` and
``cache_control`` change nothing here and are ignored.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import orjson
from msgspec import Meta

from gateway.chat.api import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOOLS,
    ApiModel,
    ChatRequestError,
    HostedTools,
    Id,
    ToolName,
    decode,
    error_status,
)
from gateway.chat.messages import AssistantReply, ChatMessage, ChatRequest, Tool, ToolCall
from gateway.chat.service import ChatResult, StreamEvent
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.turns import StreamTurn


class Block(ApiModel, tag_field="type", kw_only=True):
    """A content block, told apart by its ``type``."""


class TextBlock(Block, tag="text", kw_only=True):
    text: str


class ImageBlock(Block, tag="image", kw_only=True):
    pass


class DocumentBlock(Block, tag="document", kw_only=True):
    pass


class SearchResultBlock(Block, tag="search_result", kw_only=True):
    pass


MediaBlock = ImageBlock | DocumentBlock | SearchResultBlock


class ToolUseBlock(Block, tag="tool_use", kw_only=True):
    id: Id
    name: Id
    input: dict[str, Any]


class ToolReferenceBlock(Block, tag="tool_reference", kw_only=True):
    """A tool search's result (Claude Code's ToolSearch): which deferred tool it loaded."""

    tool_name: str


ToolResultPart = TextBlock | ImageBlock | DocumentBlock | SearchResultBlock | ToolReferenceBlock


class ToolResultBlock(Block, tag="tool_result", kw_only=True):
    tool_use_id: Id
    content: str | Annotated[list[ToolResultPart], Meta(max_length=MAX_PARTS)] = ""
    is_error: bool = False


class ThinkingBlock(Block, tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block, tag="redacted_thinking", kw_only=True):
    data: str = ""


AnyBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | SearchResultBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class MessageIn(ApiModel, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[AnyBlock], Meta(max_length=MAX_PARTS)]


class SystemBlock(ApiModel, kw_only=True):
    """A block of the top-level ``system`` prompt (its ``type`` checked: a lone tagged struct would not)."""

    type: Literal["text"]
    text: str


class ToolIn(ApiModel, kw_only=True):
    name: ToolName
    type: str | None = None  # "custom" (or none): the client's own tool; anything else: a server tool
    description: str = ""
    input_schema: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolChoiceIn(ApiModel, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingIn(ApiModel, kw_only=True):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Meta(ge=0)] | None = None


class CountTokensRequest(ApiModel, kw_only=True):
    messages: Annotated[list[MessageIn], Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: str | None = None
    system: str | list[SystemBlock] | None = None
    tools: Annotated[list[ToolIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    # Required by Anthropic's own API; here a request without it gets the gateway's default, as on the other APIs.
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    stream: bool = False


def parse_request(raw: bytes, hosted: HostedTools | None = None) -> ChatRequest:
    return to_chat_request(decode(raw, MessagesRequest), hosted)


def parse_count_request(raw: bytes, hosted: HostedTools | None = None) -> ChatRequest:
    return to_chat_request(decode(raw, CountTokensRequest), hosted)


def to_chat_request(body: CountTokensRequest, hosted: HostedTools | None = None) -> ChatRequest:
    tools = _tools(body.tools or (), hosted)
    names = {t.name for t in tools}
    if len(names) != len(tools):
        raise ChatRequestError("tools: names must be unique", param="tools")
    messages: list[ChatMessage] = []
    if body.system:
        messages.append(ChatMessage("system", _text(body.system)))
    for i, message in enumerate(body.messages):
        messages.extend(_messages(message, i))
    params: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        for key, value in (
            ("temperature", body.temperature),
            ("top_p", body.top_p),
            ("top_k", body.top_k),
            ("stop", body.stop_sequences),
        ):
            if value is not None:
                params[key] = value
    thinking = body.thinking is not None and body.thinking.type != "disabled"
    return ChatRequest(
        messages=tuple(messages),
        tools=tools,
        tool_choice=_tool_choice(body.tool_choice, names),
        sampling_params=params,
        max_tokens=body.max_tokens if isinstance(body, MessagesRequest) else None,
        stream=isinstance(body, MessagesRequest) and body.stream,
        model=body.model,
        api="anthropic",
        options={"thinking": thinking},
    )


def _tools(tools: Any, hosted: HostedTools | None) -> tuple[Tool, ...]:
    out = []
    for tool in tools:
        if tool.type not in (None, "custom"):
            if hosted is not None:
                hosted.left_out("anthropic", tool.type)
            continue
        out.append(Tool(tool.name, tool.description, tool.input_schema))
    return tuple(out)


def _text(content: str | list[SystemBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _messages(message: MessageIn, i: int) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(message.role, message.content)]
    for j, block in enumerate(message.content):
        if isinstance(block, MediaBlock):
            kind = type(block).__struct_config__.tag
            raise ChatRequestError(
                f"messages.{i}.content.{j}: {kind} blocks are not supported: the served model reads text",
                param=f"messages.{i}.content.{j}",
            )
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    thinking = [b.thinking for b in message.content if isinstance(b, ThinkingBlock)]
    if message.role == "assistant":
        if results:
            raise ChatRequestError(f"messages.{i}: tool_result blocks belong in user messages", param=f"messages.{i}")
        calls = tuple(ToolCall(b.id, b.name, orjson.dumps(b.input).decode()) for b in uses)
        reasoning = "\n".join(thinking) if thinking else None
        return [ChatMessage("assistant", "\n".join(texts), calls, reasoning=reasoning)]
    if uses or thinking:
        kind = "tool_use" if uses else "thinking"
        raise ChatRequestError(f"messages.{i}: {kind} blocks belong in assistant messages", param=f"messages.{i}")
    if message.role == "system":
        if results:
            raise ChatRequestError(f"messages.{i}: tool_result blocks belong in user messages", param=f"messages.{i}")
        return [ChatMessage("system", "\n".join(texts))]
    out = [ChatMessage("tool", _result_text(b, i), tool_call_id=b.tool_use_id, is_error=b.is_error) for b in results]
    if texts or not results:
        out.append(ChatMessage("user", "\n".join(texts)))
    return out


def _result_text(block: ToolResultBlock, i: int) -> str:
    if isinstance(block.content, str):
        return block.content
    parts = []
    for part in block.content:
        if isinstance(part, MediaBlock):
            kind = type(part).__struct_config__.tag
            raise ChatRequestError(
                f"messages.{i}: a tool_result with {kind} content is not supported: the served model reads text",
                param=f"messages.{i}",
            )
        parts.append(part.text if isinstance(part, TextBlock) else f"Tool {part.tool_name} is now available.")
    return "\n".join(parts)


def _tool_choice(choice: ToolChoiceIn | None, names: set[str]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if choice.type != "none" and not names:
        # Anthropic accepts "auto" without tools; nothing to call then.
        if choice.type == "auto":
            return "none"
        raise ChatRequestError(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name not in names:
            raise ChatRequestError(f"tool_choice names an unknown tool {choice.name!r}", param="tool_choice")
        return choice.name
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# ---- answers -------------------------------------------------------------------------------------------------
def thinking_signature(reasoning: str) -> str:
    """A signature the gateway recognizes on a thinking block it wrote (clients must send it back unchanged)."""
    return "sgw1." + hashlib.sha256(b"slime-gateway thinking\x00" + reasoning.encode()).hexdigest()[:48]


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


def content_blocks(message: ChatMessage, *, thinking: bool) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if thinking and message.reasoning is not None:
        signature = thinking_signature(message.reasoning)
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": signature})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
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
        "content": content_blocks(result.reply.message, thinking=bool(result.request.options.get("thinking"))),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(result.reply),
        "gateway": result.gateway_json(),
    }


def count_json(tokens: int) -> dict[str, Any]:
    return {"input_tokens": tokens}


def stream_writer(request: ChatRequest, model: str) -> EventWriter:
    return EventWriter(model, thinking=bool(request.options.get("thinking")))


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (name.encode(), orjson.dumps(data))


class EventWriter:
    """The stream as Anthropic sends it: ``message_start``, a thinking block's and a text block's
    ``content_block_*`` events, one block per tool call (its input as one ``input_json_delta``), ``message_delta``
    with the stop reason, ``message_stop``."""

    def __init__(self, model: str, *, thinking: bool) -> None:
        self.model = model
        self.thinking = thinking
        self._open: Literal["thinking", "text"] | None = None
        self._reasoning: list[str] = []
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
        if event.reasoning and self.thinking:
            out.append(self._delta("thinking", {"type": "thinking_delta", "thinking": event.reasoning}))
            self._reasoning.append(event.reasoning)
        if event.text:
            out.append(self._delta("text", {"type": "text_delta", "text": event.text}))
        if event.end:
            out.append(self._end(event))
        return b"".join(out)

    def _delta(self, kind: Literal["thinking", "text"], delta: dict[str, Any]) -> bytes:
        out = []
        if self._open != kind:
            if self._open is not None:
                out.append(self._close())
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text"}
            if kind == "text":
                block["text"] = ""
            out.append(self._block_start(block))
            self._open = kind
        out.append(self._block_delta(delta))
        return b"".join(out)

    def _block_start(self, block: dict[str, Any]) -> bytes:
        data = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        return _event("content_block_start", data)

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self._blocks, "delta": delta}
        return _event("content_block_delta", data)

    def _block_stop(self) -> bytes:
        """The current block's end; the next block takes the next index."""
        data = {"type": "content_block_stop", "index": self._blocks}
        self._blocks += 1
        return _event("content_block_stop", data)

    def _close(self) -> bytes:
        """The end of the open thinking or text block (a thinking block's signature first)."""
        out = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._reasoning))
            out.append(self._block_delta({"type": "signature_delta", "signature": signature}))
        out.append(self._block_stop())
        self._open = None
        return b"".join(out)

    def _end(self, event: StreamEvent) -> bytes:
        out: list[bytes] = []
        if self._open is not None:
            out.append(self._close())
        if event.reply is None:
            out.append(_event("error", error_json(event.error or {}, event.error_status)))
            return b"".join(out)
        for call in event.reply.message.tool_calls:
            block = _tool_use(call)
            out.append(self._block_start(block | {"input": {}}))
            partial = orjson.dumps(block["input"]).decode()
            out.append(self._block_delta({"type": "input_json_delta", "partial_json": partial}))
            out.append(self._block_stop())
        assert event.result is not None  # a folded turn's end carries its result
        reason, sequence = stop_reason(event.result)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        out.append(_event("message_delta", delta | {"usage": {"output_tokens": event.reply.completion_tokens}}))
        if event.error is not None:
            out.append(_event("error", error_json(event.error)))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)


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
    kind = "invalid_request_error" if status == 400 else error_type(status)
    body = {"type": kind, "message": error.get("message", ""), "gateway_type": gateway_type}
    return {"type": "error", "error": body}


def error_body(exc: GatewayError) -> dict[str, Any]:
    """Context overflows read as Anthropic words them (``ContextLengthExceeded``'s message is that wording), so that
    clients which parse it (Claude Code lowers ``max_tokens`` and retries) recover."""
    return error_json(exc.to_body()["error"], error_status(exc))
