"""Bad input found by a fuzzer and by hand (issue 22, item 6): each answered with a clear error or handled, on the
real gateway and simulator over 127.0.0.1, and the big-body parser's refusals as a unit (``gateway.bodies``).

- a malformed ~30 MB token array (one bad id) is refused in steps, never by pydantic's whole-body parse (which held
  the GIL for 0.25-0.6 s), with pydantic's own error for that element;
- session ids ``.`` and ``..`` (URL dot segments, which clients resolve away) are refused;
- an unchanged session's sample is the same bytes on every fetch;
- a MoE turn with ``max_new_tokens: 0`` (no new routing row to send) is an answer, in the simulator and the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service
from pydantic import ValidationError
from safetensors.numpy import load

from gateway.bodies import MAX_ARRAY_ERRORS, STEP_BYTES, validate_big_body
from gateway.schemas import SessionCreate, ToolAppend

BIG = list(range(1_000_000, 2_000_000))  # ~8 MB of JSON, 30 steps: pydantic's whole parse stays quick to compare
HUGE = list(range(1_000_000, 5_000_000))  # ~32 MB


def errors_of(parse: Callable[[], Any]) -> list[tuple[tuple[str, ...], str, str]]:
    with pytest.raises(ValidationError) as caught:
        parse()
    return sorted((tuple(map(str, e["loc"])), e["type"], e["msg"]) for e in caught.value.errors())


@pytest.fixture
def whole_body_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the bodies ``SessionCreate.model_validate_json`` is given (spied on, still run)."""
    sizes: list[int] = []
    original = SessionCreate.model_validate_json

    def spy(raw: bytes, **kwargs: Any) -> SessionCreate:
        sizes.append(len(raw))
        return original(raw, **kwargs)

    monkeypatch.setattr(SessionCreate, "model_validate_json", spy)
    return sizes


def with_tail(ids: list[int], tail: bytes, rest: bytes = b"}") -> bytes:
    """``{"prompt_ids": [ids..., tail]`` + ``rest``: the tail as raw JSON text."""
    return orjson.dumps({"prompt_ids": ids})[:-2] + b", " + tail + b"]" + rest


# ---- the big-body parser (unit) --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tail",
    [
        *(b"-1", b"2147483648", b"18446744073709551616", b"1.5", b"true", b"null", b'"7"', b"[1]", b"{}"),
        *(b"x", b"01", b"1 2", b"", b"5,"),  # not JSON: pydantic's json_invalid, at the same line and column
    ],
    ids=lambda tail: tail.decode() or "empty",
)
def test_one_bad_id_in_a_big_array_gets_pydantic_s_error_without_a_whole_body_parse(
    tail: bytes, whole_body_parses: list[int]
) -> None:
    raw = with_tail(BIG, tail)
    expected = errors_of(lambda: SessionCreate.__pydantic_validator__.validate_json(raw))  # pydantic's, unspied
    assert errors_of(lambda: validate_big_body(SessionCreate, raw, "prompt_ids")) == expected
    assert max(whole_body_parses, default=0) < STEP_BYTES  # the rest of the body at most, never the array


def test_every_bad_id_and_the_rest_s_errors_are_reported(whole_body_parses: list[int]) -> None:
    ids: list[Any] = list(BIG)
    ids[3], ids[400_000], ids[-1] = -3, 1.5, 2**31
    raw = orjson.dumps({"session_id": "bad id", "prompt_ids": ids, "unknown": 1})
    fast = errors_of(lambda: validate_big_body(SessionCreate, raw, "prompt_ids"))
    assert fast == errors_of(lambda: SessionCreate.__pydantic_validator__.validate_json(raw))
    assert sorted(loc for loc, _, _ in fast) == sorted(
        [
            ("prompt_ids", "3"),
            ("prompt_ids", "400000"),
            ("prompt_ids", str(len(BIG) - 1)),
            ("session_id",),
            ("unknown",),
        ]
    )
    assert max(whole_body_parses) < STEP_BYTES


def test_an_array_of_nothing_but_bad_ids_reports_the_first_ones() -> None:
    raw = orjson.dumps({"prompt_ids": [-1] * 1_000_000})
    errors = errors_of(lambda: validate_big_body(SessionCreate, raw, "prompt_ids"))
    assert len(errors) == MAX_ARRAY_ERRORS and {t for _, t, _ in errors} == {"greater_than_equal"}


def test_invalid_json_after_a_bad_array_is_placed_as_pydantic_places_it(whole_body_parses: list[int]) -> None:
    raw = with_tail(BIG, b"-1", rest=b"\n  garbage")
    expected = errors_of(lambda: SessionCreate.__pydantic_validator__.validate_json(raw))
    assert expected[0][1] == "json_invalid"
    assert errors_of(lambda: validate_big_body(SessionCreate, raw, "prompt_ids")) == expected
    assert max(whole_body_parses) < STEP_BYTES


