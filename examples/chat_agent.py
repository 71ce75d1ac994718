"""A tool-calling agent on a gateway chat session, with the unmodified OpenAI client.

    python examples/chat_agent.py --gateway http://127.0.0.1:8000
    python examples/chat_agent.py --gateway http://127.0.0.1:8000 --script-simulator http://127.0.0.1:30000

The gateway must run with --tokenizer (the served model's tokenizer directory). This creates a session without
prompt ids (its first chat request renders the prompt), points an `openai.OpenAI` client at
`{gateway}/v1/sessions/{id}`, and loops: the model answers, its tool calls run here (two local tools), their
results go back as `tool` messages, until the model answers without a tool call or --turns is reached. The gateway
keeps every token token-in-token-out: the model's own tokens as generated (trainable, with log-probs, routing and
top-p replay), the tool results as non-trainable tokens. At the end it prints what the session holds.

--script-simulator URL: against the SGLang simulator (started with --tokenizer), script the model's answers first
(a get_weather call, a calculator call, then the answer), so the loop is the same as with a real model.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import struct
import sys
from typing import Any

import httpx
import openai

QUESTION = "What is the weather in Paris today, and what is 12 * (3 + 4)?"
SYSTEM = "You are a helpful assistant. You may call tools to answer the user's question."


# ---- the tools: what the model sees (JSON schemas), and their implementations, here in the agent -----------------
def get_weather(city: str) -> dict[str, Any]:
    return {"city": city, "temperature_c": 21, "condition": "sunny"}  # a stand-in for a weather service


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> dict[str, Any]:
    def evaluate(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -evaluate(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    return {"expression": expression, "result": evaluate(ast.parse(expression, mode="eval").body)}


TOOLS = {"get_weather": get_weather, "calculator": calculator}


def _tool(name: str, description: str, arg: str, arg_description: str) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {arg: {"type": "string", "description": arg_description}},
        "required": [arg],
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOL_SCHEMAS = [
    _tool("get_weather", "The current weather in a city", "city", "the city's name, e.g. Paris"),
    _tool("calculator", "Evaluate an arithmetic expression", "expression", "e.g. 12 * (3 + 4)"),
]


def run_tool(call: dict[str, Any]) -> str:
    """A tool call's result as the `tool` message's content (errors too: the model should see them)."""
    try:
        result = TOOLS[call["function"]["name"]](**json.loads(call["function"]["arguments"]))
    except Exception as exc:  # unknown tool, bad arguments, a failing tool
        result = {"error": f"{type(exc).__name__}: {exc}"}
    return json.dumps(result)


# ---- the simulator's script (a real model needs none) -------------------------------------------------------------
def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as a Hermes-style model writes it (the gateway's hermes parser reads it back)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPT = [
    {"text": tool_call_text("get_weather", {"city": "Paris"})},
    {"text": "Now the arithmetic.\n" + tool_call_text("calculator", {"expression": "12 * (3 + 4)"})},
    {"text": "It is sunny and 21 degrees in Paris, and 12 * (3 + 4) = 84."},
]


def script_simulator(simulator_url: str, session_id: str) -> None:
    # The gateway's rids for this session are "{session_id}-{turn}-{hex}": the simulator answers them in order.
    body = {"rid_prefix": f"{session_id}-", "answers": SCRIPT}
    httpx.post(f"{simulator_url}/sim/script", json=body).raise_for_status()
    print(f"[chat] scripted {len(SCRIPT)} answers on the simulator for rids {session_id}-*")


# ---- one model turn -----------------------------------------------------------------------------------------------
def assistant_message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the next request sends it back (the gateway matches it against what the model wrote)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def complete(
    client: openai.OpenAI, messages: list[dict[str, Any]], args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One chat completion: the assistant message, and the gateway's note on the turn (unary answers only)."""
    params = {"model": args.model, "messages": messages, "tools": TOOL_SCHEMAS, "max_tokens": args.max_tokens}
    if not args.stream:
        completion = client.chat.completions.create(**params)
        message = completion.choices[0].message
        calls = [call.model_dump() for call in message.tool_calls or []]
        # Non-standard, beside OpenAI's fields: where the turn landed in the session.
        return assistant_message(message.content, calls), (completion.model_extra or {}).get("gateway")
    content, calls = "", {}  # calls by index
    print("[chat] streaming: ", end="", flush=True)
    for chunk in client.chat.completions.create(**params, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            print(delta.content, end="", flush=True)
            content += delta.content
        for part in delta.tool_calls or []:  # pieces of calls, merged by index (the gateway sends each whole)
            call = calls.setdefault(
                part.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] += part.id or ""
            if part.function:
                call["function"]["name"] += part.function.name or ""
                call["function"]["arguments"] += part.function.arguments or ""
    print()
    return assistant_message(content, [calls[i] for i in sorted(calls)]), None


def agent_loop(client: openai.OpenAI, args: argparse.Namespace) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    print(f"[chat] user: {QUESTION}")
    for turn in range(1, args.turns + 1):
        message, where = complete(client, messages, args)
        messages.append(message)
        if where:
            print(
                f"[chat] turn {turn}: session {where['total_tokens']} tokens, routing rows "
                f"{where['routed_experts_rows']}, render {where['render_ms']} ms"
            )
        if "tool_calls" not in message:
            print(f"[chat] assistant: {message['content']}")
            return messages
        for call in message["tool_calls"]:
            result = run_tool(call)
            print(f"[chat] tool call {call['function']['name']}({call['function']['arguments']}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    print(f"[chat] stopped after {args.turns} model turns (--turns) without a final answer")
    return messages


# ---- what the session holds ---------------------------------------------------------------------------------------
def runs(values: list[int]) -> str:
    """Run lengths: [1, 1, 0, 0, 0, 1] -> "1x2 0x3 1x1"."""
    out: list[list[int]] = []
    for value in values:
        if out and out[-1][0] == value:
            out[-1][1] += 1
        else:
            out.append([value, 1])
    return " ".join(f"{value}x{count}" for value, count in out)


def show_session(gw: httpx.Client, session_id: str) -> None:
    view = gw.get(f"/v1/sessions/{session_id}", params={"full": "true"}).raise_for_status().json()
    full = view.pop("full")
    print(f"[chat] curl -s $GATEWAY/v1/sessions/{session_id}:")
    print(
        f"[chat]   {view['status']}, {view['total_tokens']} tokens = prompt {view['prompt_length']} "
        f"+ response {view['response_length']}, {view['turns']} turns, branch {view.get('branch', 0)}"
    )
    print("[chat]   turn log:  " + ", ".join(f"{t['kind']} {t['num_tokens']}" for t in view["turn_log"]))
    print(f"[chat]   loss_mask: {runs(full['loss_mask'])} (1: the model's tokens, trained; 0: tool results)")
    replay = view["replay"]
    if replay["routed_experts"]:
        rows, moe = replay["routed_experts_rows"], view["moe"]
        print(f"[chat]   routing replay: {rows} rows x {moe['num_layers']} layers x top-{moe['topk']} experts")
    print(f"[chat]   top-p replay: {replay['top_p']}; weight versions {view['weight_versions']}")
    for message in view.get("chat", {}).get("messages", []):
        calls = ", ".join(c["name"] for c in message.get("tool_calls", []))
        text = (message["content"] or "").replace("\n", " ")[:60]
        written = message["generated_until_token"]
        origin = f"generated, ends at token {written}" if written is not None else "rendered"
        print(f"[chat]   {message['role']:>9}: {text!r}{f' calls {calls}' if calls else ''} ({origin})")


def show_sample(gw: httpx.Client, session_id: str) -> None:
    """The trainer's sample (safetensors; `slime_client` returns it as torch tensors): its tensors' shapes."""
    blob = gw.get(f"/v1/sessions/{session_id}/sample").raise_for_status().content
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    header.pop("__metadata__", None)
    print(f"[chat] sample ({len(blob)} bytes of safetensors):")
    for name, tensor in header.items():
        print(f"[chat]   {name:<28} {tensor['dtype']:<4} {tensor['shape']}")


# ---- main ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's URL")
    parser.add_argument("--turns", type=int, default=6, help="model turns at most")
    parser.add_argument("--stream", action="store_true", help="stream the completions")
    parser.add_argument("--script-simulator", metavar="URL", help="script the SGLang simulator's answers first")
    parser.add_argument("--model", default="default", help="the model name sent (the gateway serves one model)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per model turn")
    parser.add_argument("--num-layers", type=int, default=4, help="the model's num_hidden_layers (routing replay)")
    parser.add_argument("--topk", type=int, default=2, help="the model's num_experts_per_tok (routing replay)")
    parser.add_argument("--no-replay", action="store_true", help="no routing / top-p replay (dense model)")
    parser.add_argument("--session-id", help="choose the session id (default: the gateway picks one)")
    parser.add_argument("--fetch-sample", action="store_true", help="also fetch the training sample")
    parser.add_argument("--keep-session", action="store_true", help="leave the session on the gateway (for curl)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    api_key = os.environ.get("SLIME_GATEWAY_API_KEY", "")  # when the gateway has GATEWAY_API_KEY
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=args.gateway, headers=headers, timeout=120) as gw:
        # A chat session: no prompt_ids. The MoE shape turns on routing replay, the sampling default top-p replay.
        body: dict[str, Any] = {"metadata": {"example": "chat_agent"}}
        if args.session_id:
            body["session_id"] = args.session_id
        if not args.no_replay:
            body |= {"num_layers": args.num_layers, "moe_router_topk": args.topk}
            body["sampling_defaults"] = {"custom_params": {"return_top_p_token_ids": True}}
        session_id = gw.post("/v1/sessions", json=body).raise_for_status().json()["session_id"]
        print(f"[chat] session {session_id} on {args.gateway}")
        try:
            if args.script_simulator:
                script_simulator(args.script_simulator, session_id)
            # The unmodified OpenAI client: only the base URL points at the session.
            client = openai.OpenAI(base_url=f"{args.gateway}/v1/sessions/{session_id}", api_key=api_key or "none")
            agent_loop(client, args)
            show_session(gw, session_id)
            if args.fetch_sample:
                show_sample(gw, session_id)
        except (openai.APIError, httpx.HTTPError) as exc:
            print(f"[chat] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            if not args.keep_session:
                gw.delete(f"/v1/sessions/{session_id}")
    print("[chat] done" + (" (session kept)" if args.keep_session else " (session deleted)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
