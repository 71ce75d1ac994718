"""Streaming end to end: SSE passthrough, streamed session turns, and aborts that keep what was generated."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator
from safetensors.numpy import load as load_safetensors

from gateway.codec import CumulativeStreamDecoder, decode_generate_response
from slime_wire.sse import SSEDecoder

TOP_P = {"custom_params": {"return_top_p_token_ids": True}}
TOKEN_DELAY_MS = 4


@pytest.fixture(scope="module")
def paced() -> Iterator[tuple[Service, Service]]:
    """A simulator that takes TOKEN_DELAY_MS per token (so streams can be cut mid-way) and a gateway before it."""
    with run_simulator("--token-delay-ms", str(TOKEN_DELAY_MS)) as sim, run_gateway(sim.url) as gateway:
        yield sim, gateway


@pytest.fixture
async def gw(paced: tuple[Service, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=paced[1].url, timeout=30) as client:
        yield client


@pytest.fixture
async def sim(paced: tuple[Service, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=paced[0].url, timeout=30) as client:
        yield client
        await client.delete("/sim/faults")


async def create(gw: httpx.AsyncClient, prompt: list[int]) -> str:
    body = {"prompt_ids": prompt, "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 201
    return response.json()["session_id"]


def sse_payloads(raw: bytes) -> list[bytes]:
    return [event.data for event in SSEDecoder().feed(raw)]


async def stream_turn(gw: httpx.AsyncClient, sid: str, sampling: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"stream": True, "sampling_params": sampling}
    async with gw.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join([chunk async for chunk in response.aiter_bytes()])
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


async def sample_of(gw: httpx.AsyncClient, sid: str) -> dict[str, np.ndarray]:
    response = await gw.get(f"/v1/sessions/{sid}/sample")
    assert response.status_code == 200
    return load_safetensors(response.content)


async def check_invariants(gw: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    view = (await gw.get(f"/v1/sessions/{sid}")).json()
    arrays = await sample_of(gw, sid)
    n = view["response_length"]
    assert len(arrays["tokens"]) == view["prompt_length"] + n
    assert len(arrays["loss_mask"]) == len(arrays["rollout_log_probs"]) == n
    if "rollout_top_p_token_offsets" in arrays:
        offsets = arrays["rollout_top_p_token_offsets"]
        assert len(offsets) == n + 1
        assert offsets[-1] == len(arrays["rollout_top_p_token_ids"])
        assert (np.diff(offsets) >= 0).all()
    if "rollout_routed_experts" in arrays:
        assert arrays["rollout_routed_experts"].shape[0] <= len(arrays["tokens"]) - 1
    return view


async def wait_idle(gw: httpx.AsyncClient, sid: str, timeout_s: float = 10.0) -> dict[str, Any]:
    for _ in range(int(timeout_s / 0.05)):
        view = (await gw.get(f"/v1/sessions/{sid}")).json()
        if not view["busy"]:
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"session {sid} still busy after {timeout_s}s")


# ---- passthrough --------------------------------------------------------------------------------------------------
async def test_stream_passthrough_is_byte_equal(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    body = {
        "input_ids": [3, 1, 4, 1, 5],
        "stream": True,
        "return_logprob": True,
        "return_routed_experts": True,
        "rid": "stream-rid",
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 7, **TOP_P},
    }

    async def collect(client: httpx.AsyncClient) -> list[bytes]:
        await client.post("/flush_cache")  # same prefix-cache state for both calls
        async with client.stream("POST", "/generate", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            return sse_payloads(b"".join([c async for c in response.aiter_raw()]))

    via_gateway, direct = await collect(gw), await collect(sim)
    assert len(via_gateway) == len(direct) > 3
    assert via_gateway[1:-2] == direct[1:-2]  # the chunks between the first and the final one, byte for byte
    assert via_gateway[-1] == direct[-1] == b"[DONE]"
    for index in (0, -2):  # the first chunk is stamped with a send time, the final one with the latency
        chunk_gateway, chunk_direct = orjson.loads(via_gateway[index]), orjson.loads(direct[index])
        for chunk in (chunk_gateway, chunk_direct):
            chunk["meta_info"].pop("response_sent_to_client_ts", None)
            chunk["meta_info"].pop("e2e_latency", None)
        assert chunk_gateway == chunk_direct


async def test_stream_passthrough_delivers_in_band_errors(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    await sim.post("/sim/faults", json={"mode": "stream_error"})
    body = {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 30}}
    async with gw.stream("POST", "/generate", json=body) as response:
        payloads = sse_payloads(b"".join([c async for c in response.aiter_raw()]))
    assert response.status_code == 200
    assert b'"error"' in payloads[-2]
    assert payloads[-1] == b"[DONE]"


# ---- streamed session turns ---------------------------------------------------------------------------------------
async def test_streamed_turn_events_and_final_state(gw: httpx.AsyncClient) -> None:
    sid = await create(gw, [7, 8, 9])
    events = await stream_turn(gw, sid, {"max_new_tokens": 20, "sampling_seed": 1, **TOP_P})
    deltas = [e for e in events if e["type"] == "delta"]
    final = events[-1]
    assert final["type"] == "turn"
    assert len(deltas) >= 2  # tokens arrived as they were generated, not in one lump
    assert [t for d in deltas for t in d["token_ids"]] == final["new_token_ids"]
    assert "".join(d["text"] for d in deltas) == final["text"]
    assert deltas[-1]["completion_tokens"] == final["completion_tokens"]
    view = await check_invariants(gw, sid)
    assert view["status"] == final["status"]
    assert view["replay"]["routed_experts_rows"] == 3 + final["completion_tokens"] - 1


async def test_streamed_and_unary_turns_fold_to_the_same_state(gw: httpx.AsyncClient) -> None:
    rng = random.Random(1234)
    prompt = [rng.randrange(1, 900) for _ in range(5)]
    streamed, unary = await create(gw, prompt), await create(gw, prompt)
    for step in range(10):
        if step and rng.random() < 0.3:
            tool = {"token_ids": [rng.randrange(1, 900) for _ in range(rng.randrange(1, 6))], "text": f" t{step}"}
            for sid in (streamed, unary):
                assert (await gw.post(f"/v1/sessions/{sid}/append", json=tool)).status_code == 200
            continue
        sampling = {"max_new_tokens": rng.randrange(1, 25), "sampling_seed": step, **TOP_P}
        events = await stream_turn(gw, streamed, sampling)
        assert events[-1]["type"] == "turn"
        answer = await gw.post(f"/v1/sessions/{unary}/generate", json={"sampling_params": sampling})
        assert answer.status_code == 200
        assert events[-1]["new_token_ids"] == answer.json()["new_token_ids"]
    a, b = await sample_of(gw, streamed), await sample_of(gw, unary)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    view_a, view_b = (await gw.get(f"/v1/sessions/{streamed}")).json(), (await gw.get(f"/v1/sessions/{unary}")).json()
    for key in ("status", "response", "response_length", "weight_versions", "arrays"):
        assert view_a[key] == view_b[key], key


async def test_stream_preflight_errors_are_plain_http_errors(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    assert (await gw.post("/v1/sessions/missing/generate", json={"stream": True})).status_code == 404
    sid = await create(gw, [1, 2, 3])
    await sim.post("/sim/faults", json={"mode": "http_503"})
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={"stream": True})
    assert response.status_code == 503
    view = await wait_idle(gw, sid)
    assert view["turns"] == 0 and view["total_tokens"] == 3


async def test_invalid_final_chunk_changes_nothing(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    sid = await create(gw, [1, 2, 3])
    before = (await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    await sim.post("/sim/faults", json={"mode": "bad_base64"})
    events = await stream_turn(gw, sid, {"max_new_tokens": 8})
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "upstream_protocol_error"
    after = (await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    before.pop("updated_at"), after.pop("updated_at")
    assert after == before


# ---- aborts ---------------------------------------------------------------------------------------------------------
async def read_some_deltas(response: httpx.Response, count: int) -> int:
    """Read until `count` delta events arrived; returns how many tokens they carried."""
    events, seen, tokens = SSEDecoder(), 0, 0
    async for chunk in response.aiter_raw():
        for sse in events.feed(chunk):
            event = orjson.loads(sse.data)
            if event["type"] == "delta":
                seen += 1
                tokens += len(event["token_ids"])
        if seen >= count:
            return tokens
    raise AssertionError("stream ended before enough deltas arrived")


async def assert_upstream_idle(sim: httpx.AsyncClient) -> None:
    for _ in range(100):
        if (await sim.get("/sim/stats")).json()["running"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the upstream still runs the aborted request")


@pytest.mark.parametrize("how", ["client_cut", "explicit_abort", "upstream_death"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_abort_keeps_every_token_received(
    gw: httpx.AsyncClient, sim: httpx.AsyncClient, how: str, seed: int
) -> None:
    rng = random.Random(seed)
    sid = await create(gw, [rng.randrange(1, 900) for _ in range(4)])
    await stream_turn(gw, sid, {"max_new_tokens": 6, "sampling_seed": seed, **TOP_P})
    await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [11, 12]})
    before = (await gw.get(f"/v1/sessions/{sid}")).json()
    if how == "upstream_death":
        await sim.post("/sim/faults", json={"mode": "cut_stream"})
    body = {"stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": seed}}
    received = 0
    async with gw.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        if how == "upstream_death":
            events = sse_payloads(b"".join([c async for c in response.aiter_raw()]))
            final = orjson.loads(events[-2])
            assert final["type"] == "error"
            received = final["turn"]["completion_tokens"]
        else:
            received = await read_some_deltas(response, rng.randrange(2, 12))
            if how == "explicit_abort":
                aborted = (await gw.post(f"/v1/sessions/{sid}/abort")).json()
                assert aborted["aborted"] is True and aborted["finished"] is True
    # (client_cut: leaving the `async with` closed the connection mid-stream)
    view = await wait_idle(gw, sid)
    await check_invariants(gw, sid)
    assert view["status"] == "aborted"
    assert view["turns"] == before["turns"] + 1
    added = view["response_length"] - before["response_length"]
    assert received <= added < 400  # every token we saw is kept; the upstream stopped early
    await assert_upstream_idle(sim)
    # The next turn continues from the partial state.
    events = await stream_turn(gw, sid, {"max_new_tokens": 5, "sampling_seed": seed})
    assert events[-1]["type"] == "turn"
    assert events[-1]["prompt_length"] == view["total_tokens"]
    await check_invariants(gw, sid)
    arrays = await sample_of(gw, sid)
    assert arrays["rollout_routed_experts"].shape[0] == len(arrays["tokens"]) - 1  # the gap is re-covered


async def test_abort_without_a_running_turn(gw: httpx.AsyncClient) -> None:
    sid = await create(gw, [1, 2])
    answer = (await gw.post(f"/v1/sessions/{sid}/abort")).json()
    assert answer["aborted"] is False
    assert (await gw.post("/v1/sessions/missing/abort")).status_code == 404


# ---- the decoder's cost per chunk -----------------------------------------------------------------------------------
def cumulative_chunks(n: int, chunk_tokens: int = 8) -> list[bytes]:
    """SGLang-style cumulative chunks of an n-token answer, serialized like SGLang (orjson)."""
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 50_000, n).tolist()
    lps = (-rng.random(n)).tolist()
    chunks = []
    for m in [*range(chunk_tokens, n, chunk_tokens), n]:
        final = m == n
        meta = {
            "id": "r",
            "finish_reason": {"type": "length", "length": n} if final else None,
            "prompt_tokens": 3,
            "completion_tokens": m,
            "output_token_logprobs": [[lps[i], ids[i], None] for i in range(m)],
        }
        text = "".join(f' w{i} "q"\\' for i in ids[:m])
        chunks.append(orjson.dumps({"text": text, "output_ids": ids[:m], "meta_info": meta}))
    return chunks


@pytest.mark.parametrize("n", [1_000, 4_000, 16_000])
def test_per_chunk_work_is_flat(n: int) -> None:
    decoder = CumulativeStreamDecoder()
    chunks = cumulative_chunks(n)
    tokens, text = [], []
    for chunk in chunks[:-1]:
        delta, answer = decoder.feed(chunk)
        assert answer is None  # a non-final chunk is never parsed in full
        tokens += delta.token_ids.tolist()
        text.append(delta.text)
    reference = orjson.loads(chunks[-2])
    assert tokens == reference["output_ids"]
    assert "".join(text) == reference["text"]
    # Python-level work: each token parsed once over the whole stream (not once per chunk: O(n), not O(n^2)),
    # and none in full.
    assert decoder.items_parsed == len(tokens) and decoder.full_parses == 0
    # The final chunk is told apart cheaply and decoded like a unary answer; its delta is what the others lacked.
    assert decoder.is_final(chunks[-1]) and not decoder.is_final(chunks[-2])
    delta = decoder.final_delta(decode_generate_response(chunks[-1], want_routing=False, want_top_p=False))
    assert tokens + delta.token_ids.tolist() == orjson.loads(chunks[-1])["output_ids"]
    assert decoder.num_tokens == n


async def test_cut_first_turn_keeps_top_p_replay_on(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    """A first turn cut before its final chunk still leaves top-p replay on (empty spans for its tokens)."""
    sid = await create(gw, [4, 5, 6])
    await sim.post("/sim/faults", json={"mode": "cut_stream"})
    body = {"stream": True, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True, **TOP_P}}
    async with gw.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        events = sse_payloads(b"".join([c async for c in response.aiter_raw()]))
    assert orjson.loads(events[-2])["type"] == "error"
    view = await wait_idle(gw, sid)
    assert view["status"] == "aborted" and view["response_length"] > 0
    assert view["replay"]["top_p"] is True
    events = await stream_turn(gw, sid, {"max_new_tokens": 5, **TOP_P})
    assert events[-1]["type"] == "turn"
    await check_invariants(gw, sid)
