"""``qwen3_coder`` (Qwen3-Coder, Qwen3.5 and later): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
</parameter>\\n</function>\\n</tool_call>``, one block per call; values are bare text, typed by the tool's schema."""

from __future__ import annotations

from typing import Any

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import (
    Cursor,
    Malformed,
    NewId,
    ToolCallFormat,
    properties,
    strip_one_newline,
    tag_name,
    tool_call,
    typed_value,
)


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls = []
    while not cursor.at_end:
        cursor.expect("<tool_call>")
        cursor.skip_whitespace()
        cursor.expect("<function=")
        name = tag_name(cursor.until(">"))
        schema = properties(tools, name)
        arguments: dict[str, Any] = {}
        while True:
            cursor.skip_whitespace()
            if cursor.at("</function>"):
                break
            cursor.expect("<parameter=")
            key = tag_name(cursor.until(">"))
            value = strip_one_newline(cursor.value_until("</parameter>", ("<parameter=", "</function>")))
            if key in arguments:
                raise Malformed(f"parameter {key!r} twice")
            arguments[key] = typed_value(value, schema.get(key))
        cursor.expect("</function>")
        cursor.skip_whitespace()
        cursor.expect("</tool_call>")
        calls.append(tool_call(new_id(), name, arguments))
        cursor.skip_whitespace()
    return calls


FORMAT = ToolCallFormat(
    "qwen3_coder", "<tool_call>", read, markers=("</tool_call>", "<function=", "</function>", "</parameter>")
)
