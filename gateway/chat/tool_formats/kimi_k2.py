"""``kimi_k2`` (Kimi-K2, K2-Thinking, K2.5): ``<|tool_calls_section_begin|>`` then per call
``<|tool_call_begin|>ID<|tool_call_argument_begin|>{...}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``;
several sections one after the other are one answer's calls.

The calls carry their own ids, which the template renders back (its tool results name them), so they are returned
as the calls' ids, as the model wrote them. An id ``functions.NAME:N`` (or ``NAME:N``) names the function; any other
id (K2.5's bare counter ``3``, a client's ``call_...`` id the model copied from the history) names none, and the
call is to the one tool offered, or else to the one tool whose schema's properties hold every argument key; when no
single tool fits, the answer is not calls (all content)."""

from __future__ import annotations

import re
from typing import Any

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import (
    Cursor,
    Malformed,
    NewId,
    ToolCallFormat,
    read_sections,
    tool_call,
    tool_properties,
)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_NAMED_ID = re.compile(r"(?:functions\.)?([^\s<>|]+):(\d+)")
_ANY_ID = re.compile(r"[^\s<>|]+")


def function_name(call_id: str, arguments: dict[str, Any], tools: tuple[Tool, ...]) -> str:
    """The function a call id names, or (an id that names none) the one tool the call can be to."""
    named = _NAMED_ID.fullmatch(call_id)
    if named is not None:
        return named.group(1)
    if _ANY_ID.fullmatch(call_id) is None:
        raise Malformed(f"not a Kimi call id: {call_id[:60]!r}")
    if len(tools) == 1:
        return tools[0].name
    fitting = [t.name for t in tools if arguments and set(arguments) <= set(tool_properties(t))]
    if len(fitting) != 1:
        raise Malformed(f"call id {call_id[:60]!r} names no function and {len(fitting)} tools fit its arguments")
    return fitting[0]


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    seen: set[str] = set()

    def call() -> ToolCall:
        cursor.expect(CALL_BEGIN)
        call_id = cursor.until(ARGUMENT_BEGIN).strip()
        if call_id in seen:
            raise Malformed(f"call id {call_id!r} twice")
        seen.add(call_id)
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect(CALL_END)
        return tool_call(call_id, function_name(call_id, arguments, tools), arguments)

    return read_sections(cursor, SECTION_BEGIN, SECTION_END, call, repeated=True)


FORMAT = ToolCallFormat("kimi_k2", SECTION_BEGIN, read, markers=(SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END))
