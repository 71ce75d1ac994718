"""The pure codec: SGLang answers -> validated compact arrays (docs/protocol.md section 2), samples -> safetensors."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import orjson
import pybase64
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as safetensors_load

from gateway.codec import (
    MAX_WEIGHT_VERSION_SPANS,
    ROUTING_STEP_CHARS,
    VersionSpan,
    answers,
    check_top_p_spans,
    decode_answer,
    decode_generate_response,
    decode_int32_b64,
    decode_output_token_logprobs,
    encode_safetensors,
    narrowest_unsigned,
)
from gateway.errors import ReplayDataDropped, UpstreamError, UpstreamProtocolError


def b64_int32(values: Any) -> str:
    return pybase64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def answer(**meta_changes: Any) -> dict[str, Any]:
    """A well-formed 3-token answer with routing (4 rows of [2, 2]) and top-p spans; ``None`` drops a key."""
    meta: dict[str, Any] = {
        "id": "rid-7",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "cached_tokens": 1,
        "weight_version": "default",
        "spec_verify_ct": 2,
        "output_token_logprobs": [[-0.5, 10, "a"], [-1.5, 11, "b"], [0.0, 12, None]],
        "routed_experts": b64_int32(np.arange(16)),
        "top_p_token_ids": b64_int32([10, 3, 11, 12]),
        "top_p_token_offsets": b64_int32([0, 2, 3, 4]),
    }
    meta.update(meta_changes)
    return {"text": "abc", "output_ids": [10, 11, 12], "meta_info": {k: v for k, v in meta.items() if v is not None}}


def body(**meta_changes: Any) -> bytes:
    return orjson.dumps(answer(**meta_changes))


def decode(data: bytes | dict[str, Any], *, want_routing: bool = True, want_top_p: bool = True) -> Any:
    if isinstance(data, bytes):
        return decode_generate_response(data, want_routing=want_routing, want_top_p=want_top_p)
    return decode_answer(data, want_routing=want_routing, want_top_p=want_top_p)


# ---- decode_generate_response: good answers -------------------------------------------------------------------
def test_decodes_a_full_answer() -> None:
    turn = decode(body())
    assert turn.token_ids.dtype == np.int32 and turn.token_ids.tolist() == [10, 11, 12]
    assert turn.log_probs.dtype == np.float32 and turn.log_probs.tolist() == [-0.5, -1.5, 0.0]
    assert (turn.text, turn.rid, turn.finish_type, turn.num_tokens) == ("abc", "rid-7", "length", 3)
    assert (turn.prompt_tokens, turn.completion_tokens, turn.cached_tokens) == (2, 3, 1)
    assert turn.weight_version == "default"
    assert turn.spec_counters == {"spec_verify_ct": 2}
    assert turn.routed_experts is not None and turn.routed_experts.tolist() == list(range(16))
    assert turn.top_p_ids is not None and turn.top_p_ids.tolist() == [10, 3, 11, 12]
    assert turn.top_p_offsets is not None and turn.top_p_offsets.tolist() == [0, 2, 3, 4]


def test_token_ids_come_from_output_token_logprobs_not_output_ids() -> None:
    data = answer()
    data["output_ids"] = [99, 98, 97]
    assert decode(data).token_ids.tolist() == [10, 11, 12]


def test_replay_data_is_ignored_unless_asked_for_routing() -> None:
    turn = decode(body(routed_experts="not even base64"), want_routing=False)
    assert turn.routed_experts is None


def test_top_p_alias_keys() -> None:
    data = body(
        top_p_token_ids=None,
        top_p_token_offsets=None,
        top_p_kept_token_ids=b64_int32([1]),
        top_p_kept_token_offsets=b64_int32([0, 1, 1, 1]),
    )
    turn = decode(data)
    assert turn.top_p_ids is not None and turn.top_p_ids.tolist() == [1]
    assert turn.top_p_offsets is not None and turn.top_p_offsets.tolist() == [0, 1, 1, 1]


def test_optional_fields_default() -> None:
    data = {"meta_info": {"output_token_logprobs": [], "weight_version": 3, "cached_tokens": None}}
    turn = decode(data, want_routing=False, want_top_p=False)
    assert (turn.num_tokens, turn.text, turn.finish_reason, turn.rid) == (0, "", None, None)
    assert (turn.weight_version, turn.cached_tokens, turn.spec_counters) == ("3", 0, {})


def test_zero_tokens_need_no_top_p_and_an_early_abort_no_routing() -> None:
    empty = {"output_token_logprobs": [], "top_p_token_ids": None, "top_p_token_offsets": None}
    turn = decode(body(**empty, routed_experts=None, finish_reason={"type": "abort", "message": "x"}))
    assert (turn.routed_experts, turn.top_p_ids) == (None, None)
    with pytest.raises(ReplayDataDropped):  # a finished zero-token answer still owes its prompt rows
        decode(body(**empty, routed_experts=None))


# ---- decode_generate_response: bad answers --------------------------------------------------------------------
LOGPROB_ITEMS: dict[str, Any] = {
    "missing": None,
    "not a list": {"0": [-0.5, 1]},
    "item not a list": [-0.5],
    "item too short": [[-0.5]],
    "null log-prob": [[None, 1, "a"]],
    "string log-prob": [["-0.5", 1, "a"]],
    "log-prob beyond float32": [[-1e300, 1, "a"]],
    "null token id": [[-0.5, None, "a"]],
    "negative token id": [[-0.5, -1, "a"]],
    "token id beyond int32": [[-0.5, 2**31, "a"]],
    "token id beyond int64": [[-0.5, 2**64 - 1, "a"]],
    "float token id": [[-0.5, 10.7, "a"]],
    "integral float token id": [[-0.5, 10.0, "a"]],
    "boolean token id": [[-0.5, True, "a"]],
    "string token id": [[-0.5, "10", "a"]],
    "boolean log-prob": [[False, 1, "a"]],
    "positive log-prob": [[0.25, 1, "a"]],
    "item a string": ["ab"],
    "item an object": [{"0": -0.5, "1": 1}],
}


def span(version: Any, start: Any, end: Any) -> dict[str, Any]:
    return {"version": version, "start": start, "end": end}


# Malformed meta_info.weight_versions for answer()'s 3 tokens and weight_version "default".
BAD_WEIGHT_VERSIONS: dict[str, Any] = {
    "an object": span("default", 0, 3),
    "a string": "default",
    "an empty list": [],
    "a span as a list": [["default", 0, 3]],
    "a span as a string": ["default"],
    "a version missing": [{"start": 0, "end": 3}],
    "a null version": [span(None, 0, 3)],
    "a numeric version": [span(7, 0, 3)],
    "a version too long": [span("v" * 1000, 0, 3)],
    "a start missing": [{"version": "default", "end": 3}],
    "a float start": [span("default", 0.0, 3)],
    "a boolean start": [span("default", False, 3)],
    "a string end": [span("default", 0, "3")],
    "a null end": [span("default", 0, None)],
    "not from 0": [span("default", 1, 3)],
    "a negative start": [span("old", -1, 1), span("default", 1, 3)],
    "a gap": [span("old", 0, 1), span("default", 2, 3)],
    "an overlap": [span("old", 0, 2), span("default", 1, 3)],
    "an empty span": [span("old", 0, 0), span("default", 0, 3)],
    "an empty span in between": [span("old", 0, 2), span("mid", 2, 2), span("default", 2, 3)],
    "a reversed span": [span("old", 0, 2), span("default", 2, 1)],
    "too few tokens covered": [span("default", 0, 2)],
    "too many tokens covered": [span("default", 0, 4)],
    "a span past the tokens": [span("old", 0, 5), span("default", 5, 6)],
    "the last version not weight_version": [span("default", 0, 1), span("other", 1, 3)],
}

BAD_BODIES: dict[str, bytes] = {
    "invalid JSON": b'{"text": "abc", ',
    "empty body": b"",
    "batch array": orjson.dumps([answer()]),
    "string": b'"abc"',
    "number": b"3",
    "null": b"null",
    "missing meta_info": b'{"text": "abc", "output_ids": []}',
    "meta_info not an object": b'{"text": "abc", "meta_info": [1]}',
    "finish_reason a string": body(finish_reason="stop"),
    "finish_reason without type": body(finish_reason={"matched": 2}),
    "finish_reason type not a string": body(finish_reason={"type": 1}),
    "non-numeric counter": body(cached_tokens="many"),
    "boolean counter": body(prompt_tokens=True),
    "list counter": body(completion_tokens=[3]),
    "non-numeric spec counter": body(spec_verify_ct="x"),
    "float counter": body(cached_tokens=3.5),
    "integral float counter": body(prompt_tokens=2.0),
    "negative counter": body(completion_tokens=-1),
    "counter beyond int32": body(spec_verify_ct=2**31),
    "counter beyond 64 bits": body(cached_tokens=12345).replace(b"12345", b"%d" % 2**64),
    "prompt_tokens beyond 64 bits": body(prompt_tokens=12345).replace(b"12345", b"%d" % 2**70),
    "spec counter beyond 64 bits": body(spec_accept_token_num=12345).replace(b"12345", b"%d" % 2**64),
    "finish_reason nested 300 deep": body(finish_reason={"type": "stop", "matched": "NEST"}).replace(
        b'"NEST"', b"[" * 300 + b"]" * 300
    ),
    "finish_reason huge": body(finish_reason={"type": "stop", "matched": "x" * 10_000}),
    "finish_reason with an int beyond 64 bits": body(finish_reason={"type": "stop", "matched": 12345}).replace(
        b"12345", b"%d" % 2**64
    ),
    "weight_version an object": body(weight_version={"v": 1}),
    "weight_version a list": body(weight_version=["v1"]),
    "weight_version a boolean": body(weight_version=True),
    "weight_version too long": body(weight_version="v" * 1000),
    "text not a string": orjson.dumps({**answer(), "text": ["abc"]}),
    **{f"output_token_logprobs {name}": body(output_token_logprobs=items) for name, items in LOGPROB_ITEMS.items()},
    "routing bad base64": body(routed_experts="@@@@"),
    "routing not a string": body(routed_experts=[1, 2]),
    "top-p ids only": body(top_p_token_offsets=None),
    "top-p offsets only": body(top_p_token_ids=None),
    "top-p offsets not from 0": body(top_p_token_offsets=b64_int32([1, 2, 3, 4])),
    "top-p offsets do not add up": body(top_p_token_offsets=b64_int32([0, 2, 3, 3])),
    "top-p offsets too short": body(top_p_token_offsets=b64_int32([0, 2, 4])),
    "top-p offsets decreasing": body(top_p_token_offsets=b64_int32([0, 3, 2, 4])),
    "top-p negative id": body(top_p_token_ids=b64_int32([10, -3, 11, 12])),
    **{f"weight_versions {name}": body(weight_versions=spans) for name, spans in BAD_WEIGHT_VERSIONS.items()},
    "weight_versions an end beyond 64 bits": body(weight_versions=[span("default", 0, 12345)]).replace(
        b"12345", b"%d" % 2**70
    ),
}


@pytest.mark.parametrize("data", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_rejects_bad_answers(data: bytes) -> None:
    with pytest.raises(UpstreamProtocolError) as info:
        decode(data)
    assert type(info.value) is UpstreamProtocolError  # not ReplayDataDropped: the data is there but wrong
    assert info.value.status_code == 502
    assert info.value.to_body()["error"]["type"] == "upstream_protocol_error"


# ---- weight versions: per-token spans ---------------------------------------------------------------------------
def test_weight_version_spans_decoded() -> None:
    spans = [span("v1", 0, 1), span("default", 1, 3)]
    for data in (body(weight_versions=spans), answer(weight_versions=spans)):  # the cut-out path and the dict path
        turn = decode(data)
        expected = (VersionSpan("v1", 0, 1), VersionSpan("default", 1, 3))
        assert turn.weight_version_spans == turn.token_version_spans == expected
        assert turn.weight_version == "default"


def test_weight_version_spans_may_repeat_a_version_and_omit_weight_version() -> None:
    spans = [span("a", 0, 1), span("b", 1, 2), span("a", 2, 3)]  # weights rolled back: still one token each
    turn = decode(body(weight_versions=spans, weight_version=None))
    assert turn.weight_version is None
    assert [s.version for s in turn.token_version_spans] == ["a", "b", "a"]


def test_weight_version_spans_unknown_keys_are_ignored() -> None:
    turn = decode(body(weight_versions=[{**span("default", 0, 3), "kind": "new"}]))
    assert turn.token_version_spans == (VersionSpan("default", 0, 3),)


def test_without_spans_the_whole_turn_ran_on_weight_version() -> None:
    turn = decode(body())
    assert turn.weight_version_spans is None
    assert turn.token_version_spans == (VersionSpan("default", 0, 3),)
    unknown = decode(body(weight_version=None))
    assert unknown.token_version_spans == (VersionSpan(None, 0, 3),)


def test_numeric_weight_version_matches_its_span_in_decimal_form() -> None:
    turn = decode(body(weight_version=7, weight_versions=[span("7", 0, 3)]))
    assert (turn.weight_version, turn.token_version_spans) == ("7", (VersionSpan("7", 0, 3),))


def test_zero_token_answer_has_one_empty_span() -> None:
    empty = {"output_token_logprobs": [], "routed_experts": None, "top_p_token_ids": None, "top_p_token_offsets": None}
    aborted = {"finish_reason": {"type": "abort", "message": "x"}, **empty}
    turn = decode(body(**aborted, weight_versions=[span("default", 0, 0)]))
    assert turn.weight_version_spans == (VersionSpan("default", 0, 0),) and turn.token_version_spans == ()
    for bad in ([], [span("default", 0, 1)], [span("old", 0, 0), span("default", 0, 0)], [span("x", 0, 0)]):
        with pytest.raises(UpstreamProtocolError, match="weight_version"):
            decode(body(**aborted, weight_versions=bad))


def long_answer(spans: list[dict[str, Any]], n: int) -> bytes:
    items = [[-0.5, 1, None]] * n
    no_replay = {"routed_experts": None, "top_p_token_ids": None, "top_p_token_offsets": None}
    return body(output_token_logprobs=items, weight_versions=spans, weight_version=None, **no_replay)


def test_at_most_max_weight_version_spans() -> None:
    n = MAX_WEIGHT_VERSION_SPANS + 1
    most = [span(f"v{i}", i, i + 1) for i in range(MAX_WEIGHT_VERSION_SPANS - 1)]
    most.append(span("last", MAX_WEIGHT_VERSION_SPANS - 1, n))
    turn = decode(long_answer(most, n), want_routing=False, want_top_p=False)
    assert len(turn.token_version_spans) == MAX_WEIGHT_VERSION_SPANS
    too_many = [span(f"v{i}", i, i + 1) for i in range(n)]
    with pytest.raises(UpstreamProtocolError, match=f"over {MAX_WEIGHT_VERSION_SPANS}"):
        decode(long_answer(too_many, n), want_routing=False, want_top_p=False)


@pytest.mark.parametrize(
    ("spans", "needle"),
    [
        ([span("old", 0, 1), span("default", 2, 3)], r"weight_versions\[1\] starts at 2, not 1: a gap"),
        ([span("old", 0, 2), span("default", 1, 3)], r"weight_versions\[1\] starts at 1, not 2: an overlap"),
        ([span("default", 0, 2)], "cover 2 of the answer's 3"),
        ([span("default", 0, 4)], "past the answer's 3"),
        ([span("default", 0, 1), span("other", 1, 3)], "not the last span's version 'other'"),
        ([span("default", 0, 3.0)], r"weight_versions\[0\]: start and end must be integers"),
    ],
)
def test_weight_version_span_errors_say_what_is_wrong(spans: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(UpstreamProtocolError, match=needle):
        decode(body(weight_versions=spans))


def test_weight_version_numbers_become_their_decimal_form() -> None:
    assert decode(body(weight_version=7)).weight_version == "7"
    assert decode(body(weight_version=1.5)).weight_version == "1.5"


def test_zero_log_prob_and_integer_log_prob_are_valid() -> None:
    ids, log_probs = decode_output_token_logprobs([[0.0, 1, None], [0, 2, None], [-3, 3, None]])
    assert ids.tolist() == [1, 2, 3] and log_probs.tolist() == [0.0, 0.0, -3.0]


def test_non_finite_counters_from_python_objects() -> None:
    with pytest.raises(UpstreamProtocolError, match="cached_tokens"):
        decode(answer(cached_tokens=float("nan")))


def test_bad_log_prob_errors_name_the_item() -> None:
    with pytest.raises(UpstreamProtocolError, match=r"output_token_logprobs\[1\]"):
        decode_output_token_logprobs([[-0.5, 1, "a"], [-0.5, "x", "b"]])
    with pytest.raises(UpstreamProtocolError, match=r"output_token_logprobs\[0\].*outside"):
        decode_output_token_logprobs([[-0.5, 2**64, "a"]])
    with pytest.raises(UpstreamProtocolError, match=r"output_token_logprobs\[2\].*non-finite"):
        decode_output_token_logprobs([[-0.5, 1, "a"], [-0.5, 2, "b"], [None, 3, "c"]])


@pytest.mark.parametrize(
    ("dropped", "want", "missing"),
    [
        ({"routed_experts": None}, {"want_routing": True, "want_top_p": False}, "routed_experts"),
        ({"top_p_token_ids": None, "top_p_token_offsets": None}, {"want_routing": False}, "top_p_token_ids"),
    ],
)
def test_asked_for_replay_data_missing_is_replay_data_dropped(
    dropped: dict[str, None], want: dict[str, bool], missing: str
) -> None:
    with pytest.raises(ReplayDataDropped) as info:
        decode(body(**dropped), **want)
    error = info.value
    assert isinstance(error, UpstreamProtocolError) and isinstance(error, UpstreamError)
    assert error.to_body()["error"] == {"type": "replay_data_dropped", "message": error.message, "missing": missing}
    assert "router" in error.message  # says where to look


def test_unasked_missing_replay_data_is_fine() -> None:
    bare = body(routed_experts=None, top_p_token_ids=None, top_p_token_offsets=None)
    turn = decode(bare, want_routing=False, want_top_p=False)
    assert (turn.routed_experts, turn.top_p_ids, turn.top_p_offsets) == (None, None, None)


# ---- the routing value decoded in steps, straight from the answer's bytes ---------------------------------------
def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What decoding an answer gives: its routing (dtype, values, max) or the error it raises."""
    try:
        turn = call()
    except UpstreamError as exc:
        return ("error", type(exc).__name__, str(exc))
    routed = turn.routed_experts
    return ("ok", str(routed.dtype), routed.tolist(), turn.routed_max)


