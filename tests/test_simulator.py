"""The SGLang-protocol simulator, run as a real process on 127.0.0.1 (docs/protocol.md sections 1-4)."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64
import pytest
from procs import free_port, start_process

from sglang_sim import SimulatorConfig, create_app

L, K, E, V = 4, 2, 8, 1000  # the shape every simulator process here runs with
EOS = V - 1
TOKEN_DELAY_MS = 20  # the paced simulator: an N-token answer takes N * 20 ms


@contextmanager
def _run(*extra: str) -> Iterator[str]:
    port = free_port()
    args = [sys.executable, "-m", "sglang_sim", "--port", str(port), "--seed", "0"]
    args += ["--num-layers", str(L), "--topk", str(K), "--num-experts", str(E), "--vocab-size", str(V), *extra]
    with start_process(args, port) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with _run() as url:
        yield url


@pytest.fixture(scope="module")
def paced_url() -> Iterator[str]:
    with _run("--token-delay-ms", str(TOKEN_DELAY_MS), "--stream-chunk-tokens", "2") as url:
        yield url


@pytest.fixture
async def sim(sim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim_url, timeout=10) as client:
        (await client.post("/sim/reset")).raise_for_status()
        yield client


@pytest.fixture
async def paced(paced_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=paced_url, timeout=10) as client:
        (await client.post("/sim/reset")).raise_for_status()
        yield client


# ------------------------------------------------------------------------------------------------ helpers

PROMPT = list(range(100, 112))


def body(
    input_ids: list[int] | None = None,
    *,
    max_new: int = 16,
    seed: int = 0,
    start_len: int | None = None,
    top_p: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """A /generate body asking for everything a trainer asks for."""
    params: dict[str, Any] = {"max_new_tokens": max_new, "sampling_seed": seed}
    if top_p:
        params["custom_params"] = {"return_top_p_token_ids": True}
    out: dict[str, Any] = {
        "input_ids": PROMPT if input_ids is None else input_ids,
        "sampling_params": params,
        "return_logprob": True,
        "return_routed_experts": True,
        **extra,
    }
    if start_len is not None:
        out["routed_experts_start_len"] = start_len
    return out


async def generate(client: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    return response.json()


def i32(b64: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(b64, validate=True), dtype="<i4")


def rows(meta: dict[str, Any]) -> np.ndarray:
    return i32(meta["routed_experts"]).reshape(-1, L, K)


async def stream_events(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[Any]:
    """Every SSE `data:` payload, parsed; the literal "[DONE]" stays a string."""
    events: list[Any] = []
    async with client.stream("POST", "/generate", json={**payload, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def seed_with_length(client: httpx.AsyncClient, at_least: int, max_new: int = 64) -> tuple[int, int]:
    """A sampling_seed whose answer to PROMPT has >= `at_least` tokens (answers are deterministic per seed)."""
    for seed in range(200):
        answer = await generate(client, body(max_new=max_new, seed=seed))
        if answer["meta_info"]["completion_tokens"] >= at_least:
            return seed, answer["meta_info"]["completion_tokens"]
    raise AssertionError("no seed gives a long enough answer")


VOLATILE = {"e2e_latency", "cached_tokens", "cached_tokens_details", "response_sent_to_client_ts"}


def stable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without the fields that legitimately differ between identical requests."""
    meta = {k: v for k, v in answer["meta_info"].items() if k not in VOLATILE}
    return {**answer, "meta_info": meta}


