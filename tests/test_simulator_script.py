"""The simulator's real-tokenizer vocabulary (`--tokenizer`) and scripted answers (`POST /sim/script`).

In-process simulators (httpx over ASGI) share one tiny chat tokenizer built once for the module; one test runs the
real `python -m sglang_sim --tokenizer` process to cover the flag.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64
import pytest
from conftest import Service

from sglang_sim import SimulatorConfig, create_app

L, K, E = 4, 2, 8
PROMPT = list(range(100, 112))
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
VOLATILE = {"e2e_latency", "cached_tokens", "cached_tokens_details", "response_sent_to_client_ts"}
TOKEN_DELAY_MS = 20
JSON = "application/json"


def _config(**extra: Any) -> SimulatorConfig:
    return SimulatorConfig(num_layers=L, topk=K, num_experts=E, **extra)


@pytest.fixture(scope="module")
def apps(tokenizer_dir: Path) -> dict[str, Any]:
    """One app per kind for the whole module; each test's client resets the one it uses."""
    return {
        "tok": create_app(_config(tokenizer=str(tokenizer_dir))),
        "paced": create_app(_config(tokenizer=str(tokenizer_dir), token_delay_ms=TOKEN_DELAY_MS)),
        "plain": create_app(_config()),
    }


@asynccontextmanager
async def _client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim", timeout=30) as client:
        (await client.post("/sim/reset")).raise_for_status()
        yield client


