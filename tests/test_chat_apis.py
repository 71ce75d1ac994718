"""The three chat APIs as agent harnesses use them: the OpenAI Responses API, the Anthropic Messages API's fuller
surface (system messages anywhere, thinking, count_tokens, the session base, its own error wording), and what all
three share (a default length, tool results in the order of their calls, errors in each API's shape).

Driven by the real ``openai`` and ``anthropic`` clients against a real gateway and simulator (scripted answers), as
in ``tests/test_chat.py``; every conversation's session is checked token-exact (``chat_checks.check_trajectory``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from chat_checks import (
    CALL_TEXT,
    FINAL_TEXT,
    WEATHER_TOOL,
    anthropic_client,
    check_trajectory,
    full_view,
    hermes_call,
    new_session,
    openai_client,
    script,
    session_sample,
)
from conftest import Service, run_gateway

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's form: the function's fields flat


def stable_view(gateway: Service, sid: str) -> dict[str, Any]:
    state = httpx.get(f"{gateway.url}/v1/sessions/{sid}").json()
    return {k: v for k, v in state.items() if k not in ("updated_at", "busy")}


def upstream_requests(sim: Service, sid: str) -> list[dict[str, Any]]:
    """What the simulator was asked for this session's turns (its request log)."""
    log = httpx.get(f"{sim.url}/sim/requests").json()
    return [r["body"] for r in log if str((r.get("body") or {}).get("rid", "")).startswith(f"{sid}-")]


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


