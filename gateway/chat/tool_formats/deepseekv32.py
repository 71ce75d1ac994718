"""``deepseekv32`` (DeepSeek-V3.2): DSML, after the content and a blank line::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Each parameter says its own type: ``string="true"`` is the text as written, ``string="false"`` a JSON value (read
as JSON; text that is not JSON stays that text). An invoke may also hold one JSON object instead of parameters
(SGLang reads that form too). Whitespace between the tags is free."""

from __future__ import annotations

from typing import Any

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import (
    Cursor,
    Malformed,
    NewId,
    ToolCallFormat,
    read_sections,
    strict_json,
    tag_name,
    tool_call,
)

DSML = "｜DSML｜"
CALLS_BEGIN = f"<{DSML}function_calls>"
CALLS_END = f"</{DSML}function_calls>"
INVOKE = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER = f"<{DSML}parameter"
PARAMETER_END = f"</{DSML}parameter>"


def _attribute(cursor: Cursor, name: str) -> str:
    cursor.skip_whitespace()
    cursor.expect(f'{name}="')
    return cursor.until('"')


def _parameter(cursor: Cursor) -> tuple[str, Any]:
    cursor.expect(PARAMETER)
    key = tag_name(_attribute(cursor, "name"))
    string = _attribute(cursor, "string")
    if string not in ("true", "false"):
        raise Malformed(f"string={string[:20]!r}")
    cursor.skip_whitespace()
    cursor.expect(">")
    value = cursor.value_until(PARAMETER_END, (PARAMETER, INVOKE_END))
    if string == "true":
        return key, value
    try:
        return key, strict_json(value)
    except (ValueError, RecursionError):
        return key, value


def _invoke(cursor: Cursor) -> tuple[str, dict[str, Any]]:
    cursor.expect(INVOKE)
    name = tag_name(_attribute(cursor, "name"))
    cursor.skip_whitespace()
    cursor.expect(">")
    cursor.skip_whitespace()
    if cursor.at("{"):
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect(INVOKE_END)
        return name, arguments
    arguments: dict[str, Any] = {}
    while True:
        cursor.skip_whitespace()
        if cursor.at(INVOKE_END):
            cursor.expect(INVOKE_END)
            return name, arguments
        key, value = _parameter(cursor)
        if key in arguments:
            raise Malformed(f"parameter {key!r} twice")
        arguments[key] = value


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    def call() -> ToolCall:
        name, arguments = _invoke(cursor)
        return tool_call(new_id(), name, arguments)

    return read_sections(cursor, CALLS_BEGIN, CALLS_END, call)


FORMAT = ToolCallFormat(
    "deepseekv32", CALLS_BEGIN, read, markers=(CALLS_END, INVOKE, INVOKE_END, PARAMETER, PARAMETER_END)
)