@pytest.fixture
async def sim(apps: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(apps["tok"]) as client:
        yield client


@pytest.fixture
async def paced(apps: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(apps["paced"]) as client:
        yield client


@pytest.fixture
async def plain(apps: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(apps["plain"]) as client:
        yield client


# ------------------------------------------------------------------------------------------------ helpers


def body(rid: str | None = None, *, max_new: int = 64, seed: int = 0, **params: Any) -> dict[str, Any]:
    """A /generate body asking for log-probs, routing and top-p."""
    sampling = {"max_new_tokens": max_new, "sampling_seed": seed, "custom_params": {"return_top_p_token_ids": True}}
    out: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {**sampling, **params},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    if rid is not None:
        out["rid"] = rid
    return out


async def generate(client: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    return response.json()


async def script(client: httpx.AsyncClient, prefix: str, *answers: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/sim/script", json={"rid_prefix": prefix, "answers": list(answers)})
    assert response.status_code == 200, response.text
    return response.json()


async def pending(client: httpx.AsyncClient) -> dict[str, list[dict[str, Any]]]:
    return (await client.get("/sim/script")).json()["pending"]


async def stream_events(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[Any]:
    response = await client.post("/generate", json={**payload, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else orjson.loads(e) for e in events]


def i32(b64: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(b64, validate=True), dtype="<i4")


def stable(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "meta_info": {k: v for k, v in answer["meta_info"].items() if k not in VOLATILE}}


def check_consistent(answer: dict[str, Any], prompt_len: int = len(PROMPT)) -> None:
    """Log-probs, routing, top-p and weight versions all cover exactly the answer's tokens."""
    meta, ids = answer["meta_info"], answer["output_ids"]
    n = len(ids)
    assert meta["completion_tokens"] == n == meta["output_token_logprobs_length"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert all(lp < 0 for lp, _, _ in meta["output_token_logprobs"])
    routing = i32(meta["routed_experts"]).reshape(-1, L, K)
    assert routing.shape[0] == prompt_len + n - 1
    top_ids, offsets = i32(meta["top_p_token_ids"]), i32(meta["top_p_token_offsets"])
    assert len(offsets) == n + 1 and offsets[-1] == len(top_ids)
    assert all(tok in top_ids[offsets[i] : offsets[i + 1]] for i, tok in enumerate(ids))
    assert meta["weight_versions"][-1]["end"] == n


def token_texts(tokenizer: Any, ids: list[int]) -> str:
    """An answer's text as the simulator builds it: each token decoded alone, special tokens left out."""
    special = set(tokenizer.all_special_ids)
    return "".join(tokenizer.decode([i]) for i in ids if i not in special)


# ------------------------------------------------------------------------------------- tokenizer mode


async def test_tokenizer_sets_the_vocabulary(sim: httpx.AsyncClient, tokenizer: Any, tokenizer_dir: Path) -> None:
    for path in ("/get_model_info", "/get_server_info"):
        info = (await sim.get(path)).json()
        assert info["vocab_size"] == len(tokenizer) and info["eos_token_id"] == tokenizer.eos_token_id
        assert info["tokenizer_path"] == str(tokenizer_dir)
    answer = await generate(sim, {"text": "What is the weather in Paris?"})
    assert answer["meta_info"]["prompt_tokens"] == len(tokenizer.encode("What is the weather in Paris?"))


async def test_random_answers_decode_with_the_tokenizer(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    eos, special = tokenizer.eos_token_id, set(tokenizer.all_special_ids)
    finishes, whole = set(), 0
    for seed in range(30):
        answer = await generate(sim, body(max_new=4 if seed % 2 else 40, seed=seed))
        ids, finish = answer["output_ids"], answer["meta_info"]["finish_reason"]
        finishes.add(finish["type"])
        check_consistent(answer)
        assert not special & set(ids[:-1])  # special ids never drawn, only the eos that ends the answer
        assert ids[-1] not in special or (ids[-1] == eos and finish == {"type": "stop", "matched": eos})
        assert answer["text"] == token_texts(tokenizer, ids)
        if "\ufffd" not in answer["text"]:  # no token is a piece of a multi-byte character
            assert answer["text"] == tokenizer.decode(ids, skip_special_tokens=True)
            whole += 1
    assert finishes == {"stop", "length"} and whole > 0
    long = await generate(sim, body(max_new=500, ignore_eos=True))
    assert len(long["output_ids"]) == 500 and not special & set(long["output_ids"])


# --------------------------------------------------------------------------------------- scripted answers


async def test_scripted_text_answer(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    queued = await script(sim, "agent-", {"text": TOOL_CALL})
    expected = tokenizer.encode(TOOL_CALL, add_special_tokens=False)
    assert queued == {"queued": 1, "pending": {"agent-": [{"token_ids": expected, "eos": True, "text": TOOL_CALL}]}}
    answer = await generate(sim, body("agent-1"))
    eos = tokenizer.eos_token_id
    assert answer["output_ids"] == [*expected, eos]
    assert answer["text"] == TOOL_CALL
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert answer["meta_info"]["id"] == "agent-1"
    check_consistent(answer)
    assert await pending(sim) == {}
    # Deterministic like a random answer: the same script and request give the same answer.
    await script(sim, "agent-", {"text": TOOL_CALL})
    assert stable(await generate(sim, body("agent-1"))) == stable(answer)
    assert (await sim.get("/sim/stats")).json()["scripted"] == 2


async def test_scripted_token_ids_with_and_without_eos(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    ids = tokenizer.encode(" Paris is sunny.", add_special_tokens=False)
    await script(sim, "t-", {"token_ids": ids}, {"token_ids": ids, "eos": False}, {"token_ids": [], "eos": False})
    with_eos = await generate(sim, body("t-1"))
    assert with_eos["output_ids"] == [*ids, tokenizer.eos_token_id]
    assert with_eos["text"] == " Paris is sunny."
    check_consistent(with_eos)
    without = await generate(sim, body("t-2"))
    assert without["output_ids"] == ids and without["text"] == " Paris is sunny."  # the last token's text is kept
    assert without["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
    check_consistent(without)
    empty = await generate(sim, body("t-3"))
    assert empty["output_ids"] == [] and empty["text"] == ""
    assert empty["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}


async def test_scripted_token_ids_without_a_tokenizer(plain: httpx.AsyncClient) -> None:
    await script(plain, "p", {"token_ids": [5, 6, 7]})
    answer = await generate(plain, body("p1"))
    assert answer["output_ids"] == [5, 6, 7, 999] and answer["text"] == " w5 w6 w7"
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": 999}


async def test_max_new_tokens_cuts_a_scripted_answer(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    ids = tokenizer.encode(TOOL_CALL, add_special_tokens=False)
    eos, n = tokenizer.eos_token_id, len(ids)
    await script(sim, "c-", {"text": TOOL_CALL}, {"text": TOOL_CALL}, {"text": TOOL_CALL, "eos": False})
    cut = await generate(sim, body("c-1", max_new=5))
    assert cut["output_ids"] == ids[:5] and cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert cut["text"] == token_texts(tokenizer, ids[:5])
    check_consistent(cut)
    # The eos as the last allowed token still stops the answer (SGLang checks stop tokens before the length).
    fits = await generate(sim, body("c-2", max_new=n + 1))
    assert fits["output_ids"] == [*ids, eos] and fits["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    exact = await generate(sim, body("c-3", max_new=n))  # no eos, exactly max_new_tokens: a length finish
    assert exact["output_ids"] == ids and exact["meta_info"]["finish_reason"] == {"type": "length", "length": n}


async def test_stop_token_ids_apply_to_a_scripted_answer(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    ids = tokenizer.encode(TOOL_CALL, add_special_tokens=False)
    stop = ids[3]
    await script(sim, "s-", {"text": TOOL_CALL})
    answer = await generate(sim, body("s-1", stop_token_ids=[stop]))
    cut = ids.index(stop) + 1
    assert answer["output_ids"] == ids[:cut]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["text"] == token_texts(tokenizer, ids[: cut - 1])  # SGLang trims the matched stop token's text


async def test_skip_special_tokens_false_keeps_their_text(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    """As SGLang: special tokens have no text by default; ``skip_special_tokens: false`` spells them out (the
    matched stop token's text is still trimmed), in the whole answer and in each streamed chunk."""
    text = "Before<|im_start|>after"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    await script(sim, "sp-", {"text": text}, {"text": text}, {"text": text})
    skipped = await generate(sim, body("sp-1"))
    assert skipped["text"] == "Beforeafter"
    kept = await generate(sim, body("sp-2", skip_special_tokens=False))
    assert kept["text"] == text and kept["output_ids"] == [*ids, tokenizer.eos_token_id]
    events = await stream_events(sim, body("sp-3", skip_special_tokens=False))
    assert events[-2]["text"] == text and all(text.startswith(e["text"]) for e in events[:-2])


async def test_streamed_scripted_answer(sim: httpx.AsyncClient, tokenizer: Any) -> None:
    await script(sim, "st-", {"text": TOOL_CALL}, {"text": TOOL_CALL})
    events = await stream_events(sim, body("st-1"))
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    expected = [*tokenizer.encode(TOOL_CALL, add_special_tokens=False), tokenizer.eos_token_id]
    assert final["output_ids"] == expected and final["text"] == TOOL_CALL
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert len(chunks) == len(expected) - 1  # one token per chunk; the last one travels with the final chunk
    for i, chunk in enumerate(chunks):
        assert chunk["output_ids"] == expected[: i + 1] and chunk["meta_info"]["finish_reason"] is None
        assert TOOL_CALL.startswith(chunk["text"])
    check_consistent(final)
    assert stable(await generate(sim, body("st-1"))) == stable(final)  # the second answer, not streamed


async def test_prefix_routing(sim: httpx.AsyncClient) -> None:
    unscripted = await generate(sim, body("agent-9", seed=4))
    await script(sim, "agent-", {"token_ids": [10]}, {"token_ids": [11]})
    await script(sim, "agent-7-", {"token_ids": [20]})
    await script(sim, "agent-", {"token_ids": [12]})  # appended after the two already queued
    counts = {prefix: len(answers) for prefix, answers in (await pending(sim)).items()}
    assert counts == {"agent-": 3, "agent-7-": 1}
    first_tokens = []
    for rid in ("agent-7-a", "agent-7-b", "agent-3", "agent-4"):
        first_tokens.append((await generate(sim, body(rid, seed=4)))["output_ids"][0])
    assert first_tokens == [20, 10, 11, 12]  # longest prefix first; once it is used up the shorter one; FIFO
    assert await pending(sim) == {}
    again = await generate(sim, body("agent-9", seed=4))  # nothing queued any more: random again
    assert again["output_ids"] == unscripted["output_ids"]
    await script(sim, "agent-", {"token_ids": [10]})
    other = await generate(sim, body("other-agent-9", seed=4))  # a prefix, not a substring
    assert other["output_ids"] == unscripted["output_ids"]
    assert len((await pending(sim))["agent-"]) == 1


async def test_batch_prompts_take_scripts_in_order(sim: httpx.AsyncClient) -> None:
    await script(sim, "b", {"token_ids": [30]}, {"token_ids": [31]})
    batch = await generate(sim, {"input_ids": [[1, 2], [3, 4], [5, 6]], "rid": ["b1", "x", "b2"]})
    assert [a["output_ids"][:1] for a in batch[::2]] == [[30], [31]]


async def test_reset_and_delete_clear_scripts(sim: httpx.AsyncClient) -> None:
    await script(sim, "r", {"token_ids": [1]}, {"token_ids": [2]})
    assert (await sim.delete("/sim/script")).json() == {"cleared": 2}
    await script(sim, "r", {"token_ids": [1]})
    assert (await sim.post("/sim/reset")).status_code == 200
    assert await pending(sim) == {}
    assert (await generate(sim, body("r1")))["output_ids"][:2] != [1, 2]


async def test_faults_and_weight_updates_on_a_scripted_answer(sim: httpx.AsyncClient) -> None:
    ids = list(range(40, 50))
    await sim.post("/sim/faults", json={"mode": "http_503"})
    await script(sim, "f-", {"token_ids": ids}, {"token_ids": ids})
    assert (await sim.post("/generate", json=body("f-1"))).status_code == 503
    assert len((await pending(sim))["f-"]) == 2  # a request that failed before generating took no answer
    await sim.post("/sim/faults", json={"mode": "abort"})
    aborted = await generate(sim, body("f-1"))
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and aborted["output_ids"] == ids[:5]
    await sim.post("/sim/weight_version", json={"weight_version": "v2", "after_tokens": 3})
    answer = await generate(sim, body("f-2"))
    spans = [(s["version"], s["start"], s["end"]) for s in answer["meta_info"]["weight_versions"]]
    assert spans == [("sim-v0", 0, 3), ("v2", 3, 11)]
    check_consistent(answer)


async def test_abort_a_paced_scripted_answer(paced: httpx.AsyncClient) -> None:
    ids = list(range(300, 340))
    await script(paced, "slow-", {"token_ids": ids})
    task = asyncio.create_task(generate(paced, body("slow-1")))
    await asyncio.sleep(len(ids) * TOKEN_DELAY_MS / 1000 / 3)
    assert (await paced.post("/abort_request", json={"rid": "slow-1"})).status_code == 200
    answer = await task
    m = answer["meta_info"]["completion_tokens"]
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < m < len(ids) and answer["output_ids"] == ids[:m]
    check_consistent(answer)


# ------------------------------------------------------------------------------------------------ errors


async def test_text_answers_need_a_tokenizer(plain: httpx.AsyncClient) -> None:
    response = await plain.post("/sim/script", json={"rid_prefix": "a", "answers": [{"text": "hi"}]})
    assert response.status_code == 400 and "tokenizer" in response.json()["error"]["message"]
    assert await pending(plain) == {}


@pytest.mark.parametrize(
    "payload",
    [
        {},
        [],
        "x",
        {"rid_prefix": "a"},
        {"answers": [{"token_ids": [1]}]},
        {"rid_prefix": 3, "answers": [{"token_ids": [1]}]},
        {"rid_prefix": "a", "answers": []},
        {"rid_prefix": "a", "answers": {"token_ids": [1]}},
        {"rid_prefix": "a", "answers": [{"token_ids": [1]}], "extra": 1},
        {"rid_prefix": "a", "answers": [[1, 2]]},
        {"rid_prefix": "a", "answers": [{}]},
        {"rid_prefix": "a", "answers": [{"eos": True}]},
        {"rid_prefix": "a", "answers": [{"text": "hi", "token_ids": [1]}]},
        {"rid_prefix": "a", "answers": [{"token_ids": [1], "eos": 0}]},
        {"rid_prefix": "a", "answers": [{"token_ids": [1], "stop": True}]},
        {"rid_prefix": "a", "answers": [{"text": 5}]},
        {"rid_prefix": "a", "answers": [{"token_ids": "1 2"}]},
        {"rid_prefix": "a", "answers": [{"token_ids": [-1]}]},
        {"rid_prefix": "a", "answers": [{"token_ids": [1.0]}]},
        {"rid_prefix": "a", "answers": [{"token_ids": [True]}]},
        {"rid_prefix": "a", "answers": [{"token_ids": [598]}]},  # the tiny tokenizer has 598 ids
        {"rid_prefix": "a", "answers": [{"token_ids": [1]}, {"token_ids": [2**40]}]},  # all or nothing
    ],
)
async def test_bad_scripts_are_400(sim: httpx.AsyncClient, tokenizer: Any, payload: Any) -> None:
    assert len(tokenizer) == 598  # what the out-of-range case above assumes
    response = await sim.post("/sim/script", json=payload)
    assert response.status_code == 400
    assert isinstance(response.json()["error"]["message"], str)
    assert await pending(sim) == {}


async def test_script_body_not_json_is_400(sim: httpx.AsyncClient) -> None:
    response = await sim.post("/sim/script", content=b'{"rid_prefix": "a",', headers={"content-type": JSON})
    assert response.status_code == 400 and response.json()["error"]["message"]


# -------------------------------------------------------------------------------- without a tokenizer


# Recorded from the simulator before it had tokenizers and scripts: sha256 prefixes of each answer's values.
PINNED_KEYS = ("finish_reason", "output_token_logprobs", "routed_experts", "top_p_token_ids", "top_p_token_offsets")
PINNED = {
    0: ([29, 889, 650, 103, 944, 999], "cb607319cbd49e2f"),
    1: ([961, 999], "b6b932b29254f3e3"),
    2: ([61, 279, 744, 999], "3ae660826303e61f"),
}


def fingerprint(answer: dict[str, Any]) -> str:
    values = [answer["text"], answer["output_ids"], *(answer["meta_info"][key] for key in PINNED_KEYS)]
    return hashlib.sha256(orjson.dumps(values)).hexdigest()[:16]


async def test_unscripted_answers_without_tokenizer_are_unchanged(plain: httpx.AsyncClient) -> None:
    """The synthetic vocabulary's answers are bit for bit what they were before tokenizers and scripts."""
    answers = {seed: await generate(plain, body(seed=seed, max_new=8)) for seed in PINNED}
    assert {seed: (a["output_ids"], fingerprint(a)) for seed, a in answers.items()} == PINNED


# ------------------------------------------------------------------------------------------ the real process


async def test_tokenizer_flag(chat_sim: Service, tokenizer: Any) -> None:
    async with httpx.AsyncClient(base_url=chat_sim.url, timeout=10) as client:
        info = (await client.get("/get_model_info")).json()
        assert (info["vocab_size"], info["eos_token_id"]) == (len(tokenizer), tokenizer.eos_token_id)
        await script(client, "cli-", {"text": TOOL_CALL})
        answer = await generate(
            client, {"input_ids": PROMPT, "rid": "cli-1", "sampling_params": {"max_new_tokens": 99}}
        )
        assert answer["text"] == TOOL_CALL
        assert answer["output_ids"] == [*tokenizer.encode(TOOL_CALL, add_special_tokens=False), tokenizer.eos_token_id]
