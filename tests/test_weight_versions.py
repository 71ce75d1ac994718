"""Per-token weight versions end to end: a weight update landing mid-turn in the simulator, through the real gateway,
into ``/sample`` (``rollout_weight_version_ids`` + ``weight_version_table``) and the SDK's ``RolloutSample``.

Runs its own simulator and gateway: the weight updates here would change the version other tests' answers carry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator
from safetensors.numpy import load as load_safetensors

from gateway.codec import CumulativeStreamDecoder, VersionSpan
from gateway.errors import UpstreamProtocolError
from slime_client.sample import RolloutSample, read_safetensors_metadata
from slime_wire.sse import SSEDecoder

PROMPT = [5, 6, 7, 8]
START = "sim-v0"  # the simulator's version until an update


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[Service, Service]]:
    with run_simulator() as sim, run_gateway(sim.url, "--log-level", "warning") as gateway:
        yield sim, gateway


@pytest.fixture
async def sim(services: tuple[Service, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=services[0].url, timeout=30) as client:
        (await client.post("/sim/reset")).raise_for_status()  # back to START, no fault or update pending
        yield client


@pytest.fixture
async def gw(services: tuple[Service, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=services[1].url, timeout=30) as client:
        yield client


async def new_session(gw: httpx.AsyncClient) -> str:
    body = {"prompt_ids": PROMPT, "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


def sampling(n: int) -> dict[str, Any]:
    """Exactly ``n`` generated tokens."""
    return {"max_new_tokens": n, "ignore_eos": True}


async def unary_turn(gw: httpx.AsyncClient, sid: str, n: int) -> dict[str, Any]:
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": sampling(n)})
    assert response.status_code == 200, response.text
    return response.json()


async def streamed_turn(gw: httpx.AsyncClient, sid: str, n: int) -> list[dict[str, Any]]:
    body = {"stream": True, "sampling_params": sampling(n)}
    async with gw.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        assert response.status_code == 200
        raw = b"".join([chunk async for chunk in response.aiter_bytes()])
    payloads = [event.data for event in SSEDecoder().feed(raw)]
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


async def update_weights(sim: httpx.AsyncClient, version: str, after_tokens: int | None = None) -> None:
    update: dict[str, Any] = {"weight_version": version}
    if after_tokens is not None:
        update["after_tokens"] = after_tokens
    (await sim.post("/sim/weight_version", json=update)).raise_for_status()


async def sample_bytes(gw: httpx.AsyncClient, sid: str) -> bytes:
    response = await gw.get(f"/v1/sessions/{sid}/sample")
    assert response.status_code == 200, response.text
    return response.content


async def sample_state(gw: httpx.AsyncClient, sid: str) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """The sample's tensors and metadata (its bytes vary: safetensors writes the metadata in hash order)."""
    blob = await sample_bytes(gw, sid)
    return {name: a.tolist() for name, a in load_safetensors(blob).items()}, read_safetensors_metadata(blob)


