"""slime_client: the async SDK for the slime-gateway v1 API (sessions in, torch tensors out).

Agent / trainer code::

    from slime_client import GatewayClient

    async with GatewayClient("http://127.0.0.1:8000") as gw:
        session = await gw.create_session(prompt_ids=ids, num_layers=48, moe_router_topk=8)
        turn = await session.generate(sampling_params={"max_new_tokens": 256, "temperature": 1.0})
        await session.append(tool_output_ids)          # tool/environment tokens: loss mask 0
        turn = await session.generate(sampling_params={"max_new_tokens": 256})
        sample = await session.fetch()                 # RolloutSample: torch tensors + metadata
        sample.to_slime(slime_sample)                  # onto a slime Sample's fields

Agents (Claude Code, Codex, a Python agent) as slime's ``list[Sample]``, with routing and top-p replay:
``--custom-generate-function-path slime_client.agent.generate`` and ``SLIME_AGENT`` (``slime_client.agent``,
docs/agents/slime-training.md).

slime users add ONE flag to use the gateway for rollouts (no code changes)::

    --custom-generate-function-path slime_client.slime.generate

and say where the gateway is with the environment variable ``SLIME_GATEWAY_URL=http://HOST:PORT`` (and its key,
if it has one, with ``SLIME_GATEWAY_API_KEY``; see ``slime_client.slime`` for the exact semantics). Errors:
``slime_client.errors`` (one tree, rooted at ``GatewayError``); retries: ``slime_client._retry`` (only where
sending again cannot double a turn).
"""

from __future__ import annotations

from slime_client.client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, GatewayClient, Session
from slime_client.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GatewayConnectionError,
    GatewayError,
    GatewayResponseError,
    GatewayStatusError,
    GatewayTimeout,
    GatewayTimeoutError,
    NotFoundError,
    ServiceUnavailableError,
    UpstreamError,
)
from slime_client.sample import RolloutSample, TurnTensors
from slime_client.staleness import StalenessBound, within_bound
from slime_client.streaming import TurnDelta, TurnStream
from slime_client.types import (
    ArraySpec,
    DeleteAfterTurn,
    MoEShape,
    SessionState,
    SessionSummary,
    SessionSync,
    TurnResult,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "ArraySpec",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "DeleteAfterTurn",
    "GatewayClient",
    "GatewayConnectionError",
    "GatewayError",
    "GatewayResponseError",
    "GatewayStatusError",
    "GatewayTimeout",
    "GatewayTimeoutError",
    "MoEShape",
    "NotFoundError",
    "RolloutSample",
    "ServiceUnavailableError",
    "Session",
    "SessionState",
    "SessionSummary",
    "SessionSync",
    "StalenessBound",
    "TurnDelta",
    "TurnResult",
    "TurnStream",
    "TurnTensors",
    "UpstreamError",
    "within_bound",
]