ROUTING_IDS = st.one_of(st.integers(0, 255), st.integers(256, 70_000), st.integers(-(2**31), 2**31 - 1))


@settings(max_examples=400, deadline=None)
@given(
    values=st.lists(ROUTING_IDS, max_size=40),
    cut=st.integers(0, 5),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from("A=/+!-_ \n\\é")), max_size=2),
    step=st.sampled_from([16, 32, 64]),
)
def test_routing_decoded_in_steps_agrees_with_the_plain_path(
    values: list[int], cut: int, edits: list[tuple[int, str]], step: int
) -> None:
    """Whatever the value holds (ids of any width, a negative one, garbage, early padding, an escape, a cut int32), and
    wherever it falls against the steps' edges, the stepwise decode of the bytes gives what the plain path gives on the
    parsed answer: the same array in the same dtype, or the same error."""
    chars = list(b64_int32(values))
    chars = chars[: len(chars) - cut] if cut < len(chars) else chars
    for at, char in edits:
        if chars:
            chars[at % len(chars)] = char
    data = body(routed_experts="".join(chars))
    with mock.patch.object(answers, "ROUTING_STEP_CHARS", step):
        stepwise = outcome(lambda: decode(data))
    assert stepwise == outcome(lambda: decode(orjson.loads(data)))


