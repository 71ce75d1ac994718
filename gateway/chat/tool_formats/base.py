"""What every tool-call format shares: a cursor over the completion, the typing of bare-text values by the tool's
schema, the format record the registry lists (``ToolCallFormat``) and the stream splitter.

What holds for all formats:
- Content is the text before the format's first marker (trailing whitespace dropped); from the marker on, the text
  must be calls and nothing else (whitespace between them aside).
- All or nothing: if anything from the marker on is not the format (unclosed, not JSON, arguments not an object, a
  missing name, text after the calls), the whole completion stays content and ``failed`` is set (the service counts
  it in ``gateway_chat_tool_parse_failures_total``), so an agent harness sees exactly what the model wrote.
- The formats that carry values as bare text give each value the type the tool's JSON schema names for that key
  (integer, number, boolean, null, object, array, or a union of them): the value read as JSON (or, as the
  Qwen3-Coder template writes non-strings, a Python literal) when that fits the schema; otherwise, and for keys the
  schema does not type, the text itself, as a string.
- Markers inside a JSON string are text (the JSON is read to its end, not cut at the next marker); a bare-text value
  ends at the first close tag that is followed by the next key or the end of the call.

Streaming: ``ToolCallStreamSplitter`` sends content as it arrives and holds back, from the format's first marker on,
what may be calls (and a tail that may begin the marker, and trailing whitespace), so the streamed content always
equals the unary answer's; calls are sent once the completion is whole and parsed.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.chat.messages import Tool, ToolCall


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    content: str
    tool_calls: tuple[ToolCall, ...]
    failed: bool = False  # the completion had tool-call markup that could not be read: it is all content


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


NewId = Callable[[], str]


class Malformed(ValueError):
    """The text from the first marker on is not the format."""


def _reject_constant(name: str) -> Any:
    raise Malformed(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_reject_constant)
WHITESPACE = " \t\r\n"


class Cursor:
    """A position in the completion text, moved forward by what each format expects next."""

    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def skip_whitespace(self) -> None:
        text, pos = self.text, self.pos
        while pos < len(text) and text[pos] in WHITESPACE:
            pos += 1
        self.pos = pos

    def at(self, literal: str) -> bool:
        return self.text.startswith(literal, self.pos)

    @property
    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def expect(self, literal: str) -> None:
        if not self.at(literal):
            raise Malformed(f"expected {literal!r} at {self.pos}")
        self.pos += len(literal)

    def until(self, literal: str) -> str:
        """The text up to the next ``literal``; the cursor moves past it."""
        end = self.text.find(literal, self.pos)
        if end < 0:
            raise Malformed(f"no {literal!r} after {self.pos}")
        out = self.text[self.pos : end]
        self.pos = end + len(literal)
        return out

    def until_any(self, *literals: str) -> str:
        """The text up to the first of ``literals``; the cursor stays before it."""
        ends = [e for e in (self.text.find(literal, self.pos) for literal in literals) if e >= 0]
        if not ends:
            raise Malformed(f"none of {literals!r} after {self.pos}")
        out = self.text[self.pos : min(ends)]
        self.pos = min(ends)
        return out

    def value_until(self, close: str, followers: tuple[str, ...]) -> str:
        """Bare text up to the first ``close`` that is followed (after whitespace) by one of ``followers``, so a
        value may hold the close tag itself; the cursor moves past that ``close``."""
        text, search = self.text, self.pos
        while True:
            end = text.find(close, search)
            if end < 0:
                raise Malformed(f"no {close!r} after {self.pos}")
            after = end + len(close)
            probe = after
            while probe < len(text) and text[probe] in WHITESPACE:
                probe += 1
            if text.startswith(followers, probe):
                out = text[self.pos : end]
                self.pos = after
                return out
            search = end + 1

    def json_value(self) -> Any:
        """One JSON value, read to its end (markers inside its strings are text)."""
        self.skip_whitespace()
        value, self.pos = DECODER.raw_decode(self.text, self.pos)
        return value

    def json_object(self) -> dict[str, Any]:
        value = self.json_value()
        if not isinstance(value, dict):
            raise Malformed("the arguments are not a JSON object")
        return value


def strict_json(text: str) -> Any:
    """``text`` as one JSON value (NaN and Infinity refused); Malformed or ValueError when it is not."""
    return json.loads(text, parse_constant=_reject_constant)


# ---- typing bare-text values by the tool's schema ----------------------------------------------------------------
def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "other"


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a property's schema allows: its ``type`` (a name or a list), its ``anyOf``/``oneOf``/``allOf``
    branches, the types of its ``enum``/``const`` values, else object/array from ``properties``/``items``. Empty when
    the schema names none (the value then stays text)."""
    if not isinstance(schema, dict):
        return frozenset()
    out: set[str] = set()
    named = schema.get("type")
    if isinstance(named, str):
        out.add(named)
    elif isinstance(named, list):
        out.update(t for t in named if isinstance(t, str))
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                out |= schema_types(branch)
    if isinstance(schema.get("enum"), list):
        out.update(json_type(v) for v in schema["enum"])
    if "const" in schema:
        out.add(json_type(schema["const"]))
    if not out and "properties" in schema:
        out.add("object")
    if not out and "items" in schema:
        out.add("array")
    return frozenset(out)


