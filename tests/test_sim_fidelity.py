"""Simulator fidelity: the simulator answers in the same formats as recorded real SGLang answers.

The recordings in tests/fixtures/sglang/*.json come from `scripts/record_fixtures.py` (SGLang 0.5.23 on CPU, a tiny
random Qwen3-MoE: 2 layers, 8 experts, top-2, 512-token vocabulary). Each test sends the recorded request to an
in-process simulator of the same MoE shape and checks both answers the same way: key sets, value types,
encodings (base64 int32 routing with the right element count), log-prob items, finish reasons and SSE framing.
Values (tokens, log-probs) differ by design. Known deviations would be strict xfails naming the difference (none left).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pybase64
import pytest

from sglang_sim.app import create_app
from sglang_sim.engine import SimulatorConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang"
NON_STREAMED = ("plain", "stop", "routed_experts", "start_len", "aborted")
WITH_ROUTING = ("routed_experts", "start_len", "aborted")
# meta_info keys the gateway's codec and fold read (gateway/codec/), on every final answer.
GATEWAY_META_KEYS = frozenset(
    {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}
)
# Keys whose value is null or an object depending on state (a prefix-cache hit or not), not on the format.
STATE_DEPENDENT_TYPES = frozenset({"cached_tokens_details"})
# Keys only the simulator has: the top-p replay arrays of slime's SGLang patch (the stock engine lacks them).
SIMULATOR_ONLY_KEYS = frozenset({"top_p_token_ids", "top_p_token_offsets"})
FINISH_KEYS = {
    "length": {"type", "length"},
    "stop": {"type", "matched"},
    "abort": {"type", "message", "status_code", "err_type"},
}
BASE64 = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
DONE = "data: [DONE]"
ABORT_AFTER_S = 0.15


@cache
def recorded(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@cache
def engine_shape() -> dict[str, int]:
    engine = recorded("plain")["engine"]
    return {key: int(engine[key]) for key in ("num_layers", "topk", "num_experts", "vocab_size")}


def simulator_app(token_delay_ms: float = 0.0) -> Any:
    return create_app(SimulatorConfig(**engine_shape(), token_delay_ms=token_delay_ms))


@dataclass(frozen=True)
class Simulators:
    """In-process simulators with the recorded model's MoE shape and vocabulary."""

    fast: httpx.AsyncClient
    paced: httpx.AsyncClient  # 50 tokens/s, so a request can be aborted mid-generation

    def for_recording(self, name: str) -> httpx.AsyncClient:
        return self.paced if name == "aborted" else self.fast


@pytest.fixture
async def sim() -> AsyncIterator[Simulators]:
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim", timeout=30)
            )
            for app in (simulator_app(), simulator_app(token_delay_ms=20))
        ]
        yield Simulators(*clients)


# ---- helpers: answers of both sides in one shape -----------------------------------------------------------------
async def sim_answer(sims: Simulators, name: str) -> dict[str, Any]:
    """The simulator's answer to a recording's request, in the recording's format."""
    request = recorded(name)["request"]
    client = sims.for_recording(name)
    if name == "aborted":
        response = await aborted_answer(client, request)
    else:
        if name == "stop":  # stop on the simulator's own second greedy token, as the recorder did on the engine
            request = await with_own_stop_token(client, request)
        response = await client.post("/generate", json=request)
    answer: dict[str, Any] = {"status": response.status_code, "content_type": response.headers["content-type"]}
    if answer["content_type"].startswith("text/event-stream"):
        answer["sse"] = response.text
    else:
        answer["json"] = response.json()
    return answer


async def with_own_stop_token(client: httpx.AsyncClient, request: dict[str, Any]) -> dict[str, Any]:
    params = {k: v for k, v in request["sampling_params"].items() if k != "stop_token_ids"}
    greedy = (
        await client.post("/generate", json={"input_ids": request["input_ids"], "sampling_params": params})
    ).json()
    return request | {"sampling_params": params | {"stop_token_ids": [greedy["output_ids"][1]]}}


async def aborted_answer(client: httpx.AsyncClient, request: dict[str, Any]) -> httpx.Response:
    pending = asyncio.create_task(client.post("/generate", json=request))
    await asyncio.sleep(ABORT_AFTER_S)
    (await client.post("/abort_request", json={"rid": request["rid"]})).raise_for_status()
    return await pending


async def both(sim: Simulators, name: str) -> list[tuple[str, dict[str, Any]]]:
    """[("engine", recorded answer), ("simulator", its answer to the same request)]."""
    return [("engine", recorded(name)), ("simulator", await sim_answer(sim, name))]


def type_name(value: Any) -> str:
    return "float" if isinstance(value, float) else type(value).__name__


