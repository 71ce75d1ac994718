"""OpenAI's harmony format (gpt-oss), as a completion after the generation prompt ``<|start|>assistant`` writes it.

A completion is a run of assistant messages, each ``<|channel|>CHANNEL ...<|message|>BODY`` then a terminator: the
first one's ``<|start|>assistant`` is the prompt's (written again, it reads the same), the next ones begin with it.
``<|end|>`` closes a message the model goes on after; ``<|call|>`` (a tool call) and ``<|return|>`` (the answer) end
the completion, and as stop tokens SGLang leaves them out of the text. The channels: ``analysis`` is the reasoning,
``final`` the answer, ``commentary`` a preamble to the user or, with a recipient (``to=functions.NAME``, in the
channel part or after the role), a tool call whose body is its arguments (``<|constrain|>json``).

``HarmonyReader`` reads a completion as it arrives into reasoning (the analysis bodies) and content (the final and
preamble bodies, then, raw, everything from the first call message on: the tool-call parser reads that part), so a
stream and the whole text give the same split. Where the text stops being harmony (an unknown channel, a header
without ``<|message|>``, text after a terminator), the rest is content as written: the messages before it keep
their split, so a streamed reasoning never has to be taken back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gateway.chat.tool_formats.base import partial_marker_length

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
ASSISTANT = "assistant"
_TERMINATORS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_HEADER_LIMIT = 4096  # a header is a few words: past this without <|message|>, it is not one

Channel = Literal["reasoning", "content"]
Piece = tuple[Channel, str]


@dataclass(frozen=True, slots=True)
class Header:
    role: str
    channel: str
    recipient: str | None
    content_type: str | None


def parse_header(text: str) -> Header | None:
    """The header of a message (what stands between ``<|start|>`` and ``<|message|>``, or from the completion's
    start for its first message): ``ROLE[ to=R]<|channel|>CHANNEL[ to=R][ [<|constrain|>]TYPE]``. None when it is
    not one."""
    at = text.find(CHANNEL)
    if at < 0:
        return None
    role_part, channel_part = text[:at], text[at + len(CHANNEL) :]
    if CHANNEL in channel_part or any(m in text for m in (START, MESSAGE, *_TERMINATORS)):
        return None
    role = role_part.split(" to=")[0].strip()
    found = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
    recipient = found.group(1) if found else None
    words = _RECIPIENT.sub(" ", channel_part.replace(CONSTRAIN, " ")).split()
    if not words:
        return None
    channel, *rest = words
    if len(rest) > 1:
        return None
    return Header(role, channel, recipient, rest[0] if rest else None)


class HarmonyReader:
    """A completion split as it arrives (``feed``; ``close`` once it is whole) into reasoning and content pieces.
    Text that may still turn out to be markup (a partial marker, a header without its ``<|message|>`` yet) is held
    back until it can be decided."""

    def __init__(self) -> None:
        self._buffer = ""  # received, not decided yet
        self._state: Literal["first", "header", "body", "between", "raw"] = "first"
        self._kind: Channel = "content"  # what the body being read is
        self.harmony = True  # False: the completion did not start as harmony (all of it is content)
        self.reasoning_messages = 0

    def feed(self, piece: str) -> list[Piece]:
        self._buffer += piece
        return self._run(final=False)

    def close(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            step = getattr(self, f"_{self._state}")(final, out)
            if not step:
                return [(channel, text) for channel, text in out if text]

    # Each state's step: True when it moved on (run again), False when it needs more text.
    def _first(self, final: bool, out: list[Piece]) -> bool:
        buffer = self._buffer
        if buffer.startswith((CHANNEL, START)):  # a completion that repeats <|start|>assistant reads the same
            self._state = "header"
            return True
        if (CHANNEL.startswith(buffer) or START.startswith(buffer)) and not final:
            return False  # could still become <|channel|> or <|start|>
        self.harmony = False
        self._state = "raw"
        return True

    def _header(self, final: bool, out: list[Piece]) -> bool:
        buffer = self._buffer
        at = buffer.find(MESSAGE)
        first = not buffer.startswith(START)
        if at < 0:
            if final or len(buffer) > _HEADER_LIMIT or any(m in buffer for m in _TERMINATORS):
                self._state = "raw"
                return True
            return False
        header = parse_header(buffer[:at] if first else buffer[len(START) : at])
        if header is None or (not first and header.role != ASSISTANT):
            self._state = "raw"
            return True
        if header.recipient is not None:  # a tool call: the rest is the tool-call parser's, as written
            if first:
                self._buffer = START + ASSISTANT + buffer
            self._state = "raw"
            return True
        if header.channel == "analysis":
            self._kind = "reasoning"
            self.reasoning_messages += 1
        elif header.channel in ("final", "commentary"):
            self._kind = "content"
        else:
            self._state = "raw"
            return True
        self._buffer = buffer[at + len(MESSAGE) :]
        self._state = "body"
        return True

    def _body(self, final: bool, out: list[Piece]) -> bool:
        buffer = self._buffer
        ends = [e for e in (buffer.find(t) for t in _TERMINATORS) if e >= 0]
        if ends:
            end = min(ends)
            out.append((self._kind, buffer[:end]))
            terminator = next(t for t in _TERMINATORS if buffer.startswith(t, end))
            self._buffer = buffer[end + len(terminator) :]
            self._state = "between"
            return True
        hold = 0 if final else max(partial_marker_length(buffer, t) for t in _TERMINATORS)
        out.append((self._kind, buffer[: len(buffer) - hold]))
        self._buffer = buffer[len(buffer) - hold :]
        return False

    def _between(self, final: bool, out: list[Piece]) -> bool:
        buffer = self._buffer
        if buffer.startswith(START):
            self._state = "header"
            return True
        if not buffer or (START.startswith(buffer) and not final):
            return False
        self._state = "raw"
        return True

    def _raw(self, final: bool, out: list[Piece]) -> bool:
        out.append(("content", self._buffer))
        self._buffer = ""
        return False


def split(text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole completion; reasoning None when it has no analysis message."""
    reader = HarmonyReader()
    pieces = reader.feed(text) + reader.close()
    if not reader.harmony:
        return None, text
    reasoning = "".join(t for channel, t in pieces if channel == "reasoning")
    content = "".join(t for channel, t in pieces if channel == "content")
    return (reasoning if reader.reasoning_messages else None), content
