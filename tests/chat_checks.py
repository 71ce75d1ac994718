"""The chat tests' kit: what every agent test checks of the session it leaves (the trajectory the gateway
recorded is token-exact), and the helpers they share to make sessions, script the simulator and call the APIs.

``check_trajectory`` reads the session's record of the conversation (``GET /v1/sessions/{id}?full=true``: every
message whole, the tools with their schemas) and its sample, and asserts, independently of the gateway's code:
- one branch;
- the session's tokens are exactly the chat template's one-shot rendering of the recorded conversation (through
  transformers' ``apply_chat_template`` and the tokenizer, as the model was trained), the last assistant message
  ending at the stop token the model wrote;
- the loss mask is 1 exactly on the model's tokens: each scripted answer (its text encoded, then eos) stands where
  the template puts that assistant message, and no other token is trainable.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
from conftest import SIM_LAYERS, SIM_TOPK, Service
from safetensors.numpy import load

TOP_P = {"custom_params": {"return_top_p_token_ids": True}}
# The agent tests' tool (Chat Completions form) and what the scripted model writes with it: a call, exactly as the
# template renders an assistant message with that content and call, then the answer once the tool has spoken.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL_TEXT = "It is sunny in Paris, 21 degrees."


# ---- sessions, scripts, clients ----------------------------------------------------------------------------------
def new_session(
    gateway: Service,
    *,
    moe: bool = True,
    top_p: bool = True,
    headers: dict[str, str] | None = None,
    prefix: str = "chat",
    **extra: Any,
) -> str:
    """A chat session (no prompt_ids): the simulator's MoE shape for routing replay, top-p replay by default;
    ``extra``: more of the create body's fields (``metadata``)."""
    sid = f"{prefix}-{uuid.uuid4().hex[:10]}"
    body: dict[str, Any] = {"session_id": sid, "sampling_defaults": TOP_P if top_p else {}}
    if moe:
        body |= {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    body |= extra
    response = httpx.post(f"{gateway.url}/v1/sessions", json=body, headers=headers)
    assert response.status_code == 201, response.text
    return sid


def script(sim: Service, sid: str, *answers: str | list[int]) -> None:
    """The simulator's next answers for the session's turns, in order: a text (the model's, encoded with the
    simulator's tokenizer, then eos) or token ids."""
    items = [{"text": a} if isinstance(a, str) else {"token_ids": a} for a in answers]
    response = httpx.post(f"{sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": items})
    assert response.status_code == 200, response.text


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it, exactly as the tiny template renders one (Hermes style)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _session_get(
    url: str, route: str, params: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 5.0
) -> httpx.Response:
    """``GET /v1/sessions/{route}`` (a session's view, ``{sid}/sample`` its sample), asserting a 200."""
    response = httpx.get(f"{url}/v1/sessions/{route}", params=params, headers=headers, timeout=timeout)
    assert response.status_code == 200, response.text
    return response