def types_of(meta: dict[str, Any]) -> dict[str, str]:
    return {key: type_name(value) for key, value in meta.items() if key not in STATE_DEPENDENT_TYPES}


def sse_events(text: str) -> list[str]:
    """The payloads of an SSE body, checking the framing: `data: <payload>` events, each ended by a blank line."""
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, f"not a one-line data event: {event[:80]!r}"
    return [event.removeprefix("data: ") for event in events]


def stream_chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    assert answer["status"] == 200
    assert answer["content_type"].startswith("text/event-stream")
    payloads = sse_events(answer["sse"])
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(payload) for payload in payloads[:-1]]


def routing_elements(meta: dict[str, Any]) -> np.ndarray:
    encoded = meta["routed_experts"]
    assert isinstance(encoded, str) and BASE64.match(encoded), "standard base64 (+/ and = padding)"
    raw = pybase64.b64decode(encoded, validate=True)
    assert len(raw) % 4 == 0, "whole little-endian int32 values"
    return np.frombuffer(raw, dtype="<i4")


# ---- the recordings themselves -----------------------------------------------------------------------------------
def test_recordings_are_small_and_complete() -> None:
    names = {path.stem for path in FIXTURES.glob("*.json")}
    assert {*NON_STREAMED, "stream", "error_400", "stream_error_400"} <= names
    for path in FIXTURES.glob("*.json"):
        assert path.stat().st_size < 16 * 1024, f"{path.name} is not commit-sized"
        fixture = json.loads(path.read_text())
        assert {"request", "status", "content_type", "engine"} <= set(fixture)
        assert ("json" in fixture) != ("sse" in fixture)


# ---- non-streamed answers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NON_STREAMED)
async def test_answer_keys_and_types(sim: Simulators, name: str) -> None:
    (_, real), (_, simulated) = await both(sim, name)
    assert simulated["status"] == real["status"] == 200
    assert simulated["content_type"] == real["content_type"] == "application/json"
    real_body, sim_body = real["json"], simulated["json"]
    assert set(sim_body) == set(real_body) == {"text", "output_ids", "meta_info"}
    real_meta, sim_meta = real_body["meta_info"], sim_body["meta_info"]
    wanted = GATEWAY_META_KEYS | ({"routed_experts"} if name in WITH_ROUTING else set())
    assert wanted <= set(real_meta) and wanted <= set(sim_meta)
    assert "output_token_logprobs" in real_meta and "output_token_logprobs" in sim_meta
    real_types, sim_types = types_of(real_meta), types_of(sim_meta)
    common = set(real_types) & set(sim_types)
    assert {k: sim_types[k] for k in common} == {k: real_types[k] for k in common}


@pytest.mark.parametrize("name", NON_STREAMED)
async def test_simulator_adds_no_unknown_meta_keys(sim: Simulators, name: str) -> None:
    (_, real), (_, simulated) = await both(sim, name)
    extra = set(simulated["json"]["meta_info"]) - set(real["json"]["meta_info"]) - SIMULATOR_ONLY_KEYS
    assert not extra, f"meta_info keys the real engine does not send: {sorted(extra)}"


@pytest.mark.parametrize("name", NON_STREAMED)
async def test_simulator_has_every_engine_meta_key(sim: Simulators, name: str) -> None:
    (_, real), (_, simulated) = await both(sim, name)
    missing = set(real["json"]["meta_info"]) - set(simulated["json"]["meta_info"])
    assert not missing, f"meta_info keys the simulator lacks: {sorted(missing)}"


@pytest.mark.parametrize("name", NON_STREAMED)
async def test_output_token_logprobs_items(sim: Simulators, name: str) -> None:
    for side, answer in await both(sim, name):
        body = answer["json"]
        meta = body["meta_info"]
        items = meta["output_token_logprobs"]
        for item in items:
            assert isinstance(item, list) and len(item) == 3, (side, item)
            logprob, token_id, text = item
            assert isinstance(logprob, float) and logprob <= 0, (side, item)
            assert type(token_id) is int and 0 <= token_id < engine_shape()["vocab_size"], (side, item)
            assert text is None or isinstance(text, str), (side, item)
        assert [item[1] for item in items] == body["output_ids"], side
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == len(items), side
        assert meta["input_token_logprobs"] == [], side


@pytest.mark.parametrize("name", WITH_ROUTING)
async def test_routed_experts_encoding_and_row_count(sim: Simulators, name: str) -> None:
    shape = engine_shape()
    start_len = recorded(name)["request"].get("routed_experts_start_len", 0)
    for side, answer in await both(sim, name):
        meta = answer["json"]["meta_info"]
        experts = routing_elements(meta)
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start_len
        assert experts.size == rows * shape["num_layers"] * shape["topk"], side
        assert experts.min() >= 0 and experts.max() < shape["num_experts"], side
        assert "routed_experts_start_len" not in meta, f"{side}: start_len is not echoed back"


