"""Settings: from ``GATEWAY_*`` environment variables, overridden by command-line flags."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import AnyHttpUrl, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.chat import reasoning, tool_parsers

# The accepted parser names come from the registries: adding a format adds its name here.
ToolParserName = Literal[tool_parsers.NAMES]  # type: ignore[valid-type]
ReasoningParserName = Literal[reasoning.NAMES]  # type: ignore[valid-type]


class Settings(BaseSettings):
    # hide_input_in_errors: a ValidationError's text would otherwise quote the value of a bad key setting.
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="forbid", hide_input_in_errors=True)

    upstream_url: AnyHttpUrl = Field(description="SGLang router (or server) base URL, e.g. http://127.0.0.1:30000")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    log_level: str = Field(
        "info",
        pattern="^(critical|error|warning|info|debug)$",
        description="critical, error, warning, info or debug (debug adds the access log)",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="deadline for one whole upstream call (connect, send, the answer to its last byte; a streamed "
        "turn included): past it the call is cut and answered 504 upstream_timeout",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="opening one upstream connection (503 past it)")
    pool_timeout_s: float = Field(
        30.0,
        gt=0,
        description="waiting for a free upstream connection when max_connections are busy: 503 upstream_unavailable "
        "past it (nothing was sent, so the SDK retries)",
    )
    max_connections: int = Field(512, ge=1, description="upstream connections open at once, at most")
    upstream_keepalive_s: float = Field(
        4.0,
        gt=0,
        description="idle upstream connections are reused for this long; keep it below the upstream's own keep-alive "
        "(uvicorn's, SGLang's: 5 s)",
    )
    decode_offload_bytes: int = Field(
        64 * 1024, ge=0, description="answers larger than this are decoded in a worker thread, off the event loop"
    )
    decode_threads: int = Field(4, ge=1, description="worker threads that decode large answers and parse big bodies")
    max_sessions: int = Field(1_000_000, ge=1, description="refuse new sessions beyond this many (429)")
    session_idle_ttl_s: float = Field(
        3600.0, ge=0, description="drop sessions untouched for this long (abandoned rollouts); 0 keeps them forever"
    )
    incremental_routing: bool = Field(
        True,
        description="ask SGLang only for the routing rows the session lacks (routed_experts_start_len); turn off "
        "for an upstream that mishandles it, at the cost of re-sending the whole routing history every turn",
    )
    resume_max: int = Field(
        8,
        ge=0,
        description="how many times one model turn is resubmitted when the engine aborts it mid-answer (a weight "
        "update's pause): chat turns always, token-level turns that ask for it (resume). Past it, or past "
        "request_timeout_s for the whole turn, a chat client gets 503 turn_interrupted and the session keeps what "
        "was generated; 0: never resume",
    )
    shutdown_grace_s: int = Field(
        5,
        ge=1,
        description="on SIGTERM, in-flight requests get this long to finish; then running turns are aborted "
        "(tokens so far folded in). Keep it under the orchestrator's kill timeout (docker stop: 10 s)",
    )
    keep_alive_s: float = Field(75.0, gt=0, description="idle client connections are kept open this long")
    drain_s: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM, first drain for this long: GET /health answers 503 (status draining) so that a load "
        "balancer's health checks take this replica out, while every request it still gets is served; then the "
        "shutdown of shutdown_grace_s. Set it above the balancer's detection time (HAProxy: inter x fall)",
    )
    max_request_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="request bodies larger than this are refused (413 request_too_large) while they arrive, "
        "never buffered whole; a larger Content-Length is refused before reading",
    )
    max_session_tokens: int = Field(
        1024 * 1024,
        ge=1,
        description="tokens one session may hold (prompt + response): a create, append or model turn that would "
        "pass it is refused (413 session_too_long), the session unchanged",
    )
    max_stored_bytes: int | None = Field(
        None,
        ge=0,
        description="bytes of session arrays all sessions may hold; at it, new sessions and growth are refused "
        "(507 store_full) while reads and deletes work. Unset: half of the memory this process may use "
        "(physical memory, or the cgroup limit when lower); 0: no limit",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a client connection whose request head is not complete this long is closed"
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a request whose body is not complete this long after its head is answered 408 body_timeout "
        "and its connection closed",
    )
    max_client_connections: int = Field(
        10_000,
        ge=1,
        description="client connections held at once; past it a new connection closes the longest-idle one (or "
        "is answered 503 too_many_connections when none is idle)",
    )
    api_key: SecretStr | None = Field(
        None,
        description="the key callers must send as 'Authorization: Bearer KEY' on every route but GET /health; "
        "a comma-separated list accepts each of them (rotation)",
    )
    protect_metrics: bool = Field(False, description="GET /metrics needs the key too (it is open by default)")
    allow_unauthenticated: bool = Field(
        False, description="start without api_key on a non-loopback host (anyone who can connect controls sessions)"
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="SGLang's / the router's own --api-key, sent on every upstream request"
    )
    store: str = Field(
        "memory",
        description="where sessions live: 'memory' (this process, the default) or a Redis URL, "
        "redis://host:port/db (sessions survive restarts and are shared by gateway replicas), or "
        "redis+cluster://host:port, a seed node of a Redis Cluster (rediss:// and rediss+cluster:// for TLS)",
        pattern=r"^(memory|rediss?(\+cluster)?://.+)$",
    )
    redis_lease_s: float = Field(
        30.0,
        gt=0,
        description="with the Redis store: how long a turn's hold on a session outlives a replica that died "
        "holding it (renewed while the turn runs)",
    )
    redis_heartbeat_s: float = Field(
        1.0,
        ge=0,
        description="with the Redis store: each replica renews a heartbeat key this often (it lasts 5 beats); a hold "
        "left by a replica whose heartbeat ran out (killed, its host gone) is taken over at once instead of after "
        "redis_lease_s. 0: no heartbeat (a dead replica's holds run out after redis_lease_s)",
    )
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        description="with the Redis store: a turn (or create) is acknowledged only once this many replicas of its "
        "Redis node have its write (WAIT), so that a failover loses no acknowledged turn; a write they do not confirm "
        "within redis_wait_timeout_ms is answered 503 store_unavailable (reason unconfirmed). 0: acknowledged once "
        "the node has it (a failover of a node without AOF may lose its last writes)",
    )
    redis_retry_s: float = Field(
        0.0,
        ge=0,
        description="with the Redis store: how long a command is sent again while Redis fails over (a node down or "
        "frozen, a Redis Cluster promoting a replica), before the request is answered 503 store_unavailable; every "
        "command of the store is safe to send twice. Set it to your failover time (cluster-node-timeout and the "
        "election: seconds). 0: no retry beyond one on a dead pooled connection",
    )
    redis_wait_timeout_ms: int = Field(
        1000, ge=1, description="with redis_wait_replicas: how long a write waits for its replicas to confirm it"
    )
    redis_prefix: str = Field(
        "slime-gateway",
        min_length=1,
        pattern=r"^[^{}]+$",
        description="the Redis store's key prefix (no braces: a session's keys carry its own Redis Cluster hash tag)",
    )
    tokenizer: str | None = Field(
        None,
        description="the served model's Hugging Face tokenizer directory (with its chat template): enables the "
        "OpenAI and Anthropic chat routes; read locally, never downloaded",
    )
    chat_tool_parser: ToolParserName = Field(
        "hermes",
        description="how tool calls are read from completions, by SGLang's --tool-call-parser name (the value slime "
        "passes as --sglang-tool-call-parser): hermes (<tool_call>{json}</tool_call>; qwen25 and qwen too), "
        "qwen3_coder (<tool_call><function=NAME><parameter=KEY>...), glm45 and glm47 (<tool_call>NAME<arg_key>...), "
        "kimi_k2 (<|tool_calls_section_begin|>...), deepseekv3, deepseekv31 (<｜tool▁calls▁begin｜>...), deepseekv32 "
        "(<｜DSML｜function_calls>...), minimax-m2 (<minimax:tool_call><invoke name=...>), gpt-oss (harmony's "
        "commentary channel; needs the gpt-oss reasoning parser)",
    )
    chat_reasoning_parser: ReasoningParserName = Field(
        "none",
        description="how a reasoning model's reasoning is read from completions, by SGLang's --reasoning-parser name "
        "(the value slime passes as --sglang-reasoning-parser): qwen3, qwen3-thinking, deepseek-r1 (deepseek_r1 "
        "too), deepseek-v3, glm45, kimi_k2, minimax (<think>...</think>), minimax-append-think (the <think> kept in "
        "the content), gpt-oss (harmony's analysis channel; needs the gpt-oss tool parser); returned as "
        "reasoning_content (OpenAI chat), thinking blocks (Anthropic), reasoning items (Responses); none: the "
        "completion is all content",
    )
    chat_rewrite_policy: Literal["append", "fork"] = Field(
        "append",
        description="a chat template that renders earlier turns differently once new messages follow (Qwen3-style "
        "templates drop earlier reasoning): append (the session's tokens, then the new messages as the template "
        "renders them after the history; one trajectory) or fork (the conversation re-rendered as the template "
        "renders it now, on a new branch)",
    )
    chat_max_tools_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="the tools' schemas a chat request may carry (their JSON, bytes): past it, 413 request_too_large "
        "before anything is rendered (the template renders them into the prompt)",
    )
    chat_default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="the answer's length when a chat request names none (OpenAI's max_tokens, the Responses API's "
        "max_output_tokens); unset: the context left (8192 when the context length is unknown)",
    )
    chat_drift_policy: Literal["fork", "reject"] = Field(
        "fork",
        description="a chat history that disagrees with its session's record: fork a new branch from the common "
        "prefix (the old trajectory kept as a finished branch), or reject it with 409 history_mismatch",
    )
    chat_context_tokens: int | None = Field(
        None,
        ge=1,
        description="the model's context length, for context_length_exceeded; default: the tokenizer's "
        "model_max_length when it states one",
    )

    @field_validator("upstream_url")
    @classmethod
    def _no_path_suffix(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        if url.query or url.fragment:
            raise ValueError("upstream_url must be a base URL without query or fragment")
        return url

    @field_validator("api_key")
    @classmethod
    def _key_list(cls, value: SecretStr | None) -> SecretStr | None:
        # Blank items are dropped (a trailing comma); all blank means no key, which the exposure check then judges.
        keys = [key for key in (item.strip() for item in _secret(value).split(",")) if key]
        return SecretStr(",".join(_checked_key(key) for key in keys)) if keys else None

    @field_validator("upstream_api_key")
    @classmethod
    def _one_key(cls, value: SecretStr | None) -> SecretStr | None:
        key = _secret(value).strip()
        return SecretStr(_checked_key(key)) if key else None

    @model_validator(mode="after")
    def _parsers_go_together(self) -> Settings:
        mismatch = tool_parsers.pairing_error(
            tool_parsers.tool_format(self.chat_tool_parser), reasoning.reasoning_format(self.chat_reasoning_parser)
        )
        if mismatch is not None:
            raise ValueError(mismatch)
        return self

    @property
    def upstream_base(self) -> str:
        return str(self.upstream_url).rstrip("/")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys; empty when authentication is off."""
        return tuple(_secret(self.api_key).split(",")) if self.api_key else ()

    @property
    def upstream_key(self) -> str | None:
        return self.upstream_api_key.get_secret_value() if self.upstream_api_key else None


