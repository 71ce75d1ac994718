"""Token-id arrays in request bodies: their pydantic type, and big bodies parsed without holding the GIL for long.

pydantic-core validates a JSON body in one call that holds the GIL from start to end: run in a worker thread, a
39 MB prompt (5M token ids) still stalls the event loop for the whole ~1 s, as if it ran on the loop. A big v1 body
is almost all one token-id array, so ``validate_big_body`` cuts that array out, parses it in steps of
``STEP_BYTES`` (between steps the GIL changes hands, so the loop keeps answering), and lets pydantic validate the
small rest exactly as it would the whole body.

An array that is not a token-id array is refused the same way, never by a whole-body parse (one bad id at the end
of a 30 MB array made pydantic stall the loop for 0.25-0.6 s): its steps are checked in turn and each bad element
gets pydantic's own error for it, at ``field.index`` (the first ``MAX_ARRAY_ERRORS`` of them), beside the rest's
errors; an array that is not valid JSON gets pydantic's ``json_invalid``, placed at the same line and column of the
body. Only a body shaped otherwise (the array not the top-level value of its key: nested, or not found) is left to
plain pydantic validation. The errors are pydantic's, element by element; what may differ from a whole-body parse
is how many are reported (at most ``MAX_ARRAY_ERRORS`` of the array's), and, in a body over ``EXACT_BELOW_BYTES``,
whether the errors after an element that is a string or a list (whose own commas and brackets the steps cannot see
past) are.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, TypeVar

import numpy as np
import orjson
import pydantic_core
from pydantic import BaseModel, GetCoreSchemaHandler, GetJsonSchemaHandler, TypeAdapter, ValidationError
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import InitErrorDetails, core_schema

INT32_MAX = 2**31 - 1
# ~40k ids a step: ~1 ms of parsing with the GIL held, then the event loop gets its turn.
STEP_BYTES = 1 << 18
# A bad array in a body smaller than this whose elements the steps cannot all see (a string or list among them) is
# left to pydantic whole: ~10 ms at most.
EXACT_BELOW_BYTES = 1 << 20
# A bad array reports this many of its bad elements at most (pydantic reports every one: 4M for an array of floats).
MAX_ARRAY_ERRORS = 64
# What a JSON array of non-negative integers is made of. Anything else (floats, negative ids, nesting, strings)
# goes the slow way, element by element, whose error messages are pydantic's.
_ARRAY_CHARS = b"0123456789, \t\r\n"
_WHITESPACE = b" \t\r\n"
_JSON_POSITION = re.compile(r" at line (\d+) column (\d+)$")

Model = TypeVar("Model", bound=BaseModel)


def _whole(value: float) -> int:
    if not value.is_integer():
        raise ValueError("a fractional number")
    return int(value)


@dataclass(frozen=True, slots=True)
class WholeNumber:
    """An integer as JSON Schema (2020-12, what the OpenAPI document uses) has it: ``2`` and ``2.0`` are one, and
    so is ``1e3``; ``2.5``, ``"2"`` and ``true`` are not (each ``int_type``, as pydantic's strict int says). Bounds
    as ``Field``'s (their errors pydantic's too). ``Annotated[int, WholeNumber(ge=0)]``."""

    ge: int | None = None
    le: int | None = None
    gt: int | None = None

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        whole_float = core_schema.no_info_after_validator_function(_whole, core_schema.float_schema(strict=True))
        number = core_schema.union_schema(
            [core_schema.int_schema(strict=True), whole_float], custom_error_type="int_type"
        )
        bounded = core_schema.int_schema(strict=True, ge=self.ge, le=self.le, gt=self.gt)
        return core_schema.chain_schema([number, bounded])

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        bounds = {"minimum": self.ge, "maximum": self.le, "exclusiveMinimum": self.gt}
        return {"type": "integer", **{key: value for key, value in bounds.items() if value is not None}}


TokenId = Annotated[int, WholeNumber(ge=0, le=INT32_MAX)]
_TOKEN_ID = TypeAdapter(TokenId)


def _int32_array(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


class _TokenIdArray:
    """A JSON list of token ids (integers in 0..2**31-1, at least one), held as an int32 array: what the session
    stores, without a Python int per token."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            _int32_array,
            core_schema.list_schema(handler.generate_schema(TokenId), min_length=1),
            serialization=core_schema.plain_serializer_function_ser_schema(np.ndarray.tolist),
        )


TokenIds = Annotated[np.ndarray, _TokenIdArray]


class _Place(Enum):
    """Where the array cut out of a body sits, as the rest of the body shows."""

    FIELD_VALUE = "the value of the top-level key"
    OVERRIDDEN = "an earlier value of a top-level key that appears again (the last one counts)"
    UNKNOWN = "unknown: the rest is not JSON with the array taken out"


