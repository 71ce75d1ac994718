"""The gateway's fold (``SessionSample``, compact numpy arrays) is slime's ``Sample.append_response_tokens``.

Every test feeds the SAME SGLang-style answers to the gateway (decoded from their JSON bytes, as the gateway
does, and checked against ``decode_answer`` on the parsed dict; then ``fold_model_turn`` / ``append_tool_tokens``)
and to the list-based oracle in ``slime_reference.py``, and compares every field after every step. Failing steps
must raise the gateway's error and leave the ``SessionSample`` exactly as it was (every array and scalar).

SGLang does not echo ``routed_experts_start_len``: the gateway passes the value it sent as ``routing_start_len``,
while slime reads it from ``meta_info``; the answers built here carry it in both places.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson
import pybase64
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from slime_reference import ReferenceArgs, ReferenceSample

from gateway.codec import DecodedTurn, VersionSpan, decode_answer, decode_generate_response
from gateway.errors import GatewayError, InvalidRequest, ReplayDataDropped, SessionConflict, UpstreamProtocolError
from gateway.sample import UNKNOWN_VERSION_ID, MoEShape, SessionSample, Status
from gateway.turns import aborted_turn

PROMPT = (11, 12, 13, 14)
MOE = MoEShape(num_layers=3, topk=2)
FINISH_BODIES: dict[str, dict[str, Any]] = {
    "stop": {"type": "stop", "matched": 2},
    "length": {"type": "length", "length": 16},
    "abort": {"type": "abort", "message": "aborted by the client"},
    "other": {"type": "something_new"},  # an unknown type leaves the status alone, in slime and here
}
ORACLE_ERRORS = (ValueError, TypeError)  # what slime raises (binascii.Error is a ValueError)


# ---- building SGLang answers ---------------------------------------------------------------------------------
def b64_int32(values: Sequence[int] | np.ndarray) -> str:
    return pybase64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


@dataclass(frozen=True)
class Fold:
    """One upstream answer plus what the gateway asked for (and so passes to the decoder and the fold)."""

    answer: dict[str, Any]
    want_routing: bool = False
    want_top_p: bool = False
    start_len: int = 0
    oracle_meta: dict[str, Any] | None = None  # what slime sees instead of answer["meta_info"], when it differs

    @property
    def meta(self) -> dict[str, Any]:
        return self.answer["meta_info"]

    def with_meta(self, **changes: Any) -> Fold:
        """A copy whose meta_info has ``changes`` applied (a value of ``None`` deletes the key)."""
        meta = {**self.meta, **changes}
        meta = {key: value for key, value in meta.items() if value is not None}
        return replace(self, answer={**self.answer, "meta_info": meta})


def make_answer(
    token_ids: Sequence[int],
    *,
    log_probs: Sequence[float | None] | None = None,
    text: str = "",
    finish: str | None = "stop",
    weight_version: str | None = "w1",
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    routing: np.ndarray | None = None,
    start_len: int = 0,
    top_p: tuple[Sequence[int], Sequence[int]] | None = None,
    top_p_keys: tuple[str, str] = ("top_p_token_ids", "top_p_token_offsets"),
) -> dict[str, Any]:
    """A non-streamed SGLang ``/generate`` answer (docs/protocol.md section 2)."""
    if log_probs is None:
        log_probs = [-0.125 * (i + 1) for i in range(len(token_ids))]
    meta: dict[str, Any] = {
        "id": "rid-1",
        "output_token_logprobs": [[lp, int(tid), None] for lp, tid in zip(log_probs, token_ids, strict=True)],
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(token_ids),
        "cached_tokens": cached_tokens,
    }
    if finish is not None:
        meta["finish_reason"] = FINISH_BODIES[finish]
    if weight_version is not None:
        meta["weight_version"] = weight_version
    if routing is not None:
        meta["routed_experts"] = b64_int32(routing.reshape(-1))
        meta["routed_experts_start_len"] = start_len  # for the oracle: SGLang never echoes it
    if top_p is not None:
        meta[top_p_keys[0]] = b64_int32(top_p[0])
        meta[top_p_keys[1]] = b64_int32(top_p[1])
    return {"text": text, "output_ids": [int(t) for t in token_ids], "meta_info": meta}


def decoded(fold: Fold, key: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(fold.meta[key]), "<i4").copy()


def spans(sizes: Sequence[int], first_id: int = 500) -> tuple[list[int], list[int]]:
    """Top-p ids/offsets for tokens whose kept sets have the given sizes."""
    offsets = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
    return list(range(first_id, first_id + offsets[-1])), offsets


def expert_rows(rng: np.random.Generator, rows: int, moe: MoEShape, num_experts: int = 8) -> np.ndarray:
    return rng.integers(0, num_experts, size=(rows, moe.num_layers, moe.topk), dtype=np.int32)


@dataclass
class FakeUpstream:
    """Answers like SGLang would for the session's current state: the right row counts, fresh random data."""

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def answer(
        self,
        sample: SessionSample,
        *,
        n: int,
        routing: bool = False,
        top_p: bool = False,
        finish: str | None = "stop",
        num_experts: int = 8,
        start_len: int | None = None,
        ignore_start_len: bool = False,
        text: str | None = None,
    ) -> Fold:
        """``start_len`` defaults to the gateway's choice (the rows it holds); ``ignore_start_len`` sends all rows."""
        start = sample.routing_rows if start_len is None else start_len
        new_total = len(sample.tokens) + n
        token_ids = self.rng.integers(0, 50_000, size=n).tolist()
        log_probs = (-self.rng.random(n) * 5).tolist()
        rows = None
        if routing:
            assert sample.moe is not None
            row_count = max(0, new_total - 1 - (0 if ignore_start_len else start))
            rows = expert_rows(self.rng, row_count, sample.moe, num_experts)
        top_p_data = spans(self.rng.integers(0, 4, size=n).tolist(), first_id=int(self.rng.integers(0, 1000)))
        answer = make_answer(
            token_ids,
            log_probs=log_probs,
            text=text if text is not None else "".join(chr(97 + int(t) % 26) for t in token_ids),
            finish=finish,
            weight_version=f"w{len(sample.turns)}",
            prompt_tokens=len(sample.tokens),
            cached_tokens=int(self.rng.integers(0, len(sample.tokens) + 1)),
            routing=rows,
            start_len=start,
            top_p=top_p_data if top_p else None,
        )
        fold = Fold(answer, want_routing=routing, want_top_p=top_p, start_len=start)
        if ignore_start_len:  # slime, given the full rows, would be told start_len 0: a single full call
            fold = replace(fold, oracle_meta={**answer["meta_info"], "routed_experts_start_len": 0})
        return fold


