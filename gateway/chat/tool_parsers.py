"""Tool-call parsers: a model's completion text into content and tool calls, selected by name.

``hermes`` (Qwen2.5/Qwen3, Hermes, and most models fine-tuned on them) writes each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` after optional content. The parse is all or
nothing: if any call block is malformed (not JSON, no name, arguments not an object, unclosed, or text after the
calls), the whole completion stays content, so an agent harness sees exactly what the model wrote.

Written here rather than taken from a library: the parsers that exist live inside serving engines (vLLM, SGLang)
and pull the whole engine in; this one is a few dozen lines over ``re`` and ``orjson``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from gateway.chat.messages import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    content: str
    tool_calls: tuple[ToolCall, ...]
    failed: bool = False  # the completion had tool-call markup that could not be read: it is all content


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_hermes(text: str, new_id: Callable[[], str] = new_tool_call_id) -> ParsedCompletion:
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedCompletion(text, ())
    calls: list[ToolCall] = []
    pos = start
    failed = ParsedCompletion(text, (), failed=True)
    for block in _BLOCK.finditer(text, start):
        if text[pos : block.start()].strip():  # text between calls: not the format
            return failed
        call = _hermes_call(block.group(1), new_id)
        if call is None:
            return failed
        calls.append(call)
        pos = block.end()
    if not calls or text[pos:].strip():  # unclosed block, or text after the calls
        return failed
    return ParsedCompletion(text[:start].rstrip(), tuple(calls))


def _hermes_call(body: str, new_id: Callable[[], str]) -> ToolCall | None:
    try:
        value = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_id(), name=value["name"], arguments=orjson.dumps(arguments).decode())


class HermesStreamSplitter:
    """Streams a completion's content while it arrives, holding back what may belong to a tool call: text from the
    first ``<tool_call>`` on, a tail that could be the start of that tag, and trailing whitespace (dropped when
    calls follow). ``finish`` then says what remains to send, so the streamed content always equals the unary
    answer's."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._sent = 0  # characters of the completion sent as content
        self._length = 0
        self._in_call = False

    def feed(self, piece: str) -> str:
        """Content that is safe to send now."""
        self._text.append(piece)
        self._length += len(piece)
        if self._in_call:
            return ""
        text = self.text
        tag = text.find(TOOL_CALL_OPEN, max(0, self._sent - len(TOOL_CALL_OPEN)))
        if tag >= 0:
            self._in_call = True
            end = len(text[:tag].rstrip())
        else:
            end = len(text) - _partial_tag_length(text)
            end = len(text[:end].rstrip())
        out = text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def finish(self, parsed: ParsedCompletion) -> str:
        """The content still to send once the completion is whole and ``parsed`` (``parse_hermes`` of it)."""
        content = parsed.content
        return content[self._sent :] if len(content) > self._sent else ""


def _partial_tag_length(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>``."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


PARSERS: dict[str, Callable[[str], ParsedCompletion]] = {"hermes": parse_hermes}
STREAM_SPLITTERS: dict[str, Callable[[], HermesStreamSplitter]] = {"hermes": HermesStreamSplitter}
