"""The chat routes' common language: messages, tool calls and one chat request, whichever API they came from.

The API adapters (``gateway.chat.openai``, ``gateway.chat.anthropic``, ``gateway.chat.responses``) translate their
wire formats into these; the conversation logic (``gateway.chat.conversation``) and the chat template work only on
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

import msgspec
import orjson

from gateway.errors import InvalidRequest

Role = Literal["system", "user", "assistant", "tool"]
ToolChoice = Literal["none", "auto", "required"] | str  # a str other than the three: that function, by name
Api = Literal["openai", "anthropic", "responses"]


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str  # a JSON object, as text (as the OpenAI API carries it)

    def arguments_value(self) -> Any:
        """The arguments parsed, as chat templates want them; the text itself if it is not JSON."""
        try:
            return orjson.loads(self.arguments)
        except orjson.JSONDecodeError:
            return self.arguments

    def same_call(self, other: ToolCall) -> bool:
        """The same call as far as the model is concerned: same function, same arguments once parsed (a client may
        re-serialize them). Ids are not compared: clients and frameworks rename them, and they are the API's
        bookkeeping rather than what the model wrote."""
        return self.name == other.name and self.arguments_value() == other.arguments_value()


class ChatMessage(msgspec.Struct, frozen=True):
    """One message. A msgspec Struct rather than a dataclass: an agent's request carries its whole history, hundreds
    of messages made anew each turn, and a Struct is made ~5x faster."""

    role: Role
    content: str = ""  # text parts joined; "" when there is none
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # role "tool": the call it answers
    name: str | None = None
    # role "assistant": the model's reasoning (a reasoning model's <think> text), when known. A client may send it
    # back in any of its APIs' forms (reasoning_content, a thinking block, a reasoning item) or drop it.
    reasoning: str | None = None
    is_error: bool = False  # role "tool": the tool failed (Anthropic's is_error); the template gets it as is_error

    def same_message(self, other: ChatMessage) -> bool:
        """Whether ``other`` (from a later request) is this recorded message: what decides that a history still
        extends the session's record (see ``gateway.chat.conversation``).

        An assistant message is the same when its content and reasoning, each stripped, are the recorded ones, or
        when the client dropped the reasoning (most clients do): the model's own tokens are what the session keeps.
        """
        if self.role != other.role or self.name != other.name or self.is_error != other.is_error:
            return False
        if self.role != "assistant":
            return self.content == other.content
        if self.content.strip() != other.content.strip():
            return False
        if other.reasoning and (self.reasoning or "").strip() != other.reasoning.strip():
            return False
        return len(self.tool_calls) == len(other.tool_calls) and all(
            a.same_call(b) for a, b in zip(self.tool_calls, other.tool_calls, strict=True)
        )

    def template_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it (arguments parsed, as most templates expect; the
        reasoning as ``reasoning_content``, the key reasoning models' templates read)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_value()}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.is_error:
            out["is_error"] = True
        return out

    @property
    def text_size(self) -> int:
        """Characters of text in the message (what rendering and encoding it costs)."""
        return (
            len(self.content) + len(self.reasoning or "") + sum(len(c.arguments) + len(c.name) for c in self.tool_calls)
        )


class Tool(msgspec.Struct, frozen=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)  # a JSON schema

    def template_dict(self) -> dict[str, Any]:
        """The OpenAI function-tool form, which Hugging Face chat templates render."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


def tools_key(tools: tuple[Tool, ...]) -> bytes:
    """The tools as canonical JSON, as the template gets them: it renders them into the prompt, so other tools are
    another prompt. A schema that JSON cannot carry (an integer past 64 bits) is the caller's error."""
    try:
        return orjson.dumps([t.template_dict() for t in tools], option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(f"tools: a schema cannot be written as JSON ({exc})", param="tools") from None


def order_tool_results(messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
    """Each run of tool results in the order of the calls they answer (matched by id), not the order the client
    sent them in (the order they finished): templates that write no ids into the text (Hermes-style) pair each
    result with a call by position, so the trained trajectory would pair a call with another call's output."""
    out = list(messages)
    position: dict[str, int] = {}
    i = 0
    while i < len(out):
        message = out[i]
        if message.role == "assistant":
            position = {call.id: n for n, call in enumerate(message.tool_calls)}
        if message.role != "tool":
            i += 1
            continue
        end = i
        while end < len(out) and out[end].role == "tool":
            end += 1
        # sorted() is stable: results for calls of an earlier message (not in ``position``) keep their order, last
        out[i:end] = sorted(out[i:end], key=lambda m: position.get(m.tool_call_id or "", len(position)))
        i = end
    return tuple(out)


@dataclass(frozen=True)
class ChatRequest:
    """One chat request, validated and translated: what the conversation logic and the turn need."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    sampling_params: dict[str, Any] = field(default_factory=dict)  # SGLang's names (stop, temperature, ...)
    max_tokens: int | None = None  # what the client asked for; None: the gateway's default (chat_default_max_tokens)
    stream: bool = False
    stream_usage: bool = False  # OpenAI's stream_options.include_usage: a last chunk with the usage
    model: str | None = None
    api: Api = "openai"
    # The Responses API: the stored response this request's input continues (its conversation comes first).
    previous_response_id: str | None = None
    store: bool = True  # the Responses API's store: whether this answer may be continued by id
    # The API-specific answer options the adapters need back (Responses: include, instructions, tools as sent).
    options: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def tools_key(self) -> bytes:
        return tools_key(self.tools)

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def with_history(self, history: tuple[ChatMessage, ...]) -> ChatRequest:
        """The request with ``history`` before its own messages (a Responses API request that continues a stored
        response); ``ChatService.resolve`` orders the tool results afterwards, as for every request."""
        return replace(self, messages=(*history, *self.messages))


@dataclass(frozen=True, slots=True)
class AssistantReply:
    """A completion parsed into an assistant message, with why it ended."""

    message: ChatMessage
    finish: Literal["stop", "length", "tool_calls", "abort"]
    completion_tokens: int
    prompt_tokens: int  # the tokens the model was given (the session's, with this request's new ones)
    cached_tokens: int
    rid: str
