"""Agents as they are really run: Claude Code, the Codex CLI and the OpenAI Agents SDK against a session.

The real harnesses, installed by ``make harnesses`` into ``.harnesses/`` (pinned npm packages; the tests skip, quoting
the install log, when they could not be had) and the real ``openai-agents`` package. Each runs non-interactively with
its DEFAULT settings apart from what a user of a self-hosted model sets: the base URL (the session's), the key, a
HOME of its own, telemetry and update checks off, and (Codex) the served model's name. No model-name tricks, thinking
left as the harness sends it. A gateway with an API key, a simulator speaking the tiny tokenizer and answering with
scripted text (the model's tool calls in the template's format), a temporary working folder.

Each test checks the harness's exit code and output, that the harness really ran the tool (its output is in the
recorded tool result), and the session (``chat_checks.check_trajectory``): one branch, its tokens the template's
one-shot rendering of the conversation, the loss mask 1 exactly on the model's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chat_checks import check_trajectory, full_view, hermes_call, script
from chat_checks import new_session as kit_new_session
from conftest import Service, run_gateway
from procs import REPO_ROOT

HARNESS_DIR = REPO_ROOT / ".harnesses"
KEY = "harness-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RUN_TIMEOUT_S = 180


def harness(name: str) -> Path:
    binary = HARNESS_DIR / "node_modules" / ".bin" / name
    if not binary.exists():
        log = HARNESS_DIR / "install.log"
        why = log.read_text().strip()[-600:] if log.exists() else "run `make harnesses` (scripts/harnesses.sh)"
        pytest.skip(f"no {name} in {binary.parent}: {why}")
    return binary


@pytest.fixture(scope="module")
def harness_gateway(chat_sim: Service, tokenizer_dir: Path) -> Iterator[Service]:
    """A gateway as a user deploys it for agents: a key, the served model's tokenizer, its context length."""
    env = {"GATEWAY_API_KEY": KEY, "GATEWAY_CHAT_CONTEXT_TOKENS": "262144"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as service:
        yield service


def new_session(gateway: Service) -> str:
    return kit_new_session(gateway, headers=AUTH, prefix="agent")


def recorded_tool_results(view: dict[str, Any]) -> list[str]:
    return [m["content"] for m in view["chat"]["record"]["messages"] if m["role"] == "tool"]


def base_env(home: Path) -> dict[str, str]:
    """Nothing of the test process's environment but PATH and the locale: no stray keys or endpoints."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}


# ---- Claude Code --------------------------------------------------------------------------------------------------
def run_claude(gateway: Service, sid: str, prompt: str, tmp_path: Path, *extra: str) -> tuple[int, list[dict]]:
    """``claude -p PROMPT --output-format stream-json`` in a fresh working folder; its exit code and events."""
    claude = harness("claude")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    env = base_env(home) | {
        "ANTHROPIC_BASE_URL": f"{gateway.url}/v1/sessions/{sid}",
        "ANTHROPIC_API_KEY": KEY,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    args = [str(claude), "-p", prompt, "--output-format", "stream-json", "--verbose", *extra]
    done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:])
    return done.returncode, events


def claude_result(events: list[dict]) -> dict[str, Any]:
    (result,) = [e for e in events if e.get("type") == "result"]
    return result


def claude_tool_uses(events: list[dict]) -> list[dict[str, Any]]:
    return [
        block
        for e in events
        if e.get("type") == "assistant"
        for block in e["message"]["content"]
        if block.get("type") == "tool_use"
    ]


def test_claude_code_text_answer(harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path) -> None:
    sid = new_session(harness_gateway)
    answer = "Hello! How can I help you today?"
    script(chat_sim, sid, answer)
    code, events = run_claude(harness_gateway, sid, "Say hello", tmp_path)
    assert code == 0
    result = claude_result(events)
    assert result["is_error"] is False and result["result"] == answer
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [answer], AUTH)
    roles = [m["role"] for m in view["chat"]["record"]["messages"]]
    # Claude Code's own conversation: its system prompt, the user's turn, and a system message inside messages
    # (rendered where it stands), then the model's answer.
    assert roles[0] == "system" and "system" in roles[1:-1] and roles[-1] == "assistant"
    assert any("Say hello" in m["content"] for m in view["chat"]["record"]["messages"] if m["role"] == "user")


def test_claude_code_runs_a_bash_tool_and_answers(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    sid = new_session(harness_gateway)
    call = hermes_call("Bash", {"command": "echo hello-from-bash", "description": "Print a greeting"})
    final = "The command printed hello-from-bash."
    script(chat_sim, sid, f"Let me run it.\n{call}", final)
    code, events = run_claude(harness_gateway, sid, "Run echo hello-from-bash", tmp_path)
    assert code == 0
    assert claude_result(events)["result"] == final
    (use,) = claude_tool_uses(events)
    assert use["name"] == "Bash" and use["input"]["command"] == "echo hello-from-bash"
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [f"Let me run it.\n{call}", final], AUTH)
    assert recorded_tool_results(view) == ["hello-from-bash"]  # Claude Code ran it and sent back its output


def test_claude_code_parallel_tool_calls_are_recorded_in_call_order(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    """Claude Code runs both calls at once and sends their results in the order they finished (the slow first
    call last); the trajectory pairs each result with its call by position (Hermes-style templates write no ids)."""
    sid = new_session(harness_gateway)
    calls = "\n".join(
        [
            hermes_call("Bash", {"command": "sleep 1; echo first-call", "description": "First"}),
            hermes_call("Bash", {"command": "echo second-call", "description": "Second"}),
        ]
    )
    final = "Both commands ran."
    script(chat_sim, sid, calls, final)
    code, events = run_claude(harness_gateway, sid, "Run both commands", tmp_path)
    assert code == 0
    assert claude_result(events)["result"] == final
    assert [u["input"]["command"] for u in claude_tool_uses(events)] == ["sleep 1; echo first-call", "echo second-call"]
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [calls, final], AUTH)
    assert recorded_tool_results(view) == ["first-call", "second-call"]


def test_claude_code_continue_extends_the_same_branch(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    """``claude -p --continue`` resends the earlier conversation with a new user turn: it extends the record."""
    sid = new_session(harness_gateway)
    first, second = "Hello there!", "Still here."
    script(chat_sim, sid, first, second)
    assert run_claude(harness_gateway, sid, "Say hello", tmp_path)[0] == 0
    code, events = run_claude(harness_gateway, sid, "Again", tmp_path, "--continue")
    assert code == 0 and claude_result(events)["result"] == second
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [first, second], AUTH)
    assert [m["content"] for m in view["chat"]["record"]["messages"] if m["role"] == "user"][-1] == "Again"


def test_claude_code_subagent_keeps_the_main_conversation_in_one_branch(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    """The model starts an Explore subagent (Claude Code's Agent tool; in the foreground, so that the requests come
    in a fixed order for the script): the subagent calls the same base URL with its own system prompt and becomes a
    new root branch, and the main agent's next request, which extends its own record, stays in branch 0."""
    sid = new_session(harness_gateway)
    arguments = {
        "description": "Find the config",
        "prompt": "Find the config file and report its name.",
        "subagent_type": "Explore",
        "run_in_background": False,
    }
    call, report, final = hermes_call("Agent", arguments), "The config file is settings.toml.", "Found settings.toml."
    script(chat_sim, sid, call, report, final)
    code, events = run_claude(harness_gateway, sid, "Use an Explore agent to find the config", tmp_path)
    assert code == 0 and claude_result(events)["result"] == final
    main = check_trajectory(harness_gateway.url, sid, tokenizer, [call, final], AUTH, branches=2)
    (result,) = recorded_tool_results(main)
    assert report in result  # the subagent's report came back as the Agent tool's result
    sub = check_trajectory(harness_gateway.url, sid, tokenizer, [report], AUTH, branch=1, branches=2)
    assert sub["branches"][1] == sub["branches"][1] | {"parent": None, "cause": "new_root", "turns": 1}
    assert any("Find the config file" in m["content"] for m in sub["chat"]["record"]["messages"] if m["role"] == "user")


def test_claude_code_recovers_from_a_context_overflow_by_lowering_max_tokens(
    chat_sim: Service, tokenizer_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """Claude Code asks for a 128k-token answer; on a model with a smaller context the gateway says so in
    Anthropic's words (``input length and `max_tokens` exceed context limit: X + Y > Z``), which Claude Code parses
    to retry with what fits."""
    env = {"GATEWAY_API_KEY": KEY, "GATEWAY_CHAT_CONTEXT_TOKENS": "65536"}
    with run_gateway(chat_sim.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning", env=env) as gateway:
        sid = new_session(gateway)
        answer = "Hello within the context."
        script(chat_sim, sid, answer)
        code, events = run_claude(gateway, sid, "Say hello", tmp_path)
        assert code == 0 and claude_result(events)["result"] == answer
        metrics = httpx.get(f"{gateway.url}/metrics", headers=AUTH).text
        route = 'method="POST",route="/v1/sessions/{session_id}/v1/messages"'
        assert f'gateway_requests_total{{{route},status="400"}} 1.0' in metrics  # refused once, then it fit
        assert f'gateway_requests_total{{{route},status="200"}} 1.0' in metrics
        check_trajectory(gateway.url, sid, tokenizer, [answer], AUTH)


# ---- Codex --------------------------------------------------------------------------------------------------------
def run_codex(gateway: Service, sid: str, prompt: str, tmp_path: Path) -> tuple[int, list[dict]]:
    """``codex exec --json PROMPT`` in a fresh working folder, configured as a user points it at a self-hosted model
    (a model provider with the session's base URL, the Responses wire API, the served model's name)."""
    codex = harness("codex")
    work, home = tmp_path / "work", tmp_path / "home"
    codex_home = home / ".codex"
    work.mkdir(exist_ok=True)
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        "\n".join(
            [
                'model = "tiny"',
                'model_provider = "slime-gateway"',
                "check_for_update_on_startup = false",
                "[analytics]",
                "enabled = false",
                "[model_providers.slime-gateway]",
                'name = "slime-gateway"',
                f'base_url = "{gateway.url}/v1/sessions/{sid}"',
                'wire_api = "responses"',
                'env_key = "SLIME_GATEWAY_KEY"',
                "",
            ]
        )
    )
    env = base_env(home) | {"CODEX_HOME": str(codex_home), "SLIME_GATEWAY_KEY": KEY}
    args = [str(codex), "exec", "--json", "--skip-git-repo-check", prompt]
    done = subprocess.run(
        args, cwd=work, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:])
    return done.returncode, events


def codex_items(events: list[dict], kind: str) -> list[dict[str, Any]]:
    return [e["item"] for e in events if e.get("type") == "item.completed" and e["item"].get("type") == kind]


def test_codex_text_answer(harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path) -> None:
    sid = new_session(harness_gateway)
    answer = "Hello from the served model!"
    script(chat_sim, sid, answer)
    code, events = run_codex(harness_gateway, sid, "Say hello", tmp_path)
    assert code == 0
    assert [m["text"] for m in codex_items(events, "agent_message")] == [answer]
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [answer], AUTH)
    assert any(m["content"] == "Say hello" for m in view["chat"]["record"]["messages"] if m["role"] == "user")


