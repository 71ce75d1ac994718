"""The Codex CLI (``codex exec``), unattended, against a session.

- HOME: ``.codex/config.toml`` (``CODEX_HOME``) with a model provider whose ``base_url`` is the session's base URL as
  it is (slime's harness appends ``/v1``, which under a session is a 404) and ``wire_api = "responses"`` (Codex's
  own API; slime's harness uses ``"chat"``), the key from an environment variable, update checks and analytics off.
- Command: ``codex exec --json --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox`` (the rollout's
  sandbox is the sandbox), the user's extra arguments (``SLIME_AGENT_CODEX_ARGS``), then the prompt.
"""

from __future__ import annotations

import json

from slime_client.agent.contract import AgentRun
from slime_client.agent.harness.common import CliHarness

PROVIDER = "slime-gateway"
KEY_VARIABLE = "SLIME_GATEWAY_KEY"
NO_KEY = "slime-gateway-no-key"  # Codex refuses an unset key variable; the gateway without a key ignores it
DEFAULT_MODEL = "slime-actor"


def toml_string(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)


class CodexHarness(CliHarness):
    name = "codex"
    setting = "SLIME_AGENT_CODEX"

    def write_config(self, run: AgentRun) -> None:
        codex_home = run.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        lines = [
            f"model = {toml_string(run.model or DEFAULT_MODEL)}",
            f"model_provider = {toml_string(PROVIDER)}",
            "check_for_update_on_startup = false",
            "[analytics]",
            "enabled = false",
            f"[model_providers.{PROVIDER}]",
            f"name = {toml_string(PROVIDER)}",
            f"base_url = {toml_string(run.base_url)}",
            'wire_api = "responses"',
            f"env_key = {toml_string(KEY_VARIABLE)}",
            "",
        ]
        (codex_home / "config.toml").write_text("\n".join(lines))

    def environment(self, run: AgentRun) -> dict[str, str]:
        return {"CODEX_HOME": str(run.home / ".codex"), KEY_VARIABLE: run.api_key or NO_KEY}

    def command(self, run: AgentRun) -> list[str]:
        flags = ["exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        return [str(self.executable), *flags, *self.extra_args, run.prompt]
