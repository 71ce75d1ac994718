"""Agent RL rollouts as slime runs them: ``slime_client.agent.generate`` turns agent runs into slime's samples.

    python examples/agent_rl.py --gateway http://127.0.0.1:8000 --script-simulator http://127.0.0.1:30000
    python examples/agent_rl.py --gateway URL --script-simulator URL --agent claude_code --cli PATH/TO/claude

slime calls ``generate(args, sample, sampling_params)`` once per sample when it runs with
``--custom-generate-function-path slime_client.agent.generate``; this script does what slime would, for a group of
samples of one task: a git repository whose test fails (``calc.add`` subtracts). Each rollout gets a copy of the task
as its workspace and a session on the gateway (routing replay with the simulator's MoE shape, top-p replay); the agent
fixes the file with a shell tool and runs the test; the reward is the task's test, run in the workspace afterwards.
Then it prints the samples slime would train on, and checks them as slime's trainer does: one ``rollout_id`` per
rollout, the reward on each, ``len(rollout_routed_experts) == len(tokens) - 1``, top-p offsets for every response
token.

The agent (``--agent``): ``python`` (the default: the function ``shell_agent`` below, the OpenAI client and one tool),
``claude_code`` or ``codex`` (the CLI, ``--cli PATH`` or on PATH). ``--script-simulator URL``: against the SGLang
simulator (started with ``--tokenizer``), script the model's answers for each rollout's session first, in the
format of the gateway's default tool parser (Hermes), so the loop is the same as with a real model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

PROMPT = "calc.add is wrong: test_calc.py fails. Fix calc.py and run the test."
FIX = "sed -i 's/a - b/a + b/' calc.py"
TEST = "python3 test_calc.py"
SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command in the workspace; returns its output",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


# ---- what slime hands generate: its Sample (its fields, in short: slime itself is not importable here) -------------
@dataclass
class Sample:
    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    session_id: str | None = None
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)


# ---- the agent, the reward, the task -------------------------------------------------------------------------------
async def shell_agent(run: Any) -> None:
    """A Python agent (``SLIME_AGENT=module:function``): the OpenAI client on the session's base URL, one tool that
    runs shell commands in the workspace, until the model answers without a call. Returns None: the reward function
    grades."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key or "unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": run.prompt}]
    for _ in range(8):
        completion = await client.chat.completions.create(
            model=run.model, messages=messages, tools=[SHELL_TOOL], max_tokens=256
        )
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            command = json.loads(call.function.arguments)["command"]
            done = await asyncio.to_thread(
                subprocess.run, command, shell=True, cwd=run.workspace, capture_output=True, text=True, timeout=60
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": (done.stdout + done.stderr)[-2000:]})
    await client.close()


def task_reward(run: Any, outcome: Any) -> float:
    """The reward function (``SLIME_AGENT_REWARD``): the task's own test, in the rollout's workspace."""
    done = subprocess.run([sys.executable, "test_calc.py"], cwd=run.workspace, capture_output=True, timeout=60)
    return 1.0 if done.returncode == 0 else 0.0


def make_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "test_calc.py").write_text("from calc import add\n\nassert add(2, 3) == 5\nprint('test_calc: ok')\n")
    git = ["git", "-c", "user.name=demo", "-c", "user.email=demo@example.com", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "a failing test"]):
        subprocess.run([*git, *args], cwd=folder, check=True, capture_output=True)
    return folder


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it (Hermes style: the gateway's default tool parser)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def scripted_answers(agent: str) -> list[str]:
    """The model's answers, for each agent's shell tool."""
    if agent == "claude_code":
        calls = [tool_call("Bash", {"command": c, "description": "Run it"}) for c in (FIX, TEST)]
    elif agent == "codex":
        calls = [tool_call("exec_command", {"cmd": c}) for c in (FIX, TEST)]
    else:
        calls = [tool_call("run_shell", {"command": c}) for c in (FIX, TEST)]
    return ["I will fix the subtraction.\n" + calls[0], calls[1], "Fixed: add adds, and test_calc passes."]


# ---- what slime does -----------------------------------------------------------------------------------------------
def check_like_slime(samples: list[Sample], args: SimpleNamespace) -> None:
    """What slime's trainer asserts of one rollout's samples before it trains on them."""
    ids = {s.rollout_id for s in samples}
    assert None not in ids and len(ids) == 1, f"siblings must share one rollout_id: {ids}"
    for s in samples:
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        assert len(s.rollout_top_p_token_offsets) == s.response_length + 1
        assert int(s.rollout_top_p_token_offsets[-1]) == len(s.rollout_top_p_token_ids)
        assert tuple(s.rollout_routed_experts.shape) == (len(s.tokens) - 1, args.num_layers, args.moe_router_topk)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", required=True, help="the gateway's URL (started with --tokenizer)")
    parser.add_argument("--script-simulator", help="the simulator's URL: script the model's answers there")
    parser.add_argument("--agent", default="python", help="python (shell_agent here), claude_code or codex")
    parser.add_argument("--cli", help="the Claude Code / Codex executable (default: on PATH)")
    parser.add_argument("--samples", type=int, default=2, help="samples of the task (slime's --n-samples-per-prompt)")
    parser.add_argument("--num-layers", type=int, default=4, help="the MoE shape (the simulator's)")
    parser.add_argument("--topk", type=int, default=2)
    options = parser.parse_args()

    from slime_client.agent import close_runtimes, counters, generate

    workdir = Path(tempfile.mkdtemp(prefix="agent-rl-"))
    task = make_task(workdir / "task")
    agent = "__main__:shell_agent" if options.agent == "python" else options.agent
    os.environ |= {
        "SLIME_AGENT": agent,
        "SLIME_AGENT_REWARD": "__main__:task_reward",
        "SLIME_AGENT_WORKDIR": str(workdir / "rollouts"),
        "SLIME_AGENT_TIME_BUDGET_S": "120",
        "SLIME_AGENT_MODEL": "tiny",
    }
    if options.cli:
        os.environ["SLIME_AGENT_CLAUDE" if options.agent == "claude_code" else "SLIME_AGENT_CODEX"] = options.cli
    # slime's arguments (a slime launcher's): routing replay with the model's MoE shape, top-p replay, the lengths
    args = SimpleNamespace(
        gateway_url=options.gateway,
        use_rollout_routing_replay=True,
        num_layers=options.num_layers,
        moe_router_topk=options.topk,
        rollout_top_p=0.9,
        rollout_max_context_len=0,
        rollout_max_response_len=512,
        hf_checkpoint="/models/tiny",
    )
    sampling_params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 512}  # slime's, for each sample
    group = [
        Sample(
            index=i,
            group_index=0,
            prompt=PROMPT,
            session_id=f"agent-rl-{os.getpid()}-{i}",
            metadata={"task_dir": str(task)},
        )
        for i in range(options.samples)
    ]
    if options.script_simulator:
        for sample in group:
            answers = [{"text": text} for text in scripted_answers(options.agent)]
            body = {"rid_prefix": f"{sample.session_id}-", "answers": answers}
            httpx.post(f"{options.script_simulator}/sim/script", json=body).raise_for_status()

    print(f"[agent-rl] {len(group)} rollouts of the task with agent {options.agent}: generate(args, sample, params)")
    results = await asyncio.gather(*(generate(args, sample, sampling_params) for sample in group))
    failed = 0
    for rollout in results:
        for s in rollout:
            if s.remove_sample:
                failed += 1
                print(f"[agent-rl] rollout {s.index}: placeholder ({s.metadata.get('abort_reason')})")
                continue
            trained = sum(s.loss_mask)
            print(
                f"[agent-rl] rollout {s.index} -> sample: rollout_id={s.rollout_id} reward={s.reward} "
                f"status={s.status.value} tokens={len(s.tokens)} response_length={s.response_length} "
                f"trained={trained} rollout_routed_experts={tuple(s.rollout_routed_experts.shape)} "
                f"top_p_offsets={len(s.rollout_top_p_token_offsets)} use_tool={s.metadata['use_tool']} "
                f"agent_exit_code={s.metadata.get('agent_exit_code')}"
            )
        if not rollout[0].remove_sample:
            check_like_slime(rollout, args)
    print(f"[agent-rl] the samples pass slime's checks; counters: {counters()}")
    left = httpx.get(f"{options.gateway}/v1/sessions").json()["sessions"]
    mine = [s for s in left if s["session_id"].startswith(f"agent-rl-{os.getpid()}-")]
    print(f"[agent-rl] sessions left on the gateway by these rollouts: {len(mine)}")
    await close_runtimes()
    return 1 if failed or mine else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
