"""The session inspector's server side: what its pages fetch, beside the static files in ``static/``.

The pages are plain HTML, CSS and JavaScript shipped in the package (no build step, nothing from a CDN); they fetch a
session's JSON view (``GET /v1/sessions/{id}``, small: no arrays) and one compact binary per trajectory,
``inspector_payload``: the sample's own arrays as safetensors (what ``GET /v1/sessions/{id}/sample`` sends: routing
replay as ``uint8`` rows, not JSON numbers), plus in its metadata the trajectory's turn log and, when the gateway has
a tokenizer, the text of each distinct token id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

from gateway.store import Session
from gateway.views import SamplePayload, sample_payload

Decoder = Callable[[Sequence[int]], list[str]]


def inspector_payload(session: Session, branch: int | None) -> SamplePayload:
    """One branch for the inspector (``branch`` None: the root), taken on the event loop: the arrays are views,
    safe to encode in another thread (see ``SamplePayload``)."""
    payload = sample_payload(session, branch)
    sample = session.branches[int(payload.metadata["branch"])].sample
    metadata = payload.metadata | {"turn_log": orjson.dumps([turn.to_json() for turn in sample.turns]).decode()}
    return SamplePayload(payload.arrays, metadata)


def encode_with_pieces(payload: SamplePayload, decode: Decoder) -> bytes:
    """``payload`` with the text of each distinct token id (``decode``: the served model's tokenizer) in its metadata
    under ``pieces``; run it off the event loop for big sessions (the decode is the cost)."""
    pieces = token_pieces(payload.arrays["tokens"], decode)
    return SamplePayload(payload.arrays, payload.metadata | {"pieces": pieces}).encode()


def token_pieces(tokens: np.ndarray, decode: Decoder) -> str:
    """``{"id": text}`` (JSON) for each distinct id in ``tokens``."""
    ids = np.unique(tokens).tolist()
    return orjson.dumps(dict(zip(map(str, ids), decode(ids), strict=True))).decode()


def tokenizer_decoder(tokenizer: Any) -> Decoder:
    """Each id alone through the tokenizer's batch decode (the Rust one when there is one: ~1 us per id)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return lambda ids: tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)


def page_query_metadata(filters: Sequence[str]) -> dict[str, str]:
    """``?meta=key=value`` filters (repeatable) as a dict; ValueError names one without ``=``."""
    out: dict[str, str] = {}
    for item in filters:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"metadata filter {item!r:.80} is not key=value")
        out[key] = value
    return out


def listing_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The list page's columns, nothing more (a session's metadata can be up to 64 KiB: the page shows it cut)."""
    keep = (
        "session_id",
        "status",
        "busy",
        "branches",
        "total_tokens",
        "prompt_length",
        "response_length",
        "turns",
        "last_error",
        "created_at",
        "updated_at",
    )
    return [{key: row.get(key) for key in keep} | {"metadata": _metadata_text(row.get("metadata"))} for row in rows]


METADATA_SHOWN = 300


def _metadata_text(metadata: Any) -> str:
    text = orjson.dumps(metadata or {}).decode()
    return text if len(text) <= METADATA_SHOWN else text[: METADATA_SHOWN - 1] + "…"
