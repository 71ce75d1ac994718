"""``deepseekv31`` (DeepSeek-V3.1): ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>
{...}<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``."""

from __future__ import annotations

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import Cursor, NewId, ToolCallFormat, expect_end, tag_name, tool_call

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    cursor.expect(CALLS_BEGIN)
    calls: list[ToolCall] = []
    while True:
        cursor.skip_whitespace()
        if cursor.at(CALLS_END) and calls:
            break
        cursor.expect(CALL_BEGIN)
        name = tag_name(cursor.until(SEP).strip())
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect(CALL_END)
        calls.append(tool_call(new_id(), name, arguments))
    cursor.expect(CALLS_END)
    expect_end(cursor)
    return calls


FORMAT = ToolCallFormat("deepseekv31", CALLS_BEGIN, read, markers=(CALLS_END, CALL_BEGIN, SEP, CALL_END))
