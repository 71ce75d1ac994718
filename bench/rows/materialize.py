"""Row 3: trainer-side CPU to get one sample's training tensors: the SDK vs slime's path from the raw JSON.

Two measurements of the same sample, both against slime's path (``bench.reference``: json.loads, list
comprehensions, pybase64 + torch.frombuffer, list appends, torch.tensor of the lists) on the raw ``/generate``
answer in memory, CPU time (``time.process_time``), best of N, interleaved:

- in memory: the SDK turns the gateway's safetensors bytes for the same sample into ``RolloutSample`` tensors (the
  materialization itself; what travels is row 2);
- over real HTTP on 127.0.0.1, receive included: ``Session.fetch`` from the gateway process (the SDK's transport,
  ``slime_wire.http1``, on a plain asyncio loop as a trainer runs it), beside a raw-socket floor for the same
  answer (a ``BufferedProtocol`` that parses and keeps nothing: the kernel's copy and the event loop's callbacks)
  and a small call (``GatewayClient.health``). Next to them, the reference's own POST /generate to the simulator
  through httpx (as slime sends it) + the same materialization, and the SDK's whole create + generate + fetch.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import torch

from bench.core import Check, Context, RowResult, interleaved_best, log, ratio
from bench.receive_worker import Floor
from bench.reference import ReferenceSample
from bench.workload import TOP_P_FLAG, generate_request, prompt_ids
from gateway.codec import decode_generate_response
from gateway.sample import MoEShape, SessionSample
from gateway.store import Session as GatewaySession
from gateway.views import sample_payload
from slime_client import GatewayClient
from slime_client.sample import RolloutSample

NAME = "trainer-side materialization"
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
FETCHES_PER_SAMPLE = 10  # one timed sample of the fetch (and of the floor): the mean of this many, back to back
SMALL_CALLS_PER_SAMPLE = 100
FETCH_SAMPLES_PER_ROUND = 4  # timed samples of each side per conversation round, the sides interleaved
GOAL_RATIO = 50.0
GOAL_SMALL_CALL_US = 150.0
GOAL_FETCH_VS_FLOOR = 1.4


class KeepingFloor(Floor):
    """The floor, receiving into fresh memory of the answer's size (``numpy.empty``, as the SDK's own buffer) that it
    keeps until the next request: the least a client whose tensors view the received bytes can do. It costs more
    than the plain floor, whose one 256 KiB buffer stays in the CPU's caches."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._kept: np.ndarray | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._kept is not None and self._filled < len(self._kept):
            return memoryview(self._kept)[self._filled :]
        return super().get_buffer(sizehint)

    async def get(self, request: bytes, expect: int) -> int:
        self._kept = None  # as a fetched sample dropped before the next fetch: its memory is reused
        self._kept = np.empty(expect, np.uint8)
        return await super().get(request, expect)


def check_same(sdk: RolloutSample, reference: dict[str, torch.Tensor]) -> None:
    assert torch.equal(sdk.tokens, reference["tokens"])
    assert torch.equal(sdk.loss_mask, reference["loss_mask"])
    assert torch.equal(sdk.rollout_log_probs, reference["rollout_log_probs"])
    routed = sdk.routed_experts_int32()
    assert routed is not None and torch.equal(routed, reference["rollout_routed_experts"])
    if "rollout_top_p_token_ids" in reference:
        assert sdk.rollout_top_p_token_ids is not None and sdk.rollout_top_p_token_offsets is not None
        assert torch.equal(sdk.rollout_top_p_token_ids, reference["rollout_top_p_token_ids"])
        assert torch.equal(sdk.rollout_top_p_token_offsets, reference["rollout_top_p_token_offsets"])


