"""SGLang ``/generate`` answers -> compact numpy arrays, checked (docs/protocol.md section 2).

No I/O and no session state here: every function takes bytes/objects and returns arrays or raises
``UpstreamProtocolError`` (a 502 for the caller) saying exactly what is wrong with the answer.
"""

from __future__ import annotations

import binascii
import mmap
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pybase64

from gateway.codec.versions import VersionSpan, decode_weight_version_spans, read_weight_version
from gateway.errors import ReplayDataDropped, UpstreamProtocolError

TOP_P_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
TOP_P_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")
ROUTED_EXPERTS_KEY = "routed_experts"
# The base64 fields cut out of an answer before parsing it; of a group of aliases, the first one found.
RAW_B64_GROUPS = ((ROUTED_EXPERTS_KEY,), TOP_P_ID_KEYS, TOP_P_OFFSET_KEYS)
_ROUTED_EXPERTS_NEEDLE = b'"' + ROUTED_EXPERTS_KEY.encode() + b'":"'
# Routing is decoded in steps of this many base64 characters (a multiple of 16: whole int32 per step). 1 MiB in,
# 768 KiB out: each step's output is still in the core's 2 MiB L2 when it is checked and narrowed, and the GIL can
# change hands between steps (a single 20 MB decode holds it for milliseconds). Bench row 1, side by side: 256 KiB
# steps cost ~10% more (each step's max and narrowing pay numpy's per-call set-up, ~80 steps per answer), 2 MiB too.
ROUTING_STEP_CHARS = 1 << 20
# What an upstream answer's bytes can arrive as: a big one is received into an anonymous mmap (see
# ``slime_wire.http1.BodyBuffers``), which searches and slices like bytes.
AnswerBytes = bytes | bytearray | mmap.mmap
# Terminal counters slime sums into Sample.spec_info (speculative decoding).
SPEC_COUNTER_KEYS = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct")
INT32_MAX = 2**31 - 1
_INT_TYPE = frozenset({int})
_NUMBER_TYPES = frozenset({int, float})
MAX_FINISH_REASON_BYTES = 4096


