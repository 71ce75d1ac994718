"""All or nothing, at both edges: values that cannot be stored or served are refused before anything changes.

Upstream answers come from a raw-TCP fake (``raw_upstream.RawUpstream``) whose bytes each test scripts: a valid
answer with one value made wrong. Client bodies go to a gateway before the simulator. After every refusal the
session is byte-identical (its full view minus ``updated_at``, its compact sample) and still served: the view,
``/sample``, a group ``/v1/samples`` that includes it, and a good turn right after.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway
from raw_upstream import RawRequest, RawUpstream, Step, chunked, http_response, sglang_answer, sse_event
from safetensors.numpy import load

from gateway.views import FULL_VIEW_SLICE_ELEMENTS, _json_array

NUM_LAYERS, TOPK = 2, 2
SLICE = FULL_VIEW_SLICE_ELEMENTS
PROMPT = [1, 2, 3, 4]


# ---- the raw upstream and its gateway --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def raw() -> Iterator[tuple[RawUpstream, Service]]:
    with RawUpstream() as upstream, run_gateway(upstream.url, env={"GATEWAY_REQUEST_TIMEOUT_S": "5"}) as gateway:
        yield upstream, gateway


@pytest.fixture
async def client(raw: tuple[RawUpstream, Service]) -> AsyncIterator[httpx.AsyncClient]:
    upstream, gateway = raw
    upstream.reply = good
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        yield http
    upstream.reply = good


def good(request: RawRequest) -> list[Step]:
    return [http_response(sglang_answer(request, num_layers=NUM_LAYERS, topk=TOPK))]


def spoiled(change: Callable[[bytes], bytes]) -> Callable[[RawRequest], list[Step]]:
    """Answers whose JSON ``change`` spoils, unary or (for a streamed request) as the final chunk of a stream."""

    def reply(request: RawRequest) -> list[Step]:
        body = change(sglang_answer(request, num_layers=NUM_LAYERS, topk=TOPK))
        if not (request.json or {}).get("stream"):
            return [http_response(body)]
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return [head + chunked(sse_event(body), sse_event(b"[DONE]"))]

    return reply


def replace(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def change(body: bytes) -> bytes:
        assert old in body
        return body.replace(old, new, 1)

    return change


def meta_value(key: str, raw_value: bytes) -> Callable[[bytes], bytes]:
    """Set ``meta_info[key]`` to the raw JSON ``raw_value`` (which orjson itself could not always write)."""

    def change(body: bytes) -> bytes:
        found = re.search(rb'"%s":(?:"[^"]*"|[^,}]*)' % key.encode(), body)
        if found is None:
            return body.replace(b'"meta_info":{', b'"meta_info":{"%s":%s,' % (key.encode(), raw_value), 1)
        return body[: found.start()] + b'"%s":%s' % (key.encode(), raw_value) + body[found.end() :]

    return change


DEEP = b"[" * 300 + b"]" * 300
BAD_ANSWERS: dict[str, Callable[[bytes], bytes]] = {
    "cached_tokens >= 2**64": meta_value("cached_tokens", b"%d" % 2**64),
    "prompt_tokens >= 2**64": meta_value("prompt_tokens", b"%d" % 2**70),
    "spec counter >= 2**64": meta_value("spec_verify_ct", b"%d" % 2**64),
    "finish_reason nested 300 deep": replace(
        b'"finish_reason":{', b'"finish_reason":{"x":%s,' % (b"[" * 300 + b"]" * 300)
    ),
    "token id 10.7": replace(b"[-0.5,10,null]", b"[-0.5,10.7,null]"),
    "token id true": replace(b"[-0.5,10,null]", b"[-0.5,true,null]"),
    "log-prob a string": replace(b"[-0.5,10,null]", b'["-0.5",10,null]'),
    "positive log-prob": replace(b"[-0.5,10,null]", b"[0.5,10,null]"),
    "weight_version an object": meta_value("weight_version", b'{"v":1}'),
}


async def create(client: httpx.AsyncClient, **extra: Any) -> str:
    body = {"prompt_ids": PROMPT, "num_layers": NUM_LAYERS, "moe_router_topk": TOPK, **extra}
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


async def turn(client: httpx.AsyncClient, sid: str, *, stream: bool) -> tuple[int, dict[str, Any]]:
    """(HTTP status, the turn summary or error body); a streamed turn's result is its last event."""
    body = {"sampling_params": {"max_new_tokens": 2}, "stream": stream}
    if not stream:
        response = await client.post(f"/v1/sessions/{sid}/generate", json=body)
        return response.status_code, response.json()
    async with client.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        raw_events = b"".join([chunk async for chunk in response.aiter_bytes()])
    events = [orjson.loads(line[6:]) for line in raw_events.split(b"\n\n") if line.startswith(b"data: {")]
    return response.status_code, events[-1]