def test_a_repeated_key_s_last_value_counts_as_in_pydantic(whole_body_parses: list[int]) -> None:
    raw = with_tail(BIG, b"-1", rest=b', "prompt_ids": [7, 8]}')
    assert validate_big_body(SessionCreate, raw, "prompt_ids").prompt_ids.tolist() == [7, 8]
    assert max(whole_body_parses) < STEP_BYTES


def test_a_big_bad_array_of_tool_tokens_is_refused_the_same_way() -> None:
    raw = orjson.dumps({"token_ids": [*BIG, -5], "text": "x"})
    errors = errors_of(lambda: validate_big_body(ToolAppend, raw, "token_ids"))
    assert errors == [
        (("token_ids", str(len(BIG))), "greater_than_equal", "Input should be greater than or equal to 0")
    ]


# ---- end to end ----------------------------------------------------------------------------------------------
@pytest.fixture
async def gw(gateway: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        yield client


async def test_a_30_mb_prompt_with_one_bad_id_is_a_422_naming_it(gw: httpx.AsyncClient) -> None:
    raw = with_tail(HUGE, b"-1")
    assert len(raw) > 30_000_000
    response = await gw.post("/v1/sessions", content=raw)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["errors"] == [f"prompt_ids.{len(HUGE)}: Input should be greater than or equal to 0"]
    assert (await gw.get("/health")).status_code == 200


@pytest.mark.parametrize("session_id", [".", ".."])
async def test_dot_segment_session_ids_are_refused(gw: httpx.AsyncClient, session_id: str) -> None:
    before = (await gw.get("/v1/sessions")).json()["count"]
    response = await gw.post("/v1/sessions", json={"prompt_ids": [1, 2], "session_id": session_id})
    assert response.status_code == 422, response.text
    assert "session_id" in response.json()["error"]["message"] and "dot segment" in response.json()["error"]["message"]
    samples = await gw.post("/v1/samples", json={"session_ids": [session_id]})
    assert samples.status_code == 422
    assert (await gw.get("/v1/sessions")).json()["count"] == before


async def test_dots_that_are_no_dot_segment_are_ordinary_ids(gw: httpx.AsyncClient) -> None:
    created = await gw.post("/v1/sessions", json={"prompt_ids": [1, 2], "session_id": "..."})
    assert created.status_code == 201, created.text
    assert (await gw.get("/v1/sessions/...")).json()["session_id"] == "..."
    assert (await gw.delete("/v1/sessions/...")).status_code == 204


async def test_an_unchanged_session_s_sample_is_the_same_bytes_on_every_fetch(gw: httpx.AsyncClient) -> None:
    created = await gw.post(
        "/v1/sessions",
        json={"prompt_ids": [1, 2, 3], "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK, "metadata": {"g": 1}},
    )
    sid = created.json()["session_id"]
    turn = {"sampling_params": {"max_new_tokens": 6, "custom_params": {"return_top_p_token_ids": True}}}
    assert (await gw.post(f"/v1/sessions/{sid}/generate", json=turn)).status_code == 200
    fetches = {(await gw.get(f"/v1/sessions/{sid}/sample")).content for _ in range(8)}
    assert len(fetches) == 1
    (blob,) = fetches
    tensors = load(blob)
    assert len(tensors["tokens"]) == 3 + 6 and tensors["rollout_routed_experts"].shape == (8, SIM_LAYERS, SIM_TOPK)
    header = orjson.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    assert list(header["__metadata__"])[:3] == ["session_id", "branch", "branches"]  # the gateway's own order
    group = load((await gw.post("/v1/samples", json={"session_ids": [sid]})).content)  # the same arrays
    assert all(np.array_equal(group[f"0/{name}"], values) for name, values in tensors.items())
    await gw.delete(f"/v1/sessions/{sid}")


async def test_a_moe_turn_with_max_new_tokens_0_is_an_answer(gw: httpx.AsyncClient) -> None:
    created = await gw.post(
        "/v1/sessions", json={"prompt_ids": [1, 2, 3], "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    )
    sid = created.json()["session_id"]
    first = await gw.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": {"max_new_tokens": 4}})
    assert first.status_code == 200, first.text
    # The session holds every routing row it has tokens for: the upstream has none to send for a turn of 0 tokens.
    for stream in (False, True):
        empty = await gw.post(
            f"/v1/sessions/{sid}/generate", json={"sampling_params": {"max_new_tokens": 0}, "stream": stream}
        )
        assert empty.status_code == 200, empty.text
    view = (await gw.get(f"/v1/sessions/{sid}")).json()
    assert view["total_tokens"] == first.json()["total_tokens"]
    assert view["replay"]["routed_experts_rows"] == view["total_tokens"] - 1
    await gw.delete(f"/v1/sessions/{sid}")
