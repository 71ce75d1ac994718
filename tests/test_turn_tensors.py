"""One round trip per model turn: a turn can answer with its own tensors, a session can be created with its first
turn, a caller that keeps its own copy of the tokens can skip asking for the session's state (``sync``), and a group
of samples is streamed from the sessions' arrays. Real gateway and simulator processes over 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service
from safetensors import safe_open
from safetensors.numpy import load

from gateway.codec import safetensors_stream

TENSORS = {"accept": "application/vnd.safetensors"}
TOP_P = {"custom_params": {"return_top_p_token_ids": True}}
MOE = {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}


@pytest.fixture
async def gw(gateway: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        yield client


def metadata_of(body: bytes) -> dict[str, str]:
    size = int.from_bytes(body[:8], "little")
    return orjson.loads(body[8 : 8 + size]).get("__metadata__", {})


async def sample_of(gw: httpx.AsyncClient, sid: str) -> dict[str, np.ndarray]:
    response = await gw.get(f"/v1/sessions/{sid}/sample")
    assert response.status_code == 200
    return load(response.content)


async def tensor_turn(gw: httpx.AsyncClient, sid: str, body: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    response = await gw.post(f"/v1/sessions/{sid}/generate", json=body, headers=TENSORS)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/vnd.safetensors")
    metadata = metadata_of(response.content)
    return load(response.content), metadata | orjson.loads(metadata["turn"])


# ---- a turn's own tensors --------------------------------------------------------------------------------------------
async def test_turn_tensors_rebuild_the_sample_without_a_fetch(gw: httpx.AsyncClient) -> None:
    """A caller that keeps the prompt and folds each turn's tensors slime's way ends with the session's sample."""
    prompt = [5, 6, 7, 8]
    sid = (await gw.post("/v1/sessions", json={"prompt_ids": prompt, **MOE})).json()["session_id"]
    tokens, log_probs, loss_mask = list(prompt), np.empty(0, np.float32), np.empty(0, np.uint8)
    spans_ids, spans_offsets = np.empty(0, np.int32), np.zeros(1, np.int32)
    routing = np.empty((0, SIM_LAYERS, SIM_TOPK), np.int64)
    version_ids = np.empty(0, np.int32)
    for turn_number in range(3):
        sampling = {"max_new_tokens": 6, "ignore_eos": True, **TOP_P}
        arrays, meta = await tensor_turn(gw, sid, {"sampling_params": sampling})
        assert meta["turn"] == 2 * turn_number and meta["completion_tokens"] == len(arrays["tokens"]) == 6
        assert "new_token_ids" not in meta  # the tensors carry them
        tokens += arrays["tokens"].tolist()
        log_probs = np.concatenate([log_probs, arrays["rollout_log_probs"]])
        loss_mask = np.concatenate([loss_mask, arrays["loss_mask"]])
        spans_ids = np.concatenate([spans_ids, arrays["rollout_top_p_token_ids"]])
        spans_offsets = np.concatenate([spans_offsets, arrays["rollout_top_p_token_offsets"][1:] + spans_offsets[-1]])
        first_row = int(meta["routed_experts_first_row"])
        assert first_row == (0 if turn_number == 0 else len(routing))  # incremental replay: only the new rows
        routing = np.concatenate([routing[:first_row], arrays["rollout_routed_experts"].astype(np.int64)])
        assert len(orjson.loads(meta["weight_version_table"])) == 1  # one weight version all along
        version_ids = np.concatenate([version_ids, arrays["rollout_weight_version_ids"], np.full(2, -1, np.int32)])
        tool = [900 + turn_number, 901]
        append = await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": tool})
        assert append.status_code == 200
        tokens += tool
        log_probs = np.concatenate([log_probs, np.zeros(2, np.float32)])
        loss_mask = np.concatenate([loss_mask, np.zeros(2, np.uint8)])
        spans_offsets = np.concatenate([spans_offsets, np.repeat(spans_offsets[-1:], 2)])
    sample = await sample_of(gw, sid)
    assert sample["tokens"].tolist() == tokens
    assert np.array_equal(sample["rollout_log_probs"], log_probs)
    assert np.array_equal(sample["loss_mask"], loss_mask)
    assert np.array_equal(sample["rollout_top_p_token_ids"], spans_ids)
    assert np.array_equal(sample["rollout_top_p_token_offsets"], spans_offsets)
    assert np.array_equal(sample["rollout_routed_experts"].astype(np.int64), routing)
    assert np.array_equal(sample["rollout_weight_version_ids"], version_ids)


