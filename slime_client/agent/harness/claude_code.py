"""Claude Code (``claude -p``), unattended, against a session.

- HOME: ``.claude.json`` with onboarding done and bypass-permissions mode accepted (as slime's harness writes it),
  ``.claude/settings.json`` with bypass permissions as the default mode.
- Environment: ``ANTHROPIC_BASE_URL`` the session's base URL, ``ANTHROPIC_API_KEY`` the gateway's key (the session is
  in the URL, so a gateway with a key gets its key: slime's harness sends the session id as the key instead),
  ``ANTHROPIC_MODEL`` / ``ANTHROPIC_SMALL_FAST_MODEL`` the served model's name when one is set, telemetry, update
  checks and nonessential traffic off, the attribution header off (it would change the system prompt from request
  to request, and every change is a new branch), ``IS_SANDBOX=1`` where it runs as root (Claude Code refuses
  ``--permission-mode bypassPermissions`` as root without it).
- Command: ``claude -p PROMPT --permission-mode bypassPermissions --output-format stream-json --verbose`` and the
  user's extra arguments (``SLIME_AGENT_CLAUDE_ARGS``: ``--settings``, ``--agents``, ``--disallowedTools`` ...).
"""

from __future__ import annotations

import json

from slime_client.agent.contract import AgentRun
from slime_client.agent.harness.common import CliHarness

# A key Claude Code accepts as configured when the gateway has none (the gateway then ignores it).
NO_KEY = "slime-gateway-no-key"


class ClaudeCodeHarness(CliHarness):
    name = "claude_code"
    setting = "SLIME_AGENT_CLAUDE"

    def write_config(self, run: AgentRun) -> None:
        (run.home / ".claude").mkdir(parents=True, exist_ok=True)
        state = {"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}
        (run.home / ".claude.json").write_text(json.dumps(state))
        settings = {"permissions": {"defaultMode": "bypassPermissions"}}
        (run.home / ".claude" / "settings.json").write_text(json.dumps(settings))

    def environment(self, run: AgentRun) -> dict[str, str]:
        env = {
            "ANTHROPIC_BASE_URL": run.base_url,
            "ANTHROPIC_API_KEY": run.api_key or NO_KEY,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        }
        if run.model:
            env |= {"ANTHROPIC_MODEL": run.model, "ANTHROPIC_SMALL_FAST_MODEL": run.model}
        if self.sandbox.runs_as_root:
            env["IS_SANDBOX"] = "1"
        return env

    def command(self, run: AgentRun) -> list[str]:
        flags = ["--permission-mode", "bypassPermissions", "--output-format", "stream-json", "--verbose"]
        return [str(self.executable), "-p", run.prompt, *flags, *self.extra_args]
