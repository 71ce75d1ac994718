"""The measured case of a weight update landing mid-answer, for each chat API, unary and streamed, and each of SGLang's
pause modes: what the client gets, and what the session keeps.

The scripted model answers eight sentences and then a tool call; the simulator holds it at token ``HELD_AT`` (the
``hold`` fault) while the client waits, and the trainer's side does what slime does to update an engine's weights:
``/pause_generation`` (the mode under test), ``/flush_cache``, a new weight version (``/update_weight_version``),
``/continue_generation``. Used by tests/test_weight_updates.py, and run on its own for the before/after table of
docs/operations/weight-updates.md::

    .venv/bin/python tests/weight_update_case.py          # starts a simulator and a gateway, prints the table
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
from chat_checks import anthropic_turn, hermes_call, new_session, openai_chat, script, view
from conftest import Service, run_gateway, run_simulator

SENTENCES = (
    "The forecast for Paris is mixed this week. Monday starts with light rain in the morning. "
    "The afternoon clears up and the wind drops. Tuesday is warmer, with sunny spells until the evening. "
    "Wednesday brings clouds from the west. Thursday looks dry but cool. Friday is the best day for a walk. "
    "To be sure about today, I will look it up."
)
CALL = hermes_call("get_weather", {"city": "Paris"})
ANSWER = f"{SENTENCES}\n{CALL}"
HELD_AT = 49  # the tiny tokenizer's 49 first tokens of ANSWER end inside a word ("... and the w")
APIS = ("chat", "messages", "responses")
MODES = ("abort", "retract", "in_place")
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": ANTHROPIC_TOOL["input_schema"],
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@dataclass
class Outcome:
    """What one run of the case gave: the client's answer (or its error) and the session's record of the turn."""

    api: str
    stream: bool
    mode: str
    finish: str | None  # the API's own finish / stop reason / status
    content: str
    tool_calls: list[str]  # the names called
    error: str | None  # the error the client raised (its class and the gateway's error type)
    status: str  # the session's
    response_tokens: int
    model_turns: int
    spans: list[dict[str, Any]]  # the turn's weight version spans
    resumed: int | None

    @property
    def whole(self) -> bool:
        """The client got the whole answer: every sentence, and the tool call."""
        return self.error is None and self.content.strip() == SENTENCES and self.tool_calls == ["get_weather"]

    def client_line(self) -> str:
        if self.error is not None:
            return f"error: {self.error}"
        tail = self.content[-12:].replace("\n", " ")
        return (
            f"{self.finish}, content {len(self.content)} chars ending {tail!r}, tool calls {self.tool_calls or 'none'}"
        )

    def session_line(self) -> str:
        versions = ", ".join(f"{s['version']} [{s['start']}, {s['end']})" for s in self.spans)
        resumed = "" if self.resumed is None else f", resumed {self.resumed}x"
        return (
            f"{self.status}, {self.response_tokens} tokens in {self.model_turns} model turn(s){resumed}; versions "
            f"{versions}"
        )


def call(gateway: Service, sid: str, api: str, stream: bool) -> tuple[str | None, str, list[str]]:
    """The client's turn: (finish, content, names of the tools called)."""
    base = f"{gateway.url}/v1/sessions/{sid}"
    if api == "chat":
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        message, finish, _ = openai_chat(client, MESSAGES, stream=stream)
        calls = [c["function"]["name"] for c in message.get("tool_calls", [])]
        return finish, message.get("content") or "", calls
    if api == "messages":
        client_a = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)
        message = anthropic_turn(
            client_a, stream=stream, model="tiny", max_tokens=512, messages=MESSAGES, tools=[ANTHROPIC_TOOL]
        )
        text = "".join(block.text for block in message.content if block.type == "text")
        return message.stop_reason, text, [block.name for block in message.content if block.type == "tool_use"]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    if not stream:
        response = client.responses.create(model="tiny", input=MESSAGES, tools=[RESPONSES_TOOL])
    else:
        response = None
        for event in client.responses.create(model="tiny", input=MESSAGES, tools=[RESPONSES_TOOL], stream=True):
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                response = event.response
        assert response is not None
        if response.status == "failed":
            raise openai.APIError(f"response.failed: {response.error}", request=None, body=None)  # type: ignore[arg-type]
    text = "".join(
        part.text for item in response.output if item.type == "message" for part in item.content if part.type
    )
    return response.status, text, [item.name for item in response.output if item.type == "function_call"]