# ---- the two folds side by side ------------------------------------------------------------------------------
def assert_same_turn(a: DecodedTurn, b: DecodedTurn) -> None:
    for item in dataclasses.fields(DecodedTurn):
        x, y = getattr(a, item.name), getattr(b, item.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None and x.dtype == y.dtype, item.name
            np.testing.assert_array_equal(x, y, err_msg=item.name)
        else:
            assert x == y, item.name


def decode_turn(fold: Fold) -> DecodedTurn:
    """Decode the answer as the gateway does (its JSON bytes), checking the parsed-dict path agrees."""
    want = {"want_routing": fold.want_routing, "want_top_p": fold.want_top_p}
    results: list[DecodedTurn | GatewayError] = []
    for decode in (
        lambda: decode_generate_response(orjson.dumps(fold.answer), **want),
        lambda: decode_answer(copy.deepcopy(fold.answer), **want),
    ):
        try:
            results.append(decode())
        except GatewayError as exc:
            results.append(exc)
    from_bytes, from_dict = results
    if isinstance(from_bytes, GatewayError) or isinstance(from_dict, GatewayError):
        assert type(from_bytes) is type(from_dict), (from_bytes, from_dict)
        assert isinstance(from_bytes, GatewayError)
        raise from_bytes
    assert_same_turn(from_bytes, from_dict)
    return from_bytes


def fold_gateway(sample: SessionSample, fold: Fold) -> None:
    sample.fold_model_turn(decode_turn(fold), routing_start_len=fold.start_len)


def fold_oracle(oracle: ReferenceSample, args: ReferenceArgs | None, fold: Fold) -> None:
    """What a slime rollout does with the answer: ids and log-probs from output_token_logprobs, then the fold."""
    meta = fold.meta if fold.oracle_meta is None else fold.oracle_meta
    items = meta["output_token_logprobs"]
    oracle.append_response_tokens(
        args,
        tokens=[item[1] for item in items],
        log_probs=[item[0] for item in items],
        meta_info=meta,
        text=fold.answer["text"],
    )


def snapshot(sample: SessionSample) -> dict[str, Any]:
    """Everything a failed turn must leave untouched: every array (dtype, shape, bytes), every scalar."""
    state: dict[str, Any] = {
        f"array {name}": (array.dtype.str, array.shape, array.tobytes()) for name, array in sample.arrays().items()
    }
    state.update(
        prompt_length=sample.prompt_length,
        moe=sample.moe,
        status=sample.status,
        weight_versions=list(sample.weight_versions),
        weight_version_table=list(sample.weight_version_table),
        cached_tokens=sample.cached_tokens,
        prompt_tokens=sample.prompt_tokens,
        spec_counters=dict(sample.spec_counters),
        turns=[turn.to_json() for turn in sample.turns],
        response=sample.response,
        stored_bytes=sample.stored_bytes,
    )
    return state


def tensor_list(value: Any) -> list[int] | None:
    return None if value is None else [int(v) for v in value.reshape(-1).tolist()]


def buffer_list(buffer: Any) -> list[int] | None:
    return None if buffer is None else buffer.view().tolist()


def assert_same(sample: SessionSample, oracle: ReferenceSample) -> None:
    sample.check_invariants()
    assert sample.tokens.view().tolist() == oracle.tokens
    assert sample.response_length == oracle.response_length
    assert sample.loss_mask.view().tolist() == oracle.loss_mask
    # float32 tolerance: the gateway keeps float32, slime Python floats; they agree exactly once cast.
    np.testing.assert_array_equal(sample.log_probs.view(), np.asarray(oracle.rollout_log_probs, dtype=np.float32))
    assert sample.response == oracle.response
    assert buffer_list(sample.top_p_ids) == tensor_list(oracle.rollout_top_p_token_ids)
    assert buffer_list(sample.top_p_offsets) == tensor_list(oracle.rollout_top_p_token_offsets)
    if oracle.rollout_routed_experts is None:
        assert sample.routed_experts is None
    else:
        assert sample.routed_experts is not None
        routed = sample.routed_experts.view()
        assert routed.shape == tuple(oracle.rollout_routed_experts.shape)
        np.testing.assert_array_equal(routed.astype(np.int64), oracle.rollout_routed_experts.numpy())
    assert sample.status.value == oracle.status
    assert sample.weight_versions == oracle.weight_versions
    assert sample.cached_tokens == oracle.cached_tokens
    assert sample.prompt_tokens == oracle.total_prompt_tokens


class Twin:
    """A gateway ``SessionSample`` and the slime oracle, fed the same steps and compared after each."""

    def __init__(self, prompt: Sequence[int] = PROMPT, moe: MoEShape | None = MOE) -> None:
        self.gateway = SessionSample.from_prompt(np.asarray(prompt, dtype=np.int64), moe)
        self.oracle = ReferenceSample(tokens=[int(t) for t in prompt])
        self.args = None if moe is None else ReferenceArgs(moe.num_layers, moe.topk)
        self.check()

    def check(self) -> None:
        assert_same(self.gateway, self.oracle)

    def model(self, fold: Fold) -> None:
        fold_gateway(self.gateway, fold)
        fold_oracle(self.oracle, self.args, fold)
        self.check()

    def tool(self, token_ids: Sequence[int], text: str | None = None) -> None:
        self.gateway.append_tool_tokens(np.asarray(token_ids, dtype=np.int32), text)
        self.oracle.append_response_tokens(self.args, tokens=token_ids, trainable=False, text=text)
        self.check()

    def rejects(self, fold: Fold, error: type[GatewayError], *, oracle_rejects: bool) -> GatewayError:
        """The gateway raises ``error`` and is unchanged; slime (on a copy) rejects it too when it should."""
        before = snapshot(self.gateway)
        with pytest.raises(error) as info:
            fold_gateway(self.gateway, fold)
        assert snapshot(self.gateway) == before
        if oracle_rejects:
            with pytest.raises(ORACLE_ERRORS):
                fold_oracle(copy.deepcopy(self.oracle), self.args, fold)
        self.check()
        return info.value


# ---- worked cases --------------------------------------------------------------------------------------------
def test_single_turn_matches_slime() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7, 8, 9], text="abc", prompt_tokens=4, cached_tokens=2, weight_version="v3")))
    sample = twin.gateway
    assert sample.tokens.view().tolist() == [*PROMPT, 7, 8, 9]
    assert sample.loss_mask.view().tolist() == [1, 1, 1]
    assert (sample.status, sample.weight_versions, sample.cached_tokens, sample.prompt_tokens) == (
        Status.COMPLETED,
        ["v3"],
        2,
        4,
    )


