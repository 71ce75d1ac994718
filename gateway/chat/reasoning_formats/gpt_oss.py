"""``gpt-oss``: harmony's analysis channel is the reasoning, the final channel (and commentary preambles) the
content, and the tool calls (commentary addressed to a function) go on, as written, to the ``gpt-oss`` tool-call
parser; see ``gateway.chat.harmony``. A completion always starts inside an assistant message (the generation prompt
is ``<|start|>assistant``), so there is no "inside" to detect."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.chat import harmony
from gateway.chat.reasoning_formats.base import Channel


@dataclass(frozen=True, slots=True)
class Harmony:
    name: str = "gpt-oss"
    markers: tuple[str, ...] = harmony.MARKERS
    tool_parser: str | None = "gpt-oss"

    def starts_inside(self, prompt_tail: str) -> bool:
        return False

    def split(self, text: str, *, inside: bool) -> tuple[str | None, str]:
        return harmony.split(text)

    def stream(self, *, inside: bool) -> HarmonyStream:
        return HarmonyStream()

    def split_history(self, content: str) -> tuple[str | None, str] | None:
        return None  # a client sends the reasoning back as reasoning (or not at all), never as harmony text


class HarmonyStream:
    def __init__(self) -> None:
        self._reader = harmony.HarmonyReader()
        self._reasoning_sent = 0

    def feed(self, piece: str) -> list[tuple[Channel, str]]:
        pieces = self._reader.feed(piece)
        self._reasoning_sent += sum(len(text) for channel, text in pieces if channel == "reasoning")
        return pieces

    def finish(self, reasoning: str | None) -> str:
        if reasoning is None or len(reasoning) <= self._reasoning_sent:
            return ""
        return reasoning[self._reasoning_sent :]


FORMAT = Harmony()