def wait_for(sim: Service, **wanted: Any) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{sim.url}/sim/stats").json()
        if all(stats[key] == value for key, value in wanted.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the simulator never got to {wanted}: {stats}")
        time.sleep(0.01)


def update_weights(sim: Service, mode: str, version: str) -> None:
    """slime's sequence around a weight update (its pause is the default mode, abort; the others are SGLang's)."""
    assert httpx.post(f"{sim.url}/pause_generation", json={"mode": mode}, timeout=30).status_code == 200
    httpx.post(f"{sim.url}/flush_cache")  # refused (400) while an in_place pause keeps answers running, as SGLang's
    update = {"new_version": version, "abort_all_requests": False}
    assert httpx.post(f"{sim.url}/update_weight_version", json=update).status_code == 200
    assert httpx.post(f"{sim.url}/continue_generation", json={}).status_code == 200


def run_case(gateway: Service, sim: Service, api: str, stream: bool, mode: str) -> Outcome:
    """One run, from a fresh simulator state (weights ``sim-v0``, updated to ``sim-v1`` mid-answer)."""
    assert httpx.post(f"{sim.url}/sim/reset").status_code == 200
    sid = new_session(gateway, prefix=f"wu-{api}")
    script(sim, sid, ANSWER)
    fault = {"mode": "hold", "after_tokens": HELD_AT}
    assert httpx.post(f"{sim.url}/sim/faults", json=fault).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call, gateway, sid, api, stream)
        wait_for(sim, held=1)
        update_weights(sim, mode, "sim-v1")
        try:
            finish, content, calls = pending.result(timeout=60)
            error = None
        except (openai.APIError, anthropic.APIError) as exc:
            finish, content, calls = None, "", []
            body = getattr(exc, "body", None)
            kind = body.get("code") or body.get("type") if isinstance(body, dict) else None
            error = f"{type(exc).__name__} {getattr(exc, 'status_code', '') or ''} {kind or exc.message}".strip()
    state = wait_session_free(gateway, sid)
    models = [turn for turn in state["turn_log"] if turn["kind"] == "model"]
    return Outcome(
        api,
        stream,
        mode,
        finish,
        content,
        calls,
        error,
        state["status"],
        state["response_length"],
        len(models),
        models[-1]["weight_version_spans"] if models else [],
        models[-1].get("resumed") if models else None,
    )


def wait_session_free(gateway: Service, sid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (state := view(gateway, sid))["busy"]:
        assert time.monotonic() < deadline, "the turn never ended"
        time.sleep(0.01)
    return state


def table(outcomes: list[Outcome]) -> str:
    rows = ["| API | mode | pause | the client gets | the session keeps |", "|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(
            f"| {o.api} | {'stream' if o.stream else 'unary'} | {o.mode} | {o.client_line()} | {o.session_line()} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the weight-update case, each chat API x unary/stream x pause mode")
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    from sglang_sim.tiny_tokenizer import build_tiny_chat_tokenizer

    tokenizer_dir = build_tiny_chat_tokenizer(Path(tempfile.mkdtemp(prefix="tiny-tokenizer-")))
    outcomes = []
    with (
        run_simulator("--tokenizer", str(tokenizer_dir)) as sim,
        run_gateway(sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning") as gateway,
    ):
        for api in args.apis.split(","):
            for stream in (False, True):
                outcomes.extend(run_case(gateway, sim, api, stream, mode) for mode in args.modes.split(","))
    print(table(outcomes))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