def validate_big_body(model: type[Model], raw: bytes, array_field: str) -> Model:
    """``model.model_validate_json(raw)``, with the token-id array ``array_field`` parsed in GIL-friendly steps
    when the body allows it. Raises pydantic's ``ValidationError`` (see the module's docstring for a bad array)."""
    span = find_array_value(raw, array_field)
    if span is None or not _opens_top_level_value(raw, span[0], array_field):
        return model.model_validate_json(raw)
    start, end = span
    ids = parse_token_array(raw, start, end)
    place = _place_of(raw, start, end, array_field)
    if ids is not None:
        if place is not _Place.FIELD_VALUE:
            return model.model_validate_json(raw)
        # The rest of the body, validated as it came, with a valid stand-in for the array: its errors are the ones
        # the whole body has (the array is valid), named by the same locations.
        rest = model.model_validate_json(_with_stand_in(raw, start, end))
        return rest.model_copy(update={array_field: ids})
    if place is _Place.OVERRIDDEN:  # the key's later value is the one validated: this array does not count
        return model.model_validate_json(_with_stand_in(raw, start, end))
    error = _bad_array_error(model, raw, start, end, array_field, place)
    if error is None:  # not plain digits, yet valid: whole numbers spelled as floats (2.0, 1e3)
        return model.model_validate_json(raw)
    raise error


def find_array_value(raw: bytes, field: str) -> tuple[int, int] | None:
    """``(start, end)`` of the ``[...]`` after the first ``"field":`` in ``raw`` (not yet known to be the
    top-level one: ``_opens_top_level_value`` checks that), or None."""
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
        cut = _step_end(raw, pos, stop)
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


def _step_end(raw: bytes, pos: int, stop: int) -> int:
    cut = raw.find(b",", pos + STEP_BYTES, stop) if stop - pos > STEP_BYTES else -1
    return stop if cut < 0 else cut


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


def _opens_top_level_value(raw: bytes, start: int, field: str) -> bool:
    """Whether the value starting at ``start`` is the top-level key ``field``'s: the body up to there, closed with
    a string nobody could have sent, parses as an object whose ``field`` is that string."""
    return _holds_marker(raw[:start], b"}", field) is True


def _place_of(raw: bytes, start: int, end: int, field: str) -> _Place:
    """The span is replaced by a string nobody could have sent and the (small) rest is parsed: the body up to
    ``start`` and from ``end`` is unchanged, so if the marker lands as ``field``'s value, so did the array in the
    body; if another value does, the key appears again later, and that later value is the one that counts."""
    holds = _holds_marker(raw[:start], raw[end:], field)
    if holds is None:
        return _Place.UNKNOWN
    return _Place.FIELD_VALUE if holds else _Place.OVERRIDDEN


def _holds_marker(head: bytes, tail: bytes, field: str) -> bool | None:
    """Whether ``head`` + a string nobody could have sent + ``tail`` is an object whose ``field`` is that string
    (None: not a JSON object)."""
    marker = f"gateway-cut-{uuid.uuid4().hex}"
    try:
        body = orjson.loads(head + orjson.dumps(marker) + tail)
    except orjson.JSONDecodeError:
        return None
    return body.get(field) == marker if isinstance(body, dict) else None


def _with_stand_in(raw: bytes, start: int, end: int) -> bytes:
    return raw[:start] + b"[0]" + raw[end:]


# ---- a bad array's errors ------------------------------------------------------------------------------------------
def _bad_array_error(
    model: type[BaseModel], raw: bytes, start: int, end: int, field: str, place: _Place
) -> ValidationError | None:
    """The error of a body whose token array the steps could not parse; None if the array has no bad element."""
    errors, complete = _array_errors(raw, start, end, field)
    if not errors and complete:
        return None
    if not complete and len(raw) < EXACT_BELOW_BYTES:
        # A string or list element hid how the array goes on; a small body is cheap to hand to pydantic whole.
        try:
            model.model_validate_json(raw)
        except ValidationError as exc:
            return exc
        return None
    if errors and errors[0]["type"] == "json_invalid":  # pydantic reports the first syntax error and nothing else
        return ValidationError.from_exception_data(model.__name__, errors)
    if place is _Place.FIELD_VALUE:
        try:
            model.model_validate_json(_with_stand_in(raw, start, end))
        except ValidationError as exc:
            errors += _details(exc.errors(), shift=None)
    elif complete:
        # Every element was seen and the array ends where it was found, yet the rest is not JSON: the body is not.
        try:
            model.model_validate_json(_with_stand_in(raw, start, end))
        except ValidationError as exc:
            invalid = [e for e in exc.errors() if e["type"] == "json_invalid"]
            if invalid:
                moved = _json_error_in(raw, _with_stand_in(raw, start, end), invalid[0], start, end)
                return ValidationError.from_exception_data(model.__name__, [moved])
    return ValidationError.from_exception_data(model.__name__, errors)


