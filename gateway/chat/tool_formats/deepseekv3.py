"""``deepseekv3`` (DeepSeek-V3, V3-0324, R1-0528): the V3.1 markers, each call typed ``function`` and its arguments
in a fenced JSON block: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
<｜tool▁call▁end｜>``, calls separated by a newline, then ``<｜tool▁calls▁end｜>``."""

from __future__ import annotations

from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import Cursor, NewId, ToolCallFormat, read_sections, tag_name, tool_call
from gateway.chat.tool_formats.deepseekv31 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    def call() -> ToolCall:
        cursor.expect(CALL_BEGIN)
        cursor.expect("function")
        cursor.expect(SEP)
        name = tag_name(cursor.until("\n").strip())
        cursor.skip_whitespace()
        cursor.expect("```json")
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        cursor.expect("```")
        cursor.skip_whitespace()
        cursor.expect(CALL_END)
        return tool_call(new_id(), name, arguments)

    return read_sections(cursor, CALLS_BEGIN, CALLS_END, call)


FORMAT = ToolCallFormat("deepseekv3", CALLS_BEGIN, read, markers=(CALLS_END, CALL_BEGIN, SEP, CALL_END))
