"""slime_wire.sse: server-sent events decoded incrementally (WHATWG HTML, "Server-sent events", 9.2.6).

Conformance by example, two properties (events serialized with any line ends decode the same however the bytes are
split; arbitrary byte soup decodes like a line-by-line reference of the spec), the big-payload path into a buffer of
the caller's, ``max_event_bytes``, and the "every byte scanned once" claim, checked by counting the bytes that
``bytes.find`` is asked to scan (a ``bytes`` subclass whose ``find`` keeps count) and the memory a line end costs.
"""

from __future__ import annotations

import itertools
import mmap
import random
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_wire.sse import SSEDecoder, SSEError, SSEEvent

BOM = b"\xef\xbb\xbf"
NO_LINE_END = bytes(range(256)).replace(b"\n", b"N").replace(b"\r", b"R")  # every other byte value


# ---- helpers ---------------------------------------------------------------------------------------------------------
def decode(stream: bytes, **options: Any) -> list[SSEEvent]:
    return SSEDecoder(**options).feed(stream)


def decode_in_pieces(pieces: Sequence[bytes], **options: Any) -> list[SSEEvent]:
    decoder = SSEDecoder(**options)
    return [event for piece in pieces for event in decoder.feed(piece)]


def split_at(stream: bytes, cuts: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def plain(events: Sequence[SSEEvent]) -> list[tuple[bytes, str]]:
    """Events as (data bytes, type): comparable whatever buffer type a payload came in."""
    return [(bytes(event.data), event.event) for event in events]


def reference(stream: bytes) -> list[tuple[bytes, str]]:
    """The spec's algorithm, line by line, with nothing incremental about it (the oracle for the fuzz test)."""
    if stream.startswith(BOM):
        stream = stream[len(BOM) :]
    lines: list[bytes] = []
    start = i = 0
    while i < len(stream):
        if stream[i : i + 2] == b"\r\n":
            lines.append(stream[start:i])
            i += 2
            start = i
        elif stream[i : i + 1] in (b"\r", b"\n"):
            lines.append(stream[start:i])
            i += 1
            start = i
        else:
            i += 1
    # stream[start:] has no line end: an unfinished line, never processed
    events: list[tuple[bytes, str]] = []
    data, event_type = b"", b""
    for line in lines:
        if not line:
            if data:
                events.append(
                    (data[:-1] if data.endswith(b"\n") else data, event_type.decode("utf-8", "replace") or "message")
                )
            data, event_type = b"", b""
            continue
        if line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data += value + b"\n"
        elif name == b"event":
            event_type = value
    return events


class CountingBytes(bytes):
    """``bytes`` whose ``find`` counts the bytes it is asked to scan (the decoder keeps ``bytes`` input as is)."""

    scanned = 0

    def find(self, sub: Any, start: Any = 0, end: Any = None) -> int:  # type: ignore[override]
        stop = len(self) if end is None else min(end, len(self))
        found = bytes.find(self, sub, start, stop)
        CountingBytes.scanned += (found - start + 1) if found != -1 else max(0, stop - start)
        return found


def mmap_buffer(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


# ---- conformance by example ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_line_ends(eol: bytes) -> None:
    stream = b"data: one" + eol + eol + b"event: two" + eol + b"data: 2" + eol + eol
    assert decode(stream) == [SSEEvent(b"one"), SSEEvent(b"2", "two")]


def test_mixed_line_ends_in_one_stream() -> None:
    stream = b"data: a\rdata: b\ndata: c\r\n\r\rdata: d\n\r\n"
    assert decode(stream) == [SSEEvent(b"a\nb\nc"), SSEEvent(b"d")]


def test_cr_at_the_end_of_a_feed_and_lf_at_the_start_of_the_next_are_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    # the LF completes the CRLF of "data: x": it is not a blank line, so nothing is dispatched yet
    assert decoder.feed(b"\ndata: y\r") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\r") == [SSEEvent(b"x\ny")]
    assert decoder.feed(b"\n") == []  # the LF of that CRLF, not a second blank line


def test_cr_then_an_empty_feed_then_lf() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\n") == []  # still the LF of the CRLF
    assert decoder.feed(b"\n") == [SSEEvent(b"x")]


def test_cr_then_a_feed_starting_with_another_cr_is_a_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"\rdata: y\n\n") == [SSEEvent(b"x"), SSEEvent(b"y")]


def test_multi_line_data_is_joined_by_lf() -> None:
    assert decode(b"data: a\ndata: b\ndata:c\n\n") == [SSEEvent(b"a\nb\nc")]


def test_data_without_colon_is_an_empty_data_line() -> None:
    assert decode(b"data\n\n") == [SSEEvent(b"")]
    assert decode(b"data\ndata\n\n") == [SSEEvent(b"\n")]
    assert decode(b"data: a\ndata\ndata: b\n\n") == [SSEEvent(b"a\n\nb")]


def test_empty_data_lines() -> None:
    # "data:" makes the data buffer "\n", which is not empty: the event is dispatched, with empty data
    assert decode(b"data:\n\n") == [SSEEvent(b"")]
    assert decode(b"data: \n\n") == [SSEEvent(b"")]
    assert decode(b"data:\ndata:\n\n") == [SSEEvent(b"\n")]


def test_only_one_leading_space_is_stripped() -> None:
    assert decode(b"data:  two spaces\n\n") == [SSEEvent(b" two spaces")]
    assert decode(b"data:no space\n\n") == [SSEEvent(b"no space")]
    assert decode(b"data:\tTab\n\n") == [SSEEvent(b"\tTab")]
    assert decode(b"data: trailing \n\n") == [SSEEvent(b"trailing ")]
    assert decode(b"event:  spaced\ndata: x\n\n") == [SSEEvent(b"x", " spaced")]


def test_colons_after_the_first_belong_to_the_value() -> None:
    assert decode(b'data: {"a": 1}\n\ndata::\n\n') == [SSEEvent(b'{"a": 1}'), SSEEvent(b":")]


def test_comments_are_ignored() -> None:
    stream = b": keep-alive\n:\ndata: a\n: in the middle\ndata: b\n\n:only a comment\n\n"
    assert decode(stream) == [SSEEvent(b"a\nb")]


def test_unknown_fields_and_id_and_retry_are_ignored() -> None:
    stream = b"id: 7\nretry: 100\nfoo: bar\nDATA: upper\ndat: short\ndatas: long\nx\ndata: kept\n\n"
    assert decode(stream) == [SSEEvent(b"kept")]


def test_long_unknown_field_names_are_ignored() -> None:
    # names longer than any known one, with and without a colon, and a value that looks like a field
    stream = b"verylongfieldname: data: x\nverylongfieldname\ndataevent: y\ndata : z\ndata: kept\n\n"
    assert decode(stream) == [SSEEvent(b"kept")]


def test_event_names() -> None:
    stream = b"event: add\ndata: 1\n\ndata: 2\n\nevent: remove\nevent: last\ndata: 3\n\nevent\ndata: 4\n\n"
    assert decode(stream) == [SSEEvent(b"1", "add"), SSEEvent(b"2"), SSEEvent(b"3", "last"), SSEEvent(b"4")]


def test_event_name_is_utf8() -> None:
    assert decode("event: grüße\ndata: x\n\n".encode()) == [SSEEvent(b"x", "grüße")]


def test_an_event_without_data_is_not_dispatched_and_its_type_does_not_leak() -> None:
    assert decode(b"event: lonely\n\ndata: x\n\n") == [SSEEvent(b"x", "message")]
    assert decode(b"\n\n\n") == []


def test_a_bom_is_dropped_at_the_start_of_the_stream_only() -> None:
    assert decode(BOM + b"data: x\n\n") == [SSEEvent(b"x")]
    # one BOM only: a second one makes the first line's field "\ufeffdata", which is unknown
    assert decode(BOM + BOM + b"data: x\n\ndata: y\n\n") == [SSEEvent(b"y")]
    # a BOM at the start of a later line is part of that line
    assert decode(b"data: x\n\n" + BOM + b"data: y\n\n") == [SSEEvent(b"x")]
    # nor is it dropped at the start of a later feed
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\n\n") == [SSEEvent(b"x")]
    assert decoder.feed(BOM + b"data: y\n\n") == []
    # a BOM inside data is kept
    assert decode(b"data: " + BOM + b"\n\n") == [SSEEvent(BOM)]


def test_a_bom_split_across_feeds_is_still_dropped() -> None:
    assert decode_in_pieces([BOM[:1], BOM[1:2], BOM[2:] + b"da", b"ta: x\n\n"]) == [SSEEvent(b"x")]


def test_a_final_event_without_a_blank_line_is_not_dispatched() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: done\n\ndata: cut") == [SSEEvent(b"done")]
    assert decoder.feed(b" off\n") == []
    assert decode(b"data: a\ndata: b") == []
    assert decode(b"data: a\r\n") == []


def test_bytearray_and_memoryview_input() -> None:
    decoder = SSEDecoder()
    chunk = bytearray(b"data: a\n")
    assert decoder.feed(chunk) == []
    chunk[:] = b"XXXXXXXX"  # the decoder must not keep a view of the caller's mutable buffer
    assert decoder.feed(memoryview(b"data: b\n\n")) == [SSEEvent(b"a\nb")]


def test_decoder_keeps_no_view_of_a_reused_bytearray_for_an_unfinished_line() -> None:
    decoder = SSEDecoder()
    chunk = bytearray(b"data: abc")
    assert decoder.feed(chunk) == []
    chunk[:] = b"ZZZZZZZZZ"
    assert decoder.feed(b"def\n\n") == [SSEEvent(b"abcdef")]


# ---- properties ------------------------------------------------------------------------------------------------------
data_values = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"r").replace(b"\n", b"n"))
event_names = st.text(max_size=6).map(lambda s: s.replace("\r", "r").replace("\n", "n"))
events_strategy = st.lists(
    st.tuples(st.none() | event_names, st.lists(data_values, max_size=3), st.booleans()), max_size=6
)


