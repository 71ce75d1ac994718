"""``GatewayAdapter``: slime's adapter API over a real gateway and simulator, driven by the real OpenAI and Anthropic
clients on ``adapter.base_url(sid)``.

``finish_session`` must return, per branch with a trained token, a copy of the base sample holding exactly what the
session held (read raw just before the finish), in slime's shape (``slime_shapes.check_fan_out``); then the session is
gone, and a second finish returns ``[]``.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from chat_checks import CALL_TEXT, FINAL_TEXT, WEATHER_TOOL, script
from conftest import SIM_LAYERS, SIM_TOPK, Service
from safetensors.numpy import load
from slime_shapes import Sample, TrainArgs, check_fan_out

from slime_client.agent import GatewayAdapter

R3 = TrainArgs(use_rollout_routing_replay=True, num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK, rollout_top_p=0.9)
SLIME_SAMPLING = {  # what slime's generate passes (GenerateState.sampling_params with --rollout-top-p 0.9)
    "temperature": 1.0,
    "top_p": 0.9,
    "top_k": -1,
    "max_new_tokens": 64,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
    "custom_params": {"return_top_p_token_ids": True},
}


def slime_args(gateway: Service, **extra: Any) -> SimpleNamespace:
    fields = {
        "gateway_url": gateway.url,
        "use_rollout_routing_replay": True,
        "num_layers": SIM_LAYERS,
        "moe_router_topk": SIM_TOPK,
        "rollout_top_p": 0.9,
        "rollout_max_context_len": 0,
        "rollout_max_response_len": 64,
    }
    return SimpleNamespace(**(fields | extra))


def raw_branches(gateway: Service, sid: str) -> list[dict[str, np.ndarray]]:
    count = len(httpx.get(f"{gateway.url}/v1/sessions/{sid}").json()["branches"])
    return [
        load(httpx.get(f"{gateway.url}/v1/sessions/{sid}/sample", params={"branch": i}).content) for i in range(count)
    ]


def assert_same(sample: Sample, arrays: dict[str, np.ndarray]) -> None:
    """The sample holds the branch exactly: tokens, loss mask, log-probs, routing rows, top-p spans."""
    assert sample.tokens == arrays["tokens"].tolist()
    assert sample.loss_mask == arrays["loss_mask"].tolist()
    assert sample.rollout_log_probs == arrays["rollout_log_probs"].tolist()
    assert np.array_equal(np.asarray(sample.rollout_routed_experts), arrays["rollout_routed_experts"])
    assert np.array_equal(np.asarray(sample.rollout_top_p_token_ids), arrays["rollout_top_p_token_ids"])
    assert np.array_equal(np.asarray(sample.rollout_top_p_token_offsets), arrays["rollout_top_p_token_offsets"])


async def test_a_tool_loop_and_a_side_conversation_become_two_samples(chat_gateway: Service, chat_sim: Service) -> None:
    from openai import AsyncOpenAI

    adapter = GatewayAdapter.from_args(slime_args(chat_gateway))
    sid = "adapter-two-branches"
    await adapter.open_session(sid, sampling_defaults=SLIME_SAMPLING)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT, "A side answer.")
    client = AsyncOpenAI(base_url=adapter.base_url(sid), api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = (await client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL])).choices[0]
    messages += [first.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "sunny"}]
    await client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL])
    side = [{"role": "system", "content": "You summarize."}, {"role": "user", "content": "Summarize."}]
    await client.chat.completions.create(model="tiny", messages=side)
    await client.close()
    raw = raw_branches(chat_gateway, sid)
    base = Sample(index=3, group_index=1, prompt="Weather in Paris?", metadata={"task": "weather"})

    samples = await adapter.finish_session(sid, base_sample=base, reward=1.0, extra_metadata={"instance_id": "w1"})
    check_fan_out(samples, R3)
    assert len(samples) == 2
    for sample, arrays in zip(samples, raw, strict=True):
        assert_same(sample, arrays)
        assert sample.rollout_id == 3 and sample.reward == 1.0 and sample.status is Sample.Status.COMPLETED
        assert sample.metadata["task"] == "weather" and sample.metadata["instance_id"] == "w1"
    assert [s.metadata["use_tool"] for s in samples] == [True, False]
    assert [s.metadata["branch"]["cause"] for s in samples] == [None, "new_root"]
    assert httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").status_code == 404  # consumed
    assert await adapter.finish_session(sid, base_sample=base) == []  # idempotent
    await adapter.drop_session(sid)  # idempotent too
    await adapter.aclose()


async def test_open_session_sets_the_trainers_caps_and_replay(chat_gateway: Service) -> None:
    adapter = GatewayAdapter.from_args(slime_args(chat_gateway, rollout_max_context_len=4096), max_turns_per_sid=7)
    sid = "adapter-caps"
    await adapter.open_session(sid, sampling_defaults=SLIME_SAMPLING)
    view = httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").json()
    assert view["moe"] == {"num_layers": SIM_LAYERS, "topk": SIM_TOPK}
    with pytest.raises(ValueError, match="already exists"):  # slime's: ids are unique per agent run
        await adapter.open_session(sid)
    # the sampling defaults a session keeps: slime's, less what shapes SGLang's output text, top-p replay on
    assert adapter.session_defaults(SLIME_SAMPLING) == {
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 64,
        "custom_params": {"return_top_p_token_ids": True},
    }
    assert adapter.session_defaults({})["max_new_tokens"] == 64  # --rollout-max-response-len
    await adapter.drop_session(sid)
    await adapter.aclose()


async def test_the_turn_cap_and_budget_reach_the_session(chat_gateway: Service, chat_sim: Service) -> None:
    from anthropic import AsyncAnthropic, RateLimitError

    adapter = GatewayAdapter(chat_gateway.url, max_turns_per_sid=1, max_context_tokens=200)
    sid = "adapter-turn-cap"
    await adapter.open_session(sid, sampling_defaults={"max_new_tokens": 4})
    script(chat_sim, sid, "one two three four five six seven")
    client = AsyncAnthropic(base_url=adapter.base_url(sid), api_key="unused", max_retries=0)
    message = await client.messages.create(
        model="tiny", max_tokens=100, messages=[{"role": "user", "content": "count"}]
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    with pytest.raises(RateLimitError):
        await client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "again"}])
    await client.close()
    (sample,) = await adapter.finish_session(sid, base_sample=Sample(index=0))
    assert sample.metadata["truncated"] is True and len(sample.tokens) <= 200
    await adapter.aclose()


async def test_finish_drains_a_turn_that_is_still_running(chat_gateway: Service, chat_sim: Service) -> None:
    """A turn still running when the harness is done (a subagent left behind) is waited for, then aborted: the
    samples are read only after it ended, so they hold its routing rows (or nothing of it)."""
    from openai import AsyncOpenAI

    adapter = GatewayAdapter.from_args(slime_args(chat_gateway))
    sid = "adapter-drain"
    await adapter.open_session(sid, sampling_defaults=SLIME_SAMPLING)
    script(chat_sim, sid, "The first answer.")
    client = AsyncOpenAI(base_url=adapter.base_url(sid), api_key="unused", max_retries=0)
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert (
        httpx.post(f"{chat_sim.url}/sim/faults", json={"mode": "delay", "delay_s": 30, "count": 1}).status_code == 200
    )
    try:
        late = asyncio.create_task(
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a side question"}])
        )
        while not httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").json()["busy"]:
            await asyncio.sleep(0.02)
        samples = await adapter.finish_session(sid, base_sample=Sample(index=1), wait_timeout=0.2)
        check_fan_out(samples, R3)
        assert len(samples) == 1  # the aborted side turn brought no trained token
        # The client gets an honest error, never the aborted turn's empty reply taken for an answer (a 503 its
        # client would retry; the session is closed, so the retry is refused).
        with pytest.raises(openai.InternalServerError) as aborted:
            await late
        assert aborted.value.status_code == 503 and aborted.value.body["code"] == "turn_aborted", aborted.value.body
        assert "session closed" in aborted.value.body["message"]
    finally:
        httpx.delete(f"{chat_sim.url}/sim/faults")
        await client.close()
        await adapter.aclose()


async def test_a_branch_of_only_tool_tokens_is_no_sample(chat_gateway: Service, chat_sim: Service) -> None:
    """A session that never got a model answer (the harness never called the model) gives no sample."""
    adapter = GatewayAdapter(chat_gateway.url)
    sid = "adapter-empty"
    await adapter.open_session(sid)
    assert await adapter.finish_session(sid, base_sample=Sample(index=0), reward=1.0) == []
    await adapter.aclose()


def test_the_adapter_takes_slimes_arguments() -> None:
    args = SimpleNamespace(
        gateway_url="http://gw:1",
        gateway_api_key="k",
        use_rollout_routing_replay=True,
        num_layers=48,
        moe_router_topk=8,
        rollout_top_p=1.0,
        rollout_max_context_len=96000,
        rollout_max_response_len=32768,
    )
    adapter = GatewayAdapter.from_args(args)
    assert (adapter.replay.num_layers, adapter.replay.topk, adapter.replay.top_p) == (48, 8, False)
    assert (adapter.max_context_tokens, adapter.max_response_tokens, adapter.api_key) == (96000, 32768, "k")
    assert adapter.base_url("a:b") == "http://gw:1/v1/sessions/a%3Ab"
    plain = GatewayAdapter.from_args(SimpleNamespace(gateway_url="http://gw:1", rollout_top_p=0.95))
    assert plain.replay.num_layers is None and plain.replay.top_p is True
    with pytest.raises(ValueError, match="num_layers"):
        GatewayAdapter.from_args(SimpleNamespace(gateway_url="http://gw:1", use_rollout_routing_replay=True))
    with pytest.raises(ValueError, match="both"):
        GatewayAdapter("http://gw:1", num_layers=4)
    assert json.dumps(adapter.session_defaults({"stop": ["x"]})) == json.dumps({"stop": ["x"], "max_new_tokens": 32768})