@pytest.mark.parametrize(
    ("where", "value", "expect"),
    [
        ("last step", 2**31, "negative expert id"),
        ("first step", 300, "uint16"),
        ("middle", 70_000, "uint32"),
        ("middle", None, "not valid base64"),
    ],
)
def test_a_big_routing_value_across_real_steps(where: str, value: int | None, expect: str) -> None:
    """A multi-megabyte value over several real steps: a wide id or a negative one anywhere widens or refuses, and
    garbage in the middle is reported as the plain path reports it."""
    ids = np.random.default_rng(0).integers(0, 128, size=ROUTING_STEP_CHARS * 3 // 4 * 3 // 4 + 5)
    at = {"first step": 7, "middle": len(ids) // 2, "last step": len(ids) - 1}[where]
    if value is not None:
        ids[at] = value
    text = b64_int32(ids.astype(np.uint32).view(np.int32))
    if value is None:
        cut = at * 4 // 3 // 4 * 4
        text = text[:cut] + "!" + text[cut + 1 :]
    got = outcome(lambda: decode(body(routed_experts=text)))
    assert got == outcome(lambda: decode(answer(routed_experts=text)))
    if expect.startswith("uint"):
        assert got[0] == "ok" and got[1] == expect and got[2] == ids.tolist() and got[3] == value
    else:
        assert got[0] == "error" and expect in got[2]


# ---- decode_int32_b64 -----------------------------------------------------------------------------------------
def test_decode_int32_b64_round_trip_and_read_only() -> None:
    values = np.array([0, 1, -1, 2**31 - 1, -(2**31)], dtype=np.int32)
    for encoded in (b64_int32(values), b64_int32(values).encode("ascii")):
        decoded = decode_int32_b64(encoded, "x")
        assert decoded.dtype == np.dtype("<i4")
        np.testing.assert_array_equal(decoded, values)
        assert not decoded.flags.writeable
    assert decode_int32_b64("", "x").size == 0


@pytest.mark.parametrize(
    "garbage",
    [
        "AAA*AAA==",  # decodes to 4 bytes if the '*' were skipped: validate=True must refuse it
        "AAAA\nAAAA",
        "AAAAAAAA=",
        "A",
        "====",
        "AAAA AAAA",
        "AAAA-_AA",  # URL-safe alphabet is not standard base64
        "AAAé",
    ],
)
def test_decode_int32_b64_rejects_garbage(garbage: str) -> None:
    with pytest.raises(UpstreamProtocolError, match=r"meta_info\.routed_experts is not valid base64"):
        decode_int32_b64(garbage, "routed_experts")


@pytest.mark.parametrize("whole_bytes", [1, 2, 3, 5, 7])
def test_decode_int32_b64_rejects_partial_int32(whole_bytes: int) -> None:
    encoded = pybase64.b64encode(bytes(whole_bytes)).decode("ascii")
    with pytest.raises(UpstreamProtocolError, match=f"{whole_bytes} bytes"):
        decode_int32_b64(encoded, "top_p_token_ids")


@pytest.mark.parametrize("value", [None, 3, [1, 2], {"b64": "AAAA"}])
def test_decode_int32_b64_rejects_non_strings(value: Any) -> None:
    with pytest.raises(UpstreamProtocolError, match="must be a base64 string"):
        decode_int32_b64(value, "routed_experts")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64))