def test_codex_runs_a_shell_command_and_answers(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    sid = new_session(harness_gateway)
    call = hermes_call("exec_command", {"cmd": "echo hello-from-shell"})
    final = "The shell printed hello-from-shell."
    script(chat_sim, sid, call, final)
    code, events = run_codex(harness_gateway, sid, "Run echo hello-from-shell", tmp_path)
    assert code == 0
    (command,) = codex_items(events, "command_execution")
    assert "echo hello-from-shell" in command["command"] and "hello-from-shell" in command["aggregated_output"]
    assert [m["text"] for m in codex_items(events, "agent_message")] == [final]
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [call, final], AUTH)
    (result,) = recorded_tool_results(view)
    assert "hello-from-shell" in result  # Codex ran it and sent back its output


def test_codex_parallel_shell_commands(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    sid = new_session(harness_gateway)
    calls = "\n".join(
        [
            hermes_call("exec_command", {"cmd": "sleep 1; echo first-call"}),
            hermes_call("exec_command", {"cmd": "echo second-call"}),
        ]
    )
    final = "Both commands ran."
    script(chat_sim, sid, calls, final)
    code, events = run_codex(harness_gateway, sid, "Run both commands", tmp_path)
    assert code == 0
    commands = codex_items(events, "command_execution")
    assert len(commands) == 2 and all(c["exit_code"] == 0 for c in commands)
    assert [m["text"] for m in codex_items(events, "agent_message")] == [final]
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [calls, final], AUTH)
    first, second = recorded_tool_results(view)
    assert "first-call" in first and "second-call" in second  # in the order of the calls


