"""Per-session Sample state and THE fold: slime's ``Sample.append_response_tokens`` over compact arrays.

Every append validates first and mutates only once everything is known to be valid, so a failed turn
leaves the session exactly as it was. Appends are amortized O(new tokens) (see ``GrowableArray``).
docs/protocol.md section 6 is the contract; the field names are slime's ``Sample`` fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.buffers import GrowableArray
from gateway.codec import INT32_MAX, DecodedTurn, VersionSpan, narrowest_unsigned, unsigned_max
from gateway.errors import InvalidRequest, SessionConflict, UpstreamProtocolError


class Status(enum.StrEnum):
    """slime's ``Sample.Status`` values."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
# ``weight_version_ids`` of a token no weights produced (tool/environment tokens) or of an unknown version.
UNKNOWN_VERSION_ID = -1


@dataclass(frozen=True, slots=True)
class MoEShape:
    num_layers: int
    topk: int

    @property
    def row_size(self) -> int:
        return self.num_layers * self.topk


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """How a validated routing array lands in the state: rows kept from the store, then the new rows."""

    keep_rows: int
    rows: np.ndarray  # [new_rows, L, K], as decoded (int32, or already the narrowest unsigned dtype)
    max_id: int
    upstream_ignored_start_len: bool = False


@dataclass(frozen=True, slots=True)
class VersionPlan:
    """How a turn's weight versions land in the state: versions new to the session's table, and the table index of
    each new token (``UNKNOWN_VERSION_ID`` where the version is unknown)."""

    new_versions: tuple[str, ...]
    ids: np.ndarray  # int32 [num_tokens]


@dataclass(frozen=True, slots=True)
class ModelTurnPlan:
    """A model answer checked against the session: everything ``apply_model_turn`` will do, decided up front."""

    turn: DecodedTurn
    routing: RoutingPlan | None
    record: TurnRecord
    status_after: Status
    routing_rows_after: int
    versions: VersionPlan


@dataclass(frozen=True, slots=True)
class SampleMark:
    """``SessionSample.mark``: the lengths and scalars that ``rollback`` restores."""

    tokens: int
    prompt_length: int
    turns: int
    top_p_offsets: int | None
    routing_rows: int
    text_pieces: tuple[str, ...]
    status: Status


@dataclass(slots=True)
class TurnRecord:
    """One entry of the session's turn log (what the curl view shows)."""

    kind: str  # "model" | "tool"
    num_tokens: int
    finish_reason: dict[str, Any] | None = None
    weight_version: str | None = None
    cached_tokens: int = 0
    routing_rows: int | None = None
    # model turns: which weights produced which of the turn's tokens ({"version", "start", "end"}, version null when
    # unknown), positions counted from the turn's first token
    weight_version_spans: list[dict[str, Any]] | None = None
    resumed: int = 0  # model turns: times the engine aborted it mid-answer and it was resubmitted (gateway.resume)

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}