def test_decode_int32_b64_inverts_standard_base64(values: list[int]) -> None:
    assert decode_int32_b64(b64_int32(values), "x").tolist() == values


# ---- top-p span checks ----------------------------------------------------------------------------------------
def test_check_top_p_spans_accepts_empty_spans() -> None:
    check_top_p_spans(np.array([], np.int32), np.array([0, 0, 0], np.int32), 2)
    check_top_p_spans(np.array([], np.int32), np.array([0], np.int32), 0)


# ---- narrowest_unsigned ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("max_value", "dtype"),
    [
        (0, np.uint8),
        (255, np.uint8),
        (256, np.uint16),
        (65_535, np.uint16),
        (65_536, np.uint32),
        (2**32 - 1, np.uint32),
    ],
)
def test_narrowest_unsigned(max_value: int, dtype: type[np.unsignedinteger]) -> None:
    assert narrowest_unsigned(max_value) == np.dtype(dtype)


def test_narrowest_unsigned_refuses_beyond_32_bits() -> None:
    with pytest.raises(UpstreamProtocolError):
        narrowest_unsigned(2**32)


# ---- encode_safetensors ---------------------------------------------------------------------------------------
def safetensors_metadata(data: bytes) -> dict[str, str]:
    (header_len,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + header_len]).get("__metadata__", {})


def test_encode_safetensors_round_trip() -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "tokens": np.arange(10, dtype=np.int32),
        "loss_mask": np.array([0, 1, 1], dtype=np.uint8),
        "rollout_log_probs": -rng.random(3).astype(np.float32),
        "rollout_routed_experts": rng.integers(0, 300, size=(9, 4, 2)).astype(np.uint16),
        "strided": np.arange(20, dtype=np.int64)[::2],  # not contiguous: must be made so
        "empty": np.zeros((0, 4, 2), dtype=np.uint8),
    }
    metadata = {"session_id": "s1", "status": "completed"}
    data = encode_safetensors(arrays, metadata)
    loaded = safetensors_load(data)
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        np.testing.assert_array_equal(loaded[name], array)
    assert safetensors_metadata(data) == metadata
