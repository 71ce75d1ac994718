"""Reasoning between ``<think>`` and ``</think>``, then the answer: Qwen3, DeepSeek-R1, GLM-4.5+, Kimi-K2-Thinking,
MiniMax-M2, DeepSeek-V3.x; the variants are parameters (``ThinkTags``).

The reasoning is the text between the tags, stripped; the content is the text after ``</think>``, its leading
whitespace stripped. The opening tag may be repeated (``<think><think>``: all of them are markup). A completion
starts inside the reasoning when the generation prompt left a ``<think>`` open (the thinking templates do), or
always for a format that says so (``always_inside``); then it has no opening tag. A completion cut before
``</think>`` is all reasoning. Without the tags (and not started inside) the completion is all content, and so is a
``<think>`` that comes after the answer began.

``tool_start``: the family's tool-call marker ends the reasoning too when no ``</think>`` follows it (Qwen3.5/3.6, GLM
and Kimi-K2 open a call before closing their reasoning, a known habit SGLang handles the same way): the reasoning is
what comes before it and the content begins with it, for the tool-call parser. A call the model only drafts in its
reasoning, before ``</think>``, stays reasoning. ``append_think`` (``minimax-append-think``): nothing is
split; the content is the whole completion with the ``<think>`` the prompt opened put back in front, so a client
that keeps the text keeps the reasoning (MiniMax-M2's interleaved thinking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.chat.reasoning_formats.base import Channel
from gateway.chat.tool_formats.base import partial_marker_length


@dataclass(frozen=True, slots=True)
class ThinkTags:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_inside: bool = False  # the output starts inside the reasoning whatever the prompt shows
    tool_start: str | None = None  # a tool-call marker that also ends the reasoning
    append_think: bool = False  # nothing split: the opened <think> put back in front of the content
    tool_parser: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end)

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether a completion that follows ``prompt_tail`` (the end of the rendered prompt) starts inside the
        reasoning: the generation prompt left a ``<think>`` open."""
        return self.always_inside or prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end)

    def split(self, text: str, *, inside: bool) -> tuple[str | None, str]:
        inside = inside or self.always_inside
        if self.append_think:
            return None, (self.start + text if inside else text)
        rest, opened = self._after_opening(text)
        if not (inside or opened):
            return None, text
        end = rest.find(self.end)
        if end < 0:
            tool = rest.find(self.tool_start) if self.tool_start else -1
            if tool >= 0:
                return rest[:tool].strip(), rest[tool:]
            return rest.strip(), ""
        return rest[:end].strip(), rest[end + len(self.end) :].lstrip()

    def _after_opening(self, text: str) -> tuple[str, bool]:
        """The text after its opening tags (leading whitespace and every ``<think>`` there), and whether it had one."""
        opened = False
        while True:
            head = text.lstrip()
            if not head.startswith(self.start):
                return text, opened
            text, opened = head[len(self.start) :], True

    def stream(self, *, inside: bool) -> ThinkStream:
        return ThinkStream(self, inside=inside)

    def split_history(self, content: str) -> tuple[str | None, str] | None:
        if self.append_think or self.start not in content:
            return None
        return self.split(content, inside=False)


class ThinkStream:
    """Splits a streamed completion into reasoning and content pieces as it arrives, holding back only what is still
    ambiguous (a partial tag, whitespace that stripping may drop), so that the pieces of each channel joined equal
    ``ThinkTags.split`` of the whole completion."""

    def __init__(self, fmt: ThinkTags, *, inside: bool) -> None:
        self.fmt = fmt
        self._inside = inside or fmt.always_inside  # without an opening tag, the text is reasoning
        # undecided: whether the text opens with <think> (more of them, once one was read: "opening")
        self._mode: Literal["undecided", "opening", "reasoning", "content"] = "undecided"
        self._buffer = ""  # undecided/opening: the text so far; reasoning: the reasoning so far (after the tags)
        self._reasoning_sent = 0  # characters of the stripped reasoning sent
        self._content_started = False  # content after </think>: leading whitespace is dropped until this is set
        if fmt.append_think:
            self._mode, self._content_started = "content", True
            self._buffer = fmt.start if self._inside else ""

    def feed(self, piece: str) -> list[tuple[Channel, str]]:
        if self._mode == "content":
            piece, self._buffer = self._buffer + piece, ""
            return self._content(piece)
        self._buffer += piece
        start = self.fmt.start
        while self._mode in ("undecided", "opening"):
            head = self._buffer.lstrip()
            if not head or (start.startswith(head) and head != start):
                return []  # could still become the opening tag
            if head.startswith(start):
                self._mode, self._buffer = "opening", head[len(start) :]
            elif self._mode == "opening" or self._inside:
                self._mode = "reasoning"
            else:
                self._mode, self._content_started = "content", True
                text, self._buffer = self._buffer, ""
                return [("content", text)]
        return self._reasoning()

    def _reasoning(self) -> list[tuple[Channel, str]]:
        buffer, fmt = self._buffer, self.fmt
        end = buffer.find(fmt.end)
        if end >= 0:
            out = self._send_reasoning(buffer[:end].strip())
            self._mode, self._buffer = "content", ""
            return out + self._content(buffer[end + len(fmt.end) :])
        safe = len(buffer) - partial_marker_length(buffer, fmt.end)
        if fmt.tool_start:
            # From a tool-call marker on, the text is the call (content) unless a </think> still follows: held back
            # until the completion ends (then ``ReplySplitter.finish`` sends it as the parsed content) or it does.
            tool = buffer.find(fmt.tool_start)
            safe = min(safe, tool if tool >= 0 else len(buffer) - partial_marker_length(buffer, fmt.tool_start))
        return self._send_reasoning(buffer[:safe].strip())

    def _send_reasoning(self, reasoning: str) -> list[tuple[Channel, str]]:
        new = reasoning[self._reasoning_sent :]
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        return [("reasoning", new)] if new else []

    def _content(self, piece: str) -> list[tuple[Channel, str]]:
        if not self._content_started:
            piece = piece.lstrip()
            self._content_started = bool(piece)
        return [("content", piece)] if piece else []

    def finish(self, reasoning: str | None) -> str:
        if reasoning is None or len(reasoning) <= self._reasoning_sent:
            return ""
        return reasoning[self._reasoning_sent :]
