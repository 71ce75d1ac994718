"""Coding-agent CLIs as agents: one module per CLI (its configuration, environment, command line) over one sandbox
interface (``slime_client.agent.sandbox``)."""

from __future__ import annotations

from slime_client.agent.harness.claude_code import ClaudeCodeHarness
from slime_client.agent.harness.codex import CodexHarness
from slime_client.agent.harness.common import CliHarness, HarnessNotFound, find_cli, install_root

HARNESSES: dict[str, type[CliHarness]] = {"claude_code": ClaudeCodeHarness, "codex": CodexHarness}

__all__ = [
    "HARNESSES",
    "ClaudeCodeHarness",
    "CliHarness",
    "CodexHarness",
    "HarnessNotFound",
    "find_cli",
    "install_root",
]
