"""The real engine tier (`make test-sglang`): the gateway in front of a real SGLang 0.5.23 server on CPU.

The engine is the tiny random Qwen3-MoE of scripts/real_sglang/ (2 layers, 8 experts, top-2, token ids < 512),
installed into .sglang-cpu by its setup.sh and started here by its run.sh with --enable-return-routed-experts (about
35 s). Excluded from `make test` (pyproject addopts: -m 'not sglang ...'); `make test-sglang` runs setup.sh, then
`pytest -m sglang`. Set SGLANG_DIR to use another install folder.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pybase64
import pytest
from conftest import Service, run_gateway
from procs import REPO_ROOT, free_port, start_process
from safetensors.numpy import load as load_safetensors

pytestmark = pytest.mark.sglang

SCRIPTS = REPO_ROOT / "scripts" / "real_sglang"
ENGINE_DIR = Path(os.environ.get("SGLANG_DIR", REPO_ROOT / ".sglang-cpu"))
# ~35 s on an idle 2-core machine, a minute or two when the machine is busy.
STARTUP_TIMEOUT_S = float(os.environ.get("SGLANG_STARTUP_TIMEOUT_S", "300"))
HEALTH_REQUEST_TIMEOUT_S = 30.0
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
TOOL = [300, 301, 302, 303]  # tool/environment tokens: any id of the 512-token vocabulary
SAMPLING = {"max_new_tokens": 6}


@dataclass(frozen=True)
class Engine:
    url: str
    num_layers: int
    topk: int
    num_experts: int
    vocab_size: int


def engine_unavailable_reason() -> str | None:
    if not (ENGINE_DIR / "venv" / "bin" / "python").exists() or not (ENGINE_DIR / "model" / "config.json").exists():
        return f"no engine installed in {ENGINE_DIR}: run `make test-sglang` (setup.sh, ~3 min, ~3 GB)"
    return None


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    reason = engine_unavailable_reason()
    if reason:
        pytest.skip(reason)
    config = json.loads((ENGINE_DIR / "model" / "config.json").read_text())
    port = free_port()
    args = ["bash", str(SCRIPTS / "run.sh"), str(ENGINE_DIR), str(port), "--enable-return-routed-experts"]
    # SGLang's /health runs a one-token generation (about 1 s on a busy 2-core machine): polling it every 50 ms with
    # a 1 s timeout, as start_process does, piles up generations until the scheduler never catches up. So wait for
    # the HTTP server on the cheap /model_info, then poll /health slowly.
    with start_process(args, port, health_path="/model_info", timeout=STARTUP_TIMEOUT_S) as proc:
        wait_engine_healthy(proc.url)
        yield Engine(
            url=proc.url,
            num_layers=config["num_hidden_layers"],
            topk=config["num_experts_per_tok"],
            num_experts=config.get("num_experts") or config["num_local_experts"],  # transformers 5 renamed it
            vocab_size=config["vocab_size"],
        )


def wait_engine_healthy(url: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Until `GET /health` answers 200 (503 while the engine warms up), one request at a time, a second apart."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=HEALTH_REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TimeoutException:
                pass
            time.sleep(1.0)
    raise TimeoutError(f"the engine at {url} did not report healthy within {timeout} s")


@pytest.fixture(scope="module")
def engine_gateway(engine: Engine) -> Iterator[Service]:
    with run_gateway(engine.url, "--log-level", "warning") as service:
        yield service


@pytest.fixture
async def gw(engine_gateway: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine_gateway.url, timeout=120) as client:
        yield client


@pytest.fixture
async def direct(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
        yield client


# ---- helpers -----------------------------------------------------------------------------------------------------
async def new_session(gw: httpx.AsyncClient, engine: Engine) -> str:
    body = {
        "prompt_ids": PROMPT,
        "num_layers": engine.num_layers,
        "moe_router_topk": engine.topk,
        "sampling_defaults": SAMPLING,
    }
    response = await gw.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


async def model_turn(gw: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    response = await gw.post(f"/v1/sessions/{sid}/generate", json={})
    assert response.status_code == 200, response.text
    return response.json()


async def tool_turn(gw: httpx.AsyncClient, sid: str, tokens: list[int]) -> None:
    response = await gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": tokens, "text": " <tool>"})
    assert response.status_code == 200, response.text


async def fetch_sample(gw: httpx.AsyncClient, sid: str) -> dict[str, np.ndarray]:
    response = await gw.get(f"/v1/sessions/{sid}/sample")
    assert response.status_code == 200, response.text
    return load_safetensors(response.content)


async def full_sequence_routing(direct: httpx.AsyncClient, engine: Engine, tokens: list[int]) -> np.ndarray:
    """The engine's routing for `tokens` in one call (max_new_tokens 1): [len(tokens), L, K]."""
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True}
    response = await direct.post("/generate", json=body)
    assert response.status_code == 200, response.text
    raw = pybase64.b64decode(response.json()["meta_info"]["routed_experts"], validate=True)
    return np.frombuffer(raw, dtype="<i4").reshape(-1, engine.num_layers, engine.topk)