@pytest.mark.parametrize(
    ("finish", "status"),
    [("stop", Status.COMPLETED), ("length", Status.TRUNCATED), ("abort", Status.ABORTED), ("other", Status.PENDING)],
)
def test_status_follows_finish_type(finish: str, status: Status) -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7, 8], finish=finish)))
    assert twin.gateway.status is status


def test_terminal_info_skipped_without_finish_reason() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7, 8], finish=None, cached_tokens=3, prompt_tokens=4, weight_version="v1")))
    assert (twin.gateway.status, twin.gateway.weight_versions, twin.gateway.cached_tokens) == (Status.PENDING, [], 0)
    twin.model(Fold(make_answer([9], finish="stop", cached_tokens=5, prompt_tokens=6, weight_version="v2")))
    assert (twin.gateway.status, twin.gateway.weight_versions, twin.gateway.cached_tokens) == (
        Status.COMPLETED,
        ["v2"],
        5,
    )


def test_null_finish_reason_is_treated_as_absent() -> None:
    """Streaming chunks carry ``finish_reason: null``; slime's callers skip terminal info for them."""
    twin = Twin()
    fold = Fold(make_answer([7, 8], finish=None, cached_tokens=3))
    with_null = replace(fold, answer={**fold.answer, "meta_info": {**fold.meta, "finish_reason": None}})
    twin.model(replace(with_null, oracle_meta=fold.meta))
    assert twin.gateway.status is Status.PENDING


def test_weight_version_not_appended_for_zero_new_tokens() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7], weight_version="v1")))
    twin.model(Fold(make_answer([], finish="abort", weight_version="v2", cached_tokens=4, prompt_tokens=5)))
    assert twin.gateway.weight_versions == ["v1"]
    assert (twin.gateway.status, twin.gateway.cached_tokens) == (Status.ABORTED, 4)


# ---- per-token weight versions (not a slime field: checked against the expected ids) -----------------------------
def version_ids(sample: SessionSample) -> list[int]:
    return sample.arrays()["rollout_weight_version_ids"].tolist()


