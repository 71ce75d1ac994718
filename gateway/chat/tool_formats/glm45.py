"""``glm45`` (GLM-4.5, GLM-4.6; SGLang's ``glm`` too): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
</arg_value>\\n</tool_call>``, one block per call; values are bare text, typed by the tool's schema. The reader takes
the whitespace between the parts as optional, so GLM-4.7's form (none at all, ``glm47``) reads the same."""

from __future__ import annotations

from typing import Any

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import (
    Cursor,
    Malformed,
    NewId,
    ToolCallFormat,
    properties,
    tag_name,
    tool_call,
    typed_value,
)

MARKERS = ("</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls = []
    while not cursor.at_end:
        cursor.expect("<tool_call>")
        name = tag_name(cursor.until_any("\n", "<").strip())
        schema = properties(tools, name)
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
            arguments[key] = typed_value(value, schema.get(key))
        cursor.expect("</tool_call>")
        calls.append(tool_call(new_id(), name, arguments))
        cursor.skip_whitespace()
    return calls


FORMAT = ToolCallFormat("glm45", "<tool_call>", read, markers=MARKERS)
