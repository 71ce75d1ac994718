"""``python -m gateway --upstream-url URL [--host H] [--port P]`` (or the same settings as GATEWAY_* env vars)."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pydantic import ValidationError
from uvicorn.main import STARTUP_FAILURE

from gateway.app import create_app
from gateway.config import Settings, exposure_problem, is_loopback
from gateway.connections import ConnectionGuard, fit_open_files_limit
from gateway.drain import Drain, DrainingServer
from slime_wire.memory import keep_freed_memory


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags (a few settings; the rest are GATEWAY_* env vars). The settings reference in the docs
    lists each setting's flag from here (scripts/docs_hooks.py)."""
    parser = argparse.ArgumentParser(prog="python -m gateway", description="slime-gateway: RL rollout gateway")
    parser.add_argument("--upstream-url", help="SGLang router/server URL (env GATEWAY_UPSTREAM_URL)")
    parser.add_argument("--host", help="listen address (env GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (env GATEWAY_PORT, default 8000)")
    parser.add_argument("--log-level", help="critical|error|warning|info|debug (env GATEWAY_LOG_LEVEL)")
    parser.add_argument(
        "--request-timeout-s", type=float, help="deadline of one upstream call (env GATEWAY_REQUEST_TIMEOUT_S)"
    )
    parser.add_argument(
        "--api-key",
        help="key(s) callers must send as 'Authorization: Bearer KEY', comma-separated (env GATEWAY_API_KEY, "
        "preferred: arguments are visible to every user of the machine in `ps`)",
    )
    parser.add_argument(
        "--tokenizer",
        help="the served model's tokenizer directory, for the OpenAI/Anthropic chat routes (env GATEWAY_TOKENIZER)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> dict[str, object]:
    args = build_parser().parse_args(argv)
    return {key: value for key, value in vars(args).items() if value is not None}


def load_settings(overrides: dict[str, object]) -> Settings:
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()]
        sys.exit("gateway: invalid settings (flags or GATEWAY_* env vars):\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(parse_args(argv))
    if problem := exposure_problem(settings):
        sys.exit(f"gateway: {problem}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.api_key is None and not is_loopback(settings.host):
        logging.getLogger("gateway").warning(
            "listening on %s WITHOUT authentication (GATEWAY_ALLOW_UNAUTHENTICATED)", settings.host
        )
    keep_freed_memory()  # answers of tens of MB are received and decoded in mapped pages (see slime_wire.memory)
    connections = ConnectionGuard(
        max_connections=fit_open_files_limit(settings.max_client_connections, settings.max_connections),
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )
    drain = Drain()
    config = uvicorn.Config(
        create_app(settings, connections, drain),
        http=connections.protocol_class(),  # uvicorn's httptools protocol + the head deadline and the cap
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        timeout_keep_alive=int(settings.keep_alive_s),
    )
    server = DrainingServer(config, drain, settings.drain_s)  # uvicorn.run's server, draining first on SIGTERM
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