def test_weight_version_ids_reuse_the_table_across_turns() -> None:
    twin = Twin()
    first = Fold(make_answer([7, 8, 9], weight_version="b"))
    twin.model(with_spans(first, ("a", 0, 2), ("b", 2, 3)))
    twin.tool([50, 51], text="<tool>")
    twin.model(Fold(make_answer([10, 11], weight_version="b")))  # an older server: weight_version only
    twin.model(with_spans(Fold(make_answer([12, 13, 14], weight_version="a")), ("c", 0, 1), ("a", 1, 3)))
    sample = twin.gateway
    assert sample.weight_version_table == ["a", "b", "c"]
    assert version_ids(sample) == [0, 0, 1, -1, -1, 1, 1, 2, 0, 0]
    assert sample.weight_versions == ["b", "b", "a"]  # slime's per-turn list, as before (and as the oracle's)
    assert sample.arrays()["rollout_weight_version_ids"].dtype == np.int32
    spans_logged = [turn.weight_version_spans for turn in sample.turns]
    assert spans_logged == [
        [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 3}],
        None,  # the tool turn
        [{"version": "b", "start": 0, "end": 2}],
        [{"version": "c", "start": 0, "end": 1}, {"version": "a", "start": 1, "end": 3}],
    ]


def test_tokens_of_an_unknown_version_are_minus_one() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7, 8], weight_version=None)))
    twin.model(Fold(make_answer([], finish="abort", weight_version="v2")))  # no tokens: the table stays empty
    assert (twin.gateway.weight_version_table, version_ids(twin.gateway)) == ([], [UNKNOWN_VERSION_ID] * 2)
    assert twin.gateway.turns[0].weight_version_spans == [{"version": None, "start": 0, "end": 2}]


def test_partial_turn_keeps_the_versions_its_chunks_named() -> None:
    """A streamed turn cut before its final chunk: the spans the stream decoder kept (``partial_version_spans``)."""
    sample = SessionSample.from_prompt(np.asarray(PROMPT), None)
    sample.fold_model_turn(decode_turn(Fold(make_answer([7], weight_version="v1"))))
    spans = (VersionSpan("v1", 0, 2), VersionSpan("v2", 2, 3), VersionSpan(None, 3, 4))
    received = {"token_ids": np.arange(4, dtype=np.int32), "log_probs": np.full(4, -0.5, np.float32)}
    sample.fold_model_turn(aborted_turn("rid", "client disconnected", **received, weight_version_spans=spans))
    sample.check_invariants()
    assert sample.weight_version_table == ["v1", "v2"]
    assert version_ids(sample) == [0, 0, 0, 1, -1]
    assert (sample.weight_versions, sample.status) == (["v1"], Status.ABORTED)  # no final weight_version: no entry


@pytest.mark.parametrize(
    "spans",
    [
        (VersionSpan("v", 0, 2),),
        (VersionSpan("v", 0, 2), VersionSpan("w", 1, 3)),
        (VersionSpan("v", 0, 1), VersionSpan("w", 2, 3)),
        (VersionSpan("v", 0, 0), VersionSpan("w", 0, 3)),
        (VersionSpan("v", 0, 4),),
    ],
)
def test_turns_whose_spans_miss_tokens_are_refused_by_the_plan(spans: tuple[VersionSpan, ...]) -> None:
    """Spans the codec did not check (a partial turn's): the plan still refuses any that miss or repeat a token."""
    twin = Twin()
    twin.model(Fold(make_answer([7], weight_version="v1")))
    before = snapshot(twin.gateway)
    received = {"token_ids": np.arange(3, dtype=np.int32), "log_probs": np.full(3, -0.5, np.float32)}
    with pytest.raises(UpstreamProtocolError, match="do not cover its 3 tokens"):
        twin.gateway.plan_model_turn(aborted_turn("rid", "cut", **received, weight_version_spans=spans))
    assert snapshot(twin.gateway) == before


def test_top_p_spans_merge_across_turns() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7, 8, 9], top_p=([5, 6, 7], [0, 2, 2, 3])), want_top_p=True))
    # The second turn uses slime's alias keys; its offsets are shifted by the current last offset.
    aliases = ("top_p_kept_token_ids", "top_p_kept_token_offsets")
    twin.model(Fold(make_answer([10, 11], top_p=([8, 9, 10], [0, 1, 3]), top_p_keys=aliases), want_top_p=True))
    assert twin.gateway.top_p_ids is not None and twin.gateway.top_p_offsets is not None
    assert twin.gateway.top_p_ids.view().tolist() == [5, 6, 7, 8, 9, 10]
    assert twin.gateway.top_p_offsets.view().tolist() == [0, 2, 2, 3, 4, 6]


def test_tool_tokens_pad_top_p_with_empty_spans() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([7, 8], top_p=([5, 6, 7], [0, 2, 3])), want_top_p=True))
    twin.tool([900, 901, 902], text="<tool>")
    assert twin.gateway.top_p_offsets is not None
    assert twin.gateway.top_p_offsets.view().tolist() == [0, 2, 3, 3, 3, 3]
    assert twin.gateway.log_probs.view()[-3:].tolist() == [0.0, 0.0, 0.0]
    twin.model(Fold(make_answer([9], top_p=([4], [0, 1])), want_top_p=True))
    assert twin.gateway.top_p_offsets.view().tolist() == [0, 2, 3, 3, 3, 3, 4]
    assert twin.gateway.loss_mask.view().tolist() == [1, 1, 0, 0, 0, 1]


def test_tool_tokens_without_top_p_keep_it_off() -> None:
    twin = Twin()
    twin.tool([900, 901])
    twin.model(Fold(make_answer([7])))
    twin.tool([], text="")
    assert twin.gateway.top_p_offsets is None