# ---- the Responses API ------------------------------------------------------------------------------------------
def responses_turn(client: openai.OpenAI, *, stream: bool, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
    """One response as a dict, and (streamed) the event types in order."""
    if not stream:
        return client.responses.create(model="tiny", **kwargs).model_dump(exclude_none=True), []
    kinds: list[str] = []
    final = None
    for event in client.responses.create(model="tiny", stream=True, **kwargs):
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    assert final is not None, kinds
    return final.model_dump(exclude_none=True), kinds


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_responses_agent_loop_whole_input_each_turn(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any, stream: bool
) -> None:
    """As Codex drives it: ``store: false``, every request carries the whole input (its earlier output items
    included), and the session's record is matched exactly as on the chat routes."""
    sid = new_session(chat_gateway)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    client = openai_client(chat_gateway, sid)
    history: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first, kinds = responses_turn(
        client, stream=stream, input=history, instructions="Be brief.", tools=[WEATHER], store=False
    )
    assert first["status"] == "completed" and first["id"].startswith("resp_")
    message, call = first["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    if stream:
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        for kind in (
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ):
            assert kind in kinds, kind
    history += [*first["output"], {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    second, _ = responses_turn(client, stream=stream, input=history, instructions="Be brief.", tools=[WEATHER])
    assert [o["content"][0]["text"] for o in second["output"]] == [FINAL_TEXT]
    assert second["usage"]["output_tokens"] == len(tokenizer.encode(FINAL_TEXT, add_special_tokens=False)) + 1
    view = check_trajectory(chat_gateway.url, sid, tokenizer, [CALL_TEXT, FINAL_TEXT])
    assert [m["role"] for m in view["chat"]["record"]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


def test_streamed_response_items_equal_the_unary_ones(chat_gateway: Service, chat_sim: Service) -> None:
    items = []
    for stream in (False, True):
        sid = new_session(chat_gateway, moe=False)
        script(chat_sim, sid, CALL_TEXT)
        response, _ = responses_turn(openai_client(chat_gateway, sid), stream=stream, input="Weather?", tools=[WEATHER])
        items.append(without_ids(response["output"]))
    assert items[0] == items[1]


def test_previous_response_id_continues_a_stored_response(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any
) -> None:
    """As the Agents SDK with ``previous_response_id``: only the new input, the rest from the session."""
    sid = new_session(chat_gateway)
    script(chat_sim, sid, CALL_TEXT, FINAL_TEXT)
    client = openai_client(chat_gateway, sid)
    first = client.responses.create(model="tiny", input="Weather in Paris?", instructions="Be brief.", tools=[WEATHER])
    call = first.output[-1]
    assert call.type == "function_call"
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        instructions="Be brief.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert second.output_text == FINAL_TEXT and second.previous_response_id == first.id
    check_trajectory(chat_gateway.url, sid, tokenizer, [CALL_TEXT, FINAL_TEXT])


def test_unknown_or_unstored_previous_response_is_a_404_and_changes_nothing(
    chat_gateway: Service, chat_sim: Service
) -> None:
    sid = new_session(chat_gateway, moe=False)
    script(chat_sim, sid, "Noted.")
    client = openai_client(chat_gateway, sid)
    unstored = client.responses.create(model="tiny", input="Remember 7.", store=False)
    state = stable_view(chat_gateway, sid)
    for previous in ("resp_nope", unstored.id, "not-a-response-id"):
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model="tiny", input="And?", previous_response_id=previous)
        error = refused.value.body
        assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
        assert stable_view(chat_gateway, sid) == state


def test_responses_tools_namespaces_custom_and_hosted(chat_gateway: Service, chat_sim: Service) -> None:
    """Namespaced tools are flattened to NAMESPACE.NAME for the model and come back with their namespace; a custom
    (free-form) tool is a function with one string parameter; hosted tools are left out of the prompt."""
    sid = new_session(chat_gateway, moe=False)
    calls = "\n".join(
        [
            hermes_call("fleet.spawn_agent", {"task": "look"}),
            hermes_call("apply_patch", {"input": "*** Begin Patch"}),
        ]
    )
    script(chat_sim, sid, calls)
    namespace = {
        "type": "namespace",
        "name": "fleet",
        "description": "Agents",
        "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}],
    }
    custom = {"type": "custom", "name": "apply_patch", "description": "Patch files"}
    body = {"model": "tiny", "input": "Go.", "tools": [namespace, custom, {"type": "web_search"}]}
    response = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/responses", json=body)
    assert response.status_code == 200, response.text
    spawn, patch = response.json()["output"]
    assert spawn["type"] == "function_call" and spawn["name"] == "spawn_agent" and spawn["namespace"] == "fleet"
    assert patch == {**patch, "type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch"}
    tools = [t["name"] for t in full_view(chat_gateway.url, sid)["chat"]["record"]["tools"]]
    assert tools == ["fleet.spawn_agent", "apply_patch"]  # web_search: hosted, not in the prompt


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
        ({"input": [{"type": "mcp_call", "id": "x"}]}, "mcp_call"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "answers no earlier"),
        ({"input": []}, "input"),
        ({"input": [{"type": {}, "role": "user", "content": "x"}]}, "not supported"),
        ({"input": "x", "tools": [{"type": {}, "name": "t"}]}, "tools.0.type"),
    ],
)
def test_bad_responses_requests_are_400s_in_openais_shape(
    chat_gateway: Service, body: dict[str, Any], problem: str
) -> None:
    sid = new_session(chat_gateway, moe=False)
    state = stable_view(chat_gateway, sid)
    response = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/responses", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and problem in error["message"]
    assert stable_view(chat_gateway, sid) == state


# ---- a default length, on all three APIs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_gateway(chat_sim: Service, tokenizer_dir: Path) -> Iterator[Service]:
    """A gateway whose answers default to 3 tokens (GATEWAY_CHAT_DEFAULT_MAX_TOKENS)."""
    env = {"GATEWAY_CHAT_DEFAULT_MAX_TOKENS": "3"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as service:
        yield service


def test_a_request_without_a_length_gets_the_default_and_says_it_was_cut(
    short_gateway: Service, chat_sim: Service
) -> None:
    long = "This answer is much longer than three tokens."
    sid = new_session(short_gateway, moe=False)
    script(chat_sim, sid, long)
    chat = openai_client(short_gateway, sid).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}]
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3
    sid = new_session(short_gateway, moe=False)
    script(chat_sim, sid, long)
    response = openai_client(short_gateway, sid).responses.create(model="tiny", input="x")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    sid = new_session(short_gateway, moe=False)
    script(chat_sim, sid, long)
    message = httpx.post(
        f"{short_gateway.url}/v1/sessions/{sid}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}
    ).json()
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 3
    assert [r["sampling_params"]["max_new_tokens"] for r in upstream_requests(chat_sim, sid)] == [3]


def test_the_default_length_is_the_context_left(chat_gateway: Service, chat_sim: Service) -> None:
    """The tiny tokenizer states a 32768-token context: an answer may fill what the prompt leaves of it."""
    sid = new_session(chat_gateway, moe=False)
    script(chat_sim, sid, "Fine.")
    completion = openai_client(chat_gateway, sid).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}]
    )
    (request,) = upstream_requests(chat_sim, sid)
    assert request["sampling_params"]["max_new_tokens"] == 32768 - completion.usage.prompt_tokens


