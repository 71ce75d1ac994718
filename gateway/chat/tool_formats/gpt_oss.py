"""``gpt-oss`` (harmony): a tool call is an assistant message on the commentary channel addressed to the function,
``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (the
recipient may stand after the role instead, as gpt-oss's Hugging Face template writes it). The reasoning format
``gpt-oss`` (``gateway.chat.harmony``) hands this parser the content with the call messages as written, the first
one's ``<|start|>assistant`` (the generation prompt's) put back; ``<|call|>`` ends the completion, so SGLang leaves
it out of the text. The calls get new ``call_...`` ids (harmony writes none)."""

from __future__ import annotations

from gateway.chat import harmony
from gateway.chat.messages import Tool, ToolCall
from gateway.chat.tool_formats.base import Cursor, Malformed, NewId, ToolCallFormat, tag_name, tool_call

_FUNCTIONS = "functions."


def read(cursor: Cursor, tools: tuple[Tool, ...], new_id: NewId) -> list[ToolCall]:
    calls: list[ToolCall] = []
    while True:
        cursor.expect(harmony.START)
        header = harmony.parse_header(cursor.until(harmony.MESSAGE))
        if header is None or header.role != harmony.ASSISTANT or header.recipient is None:
            raise Malformed("not a harmony tool call")
        if not header.recipient.startswith(_FUNCTIONS):
            raise Malformed(f"a call to {header.recipient[:60]!r}, not to a function")
        if header.content_type not in (None, "json"):
            raise Malformed(f"arguments as {header.content_type[:20]!r}")
        name = tag_name(header.recipient[len(_FUNCTIONS) :])
        arguments = cursor.json_object()
        cursor.skip_whitespace()
        if cursor.at(harmony.CALL):
            cursor.expect(harmony.CALL)
        calls.append(tool_call(new_id(), name, arguments))
        cursor.skip_whitespace()
        if cursor.at_end:
            return calls


FORMAT = ToolCallFormat("gpt-oss", harmony.START, read, markers=harmony.MARKERS, reasoning="gpt-oss")
