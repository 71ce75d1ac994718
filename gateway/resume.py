"""A turn the engine aborted part-way, resumed: what the next request asks, and what the answers add up to.

An RL trainer updates the engine's weights while rollouts run: slime pauses each engine (SGLang's
``/pause_generation``, its default mode ``abort``), which ends every running request with ``finish_reason.type ==
"abort"`` and its output so far; while paused, new requests wait until ``/continue_generation``. A model turn whose
answer was cut that way, with nobody on the gateway's side asking for it (``abort_cause`` is None: the client is
there, no one aborted the session, no shutdown), is resubmitted at once: the branch's tokens plus what the turn
generated so far as the prompt, the length left, the same routing key. The client gets one answer; the session folds
one turn (``TurnDraft.combined``).

Pure: no I/O here (``gateway.turns`` sends the requests). Across the seam:

- tokens, log-probs, text: concatenated (the next request's text is detokenized by SGLang after its prompt, so the
  pieces join);
- top-p spans: merged as slime merges a turn's (offsets shifted by the ids before them);
- routing rows: incremental. The aborted answer brings the rows of the positions it fed through the model (all but
  its last token's); the next request asks from there (``routed_experts_start_len`` = the rows held), so nothing is
  sent twice. Its prefill computes the rows of the positions it was given and has no rows for: at least the aborted
  answer's last token, and every token of an aborted answer that brought none. Those rows are the RESUMED weights'
  routing (the prefill runs after the update), while the tokens were sampled under the weights before it. The
  per-token weight versions below say which tokens those are;
- weight versions: each answer's spans, shifted, so the turn's spans show the switch;
- counters (prompt and cached tokens, speculative decoding): summed, as slime sums them over the answers it folds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.codec import DecodedTurn, VersionSpan
from gateway.errors import UpstreamProtocolError
from gateway.sample import MoEShape

# What a request's sampling_params say of its length: the continuation asks for what is left of each.
LENGTH_PARAMS = ("max_new_tokens", "min_new_tokens")


def engine_abort(turn: DecodedTurn) -> bool:
    """Whether the answer ended with an abort that is not an error: SGLang's pause, ``/abort_request``, an
    ``abort_all``. An abort carrying a ``status_code`` is SGLang's way of failing a request (input too long, an
    invalid request found by the scheduler): resending it would fail again."""
    finish = turn.finish_reason
    return finish is not None and finish.get("type") == "abort" and finish.get("status_code") is None


@dataclass(frozen=True, slots=True)
class Submission:
    """One request of a turn to the upstream: the first, or a resumption after an engine abort."""

    rid: str
    routing_start_len: int  # rows the turn holds when it is sent (routed_experts_start_len)
    sampling_params: dict[str, Any]
    generated: np.ndarray | None = None  # the turn's tokens so far, after the branch's (None: the first request)


@dataclass(frozen=True, slots=True)
class _Rows:
    """The routing rows a turn's answers brought: from absolute position ``first``, the flat values in pieces."""

    first: int
    pieces: tuple[np.ndarray, ...] = ()
    max_id: int = 0

    def end(self, row_size: int) -> int:
        return self.first + sum(piece.size for piece in self.pieces) // row_size