@dataclass(frozen=True, slots=True)
class DecodedTurn:
    """One model answer, decoded and validated on its own (state-dependent checks live in the fold)."""

    token_ids: np.ndarray  # int32 [n], from output_token_logprobs (what slime trains on)
    log_probs: np.ndarray  # float32 [n]
    text: str
    finish_reason: dict[str, Any] | None
    rid: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    # flat, in the narrowest unsigned dtype holding routed_max (uint8 up to 256 experts): the stored form, which the
    # fold on the event loop can keep as it is; reshaped by the fold, which knows [L, K]
    routed_experts: np.ndarray | None = None
    routed_max: int | None = None  # the largest expert id, read as uint32 (None: not computed yet)
    top_p_ids: np.ndarray | None = None  # int32
    top_p_offsets: np.ndarray | None = None  # int32 [n + 1]
    spec_counters: dict[str, int] = field(default_factory=dict)
    # meta_info.weight_versions, validated (contiguous from 0, covering exactly the generated tokens); None when the
    # answer has none (servers before the per-token spans). See ``token_version_spans``.
    weight_version_spans: tuple[VersionSpan, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def token_version_spans(self) -> tuple[VersionSpan, ...]:
        """Which weights produced each generated token, as non-empty spans covering exactly ``num_tokens``: SGLang's
        own spans when it sent them, else the whole turn on ``weight_version`` (or unknown, None, without one)."""
        n = self.num_tokens
        if not n:
            return ()  # SGLang's zero-token form, one empty span, covers nothing
        if self.weight_version_spans is not None:
            return self.weight_version_spans
        return (VersionSpan(self.weight_version, 0, n),)

    @property
    def finish_type(self) -> str | None:
        return None if self.finish_reason is None else self.finish_reason.get("type")


def decode_generate_response(body: AnswerBytes, *, want_routing: bool, want_top_p: bool) -> DecodedTurn:
    """Decode a non-streamed ``/generate`` answer (one request, not a batch).

    The multi-megabyte base64 fields are never parsed into Python strings (that would cost ~15x decoding them):
    they are cut out of the JSON and decoded straight from the received bytes. The routing value is decoded,
    checked and narrowed to its stored dtype in one pass of cache-sized steps, which also finds where it ends.
    """
    routing = _predecode_routing(body) if want_routing else None
    found = {} if routing is None else {ROUTED_EXPERTS_KEY: routing[1]}
    rest, raw_fields = cut_raw_string_fields(body, RAW_B64_GROUPS, found)
    answer = parse_json_object(rest)
    meta = answer.get("meta_info")
    if raw_fields and isinstance(meta, dict):
        for key, value in raw_fields.items():
            if meta.get(key) == "":
                meta[key] = routing[0] if routing is not None and key == ROUTED_EXPERTS_KEY else value
    return decode_answer(answer, want_routing=want_routing, want_top_p=want_top_p)


def cut_raw_string_fields(
    body: AnswerBytes,
    groups: tuple[tuple[str, ...], ...],
    found: dict[str, tuple[int, int]] | None = None,
) -> tuple[AnswerBytes, dict[str, memoryview]]:
    """Replace the string values of the keys in ``groups`` by ``""`` and return them as views into ``body``.

    Of each group (a key and its aliases) the first key found is cut; ``found`` gives spans already known.
    Only for values that can hold no quote or backslash (base64): a key is matched as ``"key":"`` with the
    opening quote unescaped, which cannot occur inside another JSON string. A key not found (or written with
    other spacing) is left in place for the JSON parser, so this is an optimization, never a change of meaning.
    """
    spans = [(start, end, key) for key, (start, end) in (found or {}).items()]
    for group in groups:
        if any(key in (found or {}) for key in group):
            continue
        for key in group:
            span = _find_string_value(body, key, spans)
            if span is not None:
                spans.append((*span, key))
                break
    if not spans:
        return body, {}
    view = memoryview(body)
    pieces: list[bytes | memoryview] = []
    raw: dict[str, memoryview] = {}
    last = 0
    for start, end, key in sorted(spans):
        pieces.append(view[last:start])
        raw[key] = view[start:end]
        last = end
    pieces.append(view[last:])
    return b"".join(pieces), raw


def _find_string_value(body: AnswerBytes, key: str, taken: list[tuple[int, int, str]]) -> tuple[int, int] | None:
    """(start, end) of the string value of ``key``, searching around the values already cut out (a missing key
    must not cost a scan of a 20 MB routing value); the gaps after the cut values first, as the base64 fields
    follow each other at the end of SGLang's meta_info."""
    needle = b'"' + key.encode() + b'":"'
    edges = [0, *(edge for start, end, _ in sorted(taken) for edge in (start, end)), len(body)]
    for lo, hi in reversed(list(zip(edges[::2], edges[1::2], strict=True))):
        at = body.find(needle, lo, hi)
        if at == -1:
            continue
        start = at + len(needle)
        end = body.find(b'"', start)
        return None if end == -1 else (start, end)
    return None


@dataclass(frozen=True, slots=True)
class DecodedRouting:
    """A ``routed_experts`` value decoded straight from the answer bytes by ``decode_int32_b64_run``."""

    values: np.ndarray  # flat, the narrowest unsigned dtype holding max_id
    max_id: int


def _predecode_routing(body: AnswerBytes) -> tuple[DecodedRouting, tuple[int, int]] | None:
    at = body.find(_ROUTED_EXPERTS_NEEDLE)
    if at == -1:
        return None
    start = at + len(_ROUTED_EXPERTS_NEEDLE)
    decoded = decode_int32_b64_run(body, start)
    if decoded is None:
        return None
    values, max_id, end = decoded
    return DecodedRouting(values, max_id), (start, end)


def decode_int32_b64_run(body: AnswerBytes, start: int) -> tuple[np.ndarray, int, int] | None:
    """Decode the base64 int32 string that starts at ``body[start]`` and runs to the next quote.

    One pass of ``ROUTING_STEP_CHARS`` steps: decode, take the max (as uint32), store narrowed. Returns (the values
    in the narrowest unsigned dtype, their max, the index of the closing quote), or None when anything is
    irregular (not base64, padding before the end, not whole int32, no closing quote, a negative id): the caller
    then takes the plain path, which reports the problem exactly as before.
    """
    size = len(body)
    view = memoryview(body)
    b64decode, frombuffer = pybase64.b64decode, np.frombuffer  # the loop runs ~20 times per answer
    full_step = ROUTING_STEP_CHARS // 4 * 3
    # At least the int32 count; the pages of the (small) excess are never touched, so they cost nothing.
    out = np.empty((size - start) * 3 // 16 + 1, dtype=np.uint8)
    limit = int(np.iinfo(out.dtype).max)  # the largest id ``out`` holds
    filled = top = 0
    pos = start
    while True:
        stop = pos + ROUTING_STEP_CHARS
        end: int | None = None
        try:
            raw = b64decode(view[pos:stop], validate=True)
        except (binascii.Error, ValueError):  # the closing quote (or garbage) is in this step
            end = body.find(b'"', pos, stop)
            if end == -1:
                return None
            try:
                raw = b64decode(view[pos:end], validate=True)
            except (binascii.Error, ValueError):
                return None
        else:
            if stop >= size:
                return None  # ran into the end of the body: no closing quote
            if len(raw) != full_step:  # padding: only right before the closing quote
                if body[stop : stop + 1] != b'"':
                    return None
                end = stop
        if len(raw) & 3:
            return None
        count = len(raw) >> 2
        if count:
            values = frombuffer(raw, dtype="<u4")
            step_max = int(values.max())
            if step_max > top:
                top = step_max
                if top > limit:
                    if top > INT32_MAX:
                        return None
                    wider = np.empty(len(out), dtype=narrowest_unsigned(top))
                    wider[:filled] = out[:filled]
                    out, limit = wider, int(np.iinfo(wider.dtype).max)
            out[filled : filled + count] = values
            filled += count
        if end is not None:
            return out[:filled], top, end
        pos = stop


def decode_answer(answer: dict[str, Any], *, want_routing: bool, want_top_p: bool) -> DecodedTurn:
    meta = answer.get("meta_info")
    if not isinstance(meta, dict):
        raise UpstreamProtocolError("upstream answer has no meta_info object")
    token_ids, log_probs = decode_output_token_logprobs(meta.get("output_token_logprobs"))
    n = len(token_ids)
    finish_reason = _finish_reason(meta)
    routed, routed_max = _decode_routing(meta, want_routing, n, finish_reason)
    if routed_max is not None and routed_max > INT32_MAX:
        raise UpstreamProtocolError("meta_info.routed_experts holds a negative expert id")
    top_p_ids, top_p_offsets = _decode_top_p(meta, want_top_p, n)
    text = answer.get("text", "")
    if not isinstance(text, str):
        raise UpstreamProtocolError(f"upstream 'text' must be a string, got {type(text).__name__}")
    weight_version = read_weight_version(meta.get("weight_version"))
    return DecodedTurn(
        token_ids=token_ids,
        log_probs=log_probs,
        text=text,
        finish_reason=finish_reason,
        rid=meta.get("id") if isinstance(meta.get("id"), str) else None,
        prompt_tokens=_count(meta, "prompt_tokens"),
        completion_tokens=_count(meta, "completion_tokens"),
        cached_tokens=_count(meta, "cached_tokens"),
        weight_version=weight_version,
        weight_version_spans=decode_weight_version_spans(meta.get("weight_versions"), n, weight_version),
        routed_experts=routed,
        routed_max=routed_max,
        top_p_ids=top_p_ids,
        top_p_offsets=top_p_offsets,
        spec_counters={key: _count(meta, key) for key in SPEC_COUNTER_KEYS if key in meta},
    )


def decode_output_token_logprobs(items: Any) -> tuple[np.ndarray, np.ndarray]:
    """``[[logprob, token_id, text], ...]`` -> (int32 ids, float32 log-probs), refusing rather than coercing:
    ids are ints in [0, 2**31) (not floats, not booleans), log-probs finite numbers <= 0 (a null log-prob, SGLang's
    form of -inf, is refused: a sampled token cannot have probability 0, so it means the answer is broken)."""
    if not isinstance(items, list):
        raise UpstreamProtocolError(
            "upstream answer has no meta_info.output_token_logprobs list (was return_logprob dropped?)"
        )
    try:
        log_prob_values = [item[0] for item in items]
        id_values = [item[1] for item in items]
    except (TypeError, IndexError, KeyError):
        raise UpstreamProtocolError(_explain_bad_logprob_item(items)) from None
    # One pass each, in C: exact types (``type(True)`` is bool, not int), so nothing is coerced below.
    if not set(map(type, id_values)) <= _INT_TYPE or not set(map(type, log_prob_values)) <= _NUMBER_TYPES:
        raise UpstreamProtocolError(_explain_bad_logprob_item(items))
    try:
        ids = np.array(id_values, dtype=np.int64)
    except OverflowError:  # beyond int64
        raise UpstreamProtocolError(_explain_bad_logprob_item(items)) from None
    if len(ids) and (ids.min() < 0 or ids.max() > INT32_MAX):
        raise UpstreamProtocolError(_explain_bad_logprob_item(items))
    with np.errstate(over="ignore"):  # checked after the cast: |x| > 3.4e38 becomes +-inf in float32
        log_probs = np.array(log_prob_values, dtype=np.float64).astype(np.float32)
    if len(log_probs) and not (np.isfinite(log_probs).all() and (log_probs <= 0).all()):
        bad = int(np.flatnonzero(~(np.isfinite(log_probs) & (log_probs <= 0)))[0])
        raise UpstreamProtocolError(
            f"output_token_logprobs[{bad}] has log-prob {log_prob_values[bad]!r:.40}: not a finite number <= 0 "
            "(or beyond float32)"
        )
    return ids.astype(np.int32), log_probs


def _explain_bad_logprob_item(items: list[Any]) -> str:
    """Slow path, only on error: name the first item that is not [float, int, ...]."""
    for i, item in enumerate(items):
        if not isinstance(item, list | tuple) or len(item) < 2:
            return f"output_token_logprobs[{i}] is not a [logprob, token_id, text] list: {item!r:.80}"
        logprob, token_id = item[0], item[1]
        if logprob is None:
            return (
                f"output_token_logprobs[{i}] has a null log-prob: a non-finite log-prob upstream (SGLang writes -inf "
                "as null), or log-probs missing"
            )
        if type(logprob) not in _NUMBER_TYPES:
            return f"output_token_logprobs[{i}] log-prob is not a number: {logprob!r:.40}"
        if type(token_id) not in _INT_TYPE:
            return f"output_token_logprobs[{i}] token id is not an integer: {token_id!r:.40}"
        if not 0 <= token_id <= INT32_MAX:
            return f"output_token_logprobs[{i}] token id {token_id!r:.40} is outside [0, 2**31)"
    return "output_token_logprobs is malformed"


def decode_int32_b64(value: Any, name: str) -> np.ndarray:
    """Standard base64 of a little-endian int32 array -> a read-only int32 view of the decoded bytes."""
    if not isinstance(value, str | bytes | memoryview):
        raise UpstreamProtocolError(f"meta_info.{name} must be a base64 string, got {type(value).__name__}")
    try:
        raw = pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UpstreamProtocolError(f"meta_info.{name} is not valid base64: {exc}") from exc
    if len(raw) % 4:
        raise UpstreamProtocolError(f"meta_info.{name} decodes to {len(raw)} bytes, not a whole number of int32")
    return np.frombuffer(raw, dtype="<i4")


def _decode_routing(
    meta: dict[str, Any], wanted: bool, num_tokens: int, finish_reason: dict[str, Any] | None
) -> tuple[np.ndarray | None, int | None]:
    """(the routing values, their max read as uint32), or (None, None) when there is no routing to take."""
    if not wanted:
        return None, None
    value = meta.get(ROUTED_EXPERTS_KEY)
    if value is None:
        if num_tokens == 0 and finish_reason is not None and finish_reason.get("type") == "abort":
            return None, None  # aborted before the first token: nothing to replay
        raise ReplayDataDropped(
            "asked for routed experts (return_routed_experts) but the upstream answer has none: the replay "
            "data was dropped upstream. Likely causes: a router that re-serializes /generate and strips "
            "return_routed_experts (sglang-router <= 0.3.x; use smg or slime's patched router), or an SGLang "
            "server started without --enable-return-routed-experts",
            missing="routed_experts",
        )
    if isinstance(value, DecodedRouting):
        return value.values, value.max_id
    routed = decode_int32_b64(value, ROUTED_EXPERTS_KEY)
    max_id = unsigned_max(routed)
    if max_id > INT32_MAX:
        return routed, max_id  # a negative id: the caller rejects the answer
    return routed.astype(narrowest_unsigned(max_id)), max_id


def unsigned_max(values: np.ndarray) -> int:
    """max() of int32 values read as uint32: one pass that also exposes negatives (they become >= 2**31).
    Unsigned values (routing already narrowed by ``decode_int32_b64_run``) are taken as they are."""
    if not len(values):
        return 0
    return int(values.max() if values.dtype.kind == "u" else values.view(np.uint32).max())


def _decode_top_p(meta: dict[str, Any], wanted: bool, num_tokens: int) -> tuple[np.ndarray | None, ...]:
    raw_ids = _first_present(meta, TOP_P_ID_KEYS)
    raw_offsets = _first_present(meta, TOP_P_OFFSET_KEYS)
    if raw_ids is None and raw_offsets is None:
        if wanted and num_tokens:
            raise ReplayDataDropped(
                "asked for top-p replay (sampling_params.custom_params.return_top_p_token_ids) but the "
                "upstream answer has no top_p_token_ids/offsets: the replay data was dropped upstream. Likely "
                "causes: a router that strips sampling_params.custom_params (sglang-router <= 0.3.x), or an "
                "SGLang build without slime's top-p replay patch",
                missing="top_p_token_ids",
            )
        return None, None
    if raw_ids is None or raw_offsets is None:
        raise UpstreamProtocolError("top-p replay must include both top_p_token_ids and top_p_token_offsets")
    ids = decode_int32_b64(raw_ids, "top_p_token_ids")
    offsets = decode_int32_b64(raw_offsets, "top_p_token_offsets")
    check_top_p_spans(ids, offsets, num_tokens)
    return ids, offsets


def check_top_p_spans(ids: np.ndarray, offsets: np.ndarray, num_tokens: int) -> None:
    if len(offsets) != num_tokens + 1:
        raise UpstreamProtocolError(
            f"top_p_token_offsets has {len(offsets)} entries, expected generated tokens + 1 = {num_tokens + 1}"
        )
    if offsets[0] != 0:
        raise UpstreamProtocolError(f"top_p_token_offsets must start at 0, got {int(offsets[0])}")
    if offsets[-1] != len(ids):
        raise UpstreamProtocolError(
            f"top_p_token_offsets end at {int(offsets[-1])} but there are {len(ids)} top_p_token_ids"
        )
    if num_tokens and (np.diff(offsets) < 0).any():
        raise UpstreamProtocolError("top_p_token_offsets are not non-decreasing")
    if len(ids) and ids.min() < 0:
        raise UpstreamProtocolError("top_p_token_ids holds a negative token id")


def _finish_reason(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The finish reason as stored in the turn log and sent back in summaries: checked to serialize, small."""
    finish = meta.get("finish_reason")
    if finish is None:
        return None
    if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
        raise UpstreamProtocolError(f"meta_info.finish_reason must be an object with a 'type', got {finish!r:.80}")
    matched = finish.get("matched")  # the stop token id or stop string
    token_id = type(matched) is int and 0 <= matched <= INT32_MAX
    if matched is not None and not isinstance(matched, str) and not token_id:
        raise UpstreamProtocolError(
            f"meta_info.finish_reason.matched must be a token id or a string, got {matched!r:.40}"
        )
    try:
        encoded = orjson.dumps(finish)  # what the turn's summary and the session view will serialize
    except (TypeError, orjson.JSONEncodeError) as exc:  # nested too deep, an int beyond 64 bits
        raise UpstreamProtocolError(f"meta_info.finish_reason cannot be stored: {exc}") from None
    if len(encoded) > MAX_FINISH_REASON_BYTES:
        raise UpstreamProtocolError(f"meta_info.finish_reason is {len(encoded)} bytes, over {MAX_FINISH_REASON_BYTES}")
    return finish


def _count(meta: dict[str, Any], key: str) -> int:
    """A counter (tokens, spec decoding steps): an int in [0, 2**31), or absent/null (0). Sessions sum them, so a
    bound keeps every sum storable."""
    value = meta.get(key, 0)
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value <= INT32_MAX:
        raise UpstreamProtocolError(f"meta_info.{key} must be an integer in [0, 2**31), got {value!r:.40}")
    return value


def _first_present(meta: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if meta.get(key) is not None:
            return meta[key]
    return None


def parse_json_object(body: AnswerBytes) -> dict[str, Any]:
    try:
        answer = orjson.loads(body if isinstance(body, bytes | bytearray) else memoryview(body))
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError(f"upstream answer is not valid JSON: {exc}") from exc
    if isinstance(answer, list):
        raise UpstreamProtocolError("upstream answered a batch (JSON array) to a single-request turn")
    if not isinstance(answer, dict):
        raise UpstreamProtocolError(f"upstream answer must be a JSON object, got {type(answer).__name__}")
    return answer


def narrowest_unsigned(max_value: int) -> np.dtype:
    """The smallest unsigned dtype holding ``max_value`` (uint8 up to 256 experts)."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise UpstreamProtocolError(f"expert id {max_value} does not fit in 32 bits")
