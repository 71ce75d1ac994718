"""Tool-call parsers: a model's completion text into content and tool calls, by SGLang's ``--tool-call-parser`` name.

Each format is the one the model family's chat template renders an assistant's calls in (``GATEWAY_CHAT_TOOL_PARSER``,
the same value a user gives SGLang):

- ``hermes`` (Qwen2.5/Qwen3, Hermes and most models tuned on them):
  ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, one block per call;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5+): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``, one block per call;
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``;
- ``kimi_k2``: ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>functions.NAME:INDEX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``;
- ``deepseekv31`` (DeepSeek-V3.1): ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``.

What holds for all of them:
- Content is the text before the format's first marker (trailing whitespace dropped); from the marker on, the text
  must be calls and nothing else (whitespace between them aside).
- All or nothing: if anything from the marker on is not the format (unclosed, not JSON, arguments not an object, a
  missing name, text after the calls), the whole completion stays content and ``failed`` is set (the service counts
  it in ``gateway_chat_tool_parse_failures_total``), so an agent harness sees exactly what the model wrote.
- The formats that carry values as bare text (``qwen3_coder``, ``glm45``) give each value the type the tool's JSON
  schema names for that key (integer, number, boolean, null, object, array, or a union of them): the value read as
  JSON (or, as the Qwen3-Coder template writes non-strings, a Python literal) when that fits the schema; otherwise,
  and for keys the schema does not type, the text itself, as a string.
- Markers inside a JSON string are text (the JSON is read to its end, not cut at the next marker); a bare-text value
  ends at the first close tag that is followed by the next key or the end of the call.
- Call ids are new ``call_...`` ids, except for ``kimi_k2``, whose calls carry their own (``functions.NAME:INDEX``):
  the template renders those ids back, so they are returned as the calls' ids.

Streaming: ``ToolCallStreamSplitter`` sends content as it arrives and holds back, from the format's first marker on,
what may be calls (and a tail that may begin the marker, and trailing whitespace), so the streamed content always
equals the unary answer's; calls are sent once the completion is whole and parsed.

Written here rather than taken from a library: the parsers that exist live inside serving engines (vLLM, SGLang)
and pull the whole engine (torch included) in; these are a cursor over the text, ``json``'s decoder and the tool's
schema.
"""

from __future__ import annotations

import ast
import json
import re
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
ToolParser = Callable[[str, tuple[Tool, ...]], ParsedCompletion]


class Malformed(ValueError):
    """The text from the first marker on is not the format."""