# ---- the OpenAI Agents SDK ------------------------------------------------------------------------------------------
async def run_agent(gateway: Service, sid: str, prompt: str, *, responses: bool) -> Any:
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny-in-{city}"

    client = AsyncOpenAI(base_url=f"{gateway.url}/v1/sessions/{sid}", api_key=KEY, max_retries=0)
    agent = Agent(name="weather", instructions="You answer weather questions.", model="tiny", tools=[get_weather])
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=client, use_responses=responses), tracing_disabled=True
    )
    return await Runner.run(agent, prompt, run_config=config)


@pytest.mark.parametrize("responses", [True, False], ids=["responses-model", "chat-model"])
async def test_openai_agents_sdk_runs_a_tool_loop(
    harness_gateway: Service, chat_sim: Service, tokenizer: Any, responses: bool
) -> None:
    """The Agents SDK's default model speaks the Responses API, its chat model chat completions: both send no
    length, so the gateway's default (the context left) must let the tool call through whole."""
    sid = new_session(harness_gateway)
    call = hermes_call("get_weather", {"city": "Paris"})
    final = "It is sunny in Paris."
    script(chat_sim, sid, call, final)
    result = await run_agent(harness_gateway, sid, "Weather in Paris?", responses=responses)
    assert result.final_output == final
    view = check_trajectory(harness_gateway.url, sid, tokenizer, [call, final], AUTH)
    assert recorded_tool_results(view) == ["sunny-in-Paris"]
    assert view["chat"]["record"]["messages"][0] == {
        "role": "system",
        "content": "You answer weather questions.",
        "tool_calls": [],
        "tool_call_id": None,
        "name": None,
    }


def test_full_view_holds_the_whole_record(harness_gateway: Service, chat_sim: Service) -> None:
    """``?full=true`` carries the conversation whole (what the checks above read), the curl view a summary."""
    sid = new_session(harness_gateway)
    long_text = "word " * 100
    script(chat_sim, sid, "Short answer.")
    body = {"model": "tiny", "input": long_text, "max_output_tokens": 32}
    response = httpx.post(f"{harness_gateway.url}/v1/sessions/{sid}/responses", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    record = full_view(harness_gateway.url, sid, AUTH)["chat"]["record"]
    assert record["messages"][0]["content"] == long_text
    summary = httpx.get(f"{harness_gateway.url}/v1/sessions/{sid}", headers=AUTH).json()["chat"]
    assert "record" not in summary and len(summary["messages"][0]["content"]) < len(long_text)