# ---- sessions against the real engine ----------------------------------------------------------------------------
async def test_multi_turn_session_with_tool_turns(
    gw: httpx.AsyncClient, direct: httpx.AsyncClient, engine: Engine
) -> None:
    sid = await new_session(gw, engine)
    expected = list(PROMPT)
    turns = []
    for tool in (TOOL, TOOL[:1], None):
        summary = await model_turn(gw, sid)
        rows_before = summary["routed_experts_start_len"]
        # Incremental replay: the engine was asked only for rows it had not sent, and sent exactly those.
        assert rows_before == (0 if not turns else turns[-1]["routed_experts_rows"])
        assert summary["routed_experts_rows_received"] == summary["total_tokens"] - 1 - rows_before
        assert summary["routed_experts_rows"] == summary["total_tokens"] - 1
        expected += summary["new_token_ids"]
        turns.append(summary)
        if tool:
            await tool_turn(gw, sid, tool)
            expected += tool
    assert turns[1]["routed_experts_start_len"] > 0

    arrays = await fetch_sample(gw, sid)
    tokens = arrays["tokens"].tolist()
    assert tokens == expected
    assert all(0 <= t < engine.vocab_size for t in tokens)
    model_mask = [1] * turns[0]["completion_tokens"] + [0] * len(TOOL)
    model_mask += [1] * turns[1]["completion_tokens"] + [0] + [1] * turns[2]["completion_tokens"]
    assert arrays["loss_mask"].tolist() == model_mask
    log_probs = arrays["rollout_log_probs"]
    assert np.isfinite(log_probs).all()
    assert (log_probs[np.asarray(model_mask) == 0] == 0).all()
    assert (log_probs[np.asarray(model_mask) == 1] < 0).all()

    routing = arrays["rollout_routed_experts"]
    assert routing.shape == (len(tokens) - 1, engine.num_layers, engine.topk) == (len(tokens) - 1, 2, 2)
    assert int(routing.max()) < engine.num_experts
    # Stored routing, assembled from incremental answers, equals one full-sequence call's routing.
    reference = await full_sequence_routing(direct, engine, tokens)
    np.testing.assert_array_equal(routing, reference[: len(tokens) - 1])

    view = (await gw.get(f"/v1/sessions/{sid}")).json()
    assert view["arrays"]["rollout_routed_experts"]["shape"] == [len(tokens) - 1, 2, 2]
    assert view["turns"] == 5
    # Per-token weight versions, from the engine's weight_versions spans (no update ran: one version, "default").
    assert view["weight_version_table"] == ["default"]
    assert arrays["rollout_weight_version_ids"].tolist() == [0 if m else -1 for m in model_mask]


async def test_trailing_tool_tokens_leave_routing_rows_behind(gw: httpx.AsyncClient, engine: Engine) -> None:
    sid = await new_session(gw, engine)
    summary = await model_turn(gw, sid)
    await tool_turn(gw, sid, TOOL)
    arrays = await fetch_sample(gw, sid)
    assert len(arrays["tokens"]) == summary["total_tokens"] + len(TOOL)
    assert arrays["rollout_routed_experts"].shape == (summary["total_tokens"] - 1, 2, 2)


async def test_passthrough_stream_reaches_done(gw: httpx.AsyncClient, engine: Engine) -> None:
    request = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
        "stream": True,
    }
    events = []
    async with gw.stream("POST", "/generate", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 5}
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    rows = len(PROMPT) + 5 - 1
    assert len(pybase64.b64decode(final["routed_experts"])) == rows * engine.num_layers * engine.topk * 4