def test_top_p_with_zero_new_tokens_does_not_start_replay() -> None:
    twin = Twin()
    twin.model(Fold(make_answer([], finish="abort", top_p=([], [0])), want_top_p=True))
    assert not twin.gateway.top_p_active
    twin.model(Fold(make_answer([7], top_p=([3], [0, 1])), want_top_p=True))
    assert twin.gateway.top_p_active


def test_zero_token_answers_may_lack_replay_data() -> None:
    """Nothing generated, nothing to replay: aborted before the first token without routing, no top-p spans."""
    twin = Twin()
    twin.model(Fold(make_answer([], finish="abort"), want_routing=True, want_top_p=True))
    twin.model(Fold(make_answer([], finish=None), want_top_p=True))
    assert (twin.gateway.routed_experts, twin.gateway.top_p_offsets) == (None, None)


def test_routing_start_len_zero_replaces() -> None:
    twin, upstream = Twin(), FakeUpstream()
    twin.model(upstream.answer(twin.gateway, n=3, routing=True, start_len=0))
    assert twin.gateway.routing_rows == len(PROMPT) + 3 - 1
    second = upstream.answer(twin.gateway, n=2, routing=True, start_len=0)
    twin.model(second)
    assert twin.gateway.routed_experts is not None
    stored = twin.gateway.routed_experts.view()
    assert stored.shape == (len(PROMPT) + 5 - 1, MOE.num_layers, MOE.topk)
    np.testing.assert_array_equal(stored.reshape(-1).astype(np.int32), decoded(second, "routed_experts"))


def test_routing_start_len_appends_new_rows() -> None:
    twin, upstream = Twin(), FakeUpstream()
    twin.model(upstream.answer(twin.gateway, n=3, routing=True))
    assert twin.gateway.routed_experts is not None
    first = twin.gateway.routed_experts.view().copy()
    twin.model(upstream.answer(twin.gateway, n=2, routing=True))  # start_len = the 6 rows held
    stored = twin.gateway.routed_experts.view()
    assert len(stored) == len(PROMPT) + 5 - 1
    np.testing.assert_array_equal(stored[: len(first)], first)


def test_routing_start_len_below_stored_rows_keeps_only_the_prefix() -> None:
    twin, upstream = Twin(), FakeUpstream()
    twin.model(upstream.answer(twin.gateway, n=4, routing=True))
    assert twin.gateway.routed_experts is not None
    first = twin.gateway.routed_experts.view().copy()
    twin.model(upstream.answer(twin.gateway, n=2, routing=True, start_len=2))  # stored[:2] ++ new
    stored = twin.gateway.routed_experts.view()
    assert len(stored) == len(PROMPT) + 6 - 1
    np.testing.assert_array_equal(stored[:2], first[:2])


def test_routing_rows_lag_behind_tool_tokens() -> None:
    twin, upstream = Twin(), FakeUpstream()
    twin.model(upstream.answer(twin.gateway, n=3, routing=True))
    rows_after_model = twin.gateway.routing_rows
    twin.tool([900, 901, 902, 903])
    # No padding, no invented rows: the tool tokens have none until the next model turn.
    assert twin.gateway.routing_rows == rows_after_model == len(twin.gateway.tokens) - 1 - 4
    twin.model(upstream.answer(twin.gateway, n=2, routing=True))
    assert twin.gateway.routing_rows == len(twin.gateway.tokens) - 1
    twin.tool([904])  # a sample that ends with tool tokens has fewer than len(tokens) - 1 rows
    assert twin.gateway.routing_rows == len(twin.gateway.tokens) - 2


def test_upstream_ignoring_start_len_is_a_full_replace() -> None:
    """Rows from position 0 although start_len > 0 was sent: the result equals one full (start_len 0) call."""
    twin, upstream = Twin(), FakeUpstream()
    twin.model(upstream.answer(twin.gateway, n=3, routing=True))
    twin.tool([900, 901])
    fold = upstream.answer(twin.gateway, n=2, routing=True, ignore_start_len=True)
    assert fold.start_len > 0
    full_call = copy.deepcopy(twin.gateway)
    twin.model(fold)  # the oracle is given start_len 0 for it (see FakeUpstream.answer)
    fold_gateway(full_call, replace(fold, start_len=0))
    assert snapshot(full_call) == snapshot(twin.gateway)


def test_expert_ids_use_the_narrowest_dtype_and_widen() -> None:
    twin, upstream = Twin(), FakeUpstream()
    twin.model(upstream.answer(twin.gateway, n=3, routing=True, num_experts=256))
    assert twin.gateway.routed_experts is not None
    assert twin.gateway.routed_experts.dtype == np.uint8
    before = twin.gateway.routed_experts.view().copy()
    wide = upstream.answer(twin.gateway, n=2, routing=True)
    rows = decoded(wide, "routed_experts")
    rows[-1] = 300
    twin.model(wide.with_meta(routed_experts=b64_int32(rows)))
    assert twin.gateway.routed_experts.dtype == np.uint16
    np.testing.assert_array_equal(twin.gateway.routed_experts.view()[: len(before)], before)
    assert int(twin.gateway.routed_experts.view().reshape(-1)[-1]) == 300
    twin.tool([900])
    huge = upstream.answer(twin.gateway, n=1, routing=True, start_len=0)
    huge_rows = decoded(huge, "routed_experts")
    huge_rows[0] = 70_000
    twin.model(huge.with_meta(routed_experts=b64_int32(huge_rows)))
    assert twin.gateway.routed_experts.dtype == np.uint32