def _fits(value: Any, types: frozenset[str]) -> bool:
    kind = json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


_PYTHON_WORDS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def typed_value(text: str, schema: Any) -> Any:
    """A bare-text value as the type its schema names, when it reads as one; else the text itself."""
    types = schema_types(schema)
    if not types - {"string"}:
        return text
    try:
        value = strict_json(text)
    except (ValueError, RecursionError):
        value = _python_literal(text.strip())
    if isinstance(value, str) or not _fits(value, types):  # a quoted string is text with quotes in it
        return text
    return value


def _python_literal(text: str) -> Any:
    """``True``/``None``, or a dict/list as Python writes it (the Qwen3-Coder template renders non-string values with
    ``| string``), as JSON values; a string (no value) when it is not one."""
    if text in _PYTHON_WORDS:
        return _PYTHON_WORDS[text]
    if not text.startswith(("{", "[")):
        return text
    try:
        value = ast.literal_eval(text)
        return json.loads(json.dumps(value, allow_nan=False))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def properties(tools: tuple[Tool, ...], name: str) -> dict[str, Any]:
    """The ``properties`` of the named tool's schema ({} when the tool or its properties are not there)."""
    for tool in tools:
        if tool.name == name:
            return tool_properties(tool)
    return {}


def tool_properties(tool: Tool) -> dict[str, Any]:
    """The ``properties`` of the tool's schema ({} when it has none)."""
    found = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
    return found if isinstance(found, dict) else {}


def tool_call(call_id: str, name: Any, arguments: dict[str, Any]) -> ToolCall:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise Malformed("no function name")
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    # A JSON escape can make a lone surrogate, which no UTF-8 answer can carry: not a call.
    (name + text + call_id).encode()
    return ToolCall(id=call_id, name=name, arguments=text)


def tag_name(text: str) -> str:
    """A function or parameter name written inside a tag: not empty, no tag characters, no line break."""
    if not text or any(c in text for c in "<>\n"):
        raise Malformed(f"not a name: {text[:40]!r}")
    return text


def strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def expect_end(cursor: Cursor) -> None:
    cursor.skip_whitespace()
    if not cursor.at_end:
        raise Malformed("text after the calls")


def read_sections(
    cursor: Cursor, begin: str, end: str, read_call: Callable[[], ToolCall], *, repeated: bool = False
) -> list[ToolCall]:
    """The calls of a ``begin`` ... ``end`` section (at least one; whitespace around each is free), then the end of
    the text; ``repeated``: several sections one after the other are one answer's calls. ``read_call`` reads one
    call."""
    calls: list[ToolCall] = []
    while True:
        cursor.expect(begin)
        before = len(calls)
        while True:
            cursor.skip_whitespace()
            if cursor.at(end) and len(calls) > before:
                break
            calls.append(read_call())
        cursor.expect(end)
        cursor.skip_whitespace()
        if not (repeated and cursor.at(begin)):
            break
    expect_end(cursor)
    return calls


# ---- the format record ---------------------------------------------------------------------------------------------
Reader = Callable[[Cursor, tuple[Tool, ...], NewId], list[ToolCall]]


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One format, as the registry (``gateway.chat.tool_parsers``) lists it."""

    name: str  # SGLang's --tool-call-parser name
    start: str  # the marker the calls begin with: content before it, held back from it in streams
    read: Reader  # from the marker to the end of the text: the calls, or Malformed
    markers: tuple[str, ...] = ()  # every marker the format writes (beside ``start``): must reach the gateway as text
    reasoning: str | None = None  # the reasoning format it only works with (gpt-oss's harmony carries both)

    def parse(self, text: str, tools: tuple[Tool, ...] = (), new_id: NewId = new_tool_call_id) -> ParsedCompletion:
        start = text.find(self.start)
        if start < 0:
            return ParsedCompletion(text, ())
        try:
            calls = self.read(Cursor(text, start), tools, new_id)
        except (ValueError, RecursionError):  # Malformed, JSON errors, a lone surrogate
            return ParsedCompletion(text, (), failed=True)
        return ParsedCompletion(text[:start].rstrip(), tuple(calls))

    def splitter(self) -> ToolCallStreamSplitter:
        return ToolCallStreamSplitter(self.start)


class ToolCallStreamSplitter:
    """Streams a completion's content while it arrives, holding back what may belong to tool calls: text from the
    format's first marker on, a tail that could be the start of that marker, and trailing whitespace (dropped when
    calls follow). What it sends is always a prefix of the parsed content; the rest is sent once the completion is
    whole and parsed (``gateway.chat.service.ReplySplitter.finish``), so the streamed content equals the unary
    answer's."""

    def __init__(self, start: str) -> None:
        self._start = start
        self._pending = ""  # received, not sent: trailing whitespace and a partial marker
        self._in_calls = False

    def feed(self, piece: str) -> str:
        """Content that is safe to send now."""
        if self._in_calls:
            return ""
        text = self._pending + piece
        marker = text.find(self._start)
        if marker >= 0:
            self._in_calls = True
            out = text[:marker].rstrip()
            self._pending = ""
        else:
            end = len(text[: len(text) - partial_marker_length(text, self._start)].rstrip())
            out, self._pending = text[:end], text[end:]
        return out


def partial_marker_length(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
