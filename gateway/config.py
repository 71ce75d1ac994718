"""Settings: from ``GATEWAY_*`` environment variables, overridden by command-line flags."""

from __future__ import annotations

from pydantic import AnyHttpUrl, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="forbid")

    upstream_url: AnyHttpUrl = Field(description="SGLang router (or server) base URL, e.g. http://127.0.0.1:30000")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535)
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$")
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
    decode_threads: int = Field(4, ge=1)
    max_sessions: int = Field(1_000_000, ge=1, description="refuse new sessions beyond this many (429)")
    session_idle_ttl_s: float = Field(
        3600.0, ge=0, description="drop sessions untouched for this long (abandoned rollouts); 0 keeps them forever"
    )
    incremental_routing: bool = Field(
        True,
        description="ask SGLang only for the routing rows the session lacks (routed_experts_start_len); turn off "
        "for an upstream that mishandles it, at the cost of re-sending the whole routing history every turn",
    )
    shutdown_grace_s: int = Field(
        5,
        ge=1,
        description="on SIGTERM, in-flight requests get this long to finish; then running turns are aborted "
        "(tokens so far folded in). Keep it under the orchestrator's kill timeout (docker stop: 10 s)",
    )
    keep_alive_s: float = Field(75.0, gt=0, description="idle client connections are kept open this long")

    @field_validator("upstream_url")
    @classmethod
    def _no_path_suffix(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        if url.query or url.fragment:
            raise ValueError("upstream_url must be a base URL without query or fragment")
        return url

    @property
    def upstream_base(self) -> str:
        return str(self.upstream_url).rstrip("/")
