"""Drop-in replacement for slime's default rollout generate, talking to the gateway instead of SGLang.

Use it with one slime flag, and tell it where the gateway is::

    SLIME_GATEWAY_URL=http://127.0.0.1:8000 python train.py ... \\
        --custom-generate-function-path slime_client.slime.generate

(``args.gateway_url``, if your launcher defines such an argument, wins over the environment variable.) A gateway
that requires an API key gets it from ``SLIME_GATEWAY_API_KEY`` (or ``args.gateway_api_key``), sent on every call.
It leaves the ``Sample`` as ``slime.rollout.sglang_rollout.generate`` would: ``tokens``, ``response``,
``response_length``, ``loss_mask``, ``rollout_log_probs``, top-p spans, ``rollout_routed_experts`` (with
``--use-rollout-routing-replay``, shape from ``--num-layers`` / ``--moe-router-topk``), ``status``,
``weight_versions`` and ``prefix_cache_info`` -- but SGLang's multi-megabyte JSON is decoded by the gateway,
and routing replay is incremental across turns.

How a sample maps to a gateway session (key: ``sample.session_id``, a fresh uuid if slime did not set one), and
what it costs: one round trip per model turn, whatever the length of the history.
- The session mirrors ``sample.tokens``. First call: one request creates the session from ``sample.tokens`` (or
  from ``sample.prompt``, tokenized like slime, when ``tokens`` is empty) and runs the turn; a single-turn sample
  that finishes is deleted by that same request.
- Every turn answers with its own tensors (new tokens, log-probs, top-p spans, the routing rows it brought), folded
  onto the sample slime-style: the history is never downloaded again, and fields slime or the caller changed in
  between (e.g. ``--mask-offpolicy-in-partial-rollout`` zeroing the old loss mask) are kept.
- Later calls (partial rollout resuming an aborted sample, or an agent calling again after appending tool tokens
  to the sample) go straight to the turn with a ``sync`` (the token count and last tokens the session should
  hold). If the session lacks tokens the sample gained locally, the gateway says what it holds, they are appended
  as tool tokens (not trainable) and the turn runs; a session that is gone (gateway restarted) or does not match
  is (re)created from the whole ``sample.tokens``: still correct, only routing replay restarts from row 0.
- Sessions are deleted once the sample is finished (completed / truncated, or aborted without
  ``--partial-rollout``), by the turn's own request, so the gateway does not accumulate them. Set
  ``args.gateway_keep_sessions = True`` to keep every session (inspection, multi-turn agents).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slime_client.client import GatewayClient, Session
from slime_client.errors import ConflictError, GatewayResponseError, NotFoundError
from slime_client.sample import TurnTensors, slime_status
from slime_client.types import DeleteAfterTurn, MoEShape, SessionSync, TurnResult

log = logging.getLogger("slime_client.slime")

GATEWAY_URL_ENV = "SLIME_GATEWAY_URL"
GATEWAY_API_KEY_ENV = "SLIME_GATEWAY_API_KEY"
# slime's finish_reason.type -> Sample.Status value (slime's Sample.update_from_meta_info / _apply_meta_info).
FINISH_TO_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}

# The one piece of module state: a GatewayClient per (event loop, gateway URL, API key). A client's connections belong
# to the loop that opened them; keying by loop (weakly) gives every loop its own pool and drops it with the loop.
# slime runs all rollouts on one long-lived loop, so in practice this holds one client (a rotated key: a new one).
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], GatewayClient]] = (
    weakref.WeakKeyDictionary()
)


async def generate(args: Any, sample: Any, sampling_params: Mapping[str, Any], evaluation: bool = False) -> Any:
    """slime custom generate function (``--custom-generate-function-path slime_client.slime.generate``).

    ``evaluation`` is accepted for slime's signature check; evaluation and training rollouts are generated alike.
    ``sampling_params`` is not modified (slime passes a per-sample copy; this copies again).
    """
    params = dict(sampling_params)
    if not _spend_response_budget(params, sample.response_length):
        # As slime: the sample already used its whole max_new_tokens; nothing is sent.
        sample.status = slime_status(sample, "truncated")
        return sample
    if not sample.tokens:
        sample.tokens = prompt_token_ids(args, sample.prompt)
    if sample.session_id is None:
        sample.session_id = uuid.uuid4().hex

    replay = bool(getattr(args, "use_rollout_routing_replay", False))
    gateway = client_for(gateway_url(args), gateway_api_key(args))
    call = TurnCall(gateway, sample, params, routing_shape(args) if replay else None, _delete_policy(args))
    append_turn(sample, await call.run())
    return sample


# ---- configuration ---------------------------------------------------------------------------------------------
def gateway_url(args: Any) -> str:
    url = getattr(args, "gateway_url", None) or os.environ.get(GATEWAY_URL_ENV)
    if not url:
        raise ValueError(
            f"slime_client.slime.generate needs the gateway URL: set the {GATEWAY_URL_ENV} environment variable "
            "(e.g. http://127.0.0.1:8000) or args.gateway_url"
        )
    return url


def gateway_api_key(args: Any) -> str:
    """The gateway's API key: ``args.gateway_api_key``, else ``SLIME_GATEWAY_API_KEY``; "" when there is none."""
    return getattr(args, "gateway_api_key", None) or os.environ.get(GATEWAY_API_KEY_ENV, "")


