"""Reasoning models on the chat routes: the reasoning parser, and templates that rewrite earlier turns.

A Qwen3-style template written for the project (the tiny tokenizer's, with reasoning): an assistant message after the
last user query renders its reasoning as ``<think>\\nR\\n</think>\\n\\n`` before its content; earlier ones lose it. So a
new user turn makes the template render the history differently (a rewrite), which the gateway must never refuse:
``append`` (default) keeps one trajectory, ``fork`` re-renders on a new branch. A second variant's generation prompt
opens ``<think>`` (a thinking model's): the model's output starts inside its reasoning.

Driven by the real ``openai`` and ``anthropic`` clients against gateways started with
``GATEWAY_CHAT_REASONING_PARSER=qwen3`` (and ``deepseek_r1``), the simulator answering scripted text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from chat_checks import (
    WEATHER_TOOL,
    anthropic_client,
    check_trajectory,
    full_view,
    metric,
    new_session,
    openai_chat,
    openai_client,
    script,
    session_sample,
)
from conftest import Service, run_gateway

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_CALL = f"<think>\nI should look the weather up.\n</think>\n\n{CALL}"
THINK_FINAL = "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris."
THINK_NEXT = "<think>\nTomorrow: rain.\n</think>\n\nRain tomorrow."

_ASSISTANT = """\
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- set reasoning = message.reasoning_content if message.reasoning_content is defined and \
message.reasoning_content is not none else '' %}
{%- if loop.index0 > ns.last_query and reasoning %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- if message.tool_calls %}{{- '\\n' }}{%- endif %}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set function = call.function if call.function is defined else call %}
{%- if not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + function.name + '", "arguments": ' }}
{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
"""


def qwen3_style_template(open_think: bool) -> str:
    """ChatML with tools, like the tiny tokenizer's, and Qwen3's reasoning rule; ``open_think``: the generation
    prompt opens the reasoning."""
    return (
        "{%- set ns = namespace(last_query=-1) %}"
        "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
        "{%- endif %}{%- endfor %}"
        "{%- if tools %}{{- '<|im_start|>system\\n' }}"
        "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
        "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        "{{- '\\n</tools><|im_end|>\\n' }}"
        "{%- elif messages and messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        + _ASSISTANT
        + "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        + ("{{- '<think>\\n' }}" if open_think else "")
        + "{%- endif %}"
    )


def tokenizer_with(template: str, source: Path, out: Path) -> Path:
    for item in source.iterdir():
        shutil.copy(item, out / item.name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def qwen3_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_with(qwen3_style_template(False), tokenizer_dir, tmp_path_factory.mktemp("qwen3-style"))


@pytest.fixture(scope="module")
def thinking_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_with(qwen3_style_template(True), tokenizer_dir, tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def qwen3_tokenizer(qwen3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir), local_files_only=True)


def gateway_for(chat_sim: Service, tokenizer: Path, **settings: str) -> Any:
    env = {"GATEWAY_CHAT_REASONING_PARSER": "qwen3", **{f"GATEWAY_CHAT_{k.upper()}": v for k, v in settings.items()}}
    return run_gateway(chat_sim.url, "--tokenizer", str(tokenizer), "--log-level", "warning", env=env)


@pytest.fixture(scope="module")
def reasoning_gateway(chat_sim: Service, qwen3_dir: Path) -> Iterator[Service]:
    with gateway_for(chat_sim, qwen3_dir) as service:
        yield service


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
    """One completion as a message dict, reasoning included, streamed or not."""
    return openai_chat(client, messages, stream=stream)[0]


# ---- the reasoning parser ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_reasoning_comes_back_as_reasoning_content_and_the_trajectory_is_exact(
    reasoning_gateway: Service, chat_sim: Service, qwen3_tokenizer: Any, stream: bool
) -> None:
    sid = new_session(reasoning_gateway)
    script(chat_sim, sid, THINK_CALL, THINK_FINAL)
    client = openai_client(reasoning_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = chat(client, messages, stream=stream)
    assert first["reasoning_content"] == "I should look the weather up."
    assert "content" not in first and first["tool_calls"][0]["function"]["name"] == "get_weather"
    # Most clients send the reasoning back as it came; this one drops it: the same message either way.
    messages += [
        {k: v for k, v in first.items() if k != "reasoning_content"},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"},
    ]
    second = chat(client, messages, stream=stream)
    assert second == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "reasoning_content": "The tool says sunny.",
    }
    check_trajectory(reasoning_gateway.url, sid, qwen3_tokenizer, [THINK_CALL, THINK_FINAL])


def test_reasoning_left_inside_the_content_is_the_same_message(
    reasoning_gateway: Service, chat_sim: Service, qwen3_tokenizer: Any
) -> None:
    """A client that keeps the raw text (reasoning inside ``content``) extends the record too."""
    sid = new_session(reasoning_gateway)
    script(chat_sim, sid, THINK_CALL, THINK_FINAL)
    client = openai_client(reasoning_gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = chat(client, messages, stream=False)
    raw = {"role": "assistant", "content": "<think>\nI should look the weather up.\n</think>\n\n"}
    messages += [
        raw | {"tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"},
    ]
    chat(client, messages, stream=False)
    check_trajectory(reasoning_gateway.url, sid, qwen3_tokenizer, [THINK_CALL, THINK_FINAL])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_anthropic_thinking_blocks(reasoning_gateway: Service, chat_sim: Service, stream: bool) -> None:
    sid = new_session(reasoning_gateway)
    script(chat_sim, sid, THINK_FINAL, THINK_NEXT)
    client = anthropic_client(reasoning_gateway, sid)
    kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 256, "thinking": {"type": "enabled", "budget_tokens": 64}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as events:
            kinds = [event.type for event in events]
            message = events.get_final_message()
        assert "thinking" in kinds and "signature" in kinds
    else:
        message = client.messages.create(messages=messages, **kwargs)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "The tool says sunny."
    assert thinking.signature.startswith("sgw1.") and text.text == "It is sunny in Paris."
    # The thinking block sent back, as Claude Code does: the record goes on.
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    client.messages.create(messages=messages, **kwargs)
    assert len(full_view(reasoning_gateway.url, sid)["branches"]) == 1
    # Without thinking, the answer is the text only (the session still holds the model's reasoning tokens).
    sid = new_session(reasoning_gateway)
    script(chat_sim, sid, THINK_FINAL)
    plain = client.with_options(base_url=f"{reasoning_gateway.url}/v1/sessions/{sid}").messages.create(
        model="tiny", max_tokens=256, messages=[{"role": "user", "content": "Weather?"}]
    )
    assert [(b.type, b.text) for b in plain.content] == [("text", "It is sunny in Paris.")]


def test_responses_reasoning_items_round_trip(
    reasoning_gateway: Service, chat_sim: Service, qwen3_tokenizer: Any
) -> None:
    """As Codex: ``include: ["reasoning.encrypted_content"]``, ``store: false``, its reasoning items sent back with
    only the encrypted content: the record goes on, token-exact."""
    sid = new_session(reasoning_gateway)
    script(chat_sim, sid, THINK_CALL, THINK_FINAL)
    client = openai_client(reasoning_gateway, sid)
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "tools": [tool],
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(input=history, **kwargs)
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I should look the weather up."
    assert reasoning.encrypted_content
    echoed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    history += [
        echoed,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = client.responses.create(input=history, **kwargs)
    assert second.output_text == "It is sunny in Paris." and second.output[0].type == "reasoning"
    check_trajectory(reasoning_gateway.url, sid, qwen3_tokenizer, [THINK_CALL, THINK_FINAL])


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_output_that_starts_inside_the_reasoning(chat_sim: Service, thinking_dir: Path, parser: str) -> None:
    """The generation prompt opened ``<think>``: the model writes its reasoning, ``</think>``, then the answer."""
    with gateway_for(chat_sim, thinking_dir, reasoning_parser=parser) as gateway:
        sid = new_session(gateway)
        script(chat_sim, sid, "Short and simple.\n</think>\n\nHello!")
        message = (
            openai_client(gateway, sid)
            .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
            .choices[0]
            .message
        )
        assert message.content == "Hello!" and message.model_extra["reasoning_content"] == "Short and simple."


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_call_opened_before_the_reasoning_closed_is_a_call(
    chat_sim: Service, thinking_dir: Path, stream: bool
) -> None:
    """slime's Qwen3.6 flags (``qwen3``, the generation prompt opening ``<think>``): Qwen3.5/3.6 often open a call
    without ``</think>``. The reasoning ends at ``<tool_call>`` and the call is read (it used to stay inside
    ``reasoning_content``); the client sends the reply back and the session goes on on the same branch."""
    with gateway_for(chat_sim, thinking_dir) as gateway:
        sid = new_session(gateway)
        script(chat_sim, sid, f"I should look the weather up.\n{CALL}", "Sunny.\n</think>\n\nIt is sunny in Paris.")
        client = openai_client(gateway, sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first, finish, _ = openai_chat(client, messages, stream=stream)
        assert finish == "tool_calls" and first["reasoning_content"] == "I should look the weather up."
        assert "content" not in first and first["tool_calls"][0]["function"]["name"] == "get_weather"
        messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"}]
        second, finish, _ = openai_chat(client, messages, stream=stream)
        assert finish == "stop" and second["content"] == "It is sunny in Paris."
        assert len(full_view(gateway.url, sid)["branches"]) == 1


# ---- templates that rewrite earlier turns ----------------------------------------------------------------------
def two_user_turns(gateway: Service, sim: Service, sid: str) -> list[dict[str, Any]]:
    script(sim, sid, THINK_FINAL, THINK_NEXT)
    client = openai_client(gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = chat(client, messages, stream=False)
    messages += [first, {"role": "user", "content": "And tomorrow?"}]
    second = chat(client, messages, stream=False)
    assert second["content"] == "Rain tomorrow."
    return [*messages, second]


def test_append_policy_keeps_one_trajectory_when_the_template_drops_earlier_reasoning(
    reasoning_gateway: Service, chat_sim: Service, qwen3_tokenizer: Any
) -> None:
    """No 400: the session's tokens (the first answer's reasoning kept, as the model wrote it), then exactly what the
    template renders after that answer once the new user turn follows it."""
    rewrites = metric(reasoning_gateway, 'gateway_chat_drift_total{cause="rewrite"}')
    sid = new_session(reasoning_gateway)
    messages = two_user_turns(reasoning_gateway, chat_sim, sid)
    view = full_view(reasoning_gateway.url, sid)
    assert len(view["branches"]) == 1 and view["turns"] == 3
    assert metric(reasoning_gateway, 'gateway_chat_drift_total{cause="rewrite"}') == rewrites + 1
    tokens = session_sample(reasoning_gateway.url, sid)["tokens"].tolist()
    eos = qwen3_tokenizer.eos_token_id
    first_answer = [*qwen3_tokenizer.encode(THINK_FINAL, add_special_tokens=False), eos]
    first_end = view["prompt_length"] + len(first_answer)
    assert tokens[view["prompt_length"] : first_end] == first_answer  # the reasoning as the model wrote it
    # What the template renders after the first answer once the new turn follows (there, without its reasoning).
    full = qwen3_tokenizer.apply_chat_template(
        messages[:3], tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    after = full[full.index("It is sunny in Paris.<|im_end|>") + len("It is sunny in Paris.<|im_end|>") :]
    added = qwen3_tokenizer.encode(after, add_special_tokens=False)
    second_answer = [*qwen3_tokenizer.encode(THINK_NEXT, add_special_tokens=False), eos]
    assert tokens[first_end:] == [*added, *second_answer]
    mask = session_sample(reasoning_gateway.url, sid)["loss_mask"]
    assert int(mask.sum()) == len(first_answer) + len(second_answer)


def test_fork_policy_rerenders_the_conversation_on_a_new_branch(
    chat_sim: Service, qwen3_dir: Path, qwen3_tokenizer: Any
) -> None:
    """What the deployed model would see: the history as the template renders it now (the first answer without its
    reasoning), on a new branch whose parent keeps the first answer as generated."""
    with gateway_for(chat_sim, qwen3_dir, rewrite_policy="fork") as gateway:
        sid = new_session(gateway)
        messages = two_user_turns(gateway, chat_sim, sid)
        view = full_view(
            gateway.url,
            sid,
        )
        root, fork = view["branches"]
        assert fork == fork | {"parent": 0, "cause": "rewrite", "turns": 1}
        branch = httpx.get(f"{gateway.url}/v1/sessions/{sid}", params={"branch": 1}).json()
        tokens = httpx.get(f"{gateway.url}/v1/sessions/{sid}/sample", params={"branch": 1})
        from safetensors.numpy import load

        arrays = load(tokens.content)
        conversation = [
            *messages[:3],
            {"role": "assistant", "content": "Rain tomorrow.", "reasoning_content": "Tomorrow: rain."},
        ]
        text = qwen3_tokenizer.apply_chat_template(conversation, tools=[WEATHER_TOOL], tokenize=False)
        expected = qwen3_tokenizer.encode(text, add_special_tokens=False)
        assert arrays["tokens"].tolist() == expected[:-1]  # the model stopped at <|im_end|>
        assert branch["prompt_length"] == len(expected) - 1 - int(arrays["loss_mask"].sum())
        shared = root["total_tokens"]
        assert fork["fork_token"] < shared  # the re-rendered first answer differs from the generated one
        root_tokens = session_sample(gateway.url, sid)["tokens"]
        np.testing.assert_array_equal(arrays["tokens"][: fork["fork_token"]], root_tokens[: fork["fork_token"]])


def test_a_subagent_and_the_main_conversation_keep_their_own_branches(
    reasoning_gateway: Service, chat_sim: Service, qwen3_tokenizer: Any
) -> None:
    """As Claude Code's Explore subagent: another system prompt on the same session (a new root branch); the main
    agent's next request extends its own branch, whatever came in between."""
    sid = new_session(reasoning_gateway)
    script(chat_sim, sid, THINK_CALL, "<think>\nSearch.\n</think>\n\nFound it.", THINK_FINAL)
    client = openai_client(reasoning_gateway, sid)
    main: list[dict[str, Any]] = [{"role": "system", "content": "Main agent."}, {"role": "user", "content": "Weather?"}]
    first = chat(client, main, stream=False)
    sub = chat(
        client, [{"role": "system", "content": "Explore agent."}, {"role": "user", "content": "Find it."}], stream=False
    )
    assert sub["content"] == "Found it."
    main += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"}]
    final = chat(client, main, stream=False)
    assert final["content"] == "It is sunny in Paris."
    view = full_view(reasoning_gateway.url, sid)
    root, side = view["branches"]
    assert root["turns"] == 3 and side == side | {"parent": None, "cause": "new_root", "turns": 1}
    messages = view["chat"]["record"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(json.dumps(messages[-1]["content"])) == "It is sunny in Paris."


@pytest.mark.parametrize("policy", ["append", "fork"])
def test_an_agent_conversation_then_a_new_user_turn_under_each_policy(
    chat_sim: Service, qwen3_dir: Path, qwen3_tokenizer: Any, policy: str
) -> None:
    """A tool loop (no rewrite: the answers stay after the last user query), then the user's next words: the
    template now drops both answers' reasoning. ``append`` keeps one trajectory (the model's tokens, then what the
    template renders after them); ``fork`` starts a branch whose prompt is the conversation as rendered now."""
    with gateway_for(chat_sim, qwen3_dir, rewrite_policy=policy) as gateway:
        sid = new_session(gateway)
        script(chat_sim, sid, THINK_CALL, THINK_FINAL, THINK_NEXT)
        client = openai_client(gateway, sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = chat(client, messages, stream=False)
        messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"}]
        messages.append(chat(client, messages, stream=False))
        assert metric(gateway, 'gateway_chat_drift_total{cause="rewrite"}') == 0  # the tool loop rewrote nothing
        messages.append({"role": "user", "content": "And tomorrow?"})
        third = chat(client, messages, stream=False)
        assert third["content"] == "Rain tomorrow."
        assert metric(gateway, 'gateway_chat_drift_total{cause="rewrite"}') == 1
        view = full_view(gateway.url, sid)
        if policy == "append":
            assert len(view["branches"]) == 1 and view["turns"] == 5
            arrays = session_sample(gateway.url, sid)
            tokens, mask = arrays["tokens"].tolist(), arrays["loss_mask"]
            eos = qwen3_tokenizer.eos_token_id
            texts = (THINK_CALL, THINK_FINAL, THINK_NEXT)
            answers = [[*qwen3_tokenizer.encode(t, add_special_tokens=False), eos] for t in texts]
            # Every answer as the model wrote it (reasoning kept), trained; the last one ends the session.
            assert int(mask.sum()) == sum(map(len, answers)) and tokens[-len(answers[2]) :] == answers[2]
            for answer in answers[:2]:
                starts = [i for i in range(len(tokens)) if tokens[i : i + len(answer)] == answer]
                assert len(starts) == 1
            return
        root, fork = view["branches"]
        assert root["turns"] == 3 and fork == fork | {"parent": 0, "cause": "rewrite", "turns": 1}
        conversation = [*messages, third]
        for message in conversation:  # arguments as objects, as templates take them (and the gateway gives them)
            for call in message.get("tool_calls", ()):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        full = qwen3_tokenizer.apply_chat_template(conversation, tools=[WEATHER_TOOL], tokenize=False)
        expected = qwen3_tokenizer.encode(full, add_special_tokens=False)
        fork_tokens = session_sample(gateway.url, sid, branch=1)["tokens"].tolist()
        assert fork_tokens == expected[:-1]  # the deployed model's view: earlier reasoning gone, as now rendered
        assert "I should look the weather up." not in qwen3_tokenizer.decode(fork_tokens)
