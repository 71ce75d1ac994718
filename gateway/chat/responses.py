"""The OpenAI Responses API over a session: its request, answer, stream events and error shape.

``POST /v1/sessions/{id}/responses``, the path the Codex CLI, the OpenAI Agents SDK and ``openai``'s
``responses.create`` call with ``base_url="{gateway}/v1/sessions/{id}"``.

Input items map onto the common messages (``gateway.chat.messages``): ``message`` items (``system``/``developer`` as
system, ``user``, ``assistant``; ``input_text``/``output_text`` parts) are messages; the assistant-side items of one
answer (``reasoning``, an assistant ``message``, ``function_call``s) are one assistant message; each
``function_call_output`` is a tool message. ``instructions`` is the first system message. Function tools are
rendered (``strict`` accepted: there is no constrained decoding here); ``namespace`` tools are flattened to
``NAMESPACE.NAME`` (a call comes back with its ``namespace``); ``custom`` (free-form) tools are rendered as a function
with one string parameter ``input``; hosted tools the model cannot call here (``web_search``, ``file_search``, ...)
are left out of the prompt, logged once.

``store`` (default true) and ``previous_response_id``: a session keeps the responses it answered, so a request may
give only its new input and continue from one; with ``store: false`` (Codex) every request carries the whole input,
and the session's record is matched exactly as on the chat routes. ``max_output_tokens`` is the answer's length
(without it, the gateway's default); a turn cut by it is ``incomplete`` with reason ``max_output_tokens``.
``parallel_tool_calls``, ``reasoning``, ``truncation``, ``prompt_cache_key`` (the session already routes its turns to
one worker), ``client_metadata``, ``metadata``, ``user`` and ``service_tier`` change nothing here and are ignored.
``include: ["reasoning.encrypted_content"]`` adds the reasoning, encoded, to reasoning items, which a later request
may send back in place of the reasoning text.
"""

from __future__ import annotations

import base64
import binascii
import time
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
    convert,
    decode,
)
from gateway.chat.messages import AssistantReply, ChatMessage, ChatRequest, Tool, ToolCall
from gateway.chat.openai import openai_error_json
from gateway.chat.service import ChatResult, StreamEvent

if TYPE_CHECKING:
    from gateway.turns import StreamTurn

ENCRYPTED_REASONING = "reasoning.encrypted_content"
_ENCODED_PREFIX = "sgw1."


# ---- the request -----------------------------------------------------------------------------------------------
class Part(ApiModel, tag_field="type", kw_only=True):
    """A content part, told apart by its ``type``."""


class InputText(Part, tag="input_text", kw_only=True):
    text: str


class OutputText(Part, tag="output_text", kw_only=True):
    text: str


class PlainText(Part, tag="text", kw_only=True):
    text: str


class Refusal(Part, tag="refusal", kw_only=True):
    refusal: str


class InputImage(Part, tag="input_image", kw_only=True):
    pass


class InputFile(Part, tag="input_file", kw_only=True):
    pass


class InputAudio(Part, tag="input_audio", kw_only=True):
    pass


MediaParts = InputImage | InputFile | InputAudio
Content = str | Annotated[list[InputText | OutputText | PlainText | Refusal | MediaParts], Meta(max_length=MAX_PARTS)]


class Item(ApiModel, tag_field="type", kw_only=True):
    """An input item, told apart by its ``type`` (a message when it has none)."""