# ---- the Anthropic Messages API ---------------------------------------------------------------------------------
def test_count_tokens_is_the_prompt_the_turn_gives_the_model(chat_gateway: Service, chat_sim: Service) -> None:
    sid = new_session(chat_gateway, moe=False)
    script(chat_sim, sid, "First.", "Second.")
    client = anthropic_client(chat_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello there"}]
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    state = stable_view(chat_gateway, sid)
    first = client.messages.create(model="tiny", max_tokens=16, system="Be brief.", messages=messages)
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert state["total_tokens"] == 0  # counting changed nothing
    messages += [{"role": "assistant", "content": "First."}, {"role": "user", "content": "Again"}]
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    second = client.messages.create(model="tiny", max_tokens=16, system="Be brief.", messages=messages)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_system_messages_inside_messages_stand_where_they_are(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any
) -> None:
    """Claude Code's shape: a top-level system prompt, a user turn, then a system message among the messages."""
    sid = new_session(chat_gateway)
    script(chat_sim, sid, "Noted.")
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]},
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
        "output_config": {"effort": "medium"},
    }
    response = httpx.post(f"{chat_gateway.url}/v1/sessions/{sid}/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert [b["type"] for b in response.json()["content"]] == ["text"]  # no reasoning parser: no thinking blocks
    view = check_trajectory(chat_gateway.url, sid, tokenizer, ["Noted."])
    roles = [m["role"] for m in view["chat"]["record"]["messages"]]
    assert roles == ["system", "user", "system", "assistant"]


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])
def test_thinking_is_accepted(chat_gateway: Service, chat_sim: Service, thinking: dict[str, Any]) -> None:
    sid = new_session(chat_gateway, moe=False)
    script(chat_sim, sid, "Plain answer.")
    message = anthropic_client(chat_gateway, sid).messages.create(
        model="tiny", max_tokens=2048, thinking=thinking, messages=[{"role": "user", "content": "Think."}]
    )
    assert [(b.type, b.text) for b in message.content] == [("text", "Plain answer.")]


@pytest.fixture(scope="module")
def system_first_tokenizer(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer with a template that refuses system messages after the first (as some models' do)."""
    out = tmp_path_factory.mktemp("system-first-tokenizer")
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    refuse = (
        "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
        "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}"
    )
    tokenizer.chat_template = refuse + tokenizer.chat_template
    tokenizer.save_pretrained(str(out))
    return out


def test_late_system_messages_join_a_user_message_when_the_template_refuses_them(
    chat_sim: Service, system_first_tokenizer: Path
) -> None:
    with run_gateway(chat_sim.url, "--tokenizer", str(system_first_tokenizer), "--log-level", "warning") as gateway:
        sid = new_session(gateway, moe=False)
        script(chat_sim, sid, "Noted.")
        body = {
            "model": "tiny",
            "max_tokens": 16,
            "system": "You are an agent.",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": "cwd: /tmp"},
            ],
        }
        response = httpx.post(f"{gateway.url}/v1/sessions/{sid}/v1/messages", json=body)
        assert response.status_code == 200, response.text
        messages = full_view(gateway.url, sid)["chat"]["record"]["messages"]
        assert [(m["role"], m["content"]) for m in messages[:2]] == [
            ("system", "You are an agent."),
            ("user", "Hi\n\ncwd: /tmp"),
        ]


def test_the_session_base_answers_head_and_get(chat_gateway: Service) -> None:
    sid = new_session(chat_gateway, moe=False)
    assert httpx.head(f"{chat_gateway.url}/v1/sessions/{sid}").status_code == 200
    assert httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").status_code == 200
    assert httpx.head(f"{chat_gateway.url}/v1/sessions/nope-{sid}").status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "shape"),
    [
        ("POST", "/v1/nope", "anthropic"),
        ("GET", "/v1/messages", "anthropic"),
        ("GET", "/v1/messages/count_tokens", "anthropic"),
        ("GET", "/chat/completions", "openai"),
        ("POST", "/responses/resp_1/cancel", "openai"),
        ("GET", "/models", "openai"),
    ],
)
def test_errors_under_a_chat_prefix_are_in_that_apis_shape(
    chat_gateway: Service, method: str, path: str, shape: str
) -> None:
    sid = new_session(chat_gateway, moe=False)
    response = httpx.request(method, f"{chat_gateway.url}/v1/sessions/{sid}{path}")
    assert response.status_code in (404, 405), response.text
    body = response.json()
    kind = "not_found_error" if response.status_code == 404 else "invalid_request_error"
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["type"] == kind


