"""End to end: the real gateway process in front of the real simulator process, over 127.0.0.1."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import numpy as np
import pybase64
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service
from procs import free_port
from safetensors.numpy import load as load_safetensors

PROMPT = [5, 6, 7, 8, 9, 10]
TOP_P = {"custom_params": {"return_top_p_token_ids": True}}


@pytest.fixture
async def gw(any_gateway: Service) -> httpx.AsyncClient:
    """The session API, against each session store (memory, Redis)."""
    async with httpx.AsyncClient(base_url=any_gateway.url, timeout=30) as client:
        yield client


@pytest.fixture
async def sim(simulator: Service) -> httpx.AsyncClient:
    async with httpx.AsyncClient(base_url=simulator.url, timeout=30) as client:
        yield client


async def new_session(gw: httpx.AsyncClient, prompt: list[int] = PROMPT, moe: bool = True, **extra: Any) -> str:
    body: dict[str, Any] = {"prompt_ids": prompt, **extra}
    if moe:
        body |= {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


async def turn(gw: httpx.AsyncClient, sid: str, max_new_tokens: int = 12, **sampling: Any) -> dict[str, Any]:
    response = await gw.post(
        f"/v1/sessions/{sid}/generate", json={"sampling_params": {"max_new_tokens": max_new_tokens, **sampling}}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def full_view(gw: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    response = await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})
    assert response.status_code == 200, response.text
    view = response.json()
    view.pop("updated_at")
    return view


async def fetch_sample(gw: httpx.AsyncClient, sid: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    response = await gw.get(f"/v1/sessions/{sid}/sample")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/vnd.safetensors"
    return load_safetensors(response.content), safetensors_metadata(response.content)


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    import json
    import struct

    (header_len,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + header_len])["__metadata__"]


def decode_routing(b64: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(b64), dtype="<i4").reshape(-1, SIM_LAYERS, SIM_TOPK)


# ---- health and passthrough ------------------------------------------------------------------------------------
async def test_health_reports_version_and_instance(gw: httpx.AsyncClient) -> None:
    body = (await gw.get("/health")).json()
    assert body["status"] == "ok"
    assert body["version"]
    assert len(body["instance_id"]) == 32


async def test_generate_passthrough_matches_upstream(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    request = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 8, **TOP_P},
        "return_logprob": True,
        "return_routed_experts": True,
        "rid": "fixed-rid",
    }
    via_gateway = await gw.post("/generate", json=request, headers={"X-Session-Id": "affinity-key"})
    direct = await sim.post("/generate", json=request)
    assert via_gateway.status_code == direct.status_code == 200
    a, b = via_gateway.json(), direct.json()
    for answer in (a, b):
        for key in ("e2e_latency", "response_sent_to_client_ts", "cached_tokens", "cached_tokens_details"):
            answer["meta_info"].pop(key, None)
    assert a == b
    log = (await sim.get("/sim/requests")).json()
    routed = [r for r in log if r["body"].get("rid") == "fixed-rid"]
    assert routed[0]["headers"].get("x-smg-routing-key") == "affinity-key"


async def test_passthrough_keeps_upstream_error_status_and_body(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    bad = {"sampling_params": {"max_new_tokens": 4}}  # neither input_ids nor text
    via_gateway = await gw.post("/generate", json=bad)
    direct = await sim.post("/generate", json=bad)
    assert via_gateway.status_code == direct.status_code == 400
    assert via_gateway.content == direct.content


@pytest.mark.parametrize("path", ["/get_model_info", "/get_server_info", "/health_generate"])
async def test_control_endpoints_forwarded(gw: httpx.AsyncClient, sim: httpx.AsyncClient, path: str) -> None:
    via_gateway, direct = await gw.get(path), await sim.get(path)
    assert via_gateway.status_code == direct.status_code == 200
    assert via_gateway.content == direct.content


async def test_abort_request_and_flush_cache_forwarded(gw: httpx.AsyncClient) -> None:
    assert (await gw.post("/abort_request", json={"rid": "nothing-running"})).status_code == 200
    assert (await gw.post("/flush_cache")).status_code == 200


# ---- sessions: the happy path -----------------------------------------------------------------------------------
async def test_multi_turn_session_with_tool_turns_and_replay(gw: httpx.AsyncClient, sim: httpx.AsyncClient) -> None:
    sid = await new_session(gw, metadata={"group": 3})
    first = await turn(gw, sid, **TOP_P)
    assert first["routed_experts_start_len"] == 0
    assert first["prompt_length"] == len(PROMPT)
    assert first["routed_experts_rows"] == len(PROMPT) + first["completion_tokens"] - 1
    tool = [900, 901, 902]
    appended = await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": tool, "text": " <tool>"})
    assert appended.status_code == 200, appended.text
    second = await turn(gw, sid, max_new_tokens=10)  # top-p stays on: the session already keeps spans
    assert second["top_p_replay"] is True
    # Incremental routing replay: only the rows the gateway did not hold yet were asked for.
    assert second["routed_experts_start_len"] == first["routed_experts_rows"]
    log = (await sim.get("/sim/requests")).json()
    sent = next(r for r in log if r["body"].get("rid", "").startswith(f"{sid}-"))
    assert sent["headers"]["x-smg-routing-key"] == sid

    arrays, meta = await fetch_sample(gw, sid)
    tokens = arrays["tokens"]
    expected_tokens = PROMPT + first["new_token_ids"] + tool + second["new_token_ids"]
    assert tokens.tolist() == expected_tokens
    assert tokens.dtype == np.int32
    n_first, n_second = first["completion_tokens"], second["completion_tokens"]
    assert arrays["loss_mask"].tolist() == [1] * n_first + [0] * len(tool) + [1] * n_second
    assert arrays["loss_mask"].dtype == np.uint8
    log_probs = arrays["rollout_log_probs"]
    assert log_probs.dtype == np.float32
    assert (log_probs[n_first : n_first + len(tool)] == 0).all()
    assert (log_probs[:n_first] < 0).all()
    offsets = arrays["rollout_top_p_token_offsets"]
    assert len(offsets) == int(meta["response_length"]) + 1
    assert offsets[-1] == len(arrays["rollout_top_p_token_ids"])
    assert (np.diff(offsets)[n_first : n_first + len(tool)] == 0).all()  # tool tokens: empty spans

    # The stored routing equals a single full-sequence call's routing (the simulator, like a prefix cache,
    # routes a position the same way every time).
    routing = arrays["rollout_routed_experts"]
    assert routing.dtype == np.uint8
    assert routing.shape == (len(tokens) - 1, SIM_LAYERS, SIM_TOPK)
    full = await sim.post(
        "/generate",
        json={"input_ids": expected_tokens, "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True},
    )
    reference = decode_routing(full.json()["meta_info"]["routed_experts"])
    np.testing.assert_array_equal(routing, reference[: len(tokens) - 1])

    assert meta["session_id"] == sid
    assert meta["status"] in {"completed", "truncated"}
    assert meta["status"] == second["status"]
    assert meta["prompt_tokens"] == str(first["prompt_tokens"] + second["prompt_tokens"])
    view = await full_view(gw, sid)
    assert view["metadata"] == {"group": 3}
    assert view["turns"] == 3
    assert view["full"]["tokens"] == expected_tokens
    assert view["arrays"]["rollout_routed_experts"] == {"shape": list(routing.shape), "dtype": "uint8"}
    assert view["response"] == first["text"] + " <tool>" + second["text"]
    assert view["weight_versions"] == [first["weight_version"], second["weight_version"]]


async def test_routing_rows_lag_after_trailing_tool_tokens(gw: httpx.AsyncClient) -> None:
    sid = await new_session(gw)
    first = await turn(gw, sid)
    await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [1, 2]})
    arrays, _ = await fetch_sample(gw, sid)
    assert arrays["rollout_routed_experts"].shape[0] == len(PROMPT) + first["completion_tokens"] - 1
    assert len(arrays["tokens"]) == len(PROMPT) + first["completion_tokens"] + 2


async def test_session_without_moe_shape_has_no_routing(gw: httpx.AsyncClient) -> None:
    sid = await new_session(gw, moe=False)
    summary = await turn(gw, sid)
    assert summary["routed_experts_start_len"] is None
    arrays, _ = await fetch_sample(gw, sid)
    assert "rollout_routed_experts" not in arrays
    assert "rollout_top_p_token_ids" not in arrays


async def test_group_fetch_and_list_and_delete(gw: httpx.AsyncClient) -> None:
    sids = [await new_session(gw) for _ in range(3)]
    for sid in sids:
        await turn(gw, sid)
    response = await gw.post("/v1/samples", json={"session_ids": sids})
    assert response.status_code == 200
    group = load_safetensors(response.content)
    for i, sid in enumerate(sids):
        single, _ = await fetch_sample(gw, sid)
        for name, array in single.items():
            np.testing.assert_array_equal(group[f"{i}/{name}"], array)
    listed = {s["session_id"] for s in (await gw.get("/v1/sessions")).json()["sessions"]}
    assert set(sids) <= listed
    assert (await gw.delete(f"/v1/sessions/{sids[0]}")).status_code == 204
    assert (await gw.get(f"/v1/sessions/{sids[0]}")).status_code == 404


# ---- bad input: clear errors, nothing changes --------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        {"generate": {}},  # no prompt_ids: a chat session, which has nothing to generate from yet
        {"prompt_ids": []},
        {"prompt_ids": [1, -2]},
        {"prompt_ids": [1, "2"]},
        {"prompt_ids": [1, 2.5]},
        {"prompt_ids": [True]},
        {"prompt_ids": [1], "num_layers": 4},
        {"prompt_ids": [1], "num_layers": 0, "moe_router_topk": 2},
        {"prompt_ids": [1], "unknown_field": 1},
        {"prompt_ids": [1], "session_id": "has space"},
    ],
)
async def test_create_rejects_bad_bodies(gw: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["message"]


async def test_malformed_json_is_422(gw: httpx.AsyncClient) -> None:
    response = await gw.post(
        "/v1/sessions", content=b'{"prompt_ids": [1,', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "invalid_request"


async def test_duplicate_and_unknown_sessions(gw: httpx.AsyncClient) -> None:
    sid = f"dup-{uuid.uuid4().hex[:6]}"
    await new_session(gw, session_id=sid)
    again = await gw.post("/v1/sessions", json={"prompt_ids": [1], "session_id": sid})
    assert again.status_code == 409
    assert again.json()["error"]["type"] == "session_exists"
    for method, path, body in [
        ("GET", "/v1/sessions/nope", None),
        ("GET", "/v1/sessions/nope/sample", None),
        ("POST", "/v1/sessions/nope/generate", {}),
        ("POST", "/v1/sessions/nope/append", {"token_ids": [1]}),
        ("DELETE", "/v1/sessions/nope", None),
        ("POST", "/v1/samples", {"session_ids": [sid, "nope"]}),
    ]:
        response = await gw.request(method, path, json=body)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["type"] == "session_not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": []},
        {"token_ids": [-1]},
        {"token_ids": ["a"]},
        {"token_ids": [1], "text": 5},
        {"tokens": [1]},
    ],
)
async def test_bad_append_changes_nothing(gw: httpx.AsyncClient, body: dict[str, Any]) -> None:
    sid = await new_session(gw)
    await turn(gw, sid)
    before = await full_view(gw, sid)
    response = await gw.post(f"/v1/sessions/{sid}/append", json=body)
    assert response.status_code == 422
    assert await full_view(gw, sid) == before


@pytest.mark.parametrize(
    "body",
    [
        {"sampling_params": "fast"},
        {"return_routed_experts": "yes"},
        {"sampling_params": {"custom_params": [1]}},
        {"sampling_params": {}, "extra": 1},
    ],
)
async def test_bad_turn_bodies_are_422(gw: httpx.AsyncClient, body: dict[str, Any]) -> None:
    sid = await new_session(gw)
    response = await gw.post(f"/v1/sessions/{sid}/generate", json=body)
    assert response.status_code == 422, response.text


async def test_routing_without_moe_shape_is_a_conflict(gw: httpx.AsyncClient) -> None:
    sid = await new_session(gw, moe=False)
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={"return_routed_experts": True})
    assert response.status_code == 409  # a valid body this session cannot take
    assert "num_layers" in response.json()["error"]["message"]


async def test_top_p_cannot_start_mid_session(gw: httpx.AsyncClient) -> None:
    sid = await new_session(gw)
    await turn(gw, sid)
    before = await full_view(gw, sid)
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": TOP_P})
    assert response.status_code == 409
    assert "top-p" in response.json()["error"]["message"]
    assert await full_view(gw, sid) == before


# ---- upstream failures: 502/503/504 and the session exactly as before --------------------------------------------
@pytest.mark.parametrize(
    ("mode", "status", "error_type", "needle"),
    [
        ("bad_base64", 502, "upstream_protocol_error", "base64"),
        ("wrong_rows", 502, "upstream_protocol_error", "routed_experts has"),
        ("bad_offsets", 502, "upstream_protocol_error", "top_p_token_offsets"),
        ("missing_logprobs", 502, "upstream_protocol_error", "output_token_logprobs"),
        ("null_logprob", 502, "upstream_protocol_error", "non-finite log-prob"),
        ("malformed_json", 502, "upstream_protocol_error", "not valid JSON"),
        ("drop_routing", 502, "replay_data_dropped", "strips return_routed_experts"),
        ("drop_top_p", 502, "replay_data_dropped", "top-p"),
        ("http_500", 502, "upstream_error", "simulated internal error"),
        ("http_503", 503, "upstream_unavailable", "503"),
        ("http_400", 400, "upstream_rejected", "400"),
    ],
)
async def test_upstream_faults_leave_session_unchanged(
    gw: httpx.AsyncClient, sim_faults: Any, mode: str, status: int, error_type: str, needle: str
) -> None:
    sid = await new_session(gw)
    await turn(gw, sid, **TOP_P)
    await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [3, 4]})
    before = await full_view(gw, sid)
    await sim_faults(mode)
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": {"max_new_tokens": 8}})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type
    assert needle in error["message"]
    assert await full_view(gw, sid) == before
    # ... and the session keeps working once the upstream behaves again.
    await turn(gw, sid)


async def test_upstream_ignoring_start_len_is_handled(
    gw: httpx.AsyncClient, sim: httpx.AsyncClient, sim_faults: Any
) -> None:
    sid = await new_session(gw)
    await turn(gw, sid)
    await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [3, 4]})
    await sim_faults("ignore_start_len")
    summary = await turn(gw, sid)
    assert summary["routed_experts_start_len"] > 0
    arrays, _ = await fetch_sample(gw, sid)
    tokens = arrays["tokens"].tolist()
    full = await sim.post(
        "/generate", json={"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True}
    )
    np.testing.assert_array_equal(
        arrays["rollout_routed_experts"], decode_routing(full.json()["meta_info"]["routed_experts"])[: len(tokens) - 1]
    )


async def test_second_turn_while_one_runs_is_409(gw: httpx.AsyncClient, sim_faults: Any) -> None:
    sid = await new_session(gw)
    await sim_faults("delay", delay_s=1.0)
    first = asyncio.create_task(gw.post(f"/v1/sessions/{sid}/generate", json={}))
    await asyncio.sleep(0.3)
    second = await gw.post(f"/v1/sessions/{sid}/generate", json={})
    append = await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [1]})
    delete = await gw.delete(f"/v1/sessions/{sid}")
    assert second.status_code == append.status_code == delete.status_code == 409
    assert second.json()["error"]["type"] == "session_busy"
    assert (await first).status_code == 200
    assert (await gw.get(f"/v1/sessions/{sid}")).json()["turns"] == 1


async def test_unreachable_upstream_is_503(start_gateway: Any) -> None:
    with start_gateway(f"http://127.0.0.1:{free_port()}") as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            sid = (await client.post("/v1/sessions", json={"prompt_ids": [1, 2]})).json()["session_id"]
            response = await client.post(f"/v1/sessions/{sid}/generate", json={})
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "upstream_unavailable"
            view = (await client.get(f"/v1/sessions/{sid}")).json()
            assert view["total_tokens"] == 2 and view["turns"] == 0
            passthrough = await client.post("/generate", json={"input_ids": [1]})
            assert passthrough.status_code == 503


async def test_slow_upstream_is_504(start_gateway: Any, simulator: Service, sim_faults: Any) -> None:
    with start_gateway(simulator.url, "--request-timeout-s", "0.5") as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            sid = (await client.post("/v1/sessions", json={"prompt_ids": [1, 2]})).json()["session_id"]
            await sim_faults("delay", delay_s=2.0)
            response = await client.post(f"/v1/sessions/{sid}/generate", json={})
            assert response.status_code == 504
            assert response.json()["error"]["type"] == "upstream_timeout"
            assert (await client.get(f"/v1/sessions/{sid}")).json()["turns"] == 0


# ---- metrics ------------------------------------------------------------------------------------------------------
def metric_value(scrape: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text scrape (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def test_metrics_count_requests_errors_and_sessions(gw: httpx.AsyncClient, sim_faults: Any) -> None:
    before = (await gw.get("/metrics")).text
    sid = await new_session(gw)
    await turn(gw, sid)
    await sim_faults("wrong_rows")
    assert (await gw.post(f"/v1/sessions/{sid}/generate", json={})).status_code == 502
    response = await gw.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    after = response.text

    def grew(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    route = "/v1/sessions/{session_id}/generate"
    assert grew("gateway_requests_total", route=route, method="POST", status="200") == 1
    assert grew("gateway_requests_total", route=route, method="POST", status="502") == 1
    assert grew("gateway_request_duration_seconds_count", route=route, method="POST") == 2
    assert grew("gateway_upstream_errors_total", kind="upstream_protocol_error") == 1
    assert grew("gateway_replay_validation_failures_total", reason="routing_element_count") == 1
    assert grew("gateway_upstream_duration_seconds_count", call="generate") == 2
    assert grew("gateway_decode_duration_seconds_count", kind="answer") == 2
    assert grew("gateway_decoded_bytes_total", kind="answer") > 0
    assert metric_value(after, "gateway_sessions_stored") >= 1
    assert metric_value(after, "gateway_stored_bytes") > 0


async def test_json_bodies_need_no_json_content_type(gw: httpx.AsyncClient) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded; the body is still JSON, as SGLang accepts."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    created = await gw.post("/v1/sessions", content=b'{"prompt_ids": [1, 2, 3]}', headers=form)
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    turn = await gw.post(
        f"/v1/sessions/{sid}/generate", content=b'{"sampling_params": {"max_new_tokens": 3}}', headers=form
    )
    assert turn.status_code == 200, turn.text
    empty = await gw.post(f"/v1/sessions/{sid}/generate", headers=form)  # no body: every default
    assert empty.status_code == 200, empty.text