def check_answer(answer: dict[str, Any], prompt_len: int, max_new: int, start_len: int = 0) -> None:
    """Keys, types and invariants of one non-streamed answer (docs/protocol.md section 2)."""
    meta = answer["meta_info"]
    ids = answer["output_ids"]
    assert isinstance(answer["text"], str)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["prompt_tokens"] == prompt_len
    assert meta["completion_tokens"] == len(ids)
    assert type(meta["cached_tokens"]) is int and 0 <= meta["cached_tokens"] < prompt_len
    assert isinstance(meta["weight_version"], str)
    check_weight_versions(meta)
    assert isinstance(meta["e2e_latency"], float)
    assert "routed_experts_start_len" not in meta
    finish = meta["finish_reason"]
    if finish["type"] == "stop":
        assert finish["matched"] == ids[-1] == EOS and len(ids) < max_new
    else:
        assert finish == {"type": "length", "length": max_new} and len(ids) == max_new
    logprobs = meta["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == ids
    assert all(isinstance(lp, float) and lp < 0 and text is None for lp, _, text in logprobs)
    routing = rows(meta)
    assert routing.shape == (prompt_len + len(ids) - 1 - start_len, L, K)
    assert routing.min() >= 0 and routing.max() < E
    assert all(len(set(row)) == K for row in routing.reshape(-1, K).tolist())  # distinct experts per layer


def check_weight_versions(meta: dict[str, Any]) -> None:
    """SGLang's spans: contiguous from 0, one per version change, non-empty (one [0, 0) without tokens), covering
    the generated tokens, the last one's version the answer's weight_version."""
    spans, n = meta["weight_versions"], meta["completion_tokens"]
    assert [s["start"] for s in spans] == [0, *[s["end"] for s in spans[:-1]]]
    assert spans[-1]["end"] == n and spans[-1]["version"] == meta["weight_version"]
    assert all(s["end"] > s["start"] for s in spans) or (n == 0 and len(spans) == 1)
    assert all(a["version"] != b["version"] for a, b in itertools.pairwise(spans))


def check_top_p(meta: dict[str, Any], output_ids: list[int]) -> None:
    ids, offsets = i32(meta["top_p_token_ids"]), i32(meta["top_p_token_offsets"])
    assert offsets[0] == 0 and offsets[-1] == len(ids)
    assert len(offsets) == meta["completion_tokens"] + 1
    sizes = np.diff(offsets)
    assert sizes.min() >= 1 and sizes.max() <= 20
    for i, token in enumerate(output_ids):
        kept = ids[offsets[i] : offsets[i + 1]].tolist()
        assert token in kept and len(set(kept)) == len(kept)


# ------------------------------------------------------------------------------------- plain answers


async def test_info_endpoints(sim: httpx.AsyncClient) -> None:
    for path in ("/health", "/health_generate"):
        assert (await sim.get(path)).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = (await sim.get(path)).json()
        assert info["model_path"] is None and info["is_generation"] is True
        assert (info["num_hidden_layers"], info["num_experts_per_tok"], info["num_experts"]) == (L, K, E)
    for path in ("/get_server_info", "/server_info"):
        info = (await sim.get(path)).json()
        assert info["model_path"] is None and info["version"] == "sim"
        assert info["enable_return_routed_experts"] is True
        assert (info["num_layers"], info["topk"], info["num_experts"], info["seed"]) == (L, K, E, 0)
    assert (await sim.get("/v1/loads")).json()["loads"][0]["num_running_reqs"] == 0
    assert (await sim.post("/flush_cache")).status_code == 200


async def test_answer_keys_types_and_finish_reasons(sim: httpx.AsyncClient) -> None:
    finishes = set()
    for seed in range(12):
        answer = await generate(sim, body(max_new=3, seed=seed, rid=f"r{seed}"))
        check_answer(answer, len(PROMPT), 3)
        assert answer["meta_info"]["id"] == f"r{seed}"
        finishes.add(answer["meta_info"]["finish_reason"]["type"])
    assert finishes == {"stop", "length"}


async def test_optional_fields_only_when_asked(sim: httpx.AsyncClient) -> None:
    answer = await generate(sim, {"input_ids": PROMPT})
    meta = answer["meta_info"]
    for key in ("output_token_logprobs", "routed_experts", "top_p_token_ids", "top_p_token_offsets"):
        assert key not in meta
    assert len(meta["id"]) == 32  # a fresh uuid hex
    assert 1 <= meta["completion_tokens"] <= 16  # the default max_new_tokens


async def test_deterministic_per_seed(sim: httpx.AsyncClient) -> None:
    first = await generate(sim, body(seed=3, top_p=True, rid="same"))
    again = await generate(sim, body(seed=3, top_p=True, rid="same"))
    assert stable(first) == stable(again)
    other = await generate(sim, body(seed=4, top_p=True, rid="same"))
    assert other["output_ids"] != first["output_ids"]


async def test_ignore_eos_runs_to_max_new_tokens(sim: httpx.AsyncClient) -> None:
    payload = body(max_new=40)
    payload["sampling_params"]["ignore_eos"] = True
    answer = await generate(sim, payload)
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    check_answer(answer, len(PROMPT), 40)


async def test_stop_token_ids(sim: httpx.AsyncClient) -> None:
    seed, _ = await seed_with_length(sim, 4)
    full = await generate(sim, body(max_new=64, seed=seed))
    stop = full["output_ids"][2]
    payload = body(max_new=64, seed=seed)
    payload["sampling_params"]["stop_token_ids"] = [stop]
    answer = await generate(sim, payload)
    cut = full["output_ids"].index(stop) + 1
    assert answer["output_ids"] == full["output_ids"][:cut]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_text_input_and_batches(sim: httpx.AsyncClient) -> None:
    answer = await generate(sim, {"text": "hello simulated world"})
    assert answer["meta_info"]["prompt_tokens"] == 3
    assert answer["text"] == "".join(f" w{t}" for t in answer["output_ids"] if t != EOS)
    prompts = [[1, 2, 3], [4, 5], [6]]
    batch = await generate(sim, {"input_ids": prompts, "rid": ["a", "b", "c"], "return_logprob": True})
    assert [a["meta_info"]["id"] for a in batch] == ["a", "b", "c"]
    assert [a["meta_info"]["prompt_tokens"] for a in batch] == [3, 2, 1]
    single = await generate(sim, {"input_ids": [4, 5], "rid": "b", "return_logprob": True})
    assert stable(single) == stable(batch[1])
    texts = await generate(sim, {"text": ["a b", "c d e"]})
    assert [a["meta_info"]["prompt_tokens"] for a in texts] == [2, 3]


async def test_input_embeds(sim: httpx.AsyncClient) -> None:
    answer = await generate(sim, {"input_embeds": [[0.1, 0.2], [0.3, 0.4]], "return_routed_experts": True})
    assert answer["meta_info"]["prompt_tokens"] == 2
    assert rows(answer["meta_info"]).shape[0] == 1 + answer["meta_info"]["completion_tokens"]


# ---------------------------------------------------------------------------------- routing and top-p


async def test_start_len_returns_the_tail_of_the_full_rows(sim: httpx.AsyncClient) -> None:
    full = rows((await generate(sim, body(seed=1)))["meta_info"])
    for start in (1, 5, len(PROMPT)):
        answer = await generate(sim, body(seed=1, start_len=start))
        check_answer(answer, len(PROMPT), 16, start_len=start)
        assert np.array_equal(rows(answer["meta_info"]), full[start:])


@pytest.mark.parametrize("stream", [False, True])
async def test_no_new_tokens_with_routing_is_an_answer_without_rows(sim: httpx.AsyncClient, stream: bool) -> None:
    """``max_new_tokens: 0`` where the start length leaves no routing row to send (a session's next turn asks from
    its last row on): an empty ``routed_experts``, not a 500."""
    for start in (len(PROMPT) - 1, len(PROMPT)):
        payload = body(max_new=0, start_len=start, top_p=True, stream=stream)
        response = await sim.post("/generate", json=payload)
        assert response.status_code == 200, response.text
        lines = [line for line in response.text.splitlines() if line.startswith("data: {")]
        answer = orjson.loads(lines[-1][len("data: ") :]) if stream else response.json()
        meta = answer["meta_info"]
        assert answer["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["routed_experts"] == "" and rows(meta).shape == (0, L, K)
        assert i32(meta["top_p_token_offsets"]).tolist() == [0] and meta["top_p_token_ids"] == ""


async def test_same_position_same_routing_across_turns(sim: httpx.AsyncClient) -> None:
    turn1 = await generate(sim, body(seed=2))
    tokens = PROMPT + turn1["output_ids"]
    turn2 = await generate(sim, body([*tokens, 7, 8, 9], seed=5))
    fed = len(tokens) - 1  # positions that went through the model in turn 1
    assert np.array_equal(rows(turn2["meta_info"])[:fed], rows(turn1["meta_info"]))
    assert turn2["meta_info"]["cached_tokens"] == fed  # the prefix cache saw turn 1's sequence
    incremental = await generate(sim, body([*tokens, 7, 8, 9], seed=5, start_len=fed))
    assert np.array_equal(rows(incremental["meta_info"]), rows(turn2["meta_info"])[fed:])


async def test_top_p_invariants(sim: httpx.AsyncClient) -> None:
    for seed in range(5):
        answer = await generate(sim, body(seed=seed, top_p=True))
        check_top_p(answer["meta_info"], answer["output_ids"])
    plain = await generate(sim, body(seed=0))
    assert plain["output_ids"] == (await generate(sim, body(seed=0, top_p=True)))["output_ids"]


async def test_prefix_cache_and_flush(sim: httpx.AsyncClient) -> None:
    assert (await generate(sim, body()))["meta_info"]["cached_tokens"] == 0
    assert (await generate(sim, body()))["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    await sim.post("/flush_cache")
    assert (await generate(sim, body()))["meta_info"]["cached_tokens"] == 0


async def test_without_routed_experts_flag() -> None:
    with _run("--no-routed-experts") as url:
        async with httpx.AsyncClient(base_url=url) as client:
            answer = await generate(client, body())
            assert "routed_experts" not in answer["meta_info"]
            assert "output_token_logprobs" in answer["meta_info"]
            info = (await client.get("/get_server_info")).json()
            assert info["enable_return_routed_experts"] is False


async def test_context_length_refuses_what_does_not_fit() -> None:
    """``--context-length``: prompt + max_new_tokens past it is SGLang's 400, with its words; up to it, an answer."""
    with _run("--context-length", str(len(PROMPT) + 8)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/generate", json=body(max_new=8))).status_code == 200
            refused = await client.post("/generate", json=body(max_new=9))
            assert refused.status_code == 400
            assert "exceeds the model's maximum context length" in refused.json()["error"]["message"]


# ------------------------------------------------------------------------------------------- streaming


async def test_stream_is_cumulative_and_matches_the_plain_answer(sim: httpx.AsyncClient) -> None:
    seed, _ = await seed_with_length(sim, 5, max_new=32)
    payload = body(max_new=32, seed=seed, top_p=True, rid="s1", start_len=3)
    events = await stream_events(sim, payload)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert len(chunks) >= 3
    for i, chunk in enumerate(chunks):
        meta = chunk["meta_info"]
        assert meta["finish_reason"] is None
        assert not {"routed_experts", "top_p_token_ids", "top_p_token_offsets", "e2e_latency", "weight_versions"} & (
            meta.keys()
        )
        assert len(chunk["output_ids"]) == i + 1 == len(meta["output_token_logprobs"])  # one token per chunk
        assert final["output_ids"][: i + 1] == chunk["output_ids"]
        assert final["text"].startswith(chunk["text"])
        assert final["meta_info"]["output_token_logprobs"][: i + 1] == meta["output_token_logprobs"]
    plain = await generate(sim, payload)
    assert stable(final) == stable(plain)
    check_top_p(final["meta_info"], final["output_ids"])


async def test_invalid_stream_request_errors_in_band(sim: httpx.AsyncClient) -> None:
    events = await stream_events(sim, {"input_ids": [1, -2]})
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["error"]["code"] == 400 and events[0]["error"]["message"]


# ----------------------------------------------------------------------------------- abort, disconnect


async def test_abort_paced_request(sim: httpx.AsyncClient, paced: httpx.AsyncClient) -> None:
    seed, n = await seed_with_length(sim, 40)
    full = await generate(sim, body(max_new=64, seed=seed, top_p=True))
    task = asyncio.create_task(generate(paced, body(max_new=64, seed=seed, top_p=True, rid="slow")))
    await asyncio.sleep(n * TOKEN_DELAY_MS / 1000 / 3)
    assert (await paced.get("/v1/loads")).json()["loads"][0]["num_running_reqs"] == 1
    assert (await paced.post("/abort_request", json={"rid": "slow"})).status_code == 200
    answer = await task
    meta, m = answer["meta_info"], answer["meta_info"]["completion_tokens"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"]
    assert 0 < m < n
    assert answer["output_ids"] == full["output_ids"][:m]
    assert meta["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"][:m]
    assert np.array_equal(rows(meta), rows(full["meta_info"])[: len(PROMPT) + m - 1])
    check_top_p(meta, answer["output_ids"])
    assert (await paced.get("/sim/stats")).json()["aborted"] == 1


async def test_abort_all_paced_stream(sim: httpx.AsyncClient, paced: httpx.AsyncClient) -> None:
    seed, n = await seed_with_length(sim, 40)
    full = await generate(sim, body(max_new=64, seed=seed))
    events: list[Any] = []
    async with paced.stream("POST", "/generate", json=body(max_new=64, seed=seed, stream=True)) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else orjson.loads(data))
            if len(events) == 2:
                assert (await paced.post("/abort_request", json={"abort_all": True})).status_code == 200
    assert events[-1] == "[DONE]"
    final = events[-2]
    m = final["meta_info"]["completion_tokens"]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 4 <= m < n and final["output_ids"] == full["output_ids"][:m]  # 2 chunks of 2 tokens were sent
    assert rows(final["meta_info"]).shape[0] == len(PROMPT) + m - 1


async def test_abort_unknown_rid_is_200(sim: httpx.AsyncClient) -> None:
    assert (await sim.post("/abort_request", json={"rid": "nobody"})).status_code == 200
    assert (await sim.post("/abort_request", content=b"not json")).status_code == 200


async def test_stream_disconnect_stops_generation(paced: httpx.AsyncClient) -> None:
    payload = body(max_new=64, stream=True, rid="gone")
    payload["sampling_params"]["ignore_eos"] = True
    async with paced.stream("POST", "/generate", json=payload) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk: closes the connection
    for _ in range(50):
        stats = (await paced.get("/sim/stats")).json()
        if stats["disconnected"] == 1:
            break
        await asyncio.sleep(0.02)
    assert stats["disconnected"] == 1 and stats["running"] == 0
    assert stats["generated_tokens"] < 64


# ------------------------------------------------------------------------------------------------ faults


async def inject(client: httpx.AsyncClient, mode: str, count: int = 1, **params: Any) -> None:
    response = await client.post("/sim/faults", json={"mode": mode, "count": count, **params})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("stream", [False, True])
async def test_answer_faults(sim: httpx.AsyncClient, stream: bool) -> None:
    seed, n = await seed_with_length(sim, 3, max_new=32)
    payload = body(max_new=32, seed=seed, top_p=True, start_len=4)

    async def faulty(mode: str) -> dict[str, Any]:
        await inject(sim, mode)
        if stream:
            events = await stream_events(sim, payload)
            return events[-2]
        return await generate(sim, payload)

    meta = (await faulty("bad_base64"))["meta_info"]
    with pytest.raises(ValueError):
        pybase64.b64decode(meta["routed_experts"], validate=True)
    assert "routed_experts" not in (await faulty("drop_routing"))["meta_info"]
    meta = (await faulty("drop_top_p"))["meta_info"]
    assert "top_p_token_ids" not in meta and "top_p_token_offsets" not in meta
    assert rows((await faulty("ignore_start_len"))["meta_info"]).shape[0] == len(PROMPT) + n - 1
    assert rows((await faulty("wrong_rows"))["meta_info"]).shape[0] == len(PROMPT) + n - 1 - 4 - 1
    meta = (await faulty("bad_offsets"))["meta_info"]
    assert i32(meta["top_p_token_offsets"])[-1] != len(i32(meta["top_p_token_ids"]))
    assert "output_token_logprobs" not in (await faulty("missing_logprobs"))["meta_info"]
    logprobs = (await faulty("null_logprob"))["meta_info"]["output_token_logprobs"]
    assert logprobs[0][0] is None and all(lp is not None for lp, _, _ in logprobs[1:])
    spans = (await faulty("bad_weight_versions"))["meta_info"]["weight_versions"]
    assert spans == [{"version": "sim-v0", "start": 0, "end": n + 1}]  # one token more than generated
    meta = (await faulty("abort"))["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == n // 2
    # Every fault was used up: the next answer is correct again.
    check_answer(await generate(sim, payload), len(PROMPT), 32, start_len=4)


@pytest.mark.parametrize(("mode", "status"), [("http_500", 500), ("http_400", 400), ("http_503", 503)])
async def test_http_error_faults(sim: httpx.AsyncClient, mode: str, status: int) -> None:
    await inject(sim, mode, count=2)
    for _ in range(2):
        response = await sim.post("/generate", json=body())
        assert response.status_code == status
        assert response.json()["error"]["message"]
    assert (await sim.post("/generate", json=body())).status_code == 200


async def test_fault_until_cleared_and_queue_order(sim: httpx.AsyncClient) -> None:
    await inject(sim, "http_503", count=-1)
    await inject(sim, "http_400")
    for _ in range(3):
        assert (await sim.post("/generate", json=body())).status_code == 503
    assert len((await sim.get("/sim/faults")).json()["pending"]) == 2
    assert (await sim.delete("/sim/faults")).json()["cleared"] == 2
    assert (await sim.post("/generate", json=body())).status_code == 200
    bad = await sim.post("/sim/faults", json={"mode": "no_such_mode"})
    assert bad.status_code == 400 and "no_such_mode" in bad.json()["error"]["message"]


async def test_delay_fault_times_out_a_client(sim: httpx.AsyncClient) -> None:
    await inject(sim, "delay", delay_s=0.5)
    with pytest.raises(httpx.ReadTimeout):
        await sim.post("/generate", json=body(), timeout=0.1)
    assert (await sim.post("/generate", json=body())).status_code == 200


async def test_malformed_json_fault(sim: httpx.AsyncClient) -> None:
    await inject(sim, "malformed_json")
    response = await sim.post("/generate", json=body())
    assert response.status_code == 200
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(response.content)
    await inject(sim, "malformed_json")
    async with sim.stream("POST", "/generate", json=body(stream=True)) as response:
        data = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(data[0])
    assert data[-1] == "[DONE]" and orjson.loads(data[-2])["meta_info"]["finish_reason"]


async def test_cut_faults_drop_the_connection(sim: httpx.AsyncClient) -> None:
    await inject(sim, "cut_stream")
    with pytest.raises(httpx.RemoteProtocolError):
        await sim.post("/generate", json=body())
    seed, _ = await seed_with_length(sim, 6, max_new=32)
    await inject(sim, "cut_stream")
    lines: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with sim.stream("POST", "/generate", json=body(max_new=32, seed=seed, stream=True)) as response:
            async for line in response.aiter_lines():
                lines.append(line)
    data = [line for line in lines if line.startswith("data: ")]
    assert len(data) == 2 and all(orjson.loads(d[6:])["meta_info"]["finish_reason"] is None for d in data)
    assert (await sim.get("/health")).status_code == 200


async def test_stream_error_fault_is_in_band(sim: httpx.AsyncClient) -> None:
    seed, _ = await seed_with_length(sim, 6, max_new=32)
    await inject(sim, "stream_error")
    events = await stream_events(sim, body(max_new=32, seed=seed))
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"]
    assert all("error" not in e for e in events[:-2])
    await inject(sim, "stream_error")
    assert (await sim.post("/generate", json=body())).status_code == 500  # not streamed: a plain 500


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"sampling_params": {"max_new_tokens": 4}},
        {"input_ids": [1, 2], "text": "both"},
        {"input_ids": [1, -2]},
        {"input_ids": [1, 2.5]},
        {"input_ids": [1, True]},
        {"input_ids": ["1"]},
        {"input_ids": []},
        {"input_ids": "1 2"},
        {"text": ""},
        {"input_ids": [1, 2], "routed_experts_start_len": 3},
        {"input_ids": [1, 2], "routed_experts_start_len": -1},
        {"input_ids": [1, 2], "routed_experts_start_len": "1"},
        {"input_ids": [1, 2], "sampling_params": [1]},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [1, 2], "sampling_params": {"custom_params": [1]}},
        {"input_ids": [[1], [2]], "rid": ["only-one"]},
        [1, 2, 3],
    ],
)
async def test_bad_requests_are_400(sim: httpx.AsyncClient, payload: Any) -> None:
    response = await sim.post("/generate", json=payload)
    assert response.status_code == 400
    assert isinstance(response.json()["error"]["message"], str)


async def test_bad_json_is_400(sim: httpx.AsyncClient) -> None:
    response = await sim.post("/generate", content=b'{"input_ids": [1,', headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]


# ----------------------------------------------------------------------------------- /sim/ introspection


async def test_request_log_and_stats(sim: httpx.AsyncClient) -> None:
    headers = {"X-SMG-Routing-Key": "session-1"}
    await sim.post("/generate", json=body(), headers=headers)
    await sim.post("/generate", json={"input_ids": [[1, 2], [3]]})
    log = (await sim.get("/sim/requests")).json()
    assert len(log) == 2
    first = log[0]
    assert first["path"] == "/generate" and first["headers"]["x-smg-routing-key"] == "session-1"
    assert first["headers"]["content-type"] == "application/json"
    assert first["body"]["input_len"] == len(PROMPT) and "input_ids" not in first["body"]
    assert first["body"]["sampling_params"]["max_new_tokens"] == 16 and first["bytes"] > 0
    assert log[1]["body"]["input_len"] == [2, 1]
    stats = (await sim.get("/sim/stats")).json()
    assert (stats["requests"], stats["items"], stats["completed"], stats["aborted"]) == (2, 3, 3, 0)
    assert stats["generated_tokens"] > 0
    assert (await sim.delete("/sim/requests")).json()["cleared"] == 2
    assert (await sim.get("/sim/requests")).json() == []


def versions(answer: dict[str, Any]) -> tuple[str, list[tuple[str, int, int]]]:
    meta = answer["meta_info"]
    return meta["weight_version"], [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]


async def update_weights(sim: httpx.AsyncClient, **update: Any) -> None:
    response = await sim.post("/sim/weight_version", json=update)
    assert response.status_code == 200, response.text
    assert response.json() == update


async def test_weight_version_update(sim: httpx.AsyncClient) -> None:
    n = (await generate(sim, body()))["meta_info"]["completion_tokens"]
    assert versions(await generate(sim, body())) == ("sim-v0", [("sim-v0", 0, n)])
    await update_weights(sim, weight_version="v7")
    assert versions(await generate(sim, body())) == ("v7", [("v7", 0, n)])


async def test_weight_update_lands_mid_answer(sim: httpx.AsyncClient) -> None:
    seed, n = await seed_with_length(sim, 6, max_new=32)
    payload = body(max_new=32, seed=seed)
    await update_weights(sim, weight_version="v2", after_tokens=3)
    answer = await generate(sim, payload)
    check_answer(answer, len(PROMPT), 32)
    assert versions(answer) == ("v2", [("sim-v0", 0, 3), ("v2", 3, n)])
    assert (await sim.get("/get_server_info")).json()["weight_version"] == "v2"
    again = await generate(sim, payload)  # the update has landed: every later answer runs on v2 alone
    assert versions(again) == ("v2", [("v2", 0, n)])
    assert stable(again)["output_ids"] == answer["output_ids"]  # the tokens never depend on the version


@pytest.mark.parametrize(
    ("after_tokens", "expected"),
    [(0, [("v2", 0, "n")]), ("n", [("sim-v0", 0, "n")]), (1000, [("sim-v0", 0, "n")])],
)
async def test_weight_update_at_the_edges(sim: httpx.AsyncClient, after_tokens: Any, expected: list[Any]) -> None:
    """At token 0 the whole answer runs on the new weights; at or past its end, none of it (it lands after)."""
    seed, n = await seed_with_length(sim, 2, max_new=32)
    await update_weights(sim, weight_version="v2", after_tokens=n if after_tokens == "n" else after_tokens)
    answer = await generate(sim, body(max_new=32, seed=seed))
    spans = [(v, start, n if end == "n" else end) for v, start, end in expected]
    assert versions(answer) == (spans[-1][0], spans)
    assert versions(await generate(sim, body(max_new=32, seed=seed))) == ("v2", [("v2", 0, n)])


async def test_weight_update_mid_stream_keeps_chunks_consistent(sim: httpx.AsyncClient) -> None:
    seed, n = await seed_with_length(sim, 6, max_new=32)
    await update_weights(sim, weight_version="v2", after_tokens=3)
    events = await stream_events(sim, body(max_new=32, seed=seed))
    chunks, final = events[:-2], events[-2]
    assert versions(final) == ("v2", [("sim-v0", 0, 3), ("v2", 3, n)])
    # Each chunk names the version of its newest token (SGLang: the server's version when it sent the chunk).
    chunk_versions = [(len(c["output_ids"]), c["meta_info"]["weight_version"]) for c in chunks]
    assert chunk_versions == [(m, "sim-v0" if m <= 3 else "v2") for m in range(1, n)]


async def test_zero_token_answer_has_one_empty_span(sim: httpx.AsyncClient) -> None:
    await update_weights(sim, weight_version="v2", after_tokens=2)
    answer = await generate(sim, body(max_new=0))
    assert versions(answer) == ("sim-v0", [("sim-v0", 0, 0)])


async def test_reset_and_immediate_updates_drop_a_pending_one(sim: httpx.AsyncClient) -> None:
    await update_weights(sim, weight_version="v2", after_tokens=1)
    await update_weights(sim, weight_version="v3")  # the later update wins; nothing lands mid-answer
    n = (await generate(sim, body()))["meta_info"]["completion_tokens"]
    assert versions(await generate(sim, body())) == ("v3", [("v3", 0, n)])
    await update_weights(sim, weight_version="v4", after_tokens=1)
    assert (await sim.post("/sim/reset")).status_code == 200
    assert versions(await generate(sim, body())) == ("sim-v0", [("sim-v0", 0, n)])


@pytest.mark.parametrize(
    "update",
    [{}, {"weight_version": ""}, {"weight_version": 3}, {"weight_version": "v", "after_tokens": -1}]
    + [{"weight_version": "v", "after_tokens": bad} for bad in ("3", True, 1.0, 2**40)],
)
async def test_bad_weight_updates_are_400(sim: httpx.AsyncClient, update: dict[str, Any]) -> None:
    response = await sim.post("/sim/weight_version", json=update)
    assert response.status_code == 400 and response.json()["error"]["message"]
    assert versions(await generate(sim, body()))[0] == "sim-v0"  # nothing changed


# --------------------------------------------------------------------------------------------- speed


async def test_large_answer_shape() -> None:
    """48 layers x top-8, a 2k prompt and 8k new tokens: the benchmark shape (its speed is measured in bench/)."""
    app = create_app(SimulatorConfig(num_layers=48, topk=8, num_experts=128))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=30) as client:
        payload = body(list(range(2048)), max_new=8192, top_p=True)
        payload["sampling_params"]["ignore_eos"] = True
        await client.post("/generate", json=body(max_new=4))  # warm-up
        response = await client.post("/generate", json=payload)
    meta = response.json()["meta_info"]
    assert meta["completion_tokens"] == 8192
    assert len(pybase64.b64decode(meta["routed_experts"])) == (2048 + 8192 - 1) * 48 * 8 * 4