def view(
    gateway: Service, sid: str, branch: int | None = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    params = {} if branch is None else {"branch": branch}
    return _session_get(gateway.url, sid, params, headers).json()


def sample(
    gateway: Service, sid: str, branch: int | None = None, headers: dict[str, str] | None = None
) -> dict[str, np.ndarray]:
    params = {} if branch is None else {"branch": branch}
    return load(_session_get(gateway.url, f"{sid}/sample", params, headers).content)


def metric(gateway: Service, name: str) -> float:
    """One sample's value from ``/metrics`` (0 when absent): ``name`` with its labels, as the text shows them."""
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def openai_client(gateway: Service, sid: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="unused", max_retries=0, **kwargs)


def anthropic_client(gateway: Service, sid: str, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key="unused", max_retries=0, **kwargs)


def openai_chat(
    client: openai.OpenAI,
    messages: list[dict[str, Any]],
    *,
    stream: bool,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> tuple[dict[str, Any], str | None, Any]:
    """One Chat Completions turn (``tools``: the weather tool unless given) as a message dict, reasoning included
    when there is some, its finish reason and usage, streamed or not."""
    tools = [WEATHER_TOOL] if tools is None else tools
    if not stream:
        completion = client.chat.completions.create(model="tiny", messages=messages, tools=tools, **kwargs)
        choice = completion.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason, completion.usage
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    finish = None
    chunks = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        for call in delta.tool_calls or ():
            calls.append({"id": call.id, "type": "function", "function": call.function.model_dump()})
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    message["reasoning_content"] = "".join(reasoning) or None
    if calls:
        message["tool_calls"] = calls
    return {k: v for k, v in message.items() if v is not None}, finish, usage


def anthropic_turn(client: anthropic.Anthropic, *, stream: bool, **kwargs: Any) -> Any:
    """One Messages turn, unary or streamed (then the streamed text must equal the final message's)."""
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as events:
        text = "".join(events.text_stream)
        message = events.get_final_message()
    assert text == "".join(block.text for block in message.content if block.type == "text")
    return message


# ---- the trajectory ------------------------------------------------------------------------------------------------


def full_view(url: str, sid: str, headers: dict[str, str] | None = None, branch: int = 0) -> dict[str, Any]:
    return _session_get(url, sid, {"full": "true", "branch": str(branch)}, headers, timeout=30).json()


def session_sample(url: str, sid: str, headers: dict[str, str] | None = None, branch: int = 0) -> dict[str, np.ndarray]:
    return load(_session_get(url, f"{sid}/sample", {"branch": branch}, headers, timeout=30).content)


def template_messages(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The recorded conversation as Hugging Face chat templates take it: messages and tools."""
    messages = []
    for m in record["messages"]:
        message: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning") is not None:
            message["reasoning_content"] = m["reasoning"]
        if m["tool_calls"]:
            message["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": name, "arguments": _parsed(arguments)}}
                for id_, name, arguments in m["tool_calls"]
            ]
        if m["tool_call_id"] is not None:
            message["tool_call_id"] = m["tool_call_id"]
        if m.get("is_error"):
            message["is_error"] = True
        messages.append(message)
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                **({"description": t["description"]} if t["description"] else {}),
                "parameters": t["parameters"] or {"type": "object", "properties": {}},
            },
        }
        for t in record["tools"]
    ]
    return messages, tools


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, prompt: bool) -> list:
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=prompt, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def check_trajectory(
    url: str,
    sid: str,
    tokenizer: Any,
    answers: list[str],
    headers: dict[str, str] | None = None,
    *,
    branch: int = 0,
    branches: int = 1,
) -> dict[str, Any]:
    """Assert the session holds ``branches`` branches (by default one), and ``branch`` is a token-exact trajectory
    whose model tokens are ``answers`` (the scripted texts, in order); returns that branch's full view."""
    view = full_view(url, sid, headers, branch)
    assert view["branch"] == branch and len(view["branches"]) == branches, f"branches: {view['branches']}"
    check_recorded(view, session_sample(url, sid, headers, branch), tokenizer, answers)
    return view


def check_recorded(view: dict[str, Any], arrays: dict[str, np.ndarray], tokenizer: Any, answers: list[str]) -> None:
    """``check_trajectory`` on a branch's full view and sample as read (``arrays``: its safetensors tensors)."""
    record = view["chat"]["record"]
    messages, tools = template_messages(record)
    assert [m["role"] for m in messages].count("assistant") == len(answers), [m["role"] for m in messages]
    tokens, mask = arrays["tokens"].tolist(), arrays["loss_mask"]
    eos = tokenizer.eos_token_id
    expected = render_ids(tokenizer, messages, tools, prompt=False)
    # The template closes the last assistant message with "<|im_end|>\n"; the model stopped at <|im_end|>.
    assert tokens[-1] == eos and tokens == expected[: len(tokens)] and len(expected) == len(tokens) + 1, (
        "the session's tokens are not the template's one-shot rendering of the recorded conversation"
    )
    prompt_length = view["prompt_length"]
    trained = np.zeros(len(tokens), dtype=bool)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for index, text in zip(assistant, answers, strict=True):
        start = len(render_ids(tokenizer, messages[:index], tools, prompt=True))
        ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
        assert tokens[start : start + len(ids)] == ids, f"assistant message {index} is not the model's tokens"
        trained[start : start + len(ids)] = True
    # The sample's loss mask covers the response (what follows the prompt).
    np.testing.assert_array_equal(mask.astype(bool), trained[prompt_length:])


def check_turn_by_turn(
    url: str, sid: str, tokenizer: Any, answers: list[list[int]], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """For a template whose rendering of the earlier turns does not change within the conversation checked (a tool
    loop after one user turn), and whose model may end a turn on the next message's opening token (GLM) or on one
    of several stop tokens (harmony): assert the session holds one branch, and before each of the model's answers
    exactly the template's rendering of the conversation so far, generation prompt included (what the model saw);
    the answers are ``answers`` (the model's token ids, its stop token included), trained, and nothing else is."""
    view = full_view(url, sid, headers)
    assert len(view["branches"]) == 1, f"branches: {view['branches']}"
    messages, tools = template_messages(view["chat"]["record"])
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(assistant) == len(answers), [m["role"] for m in messages]
    arrays = session_sample(url, sid, headers)
    tokens, mask = arrays["tokens"].tolist(), arrays["loss_mask"]
    trained = np.zeros(len(tokens), dtype=bool)
    end = 0
    for index, ids in zip(assistant, answers, strict=True):
        before = render_ids(tokenizer, messages[:index], tools, prompt=True)
        assert tokens[: len(before)] == before, f"the tokens before assistant message {index} are not the rendering"
        assert tokens[len(before) : len(before) + len(ids)] == ids, f"assistant message {index} is not the model's"
        trained[len(before) : len(before) + len(ids)] = True
        end = len(before) + len(ids)
    assert len(tokens) == end, "the session goes on past the last answer"
    np.testing.assert_array_equal(mask.astype(bool), trained[view["prompt_length"] :])
    return view