@pytest.mark.parametrize(("name", "finish_type"), [("plain", "length"), ("stop", "stop"), ("aborted", "abort")])
async def test_finish_reason_shapes(sim: Simulators, name: str, finish_type: str) -> None:
    for side, answer in await both(sim, name):
        body = answer["json"]
        finish = body["meta_info"]["finish_reason"]
        assert finish["type"] == finish_type, side
        assert set(finish) == FINISH_KEYS[finish_type], side
        if finish_type == "length":
            assert (
                finish["length"] == len(body["output_ids"]) == answer_request(name)["sampling_params"]["max_new_tokens"]
            )
        if finish_type == "stop":
            assert type(finish["matched"]) is int and finish["matched"] == body["output_ids"][-1], side
        if finish_type == "abort":
            assert isinstance(finish["message"], str) and finish["status_code"] is None, side
            assert 0 < len(body["output_ids"]) < answer_request(name)["sampling_params"]["max_new_tokens"], side


def answer_request(name: str) -> dict[str, Any]:
    return recorded(name)["request"]


async def test_stop_token_text_is_trimmed(sim: Simulators) -> None:
    real = recorded("stop")["json"]
    assert real["text"] == " w21" and real["output_ids"] == [21, 77]  # the recording shows the trim
    simulated = (await sim_answer(sim, "stop"))["json"]
    words = [f" w{token}" for token in simulated["output_ids"]]
    assert simulated["text"] == "".join(words[:-1])


# ---- streaming ---------------------------------------------------------------------------------------------------
async def test_stream_framing_is_cumulative(sim: Simulators) -> None:
    shape = engine_shape()
    for side, answer in await both(sim, "stream"):
        chunks = stream_chunks(answer)
        assert len(chunks) >= 2, side
        for before, after in pairwise(chunks):
            assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"], side
            assert after["text"].startswith(before["text"]), side
            logprobs = before["meta_info"]["output_token_logprobs"]
            assert after["meta_info"]["output_token_logprobs"][: len(logprobs)] == logprobs, side
        *running, final = chunks
        for chunk in running:
            meta = chunk["meta_info"]
            assert meta["finish_reason"] is None, side
            assert not {"routed_experts", "e2e_latency", "weight_versions"} & set(meta), side
            assert meta["completion_tokens"] == len(chunk["output_ids"]), side
        meta = final["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": len(final["output_ids"])}, side
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        assert routing_elements(meta).size == rows * shape["num_layers"] * shape["topk"], side
        assert isinstance(meta["e2e_latency"], float), side


async def test_stream_chunk_keys_match(sim: Simulators) -> None:
    (_, real), (_, simulated) = await both(sim, "stream")
    real_chunks, sim_chunks = stream_chunks(real), stream_chunks(simulated)
    timestamp = {"response_sent_to_client_ts"}  # see test_simulator_has_every_engine_meta_key
    assert set(sim_chunks[-1]["meta_info"]) == set(real_chunks[-1]["meta_info"]) - timestamp
    assert set(sim_chunks[1]["meta_info"]) == set(real_chunks[1]["meta_info"]) - timestamp
    assert types_of(sim_chunks[-1]["meta_info"]) == types_of(real_chunks[-1]["meta_info"])


# ---- errors ------------------------------------------------------------------------------------------------------
async def test_http_400_error_body(sim: Simulators) -> None:
    for side, answer in await both(sim, "error_400"):
        assert answer["status"] == 400, side
        assert answer["content_type"] == "application/json", side
        assert set(answer["json"]) == {"error"} and set(answer["json"]["error"]) == {"message"}, side
        assert isinstance(answer["json"]["error"]["message"], str), side


async def test_stream_error_is_in_band(sim: Simulators) -> None:
    for side, answer in await both(sim, "stream_error_400"):
        (event,) = stream_chunks(answer)
        error = event["error"]
        assert set(event) == {"error"}, side
        assert isinstance(error["message"], str) and error["code"] == 400, side


async def test_stream_error_keys_match(sim: Simulators) -> None:
    (_, real), (_, simulated) = await both(sim, "stream_error_400")
    assert set(stream_chunks(simulated)[0]["error"]) == set(stream_chunks(real)[0]["error"])


async def test_aborted_answer_keeps_partial_tokens_and_routing(sim: Simulators) -> None:
    shape = engine_shape()
    for side, answer in await both(sim, "aborted"):
        meta = answer["json"]["meta_info"]
        assert answer["status"] == 200 and meta["finish_reason"]["type"] == "abort", side
        assert meta["completion_tokens"] == len(answer["json"]["output_ids"]) > 0, side
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        assert routing_elements(meta).size == rows * shape["num_layers"] * shape["topk"], side