def test_context_overflow_in_each_apis_words(chat_sim: Service, tokenizer_dir: Path) -> None:
    """Clients parse these: Claude Code lowers max_tokens on Anthropic's second wording and compacts on the first;
    OpenAI clients and frameworks look for ``context_length_exceeded``."""
    env = {"GATEWAY_CHAT_CONTEXT_TOKENS": "40"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as gateway:
        sid = new_session(gateway, moe=False)
        client = anthropic_client(gateway, sid)
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model="tiny", max_tokens=500, messages=[{"role": "user", "content": "x"}])
        message = refused.value.body["error"]["message"]
        assert message.startswith("input length and `max_tokens` exceed context limit: ") and "+ 500 > 40" in message
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x " * 200}])
        assert refused.value.body["error"]["message"].startswith("prompt is too long: ")
        assert "> 39 maximum" in refused.value.body["error"]["message"]
        for call in (
            lambda c: c.chat.completions.create(model="t", max_tokens=500, messages=[{"role": "user", "content": "x"}]),
            lambda c: c.responses.create(model="t", max_output_tokens=500, input="x"),
        ):
            with pytest.raises(openai.BadRequestError) as refused_openai:
                call(openai_client(gateway, sid))
            assert refused_openai.value.code == "context_length_exceeded"
            assert "maximum context length is 40 tokens" in refused_openai.value.message
        assert stable_view(gateway, sid)["total_tokens"] == 0


# ---- tool results ------------------------------------------------------------------------------------------------
def test_tool_results_are_rendered_in_the_order_of_their_calls(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any
) -> None:
    """Results sent in the order the tools finished are put back in the order of the calls they answer (the
    template pairs them by position), and a failed tool's ``is_error`` is kept for the template."""
    sid = new_session(chat_gateway)
    calls = "\n".join([hermes_call("get_weather", {"city": "Paris"}), hermes_call("get_weather", {"city": "Rome"})])
    script(chat_sim, sid, calls, FINAL_TEXT)
    client = anthropic_client(chat_gateway, sid)
    tools = [{"name": "get_weather", "input_schema": WEATHER["parameters"], "description": WEATHER["description"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Paris and Rome?"}]
    first = client.messages.create(model="tiny", max_tokens=64, tools=tools, messages=messages)
    paris, rome = first.content
    assert (paris.input, rome.input) == ({"city": "Paris"}, {"city": "Rome"})
    results = [
        {"type": "tool_result", "tool_use_id": rome.id, "content": "rome: timeout", "is_error": True},
        {"type": "tool_result", "tool_use_id": paris.id, "content": [{"type": "text", "text": "paris: sunny"}]},
    ]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": results},
    ]
    second = client.messages.create(model="tiny", max_tokens=64, tools=tools, messages=messages)
    assert second.content[0].text == FINAL_TEXT
    view = check_trajectory(chat_gateway.url, sid, tokenizer, [calls, FINAL_TEXT])
    tool_messages = [m for m in view["chat"]["record"]["messages"] if m["role"] == "tool"]
    assert [(m["content"], m.get("is_error", False)) for m in tool_messages] == [
        ("paris: sunny", False),
        ("rome: timeout", True),
    ]
    assert session_sample(chat_gateway.url, sid)["loss_mask"].sum() > 0
