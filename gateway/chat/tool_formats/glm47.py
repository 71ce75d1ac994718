"""``glm47`` (GLM-4.7, GLM-5): GLM-4.5's parts with nothing between them,
``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>``; the same reader (it takes the
whitespace between parts as optional)."""

from __future__ import annotations

from gateway.chat.tool_formats import glm45
from gateway.chat.tool_formats.base import ToolCallFormat

FORMAT = ToolCallFormat("glm47", "<tool_call>", glm45.read, markers=glm45.MARKERS)