def routing_shape(args: Any) -> MoEShape:
    num_layers, topk = getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None)
    if not num_layers or not topk:
        raise ValueError("--use-rollout-routing-replay needs args.num_layers and args.moe_router_topk")
    return MoEShape(num_layers=int(num_layers), topk=int(topk))


def client_for(url: str, api_key: str = "") -> GatewayClient:
    """The shared client for ``url`` (sending ``api_key``, "" for none) on the running event loop (created on first
    use)."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get((url, api_key))
    if client is None or client.is_closed:
        client = per_loop[url, api_key] = GatewayClient(url, api_key=api_key)
    return client


async def close_clients() -> None:
    """Close the running loop's shared clients (end of training, tests)."""
    for client in _clients.pop(asyncio.get_running_loop(), {}).values():
        await client.aclose()


@functools.cache
def _load_tokenizer(path: str) -> Any:
    """One tokenizer per checkpoint path for the process (as slime's GenerateState keeps one)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ImportError(
            "sample.tokens is empty, so slime_client.slime must tokenize sample.prompt and needs `transformers` "
            "(pip install transformers) -- or fill sample.tokens before generate"
        ) from exc
    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def prompt_token_ids(args: Any, prompt: Any) -> list[int]:
    """Tokenize ``sample.prompt`` exactly like slime's default generate (no special tokens added)."""
    if not isinstance(prompt, str):
        raise TypeError(f"sample.prompt must be a string to tokenize (got {type(prompt).__name__}); fill sample.tokens")
    return list(_load_tokenizer(args.hf_checkpoint)(prompt, add_special_tokens=False)["input_ids"])


# ---- one turn on the session that mirrors the sample -------------------------------------------------------------
SYNC_TOKENS = 16  # last tokens sent with a sync: enough to tell a session apart from another sample's


@dataclass
class TurnCall:
    """One model turn for ``sample`` on the session mirroring its tokens: normally one request."""

    gateway: GatewayClient
    sample: Any
    params: dict[str, Any]
    moe: MoEShape | None  # routing replay's shape, or None without replay
    delete_after_turn: DeleteAfterTurn

    async def run(self) -> TurnTensors:
        if self.sample.response_length == 0:
            try:
                return await self._start()
            except ConflictError as exc:
                if exc.error_type != "session_exists":
                    raise  # else: resumed (or re-sent) after the session was made: carry on with it
        session = Session(self.gateway, self.sample.session_id)
        tokens = self.sample.tokens
        try:
            return await self._turn(session)
        except NotFoundError:
            return await self._start()  # gone (a gateway restart, an expired session): from the whole sample
        except ConflictError as exc:
            if exc.error_type != "session_mismatch":
                raise
            held, last = int(exc.details["total_tokens"]), list(exc.details["last_tokens"])
        if held < len(tokens) and list(tokens[held - len(last) : held]) == last:
            await session.append(tokens[held:], sync=_sync(tokens[:held]))  # tokens the sample gained locally
            return await self._turn(session)
        log.warning(
            "gateway session %s (%d tokens) does not match its sample (%d tokens); recreating it from the sample",
            self.sample.session_id,
            held,
            len(tokens),
        )
        await session.delete()
        return await self._start()

    async def _start(self) -> TurnTensors:
        return await self.gateway.start_session(
            prompt_ids=self.sample.tokens,
            sampling_params=self.params,
            return_routed_experts=self.moe is not None,
            delete_after_turn=self.delete_after_turn,
            num_layers=None if self.moe is None else self.moe.num_layers,
            moe_router_topk=None if self.moe is None else self.moe.topk,
            session_id=self.sample.session_id,
        )

    async def _turn(self, session: Session) -> TurnTensors:
        return await session.generate_turn(
            self.params,
            return_routed_experts=self.moe is not None,
            sync=_sync(self.sample.tokens),
            delete_after_turn=self.delete_after_turn,
        )


def _sync(tokens: Sequence[int]) -> SessionSync:
    return SessionSync(len(tokens), tuple(int(t) for t in tokens[-SYNC_TOKENS:]))


def _delete_policy(args: Any) -> DeleteAfterTurn:
    if getattr(args, "gateway_keep_sessions", False):
        return "never"
    # With partial rollout, slime hands an aborted sample back to generate later: its session carries on.
    return "if_finished" if getattr(args, "partial_rollout", False) else "always"