# What a key may hold: it travels in a header (no spaces, no line breaks) and a list is split on commas.
_KEY_CHARS = frozenset(map(chr, range(0x21, 0x7F))) - {","}


def _secret(value: SecretStr | None) -> str:
    return value.get_secret_value() if value is not None else ""


def _checked_key(key: str) -> str:
    if not _KEY_CHARS.issuperset(key):
        # Never the value in the message (the error names the setting).
        raise ValueError("a key is printable ASCII without spaces or commas (a comma separates keys)")
    return key


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost).
    Any other name or address, 0.0.0.0 and :: included, counts as exposed."""
    name = host.strip().removeprefix("[").removesuffix("]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_problem(settings: Settings) -> str | None:
    """Why these settings must not start (an open gateway on a reachable address), or None."""
    if settings.api_key is not None or settings.allow_unauthenticated or is_loopback(settings.host):
        return None
    return (
        f"refusing to listen on {settings.host!r} without an API key: anyone who can reach it could read, change "
        "and delete every session and call /flush_cache or /abort_request upstream. Set GATEWAY_API_KEY (or "
        "--api-key), listen on 127.0.0.1, or set GATEWAY_ALLOW_UNAUTHENTICATED=true to run open on purpose."
    )


def stored_bytes_limit(settings: Settings) -> int | None:
    """``max_stored_bytes`` resolved: its value, half of the memory this process may use when unset, or None (no
    limit) for 0."""
    if settings.max_stored_bytes is not None:
        return settings.max_stored_bytes or None
    return usable_memory_bytes() // 2


def usable_memory_bytes() -> int:
    """Physical memory, or the cgroup (v2, then v1) memory limit when lower: a container sees the host's memory in
    sysconf but is killed at its own limit."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            return min(physical, int(text))
    return physical
