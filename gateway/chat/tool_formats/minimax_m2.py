"""``minimax-m2`` (MiniMax-M2, M2.1)::

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

One block holds an answer's calls (an ``invoke`` each; several blocks one after the other read the same). Values
are bare text, one newline on each side dropped, typed by the tool's schema."""

from __future__ import annotations

from typing import Any

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import (
    Cursor,
    Malformed,
    NewId,
    ToolCallFormat,
    properties,
    read_sections,
    strip_one_newline,
    tag_name,
    tool_call,
    typed_value,
)

CALLS_BEGIN = "<minimax:tool_call>"
CALLS_END = "</minimax:tool_call>"
INVOKE = '<invoke name="'
INVOKE_END = "</invoke>"
PARAMETER = '<parameter name="'
PARAMETER_END = "</parameter>"


def _invoke(cursor: Cursor, tools: tuple[Tool, ...]) -> tuple[str, dict[str, Any]]:
    cursor.expect(INVOKE)
    name = tag_name(cursor.until('">'))
    schema = properties(tools, name)
    arguments: dict[str, Any] = {}
    while True:
        cursor.skip_whitespace()
        if cursor.at(INVOKE_END):
            cursor.expect(INVOKE_END)
            return name, arguments
        cursor.expect(PARAMETER)
        key = tag_name(cursor.until('">'))
        value = strip_one_newline(cursor.value_until(PARAMETER_END, (PARAMETER, INVOKE_END)))
        if key in arguments:
            raise Malformed(f"parameter {key!r} twice")
        arguments[key] = typed_value(value, schema.get(key))


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    def call() -> ToolCall:
        name, arguments = _invoke(cursor, tools)
        return tool_call(new_id(), name, arguments)

    return read_sections(cursor, CALLS_BEGIN, CALLS_END, call, repeated=True)


FORMAT = ToolCallFormat(
    "minimax-m2", CALLS_BEGIN, read, markers=(CALLS_END, INVOKE, INVOKE_END, PARAMETER, PARAMETER_END)
)