def serialize(
    events: Sequence[tuple[str | None, Sequence[bytes], bool]], rng: random.Random
) -> tuple[bytes, list[tuple[bytes, str]]]:
    """The stream for ``events`` (type, data lines, with a comment) in random but equivalent spellings, with its
    expected decoding."""
    lines: list[bytes] = []
    expected: list[tuple[bytes, str]] = []
    for name, data, comment in events:
        if comment:
            lines.append(b": a comment")
        if name is not None:
            lines.append(
                b"event: " + name.encode() if rng.random() < 0.5 or name.startswith(" ") else b"event:" + name.encode()
            )
        for value in data:
            if not value and rng.random() < 0.3:
                lines.append(b"data")
            elif value.startswith(b" ") or rng.random() < 0.5:
                lines.append(b"data: " + value)
            else:
                lines.append(b"data:" + value)
        if rng.random() < 0.2:
            lines.append(b"id: 1")
        lines.append(b"")
        if data:
            expected.append((b"\n".join(data), name or "message"))
    out = bytearray()
    previous = b""
    for line in lines:
        # after a CR, an empty line must not end with LF: "\r" + "\n" is one line end, not two
        choices = [b"\r", b"\r\n"] if previous == b"\r" and not line else [b"\n", b"\r\n", b"\r"]
        previous = rng.choice(choices)
        out += line + previous
    return bytes(out), expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events_strategy, seed=st.integers(0, 2**32 - 1), bom=st.booleans())