def test_check_can_request_top_p_refuses_late_start() -> None:
    twin = Twin()
    twin.gateway.check_can_request_top_p()  # no response tokens yet: fine
    twin.model(Fold(make_answer([7])))
    before = snapshot(twin.gateway)
    with pytest.raises(SessionConflict):
        twin.gateway.check_can_request_top_p()
    assert snapshot(twin.gateway) == before


# ---- failures leave the session exactly as it was ------------------------------------------------------------
def replay_session() -> tuple[Twin, FakeUpstream]:
    """Routing and top-p replay active, tool tokens at the end (so routing rows lag)."""
    twin, upstream = Twin(), FakeUpstream(np.random.default_rng(7))
    twin.model(upstream.answer(twin.gateway, n=3, routing=True, top_p=True))
    twin.tool([900, 901])
    return twin, upstream


def plain_session() -> tuple[Twin, FakeUpstream]:
    """Routing but no top-p replay, with response tokens."""
    twin, upstream = Twin(), FakeUpstream(np.random.default_rng(8))
    twin.model(upstream.answer(twin.gateway, n=3, routing=True))
    return twin, upstream


def next_replay_turn(twin: Twin, upstream: FakeUpstream, **kwargs: Any) -> Fold:
    return upstream.answer(twin.gateway, n=3, routing=True, top_p=True, **kwargs)


def routing_without_last_element(fold: Fold) -> Fold:
    return fold.with_meta(routed_experts=b64_int32(decoded(fold, "routed_experts")[:-1]))


def routing_with_extra_row(fold: Fold) -> Fold:
    rows = decoded(fold, "routed_experts")
    return fold.with_meta(routed_experts=b64_int32(np.concatenate([rows, rows[: MOE.row_size]])))


def start_len_ahead_of_stored_rows(twin: Twin, upstream: FakeUpstream) -> Fold:
    return next_replay_turn(twin, upstream, start_len=twin.gateway.routing_rows + 1)


def top_p_offsets(fold: Fold, change: Callable[[list[int]], list[int]]) -> Fold:
    return fold.with_meta(top_p_token_offsets=b64_int32(change(decoded(fold, "top_p_token_offsets").tolist())))


def with_log_prob(fold: Fold, index: int, value: Any) -> Fold:
    items = [list(item) for item in fold.meta["output_token_logprobs"]]
    items[index][0] = value
    return fold.with_meta(output_token_logprobs=items)


def with_spans(fold: Fold, *spans: tuple[str, int, int]) -> Fold:
    return fold.with_meta(weight_versions=[{"version": v, "start": start, "end": end} for v, start, end in spans])


def spans_ending_on(fold: Fold, version: str) -> Fold:
    """Spans covering the answer whose last version is not its weight_version."""
    n = fold.meta["completion_tokens"]
    return with_spans(fold, (fold.meta["weight_version"], 0, 1), (version, 1, n))


def with_token_id(fold: Fold, index: int, value: Any) -> Fold:
    items = [list(item) for item in fold.meta["output_token_logprobs"]]
    items[index][1] = value
    return fold.with_meta(output_token_logprobs=items)


def negative_expert(fold: Fold) -> Fold:
    rows = decoded(fold, "routed_experts")
    rows[0] = -1
    return fold.with_meta(routed_experts=b64_int32(rows))


@dataclass(frozen=True)
class RejectCase:
    name: str
    make: Callable[[Twin, FakeUpstream], Fold]
    error: type[GatewayError]
    oracle_rejects: bool  # False where the gateway is stricter than slime by design
    session: Callable[[], tuple[Twin, FakeUpstream]] = replay_session


def _replay(change: Callable[[Fold], Fold]) -> Callable[[Twin, FakeUpstream], Fold]:
    return lambda twin, upstream: change(next_replay_turn(twin, upstream))