def _reject_constant(name: str) -> Any:
    raise Malformed(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_WHITESPACE = " \t\r\n"


class _Cursor:
    """A position in the completion text, moved forward by what each format expects next."""

    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def skip_whitespace(self) -> None:
        text, pos = self.text, self.pos
        while pos < len(text) and text[pos] in _WHITESPACE:
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
            while probe < len(text) and text[probe] in _WHITESPACE:
                probe += 1
            if text.startswith(followers, probe):
                out = text[self.pos : end]
                self.pos = after
                return out
            search = end + 1

    def json_object(self) -> dict[str, Any]:
        """One JSON object, read to its end (markers inside its strings are text)."""
        self.skip_whitespace()
        value, self.pos = _DECODER.raw_decode(self.text, self.pos)
        if not isinstance(value, dict):
            raise Malformed("the arguments are not a JSON object")
        return value


# ---- typing bare-text values by the tool's schema ----------------------------------------------------------------
def _json_type(value: Any) -> str:
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
        out.update(_json_type(v) for v in schema["enum"])
    if "const" in schema:
        out.add(_json_type(schema["const"]))
    if not out and "properties" in schema:
        out.add("object")
    if not out and "items" in schema:
        out.add("array")
    return frozenset(out)


def _fits(value: Any, types: frozenset[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


_PYTHON_WORDS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def typed_value(text: str, schema: Any) -> Any:
    """A bare-text value as the type its schema names, when it reads as one; else the text itself."""
    types = schema_types(schema)
    if not types - {"string"}:
        return text
    try:
        value = json.loads(text, parse_constant=_reject_constant)
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


def _properties(tools: tuple[Tool, ...], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool.name == name:
            properties = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def _tool_call(call_id: str, name: Any, arguments: dict[str, Any]) -> ToolCall:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise Malformed("no function name")
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    # A JSON escape can make a lone surrogate, which no UTF-8 answer can carry: not a call.
    (name + text + call_id).encode()
    return ToolCall(id=call_id, name=name, arguments=text)


# ---- the formats ---------------------------------------------------------------------------------------------------
def _read_hermes(cursor: _Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls = []
    while not cursor.at_end:
        cursor.expect("<tool_call>")
        value = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect("</tool_call>")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments, parse_constant=_reject_constant)
        if not isinstance(arguments, dict):
            raise Malformed("the arguments are not a JSON object")
        calls.append(_tool_call(new_id(), value.get("name"), arguments))
        cursor.skip_whitespace()
    return calls


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _tag_name(text: str) -> str:
    if not text or any(c in text for c in "<>\n"):
        raise Malformed(f"not a name: {text[:40]!r}")
    return text


def _read_qwen3_coder(cursor: _Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls = []
    while not cursor.at_end:
        cursor.expect("<tool_call>")
        cursor.skip_whitespace()
        cursor.expect("<function=")
        name = _tag_name(cursor.until(">"))
        properties = _properties(tools, name)
        arguments: dict[str, Any] = {}
        while True:
            cursor.skip_whitespace()
            if cursor.at("</function>"):
                break
            cursor.expect("<parameter=")
            key = _tag_name(cursor.until(">"))
            value = _strip_one_newline(cursor.value_until("</parameter>", ("<parameter=", "</function>")))
            if key in arguments:
                raise Malformed(f"parameter {key!r} twice")
            arguments[key] = typed_value(value, properties.get(key))
        cursor.expect("</function>")
        cursor.skip_whitespace()
        cursor.expect("</tool_call>")
        calls.append(_tool_call(new_id(), name, arguments))
        cursor.skip_whitespace()
    return calls


def _read_glm45(cursor: _Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls = []
    while not cursor.at_end:
        cursor.expect("<tool_call>")
        name = _tag_name(cursor.until_any("\n", "<").strip())
        properties = _properties(tools, name)
        arguments: dict[str, Any] = {}
        while True:
            cursor.skip_whitespace()
            if cursor.at("</tool_call>"):
                break
            cursor.expect("<arg_key>")
            key = cursor.until("</arg_key>")
            if not key or "<" in key:
                raise Malformed(f"not a key: {key[:40]!r}")
            cursor.skip_whitespace()
            cursor.expect("<arg_value>")
            value = cursor.value_until("</arg_value>", ("<arg_key>", "</tool_call>"))
            if key in arguments:
                raise Malformed(f"argument {key!r} twice")
            arguments[key] = typed_value(value, properties.get(key))
        cursor.expect("</tool_call>")
        calls.append(_tool_call(new_id(), name, arguments))
        cursor.skip_whitespace()
    return calls


KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s<>|]+):(\d+)")


def _read_kimi_k2(cursor: _Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    cursor.expect(KIMI_SECTION_BEGIN)
    calls: list[ToolCall] = []
    while True:
        cursor.skip_whitespace()
        if cursor.at(KIMI_SECTION_END) and calls:
            break
        cursor.expect(KIMI_CALL_BEGIN)
        call_id = cursor.until(KIMI_ARGUMENT_BEGIN).strip()
        match = _KIMI_ID.fullmatch(call_id)
        if match is None:
            raise Malformed(f"not a Kimi call id: {call_id[:60]!r}")
        if any(c.id == call_id for c in calls):
            raise Malformed(f"call id {call_id!r} twice")
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect(KIMI_CALL_END)
        calls.append(_tool_call(call_id, match.group(1), arguments))
    cursor.expect(KIMI_SECTION_END)
    cursor.skip_whitespace()
    if not cursor.at_end:
        raise Malformed("text after the calls")
    return calls


DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"


def _read_deepseekv31(cursor: _Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    cursor.expect(DEEPSEEK_CALLS_BEGIN)
    calls: list[ToolCall] = []
    while True:
        cursor.skip_whitespace()
        if cursor.at(DEEPSEEK_CALLS_END) and calls:
            break
        cursor.expect(DEEPSEEK_CALL_BEGIN)
        name = _tag_name(cursor.until(DEEPSEEK_SEP).strip())
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect(DEEPSEEK_CALL_END)
        calls.append(_tool_call(new_id(), name, arguments))
    cursor.expect(DEEPSEEK_CALLS_END)
    cursor.skip_whitespace()
    if not cursor.at_end:
        raise Malformed("text after the calls")
    return calls


Reader = Callable[[_Cursor, tuple[Tool, ...], NewId], list[ToolCall]]


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    start: str  # the marker the calls begin with: content before it, held back from it in streams
    read: Reader  # from the marker to the end of the text: the calls, or Malformed

    def parse(self, text: str, tools: tuple[Tool, ...] = (), new_id: NewId = new_tool_call_id) -> ParsedCompletion:
        start = text.find(self.start)
        if start < 0:
            return ParsedCompletion(text, ())
        try:
            calls = self.read(_Cursor(text, start), tools, new_id)
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


FORMATS: dict[str, ToolCallFormat] = {
    f.name: f
    for f in (
        ToolCallFormat("hermes", "<tool_call>", _read_hermes),
        ToolCallFormat("qwen3_coder", "<tool_call>", _read_qwen3_coder),
        ToolCallFormat("glm45", "<tool_call>", _read_glm45),
        ToolCallFormat("kimi_k2", KIMI_SECTION_BEGIN, _read_kimi_k2),
        ToolCallFormat("deepseekv31", DEEPSEEK_CALLS_BEGIN, _read_deepseekv31),
    )
}
PARSERS: dict[str, ToolParser] = {name: f.parse for name, f in FORMATS.items()}
STREAM_SPLITTERS: dict[str, Callable[[], ToolCallStreamSplitter]] = {name: f.splitter for name, f in FORMATS.items()}