class MessageItem(Item, tag="message", kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(Item, tag="function_call", kw_only=True):
    call_id: Id
    name: Id
    arguments: str
    namespace: str | None = None


class CustomToolCallItem(Item, tag="custom_tool_call", kw_only=True):
    call_id: Id
    name: Id
    input: str
    namespace: str | None = None


class FunctionCallOutputItem(Item, tag="function_call_output", kw_only=True):
    call_id: Id
    output: Content


class CustomToolCallOutputItem(Item, tag="custom_tool_call_output", kw_only=True):
    call_id: Id
    output: Content


class ReasoningPart(ApiModel, tag_field="type", kw_only=True):
    text: str


class ReasoningText(ReasoningPart, tag="reasoning_text", kw_only=True):
    pass


class SummaryText(ReasoningPart, tag="summary_text", kw_only=True):
    pass


class ReasoningItem(Item, tag="reasoning", kw_only=True):
    summary: Annotated[list[ReasoningText | SummaryText], Meta(max_length=MAX_PARTS)] = msgspec.field(
        default_factory=list
    )
    content: Annotated[list[ReasoningText | SummaryText], Meta(max_length=MAX_PARTS)] | None = None
    encrypted_content: str | None = None


AnyItem = (
    MessageItem
    | FunctionCallItem
    | CustomToolCallItem
    | FunctionCallOutputItem
    | CustomToolCallOutputItem
    | ReasoningItem
)
ITEM_TYPES = frozenset(cls.__struct_config__.tag for cls in AnyItem.__args__)


class ToolKind(ApiModel, tag_field="type", kw_only=True):
    """A tool the model may be shown, told apart by its ``type`` (anything else is a hosted tool)."""


class FunctionToolIn(ToolKind, tag="function", kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolIn(ToolKind, tag="custom", kw_only=True):
    name: ToolName
    description: str | None = None


class NamespaceToolIn(ToolKind, tag="namespace", kw_only=True):
    name: ToolName
    description: str = ""
    tools: Annotated[list[FunctionToolIn | CustomToolIn], Meta(max_length=MAX_TOOLS)]


ShownTool = FunctionToolIn | CustomToolIn | NamespaceToolIn
TOOL_TYPES = frozenset(cls.__struct_config__.tag for cls in ShownTool.__args__)


class NamedToolChoice(ApiModel, kw_only=True):
    type: Literal["function", "custom"]
    name: str


class TextFormat(ApiModel, kw_only=True):
    type: str = "text"


class TextOptions(ApiModel, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(ApiModel, kw_only=True):
    # Items and tools are checked one by one (``_items``, ``_tools``): an item without a ``type`` is a message, a
    # tool of another type a hosted one, which a tagged union cannot say.
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: str | None = None
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: Annotated[list[str], Meta(max_length=64)] | None = None
    text: TextOptions | None = None
    background: bool | None = None
    top_logprobs: int | None = None


class ResponsesRequestDoc(ResponsesRequest, kw_only=True):
    """``ResponsesRequest`` as the OpenAPI document describes it: each input item and tool as its own schema (an
    item's ``type`` given; hosted tools, which are accepted and left out, not listed)."""

    input: str | Annotated[list[AnyItem], Meta(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[ShownTool], Meta(max_length=MAX_TOOLS)] | None = None


def parse_request(raw: bytes, hosted: HostedTools | None = None) -> ChatRequest:
    return to_chat_request(decode(raw, ResponsesRequest), hosted)


def to_chat_request(body: ResponsesRequest, hosted: HostedTools | None = None) -> ChatRequest:
    _refuse_unsupported(body)
    tools, kinds = _tools(body.tools or (), hosted)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ChatRequestError("tool names must be unique", param="tools")
    messages: list[ChatMessage] = []
    continues = _continued_rid(body.previous_response_id)
    if body.instructions is not None and continues is None:
        messages.append(ChatMessage("system", body.instructions))
    messages.extend(_input_messages(body.input if isinstance(body.input, str) else _items(body.input)))
    params: dict[str, Any] = {}
    for key, value in (("temperature", body.temperature), ("top_p", body.top_p)):
        if value is not None:
            params[key] = value
    options = {
        "instructions": body.instructions,
        "tool_kinds": kinds,
        "encrypted_reasoning": ENCRYPTED_REASONING in (body.include or ()),
        "echo": _echo(body),
    }
    return ChatRequest(
        messages=tuple(messages),
        tools=tools,
        tool_choice=_tool_choice(body, set(names)),
        sampling_params=params,
        max_tokens=body.max_output_tokens,
        stream=body.stream,
        model=body.model,
        api="responses",
        previous_response_id=continues,
        store=body.store,
        options=options,
    )


def _items(values: list[dict[str, Any]]) -> list[AnyItem]:
    items = []
    for i, value in enumerate(values):
        kind = value.get("type", "message")
        if not isinstance(kind, str) or kind not in ITEM_TYPES:
            raise ChatRequestError(
                f"input.{i}: input items of type {kind!r:.80} are not supported here (messages, function calls and "
                "their outputs, reasoning)",
                param=f"input.{i}",
            )
        items.append(convert(value if "type" in value else {**value, "type": kind}, AnyItem, f"input.{i}"))
    return items


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise ChatRequestError(
            "background responses are not supported: answers come in the request", param="background"
        )
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise ChatRequestError("structured text.format is not supported", param="text.format")
    if body.top_logprobs:
        raise ChatRequestError(
            "top_logprobs are not returned here: the session's sample holds the log-probs "
            "(GET /v1/sessions/{id}/sample)",
            param="top_logprobs",
        )


def _continued_rid(previous_response_id: str | None) -> str | None:
    """The turn a ``previous_response_id`` names (answers are ``resp_{rid}``); an id of another form names none."""
    if previous_response_id is None:
        return None
    return previous_response_id.removeprefix("resp_") if previous_response_id.startswith("resp_") else "\x00"


def _tools(
    values: list[dict[str, Any]] | tuple[()], hosted: HostedTools | None
) -> tuple[tuple[Tool, ...], dict[str, tuple[str, str | None]]]:
    """The tools the model is shown, and each one's kind (``function`` or ``custom``) and namespace by the name the
    model calls it; hosted tools are left out."""
    out: list[Tool] = []
    kinds: dict[str, tuple[str, str | None]] = {}

    def add(tool: FunctionToolIn | CustomToolIn, namespace: str | None) -> None:
        name = tool.name if namespace is None else f"{namespace}.{tool.name}"
        description = tool.description or ""
        if isinstance(tool, CustomToolIn):
            parameters = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
        else:
            parameters = tool.parameters or {}
        out.append(Tool(name, description, parameters))
        kinds[name] = ("custom" if isinstance(tool, CustomToolIn) else "function", namespace)

    for i, value in enumerate(values):
        kind = value.get("type")
        if not isinstance(kind, str):
            raise ChatRequestError(f"tools.{i}.type: a tool's type is a string", param=f"tools.{i}.type")
        if kind not in TOOL_TYPES:
            if hosted is not None:
                hosted.left_out("responses", str(kind)[:80])
            continue
        tool = convert(value, ShownTool, f"tools.{i}")
        if isinstance(tool, NamespaceToolIn):
            for inner in tool.tools:
                add(inner, tool.name)
        else:
            add(tool, None)
    return tuple(out), kinds


def _tool_choice(body: ResponsesRequest, names: set[str]) -> str:
    choice = body.tool_choice
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice == "required" and not names:
            raise ChatRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return choice if names else "none"
    if choice.get("type") in ("function", "custom"):
        named = convert(choice, NamedToolChoice, "tool_choice")
        if named.name not in names:
            raise ChatRequestError(f"tool_choice names an unknown tool {named.name!r}", param="tool_choice")
        return named.name
    if choice.get("type") == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    raise ChatRequestError(f"tool_choice {choice.get('type')!r} is not supported here", param="tool_choice")


def _text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, Refusal):
            texts.append(part.refusal)
        elif isinstance(part, InputText | OutputText | PlainText):
            texts.append(part.text)
        else:
            kind = type(part).__struct_config__.tag
            raise ChatRequestError(f"{where}: {kind} is not supported: the served model reads text", param=where)
    return "\n".join(texts)


class _Answer:
    """The assistant-side items of one answer, gathered into one assistant message."""

    def __init__(self) -> None:
        self.reasoning: str | None = None
        self.content: str | None = None
        self.calls: list[ToolCall] = []

    def message(self) -> ChatMessage:
        return ChatMessage("assistant", self.content or "", tuple(self.calls), reasoning=self.reasoning)


def _input_messages(value: str | list[AnyItem]) -> list[ChatMessage]:
    if isinstance(value, str):
        return [ChatMessage("user", value)]
    out: list[ChatMessage] = []
    answer: _Answer | None = None

    def flush() -> None:
        nonlocal answer
        if answer is not None:
            out.append(answer.message())
            answer = None

    for i, item in enumerate(value):
        where = f"input.{i}"
        if isinstance(item, ReasoningItem):
            if answer is not None:
                flush()
            answer = _Answer()
            answer.reasoning = _reasoning_text(item)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if answer is not None and (answer.content is not None or answer.calls):
                flush()
            answer = answer or _Answer()
            answer.content = _text(item.content, where)
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            answer = answer or _Answer()
            answer.calls.append(_call(item))
        elif isinstance(item, MessageItem):
            flush()
            role = "system" if item.role in ("system", "developer") else "user"
            out.append(ChatMessage(role, _text(item.content, where)))  # type: ignore[arg-type]
        else:
            flush()
            out.append(ChatMessage("tool", _text(item.output, where), tool_call_id=item.call_id))
    flush()
    if not out:
        raise ChatRequestError("input holds no message", param="input")
    return out


def _call(item: FunctionCallItem | CustomToolCallItem) -> ToolCall:
    name = item.name if item.namespace is None else f"{item.namespace}.{item.name}"
    if isinstance(item, CustomToolCallItem):
        return ToolCall(item.call_id, name, orjson.dumps({"input": item.input}).decode())
    return ToolCall(item.call_id, name, item.arguments)


def _reasoning_text(item: ReasoningItem) -> str | None:
    """The reasoning a reasoning item carries: its text, or the gateway's own encoding of it; None when it carries
    only a summary or another server's encoding (the client dropped the reasoning)."""
    if item.content:
        return "\n".join(part.text for part in item.content if isinstance(part, ReasoningText))
    if item.encrypted_content and item.encrypted_content.startswith(_ENCODED_PREFIX):
        try:
            return base64.urlsafe_b64decode(item.encrypted_content[len(_ENCODED_PREFIX) :]).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
    return None


def encode_reasoning(reasoning: str) -> str:
    return _ENCODED_PREFIX + base64.urlsafe_b64encode(reasoning.encode()).decode()


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a response object repeats."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
    }


# ---- answers -------------------------------------------------------------------------------------------------
def response_id(rid: str) -> str:
    return f"resp_{rid}"


def output_items(reply: AssistantReply, request: ChatRequest) -> list[dict[str, Any]]:
    message = reply.message
    items: list[dict[str, Any]] = []
    if message.reasoning is not None:
        items.append(reasoning_item(reply.rid, message.reasoning, request))
    if message.content or not message.tool_calls:
        items.append(message_item(reply.rid, message.content))
    items.extend(call_item(call, request) for call in message.tool_calls)
    return items


def reasoning_item(rid: str, reasoning: str, request: ChatRequest, status: str = "completed") -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": f"rs_{rid}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": reasoning}],
        "status": status,
    }
    if request.options.get("encrypted_reasoning"):
        item["encrypted_content"] = encode_reasoning(reasoning)
    return item


def message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": [part]}


def call_item(call: ToolCall, request: ChatRequest) -> dict[str, Any]:
    kind, namespace = request.options.get("tool_kinds", {}).get(call.name, ("function", None))
    name = call.name if namespace is None else call.name[len(namespace) + 1 :]
    item: dict[str, Any]
    if kind == "custom":
        value = call.arguments_value()
        text = value.get("input") if isinstance(value, dict) and isinstance(value.get("input"), str) else call.arguments
        item = {"type": "custom_tool_call", "id": f"ctc_{call.id}", "call_id": call.id, "name": name, "input": text}
    else:
        item = {
            "type": "function_call",
            "id": f"fc_{call.id}",
            "call_id": call.id,
            "name": name,
            "arguments": call.arguments,
        }
    if namespace is not None:
        item["namespace"] = namespace
    return item | {"status": "completed"}


def usage_json(reply: AssistantReply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": reply.cached_tokens},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def response_json(
    rid: str,
    request: ChatRequest,
    model: str,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id(rid),
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "model": model,
        "output": output,
        "reasoning": {"effort": None, "summary": None},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "usage": usage,
        **request.options.get("echo", {}),
    }


def _status(reply: AssistantReply) -> tuple[str, str | None]:
    if reply.finish == "length":
        return "incomplete", "max_output_tokens"
    if reply.finish == "abort":
        return "incomplete", "aborted"
    return "completed", None


def answer_json(result: ChatResult, model: str) -> dict[str, Any]:
    request = result.request
    reply = result.reply
    status, incomplete = _status(reply)
    body = response_json(
        reply.rid,
        request,
        model,
        int(time.time()),
        status=status,
        output=output_items(reply, request),
        usage=usage_json(reply),
        incomplete=incomplete,
    )
    return body | {"gateway": result.gateway_json()}


def stream_writer(request: ChatRequest, model: str) -> EventWriter:
    return EventWriter(request, model)


class EventWriter:
    """The stream as the Responses API sends it: ``response.created`` and ``response.in_progress``; a reasoning item
    (``response.reasoning_text.delta``), a message item (``response.output_text.delta``), each opened with
    ``response.output_item.added`` / ``response.content_part.added`` and closed with their ``.done`` events; one
    function-call item per call (``response.function_call_arguments.delta`` / ``.done``); then
    ``response.completed`` (``response.incomplete`` when cut by the length, ``response.failed`` on an error)."""

    def __init__(self, request: ChatRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.created = int(time.time())
        self.rid = "pending"
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # the items done so far
        self._open: Literal["reasoning", "message"] | None = None
        self._text: list[str] = []

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return b"event: %b\ndata: %b\n\n" % (kind.encode(), orjson.dumps(body))

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return response_json(
            self.rid, self.request, self.model, self.created, status=status, output=self._output, **extra
        )

    def start(self, turn: StreamTurn) -> bytes:
        self.rid = turn.rid
        response = self._response("in_progress")
        return self._event("response.created", {"response": response}) + self._event(
            "response.in_progress", {"response": response}
        )

    def event(self, event: StreamEvent) -> bytes:
        out: list[bytes] = []
        if event.reasoning:
            out.append(self._delta("reasoning", event.reasoning))
        if event.text:
            out.append(self._delta("message", event.text))
        if event.end:
            out.append(self._end(event))
        return b"".join(out)

    def _item(self, kind: Literal["reasoning", "message"], status: str) -> dict[str, Any]:
        text = "".join(self._text)
        if kind == "reasoning":
            return reasoning_item(self.rid, text, self.request, status)
        return message_item(self.rid, text, status)

    def _delta(self, kind: Literal["reasoning", "message"], text: str) -> bytes:
        out = []
        if self._open != kind:
            if self._open is not None:
                out.append(self._close())
            self._open, self._text = kind, []
            index = len(self._output)
            item = self._item(kind, "in_progress")
            item["content"] = []
            item.pop("encrypted_content", None)
            out.append(self._event("response.output_item.added", {"output_index": index, "item": item}))
            part = self._part(kind, "")
            data = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part}
            out.append(self._event("response.content_part.added", data))
        self._text.append(text)
        data = {"item_id": self._item_id(kind), "output_index": len(self._output), "content_index": 0, "delta": text}
        if kind == "message":
            out.append(self._event("response.output_text.delta", data | {"logprobs": []}))
        else:
            out.append(self._event("response.reasoning_text.delta", data))
        return b"".join(out)

    def _item_id(self, kind: str) -> str:
        return f"rs_{self.rid}" if kind == "reasoning" else f"msg_{self.rid}"

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self) -> bytes:
        assert self._open is not None
        kind, text, index = self._open, "".join(self._text), len(self._output)
        item_id = self._item_id(kind)
        done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        out = [
            self._event(done, {"item_id": item_id, "output_index": index, "content_index": 0, "text": text}),
            self._event(
                "response.content_part.done",
                {"item_id": item_id, "output_index": index, "content_index": 0, "part": self._part(kind, text)},
            ),
        ]
        item = self._item(kind, "completed")
        out.append(self._event("response.output_item.done", {"output_index": index, "item": item}))
        self._output.append(item)
        self._open = None
        return b"".join(out)

    def _end(self, event: StreamEvent) -> bytes:
        out: list[bytes] = []
        reply = event.reply
        if (
            reply is not None
            and not reply.message.tool_calls
            and self._open is None
            and not any(item["type"] == "message" for item in self._output)
        ):
            out.append(self._delta("message", ""))  # every answer has a message or a call, as in a unary one
        if reply is None:  # not kept: an item still open is left unfinished (a client would keep a done item)
            failure = _failure(event.error or {})
            out.append(self._event("response.failed", {"response": self._response("failed", error=failure)}))
            return b"".join(out)
        if self._open is not None:
            out.append(self._close())
        for call in reply.message.tool_calls:
            out.append(self._call(call))
        status, incomplete = _status(reply)
        if event.error is not None:  # a turn cut by an error after some tokens: folded, and reported
            response = self._response("failed", usage=usage_json(reply), error=_failure(event.error))
            out.append(self._event("response.failed", {"response": response}))
            return b"".join(out)
        response = self._response(status, usage=usage_json(reply), incomplete=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, {"response": response}))
        return b"".join(out)

    def _call(self, call: ToolCall) -> bytes:
        item = call_item(call, self.request)
        index = len(self._output)
        opened = {**item, "status": "in_progress"}
        field = "input" if item["type"] == "custom_tool_call" else "arguments"
        opened[field] = ""
        value = item[field]
        prefix = "custom_tool_call_input" if item["type"] == "custom_tool_call" else "function_call_arguments"
        out = [
            self._event("response.output_item.added", {"output_index": index, "item": opened}),
            self._event(f"response.{prefix}.delta", {"item_id": item["id"], "output_index": index, "delta": value}),
            self._event(
                f"response.{prefix}.done",
                {"item_id": item["id"], "output_index": index, field: value, "name": item["name"]},
            ),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]
        self._output.append(item)
        return b"".join(out)


# ---- errors: OpenAI's shape, as on the chat completions route (``api_for_path`` gives this path OpenAI's) ----
def _failure(error: dict[str, Any]) -> dict[str, Any]:
    """A failed response's ``error``: the gateway's error body as its ``code`` and ``message``."""
    body = openai_error_json(error)
    return {"code": body.get("code") or body["type"], "message": body["message"]}
