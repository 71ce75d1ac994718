"""``hermes`` (Qwen2.5/Qwen3, Hermes and most models tuned on them; SGLang's ``qwen25``/``qwen`` write the same):
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, one block per call."""

from __future__ import annotations

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import Cursor, Malformed, NewId, ToolCallFormat, strict_json, tool_call


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls = []
    while not cursor.at_end:
        cursor.expect("<tool_call>")
        value = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect("</tool_call>")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = strict_json(arguments)
        if not isinstance(arguments, dict):
            raise Malformed("the arguments are not a JSON object")
        calls.append(tool_call(new_id(), value.get("name"), arguments))
        cursor.skip_whitespace()
    return calls


FORMAT = ToolCallFormat("hermes", "<tool_call>", read, markers=("</tool_call>",))