UPE = UpstreamProtocolError
REJECT_CASES = [
    RejectCase("routing element count short", _replay(routing_without_last_element), UPE, True),
    RejectCase("routing element count one row long", _replay(routing_with_extra_row), UPE, True),
    RejectCase("start_len beyond stored rows", start_len_ahead_of_stored_rows, UPE, True),
    RejectCase(
        "start_len > 0 on a session without routing",
        lambda twin, upstream: upstream.answer(twin.gateway, n=2, routing=True, start_len=2),
        UPE,
        True,
        session=lambda: (Twin(), FakeUpstream()),
    ),
    RejectCase("routing bad base64", _replay(lambda f: f.with_meta(routed_experts="@@not base64@@")), UPE, True),
    RejectCase("routing not whole int32s", _replay(lambda f: f.with_meta(routed_experts="AAA=")), UPE, True),
    RejectCase("routing negative expert id", _replay(negative_expert), UPE, False),
    RejectCase(
        "routing asked for, missing", _replay(lambda f: f.with_meta(routed_experts=None)), ReplayDataDropped, False
    ),
    RejectCase(
        "routing asked for, missing, zero tokens not aborted",
        lambda twin, upstream: Fold(make_answer([], finish="stop"), want_routing=True),
        ReplayDataDropped,
        False,
    ),
    RejectCase("top-p bad base64", _replay(lambda f: f.with_meta(top_p_token_ids="***")), UPE, True),
    RejectCase(
        "top-p offsets do not add up", _replay(lambda f: top_p_offsets(f, lambda o: [*o[:-1], o[-1] + 1])), UPE, True
    ),
    RejectCase("top-p offsets wrong length", _replay(lambda f: top_p_offsets(f, lambda o: o[:-1])), UPE, True),
    RejectCase("top-p offsets not from 0", _replay(lambda f: top_p_offsets(f, lambda o: [1, *o[1:]])), UPE, True),
    RejectCase("top-p offsets decreasing", _replay(lambda f: top_p_offsets(f, lambda o: [0, 5, *o[2:]])), UPE, False),
    RejectCase("top-p ids without offsets", _replay(lambda f: f.with_meta(top_p_token_offsets=None)), UPE, True),
    RejectCase(
        "top-p asked for, missing, session keeps top-p",
        _replay(lambda f: f.with_meta(top_p_token_ids=None, top_p_token_offsets=None)),
        ReplayDataDropped,
        True,
    ),
    RejectCase(
        "top-p not asked for, missing, session keeps top-p",
        _replay(lambda f: replace(f.with_meta(top_p_token_ids=None, top_p_token_offsets=None), want_top_p=False)),
        UPE,
        True,
    ),
    RejectCase(
        "top-p asked for on the first turn, missing",
        lambda twin, upstream: upstream.answer(twin.gateway, n=2, top_p=True).with_meta(
            top_p_token_ids=None, top_p_token_offsets=None
        ),
        ReplayDataDropped,
        False,
        session=lambda: (Twin(), FakeUpstream()),
    ),
    RejectCase(
        "top-p arriving after response tokens without it",
        lambda twin, upstream: replace(upstream.answer(twin.gateway, n=2, routing=True, top_p=True), want_top_p=False),
        UPE,
        True,
        session=plain_session,
    ),
    RejectCase("missing output_token_logprobs", _replay(lambda f: f.with_meta(output_token_logprobs=None)), UPE, False),
    RejectCase("null log-prob", _replay(lambda f: with_log_prob(f, 1, None)), UPE, True),
    RejectCase("string log-prob", _replay(lambda f: with_log_prob(f, 0, "x")), UPE, True),
    RejectCase("log-prob beyond float32", _replay(lambda f: with_log_prob(f, 0, -1e300)), UPE, False),
    RejectCase("negative token id", _replay(lambda f: with_token_id(f, 0, -5)), UPE, False),
    RejectCase("token id beyond int64", _replay(lambda f: with_token_id(f, 0, 2**64 - 1)), UPE, False),
    RejectCase("finish_reason without type", _replay(lambda f: f.with_meta(finish_reason="stop")), UPE, False),
    RejectCase("non-numeric counter", _replay(lambda f: f.with_meta(cached_tokens="many")), UPE, False),
    RejectCase("weight_versions short of the tokens", _replay(lambda f: with_spans(f, ("w", 0, 1))), UPE, False),
    RejectCase("weight_versions with a gap", _replay(lambda f: with_spans(f, ("a", 0, 1), ("b", 2, 3))), UPE, False),
    RejectCase("weight_versions not ending on weight_version", _replay(lambda f: spans_ending_on(f, "x")), UPE, False),
    RejectCase("weight_versions not a list", _replay(lambda f: f.with_meta(weight_versions="w")), UPE, False),
    RejectCase(
        "text not a string",
        _replay(lambda f: replace(f, answer={**f.answer, "text": 5})),
        UPE,
        False,
    ),
    RejectCase(
        "routing without a MoE shape",
        lambda twin, upstream: Fold(
            make_answer([7, 8], routing=np.zeros((len(PROMPT) + 1, 1, 1), np.int32)), want_routing=True
        ),
        InvalidRequest,
        False,
        session=lambda: (Twin(moe=None), FakeUpstream()),
    ),
]


@pytest.mark.parametrize("case", REJECT_CASES, ids=[case.name for case in REJECT_CASES])
def test_rejected_answer_leaves_session_unchanged(case: RejectCase) -> None:
    twin, upstream = case.session()
    fold = case.make(twin, upstream)
    twin.rejects(fold, case.error, oracle_rejects=case.oracle_rejects)
    # ... and the session still folds a good answer afterwards, in step with slime.
    twin.model(
        upstream.answer(twin.gateway, n=2, routing=twin.gateway.moe is not None, top_p=twin.gateway.top_p_active)
    )


def test_routing_error_names_the_expected_count() -> None:
    twin, upstream = replay_session()
    error = twin.rejects(_replay(routing_without_last_element)(twin, upstream), UPE, oracle_rejects=True)
    assert error.details.get("reason") == "routing_element_count"
    assert "num_layers 3" in error.message


# ---- the property: random sessions, every step in step with slime --------------------------------------------
MOE_MAX_ROW = 4 * 3  # the largest num_layers x topk drawn below
TRICKY_TEXTS = ('"routed_experts":"AAAA"', '{"top_p_token_ids":"', '\\"', "é\u2028\x00")
FAULTS = (
    "ignore_start_len",
    "routing_count",
    "start_len_ahead",
    "routing_b64",
    "drop_routing",
    "drop_top_p",
    "bad_offsets",
    "null_log_prob",
    "unasked_top_p",
)


@dataclass(frozen=True)
class ModelOp:
    n: int
    text: str | None
    finish: str | None
    routing: bool
    num_experts: int
    fault: str | None


