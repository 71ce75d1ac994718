"""Row 13: a chat turn (OpenAI Chat Completions, and the OpenAI Responses API, on a session) against a token-level
session turn, same answer.

One gateway started with ``--tokenizer`` (the tiny chat tokenizer, ``sglang_sim.tiny_tokenizer``) before the
shared simulator serves both kinds of session. Each round builds one session of each kind up to the same point, then
times the same step on both, the order alternating:

- chat: ``POST /v1/sessions`` without ``prompt_ids``, a first chat completion on a user message (its rendered prompt
  ~``prompt_tokens``), then, timed, the second chat completion: the whole history (user, the assistant's reply as it
  came back, a new ~``followup_tokens`` user message), which the gateway checks against the session's record,
  renders after the session's tokens (template + tokenizer) and answers;
- responses: the same through ``POST /v1/sessions/{id}/responses`` as Codex sends it (``store: false``, the whole
  input each turn: the user message, the answer's output items as they came back, the new user message);
- token-level: ``POST /v1/sessions`` with ``prompt_ids`` of the chat prompt's exact length and a first
  ``/generate``, then, timed, ``/append`` of as many ids as the chat turn added and ``/generate``: what a
  token-level client sends for the same continuation.

Both answers are ``response_tokens`` long (``ignore_eos``), with routing and top-p replay, on sequences of identical
lengths; the sessions are deleted after each round (not timed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import uvloop

from bench.core import Check, Context, RowResult, log, median, ratio, rotation
from bench.services import ServerProcess, read_body
from bench.workload import TOP_P_FLAG, prompt_ids
from slime_wire.http1 import ConnectionPool

if TYPE_CHECKING:
    from tokenizers import Tokenizer

NAME = "chat turn vs token turn"
JSON = [(b"content-type", b"application/json")]
GOAL = 1.2
TEMPLATE_TOKENS = 8  # what the template puts around a user message (its role line, the close, the generation prompt)
TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

_SENTENCE = (  # the words user messages are made of
    "the weather in Paris is sunny today and the forecast for tomorrow morning calls for light rain over Berlin "
    "while Tokyo stays cloudy please call the search tool to look up the population of each city and compute the "
    "average with the calculator then write a short report with a table of temperature humidity and wind for every "
    "place the user asked about including New York"
)


def user_text(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    """Plain English-like text that the tokenizer encodes to about ``tokens`` tokens."""
    words = np.random.default_rng(seed).choice(_SENTENCE.split(), size=4 * tokens + 16).tolist()
    text = " ".join(f"{w}." if i % 13 == 12 else w for i, w in enumerate(words))
    encoding = tokenizer.encode(text, add_special_tokens=False)
    keep = max(1, tokens - TEMPLATE_TOKENS)
    return text[: encoding.offsets[min(keep, len(encoding.ids)) - 1][1]]


class Sides:
    """The two kinds of session, each run up to its timed second turn."""

    def __init__(self, ctx: Context, gateway: ServerProcess, pool: ConnectionPool, tokenizer_dir: Path) -> None:
        shape, moe = ctx.suite.chat_turn, ctx.suite.moe
        self.shape = shape
        self.gateway = gateway
        self.pool = pool
        from tokenizers import Tokenizer  # the gateway's chat extra: only this row needs it

        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.first = {"role": "user", "content": user_text(tokenizer, shape.prompt_tokens, seed=21)}
        self.followup = {"role": "user", "content": user_text(tokenizer, shape.followup_tokens, seed=22)}
        sampling = {"ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
        self.session = {"num_layers": moe.layers, "moe_router_topk": moe.topk, "sampling_defaults": sampling}
        self.prompt: list[int] = []  # the token-level side's, once the chat side's lengths are known
        self.appended: list[int] = []
        self.total_tokens = 0  # after the timed turn, both sides

    async def chat(self) -> tuple[float, float, float, dict[str, Any]]:
        """(wall s, gateway CPU s, render ms of the timed turn, the timed turn's ``gateway`` object)."""
        pool, r = self.pool, self.shape.response_tokens
        created = orjson.loads(await read_body(pool, "POST", "/v1/sessions", self.session))
        path = f"/v1/sessions/{created['session_id']}"
        try:
            first = self.check_chat(await read_body(pool, "POST", f"{path}/chat/completions", self.turn([self.first])))
            reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
            body = self.turn([self.first, reply, self.followup])
            gateway, started = self.gateway.cpu_seconds(), time.perf_counter()
            raw = await read_body(pool, "POST", f"{path}/chat/completions", body)
            elapsed, cpu = time.perf_counter() - started, self.gateway.cpu_seconds() - gateway
        finally:
            await read_body(pool, "DELETE", path)
        second = self.check_chat(raw)
        info = second["gateway"] | {"first_total": first["gateway"]["total_tokens"]}
        info["first_render_ms"] = first["gateway"]["render_ms"]
        assert info["first_total"] - r > 0 and second["gateway"]["total_tokens"] > info["first_total"] + r, info
        return elapsed, cpu, float(second["gateway"]["render_ms"]), info

    async def responses(self) -> tuple[float, float, float, dict[str, Any]]:
        """The chat side's turns through the Responses API: (wall s, gateway CPU s, render ms, ``gateway``)."""
        pool = self.pool
        created = orjson.loads(await read_body(pool, "POST", "/v1/sessions", self.session))
        path = f"/v1/sessions/{created['session_id']}"
        try:
            first = self.check_responses(await read_body(pool, "POST", f"{path}/responses", self.inputs([self.first])))
            body = self.inputs([self.first, *first["output"], self.followup])
            gateway, started = self.gateway.cpu_seconds(), time.perf_counter()
            raw = await read_body(pool, "POST", f"{path}/responses", body)
            elapsed, cpu = time.perf_counter() - started, self.gateway.cpu_seconds() - gateway
        finally:
            await read_body(pool, "DELETE", path)
        second = self.check_responses(raw)
        if second["gateway"]["total_tokens"] != self.total_tokens:
            raise RuntimeError(f"responses session at {second['gateway']['total_tokens']}, chat at {self.total_tokens}")
        return elapsed, cpu, float(second["gateway"]["render_ms"]), second["gateway"]

    def inputs(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        tool = {"type": "function", **TOOL["function"]}
        return {"input": items, "tools": [tool], "max_output_tokens": self.shape.response_tokens, "store": False}

    def check_responses(self, raw: bytes) -> dict[str, Any]:
        answer = orjson.loads(raw)
        if answer.get("status") != "incomplete" or answer["usage"]["output_tokens"] != self.shape.response_tokens:
            raise RuntimeError(f"the responses turn did not end as expected: {raw[-300:]!r}")
        return answer

    def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        # A tool, as agents send: the answer goes through the tool-call parser (and the reasoning parser) too.
        return {"messages": messages, "tools": [TOOL], "max_tokens": self.shape.response_tokens}

    def check_chat(self, raw: bytes) -> dict[str, Any]:
        answer = orjson.loads(raw)
        if answer["choices"][0]["finish_reason"] != "length" or (
            answer["usage"]["completion_tokens"] != self.shape.response_tokens
        ):  # ignore_eos: the turn ends at max_tokens
            raise RuntimeError(f"the chat turn did not end as expected: {raw[-300:]!r}")
        return answer

    def match(self, info: dict[str, Any]) -> None:
        """The token-level side's lengths: the chat prompt's, and as many appended ids as the chat turn added."""
        r = self.shape.response_tokens
        prompt = info["first_total"] - r
        added = info["total_tokens"] - info["first_total"] - r
        self.prompt = prompt_ids(prompt, seed=23)
        self.appended = prompt_ids(added, seed=24)
        self.total_tokens = info["total_tokens"]

    async def token(self) -> tuple[float, float, float]:
        """(wall s of append + generate, gateway CPU s, wall s of the generate alone)."""
        pool, sampling = self.pool, {"max_new_tokens": self.shape.response_tokens}
        created = orjson.loads(
            await read_body(pool, "POST", "/v1/sessions", self.session | {"prompt_ids": self.prompt})
        )
        path = f"/v1/sessions/{created['session_id']}"
        try:
            self.check_token(await read_body(pool, "POST", f"{path}/generate", {"sampling_params": sampling}))
            gateway, started = self.gateway.cpu_seconds(), time.perf_counter()
            await read_body(pool, "POST", f"{path}/append", {"token_ids": self.appended})
            generate_started = time.perf_counter()
            raw = await read_body(pool, "POST", f"{path}/generate", {"sampling_params": sampling})
            done = time.perf_counter()
            cpu = self.gateway.cpu_seconds() - gateway
        finally:
            await read_body(pool, "DELETE", path)
        summary = self.check_token(raw)
        if summary["total_tokens"] != self.total_tokens:
            raise RuntimeError(f"token-level session at {summary['total_tokens']}, chat at {self.total_tokens}")
        return done - started, cpu, done - generate_started

    @staticmethod
    def check_token(raw: bytes) -> dict[str, Any]:
        summary = orjson.loads(raw)
        if summary["status"] != "truncated":
            raise RuntimeError(f"the token-level turn did not end as expected: {raw[-300:]!r}")
        return summary


async def measure(ctx: Context) -> dict[str, Any]:
    shape = ctx.suite.chat_turn
    gateway = ctx.services.chat_gateway
    pool = ConnectionPool(gateway.url, max_connections=4, connect_timeout_s=5, pool_timeout_s=5)
    sides = Sides(ctx, gateway, pool, ctx.services.chat_tokenizer)
    kinds = ("chat", "responses", "token", "generate", "chat cpu", "responses cpu", "token cpu", "render")
    got: dict[str, list[float]] = {kind: [] for kind in (*kinds, "first render", "responses render")}
    order = ("chat", "responses", "token")
    try:
        _, _, _, info = await sides.chat()  # warm-up, and the lengths the token-level side copies
        sides.match(info)
        await sides.token()
        await sides.responses()
        for round_number in range(shape.rounds):
            for kind in rotation(order, round_number):  # each kind runs first, second and last in turn
                if kind == "chat":
                    wall, cpu, render, info = await sides.chat()
                    got["render"].append(render)
                    got["first render"].append(float(info["first_render_ms"]))
                elif kind == "responses":
                    wall, cpu, render, _ = await sides.responses()
                    got["responses render"].append(render)
                else:
                    wall, cpu, generate = await sides.token()
                    got["generate"].append(generate)
                got[kind].append(wall)
                got[f"{kind} cpu"].append(cpu)
            log(
                f"row 13: round {round_number + 1}/{shape.rounds}: chat {got['chat'][-1] * 1e3:.0f} ms "
                f"(render {got['render'][-1]:.2f} ms), responses {got['responses'][-1] * 1e3:.0f} ms, token "
                f"{got['token'][-1] * 1e3:.0f} ms"
            )
    finally:
        await pool.aclose()
    return {"got": got, "info": info, "prompt": len(sides.prompt), "appended": len(sides.appended)}


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.chat_turn
    measured = uvloop.run(measure(ctx))
    got, info = measured["got"], measured["info"]
    wall = {kind: median(got[kind]) * 1e3 for kind in ("chat", "responses", "token", "generate")}
    cpu = {kind: median(got[f"{kind} cpu"]) * 1e3 for kind in ("chat", "responses", "token")}
    render, first_render = median(got["render"]), median(got["first render"])
    # Paired: each round's chat turn over its own token-level turn (run back to back), then the median; a load that
    # comes and goes on the machine slows both turns of a round alike.
    chat_over_token = median([ratio(c, t) for c, t in zip(got["chat"], got["token"], strict=True)])
    responses_over_token = median([ratio(c, t) for c, t in zip(got["responses"], got["token"], strict=True)])
    history = info["first_total"]  # tokens before the continuation
    return RowResult(
        number=13,
        name=NAME,
        measured=(
            f"second turn, median wall chat / token-level: {wall['chat']:.0f} / {wall['token']:.0f} ms "
            f"({ratio(wall['chat'], wall['token']):.2f}x; paired per round {chat_over_token:.2f}x; the token side's "
            f"/generate alone {wall['generate']:.0f} ms); Responses API {wall['responses']:.0f} ms (paired "
            f"{responses_over_token:.2f}x); gateway CPU per turn chat / responses / token-level {cpu['chat']:.0f} / "
            f"{cpu['responses']:.0f} / {cpu['token']:.0f} ms ({ratio(cpu['chat'], cpu['token']):.2f}x); template "
            f"render + tokenize (gateway.render_ms, median) {render:.2f} ms for the follow-up, {first_render:.2f} ms "
            "for the first prompt"
        ),
        checks=[
            Check("chat/token-level turn", chat_over_token, GOAL, higher_is_better=False),
            Check("responses/token-level turn", responses_over_token, GOAL, higher_is_better=False),
        ],
        notes=[
            f"shapes: a {measured['prompt']}-token first prompt, a {shape.response_tokens}-token first answer, a "
            f"{measured['appended']}-token continuation (a ~{shape.followup_tokens}-token user message as the "
            f"template renders it after the answer), then the timed {shape.response_tokens}-token answer "
            f"({info['total_tokens']} tokens at the end, {history} before the continuation), "
            f"{ctx.suite.moe.describe()}, routing + top-p replay (ignore_eos, top-p flag and temperature in the "
            "session's sampling_defaults)",
            "one gateway, started with --tokenizer (the tiny byte-level BPE chat tokenizer of "
            "sglang_sim.tiny_tokenizer, ChatML/Qwen-style template) and slime's Qwen3.6 parsers "
            "(GATEWAY_CHAT_TOOL_PARSER=qwen3_coder, GATEWAY_CHAT_REASONING_PARSER=qwen3; the chat requests carry one "
            "tool, so each answer goes through both), serves both sides; the simulator answers with its own "
            "vocabulary ids (the gateway does not check them against the tokenizer)",
            "the pairing: the second turn of each kind of session, on sequences of identical lengths. chat: POST "
            "/v1/sessions/{id}/chat/completions carrying the whole history (the first user message, the assistant's "
            "reply as it came back, the new user message): request parsed, history matched against the session's "
            "record, the new message rendered after the session's tokens (the template renders the history twice), "
            "then the model turn and the reply's parse and JSON. token-level: POST /append of as many ids as the "
            "chat turn added, then POST /generate: what a token-level client sends for the same continuation (the "
            "token prompt and appended lengths are copied from the chat side's answers, and the totals checked "
            "equal every round)",
            "responses: the same turns through POST /v1/sessions/{id}/responses as Codex sends them (store: false, "
            "the whole input each turn, the first answer's output items as they came back), checked to end at the "
            "same token count",
            f"{shape.rounds} rounds after one warm-up round, the three kinds in rotating order, fresh "
            "sessions each round (created and run to the timed turn untimed, deleted after it); wall time from "
            "request to last byte with slime_wire's client in this process, medians; the check is the median of "
            "the per-round ratios (each round's two turns run back to back, so a passing load slows both); gateway "
            "CPU: the run time of all its threads (/proc/<pid>/task/*/schedstat, nanoseconds) around the timed "
            "requests, medians",
            "render cost: the chat answer's gateway.render_ms (the template's apply_chat_template calls and the "
            "tokenizer encode of the turn's new text), median over the rounds, on its own: it is part of the chat "
            "turn's wall time, not added to it",
        ],
    )
