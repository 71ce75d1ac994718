"""Token-id arrays in request bodies: their pydantic type, and big bodies parsed without holding the GIL for long.

pydantic-core validates a JSON body in one call that holds the GIL from start to end: run in a worker thread, a
39 MB prompt (5M token ids) still stalls the event loop for the whole ~1 s, as if it ran on the loop. A big v1 body
is almost all one token-id array, so ``validate_big_body`` cuts that array out, parses it in steps of
``STEP_BYTES`` (between steps the GIL changes hands, so the loop keeps answering), and lets pydantic validate the
small rest exactly as it would the whole body. Whenever the body is not shaped as expected it falls back to
plain pydantic validation, so the answer (and every error message) is always pydantic's.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic_core import core_schema

INT32_MAX = 2**31 - 1
# ~40k ids a step: ~1 ms of parsing with the GIL held, then the event loop gets its turn.
STEP_BYTES = 1 << 18
# What a JSON array of non-negative integers is made of. Anything else (floats, negative ids, nesting, strings)
# goes the plain way, whose error messages are pydantic's.
_ARRAY_CHARS = b"0123456789, \t\r\n"
_WHITESPACE = b" \t\r\n"

Model = TypeVar("Model", bound=BaseModel)


def _int32_array(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


class _TokenIdArray:
    """A JSON list of token ids (ints in 0..2**31-1, at least one), held as an int32 array: what the session
    stores, without a Python int per token."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        token_id = core_schema.int_schema(strict=True, ge=0, le=INT32_MAX)
        return core_schema.no_info_after_validator_function(
            _int32_array,
            core_schema.list_schema(token_id, min_length=1),
            serialization=core_schema.plain_serializer_function_ser_schema(np.ndarray.tolist),
        )


TokenIds = Annotated[np.ndarray, _TokenIdArray]


def validate_big_body(model: type[Model], raw: bytes, array_field: str) -> Model:
    """``model.model_validate_json(raw)``, with the token-id array ``array_field`` parsed in GIL-friendly steps
    when the body allows it. Raises pydantic's ``ValidationError`` as plain validation would."""
    fast = _validate_with_array_cut_out(model, raw, array_field)
    return fast if fast is not None else model.model_validate_json(raw)


def _validate_with_array_cut_out(model: type[Model], raw: bytes, field: str) -> Model | None:
    span = find_array_value(raw, field)
    if span is None:
        return None
    start, end = span
    if not _is_top_level_value(raw, start, end, field):
        return None
    ids = parse_token_array(raw, start, end)
    if ids is None:
        return None
    # The rest of the body, validated as it came, with a valid stand-in for the array: its errors are the ones the
    # whole body has (the array is valid), named by the same locations.
    rest = model.model_validate_json(raw[:start] + b"[0]" + raw[end:])
    return rest.model_copy(update={field: ids})


def find_array_value(raw: bytes, field: str) -> tuple[int, int] | None:
    """``(start, end)`` of the ``[...]`` after the first ``"field":`` in ``raw`` (not yet known to be the
    top-level one: ``_is_top_level_value`` checks that), or None."""
    at = raw.find(b'"' + field.encode() + b'"')
    if at < 0:
        return None
    colon = _skip_whitespace(raw, at + len(field) + 2)
    if raw[colon : colon + 1] != b":":
        return None
    start = _skip_whitespace(raw, colon + 1)
    if raw[start : start + 1] != b"[":
        return None
    close = raw.find(b"]", start)
    return None if close < 0 else (start, close + 1)


def parse_token_array(raw: bytes, start: int, end: int) -> np.ndarray | None:
    """The int32 values of the JSON array ``raw[start:end]``, parsed ``STEP_BYTES`` at a time (each step cut at a
    comma), or None if it is not a non-empty array of integers in 0..2**31-1."""
    pieces: list[np.ndarray] = []
    pos, stop = start + 1, end - 1
    while pos < stop:
        cut = raw.find(b",", pos + STEP_BYTES, stop) if stop - pos > STEP_BYTES else -1
        cut = stop if cut < 0 else cut
        values = _parse_step(raw[pos:cut])
        if values is None:
            return None
        pieces.append(values)
        pos = cut + 1
    if not pieces or pos != stop + 1:  # empty, or a trailing comma
        return None
    ids = np.concatenate(pieces)
    # Checked once, not per step: a numpy reduction lets go of the GIL and takes it back at once, and a thread that
    # does that every step starves the event loop of it (the loop's timed wait for the GIL restarts at each switch).
    return ids.astype(np.int32) if int(ids.max()) <= INT32_MAX else None


def _parse_step(chunk: bytes) -> np.ndarray | None:
    if chunk.translate(None, _ARRAY_CHARS):
        return None
    try:
        values = orjson.loads(b"[" + chunk + b"]")
        array = np.array(values, dtype=np.int64)
    except (orjson.JSONDecodeError, OverflowError):
        return None
    # An empty step is an empty array or a doubled / trailing comma: not valid JSON either way.
    return array if len(array) else None


def _is_top_level_value(raw: bytes, start: int, end: int, field: str) -> bool:
    """Whether ``raw[start:end]`` is the value of the top-level key ``field``. The span is replaced by a string
    nobody could have sent and the (small) rest is parsed: the body up to ``start`` and from ``end`` is unchanged, so
    if the marker lands as ``field``'s value, so did the array in the body (a key inside another object, inside a
    string, or a repeated key that wins over this one all put it elsewhere)."""
    marker = f"gateway-cut-{uuid.uuid4().hex}"
    try:
        rest = orjson.loads(raw[:start] + orjson.dumps(marker) + raw[end:])
    except orjson.JSONDecodeError:
        return False
    return isinstance(rest, dict) and rest.get(field) == marker


def _skip_whitespace(raw: bytes, pos: int) -> int:
    while raw[pos : pos + 1] and raw[pos : pos + 1] in _WHITESPACE:
        pos += 1
    return pos