# ---- folding one turn onto the slime Sample -------------------------------------------------------------------
def append_turn(sample: Any, turn: TurnTensors) -> None:
    """Append a turn's own tensors onto ``sample`` the way slime's ``append_response_tokens`` does. Routing replay:
    the turn's rows replace the sample's from ``routed_experts_first_row`` on (slime's fold with
    ``routed_experts_start_len``)."""
    previous_length = sample.response_length
    count = turn.num_tokens
    if count:
        sample.tokens += turn.tokens.tolist()
        sample.response_length += count
        if sample.loss_mask is None:
            sample.loss_mask = [1] * previous_length
        sample.loss_mask += turn.loss_mask.tolist()
    if turn.result.text:
        sample.response += turn.result.text
    _append_log_probs(sample, turn.rollout_log_probs.tolist(), previous_length)
    _append_top_p_spans(sample, turn, previous_length)
    if turn.rollout_routed_experts is not None:
        sample.rollout_routed_experts = _replayed_routing(sample, turn)
    _apply_terminal_info(sample, turn.result)


def _replayed_routing(sample: Any, turn: TurnTensors) -> torch.Tensor:
    rows = turn.rollout_routed_experts
    assert rows is not None
    first = turn.routed_experts_first_row or 0
    held = getattr(sample, "rollout_routed_experts", None) if first else None
    if first and (held is None or len(held) < first):
        raise GatewayResponseError(
            f"session {turn.result.session_id!r} sent routing rows from row {first}, but the sample holds "
            f"{0 if held is None else len(held)} rows"
        )
    return extend(held, first, rows.numpy())


# On a tensor ``extend`` returned: the numpy buffer it views the start of. The tensor may grow in place only while it
# is still the sample's field (a caller's own slice of it is another tensor object, without the attribute).
_BUFFER_ATTRIBUTE = "_slime_client_buffer"


def extend(held: Any, keep: int, new: np.ndarray) -> torch.Tensor:
    """``held[:keep]`` followed by the rows ``new``, as an int32 tensor, amortized O(len(new)): when ``held`` is a
    tensor this function returned and ``keep`` is all of it, ``new`` goes into the spare room of the buffer it views
    (doubled when full), so a long multi-turn sample does not copy its whole routing history every turn. The tensor
    views only its rows of the buffer (pickling it ships just those). numpy does the copies: a torch copy of this
    size runs on its intra-op threads, whose spinning costs more CPU than the copy."""
    total = keep + len(new)
    buffer: np.ndarray | None = getattr(held, _BUFFER_ATTRIBUTE, None) if held is not None else None
    if buffer is None or keep != len(held) or len(buffer) < total or buffer.shape[1:] != new.shape[1:]:
        old = buffer
        buffer = np.empty((max(total, 2 * keep), *new.shape[1:]), np.int32)
        if keep:
            buffer[:keep] = old[:keep] if old is not None and keep == len(held) else np.asarray(held)[:keep]
    buffer[keep:total] = new
    grown = torch.from_numpy(buffer[:total])
    setattr(grown, _BUFFER_ATTRIBUTE, buffer)
    return grown


def _append_log_probs(sample: Any, log_probs: list[float], previous_length: int) -> None:
    if sample.rollout_log_probs is None:
        if previous_length:
            raise ValueError(
                "Cannot append trainable rollout log probabilities to a sample with existing response tokens "
                "but no existing rollout_log_probs."
            )
        sample.rollout_log_probs = []
    sample.rollout_log_probs += log_probs


def _append_top_p_spans(sample: Any, turn: TurnTensors, previous_length: int) -> None:
    ids, offsets = turn.rollout_top_p_token_ids, turn.rollout_top_p_token_offsets
    if ids is None or offsets is None or not turn.num_tokens:
        return
    held_ids = getattr(sample, "rollout_top_p_token_ids", None)
    held_offsets = getattr(sample, "rollout_top_p_token_offsets", None)
    if held_offsets is None or held_ids is None:
        if previous_length:
            raise ValueError("top-p replay data arrived for a sample whose earlier response tokens have none")
        sample.rollout_top_p_token_ids = extend(None, 0, ids.numpy())
        sample.rollout_top_p_token_offsets = extend(None, 0, offsets.numpy())
        return
    # slime's merge: the new offsets continue from the stored last offset.
    base = int(held_offsets[-1])
    sample.rollout_top_p_token_ids = extend(held_ids, len(held_ids), ids.numpy())
    sample.rollout_top_p_token_offsets = extend(held_offsets, len(held_offsets), offsets.numpy()[1:] + base)


def _apply_terminal_info(sample: Any, turn: TurnResult) -> None:
    """slime applies these only for a finished answer (``finish_reason`` present)."""
    if turn.finish_reason is None:
        return
    info = getattr(sample, "prefix_cache_info", None)
    if info is not None:  # slime's PrefixCacheInfo.add(meta_info)
        info.cached_tokens += turn.cached_tokens
        info.total_prompt_tokens += turn.prompt_tokens
    if turn.completion_tokens and turn.weight_version is not None:
        sample.weight_versions.append(turn.weight_version)
    status = FINISH_TO_STATUS.get(turn.finish_type or "")
    if status is not None:
        sample.status = slime_status(sample, status)


def _spend_response_budget(params: dict[str, Any], response_length: int) -> bool:
    """slime: ``max_new_tokens -= response_length``; False when nothing is left to generate."""
    if params.get("max_new_tokens") is None:
        return True
    params["max_new_tokens"] -= response_length
    return params["max_new_tokens"] > 0
