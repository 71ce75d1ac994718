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

How a sample maps to a gateway session (key: ``sample.session_id``, a fresh uuid if slime did not set one):
- The session mirrors ``sample.tokens``. First call: the session is created from ``sample.tokens`` (or from
  ``sample.prompt``, tokenized like slime, when ``tokens`` is empty).
- Later calls (partial rollout resuming an aborted sample, or an agent calling again after appending tool
  tokens to the sample) reuse the session when its tokens are a prefix of ``sample.tokens`` (checked on the
  length and the last tokens the gateway shows); tokens the sample gained locally are appended to the session
  as tool tokens (not trainable). If the session is gone (gateway restarted) or does not match, it is
  (re)created from the whole ``sample.tokens`` -- still correct, only routing replay restarts from row 0.
- Each call appends only what this turn added onto the sample, slime-style, so fields slime or the caller
  changed in between (e.g. ``--mask-offpolicy-in-partial-rollout`` zeroing the old loss mask) are kept.
- Sessions are deleted once the sample is finished (completed / truncated / failed, or aborted without
  ``--partial-rollout``), so the gateway does not accumulate them. Set ``args.gateway_keep_sessions = True``
  to keep every session (inspection, multi-turn agents that call this repeatedly).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from slime_client.client import GatewayClient, Session
from slime_client.errors import ConflictError, GatewayResponseError, NotFoundError
from slime_client.sample import RolloutSample, slime_status
from slime_client.types import MoEShape, SessionState, TurnResult

log = logging.getLogger("slime_client.slime")

GATEWAY_URL_ENV = "SLIME_GATEWAY_URL"
GATEWAY_API_KEY_ENV = "SLIME_GATEWAY_API_KEY"
# slime's finish_reason.type -> Sample.Status value (slime's Sample.update_from_meta_info / _apply_meta_info).
FINISH_TO_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
# Statuses after which slime will not call generate for the sample again (unless it resumes partial rollouts).
RESUMABLE_STATUSES = frozenset({"pending", "aborted"})

MirrorPlan = Literal["reuse", "append", "recreate"]

# The one piece of module state: a GatewayClient per (event loop, gateway URL, API key). httpx connections belong
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
    session = await mirror_session(gateway, sample, routing_shape(args) if replay else None)
    turn = await session.generate(params, return_routed_experts=replay)
    append_turn(sample, turn, await session.fetch())
    if not _keep_session(args, _status_value(sample.status)):
        await session.delete()
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


# ---- the session that mirrors the sample -------------------------------------------------------------------------
async def mirror_session(gateway: GatewayClient, sample: Any, moe: MoEShape | None) -> Session:
    """The gateway session holding exactly ``sample.tokens`` (created, reused, extended or recreated)."""
    if sample.response_length == 0:
        try:
            return await _create_from_sample(gateway, sample, moe)
        except ConflictError as exc:
            if exc.error_type != "session_exists":
                raise
    session = Session(gateway, sample.session_id)
    try:
        state = await session.state()
    except NotFoundError:
        return await _create_from_sample(gateway, sample, moe)
    plan = plan_mirror(state, sample.tokens, moe)
    if plan == "append":
        await session.append(sample.tokens[state.total_tokens :])
    elif plan == "recreate":
        log.warning(
            "gateway session %s (%d tokens) does not match its sample (%d tokens); recreating it from the sample",
            sample.session_id,
            state.total_tokens,
            len(sample.tokens),
        )
        await session.delete()
        return await _create_from_sample(gateway, sample, moe)
    return session


def plan_mirror(state: SessionState, tokens: Sequence[int], moe: MoEShape | None) -> MirrorPlan:
    """Whether an existing session can stand for a sample with ``tokens``: its tokens must be a prefix.

    The gateway shows the session's length and last tokens; checking those (not every token) keeps this O(1).
    """
    if moe is not None and state.moe != moe:
        return "recreate"
    held = state.total_tokens
    if held > len(tokens) or list(tokens[held - len(state.last_tokens) : held]) != state.last_tokens:
        return "recreate"
    return "reuse" if held == len(tokens) else "append"


