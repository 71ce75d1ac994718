"""Reasoning parsers: a reasoning model's completion split into its reasoning and its answer, selected by SGLang's
``--reasoning-parser`` names so that one value serves both.

``qwen3`` and ``deepseek_r1`` write the reasoning between ``<think>`` and ``</think>``, then the answer. The
reasoning is the text between the tags, stripped; the content is the text after ``</think>``, its leading whitespace
stripped. A completion that starts inside the reasoning (the generation prompt opened ``<think>``, as the thinking
variants' templates do; always for ``deepseek_r1``, whose template opens it) has no opening tag. A completion cut
before ``</think>`` is all reasoning. Without the tags (and not started inside) the completion is all content.

Written here rather than imported: SGLang's parsers live inside the engine (torch and all), and these are a few
string searches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.chat.tool_parsers import partial_marker_length

ReasoningParserName = Literal["none", "qwen3", "deepseek_r1"]
Channel = Literal["reasoning", "content"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_inside: bool = False  # the output starts inside the reasoning whatever the prompt shows

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether a completion that follows ``prompt_tail`` (the end of the rendered prompt) starts inside the
        reasoning: the generation prompt left a ``<think>`` open."""
        return self.always_inside or prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end)

    def split(self, text: str, *, inside: bool) -> tuple[str | None, str]:
        """``(reasoning, content)``; reasoning None when the completion has none."""
        inside = inside or self.always_inside
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text, inside = stripped[len(self.start) :], True
        if not inside:
            return None, text
        end = text.find(self.end)
        if end < 0:
            return text.strip(), ""
        return text[:end].strip(), text[end + len(self.end) :].lstrip()


REASONING_FORMATS: dict[str, ReasoningFormat | None] = {
    "none": None,
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_inside=True),
}


class ReasoningStream:
    """Splits a streamed completion into reasoning and content pieces as it arrives, holding back only what is still
    ambiguous (a partial tag, whitespace that stripping may drop), so that the pieces of each channel joined equal
    ``ReasoningFormat.split`` of the whole completion."""

    def __init__(self, fmt: ReasoningFormat, *, inside: bool) -> None:
        self.fmt = fmt
        self._inside = inside or fmt.always_inside  # without an opening tag, the text is reasoning
        self._mode: Literal["undecided", "reasoning", "content"] = "undecided"
        self._buffer = ""  # undecided: the text so far; reasoning: the reasoning so far (after the opening tag)
        self._reasoning_sent = 0  # characters of the stripped reasoning sent
        self._content_started = False  # content after </think>: leading whitespace is dropped until this is set

    def feed(self, piece: str) -> list[tuple[Channel, str]]:
        if self._mode == "content":
            return self._content(piece)
        self._buffer += piece
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if not head or (self.fmt.start.startswith(head) and head != self.fmt.start):
                return []  # could still become the opening tag
            if head.startswith(self.fmt.start):
                self._mode, self._buffer = "reasoning", head[len(self.fmt.start) :]
            elif self._inside:
                self._mode = "reasoning"
            else:
                self._mode, self._content_started = "content", True
                text, self._buffer = self._buffer, ""
                return [("content", text)]
        return self._reasoning()

    def _reasoning(self) -> list[tuple[Channel, str]]:
        buffer = self._buffer
        end = buffer.find(self.fmt.end)
        if end >= 0:
            out = self._send_reasoning(buffer[:end].strip())
            self._mode, self._buffer = "content", ""
            return out + self._content(buffer[end + len(self.fmt.end) :])
        safe = buffer[: len(buffer) - partial_marker_length(buffer, self.fmt.end)]
        return self._send_reasoning(safe.strip())

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
        """The reasoning still to send once the completion is whole and split (``reasoning``: its reasoning)."""
        if reasoning is None or len(reasoning) <= self._reasoning_sent:
            return ""
        return reasoning[self._reasoning_sent :]