async def test_without_the_accept_header_a_turn_answers_json(gw: httpx.AsyncClient) -> None:
    sid = (await gw.post("/v1/sessions", json={"prompt_ids": [1, 2]})).json()["session_id"]
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": {"max_new_tokens": 2}})
    assert response.headers["content-type"].startswith("application/json")
    assert len(response.json()["new_token_ids"]) == response.json()["completion_tokens"]


# ---- a session and its first turn in one call ------------------------------------------------------------------------
@pytest.mark.parametrize("tensors", [False, True], ids=["json", "tensors"])
async def test_create_with_the_first_turn(gw: httpx.AsyncClient, tensors: bool) -> None:
    body = {"prompt_ids": [3, 4, 5], **MOE, "generate": {"sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}}
    response = await gw.post("/v1/sessions", json=body, headers=TENSORS if tensors else None)
    assert response.status_code == 201, response.text
    if tensors:
        arrays = load(response.content)
        summary = orjson.loads(metadata_of(response.content)["turn"])
        assert len(arrays["tokens"]) == 4
        assert arrays["rollout_routed_experts"].shape == (3 + 4 - 1, SIM_LAYERS, SIM_TOPK)  # the prompt's rows too
    else:
        summary = response.json()
    assert summary["turn"] == 0 and summary["status"] == "truncated"
    sample = await sample_of(gw, summary["session_id"])
    assert len(sample["tokens"]) == 7


DELETE_CASES = [("never", "truncated", True), ("always", "truncated", False), ("if_finished", "truncated", False)]


@pytest.mark.parametrize(("policy", "status", "kept"), DELETE_CASES)
async def test_delete_after_turn(gw: httpx.AsyncClient, policy: str, status: str, kept: bool) -> None:
    turn = {"sampling_params": {"max_new_tokens": 2, "ignore_eos": True}, "delete_after_turn": policy}
    response = await gw.post("/v1/sessions", json={"prompt_ids": [1, 2], "generate": turn})
    assert response.status_code == 201 and response.json()["status"] == status
    found = await gw.get(f"/v1/sessions/{response.json()['session_id']}")
    assert found.status_code == (200 if kept else 404)


async def test_if_finished_keeps_an_aborted_sample(gw: httpx.AsyncClient, sim_faults: Callable[..., Any]) -> None:
    """slime resumes aborted samples (partial rollout): their session stays."""
    await sim_faults("abort")
    turn = {"sampling_params": {"max_new_tokens": 8, "ignore_eos": True}, "delete_after_turn": "if_finished"}
    response = await gw.post("/v1/sessions", json={"prompt_ids": [1, 2], "generate": turn})
    assert response.status_code == 201 and response.json()["status"] == "aborted"
    assert (await gw.get(f"/v1/sessions/{response.json()['session_id']}")).status_code == 200


async def test_a_failed_first_turn_leaves_no_session(gw: httpx.AsyncClient, sim_faults: Callable[..., Any]) -> None:
    """All or nothing: the same call can be sent again as it is."""
    body = {"prompt_ids": [1, 2], "session_id": "first-turn-fails", "generate": {"sampling_params": {}}}
    await sim_faults("http_500")
    failed = await gw.post("/v1/sessions", json=body)
    assert failed.status_code == 502 and failed.json()["error"]["type"] == "upstream_error"
    assert (await gw.get("/v1/sessions/first-turn-fails")).status_code == 404
    again = await gw.post("/v1/sessions", json=body)
    assert again.status_code == 201 and again.json()["session_id"] == "first-turn-fails"


@pytest.mark.parametrize(
    "generate",
    [{"stream": True}, {"sync": {"total_tokens": 2}}, {"sampling_params": {}, "delete_after_turn": "sometimes"}],
    ids=["stream", "sync", "unknown policy"],
)
async def test_first_turn_options_that_make_no_sense(gw: httpx.AsyncClient, generate: dict[str, Any]) -> None:
    before = (await gw.get("/v1/sessions")).json()["count"]
    response = await gw.post("/v1/sessions", json={"prompt_ids": [1, 2], "generate": generate})
    assert response.status_code == 422
    assert (await gw.get("/v1/sessions")).json()["count"] == before


# ---- sync: the caller's copy of the tokens ---------------------------------------------------------------------------
async def test_sync_lets_a_turn_go_straight_ahead_or_says_what_the_session_holds(gw: httpx.AsyncClient) -> None:
    sid = (await gw.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]})).json()["session_id"]
    ok = await gw.post(
        f"/v1/sessions/{sid}/generate",
        json={
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
            "sync": {"total_tokens": 3, "last_tokens": [2, 3]},
        },
    )
    assert ok.status_code == 200
    held = [1, 2, 3, *ok.json()["new_token_ids"]]
    before = (await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    for sync in (
        {"total_tokens": 3},
        {"total_tokens": 5, "last_tokens": [9, 9]},
        {"total_tokens": 6, "last_tokens": [1]},
    ):
        refused = await gw.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": {}, "sync": sync})
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["type"] == "session_mismatch" and error["total_tokens"] == len(held)
        assert error["last_tokens"] == held[len(held) - len(sync.get("last_tokens", [])) :]
        appended = await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [7], "sync": sync})
        assert appended.status_code == 409
    after = (await gw.get(f"/v1/sessions/{sid}", params={"full": "true"})).json()
    before.pop("updated_at"), after.pop("updated_at")
    assert after == before
    appended = await gw.post(
        f"/v1/sessions/{sid}/append", json={"token_ids": [7], "sync": {"total_tokens": 5, "last_tokens": held[-3:]}}
    )
    assert appended.status_code == 200 and appended.json()["total_tokens"] == 6