@dataclass
class TurnDraft:
    """The requests of one turn and the answers they got: each one aborted by the engine and resumed, then the last
    one, adding up to the turn that is folded once (``combined``).

    ``prompt_length``: the branch's tokens when the turn started; ``routing_start_len``: the rows the session held
    then, that the first request asks from (0 when the upstream is asked for every row); ``moe``: the branch's
    shape when routing is wanted (None otherwise).
    """

    rid: str
    prompt_length: int
    routing_start_len: int
    sampling_params: dict[str, Any]
    moe: MoEShape | None = None
    incremental_routing: bool = True
    submissions: list[Submission] = field(default_factory=list)  # the requests sent so far
    answers: list[DecodedTurn] = field(default_factory=list)  # the answers kept (all but the running request's)
    _rows: _Rows = field(init=False)

    def __post_init__(self) -> None:
        self._rows = _Rows(self.routing_start_len)

    @property
    def resumed(self) -> int:
        """How many times the turn was resubmitted."""
        return max(0, len(self.submissions) - 1)

    @property
    def num_tokens(self) -> int:
        """The tokens of the answers kept."""
        return sum(answer.num_tokens for answer in self.answers)

    @property
    def _row_size(self) -> int:
        return 1 if self.moe is None else self.moe.row_size

    def first(self) -> Submission:
        submission = Submission(self.rid, self.routing_start_len, self.sampling_params)
        self.submissions = [submission]
        return submission

    def next(self) -> Submission:
        """The request that resumes the turn after its answers so far: their tokens as the prompt's end, the length
        left, the routing rows from where the turn's end."""
        params = dict(self.sampling_params)
        done = self.num_tokens
        for key in LENGTH_PARAMS:
            if isinstance(params.get(key), int):
                params[key] = max(0, params[key] - done)
        start = self._rows.end(self._row_size) if self.moe is not None and self.incremental_routing else 0
        generated = np.concatenate([answer.token_ids for answer in self.answers]).astype(np.int32, copy=False)
        submission = Submission(f"{self.rid}-r{len(self.submissions)}", start, params, generated)
        self.submissions.append(submission)
        return submission

    def add(self, answer: DecodedTurn) -> None:
        """Keep the answer of the running request (checked: its routing rows must fit where it asked from)."""
        self._rows = self._rows_with(answer)
        self.answers.append(answer)

    def _rows_with(self, answer: DecodedTurn) -> _Rows:
        """The turn's rows once the running request's ``answer`` is counted."""
        rows = self._rows
        if answer.routed_experts is None or self.moe is None:
            return rows
        submission = self.submissions[len(self.answers)]
        row = self._row_size
        prompt = self.prompt_length + (0 if submission.generated is None else len(submission.generated))
        fed = max(0, prompt + answer.num_tokens - 1)  # positions that went through the model
        start = submission.routing_start_len
        size = answer.routed_experts.size
        if size == (fed - start) * row:
            first = start
        elif start and size == fed * row:
            first = 0  # the upstream sent every row (it ignored routed_experts_start_len)
        else:
            raise UpstreamProtocolError(
                f"routed_experts of request {submission.rid!r} has {size} elements, expected {(fed - start) * row} "
                f"= (tokens {fed + 1} - 1 - start_len {start}) x {row}",
                reason="routing_element_count",
            )
        max_id = answer.routed_max or 0
        if first < rows.end(row):  # rows from further back than the turn's: they replace what came before
            return _Rows(first, (answer.routed_experts,), max_id)
        return _Rows(rows.first, (*rows.pieces, answer.routed_experts), max(rows.max_id, max_id))

    def combined(self, last: DecodedTurn) -> tuple[DecodedTurn, int]:
        """The turn as one answer, for the fold (``SessionSample.plan_model_turn`` with the first request's
        ``routing_start_len``): the answers kept, then ``last`` (the final one: whole, aborted and not resumed, or
        what a cut stream brought); with its routing lag, the positions at its end that have no routing row yet
        (the tokens a cut stream brought without its final chunk: the fold keeps the rows there are, as after tool
        tokens). A turn of one request is its answer as it came. Changes nothing here."""
        if not self.answers:
            return last, 0
        rows = self._rows_with(last)
        answers = [*self.answers, last]
        total = sum(a.num_tokens for a in answers)
        lag = max(0, self.prompt_length + total - 1 - rows.end(self._row_size)) if rows.pieces else 0
        turn = DecodedTurn(
            token_ids=np.concatenate([a.token_ids for a in answers]).astype(np.int32, copy=False),
            log_probs=np.concatenate([a.log_probs for a in answers]).astype(np.float32, copy=False),
            text="".join(a.text for a in answers),
            finish_reason=last.finish_reason,
            rid=self.rid,
            prompt_tokens=sum(a.prompt_tokens for a in answers),
            completion_tokens=total,
            cached_tokens=sum(a.cached_tokens for a in answers),
            weight_version=last.weight_version,
            routed_experts=_joined(rows.pieces),
            routed_max=rows.max_id if rows.pieces else None,
            top_p_ids=_top_p_ids(answers),
            top_p_offsets=_top_p_offsets(answers),
            spec_counters=_summed(a.spec_counters for a in answers),
            weight_version_spans=joined_spans([a.token_version_spans for a in answers]),
        )
        return turn, lag


def _top_p_ids(answers: list[DecodedTurn]) -> np.ndarray | None:
    kept = [a.top_p_ids for a in answers if a.top_p_ids is not None and a.num_tokens]
    return np.concatenate(kept).astype(np.int32, copy=False) if kept else None


def _top_p_offsets(answers: list[DecodedTurn]) -> np.ndarray | None:
    """Each answer's offsets after its first, shifted by the ids before them; an answer without tokens adds none
    (and may have brought no spans at all)."""
    pieces = [a for a in answers if a.num_tokens]
    if not pieces or any(a.top_p_offsets is None for a in pieces):
        return None
    out = [np.zeros(1, np.int32)]
    base = 0
    for answer in pieces:
        offsets = answer.top_p_offsets
        assert offsets is not None
        out.append(offsets[1:].astype(np.int32) + np.int32(base))
        base += int(offsets[-1])
    return np.concatenate(out)


def joined_spans(parts: list[tuple[VersionSpan, ...]]) -> tuple[VersionSpan, ...]:
    """The spans of consecutive answers as one turn's: each shifted by the tokens before it, a version going on
    across the seam kept as one span (SGLang's spans merge the same way)."""
    out: list[VersionSpan] = []
    base = 0
    for spans in parts:
        for span in spans:
            start, end = base + span.start, base + span.end
            if out and out[-1].version == span.version and out[-1].end == start:
                out[-1] = VersionSpan(span.version, out[-1].start, end)
            else:
                out.append(VersionSpan(span.version, start, end))
        base = out[-1].end if out else base
    return tuple(out)


def _joined(pieces: tuple[np.ndarray, ...]) -> np.ndarray | None:
    if not pieces:
        return None
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _summed(counters: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counters:
        for key, value in one.items():
            total[key] = total.get(key, 0) + value
    return total