async def full_view(gw: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    view = (await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    view.pop("updated_at")
    return view


async def check_sample(gw: httpx.AsyncClient, sid: str, ids: list[int], table: list[str]) -> RolloutSample:
    """``/sample`` carries ``ids`` and ``table``; the SDK reads the same, alone and in a group."""
    blob = await sample_bytes(gw, sid)
    arrays, meta = load_safetensors(blob), read_safetensors_metadata(blob)
    assert arrays["rollout_weight_version_ids"].dtype == np.int32
    assert arrays["rollout_weight_version_ids"].tolist() == ids
    assert orjson.loads(meta["weight_version_table"]) == table
    sample = RolloutSample.from_safetensors(blob)
    sample.check_invariants()
    assert sample.rollout_weight_version_ids is not None and sample.rollout_weight_version_ids.dtype == torch.int32
    assert (sample.rollout_weight_version_ids.tolist(), sample.weight_version_table) == (ids, table)
    assert sample.token_weight_versions() == [None if i < 0 else table[i] for i in ids]
    group = await gw.post("/v1/samples", json={"session_ids": [sid, sid]})
    for member in RolloutSample.group_from_safetensors(group.content):
        assert member.rollout_weight_version_ids is not None
        assert (member.rollout_weight_version_ids.tolist(), member.weight_version_table) == (ids, table)
    return sample


# ---- a unary turn and a streamed turn crossing a weight update -----------------------------------------------------
async def test_unary_turn_crossing_a_weight_update(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    sid = await new_session(gw)
    first = await unary_turn(gw, sid, 4)
    await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [900, 901]})
    await update_weights(sim, "v2", after_tokens=3)
    second = await unary_turn(gw, sid, 8)
    assert (first["weight_version"], second["weight_version"]) == (START, "v2")
    sample = await check_sample(gw, sid, [0] * 4 + [-1, -1] + [0] * 3 + [1] * 5, [START, "v2"])
    assert sample.weight_versions == [START, "v2"]  # slime's per-turn list, unchanged

    view = await full_view(gw, sid)
    assert view["weight_version_table"] == [START, "v2"]
    assert view["weight_versions"] == [START, "v2"]
    assert [turn["weight_version_spans"] for turn in view["turn_log"]] == [
        [{"version": START, "start": 0, "end": 4}],
        None,
        [{"version": START, "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 8}],
    ]
    assert view["arrays"]["rollout_weight_version_ids"] == {"shape": [14], "dtype": "int32"}
    assert view["full"]["rollout_weight_version_ids"] == sample.rollout_weight_version_ids.tolist()  # type: ignore[union-attr]

    # to_slime writes slime's own fields only: slime's Sample has no per-token version field.
    written = vars(sample.to_slime(SimpleNamespace()))
    assert written["weight_versions"] == [START, "v2"]
    assert not {"rollout_weight_version_ids", "weight_version_table"} & written.keys()


async def test_streamed_turn_crossing_a_weight_update(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    sid = await new_session(gw)
    await update_weights(sim, "v2")  # an update between turns: the table grows in first-seen order
    events = await streamed_turn(gw, sid, 3)
    assert events[-1]["type"] == "turn"
    await update_weights(sim, "v3", after_tokens=2)
    events = await streamed_turn(gw, sid, 6)
    assert events[-1]["type"] == "turn" and events[-1]["weight_version"] == "v3"
    await check_sample(gw, sid, [0] * 3 + [0] * 2 + [1] * 4, ["v2", "v3"])
    # A unary turn over the same state would have given the same: the stream folds its final chunk.
    view = await full_view(gw, sid)
    assert view["turn_log"][-1]["weight_version_spans"] == [
        {"version": "v2", "start": 0, "end": 2},
        {"version": "v3", "start": 2, "end": 6},
    ]


async def test_partial_streamed_turn_takes_each_chunks_version(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    """An upstream dying mid-stream sends no final chunk: its tokens get the version of the chunk they came in."""
    sid = await new_session(gw)
    await unary_turn(gw, sid, 2)
    await update_weights(sim, "v2", after_tokens=1)
    (await sim.post("/sim/faults", json={"mode": "cut_stream"})).raise_for_status()  # two chunks, then a cut
    events = await streamed_turn(gw, sid, 8)
    assert events[-1]["type"] == "error" and events[-1]["turn"]["completion_tokens"] == 2
    sample = await check_sample(gw, sid, [0, 0, 0, 1], [START, "v2"])
    assert sample.status == "aborted"
    assert sample.weight_versions == [START]  # no final weight_version: slime's list gets no entry, as before
    view = await full_view(gw, sid)
    assert view["turn_log"][-1]["weight_version_spans"] == [
        {"version": START, "start": 0, "end": 1},
        {"version": "v2", "start": 1, "end": 2},
    ]


# ---- a refused answer changes nothing ------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_refused_weight_versions_leave_the_session_unchanged(
    gw: httpx.AsyncClient, sim: httpx.AsyncClient, stream: bool
) -> None:
    sid = await new_session(gw)
    await update_weights(sim, "v2", after_tokens=2)
    await unary_turn(gw, sid, 4)
    before, before_sample = await full_view(gw, sid), await sample_state(gw, sid)
    (await sim.post("/sim/faults", json={"mode": "bad_weight_versions"})).raise_for_status()
    body = {"stream": stream, "sampling_params": sampling(5)}
    if stream:
        events = await streamed_turn(gw, sid, 5)
        error = events[-1]["error"]
        assert events[-1]["turn"] is None
    else:
        response = await gw.post(f"/v1/sessions/{sid}/generate", json=body)
        assert response.status_code == 502
        error = response.json()["error"]
    assert error["type"] == "upstream_protocol_error"
    assert "weight_versions" in error["message"] and "past the answer's 5 generated tokens" in error["message"]
    assert await full_view(gw, sid) == before
    assert await sample_state(gw, sid) == before_sample
    await unary_turn(gw, sid, 2)  # the session keeps working
    await check_sample(gw, sid, [0, 0, 1, 1, 1, 1], [START, "v2"])


# ---- the stream decoder's chunk versions (no processes) ------------------------------------------------------------
def chunk(m: int, version: Any, *, key_order: str = "sglang") -> bytes:
    """A cumulative SGLang chunk after ``m`` tokens whose ``weight_version`` is ``version`` (absent: ``...``)."""
    meta: dict[str, Any] = {"id": "r", "finish_reason": None, "prompt_tokens": 3}
    if version is not ...:
        meta["weight_version"] = version
    meta["output_token_logprobs"] = [[-0.5, 10 + i, None] for i in range(m)]
    if key_order == "logprobs_first":  # the key after the list: found as well
        meta = {"output_token_logprobs": meta.pop("output_token_logprobs"), **meta}
    return orjson.dumps({"text": "x" * m, "output_ids": list(range(m)), "meta_info": meta})


@pytest.mark.parametrize("key_order", ["sglang", "logprobs_first"])
def test_decoder_remembers_each_chunks_version(key_order: str) -> None:
    decoder = CumulativeStreamDecoder()
    versions = ["a", "a", 'b"\\q', 7, "a", ...]  # an escaped string, a number (decimal form), a chunk without one
    for m, version in enumerate(versions, start=1):
        delta, answer = decoder.feed(chunk(m, version, key_order=key_order))
        assert answer is None  # the fast path: only the value's bytes were parsed
        assert delta.weight_version == (None if version is ... else str(version))
    assert decoder.partial_version_spans(6) == (
        VersionSpan("a", 0, 2),
        VersionSpan('b"\\q', 2, 3),
        VersionSpan("7", 3, 4),
        VersionSpan("a", 4, 5),
        VersionSpan(None, 5, 6),
    )
    assert decoder.partial_version_spans(3) == (VersionSpan("a", 0, 2), VersionSpan('b"\\q', 2, 3))
    assert decoder.partial_version_spans(0) == ()


def test_decoder_stops_looking_once_chunks_have_no_version() -> None:
    """SGLang sends its version on every chunk or on none: after a chunk without one the decoder no longer scans
    the (growing) chunks for it, and their tokens are of an unknown version."""
    decoder = CumulativeStreamDecoder()
    for m, version in enumerate([..., "a"], start=1):
        assert decoder.feed(chunk(m, version))[0].weight_version is None
    assert decoder.partial_version_spans(2) == (VersionSpan(None, 0, 2),)


def test_decoder_refuses_a_bad_chunk_version() -> None:
    decoder = CumulativeStreamDecoder()
    decoder.feed(chunk(1, "a"))
    with pytest.raises(UpstreamProtocolError, match="weight_version"):
        decoder.feed(chunk(2, {"v": 1}))  # the fast path gives up; the full parse says why