async def _create_from_sample(gateway: GatewayClient, sample: Any, moe: MoEShape | None) -> Session:
    return await gateway.create_session(
        prompt_ids=sample.tokens,
        num_layers=None if moe is None else moe.num_layers,
        moe_router_topk=None if moe is None else moe.topk,
        session_id=sample.session_id,
    )


def _keep_session(args: Any, status: str) -> bool:
    if getattr(args, "gateway_keep_sessions", False):
        return True
    # With partial rollout, slime hands an aborted sample back to generate later: its session carries on.
    return status in RESUMABLE_STATUSES and bool(getattr(args, "partial_rollout", False))


# ---- folding one turn onto the slime Sample -------------------------------------------------------------------
def append_turn(sample: Any, turn: TurnResult, fetched: RolloutSample) -> None:
    """Append this turn's tokens onto ``sample`` the way slime's ``append_response_tokens`` does.

    Only the new part is taken from the fetched session sample (positions ``turn.prompt_length`` on), so the
    sample's earlier response fields stay as the sample had them; routing replay covers the whole sequence and
    replaces the stored routing, as slime does for a full (start_len 0) routing answer.
    """
    start = turn.prompt_length - fetched.prompt_length  # the turn's first token, as an index into the response
    end = start + turn.completion_tokens
    if start < 0 or end != fetched.response_length:
        raise GatewayResponseError(
            f"session {turn.session_id!r} changed between the turn and the fetch (turn covers response "
            f"[{start}, {end}), the session has {fetched.response_length} response tokens)"
        )
    previous_length = sample.response_length
    count = end - start
    if count:
        sample.tokens += fetched.tokens[turn.prompt_length :].tolist()
        sample.response_length += count
        if sample.loss_mask is None:
            sample.loss_mask = [1] * previous_length
        sample.loss_mask += fetched.loss_mask[start:end].tolist()
    if turn.text:
        sample.response += turn.text
    _append_log_probs(sample, fetched.rollout_log_probs[start:end].tolist(), previous_length)
    _append_top_p_spans(sample, fetched, start, end, previous_length)
    if fetched.rollout_routed_experts is not None:
        sample.rollout_routed_experts = fetched.routed_experts_int32()
    _apply_terminal_info(sample, turn)


def _append_log_probs(sample: Any, log_probs: list[float], previous_length: int) -> None:
    if sample.rollout_log_probs is None:
        if previous_length:
            raise ValueError(
                "Cannot append trainable rollout log probabilities to a sample with existing response tokens "
                "but no existing rollout_log_probs."
            )
        sample.rollout_log_probs = []
    sample.rollout_log_probs += log_probs


def _append_top_p_spans(sample: Any, fetched: RolloutSample, start: int, end: int, previous_length: int) -> None:
    ids, offsets = fetched.rollout_top_p_token_ids, fetched.rollout_top_p_token_offsets
    if ids is None or offsets is None or start == end:
        return
    spans = offsets[start : end + 1]
    new_ids = ids[int(spans[0]) : int(spans[-1])].to(torch.int32, copy=True)
    new_offsets = (spans - spans[0]).to(torch.int32)
    if getattr(sample, "rollout_top_p_token_offsets", None) is None:
        if previous_length:
            raise ValueError("top-p replay data arrived for a sample whose earlier response tokens have none")
        sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets = new_ids, new_offsets
        return
    # slime's merge: the new offsets continue from the stored last offset.
    old_ids = torch.as_tensor(sample.rollout_top_p_token_ids, dtype=torch.int32)
    old_offsets = torch.as_tensor(sample.rollout_top_p_token_offsets, dtype=torch.int32)
    sample.rollout_top_p_token_ids = torch.cat([old_ids, new_ids])
    sample.rollout_top_p_token_offsets = torch.cat([old_offsets, new_offsets[1:] + old_offsets[-1]])


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


def _status_value(status: Any) -> str:
    return str(getattr(status, "value", status))
