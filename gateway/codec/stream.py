"""SGLang's cumulative SSE chunks (docs/protocol.md section 3) -> deltas, in O(new tokens) per chunk.

The SSE framing itself is ``slime_wire.sse``; these are the events' ``data`` payloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from gateway.codec.answers import AnswerBytes, DecodedTurn, decode_output_token_logprobs, parse_json_object
from gateway.codec.versions import VersionSpan, read_weight_version
from gateway.errors import UpstreamProtocolError

SSE_DONE = b"[DONE]"
_LOGPROBS_KEY = b'"output_token_logprobs":['
_TEXT_PREFIX = b'{"text":"'
_FINISH_KEY = b'"finish_reason":'
_WEIGHT_VERSION_KEY = b'"weight_version":'


@dataclass(slots=True)
class StreamDelta:
    """What one cumulative chunk added: the new tokens (and their text, when it could be cut out cheaply), and the
    chunk's ``weight_version`` (SGLang's version when it sent the chunk: the one its newest token came from)."""

    token_ids: np.ndarray
    log_probs: np.ndarray
    text: str
    weight_version: str | None = None


class CumulativeStreamDecoder:
    """Turns SGLang's cumulative chunks into deltas without re-parsing what was already seen.

    Every chunk repeats the whole ``text``, ``output_ids`` and ``output_token_logprobs`` so far; parsing each
    in full makes a turn O(n^2) in Python objects. SGLang serializes a chunk with the earlier items byte-for-byte
    as before, so the decoder remembers where the seen items end inside the log-prob list and the text, locates
    them with C-speed byte searches, and JSON-parses only the new bytes. The gateway asks without
    ``return_text_in_logprobs``, so items are ``[logprob, id, null]`` and the list ends at the first ``]]``.
    Anything unexpected falls back to a full parse of that chunk (correct, just slower).

    The final chunk (``finish_reason`` set: ``is_final``) carries the routing and top-p arrays, megabytes of base64:
    the caller decodes it like a unary answer (``decode_generate_response``, the cut-out decode) and takes its
    delta with ``final_delta``. Payloads may be bytes or a pooled buffer (an mmap): only ``find`` and slicing.

    Only the final chunk carries ``weight_versions`` (the per-token spans). For a turn cut before it, the decoder
    remembers each chunk's ``weight_version`` with the tokens it added (``partial_version_spans``).
    """

    def __init__(self) -> None:
        self.num_tokens = 0
        self.items_parsed = 0  # Python-level work done, for tests of the O(new tokens) claim
        self.full_parses = 0
        self._list_bytes = 0  # bytes from the list's '[' to the end of the last seen item
        self._text_bytes = 0  # escaped bytes of the text seen so far
        self._text_chars = 0
        # Where the keys sat in the previous chunk: everything before them only grows, so searching from
        # there costs O(new bytes) instead of a scan of the whole cumulative chunk.
        self._logprobs_key_at = 0
        self._finish_key_at = 0
        self._version_key_at = 0  # -1: a chunk had no weight_version, so none is looked for (a full scan each)
        self._fast = True
        self._version_spans: list[VersionSpan] = []  # the tokens fed so far, by the chunk version they came with

    def feed(self, payload: AnswerBytes) -> tuple[StreamDelta, dict[str, Any] | None]:
        """Decode one chunk: (what it added, the parsed answer when the chunk needed a full parse: one without
        ``finish_reason``, such as an in-band error, or one the fast path could not follow)."""
        if self._fast and self._finish_state(payload) == b"null":
            delta = self._fast_delta(payload)
            if delta is not None:
                self._note_version(delta)
                return delta, None
            self._fast = False
        answer = parse_json_object(payload)
        self.full_parses += 1
        delta = self._delta_from_answer(answer)
        self._note_version(delta)
        return delta, answer

    def partial_version_spans(self, num_tokens: int) -> tuple[VersionSpan, ...]:
        """Spans over the first ``num_tokens`` tokens fed, for a turn folded without its final chunk: each chunk's
        tokens get that chunk's ``weight_version`` (None, unknown, when it had none: SGLang sends it on every chunk
        or on none, so after a chunk without one it is no longer looked for). SGLang reports the version at
        the time it sent the chunk, so with several tokens per chunk a weight update inside one is attributed to its
        end: exact with SGLang's default of one token per chunk."""
        spans = [
            VersionSpan(span.version, span.start, min(span.end, num_tokens))
            for span in self._version_spans
            if span.start < num_tokens
        ]
        covered = spans[-1].end if spans else 0
        if covered < num_tokens:  # not expected (the caller folds what was fed); unknown rather than a wrong version
            spans.append(VersionSpan(None, covered, num_tokens))
        return tuple(spans)

    def work_bytes(self, payload: AnswerBytes) -> int:
        """How many of the chunk's bytes ``feed`` will parse: only the unseen ones on the fast path (a thread hop
        for a cumulative chunk that adds a few tokens would cost more than parsing them)."""
        if not self._fast:
            return len(payload)
        return max(0, len(payload) - self._list_bytes - self._text_bytes)

    def is_final(self, payload: AnswerBytes) -> bool:
        """Whether the chunk has a ``finish_reason`` that is not null (O(bytes since the key's last place))."""
        state = self._finish_state(payload)
        return state is not None and state != b"null"

    def final_delta(self, turn: DecodedTurn) -> StreamDelta:
        """What the final chunk added, from its decoded form (the whole turn so far)."""
        if turn.num_tokens < self.num_tokens or len(turn.text) < self._text_chars:
            raise UpstreamProtocolError("the final stream chunk holds fewer tokens or less text than the ones before")
        delta = StreamDelta(
            turn.token_ids[self.num_tokens :], turn.log_probs[self.num_tokens :], turn.text[self._text_chars :]
        )
        self.items_parsed += turn.num_tokens
        self.num_tokens, self._text_chars = turn.num_tokens, len(turn.text)
        return delta

    def _finish_state(self, payload: AnswerBytes) -> bytes | None:
        """The first 4 bytes of the ``finish_reason`` value (``b"null"`` while running), None without the key."""
        at = _find_from(payload, _FINISH_KEY, self._finish_key_at)
        if at == -1:
            return None
        self._finish_key_at = at
        return payload[at + len(_FINISH_KEY) : at + len(_FINISH_KEY) + 4]

    def _note_version(self, delta: StreamDelta) -> None:
        added = len(delta.token_ids)
        if not added:
            return
        spans = self._version_spans
        if spans and spans[-1].version == delta.weight_version:
            last = spans[-1]
            spans[-1] = VersionSpan(last.version, last.start, last.end + added)
        else:
            start = spans[-1].end if spans else 0
            spans.append(VersionSpan(delta.weight_version, start, start + added))

    def _fast_delta(self, payload: AnswerBytes) -> StreamDelta | None:
        key = _find_from(payload, _LOGPROBS_KEY, self._logprobs_key_at)
        if key == -1:
            return None
        self._logprobs_key_at = key
        open_pos = key + len(_LOGPROBS_KEY) - 1
        start = open_pos + (self._list_bytes if self.num_tokens else 1)
        if payload[start : start + 1] == b"]":
            items: list[Any] = []
            end = start - 1
        else:
            end = payload.find(b"]]", start)
            if end == -1:
                return None
            body = payload[start + 1 if self.num_tokens else start : end + 1]
            try:
                items = orjson.loads(b"[" + body + b"]")
            except orjson.JSONDecodeError:
                return None
        readable, version = self._chunk_weight_version(payload)
        if not readable:
            return None
        text = self._text_delta(payload)
        if text is None:
            return None
        try:
            ids, log_probs = decode_output_token_logprobs(items)
        except UpstreamProtocolError:
            return None
        self._list_bytes = end + 1 - open_pos
        self.num_tokens += len(items)
        self.items_parsed += len(items)
        return StreamDelta(ids, log_probs, text, version)

    def _chunk_weight_version(self, payload: AnswerBytes) -> tuple[bool, str | None]:
        """(readable, the chunk's ``weight_version``): only the value's bytes are parsed, found from where the key
        sat in the previous chunk. Not readable (an escape the cut cannot follow, a value ``read_weight_version``
        refuses): the caller falls back to a full parse, which reports a bad value."""
        if self._version_key_at == -1:
            return True, None
        at = _find_from(payload, _WEIGHT_VERSION_KEY, self._version_key_at)
        self._version_key_at = at
        if at == -1:
            return True, None
        start = at + len(_WEIGHT_VERSION_KEY)
        if payload[start : start + 1] == b'"':
            end = payload.find(b'"', start + 1)
            while end != -1 and _escaped(payload, end):
                end = payload.find(b'"', end + 1)
            end = -1 if end == -1 else end + 1
        else:  # a number or null: ends at the next separator
            end = min((pos for pos in (payload.find(b",", start), payload.find(b"}", start)) if pos != -1), default=-1)
        if end == -1:
            return False, None
        try:
            return True, read_weight_version(orjson.loads(payload[start:end]))
        except (orjson.JSONDecodeError, UpstreamProtocolError):
            return False, None

    def _text_delta(self, payload: AnswerBytes) -> str | None:
        if payload[: len(_TEXT_PREFIX)] != _TEXT_PREFIX:
            return None
        begin = len(_TEXT_PREFIX) + self._text_bytes
        close = payload.find(b'"', begin)
        while close != -1 and _escaped(payload, close):
            close = payload.find(b'"', close + 1)
        if close == -1:
            return None
        try:
            text = orjson.loads(b'"' + payload[begin:close] + b'"')
        except orjson.JSONDecodeError:
            return None
        self._text_bytes = close - len(_TEXT_PREFIX)
        self._text_chars += len(text)
        return text

    def _delta_from_answer(self, answer: dict[str, Any]) -> StreamDelta:
        meta = answer.get("meta_info") if isinstance(answer.get("meta_info"), dict) else {}
        items = meta.get("output_token_logprobs")
        if not isinstance(items, list):
            items = []
        new = items[self.num_tokens :]
        ids, log_probs = decode_output_token_logprobs(new)
        text = answer.get("text") if isinstance(answer.get("text"), str) else ""
        self.num_tokens += len(new)
        self.items_parsed += len(items)
        delta_text = text[self._text_chars :]
        self._text_chars = len(text)
        return StreamDelta(ids, log_probs, delta_text, read_weight_version(meta.get("weight_version")))


def _find_from(payload: AnswerBytes, needle: bytes, hint: int) -> int:
    """``find`` starting at where the needle was last time, falling back to a full search."""
    at = payload.find(needle, hint)
    return payload.find(needle) if at == -1 and hint else at


def _escaped(payload: AnswerBytes, quote: int) -> bool:
    """Whether the quote at ``quote`` is escaped (an odd run of backslashes right before it)."""
    run = 0
    while quote - run - 1 >= 0 and payload[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 1


def answer_rid(answer: dict[str, Any] | None, payload: AnswerBytes) -> str | None:
    """``meta_info.id`` of an answer or chunk: from its parsed form when there is one, else parsed from ``payload``."""
    parsed = answer if answer is not None else parse_json_object(payload)
    meta = parsed.get("meta_info")
    rid = meta.get("id") if isinstance(meta, dict) else None
    return rid if isinstance(rid, str) else None


def stream_error_payload(answer: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang reports errors inside a stream as ``{"error": {"message", "code"}}`` with HTTP 200."""
    error = answer.get("error")
    if error is None:
        return None
    return error if isinstance(error, dict) else {"message": str(error)}
