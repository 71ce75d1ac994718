"""Agent RL with slime through the gateway: a harness run (Claude Code, Codex, or a Python agent) becomes slime's
``list[Sample]``, with routing and top-p replay.

One flag and two settings::

    SLIME_GATEWAY_URL=http://127.0.0.1:8000 SLIME_AGENT=claude_code python train.py ... \\
        --custom-generate-function-path slime_client.agent.generate

The modules, in the order data flows: ``adapter`` (``GatewayAdapter``: slime's ``open_session`` / ``base_url`` /
``finish_session`` / ``drop_session`` over gateway chat sessions), ``samples`` (a fetched branch -> a ``Sample``, and
slime's placeholders), ``rollout`` (``generate``: open, run, grade, finish, always drop), ``contract`` (``AgentRun``:
what an agent gets; what it returns), ``harness`` (one module per CLI) over ``sandbox`` (a local process group, or a
Docker container), ``workspace``, ``settings`` (``SLIME_AGENT_*``). See docs/agents/slime-training.md.
"""

from __future__ import annotations

from slime_client.agent.adapter import GatewayAdapter
from slime_client.agent.contract import AgentOutcome, AgentRun, prompt_text
from slime_client.agent.rollout import close_runtimes, counters, generate
from slime_client.agent.samples import ReplayShape, branch_to_sample, branches_to_samples, placeholder_sample
from slime_client.agent.sandbox import DockerSandbox, LocalSandbox, Sandbox
from slime_client.agent.settings import AgentSettings

__all__ = [
    "AgentOutcome",
    "AgentRun",
    "AgentSettings",
    "DockerSandbox",
    "GatewayAdapter",
    "LocalSandbox",
    "ReplayShape",
    "Sandbox",
    "branch_to_sample",
    "branches_to_samples",
    "close_runtimes",
    "counters",
    "generate",
    "placeholder_sample",
    "prompt_text",
]