# ---- a chat session ------------------------------------------------------------------------------------------
# The engine's word-level vocabulary ("w0" ... "w508", whitespace-split) has no markup, so the gateway gets the model's
# tokenizer with a chat template made of words and its special tokens: every rendered token is one the model knows.
CHAT_TEMPLATE = (
    "{% set roles = {'system': 'w502', 'user': 'w500', 'assistant': 'w501', 'tool': 'w503'} %}"
    "{% for m in messages %}{{ roles[m['role']] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}w501 {% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine model's tokenizer with the template above."""
    out = tmp_path_factory.mktemp("engine-tokenizer")
    (out / "tokenizer.json").write_bytes((ENGINE_DIR / "model" / "tokenizer.json").read_bytes())
    config = json.loads((ENGINE_DIR / "model" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


async def test_a_chat_session_against_the_engine(
    engine: Engine, chat_tokenizer: Path, direct: httpx.AsyncClient
) -> None:
    """Two OpenAI chat turns through the gateway: the engine sees the session's tokens plus only the new rendered
    message, and the stored routing equals a full-sequence call's."""
    import openai

    with run_gateway(engine.url, "--tokenizer", str(chat_tokenizer), "--log-level", "warning") as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as gw:
            moe = {"num_layers": engine.num_layers, "moe_router_topk": engine.topk}
            created = await gw.post("/v1/sessions", json=moe)
            assert created.status_code == 201, created.text
            sid = created.json()["session_id"]
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="-", timeout=120)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "w1 w2 w3"}]
            first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "w4 w5"},
            ]
            second = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
            arrays = await fetch_sample(gw, sid)
            view = (await gw.get(f"/v1/sessions/{sid}")).json()
    tokens = arrays["tokens"].tolist()
    assert all(0 <= t < engine.vocab_size for t in tokens)
    assert len(tokens) == second.usage.prompt_tokens + second.usage.completion_tokens
    assert [t["kind"] for t in view["turn_log"]] == ["model", "tool", "model"]
    mask = arrays["loss_mask"].tolist()
    assert sum(mask) == first.usage.completion_tokens + second.usage.completion_tokens
    assert mask[: first.usage.completion_tokens] == [1] * first.usage.completion_tokens
    routing = arrays["rollout_routed_experts"]
    assert routing.shape == (len(tokens) - 1, engine.num_layers, engine.topk)
    reference = await full_sequence_routing(direct, engine, tokens)
    np.testing.assert_array_equal(routing, reference[: len(tokens) - 1])


# ---- a weight update mid-turn: slime's sequence, SGLang's abort mode --------------------------------------------
async def test_a_turn_the_engine_aborts_for_a_weight_update_is_resumed(
    gw: httpx.AsyncClient, direct: httpx.AsyncClient, engine: Engine
) -> None:
    """While a streamed token-level turn (resume on) generates, the engine is paused in SGLang's default mode (abort),
    its weight version bumped and continued, as slime does around an update: the turn comes back whole, one turn,
    resumed once, its versions switching where the pause landed; the routing rows assembled across the seam equal
    one full-sequence call's (the weights themselves did not change here, only their version)."""
    sid = await new_session(gw, engine)
    n = 160
    body = {"sampling_params": {"max_new_tokens": n, "ignore_eos": True}, "stream": True, "resume": True}
    events: list[dict[str, Any]] = []
    async with gw.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        assert response.status_code == 200
        paused = False
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if not paused and sum(e["type"] == "delta" for e in events) >= 3:
                paused = True  # mid-answer: slime's sequence around a weight update
                assert (await direct.post("/pause_generation", json={})).status_code == 200
                assert (await direct.post("/flush_cache")).status_code == 200
                update = {"new_version": "after-update", "abort_all_requests": False}
                assert (await direct.post("/update_weight_version", json=update)).status_code == 200
                assert (await direct.post("/continue_generation", json={})).status_code == 200
    summary = events[-1]
    assert summary["type"] == "turn", summary
    streamed = [t for e in events if e["type"] == "delta" for t in e["token_ids"]]
    assert streamed == summary["new_token_ids"] and len(streamed) == n  # nothing repeated or missing
    assert (summary["resumed"], summary["status"]) == (1, "truncated")
    view = (await gw.get(f"/v1/sessions/{sid}")).json()
    (turn,) = view["turn_log"]
    spans = turn["weight_version_spans"]
    assert [s["version"] for s in spans] == ["default", "after-update"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    assert 0 < spans[1]["start"] < n and turn["resumed"] == 1
    arrays = await fetch_sample(gw, sid)
    tokens = arrays["tokens"].tolist()
    assert len(tokens) == len(PROMPT) + n and arrays["loss_mask"].all()
    routing = arrays["rollout_routed_experts"]
    assert routing.shape == (len(tokens) - 1, engine.num_layers, engine.topk)
    reference = await full_sequence_routing(direct, engine, tokens)
    np.testing.assert_array_equal(routing, reference[: len(tokens) - 1])
