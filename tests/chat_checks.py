"""What every agent test checks of the session it leaves: the trajectory the gateway recorded is token-exact.

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
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import load


def full_view(url: str, sid: str, headers: dict[str, str] | None = None, branch: int = 0) -> dict[str, Any]:
    params = {"full": "true", "branch": str(branch)}
    response = httpx.get(f"{url}/v1/sessions/{sid}", params=params, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def session_sample(
    url: str, sid: str, headers: dict[str, str] | None = None, branch: int = 0
) -> dict[str, np.ndarray]:
    response = httpx.get(f"{url}/v1/sessions/{sid}/sample", params={"branch": branch}, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return load(response.content)


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
    record = view["chat"]["record"]
    messages, tools = template_messages(record)
    assert [m["role"] for m in messages].count("assistant") == len(answers), [m["role"] for m in messages]
    arrays = session_sample(url, sid, headers, branch)
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
    return view