def test_any_split_decodes_like_one_feed(
    events: list[tuple[str | None, list[bytes], bool]], seed: int, bom: bool
) -> None:
    rng = random.Random(seed)
    stream, expected = serialize(events, rng)
    if bom:
        stream = BOM + stream
    whole = plain(decode(stream))
    assert whole == expected
    cuts = rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(0, 8))) if len(stream) > 1 else []
    assert plain(decode_in_pieces(split_at(stream, cuts))) == expected
    assert plain(decode_in_pieces([stream[i : i + 1] for i in range(len(stream))])) == expected
    # the big-payload path (a buffer of the caller's from 2 bytes on) decodes the same
    big = {"big_buffer": bytearray, "big_payload_bytes": 2}
    assert plain(decode_in_pieces(split_at(stream, cuts), **big)) == expected
    assert plain(decode_in_pieces([stream[i : i + 1] for i in range(len(stream))], **big)) == expected


soup_tokens = st.sampled_from(
    [b"data", b"event", b"id", b"dat", b"datax", b":", b" ", b"\r", b"\n", b"\r\n", b"x", b"\xc3\xa9", b"\xff", BOM]
)


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(soup_tokens, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_byte_soup_decodes_like_the_reference(tokens: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(tokens)
    expected = reference(stream)
    pieces = split_at(stream, [min(cut, len(stream)) for cut in cuts])
    assert plain(decode_in_pieces(pieces)) == expected
    assert plain(decode_in_pieces([stream[i : i + 1] for i in range(len(stream))])) == expected
    assert plain(decode_in_pieces(pieces, big_buffer=bytearray, big_payload_bytes=1)) == expected


# ---- big payloads into the caller's buffer ---------------------------------------------------------------------------
def test_a_big_payload_goes_into_the_callers_buffer() -> None:
    payload = NO_LINE_END * 64  # 16 KiB
    asked: list[int] = []

    def big_buffer(size: int) -> mmap.mmap:
        asked.append(size)
        return mmap_buffer(size)

    decoder = SSEDecoder(big_buffer=big_buffer, big_payload_bytes=len(payload))
    [event] = decoder.feed(b"data: " + payload + b"\n\n")
    assert isinstance(event.data, mmap.mmap)
    assert asked == [len(payload)]
    assert event.data[:] == payload
    assert event.data.find(b"\x00\x01\x02") == 0  # the buffer supports find, as callers search it
    # one byte under the threshold: plain bytes, no buffer asked for
    [small] = decoder.feed(b"data: " + payload[:-1] + b"\n\n")
    assert type(small.data) is bytes and small.data == payload[:-1]
    assert asked == [len(payload)]


def test_without_big_buffer_big_payloads_are_bytes() -> None:
    payload = b"z" * 5000
    [event] = decode(b"data: " + payload + b"\n\n", big_payload_bytes=10)
    assert type(event.data) is bytes and event.data == payload


@pytest.mark.parametrize("prefix_cut", [0, 1, 2, 4, 5, 6], ids=lambda cut: f"prefix-cut-{cut}")
def test_a_big_payload_in_many_pieces_with_the_prefix_split(prefix_cut: int) -> None:
    rng = random.Random(prefix_cut)
    payload = rng.randbytes(300_000).replace(b"\n", b"N").replace(b"\r", b"R")
    stream = b"event: big\r\ndata: " + payload + b"\r\n\r\n"
    start = stream.index(b"data: ")
    cuts = {start + prefix_cut} if prefix_cut else set()
    cuts |= set(rng.sample(range(1, len(stream)), 200))
    cuts.add(len(stream) - 1)  # the CR and the LF of the last line end in different pieces
    buffers: list[mmap.mmap] = []

    def big_buffer(size: int) -> mmap.mmap:
        buffers.append(mmap_buffer(size))
        return buffers[-1]

    events = decode_in_pieces(split_at(stream, sorted(cuts)), big_buffer=big_buffer, big_payload_bytes=1 << 16)
    assert len(events) == 1 and events[0].event == "big"
    assert len(buffers) == 1 and events[0].data is buffers[0]
    assert len(buffers[0]) == len(payload)
    assert buffers[0][:] == payload


def test_a_big_payload_whose_first_piece_is_shorter_than_the_field_name() -> None:
    payload = b"p" * 100_000
    pieces = [b"d", b"a", b"t", b"a", b":", b" ", payload[:10], payload[10:], b"\n", b"\n"]
    [event] = decode_in_pieces(pieces, big_buffer=mmap_buffer, big_payload_bytes=1000)
    assert isinstance(event.data, mmap.mmap) and event.data[:] == payload


def test_big_and_small_data_lines_of_one_event_are_joined() -> None:
    big = b"B" * 2000
    [event] = decode(b"data: s\ndata: " + big + b"\n\n", big_buffer=mmap_buffer, big_payload_bytes=1000)
    assert bytes(event.data) == b"s\n" + big


# ---- limits ----------------------------------------------------------------------------------------------------------
def test_max_event_bytes_bounds_one_line_before_it_ends() -> None:
    decoder = SSEDecoder(max_event_bytes=10_000)
    decoder.feed(b"data: " + b"x" * 5000)
    with pytest.raises(SSEError):
        decoder.feed(b"x" * 6000)  # no line end ever came: the decoder must not buffer on


def test_max_event_bytes_counts_the_data_lines_of_one_event() -> None:
    decoder = SSEDecoder(max_event_bytes=1000)
    line = b"data: " + b"y" * 99 + b"\n"
    decoder.feed(line * 5)
    with pytest.raises(SSEError):
        decoder.feed(line * 10)


def test_max_event_bytes_is_per_event() -> None:
    decoder = SSEDecoder(max_event_bytes=1000)
    event = b"data: " + b"y" * 400 + b"\ndata: " + b"z" * 400 + b"\n\n"
    events = [e for _ in range(20) for e in decoder.feed(event)]  # 16 KB in all, each event under the limit
    assert len(events) == 20 and all(e.data == b"y" * 400 + b"\n" + b"z" * 400 for e in events)
    # an event with no data still resets the count
    decoder.feed(b"data: " + b"q" * 900 + b"\nevent: x\n\n")


def test_sse_error_is_a_value_error() -> None:
    assert issubclass(SSEError, ValueError)


# ---- every byte scanned once -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [b"data: x\n\n", b"data: x\r\r", b"data: x\r\n\r\n", b"data: x\r\r\n\n", b": c\rdata: x\n\r\n"],
    ids=["LF", "CR", "CRLF", "CR-then-LF", "mixed"],
)
def test_bytes_find_scans_each_byte_a_bounded_number_of_times(line: bytes) -> None:
    """Many short lines in one chunk: a decoder that searched the rest of the chunk for each line (an LF search
    past a CR-ended line, say) asks ``find`` to scan ~ lines x chunk bytes."""
    chunk = CountingBytes(line * 20_000)
    CountingBytes.scanned = 0
    events = SSEDecoder().feed(chunk)
    assert len(events) == 20_000 and all(event.data == b"x" for event in events)
    assert CountingBytes.scanned <= 3 * len(chunk)


def test_a_20_mb_event_in_64_kib_pieces_keeps_one_piece_per_feed_and_scans_linearly() -> None:
    piece_bytes, total = 64 * 1024, 20 * 1024 * 1024
    payload = NO_LINE_END * (piece_bytes // 256)
    decoder = SSEDecoder(big_buffer=mmap_buffer, big_payload_bytes=1 << 20)
    CountingBytes.scanned = 0
    fed = 0
    assert decoder.feed(CountingBytes(b"data: ")) == []
    feeds = 1
    while fed < total:
        assert decoder.feed(CountingBytes(payload)) == []
        fed += piece_bytes
        feeds += 1
    assert len(decoder._line) == feeds  # each piece kept as it arrived: never joined or copied before the line ends
    assert decoder._line_bytes == total + len(b"data: ")
    [event] = decoder.feed(CountingBytes(b"\n\n"))
    assert isinstance(event.data, mmap.mmap) and len(event.data) == total
    assert event.data[:piece_bytes] == payload and event.data[total - piece_bytes :] == payload
    # two searches (LF, CR) over each new byte, nothing rescanned
    assert CountingBytes.scanned <= 2 * (total + 16)


def test_ending_a_big_line_copies_it_once() -> None:
    """The line's head (its field name) comes from the first bytes only: with the ``data: `` prefix split, joining
    the whole line to read its first 7 bytes would cost a second copy of the payload."""
    size = 8 * 1024 * 1024
    decoder = SSEDecoder(big_buffer=mmap_buffer, big_payload_bytes=1 << 20)  # mmap memory is not traced
    decoder.feed(b"da")
    decoder.feed(b"ta: ")
    block = b"m" * (1 << 20)
    for _ in range(size // len(block)):
        decoder.feed(block)
    tracemalloc.start()
    try:
        [event] = decoder.feed(b"\n\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(event.data) == size
    assert peak < size // 4, f"ending the line allocated {peak} bytes"


# ---- small sanity on the helpers (the oracle must itself be right) ---------------------------------------------------
@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (b"data: a\r\n\r\n", [(b"a", "message")]),
        (b"data: a\r\r", [(b"a", "message")]),
        (b"event: e\ndata\n\n", [(b"", "e")]),
        (BOM + b"data:  b\n\n", [(b" b", "message")]),
        (b"data: a\n", []),
    ],
)
def test_reference_oracle(stream: bytes, expected: list[tuple[bytes, str]]) -> None:
    assert reference(stream) == expected
