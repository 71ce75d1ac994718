"""Server-sent events, decoded incrementally: every byte is scanned once, whatever the event sizes.

The event stream format (WHATWG HTML, "Server-sent events", section 9.2.6): lines end with CRLF, LF or CR; a line
``field: value`` (one leading space of the value dropped) sets a field, a line starting with ``:`` is a comment,
and a blank line dispatches the event, its ``data`` being the ``data`` lines joined by LF. An event not ended by a
blank line when the stream ends is dropped.

Why by hand: the SSE packages on PyPI decode text lines with ``str.splitlines`` (a copy and a decode of every
byte, megabytes for the last event of a big MoE turn) or rescan their buffer on every read, and none can put a big
payload into a buffer of the caller's. This decoder searches only bytes it has not seen, keeps an unfinished line
as the pieces it arrived in, and joins them once, into ``big_buffer(size)`` when given and the payload is big.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Payload = Any  # bytes, or whatever ``big_buffer`` returns (a writable buffer that supports ``find``, e.g. an mmap)

_BOM = b"\xef\xbb\xbf"
_FIELDS = (b"data", b"event", b"id", b"retry")
# How many leading bytes of a line decide its field: the longest name with its colon and one space.
_FIELD_HEAD = max(len(name) for name in _FIELDS) + 2
DEFAULT_BIG_PAYLOAD_BYTES = 1 << 20


class SSEError(ValueError):
    """The stream breaks a limit of the decoder (an event larger than ``max_event_bytes``)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: Payload  # the data lines joined by LF
    event: str = "message"


class SSEDecoder:
    """``feed(bytes)`` -> the events completed by those bytes. One decoder per stream.

    ``big_buffer(size)``: where a payload of at least ``big_payload_bytes`` goes (the caller can recycle it); by
    default such payloads are bytes like the others. ``max_event_bytes`` bounds the bytes one event may buffer.
    """

    def __init__(
        self,
        *,
        big_buffer: Callable[[int], Any] | None = None,
        big_payload_bytes: int = DEFAULT_BIG_PAYLOAD_BYTES,
        max_event_bytes: int | None = None,
    ) -> None:
        self._big_buffer = big_buffer
        self._big_payload_bytes = big_payload_bytes
        self._max_event_bytes = max_event_bytes
        self._line: list[memoryview] = []  # the unfinished line, as the pieces it arrived in
        self._line_bytes = 0
        self._event_bytes = 0
        self._after_cr = False  # the last line ended with CR: an LF right after it belongs to that line end
        self._first_line = True
        self._data: list[Payload] = []
        self._event_type = ""

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[SSEEvent]:
        data = chunk if isinstance(chunk, bytes) else bytes(chunk)  # bytes.find is memchr; pieces may be kept
        view = memoryview(data)
        end = len(data)
        pos = 0
        if self._after_cr and end:
            self._after_cr = False
            if data[0] == 0x0A:
                pos = 1
        events: list[SSEEvent] = []
        # The next LF is searched for again only once a line end has passed it: searching afresh for every line
        # rescanned the rest of the chunk per CR-ended line (quadratic in a chunk of many CR-ended lines).
        lf = data.find(b"\n", pos)
        while pos < end:
            line_start = pos
            if lf != -1 and lf < pos:
                lf = data.find(b"\n", pos)
            cr = data.find(b"\r", pos, end if lf == -1 else lf)
            if cr != -1:
                line_end, pos = cr, cr + 1
                if pos == end:
                    self._after_cr = True
                elif data[pos] == 0x0A:
                    pos += 1
            elif lf != -1:
                line_end, pos = lf, lf + 1
            else:
                self._keep(view[line_start:end])
                break
            self._keep(view[line_start:line_end])
            event = self._end_line()
            if event is not None:
                events.append(event)
        return events

    def _keep(self, piece: memoryview) -> None:
        if not piece:
            return
        self._line.append(piece)
        self._line_bytes += len(piece)
        if self._max_event_bytes is not None and self._event_bytes + self._line_bytes > self._max_event_bytes:
            raise SSEError(f"an event is larger than {self._max_event_bytes} bytes")

    def _end_line(self) -> SSEEvent | None:
        pieces, size = self._line, self._line_bytes
        self._line, self._line_bytes = [], 0
        head = _head(pieces, _FIELD_HEAD)
        if self._first_line:
            self._first_line = False
            if head.startswith(_BOM):
                pieces, size = _drop_front(pieces, len(_BOM)), size - len(_BOM)
                head = _head(pieces, _FIELD_HEAD)
        if not size:
            return self._dispatch()
        colon = head.find(b":")
        if colon == 0:
            return None  # a comment
        if colon == -1:
            if size > len(head):
                return None  # a field name longer than any known one
            name, value_at = head, size
        else:
            name, value_at = head[:colon], colon + 1
            if head[value_at : value_at + 1] == b" ":
                value_at += 1
        if name == b"data":
            value = self._join(pieces, value_at, size)
            self._data.append(value)
            self._event_bytes += len(value) + 1
        elif name == b"event":
            self._event_type = bytes(self._join(pieces, value_at, size)).decode("utf-8", "replace")
        # "id" and "retry" serve reconnection, which the callers here never do; other fields are ignored by the spec
        return None

    def _join(self, pieces: list[memoryview], start: int, size: int) -> Payload:
        """The line's bytes from ``start`` on, in one buffer: copied once."""
        length = size - start
        if self._big_buffer is not None and length >= self._big_payload_bytes:
            out = self._big_buffer(length)
            filled = 0
            for piece in _drop_front(pieces, start):
                out[filled : filled + len(piece)] = piece
                filled += len(piece)
            return out
        if len(pieces) == 1:
            return bytes(pieces[0][start:])
        return b"".join(_drop_front(pieces, start))

    def _dispatch(self) -> SSEEvent | None:
        data, event_type = self._data, self._event_type or "message"
        self._data, self._event_type, self._event_bytes = [], "", 0
        if not data:
            return None
        return SSEEvent(data[0] if len(data) == 1 else b"\n".join(bytes(d) for d in data), event_type)


def _head(pieces: list[memoryview], size: int) -> bytes:
    """The first ``size`` bytes of a line kept as pieces (fewer if the line is shorter)."""
    if pieces and len(pieces[0]) >= size:
        return bytes(pieces[0][:size])
    head = bytearray()  # join only the pieces the head needs, not a whole (maybe 20 MB) line
    for piece in pieces:
        head += piece[: size - len(head)]
        if len(head) >= size:
            break
    return bytes(head)


def _drop_front(pieces: list[memoryview], count: int) -> list[memoryview]:
    """The pieces without their first ``count`` bytes."""
    out = []
    for piece in pieces:
        if count >= len(piece):
            count -= len(piece)
            continue
        out.append(piece[count:] if count else piece)
        count = 0
    return out
