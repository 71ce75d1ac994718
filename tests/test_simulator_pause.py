"""The simulator's weight-update protocol, as slime drives SGLang's: pause (abort | retract | in_place) -> update
the weight version -> continue, landing at an exact token with the ``hold`` fault (the answer stops at token K until
continued or aborted), so that nothing here depends on timing."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pybase64
import pytest
from procs import free_port, start_process

L, K, E = 4, 2, 8
PROMPT = list(range(100, 112))
N = 24  # every answer here: exactly N tokens (ignore_eos)
HELD_AT = 9


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    port = free_port()
    args = [sys.executable, "-m", "sglang_sim", "--port", str(port), "--seed", "0"]
    args += ["--num-layers", str(L), "--topk", str(K), "--num-experts", str(E), "--stream-chunk-tokens", "2"]
    with start_process(args, port) as proc:
        yield proc.url


@pytest.fixture
async def sim(sim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim_url, timeout=30) as client:
        (await client.post("/sim/reset")).raise_for_status()
        yield client


def body(input_ids: list[int], max_new: int = N, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 3}
    return {
        "input_ids": input_ids,
        "sampling_params": params,
        "return_logprob": True,
        "return_routed_experts": True,
        **extra,
    }


async def generate(sim: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    response = await sim.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    return response.json()


async def stream(sim: httpx.AsyncClient, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's chunks, parsed (the final one last); asserts it ends with [DONE]."""
    events: list[Any] = []
    async with sim.stream("POST", "/generate", json={**payload, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


async def stats(sim: httpx.AsyncClient) -> dict[str, Any]:
    return (await sim.get("/sim/stats")).json()


async def until(sim: httpx.AsyncClient, **wanted: Any) -> None:
    """Until ``/sim/stats`` shows ``wanted`` (a held answer, a waiting request): states, not times."""
    for _ in range(2000):
        current = await stats(sim)
        if all(current[key] == value for key, value in wanted.items()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the simulator never got to {wanted}: {current}")


async def hold(sim: httpx.AsyncClient, after_tokens: int = HELD_AT) -> None:
    response = await sim.post("/sim/faults", json={"mode": "hold", "after_tokens": after_tokens})
    assert response.status_code == 200, response.text


def routing_rows(meta: dict[str, Any]) -> int:
    return len(pybase64.b64decode(meta["routed_experts"])) // (4 * L * K)


async def test_abort_mode_ends_the_held_answer_and_the_resuming_request_waits_then_goes_on(
    sim: httpx.AsyncClient,
) -> None:
    whole = await generate(sim, body(PROMPT))
    await hold(sim)
    held = asyncio.create_task(generate(sim, body(PROMPT)))
    await until(sim, held=1)
    paused = await sim.post("/pause_generation", json={})  # slime's body: the default mode, abort
    assert paused.status_code == 200 and paused.json()["status"] == "ok"
    aborted = await held  # the pause answers once the running answers have ended
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == HELD_AT
    assert aborted["output_ids"] == whole["output_ids"][:HELD_AT]
    assert routing_rows(meta) == len(PROMPT) + HELD_AT - 1  # an aborted answer brings its routing rows
    # While paused a new request waits (SGLang holds it on is_pause; it is not refused), then runs on the new weights.
    resumed_input = PROMPT + aborted["output_ids"]
    resumed = asyncio.create_task(generate(sim, body(resumed_input, N - HELD_AT, routed_experts_start_len=20)))
    await until(sim, waiting=1, paused="abort")
    assert not resumed.done()
    assert (await sim.post("/sim/weight_version", json={"weight_version": "sim-v1"})).status_code == 200
    assert (await sim.post("/continue_generation", json={})).json()["status"] == "ok"
    rest = await resumed
    # The model continues its own prefix: the rest of the same answer, on the new weights.
    assert aborted["output_ids"] + rest["output_ids"] == whole["output_ids"]
    lps = meta["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]
    assert [lp[0] for lp in lps] == [lp[0] for lp in whole["meta_info"]["output_token_logprobs"]]
    assert rest["meta_info"]["finish_reason"] == {"type": "length", "length": N - HELD_AT}
    assert rest["meta_info"]["weight_versions"] == [{"version": "sim-v1", "start": 0, "end": N - HELD_AT}]
    assert routing_rows(rest["meta_info"]) == len(resumed_input) + N - HELD_AT - 1 - 20
    assert (await stats(sim))["resumed"] == 1


async def test_in_place_pause_stops_a_stream_where_it_is_and_the_spans_show_the_update(
    sim: httpx.AsyncClient,
) -> None:
    whole = await generate(sim, body(PROMPT))
    await hold(sim)
    chunks_task = asyncio.create_task(stream(sim, body(PROMPT)))
    await until(sim, held=1)
    assert (await sim.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    assert (await stats(sim))["paused"] == "in_place"
    # SGLang cannot flush a cache that an in-place pause keeps answers running on.
    assert (await sim.post("/flush_cache")).status_code == 400
    update = {"new_version": "sim-v1", "abort_all_requests": False}
    assert (await sim.post("/update_weight_version", json=update)).json()["success"] is True
    assert (await sim.post("/continue_generation", json={})).status_code == 200
    chunks = await chunks_task
    final = chunks[-1]
    assert final["output_ids"] == whole["output_ids"]  # nothing lost, nothing repeated
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["weight_versions"] == [
        {"version": "sim-v0", "start": 0, "end": HELD_AT},
        {"version": "sim-v1", "start": HELD_AT, "end": N},
    ]
    assert final["meta_info"]["weight_version"] == "sim-v1" and final["meta_info"]["num_retractions"] == 0
    versions = [chunk["meta_info"]["weight_version"] for chunk in chunks[:-1]]
    assert versions[0] == "sim-v0" and versions[-1] == "sim-v1"
    assert (await sim.post("/flush_cache")).status_code == 200  # once it ran on


async def test_retract_pause_takes_a_unary_answer_back_and_reruns_it_after_continue(sim: httpx.AsyncClient) -> None:
    whole = await generate(sim, body(PROMPT))
    await hold(sim)
    held = asyncio.create_task(generate(sim, body(PROMPT)))
    await until(sim, held=1)
    assert (await sim.post("/pause_generation", json={"mode": "retract"})).status_code == 200
    assert (await sim.post("/flush_cache")).status_code == 200  # retract leaves a cache that can be flushed
    assert (await sim.post("/sim/weight_version", json={"weight_version": "sim-v2"})).status_code == 200
    assert not held.done()
    assert (await sim.post("/continue_generation")).status_code == 200
    answer = await held
    meta = answer["meta_info"]
    assert answer["output_ids"] == whole["output_ids"] and meta["num_retractions"] == 1
    assert meta["weight_versions"] == [
        {"version": "sim-v0", "start": 0, "end": HELD_AT},
        {"version": "sim-v2", "start": HELD_AT, "end": N},
    ]


async def test_abort_mode_on_a_stream_sends_the_tokens_so_far_and_the_resume_continues_it(
    sim: httpx.AsyncClient,
) -> None:
    whole = await generate(sim, body(PROMPT))
    await hold(sim)
    chunks_task = asyncio.create_task(stream(sim, body(PROMPT)))
    await until(sim, held=1)
    await sim.post("/pause_generation", json={"mode": "abort"})
    chunks = await chunks_task
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and chunks[-1]["output_ids"] == whole["output_ids"][:HELD_AT]
    assert max(chunk["meta_info"]["completion_tokens"] for chunk in chunks[:-1]) == HELD_AT  # streamed before the hold
    await sim.post("/continue_generation")
    rest = await stream(sim, body(PROMPT + chunks[-1]["output_ids"], N - HELD_AT))
    assert chunks[-1]["output_ids"] + rest[-1]["output_ids"] == whole["output_ids"]


async def test_a_request_waiting_out_a_pause_can_be_aborted(sim: httpx.AsyncClient) -> None:
    assert (await sim.post("/pause_generation", json={"mode": "abort"})).status_code == 200
    waiting = asyncio.create_task(generate(sim, body(PROMPT, rid="waits")))
    await until(sim, waiting=1)
    assert (await sim.post("/abort_request", json={"rid": "waits"})).status_code == 200
    answer = await waiting
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and answer["output_ids"] == []
    assert (await stats(sim))["paused"] == "abort"  # still paused: only continue ends it
    await sim.post("/continue_generation")
    assert (await stats(sim))["paused"] is None


async def test_a_held_answer_goes_on_when_continued_without_a_pause(sim: httpx.AsyncClient) -> None:
    whole = await generate(sim, body(PROMPT))
    await hold(sim, after_tokens=0)
    held = asyncio.create_task(generate(sim, body(PROMPT)))
    await until(sim, held=1)
    await sim.post("/continue_generation")
    answer = await held
    assert answer["output_ids"] == whole["output_ids"]
    assert answer["meta_info"]["weight_versions"] == [{"version": "sim-v0", "start": 0, "end": N}]


async def test_update_weight_version_aborts_running_answers_unless_told_not_to(sim: httpx.AsyncClient) -> None:
    await hold(sim)
    held = asyncio.create_task(generate(sim, body(PROMPT)))
    await until(sim, held=1)
    answer = (await sim.post("/update_weight_version", json={"new_version": "sim-v3"})).json()
    assert answer == {"success": True, "message": "Weight version updated to sim-v3", "new_version": "sim-v3"}
    aborted = await held
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["meta_info"]["completion_tokens"] == HELD_AT
    after = await generate(sim, body([7, 8, 9]))
    assert after["meta_info"]["weight_version"] == "sim-v3"


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/pause_generation", {"mode": "later"}),
        ("/pause_generation", [1]),
        ("/update_weight_version", {"new_version": ""}),
        ("/sim/faults", {"mode": "hold"}),
        ("/sim/faults", {"mode": "hold", "after_tokens": -1}),
        ("/sim/faults", {"mode": "abort", "after_tokens": 3}),
    ],
)
async def test_bad_weight_update_controls_are_400(sim: httpx.AsyncClient, path: str, payload: Any) -> None:
    response = await sim.post(path, json=payload)
    assert response.status_code == 400, response.text
    assert (await stats(sim))["paused"] is None
