"""Typed views of the gateway's JSON answers (turn summaries, session summaries and the curl view).

Each dataclass takes the fields it knows from the answer and keeps every other key in ``raw``, so a newer
gateway that adds fields never breaks an older SDK, and nothing it says is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from slime_client.errors import GatewayResponseError

T = TypeVar("T")


def split_known_fields(cls: type, data: Any, *, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the keys ``cls`` declares, everything else) of a JSON object answered by the gateway."""
    if not isinstance(data, dict):
        raise GatewayResponseError(f"{what}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)} - {"raw"}
    known = {key: value for key, value in data.items() if key in names}
    raw = {key: value for key, value in data.items() if key not in names}
    return known, raw


def build(cls: type[T], known: dict[str, Any], raw: dict[str, Any], *, what: str) -> T:
    try:
        return cls(**known, raw=raw)
    except TypeError as exc:  # a required field is missing
        raise GatewayResponseError(f"{what}: {exc}") from exc


# After a unary turn the gateway keeps the session ("never" deletes it), deletes it ("always"), or deletes it once its
# sample is completed or truncated ("if_finished": pending and aborted ones stay, for a partial rollout to resume).
DeleteAfterTurn = Literal["never", "always", "if_finished"]


@dataclass(frozen=True, slots=True)
class SessionSync:
    """What a caller keeping its own copy of the tokens believes the session holds: its length and last tokens (at
    most 64). The gateway refuses a turn or append that does not match (409 ``session_mismatch``)."""

    total_tokens: int
    last_tokens: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"total_tokens": self.total_tokens, "last_tokens": list(self.last_tokens)}


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The routing-replay shape of a session: rows of ``[num_layers, topk]`` expert ids."""

    num_layers: int
    topk: int


@dataclass(frozen=True, slots=True)
class ArraySpec:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class TurnResult:
    """The answer of ``POST /v1/sessions/{id}/generate``: one model turn, already folded into the session."""

    session_id: str
    turn: int = 0
    rid: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    status: str = "pending"
    prompt_length: int = 0  # session tokens before this turn (what SGLang was sent)
    completion_tokens: int = 0
    response_length: int = 0  # the session's response after this turn
    total_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    weight_version: str | None = None
    routed_experts_start_len: int | None = None
    routed_experts_rows_received: int | None = None
    routed_experts_rows: int = 0
    top_p_replay: bool = False
    resumed: int = 0  # times the engine aborted it mid-answer and it was resubmitted (a weight update)
    interrupted: dict[str, Any] | None = None  # why it ended before the model ended it (the gateway's error body)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_type(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` (or None)."""
        return None if self.finish_reason is None else self.finish_reason.get("type")

    @classmethod
    def from_json(cls, data: Any) -> TurnResult:
        known, raw = split_known_fields(cls, data, what="turn result")
        return build(cls, known, raw, what="turn result")


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """The short session record (answer of create and append, entries of the session list)."""

    session_id: str
    status: str = "pending"
    busy: bool = False
    prompt_length: int = 0
    response_length: int = 0
    total_tokens: int = 0
    turns: int = 0
    created_at: float | None = None
    updated_at: float | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> SessionSummary:
        known, raw = split_known_fields(cls, data, what="session summary")
        return build(cls, known, raw, what="session summary")


@dataclass(frozen=True, slots=True)
class SessionState(SessionSummary):
    """``GET /v1/sessions/{id}``: the human/curl view of a session (``full`` only with ``full=True``): the
    summary's fields and the rest of the view."""

    metadata: dict[str, Any] = field(default_factory=dict)
    moe: MoEShape | None = None
    replay: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, ArraySpec] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)
    weight_version_table: list[str] = field(default_factory=list)  # what rollout_weight_version_ids index
    cached_tokens: int = 0
    prompt_tokens: int = 0
    spec_counters: dict[str, int] = field(default_factory=dict)
    stored_bytes: int = 0
    response: str = ""
    last_tokens: list[int] = field(default_factory=list)
    turn_log: list[dict[str, Any]] = field(default_factory=list)
    full: dict[str, list[Any]] | None = None

    @classmethod
    def from_json(cls, data: Any) -> SessionState:
        known, raw = split_known_fields(cls, data, what="session state")
        moe = known.get("moe")
        if isinstance(moe, dict):
            known["moe"] = MoEShape(num_layers=int(moe["num_layers"]), topk=int(moe["topk"]))
        arrays = known.get("arrays")
        if isinstance(arrays, dict):
            known["arrays"] = {
                name: ArraySpec(shape=tuple(spec["shape"]), dtype=str(spec["dtype"])) for name, spec in arrays.items()
            }
        return build(cls, known, raw, what="session state")