# ---- a group, streamed -----------------------------------------------------------------------------------------------
async def test_group_fetch_streams_every_sample_as_its_own_fetch_shows_it(gw: httpx.AsyncClient) -> None:
    sids = []
    for prompt in ([1, 2], [3, 4, 5], [6]):
        body = {"prompt_ids": prompt, **MOE, "generate": {"sampling_params": {"max_new_tokens": 3, **TOP_P}}}
        sids.append((await gw.post("/v1/sessions", json=body)).json()["session_id"])
    response = await gw.post("/v1/samples", json={"session_ids": sids})
    assert response.status_code == 200
    assert int(response.headers["content-length"]) == len(response.content)
    group = load(response.content)
    for i, sid in enumerate(sids):
        alone = await sample_of(gw, sid)
        assert {name.split("/", 1)[1] for name in group if name.startswith(f"{i}/")} == set(alone)
        for name, values in alone.items():
            assert np.array_equal(group[f"{i}/{name}"], values) and group[f"{i}/{name}"].dtype == values.dtype


@pytest.mark.parametrize("empty", [False, True])
def test_the_streamed_layout_is_what_the_safetensors_package_reads(tmp_path: Any, empty: bool) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "a/u8": rng.integers(0, 255, (7, 3, 2)).astype(np.uint8),
        "b/f32": rng.random(5).astype(np.float32),
        "c/i32": np.arange(0 if empty else 9, dtype=np.int32),
        "d/u16": rng.integers(0, 60_000, 4).astype(np.uint16),
        "e/i64": np.arange(3, dtype=np.int64),
    }
    stream = safetensors_stream(arrays, {"k": "v", "samples": "[]"})
    body = b"".join(bytes(chunk) for chunk in stream.chunks())
    assert len(body) == stream.size and (int.from_bytes(body[:8], "little") + 8) % 8 == 0
    loaded = load(body)
    assert set(loaded) == set(arrays)
    for name, values in arrays.items():
        assert loaded[name].dtype == values.dtype and np.array_equal(loaded[name], values)
    path = tmp_path / "group.safetensors"
    path.write_bytes(body)
    with safe_open(str(path), framework="numpy") as opened:
        assert opened.metadata() == {"k": "v", "samples": "[]"}