def _array_errors(raw: bytes, start: int, end: int, field: str) -> tuple[list[InitErrorDetails], bool]:
    """The errors of the array ``raw[start:end]``, step by step, and whether every element was seen (False when a
    string or list element was met: its own commas or brackets may have hidden the array's real end)."""
    if not raw[start + 1 : end - 1].strip(_WHITESPACE):
        details = {"field_type": "List", "min_length": 1, "actual_length": 0}
        return [{"type": "too_short", "loc": (field,), "input": [], "ctx": details}], True
    errors: list[InitErrorDetails] = []
    index, pos, stop = 0, start + 1, end - 1
    while pos <= stop and len(errors) < MAX_ARRAY_ERRORS:
        cut = _step_end(raw, pos, stop)
        values = _parse_step(raw[pos:cut])
        if values is not None:
            for at in np.flatnonzero(values > INT32_MAX)[: MAX_ARRAY_ERRORS - len(errors)]:
                errors += _token_errors(int(values[at]), (field, index + int(at)))
            index += len(values)
        else:
            for element in raw[pos:cut].split(b","):
                text = element.strip(_WHITESPACE)
                if not text or text[:1] not in b'"[{':
                    # Parsed where it stands, after a comma in an array, for the error pydantic's parser gives there.
                    probe = (b"[0," if index else b"[") + text + b"]"
                    try:
                        (*_, value) = pydantic_core.from_json(probe)
                    except ValueError as exc:
                        return [_json_invalid(raw, pos, element, len(probe) - len(text) - 1, exc)], False
                    errors += _token_errors(value, (field, index))
                else:
                    try:
                        value = pydantic_core.from_json(text)
                    except ValueError:
                        # A string or list with its own commas: its end is not a comma's; nor, maybe, the array's.
                        errors += _token_errors(text.decode(errors="replace"), (field, index))
                        return errors, False
                    errors += _token_errors(value, (field, index))
                index += 1
                pos += len(element) + 1
                if len(errors) >= MAX_ARRAY_ERRORS:
                    break
            continue
        pos = cut + 1
    return errors[:MAX_ARRAY_ERRORS], True


def _token_errors(value: Any, loc: tuple[str | int, ...]) -> list[InitErrorDetails]:
    try:
        _TOKEN_ID.validate_python(value)
    except ValidationError as exc:
        return _details(exc.errors(), shift=loc)
    return []


def _details(errors: list[Any], shift: tuple[str | int, ...] | None) -> list[InitErrorDetails]:
    """``ValidationError.errors()`` as what ``ValidationError.from_exception_data`` takes, their locations put
    under ``shift`` when given."""
    out: list[InitErrorDetails] = []
    for error in errors:
        detail: InitErrorDetails = {
            "type": error["type"],
            "loc": (*shift, *error["loc"]) if shift is not None else error["loc"],
            "input": error["input"],
        }
        if "ctx" in error:
            detail["ctx"] = error["ctx"]
        out.append(detail)
    return out


def _json_invalid(raw: bytes, at: int, element: bytes, prefix: int, exc: ValueError) -> InitErrorDetails:
    """pydantic's ``json_invalid`` for the bad ``element`` at ``raw[at:]``, placed at the body's line and column:
    its probe (``prefix`` bytes, the element stripped, a bracket) counted them from the probe's start."""
    reason = str(exc)
    found = _JSON_POSITION.search(reason)
    if found is not None:
        reason = reason[: found.start()]
        text = element.strip(_WHITESPACE)
        into = max(0, int(found.group(2)) - 1 - prefix)
        lead = len(element) - len(element.lstrip(_WHITESPACE))
        at += lead + into if into < len(text) else len(element) + into - len(text)
    return {"type": "json_invalid", "loc": (), "input": raw, "ctx": {"error": f"{reason}{_position(raw, at)}"}}


def _json_error_in(raw: bytes, reduced: bytes, error: Any, start: int, end: int) -> InitErrorDetails:
    """A ``json_invalid`` found in the body with its array replaced by ``[0]``, placed in the body itself."""
    reason = str(error["ctx"]["error"])
    found = _JSON_POSITION.search(reason)
    if found is None:
        return {"type": "json_invalid", "loc": (), "input": raw, "ctx": {"error": reason}}
    line, column = int(found.group(1)), int(found.group(2))
    at = _offset(reduced, line, column)
    at = at if at < start else at + (end - start) - len(b"[0]")
    return {
        "type": "json_invalid",
        "loc": (),
        "input": raw,
        "ctx": {"error": reason[: found.start()] + _position(raw, at)},
    }


def _offset(text: bytes, line: int, column: int) -> int:
    line_start = 0
    for _ in range(line - 1):
        line_start = text.index(b"\n", line_start) + 1
    return line_start + max(0, column - 1)


def _position(raw: bytes, at: int) -> str:
    """serde_json's way of naming a place (what pydantic's JSON errors say): 1-based line, 1-based column."""
    at = min(at, len(raw))
    line = raw.count(b"\n", 0, at) + 1
    column = at - raw.rfind(b"\n", 0, at)
    return f" at line {line} column {column}"


def _skip_whitespace(raw: bytes, pos: int) -> int:
    while raw[pos : pos + 1] and raw[pos : pos + 1] in _WHITESPACE:
        pos += 1
    return pos