def answer_bytes(url: str, request: bytes) -> int:
    """The size of the whole answer to ``request`` (head + Content-Length body), asked once on a socket of its own."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"{url} closed the connection before the answer's head")
            head += chunk
    head_end = head.index(b"\r\n\r\n") + 4
    for line in head[:head_end].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return head_end + int(value)
    raise RuntimeError(f"{url}: the answer has no Content-Length")


async def mean_cpu(call: Callable[[], Awaitable[object]], times: int) -> float:
    """CPU seconds per call, over ``times`` calls back to back (one untimed call first: a connection idle for a while
    restarts TCP slow start, and the first call after another side's pays for it)."""
    await call()
    start = time.process_time()
    for _ in range(times):
        await call()
    return (time.process_time() - start) / times


async def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.answer
    moe = shape.moe
    prompt = prompt_ids(shape.prompt_tokens)
    body = generate_request(prompt, shape.response_tokens, routing=True, top_p=shape.top_p)
    sampling = {"max_new_tokens": shape.response_tokens, "ignore_eos": True, "temperature": 1.0}
    if shape.top_p:
        sampling |= TOP_P_FLAG
    sim_url, gw_url = ctx.services.simulator.url, ctx.services.gateway.url
    best = dict.fromkeys(("reference", "sdk_turn", "sdk_fetch", "floor", "floor_kept", "small_call"), math.inf)
    raw_size = sample_size = 0
    raw_answer = b""
    loop = asyncio.get_running_loop()
    gw_parts = urlsplit(gw_url)
    _, floor = await loop.create_connection(lambda: Floor(loop), gw_parts.hostname, gw_parts.port)
    _, kept = await loop.create_connection(lambda: KeepingFloor(loop), gw_parts.hostname, gw_parts.port)
    async with GatewayClient(gw_url) as gateway, httpx.AsyncClient(base_url=sim_url, timeout=HTTP_TIMEOUT) as sglang:
        for i in range(ctx.suite.materialize_repeat):
            log(f"row 3: round {i + 1}/{ctx.suite.materialize_repeat}")
            # reference: what slime's rollout process does per sample
            start = time.process_time()
            response = await sglang.post("/generate", json=body)
            response.raise_for_status()
            reference = ReferenceSample(tokens=list(prompt), num_layers=moe.layers, topk=moe.topk)
            reference.append_answer(response.content)
            tensors = reference.tensors()
            best["reference"] = min(best["reference"], time.process_time() - start)
            raw_answer = response.content
            raw_size = len(raw_answer)

            # SDK: the same sample through the gateway
            start = time.process_time()
            session = await gateway.create_session(prompt_ids=prompt, num_layers=moe.layers, moe_router_topk=moe.topk)
            await session.generate(sampling)
            sample = await session.fetch()
            best["sdk_turn"] = min(best["sdk_turn"], time.process_time() - start)
            check_same(sample, tensors)

            # the fetch alone, the raw-socket floor for the same answer, and a small call: interleaved samples
            request = b"GET /v1/sessions/%s/sample HTTP/1.1\r\nHost: bench\r\n\r\n" % session.session_id.encode()
            expect = answer_bytes(gw_url, request)
            sample_size = expect
            sides: dict[str, tuple[Callable[[], Awaitable[object]], int]] = {
                "sdk_fetch": (session.fetch, FETCHES_PER_SAMPLE),
                "floor": (lambda request=request, expect=expect: floor.get(request, expect), FETCHES_PER_SAMPLE),
                "floor_kept": (lambda request=request, expect=expect: kept.get(request, expect), FETCHES_PER_SAMPLE),
                "small_call": (gateway.health, SMALL_CALLS_PER_SAMPLE),
            }
            for _ in range(FETCH_SAMPLES_PER_ROUND):
                for name, (call, times) in sides.items():
                    best[name] = min(best[name], await mean_cpu(call, times))
            await session.delete()
    return {**best, "raw_bytes": raw_size, "answer_bytes": sample_size, "raw_answer": raw_answer, "prompt": prompt}


def in_memory(ctx: Context, raw_answer: bytes, prompt: list[int], repeat: int) -> tuple[float, float]:
    """From bytes already in memory: (reference, SDK) best-of-``repeat`` CPU seconds, interleaved."""
    moe = ctx.suite.moe
    sample = SessionSample.from_prompt(prompt, MoEShape(moe.layers, moe.topk))
    sample.fold_model_turn(decode_generate_response(raw_answer, want_routing=True, want_top_p=ctx.suite.answer.top_p))
    compact = sample_payload(GatewaySession.of("bench", sample)).encode()

    def reference() -> dict[str, torch.Tensor]:
        ref = ReferenceSample(tokens=list(prompt), num_layers=moe.layers, topk=moe.topk)
        ref.append_answer(raw_answer)
        return ref.tensors()

    check_same(RolloutSample.from_safetensors(compact), reference())
    best = interleaved_best({"reference": reference, "sdk": lambda: RolloutSample.from_safetensors(compact)}, repeat)
    return best["reference"], best["sdk"]


def run(ctx: Context) -> RowResult:
    log(f"row 3: {ctx.suite.answer.describe()}, over HTTP")
    got = asyncio.run(measure(ctx))
    log(f"row 3: in memory, best of {ctx.suite.decode_repeat}, interleaved")
    mem_reference, mem_sdk = in_memory(ctx, got["raw_answer"], got["prompt"], ctx.suite.decode_repeat)
    fetch, floor, floor_kept, small = got["sdk_fetch"], got["floor"], got["floor_kept"], got["small_call"]
    samples = ctx.suite.materialize_repeat * FETCH_SAMPLES_PER_ROUND
    return RowResult(
        number=3,
        name=NAME,
        measured=(
            f"reference (slime's path) {mem_reference * 1e3:.1f} ms in memory, {got['reference'] * 1e3:.1f} ms over "
            f"HTTP; SDK in memory {mem_sdk * 1e3:.2f} ms; SDK fetch over HTTP {fetch * 1e3:.2f} ms "
            f"({ratio(got['reference'], fetch):.0f}x vs the reference over HTTP, {ratio(mem_reference, fetch):.0f}x "
            "vs it in memory); raw-socket floor "
            f"{floor * 1e3:.2f} ms, {floor_kept * 1e3:.2f} ms into memory it keeps (fetch/floor "
            f"{ratio(fetch, floor):.2f}x, {ratio(fetch, floor_kept):.2f}x); small call {small * 1e6:.0f} us; "
            f"SDK create+generate+fetch {got['sdk_turn'] * 1e3:.2f} ms (trainer CPU)"
        ),
        checks=[
            Check("less trainer CPU", ratio(mem_reference, mem_sdk), GOAL_RATIO, higher_is_better=True),
            Check("fetch vs slime's path, both over HTTP", ratio(got["reference"], fetch), GOAL_RATIO, True),
            Check("small call CPU", small * 1e6, GOAL_SMALL_CALL_US, higher_is_better=False, unit="us"),
            Check("fetch/raw-socket floor", ratio(fetch, floor), GOAL_FETCH_VS_FLOOR, higher_is_better=False),
        ],
        notes=[
            f"sample: {ctx.suite.answer.describe()}; raw answer {got['raw_bytes'] / 2**20:.1f} MiB, the sample's "
            f"answer {got['answer_bytes'] / 2**20:.2f} MiB (safetensors + head); both paths produce equal tensors "
            "(checked)",
            "slime's path (the reference): bench/reference.py on the raw /generate JSON + torch.tensor of its lists; "
            f"in memory best of {ctx.suite.decode_repeat}, interleaved with the SDK's RolloutSample.from_safetensors "
            "on the gateway's sample bytes; over HTTP, best of "
            f"{ctx.suite.materialize_repeat} rounds, with the POST /generate to the simulator through httpx (as slime "
            "sends it). The in-memory check compares the materializations alone; the over-HTTP check compares what "
            "each path costs the trainer from the wire, receive included on both sides (slime's rollout process "
            "receives the raw answer over HTTP too). The fetch against the reference IN MEMORY (no receive on slime's "
            "side, the stricter figure) is shown in the measured column, with no goal",
            "SDK fetch over HTTP: Session.fetch (GET /v1/sessions/ID/sample from the gateway process, received by "
            "slime_wire.http1 straight into a numpy buffer that the tensors view, then "
            "RolloutSample.from_safetensors), plain asyncio loop, keep_freed_memory in force (GatewayClient sets "
            "it); CPU per fetch = mean of "
            f"{FETCHES_PER_SAMPLE} back to back, best of {samples} samples interleaved with the floor and the small "
            "call",
            "raw-socket floor: bench/receive_worker.py's BufferedProtocol on a connection of its own to the gateway, "
            "the same request, receiving the known number of bytes into one reused 256 KiB buffer and keeping none "
            "(the kernel's copy and the event loop's callbacks of a plain receive); 'into memory it keeps': "
            "the same into a fresh numpy.empty buffer of the answer's size per request, as the SDK receives (a "
            "multi-megabyte destination does not stay in the CPU's caches as the 256 KiB one does). Neither floor "
            "sets SO_RCVLOWAT, which the SDK's transport does for a body read into its buffer (the loop wakes once "
            "the missing bytes are in, not for every few hundred KB): a client can go below these floors",
            f"small call: GatewayClient.health (GET /health, JSON), mean of {SMALL_CALLS_PER_SAMPLE}, best of "
            f"{samples}",
            "SDK create+generate+fetch: the whole conversation for the sample (GatewayClient.create_session + "
            "Session.generate + Session.fetch), best of the rounds",
        ],
    )
