"""The OpenAI Chat Completions API over a session: its request, answer, stream chunks and error shape.

``POST /v1/sessions/{id}/chat/completions``, so that an unmodified OpenAI client works with
``base_url="{gateway}/v1/sessions/{id}"``. Fields the API has and this gateway cannot honour are refused (``n`` > 1,
structured ``response_format``, non-text content); fields that change nothing here (``user``, ``store``,
``metadata``, ``parallel_tool_calls``, ...) are accepted and ignored. With a reasoning parser configured the model's
reasoning comes back as ``reasoning_content`` (streamed as ``delta.reasoning_content``), as SGLang's and vLLM's
OpenAI-compatible servers return it; a client may send it back the same way (or as ``reasoning``), or drop it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

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
from gateway.errors import ContextLengthExceeded, GatewayError

if TYPE_CHECKING:
    from gateway.turns import StreamTurn


class TextPart(ApiModel, kw_only=True):
    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], Meta(max_length=MAX_PARTS)] | None


class FunctionCall(ApiModel, kw_only=True):
    name: Id
    arguments: str


class ToolCallIn(ApiModel, kw_only=True):
    id: Annotated[str, Meta(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageIn(ApiModel, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Annotated[str, Meta(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for the same


class FunctionDef(ApiModel, kw_only=True):
    name: ToolName
    description: str = ""
    parameters: dict[str, Any] | None = None


class ToolIn(ApiModel, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(ApiModel, kw_only=True):
    type: Literal["function"]
    function: dict[str, Any]


class StreamOptions(ApiModel, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(ApiModel, kw_only=True):
    messages: Annotated[list[MessageIn], Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: str | None = None
    tools: Annotated[list[ToolIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # not OpenAI's, but SGLang's and vLLM's servers take it
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=16)] | None = None
    seed: int | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None


def parse_request(raw: bytes, hosted: HostedTools | None = None) -> ChatRequest:
    return to_chat_request(decode(raw, ChatCompletionRequest))


def to_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    if body.n not in (None, 1):
        raise ChatRequestError("only n=1 is supported: a session holds one trajectory per turn", param="n")
    if body.response_format is not None and body.response_format.get("type") not in (None, "text"):
        raise ChatRequestError("structured response_format is not supported", param="response_format")
    if body.logprobs:
        raise ChatRequestError(
            "logprobs are not returned here: the session's sample holds them (GET /v1/sessions/{id}/sample)",
            param="logprobs",
        )
    tools = tuple(_tool(t) for t in body.tools or ())
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ChatRequestError("tool names must be unique", param="tools")
    messages = tuple(_message(m, i) for i, m in enumerate(body.messages))
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body, set(names)),
        sampling_params=_sampling_params(body),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        stream=body.stream,
        stream_usage=body.stream_options is not None and body.stream_options.include_usage,
        model=body.model,
        api="openai",
    )


def _text(content: Content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _message(m: MessageIn, i: int) -> ChatMessage:
    role = "system" if m.role == "developer" else m.role
    if role == "tool" and not m.tool_call_id:
        raise ChatRequestError(f"messages[{i}]: a tool message needs tool_call_id", param=f"messages.{i}")
    if m.tool_calls and role != "assistant":
        raise ChatRequestError(f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages.{i}")
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    return ChatMessage(
        role=role,  # type: ignore[arg-type]
        content=_text(m.content),
        tool_calls=calls,
        tool_call_id=m.tool_call_id if role == "tool" else None,
        name=m.name,
        reasoning=reasoning if role == "assistant" else None,
    )


def _tool(t: ToolIn) -> Tool:
    return Tool(t.function.name, t.function.description, t.function.parameters or {})


def _tool_choice(body: ChatCompletionRequest, names: set[str]) -> str:
    choice = body.tool_choice
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice != "none" and not names:
            raise ChatRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return choice
    name = choice.function.get("name")
    if not isinstance(name, str) or name not in names:
        raise ChatRequestError(f"tool_choice names an unknown tool {name!r}", param="tool_choice")
    return name


def _sampling_params(body: ChatCompletionRequest) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, value in (
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", body.top_k),
        ("stop", [body.stop] if isinstance(body.stop, str) else body.stop),
        ("sampling_seed", body.seed),
        ("frequency_penalty", body.frequency_penalty),
        ("presence_penalty", body.presence_penalty),
    ):
        if value is not None:
            params[key] = value
    return params


# ---- answers -------------------------------------------------------------------------------------------------
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}


def completion_id(reply: AssistantReply) -> str:
    return f"chatcmpl-{reply.rid}"


def message_json(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [_tool_call_json(c) for c in message.tool_calls]
    return out


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage_json(reply: AssistantReply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def answer_json(result: ChatResult, model: str) -> dict[str, Any]:
    reply = result.reply
    return {
        "id": completion_id(reply),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message_json(reply.message),
                "finish_reason": FINISH_REASONS[reply.finish],
                "logprobs": None,
            }
        ],
        "usage": usage_json(reply),
        "gateway": result.gateway_json(),
    }


def stream_writer(request: ChatRequest, model: str) -> ChunkWriter:
    return ChunkWriter(model, request.stream_usage)


class ChunkWriter:
    """The stream as OpenAI sends it: a first chunk with the role, content deltas, the tool calls, a last chunk with
    the finish reason (and a usage chunk when asked for), then ``[DONE]``."""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.id = "chatcmpl-pending"

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def start(self, turn: StreamTurn) -> bytes:
        self.id = f"chatcmpl-{turn.rid}"
        return self.chunk({"role": "assistant", "content": ""})

    def event(self, event: StreamEvent) -> bytes:
        out = [self.chunk({"reasoning_content": event.reasoning})] if event.reasoning else []
        if event.text:
            out.append(self.chunk({"content": event.text}))
        if event.end:
            out.append(self._end(event))
        return b"".join(out)

    def _end(self, event: StreamEvent) -> bytes:
        reply = event.reply
        if reply is None:
            error = openai_error_json(event.error or {}, event.error_status)
            return b"data: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n"
        out = []
        if reply.message.tool_calls:
            calls = [{"index": i, **_tool_call_json(c)} for i, c in enumerate(reply.message.tool_calls)]
            out.append(self.chunk({"tool_calls": calls}))
        out.append(self.chunk({}, FINISH_REASONS[reply.finish]))
        if self.include_usage:
            usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
            out.append(b"data: " + orjson.dumps(usage | {"choices": [], "usage": usage_json(reply)}) + b"\n\n")
        if event.error is not None:  # a turn cut by an error after some tokens: folded, and reported
            out.append(b"data: " + orjson.dumps({"error": openai_error_json(event.error)}) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)


# ---- errors --------------------------------------------------------------------------------------------------
def openai_error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def openai_error_json(error: dict[str, Any], status: int = 500) -> dict[str, Any]:
    """The gateway's error body (``{"type", "message", ...}``) in OpenAI's shape; ``code`` is the gateway's type."""
    gateway_type = str(error.get("type", "internal_error"))
    kind = gateway_type if gateway_type == "invalid_request_error" else openai_error_type(status)
    return {
        "message": error.get("message", ""),
        "type": kind,
        "param": error.get("param"),
        "code": None if gateway_type == "invalid_request_error" else gateway_type,
    }


def error_body(exc: GatewayError) -> dict[str, Any]:
    body = openai_error_json(exc.to_body()["error"], error_status(exc))
    if isinstance(exc, ContextLengthExceeded):
        body |= {"message": context_message(exc), "type": "invalid_request_error", "code": "context_length_exceeded"}
    return {"error": body}


def context_message(exc: ContextLengthExceeded) -> str:
    """The overflow as OpenAI words it (clients and frameworks look for "maximum context length")."""
    limit, prompt, wanted = exc.details["context_tokens"], exc.details["prompt_tokens"], exc.details["max_tokens"]
    if wanted is None:
        least = "at least " if exc.details.get("at_least") else ""
        return (
            f"This model's maximum context length is {limit} tokens. However, your messages resulted in {least}"
            f"{prompt} tokens. Please reduce the length of the messages."
        )
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {prompt + wanted} tokens "
        f"({prompt} in the messages, {wanted} in the completion). Please reduce the length of the messages or "
        "completion."
    )