@dataclass(frozen=True)
class ToolOp:
    n: int
    text: str | None


@dataclass(frozen=True)
class Outcome:
    """What a (possibly faulty) answer should do: ``error`` None means both folds accept it."""

    fold: Fold
    error: type[GatewayError] | None = None
    oracle_rejects: bool = False


def apply_fault(fold: Fold, fault: str | None, sample: SessionSample, n: int, upstream: FakeUpstream) -> Outcome:
    """Corrupt ``fold`` the way ``fault`` says, when it applies to this turn; otherwise leave it valid."""
    routing, top_p = fold.want_routing, fold.want_top_p
    if fault == "routing_count" and routing:
        rows = decoded(fold, "routed_experts")
        # One element short (never a whole-row count), or, with no rows due, more rows than positions.
        bad = rows[:-1] if rows.size else np.zeros(MOE_MAX_ROW * (len(sample.tokens) + n + 1), np.int32)
        return Outcome(fold.with_meta(routed_experts=b64_int32(bad)), UPE, oracle_rejects=True)
    if fault == "start_len_ahead" and routing:
        ahead = upstream.answer(sample, n=n, routing=True, top_p=top_p, start_len=sample.routing_rows + 1)
        return Outcome(ahead, UPE, oracle_rejects=True)
    if fault == "routing_b64" and routing:
        return Outcome(fold.with_meta(routed_experts="A"), UPE, oracle_rejects=True)
    if (
        fault == "drop_routing"
        and routing
        and not (n == 0 and fold.meta.get("finish_reason") == FINISH_BODIES["abort"])
    ):
        return Outcome(fold.with_meta(routed_experts=None), ReplayDataDropped)
    if fault == "drop_top_p" and top_p and n:
        dropped = fold.with_meta(top_p_token_ids=None, top_p_token_offsets=None)
        return Outcome(dropped, ReplayDataDropped, oracle_rejects=sample.top_p_active)
    if fault == "bad_offsets" and top_p:
        # slime only reads top-p data when tokens were generated; the gateway validates it always.
        return Outcome(top_p_offsets(fold, lambda o: [*o[:-1], o[-1] + 1]), UPE, oracle_rejects=n > 0)
    if fault == "null_log_prob" and n:
        return Outcome(with_log_prob(fold, n - 1, None), UPE, oracle_rejects=True)
    if fault == "unasked_top_p" and not top_p:
        ids, offsets = spans([1] * n)
        unasked = fold.with_meta(top_p_token_ids=b64_int32(ids), top_p_token_offsets=b64_int32(offsets))
        late = n > 0 and sample.response_length > 0 and not sample.top_p_active
        return Outcome(unasked, UPE if late else None, oracle_rejects=late)
    return Outcome(fold)


model_ops = st.builds(
    ModelOp,
    n=st.integers(0, 6),
    # Texts that look like the base64 fields the byte-level decoder cuts out of the JSON must stay text.
    text=st.one_of(st.none(), st.sampled_from(TRICKY_TEXTS), st.text(max_size=5)),
    finish=st.sampled_from([None, "stop", "length", "abort"]),
    routing=st.sampled_from([True, True, True, False]),
    num_experts=st.sampled_from([8, 256, 301, 70_001]),
    fault=st.one_of(st.none(), st.sampled_from(FAULTS)),
)
tool_ops = st.builds(ToolOp, n=st.integers(0, 4), text=st.one_of(st.none(), st.text(max_size=3)))
# num_layers 0 stands for a dense model (no MoE shape): one session in five.
moe_shapes = st.tuples(st.integers(0, 4), st.integers(1, 3)).map(lambda lk: MoEShape(*lk) if lk[0] else None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, 50_000), min_size=1, max_size=6),
    moe=moe_shapes,
    top_p_from_start=st.booleans(),
    ops=st.lists(st.one_of(model_ops, model_ops, tool_ops), min_size=1, max_size=15),
    seed=st.integers(0, 2**32 - 1),
)
def test_fold_matches_slime_on_random_sessions(
    prompt: list[int], moe: MoEShape | None, top_p_from_start: bool, ops: list[ModelOp | ToolOp], seed: int
) -> None:
    twin, upstream = Twin(prompt, moe), FakeUpstream(np.random.default_rng(seed))
    for op in ops:
        sample = twin.gateway
        if isinstance(op, ToolOp):
            twin.tool(upstream.rng.integers(0, 50_000, size=op.n).tolist(), op.text)
            continue
        # As gateway.turns plans it: routing needs a MoE shape; top-p from the first response token, then always.
        want_top_p = sample.top_p_active or (top_p_from_start and sample.response_length == 0)
        routing = op.routing and moe is not None
        fold = upstream.answer(
            sample,
            n=op.n,
            routing=routing,
            top_p=want_top_p,
            finish=op.finish,
            num_experts=op.num_experts,
            text=op.text,
            ignore_start_len=op.fault == "ignore_start_len" and routing and sample.routing_rows > 0,
        )
        outcome = apply_fault(fold, op.fault, sample, op.n, upstream)
        event(f"fault {op.fault}: {'accepted' if outcome.error is None else outcome.error.__name__}")
        if outcome.error is None:
            twin.model(outcome.fold)
        else:
            twin.rejects(outcome.fold, outcome.error, oracle_rejects=outcome.oracle_rejects)
