"""The chat routes' common language: messages, tool calls and one chat request, whichever API they came from.

The OpenAI and Anthropic adapters (``gateway.chat.openai``, ``gateway.chat.anthropic``) translate their wire formats
into these; the conversation logic (``gateway.chat.conversation``) and the chat template work only on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Role = Literal["system", "user", "assistant", "tool"]
ToolChoice = Literal["none", "auto", "required"] | str  # a str other than the three: that function, by name


@dataclass(frozen=True, slots=True)
class ToolCall:
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


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str = ""  # text parts joined; "" when there is none
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # role "tool": the call it answers
    name: str | None = None

    def same_message(self, other: ChatMessage) -> bool:
        """Whether ``other`` (from a later request) is this recorded message: what decides that a history still
        extends the session's record (see ``gateway.chat.conversation``)."""
        return (
            self.role == other.role
            and self.content == other.content
            and self.name == other.name
            and len(self.tool_calls) == len(other.tool_calls)
            and all(a.same_call(b) for a, b in zip(self.tool_calls, other.tool_calls, strict=True))
        )

    def template_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it (arguments parsed, as most templates expect)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_value()}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # a JSON schema

    def template_dict(self) -> dict[str, Any]:
        """The OpenAI function-tool form, which Hugging Face chat templates render."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


def tools_key(tools: tuple[Tool, ...]) -> bytes:
    """The tools as canonical JSON, as the template gets them: it renders them into the prompt, so other tools are
    another prompt."""
    return orjson.dumps([t.template_dict() for t in tools], option=orjson.OPT_SORT_KEYS)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One chat request, validated and translated: what the conversation logic and the turn need."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    sampling_params: dict[str, Any] = field(default_factory=dict)  # SGLang's names (max_new_tokens, stop, ...)
    stream: bool = False
    stream_usage: bool = False  # OpenAI's stream_options.include_usage: a last chunk with the usage
    model: str | None = None

    @property
    def tools_key(self) -> bytes:
        return tools_key(self.tools)

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True, slots=True)
class AssistantReply:
    """A completion parsed into an assistant message, with why it ended."""

    message: ChatMessage
    finish: Literal["stop", "length", "tool_calls", "abort"]
    completion_tokens: int
    prompt_tokens: int  # the tokens the model was given (the session's, with this request's new ones)
    cached_tokens: int
    rid: str
