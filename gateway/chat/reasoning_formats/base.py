"""What a reasoning format gives the chat service: the split of a whole completion, a stream splitter that agrees
with it, and how to read reasoning a client left inside an assistant message's content."""

from __future__ import annotations

from typing import Literal, Protocol

Channel = Literal["reasoning", "content"]


class ReasoningSplitter(Protocol):
    """A streamed completion split as it arrives: the pieces of each channel, joined, are the whole text's split
    (content still held back at the end is sent from the parsed reply)."""

    def feed(self, piece: str) -> list[tuple[Channel, str]]: ...

    def finish(self, reasoning: str | None) -> str:
        """The reasoning still to send once the completion is whole and split (``reasoning``: its reasoning)."""
        ...


class ReasoningFormat(Protocol):
    name: str  # SGLang's --reasoning-parser name
    markers: tuple[str, ...]  # the text the format is read by: must reach the gateway as text
    tool_parser: str | None  # the tool-call format it only works with (gpt-oss's harmony carries both)

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether a completion after ``prompt_tail`` (the end of the rendered prompt) starts inside the reasoning."""
        ...

    def split(self, text: str, *, inside: bool) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole completion; reasoning None when it has none."""
        ...

    def stream(self, *, inside: bool) -> ReasoningSplitter: ...

    def split_history(self, content: str) -> tuple[str | None, str] | None:
        """The reasoning a client left inside an earlier assistant message's content, split out as the model's
        reply was (None: nothing to split, the content stays as it is)."""
        ...
