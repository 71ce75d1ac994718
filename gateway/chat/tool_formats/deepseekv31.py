"""``deepseekv31`` (DeepSeek-V3.1): ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>
{...}<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``."""

from __future__ import annotations

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import Cursor, NewId, ToolCallFormat, read_sections, tag_name, tool_call

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    def call() -> ToolCall:
        cursor.expect(CALL_BEGIN)
        name = tag_name(cursor.until(SEP).strip())
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect(CALL_END)
        return tool_call(new_id(), name, arguments)

    return read_sections(cursor, CALLS_BEGIN, CALLS_END, call)


FORMAT = ToolCallFormat("deepseekv31", CALLS_BEGIN, read, markers=(CALLS_END, CALL_BEGIN, SEP, CALL_END))