@dataclass
class SessionSample:
    """The compact form of slime's ``Sample`` for one session."""

    prompt_length: int
    tokens: GrowableArray
    moe: MoEShape | None = None
    loss_mask: GrowableArray = field(default_factory=lambda: GrowableArray(np.uint8))
    log_probs: GrowableArray = field(default_factory=lambda: GrowableArray(np.float32))
    top_p_ids: GrowableArray | None = None
    top_p_offsets: GrowableArray | None = None
    routed_experts: GrowableArray | None = None
    status: Status = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)  # slime's: one entry per finished model turn
    # Per response token, which weights produced it: an index into ``weight_version_table`` (distinct versions in
    # first-seen order), UNKNOWN_VERSION_ID for tool tokens and unknown versions. Off-policy correction needs it
    # per token: a partial rollout resumed after a weight update, or an update landing mid-answer, mixes versions
    # (docs/protocol.md section 6.7).
    weight_version_table: list[str] = field(default_factory=list)
    weight_version_ids: GrowableArray = field(default_factory=lambda: GrowableArray(np.int32))
    cached_tokens: int = 0
    prompt_tokens: int = 0
    spec_counters: dict[str, int] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    _text_pieces: list[str] = field(default_factory=list)
    # A persistent store's bookkeeping of what it holds of this sample (``gateway.redis_store``); empty in memory.
    persisted: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_prompt(cls, prompt_ids: list[int] | np.ndarray, moe: MoEShape | None = None) -> SessionSample:
        ids = prompt_ids
        if not (isinstance(ids, np.ndarray) and ids.dtype == np.int32):  # the body parser's arrays are int32 already
            ids = np.asarray(prompt_ids, dtype=np.int64).astype(np.int32)
        tokens = GrowableArray.from_array(ids)  # the one copy: a 4M-token prompt was three (~100 ms on the loop)
        return cls(prompt_length=len(tokens), tokens=tokens, moe=moe)

    # ---- derived views -------------------------------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def routing_rows(self) -> int:
        return 0 if self.routed_experts is None else len(self.routed_experts)

    @property
    def top_p_active(self) -> bool:
        return self.top_p_offsets is not None

    @property
    def response(self) -> str:
        if len(self._text_pieces) > 1:  # join lazily, once: repeated str += would be O(n^2)
            self._text_pieces[:] = ["".join(self._text_pieces)]
        return self._text_pieces[0] if self._text_pieces else ""

    @property
    def stored_bytes(self) -> int:
        buffers = (
            self.tokens,
            self.loss_mask,
            self.log_probs,
            self.weight_version_ids,
            self.top_p_ids,
            self.top_p_offsets,
            self.routed_experts,
        )
        return sum(b.nbytes for b in buffers if b is not None)

    # ---- the fold ------------------------------------------------------------------------------------------
    def check_can_request_top_p(self) -> None:
        """slime cannot start top-p replay on a sample that already has response tokens without it."""
        if not self.top_p_active and self.response_length:
            raise SessionConflict(
                "top-p replay must be enabled from the session's first response token: this session already has "
                f"{self.response_length} response tokens without top-p data"
            )

    def fold_model_turn(self, turn: DecodedTurn, *, routing_start_len: int = 0) -> TurnRecord:
        """Append a model answer (trainable tokens): ``plan_model_turn``, then ``apply_model_turn``."""
        return self.apply_model_turn(self.plan_model_turn(turn, routing_start_len=routing_start_len))

    def plan_model_turn(self, turn: DecodedTurn, *, routing_start_len: int = 0, routing_lag: int = 0) -> ModelTurnPlan:
        """Check a model answer against the session and decide what folding it changes; changes nothing. Every
        error of the fold is raised here, so a caller can also check what it will answer before applying.
        ``routing_lag``: the answer's last positions that have no routing row (a resumed turn's stream cut before
        its final chunk): its rows end that many positions short, and the next turn asks for them, as after tool
        tokens."""
        n = turn.num_tokens
        routing = self._plan_routing(turn, len(self.tokens) + n - routing_lag, routing_start_len)
        self._check_top_p(turn, n)
        spans = turn.token_version_spans
        versions = self._plan_versions(spans, n)
        record = TurnRecord(
            kind="model",
            num_tokens=n,
            finish_reason=turn.finish_reason,
            weight_version=turn.weight_version,
            cached_tokens=turn.cached_tokens,
            routing_rows=None if routing is None else len(routing.rows),
            weight_version_spans=[span.to_json() for span in spans],
        )
        status = FINISH_TO_STATUS.get(turn.finish_type or "", self.status) if turn.finish_reason else self.status
        rows_after = self.routing_rows if routing is None else routing.keep_rows + len(routing.rows)
        return ModelTurnPlan(turn, routing, record, status, rows_after, versions)

    def apply_model_turn(self, plan: ModelTurnPlan) -> TurnRecord:
        """Fold a planned answer in. Nothing here can fail on the answer's content (``plan_model_turn`` checked
        it); only running out of memory could stop it half-way."""
        turn = plan.turn
        n = turn.num_tokens
        self._append_tokens(turn.token_ids, trainable=True, log_probs=turn.log_probs, text=turn.text)
        if turn.top_p_offsets is not None and n:
            self._merge_top_p(turn.top_p_ids, turn.top_p_offsets)
        if plan.routing is not None:
            self._apply_routing(plan.routing)
        self.weight_version_table.extend(plan.versions.new_versions)
        self.weight_version_ids.append(plan.versions.ids)
        if turn.finish_reason is not None:
            self._apply_terminal_info(turn)
        self.status = plan.status_after
        self.turns.append(plan.record)
        return plan.record

    def append_prompt_tokens(self, token_ids: np.ndarray) -> None:
        """More prompt: only while the sample has no response (a chat session's prompt comes with its first request)."""
        if self.response_length:
            raise InvalidRequest("a sample's prompt can only grow before its first response token")
        self.tokens.append(token_ids)
        self.prompt_length += len(token_ids)

    def mark(self) -> SampleMark:
        """Where the sample stands now, for ``rollback`` (a chat turn rolls back the tokens it appended before its
        model turn when that turn fails)."""
        return SampleMark(
            tokens=len(self.tokens),
            prompt_length=self.prompt_length,
            turns=len(self.turns),
            top_p_offsets=None if self.top_p_offsets is None else len(self.top_p_offsets),
            routing_rows=self.routing_rows,
            text_pieces=tuple(self._text_pieces),
            status=self.status,
        )

    def rollback(self, mark: SampleMark) -> None:
        """Undo the prompt or tool tokens appended since ``mark``. Only those: a model turn since then (routing
        rows, top-p ids, versions) is not undone here, and is refused. Buffers are cut by copying what stays
        (``GrowableArray.truncate``), so views handed out meanwhile stay valid snapshots."""
        if self.routing_rows != mark.routing_rows or any(t.kind == "model" for t in self.turns[mark.turns :]):
            raise AssertionError("rollback only undoes prompt and tool tokens")
        response_tokens = mark.tokens - mark.prompt_length
        for buffer, keep in (
            (self.tokens, mark.tokens),
            (self.loss_mask, response_tokens),
            (self.log_probs, response_tokens),
            (self.weight_version_ids, response_tokens),
            (self.top_p_offsets, mark.top_p_offsets),
        ):
            if buffer is not None and keep is not None and len(buffer) != keep:
                buffer.truncate(keep)
        self.prompt_length = mark.prompt_length
        del self.turns[mark.turns :]
        self._text_pieces[:] = mark.text_pieces
        self.status = mark.status

    def branch(self, prefix_tokens: int) -> SessionSample:
        """A new trajectory that continues from this one's first ``prefix_tokens`` tokens (a chat history that was
        edited after them). The prefix is its prompt: the responses in it are trained once, in this sample. It keeps
        the prefix's routing rows (replay covers prompt positions too) and this sample's replay settings."""
        if not 0 <= prefix_tokens <= len(self.tokens):
            raise ValueError(f"cannot branch at token {prefix_tokens} of {len(self.tokens)}")
        branch = SessionSample.from_prompt(self.tokens.view()[:prefix_tokens], self.moe)
        if self.routed_experts is not None:
            rows = min(self.routing_rows, max(0, prefix_tokens - 1))
            branch.routed_experts = GrowableArray.from_array(self.routed_experts.view()[:rows])
        if self.top_p_active:
            branch.top_p_ids = GrowableArray(np.int32)
            branch.top_p_offsets = GrowableArray.from_array(np.zeros(1, np.int32))
        return branch

    def append_tool_tokens(self, token_ids: np.ndarray, text: str | None = None) -> TurnRecord:
        """Tool/environment tokens: not trainable (loss mask 0, log-prob 0.0, empty top-p spans, no weight version)."""
        self._append_tokens(token_ids, trainable=False, log_probs=None, text=text)
        self.weight_version_ids.append_repeat(UNKNOWN_VERSION_ID, len(token_ids))
        if self.top_p_offsets is not None:
            self.top_p_offsets.append_repeat(self.top_p_offsets.last(), len(token_ids))
        record = TurnRecord(kind="tool", num_tokens=len(token_ids))
        self.turns.append(record)
        return record

    def _append_tokens(
        self, token_ids: np.ndarray, *, trainable: bool, log_probs: np.ndarray | None, text: str | None
    ) -> None:
        n = len(token_ids)
        self.tokens.append(token_ids)
        self.loss_mask.append_repeat(1 if trainable else 0, n)
        if log_probs is None:
            self.log_probs.append_repeat(0.0, n)
        else:
            self.log_probs.append(log_probs)
        if text:
            self._text_pieces.append(text)

    def _check_top_p(self, turn: DecodedTurn, n: int) -> None:
        if turn.top_p_offsets is None or not n:
            if self.top_p_active and n:
                raise UpstreamProtocolError("this session keeps top-p replay data but the answer carries none")
            return
        if not self.top_p_active and self.response_length:
            # slime would replace the spans with this turn's only and then fail its length check.
            raise UpstreamProtocolError(
                "top-p replay data arrived for a session whose earlier response tokens have none"
            )

    def _plan_versions(self, spans: tuple[VersionSpan, ...], n: int) -> VersionPlan:
        """Table indices for the turn's tokens, reusing the session's entries; a version seen first here is added
        after the existing ones (so earlier ids never change)."""
        _check_spans_cover(spans, n)
        index = {version: i for i, version in enumerate(self.weight_version_table)}
        new_versions: list[str] = []
        ids = np.empty(n, dtype=np.int32)
        for span in spans:
            version = span.version
            if version is None:
                version_id = UNKNOWN_VERSION_ID
            elif version in index:
                version_id = index[version]
            else:
                version_id = index[version] = len(index)
                new_versions.append(version)
            ids[span.start : span.end] = version_id
        return VersionPlan(tuple(new_versions), ids)

    def _merge_top_p(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        if self.top_p_offsets is None or self.top_p_ids is None:
            self.top_p_ids = GrowableArray.from_array(ids, np.int32)
            self.top_p_offsets = GrowableArray.from_array(offsets, np.int32)
            return
        base = self.top_p_offsets.last()
        self.top_p_ids.append(ids)
        self.top_p_offsets.append(offsets[1:] + np.int32(base))

    def _plan_routing(self, turn: DecodedTurn, new_total: int, start_len: int) -> RoutingPlan | None:
        routed = turn.routed_experts
        if routed is None:
            return None
        max_id = turn.routed_max if turn.routed_max is not None else unsigned_max(routed)
        if max_id > INT32_MAX:
            raise UpstreamProtocolError("meta_info.routed_experts holds a negative expert id")
        if self.moe is None:
            raise InvalidRequest("routed experts need the session's MoE shape (num_layers, moe_router_topk)")
        row = self.moe.row_size
        full_rows = max(0, new_total - 1)
        expected_rows = max(0, new_total - 1 - start_len)
        if routed.size == expected_rows * row:
            if start_len and self.routing_rows < start_len:
                raise UpstreamProtocolError(
                    f"routed_experts_start_len={start_len} but the session holds only {self.routing_rows} rows"
                )
            keep, ignored = start_len, False
        elif start_len and routed.size == full_rows * row:
            keep, ignored = 0, True  # the upstream sent every row (ignored start_len): replace, as slime does for 0
        else:
            raise UpstreamProtocolError(
                f"routed_experts has {routed.size} elements, expected {expected_rows * row} = "
                f"(tokens {new_total} - 1 - start_len {start_len}) x num_layers {self.moe.num_layers} x "
                f"topk {self.moe.topk}",
                reason="routing_element_count",
            )
        rows = routed.reshape(-1, self.moe.num_layers, self.moe.topk)
        return RoutingPlan(keep_rows=keep, rows=rows, max_id=max_id, upstream_ignored_start_len=ignored)

    def _apply_routing(self, plan: RoutingPlan) -> None:
        max_id = plan.max_id
        if self.routed_experts is None:
            dtype = narrowest_unsigned(max_id)
            if plan.keep_rows == 0 and plan.rows.dtype == dtype:
                # The codec decoded the rows straight into their stored dtype, for this fold only: keep that
                # array rather than copy megabytes on the event loop.
                self.routed_experts = GrowableArray.adopt(plan.rows)
                return
            self.routed_experts = GrowableArray(dtype, (self.moe.num_layers, self.moe.topk))  # type: ignore[union-attr]
        elif max_id > np.iinfo(self.routed_experts.dtype).max:
            self.routed_experts.widen(narrowest_unsigned(max_id))
        self.routed_experts.replace_tail(plan.keep_rows, plan.rows)

    def _apply_terminal_info(self, turn: DecodedTurn) -> None:
        self.cached_tokens += turn.cached_tokens
        self.prompt_tokens += turn.prompt_tokens
        for key, value in turn.spec_counters.items():
            self.spec_counters[key] = self.spec_counters.get(key, 0) + value
        if turn.num_tokens and turn.weight_version is not None:
            self.weight_versions.append(turn.weight_version)

    # ---- export ----------------------------------------------------------------------------------------------
    def trained_versions(self) -> dict[str, Any]:
        """The weight versions this trajectory's trained tokens (loss mask 1) come from: the first and the last in the
        order the trajectory met them (the order of the updates), how many, the trained tokens of each, and those of
        no known version. What a staleness bound looks at (docs/operations/weight-updates.md). O(response)."""
        trained = self.weight_version_ids.view()[self.loss_mask.view().astype(bool)]
        known = trained[trained >= 0]
        counts = np.bincount(known, minlength=len(self.weight_version_table)) if len(known) else np.zeros(0, np.int64)
        present = np.flatnonzero(counts).tolist()
        table = self.weight_version_table
        return {
            "first": table[present[0]] if present else None,
            "last": table[present[-1]] if present else None,
            "count": len(present),
            "tokens": {table[i]: int(counts[i]) for i in present},
            "unknown_tokens": int(len(trained) - len(known)),
        }

    def arrays(self) -> dict[str, np.ndarray]:
        """The sample as named arrays (slime field names), views into the state: no copies."""
        out = {
            "tokens": self.tokens.view(),
            "loss_mask": self.loss_mask.view(),
            "rollout_log_probs": self.log_probs.view(),
        }
        if self.top_p_ids is not None and self.top_p_offsets is not None:
            out["rollout_top_p_token_ids"] = self.top_p_ids.view()
            out["rollout_top_p_token_offsets"] = self.top_p_offsets.view()
        if self.routed_experts is not None:
            out["rollout_routed_experts"] = self.routed_experts.view()
        out["rollout_weight_version_ids"] = self.weight_version_ids.view()
        return out

    def check_invariants(self) -> None:
        """docs/protocol.md section 6.6 invariants; raises AssertionError (used by tests and debug checks)."""
        n = self.response_length
        assert len(self.loss_mask) == len(self.log_probs) == n, "loss_mask/log_probs length != response_length"
        if self.top_p_offsets is not None and self.top_p_ids is not None:
            assert len(self.top_p_offsets) == n + 1, "len(top_p_offsets) != response_length + 1"
            assert self.top_p_offsets.last() == len(self.top_p_ids), "top_p_offsets[-1] != len(top_p_ids)"
        if self.routed_experts is not None:
            assert len(self.routed_experts) <= max(0, len(self.tokens) - 1), "more routing rows than positions"
        ids = self.weight_version_ids.view()
        assert len(ids) == n, "len(weight_version_ids) != response_length"
        assert not len(ids) or UNKNOWN_VERSION_ID <= ids.min() <= ids.max() < len(self.weight_version_table), (
            "weight_version_ids outside the version table"
        )
        assert len(set(self.weight_version_table)) == len(self.weight_version_table), "repeated table entries"


def _check_spans_cover(spans: tuple[VersionSpan, ...], n: int) -> None:
    """The codec checks SGLang's spans; a partial turn's come from the stream decoder. Checked again here so that no
    turn can leave a token without its version, or give one two."""
    covered = 0
    for span in spans:
        if span.start != covered or span.end <= span.start:
            break
        covered = span.end
    else:
        if covered == n:
            return
    raise UpstreamProtocolError(
        f"the turn's weight version spans {[span.to_json() for span in spans]!r:.200} do not cover its {n} tokens"
    )
