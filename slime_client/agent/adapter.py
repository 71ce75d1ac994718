"""``GatewayAdapter``: slime's agent adapter API (``slime.agent.adapters``), over gateway chat sessions.

Sessions in, samples out, as slime's ``AnthropicAdapter`` / ``OpenAIAdapter`` do it, so that porting slime's
``examples/coding_agent_rl/generate.py`` is mechanical (``open_session`` is awaited here: the one word that
changes)::

    adapter = GatewayAdapter.from_args(args)        # --use-rollout-routing-replay, --rollout-top-p, ...
    await adapter.open_session(sid, sampling_defaults=sampling_params)
    ... run the agent against adapter.base_url(sid) ...
    samples = await adapter.finish_session(sid, base_sample=sample, reward=reward)

The gateway does the capture (the chat template, the model's tokens as generated, log-probs, routing and top-p
replay, the tree of branches); nothing here parses a model's output or renders a template. ``finish_session``
closes the session (every later request refused; running turns waited for, then aborted), fetches every branch in
one round trip, turns each branch with a trained token into a copy of ``base_sample``
(``slime_client.agent.samples``) and deletes the session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from slime_client.agent.samples import ReplayShape, Reward, branches_to_samples
from slime_client.client import GatewayClient, Session
from slime_client.errors import ConflictError, NotFoundError
from slime_client.sample import RolloutSample
from slime_client.slime import gateway_api_key, gateway_url, routing_shape
from slime_client.staleness import StalenessBound, keep_within

log = logging.getLogger("slime_client.agent")

TOP_P_FLAG = "return_top_p_token_ids"
DEFAULT_WAIT_TIMEOUT_S = 5.0
# The keys of slime's sampling params a chat session keeps as its defaults. The rest shape SGLang's output text
# (skip_special_tokens, no_stop_trim, spaces_between_special_tokens: slime decodes the ids itself), and the chat side
# reads that text as SGLang writes it by default.
CHAT_SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "sampling_seed",
        "custom_params",
    }
)


class GatewayAdapter:
    """slime's adapter API over gateway chat sessions (see the module docstring).

    ``num_layers`` / ``moe_router_topk``: routing replay (R3), as ``--use-rollout-routing-replay`` asks;
    ``top_p_replay``: top-p replay, as ``--rollout-top-p`` below 1 asks (slime's ``custom_params``).
    ``max_context_tokens``: the default context budget of each session (``--rollout-max-context-len``; 0: none),
    ``max_response_tokens``: each turn's length cap when the sampling defaults name none
    (``--rollout-max-response-len``), ``max_turns_per_sid``: slime's turn cap (past it a harness's request is a 429).
    ``split_reward``: ``finish_session`` divides the reward evenly over the samples (slime gives each all of it).
    ``client``: a ``GatewayClient`` to share (else one of its own, created on first use: it belongs to the event loop
    that first uses it).
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        api_key: str | None = None,
        num_layers: int | None = None,
        moe_router_topk: int | None = None,
        top_p_replay: bool = False,
        max_context_tokens: int = 0,
        max_response_tokens: int | None = None,
        max_turns_per_sid: int | None = None,
        split_reward: bool = False,
        staleness: StalenessBound | None = None,
        client: GatewayClient | None = None,
    ) -> None:
        if (num_layers is None) != (moe_router_topk is None):
            raise ValueError("give both num_layers and moe_router_topk (routing replay's shape) or neither")
        self.gateway_url = gateway_url.rstrip("/")
        self.api_key = api_key or ""
        self.replay = ReplayShape(num_layers, moe_router_topk, top_p_replay)
        self.max_context_tokens = int(max_context_tokens or 0)
        self.max_response_tokens = max_response_tokens
        self.max_turns_per_sid = max_turns_per_sid
        self.split_reward = split_reward
        self.staleness = staleness  # the default bound of finish_session (``slime_client.staleness``)
        self._client = client
        self._budgets: dict[str, int] = {}  # session id -> its context budget (samples are cut to it)

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> GatewayAdapter:
        """From slime's arguments: the gateway (``args.gateway_url`` / ``SLIME_GATEWAY_URL``, its key
        ``args.gateway_api_key`` / ``SLIME_GATEWAY_API_KEY``), ``--use-rollout-routing-replay`` with ``--num-layers``
        and ``--moe-router-topk``, ``--rollout-top-p``, ``--rollout-max-context-len``, ``--rollout-max-response-len``
        and ``args.max_turns_per_sid`` when the launcher defines it."""
        moe = routing_shape(args) if getattr(args, "use_rollout_routing_replay", False) else None
        fields: dict[str, Any] = {
            "api_key": gateway_api_key(args),
            "num_layers": None if moe is None else moe.num_layers,
            "moe_router_topk": None if moe is None else moe.topk,
            "top_p_replay": float(getattr(args, "rollout_top_p", 1.0) or 1.0) != 1.0,
            "max_context_tokens": int(getattr(args, "rollout_max_context_len", 0) or 0),
            "max_response_tokens": getattr(args, "rollout_max_response_len", None),
            "max_turns_per_sid": getattr(args, "max_turns_per_sid", None),
        }
        return cls(gateway_url(args), **(fields | overrides))

    @property
    def client(self) -> GatewayClient:
        if self._client is None or self._client.is_closed:
            self._client = GatewayClient(self.gateway_url, api_key=self.api_key)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ---- sessions -----------------------------------------------------------------------------------------------
    async def open_session(
        self, session_id: str, *, sampling_defaults: Mapping[str, Any] | None = None, max_context_tokens: int = 0
    ) -> None:
        """Create the chat session ``session_id``, with routing and top-p replay as the adapter was made for, the
        sampling defaults every turn gets (``CHAT_SAMPLING_KEYS`` of slime's params; their ``max_new_tokens`` caps
        every turn), the context budget (``max_context_tokens``, else the adapter's) and the turn cap. Raises
        ``ValueError`` for an id that exists, as slime does (ids must be unique per agent run)."""
        budget = int(max_context_tokens or 0) or self.max_context_tokens
        try:
            await self.client.create_session(
                session_id=session_id,
                num_layers=self.replay.num_layers,
                moe_router_topk=self.replay.topk,
                sampling_defaults=self.session_defaults(sampling_defaults),
                max_context_tokens=budget or None,
                max_turns=self.max_turns_per_sid,
            )
        except ConflictError as exc:
            if exc.error_type == "session_exists":
                raise ValueError(
                    f"session_id {session_id!r} already exists; sids must be unique per agent run"
                ) from exc
            raise
        if budget:
            self._budgets[session_id] = budget

    def session_defaults(self, sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
        """The sampling defaults a session is created with, from slime's sampling params."""
        defaults = {k: v for k, v in (sampling_params or {}).items() if k in CHAT_SAMPLING_KEYS and v is not None}
        if defaults.get("max_new_tokens") is None and self.max_response_tokens:
            defaults["max_new_tokens"] = int(self.max_response_tokens)
        if self.replay.top_p:
            defaults["custom_params"] = {**(defaults.get("custom_params") or {}), TOP_P_FLAG: True}
        return defaults

    def base_url(self, session_id: str) -> str:
        """What OpenAI and Anthropic clients and agent harnesses take as their base URL for this session."""
        return f"{self.gateway_url}/v1/sessions/{quote(session_id, safe='')}"

    async def finish_session(
        self,
        session_id: str,
        *,
        base_sample: Any,
        reward: Reward | None = 0.0,
        extra_metadata: Mapping[str, Any] | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
        split_reward: bool | None = None,
        staleness: StalenessBound | None = None,
    ) -> list[Any]:
        """The session's trainable branches as copies of ``base_sample`` (``slime_client.agent.samples``), each with
        the whole ``reward`` (``split_reward``: an even share); the session is closed, drained (running turns get
        ``wait_timeout`` seconds, then are aborted) and deleted. Consuming and idempotent: a second call returns
        ``[]``. ``staleness`` (default: the adapter's): a branch with trained tokens from weights too many versions
        old is dropped, or those tokens are not trained (``slime_client.staleness``)."""
        branches = await self.take_branches(session_id, wait_timeout=wait_timeout)
        return self.to_samples(
            session_id,
            self.keep_fresh(branches or [], staleness),
            base_sample=base_sample,
            reward=reward,
            extra_metadata=extra_metadata,
            split_reward=self.split_reward if split_reward is None else split_reward,
        )

    async def drop_session(self, session_id: str, *, wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S) -> None:
        """The same close and drain, then delete; nothing returned. Idempotent."""
        self._budgets.pop(session_id, None)
        session = Session(self.client, session_id)
        try:
            await session.close(wait_timeout)
        except NotFoundError:
            return
        await self._delete(session, wait_timeout)

    # ---- the steps of finish_session ------------------------------------------------------------------------------
    async def take_branches(
        self, session_id: str, *, wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S
    ) -> list[RolloutSample] | None:
        """Close, drain, fetch every branch (one round trip), delete: the session's branches as fetched, or None when
        the gateway holds no such session (finished already, or lost with a gateway restart)."""
        session = Session(self.client, session_id)
        try:
            closed = await session.close(wait_timeout)
            if not closed.get("drained", True):
                log.warning(
                    "session %s: a turn still held it after the close (%s); its samples hold what was folded",
                    session_id,
                    closed.get("instance_id") or "this gateway",
                )
            branches = await self.client.fetch_samples([session_id])
        except NotFoundError:
            return None
        await self._delete(session, wait_timeout)
        return branches

    def keep_fresh(self, branches: list[RolloutSample], staleness: StalenessBound | None = None) -> list[RolloutSample]:
        """The branches the staleness bound keeps (``staleness``, else the adapter's; none: all of them), the
        too-stale tokens of a "mask" bound no longer trained."""
        bound = staleness if staleness is not None else self.staleness
        kept = keep_within(branches, bound)
        if len(kept) < len(branches):
            dropped = len(branches) - len(kept)
            log.info("%d of %d branches dropped: trained tokens past %s", dropped, len(branches), bound)
        return kept

    def to_samples(
        self,
        session_id: str,
        branches: list[RolloutSample],
        *,
        base_sample: Any,
        reward: Reward | None,
        extra_metadata: Mapping[str, Any] | None = None,
        split_reward: bool = False,
    ) -> list[Any]:
        return branches_to_samples(
            branches,
            base_sample,
            reward=reward,
            extra_metadata=extra_metadata,
            max_tokens=self._budgets.pop(session_id, 0),
            split_reward=split_reward,
        )

    async def _delete(self, session: Session, wait_timeout: float) -> None:
        """Delete, closing (and draining) once more if a turn still holds it; a session that stays busy is left to
        the gateway's idle expiry, with a warning."""
        for attempt in range(2):
            try:
                await session.delete()
                return
            except NotFoundError:
                return
            except ConflictError as exc:
                if exc.error_type != "session_busy" or attempt:
                    log.warning("session %s could not be deleted: %s", session.session_id, exc)
                    return
                await session.close(wait_timeout)