def safetensors_parts(body: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data): the header is a JSON object whose key order safetensors does not keep from call to call."""
    size = int.from_bytes(body[:8], "little")
    return orjson.loads(body[8 : 8 + size]), body[8 + size :]


async def snapshot(client: httpx.AsyncClient, sid: str) -> tuple[Any, ...]:
    view = (await client.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    view.pop("updated_at")
    sample = await client.get(f"/v1/sessions/{sid}/sample")
    group = await client.post("/v1/samples", json={"session_ids": [sid]})
    assert sample.status_code == group.status_code == 200
    return view, safetensors_parts(sample.content), safetensors_parts(group.content)


# ---- upstream answers: refused whole, the session unchanged ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("change", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
async def test_an_answer_that_cannot_be_stored_changes_nothing(
    raw: tuple[RawUpstream, Service], client: httpx.AsyncClient, change: Callable[[bytes], bytes], stream: bool
) -> None:
    upstream, _ = raw
    sid = await create(client)
    assert (await turn(client, sid, stream=False))[0] == 200
    before = await snapshot(client, sid)
    upstream.reply = spoiled(change)
    status, result = await turn(client, sid, stream=stream)
    upstream.reply = good
    if stream:
        assert status == 200 and result["type"] == "error"
        error = result["error"]
        assert result["turn"] is None  # nothing of it was folded
    else:
        assert status == 502
        error = result["error"]
    assert error["type"] == "upstream_protocol_error", error
    assert await snapshot(client, sid) == before
    status, summary = await turn(client, sid, stream=False)
    assert status == 200 and summary["turn"] == 1


# ---- client bodies: refused before anything is created or sent -------------------------------------------------------
BAD_CREATES: dict[str, bytes] = {
    "metadata int >= 2**64": b'{"prompt_ids": [1, 2], "metadata": {"n": %d}}' % 2**64,
    "metadata nested 100 deep": b'{"prompt_ids": [1, 2], "metadata": {"n": %s}}' % (b"[" * 100 + b"]" * 100),
    "metadata NaN": b'{"prompt_ids": [1, 2], "metadata": {"n": NaN}}',
    "metadata too big": b'{"prompt_ids": [1, 2], "metadata": {"n": "%s"}}' % (b"x" * 70_000),
    "custom_params a string": b'{"prompt_ids": [1, 2], "sampling_defaults": {"custom_params": "x"}}',
    "custom_params a list": b'{"prompt_ids": [1, 2], "sampling_defaults": {"custom_params": [1]}}',
    "sampling default 2**70": b'{"prompt_ids": [1, 2], "sampling_defaults": {"max_new_tokens": %d}}' % 2**70,
    "num_layers 10**9": b'{"prompt_ids": [1, 2], "num_layers": 1000000000, "moe_router_topk": 8}',
    "num_layers 10**30": b'{"prompt_ids": [1, 2], "num_layers": %d, "moe_router_topk": 8}' % 10**30,
    "moe_router_topk 10**6": b'{"prompt_ids": [1, 2], "num_layers": 4, "moe_router_topk": 1000000}',
}

BAD_TURNS: dict[str, bytes] = {
    "temperature NaN": b'{"sampling_params": {"temperature": NaN}}',
    "temperature Infinity": b'{"sampling_params": {"temperature": Infinity}}',
    "max_new_tokens 2**70": b'{"sampling_params": {"max_new_tokens": %d}}' % 2**70,
    "unknown key 2**70": b'{"sampling_params": {"some_new_knob": %d}}' % 2**70,
    "unknown key 1e400": b'{"sampling_params": {"some_new_knob": 1e400}}',
    "top_k 2**40": b'{"sampling_params": {"top_k": %d}}' % 2**40,
    "custom_params a string": b'{"sampling_params": {"custom_params": "x"}}',
    "stop a number": b'{"sampling_params": {"stop": 3}}',
    "top_p above 1": b'{"sampling_params": {"top_p": 1.5}}',
}


@pytest.fixture(scope="module")
def simulated(simulator: Service) -> Iterator[Service]:
    with run_gateway(simulator.url) as gateway:
        yield gateway


@pytest.fixture
async def sim_client(simulated: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=simulated.url, timeout=10) as http:
        yield http


@pytest.mark.parametrize("body", BAD_CREATES.values(), ids=BAD_CREATES.keys())
async def test_a_session_that_could_not_be_served_is_never_created(sim_client: httpx.AsyncClient, body: bytes) -> None:
    before = (await sim_client.get("/v1/sessions")).json()["count"]
    response = await sim_client.post("/v1/sessions", content=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == "invalid_request"
    assert (await sim_client.get("/v1/sessions")).json()["count"] == before


@pytest.mark.parametrize("body", BAD_TURNS.values(), ids=BAD_TURNS.keys())
async def test_sampling_params_that_cannot_be_sent_as_they_came_are_422(
    sim_client: httpx.AsyncClient, body: bytes
) -> None:
    response = await sim_client.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]})
    sid = response.json()["session_id"]
    before = await snapshot(sim_client, sid)
    response = await sim_client.post(f"/v1/sessions/{sid}/generate", content=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == "invalid_request"
    assert await snapshot(sim_client, sid) == before
    ok = await sim_client.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


async def test_unknown_sampling_params_are_forwarded_as_they_came(
    sim_client: httpx.AsyncClient, simulator: Service
) -> None:
    """SGLang knows more sampling params than the gateway types: plain ones pass, untouched."""
    sid = (await sim_client.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]})).json()["session_id"]
    sampling = {"max_new_tokens": 2, "frequency_penalty": 0.5, "json_schema": None, "some_new_knob": [1, {"a": 2}]}
    response = await sim_client.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": sampling})
    assert response.status_code == 200
    async with httpx.AsyncClient(base_url=simulator.url) as sim:
        logged = (await sim.get("/sim/requests")).json()
    sent = next(r["body"] for r in reversed(logged) if (r["body"] or {}).get("rid") == response.json()["rid"])
    assert {key: sent["sampling_params"][key] for key in sampling} == sampling


# ---- aborting a unary turn behind a router: the connection is closed -------------------------------------------------
async def test_aborting_a_unary_turn_behind_a_router_closes_its_connection(
    raw: tuple[RawUpstream, Service], client: httpx.AsyncClient
) -> None:
    """A router has no /abort_request (404): the gateway closes the turn's connection at once (which makes SGLang
    abort the request), and the session records an aborted turn."""
    upstream, _ = raw
    sid = await create(client)
    upstream.reply = lambda request: (
        [http_response(b'{"error": "no route"}', 404)] if request.path == "/abort_request" else [30.0]
    )
    pending = asyncio.create_task(client.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": {}}))
    await asyncio.sleep(0.3)
    started = asyncio.get_running_loop().time()
    abort = await client.post(f"/v1/sessions/{sid}/abort")
    answer = await pending
    assert asyncio.get_running_loop().time() - started < 2.0  # not the 3 s a worker gets to end the rid itself
    assert abort.status_code == 200 and abort.json()["aborted"] is True and abort.json()["finished"] is True
    assert answer.status_code == 200, answer.text
    summary = answer.json()
    assert summary["status"] == "aborted" and summary["completion_tokens"] == 0
    assert summary["finish_reason"]["type"] == "abort"
    paths = [request.path for request in upstream.requests[-2:]]
    assert paths == ["/generate", "/abort_request"]
    view = (await client.get(f"/v1/sessions/{sid}")).json()
    assert view["status"] == "aborted" and not view["busy"] and view["response_length"] == 0
    upstream.reply = good
    status, summary = await turn(client, sid, stream=False)
    assert status == 200 and summary["turn"] == 1 and summary["completion_tokens"] == 2


# ---- the full view ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [
        (0,),
        (1,),
        (5,),
        (FULL_VIEW_SLICE_ELEMENTS + 3,),
        (0, 4, 2),
        (7, 4, 2),
        (FULL_VIEW_SLICE_ELEMENTS // 8 + 5, 4, 2),
    ],
)
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float32])
def test_full_view_arrays_encode_in_slices_as_nested_lists(shape: tuple[int, ...], dtype: type) -> None:
    values = (np.arange(int(np.prod(shape))) % 200 - (50 if dtype is np.float32 else 0)).astype(dtype).reshape(shape)
    if dtype is np.float32:
        values = values / np.float32(3)
    decoded = orjson.loads(_json_array(values))
    assert np.array_equal(np.asarray(decoded, dtype=dtype).reshape(shape), values)
    assert len(decoded) == shape[0]


async def test_full_view_holds_every_array(sim_client: httpx.AsyncClient) -> None:
    body = {"prompt_ids": [1, 2, 3], "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    sid = (await sim_client.post("/v1/sessions", json=body)).json()["session_id"]
    sampling = {"max_new_tokens": 50, "ignore_eos": True, "custom_params": {"return_top_p_token_ids": True}}
    assert (
        await sim_client.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": sampling})
    ).status_code == 200
    view = (await sim_client.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    arrays = load((await sim_client.get(f"/v1/sessions/{sid}/sample")).content)
    assert set(view["full"]) == set(arrays)
    for name, values in arrays.items():
        assert np.array_equal(np.asarray(view["full"][name], dtype=values.dtype), values), name
    assert view["arrays"]["rollout_routed_experts"]["shape"] == [52, SIM_LAYERS, SIM_TOPK]
