"""Weight versions: which weights produced an answer's tokens (``meta_info.weight_version`` and the per-token
``weight_versions`` spans of newer SGLang builds), read and checked. Pure, like the rest of ``gateway.codec``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.errors import UpstreamProtocolError

MAX_WEIGHT_VERSION_CHARS = 256
# SGLang adds a span per weight update that lands while the answer is generated: a handful at most. The bound keeps
# a broken upstream from filling the turn log (each span is stored and shown in the session view).
MAX_WEIGHT_VERSION_SPANS = 256


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Generated positions ``[start, end)`` of one answer, produced by the weights ``version`` (None: unknown)."""

    version: str | None
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


def read_weight_version(value: Any) -> str | None:
    """SGLang sends a string; a number is taken as its decimal form, anything else is refused (never a repr)."""
    if value is None:
        return None
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        value = str(value)
    if not isinstance(value, str) or len(value) > MAX_WEIGHT_VERSION_CHARS:
        raise UpstreamProtocolError(
            f"meta_info.weight_version must be a string (at most {MAX_WEIGHT_VERSION_CHARS} characters) or a number, "
            f"got {value!r:.60}"
        )
    return value


def decode_weight_version_spans(
    value: Any, num_tokens: int, weight_version: str | None
) -> tuple[VersionSpan, ...] | None:
    """``meta_info.weight_versions``, ``[{"version": str, "start": int, "end": int}, ...]``: half-open spans over the
    answer's generated positions, contiguous from 0 and ending at ``num_tokens`` (SGLang's
    ``compute_weight_version_spans``). An answer without tokens has SGLang's single empty span ``[0, 0)``; otherwise
    every span is non-empty. ``weight_version``, when the answer has one, must be the last span's version (SGLang
    sets it so). Refused, never repaired: off-policy correction weighs each token by the version named here.
    None when the field is absent (servers before the spans)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise UpstreamProtocolError(f"meta_info.weight_versions must be a non-empty list of spans, got {value!r:.60}")
    if len(value) > MAX_WEIGHT_VERSION_SPANS:
        raise UpstreamProtocolError(
            f"meta_info.weight_versions has {len(value)} spans, over {MAX_WEIGHT_VERSION_SPANS}"
        )
    spans = tuple(_version_span(item, index) for index, item in enumerate(value))
    _check_span_coverage(spans, num_tokens)
    if weight_version is not None and spans[-1].version != weight_version:
        raise UpstreamProtocolError(
            f"meta_info.weight_version {weight_version!r:.60} is not the last span's version {spans[-1].version!r:.60}"
        )
    return spans


def _version_span(item: Any, index: int) -> VersionSpan:
    where = f"meta_info.weight_versions[{index}]"
    if not isinstance(item, dict):
        raise UpstreamProtocolError(f"{where} must be an object, got {item!r:.60}")
    version, start, end = item.get("version"), item.get("start"), item.get("end")
    if type(version) is not str or len(version) > MAX_WEIGHT_VERSION_CHARS:
        raise UpstreamProtocolError(
            f"{where}.version must be a string of at most {MAX_WEIGHT_VERSION_CHARS} characters, got {version!r:.60}"
        )
    if type(start) is not int or type(end) is not int:  # exact types: no booleans, no integral floats
        raise UpstreamProtocolError(f"{where}: start and end must be integers, got {start!r:.30} and {end!r:.30}")
    return VersionSpan(version, start, end)


def _check_span_coverage(spans: tuple[VersionSpan, ...], num_tokens: int) -> None:
    """Each generated token in exactly one span: no gap, no overlap, nothing past the answer, nothing missing."""
    if not num_tokens:
        if len(spans) != 1 or (spans[0].start, spans[0].end) != (0, 0):
            raise UpstreamProtocolError("meta_info.weight_versions of an answer without tokens must be one span [0, 0)")
        return
    covered = 0
    for index, span in enumerate(spans):
        where = f"meta_info.weight_versions[{index}]"
        if span.start != covered:
            kind = "the first generated token" if not index else "a gap" if span.start > covered else "an overlap"
            raise UpstreamProtocolError(f"{where} starts at {span.start}, not {covered}: {kind}")
        if span.end <= span.start:
            raise UpstreamProtocolError(f"{where} is empty or reversed: [{span.start}, {span.end})")
        if span.end > num_tokens:
            raise UpstreamProtocolError(f"{where} ends at {span.end}, past the answer's {num_tokens} generated tokens")
        covered = span.end
    if covered != num_tokens:
        raise UpstreamProtocolError(
            f"meta_info.weight_versions cover {covered} of the answer's {num_tokens} generated tokens"
        )
