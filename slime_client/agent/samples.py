"""A fetched branch of a session -> one slime ``Sample``, and slime's placeholder samples. Pure: no I/O.

The contract is slime's own (``slime.agent.trajectory.TrajectoryManager.get_trajectory`` and what
``slime.ray.rollout`` asserts before it trains on a fan-out):

- every sibling of one rollout carries the same non-None ``rollout_id`` (``base_sample.rollout_id``, else its
  ``index``);
- ``reward`` on each, the whole reward (``split_reward`` divides it evenly instead);
- ``status`` COMPLETED, as slime's adapters set it; ``metadata`` gains ``truncated`` (the branch's last model turn
  stopped at its length), ``use_tool`` and ``ill_formed`` (over the branch's whole conversation, the parent's part
  of a fork included), and ``branch`` (its place in the session's tree);
- ``tokens``, ``response``, ``response_length``, ``loss_mask``, ``rollout_log_probs``, top-p spans, routing (uint8
  as the gateway stores it up to 256 experts: slime's routing replay widens it to int32 on its way to the GPU; int32
  past that), ``weight_versions`` and ``prefix_cache_info`` exactly as the session holds them
  (``RolloutSample.to_slime``), cut
  to the session's context budget, and to the tokens its routing rows cover: slime's trainer asserts
  ``len(rollout_routed_experts) == len(tokens) - 1``, and the tokens of a turn whose routing never came (a streamed
  turn aborted mid-way) are not trainable with routing replay;
- a branch with no trained token is no sample.

The ``Sample`` is whatever object the caller passes (slime's is not importable here): it is copied, never imported.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slime_client.sample import RolloutSample, slime_status

Reward = float | dict[str, Any]
# Fields the conversion writes: not copied from the base sample first.
_WRITTEN = frozenset(
    {
        "tokens",
        "response",
        "loss_mask",
        "rollout_log_probs",
        "rollout_top_p_token_ids",
        "rollout_top_p_token_offsets",
        "rollout_routed_experts",
        "weight_versions",
        "metadata",
    }
)


@dataclass(frozen=True, slots=True)
class ReplayShape:
    """What slime trains with, so that a placeholder sample passes slime's checks beside real ones: routing replay's
    shape (``--use-rollout-routing-replay``), top-p replay (``--rollout-top-p`` below 1)."""

    num_layers: int | None = None
    topk: int | None = None
    top_p: bool = False


def kept_tokens(branch: RolloutSample, max_tokens: int = 0) -> int:
    """How many of the branch's tokens its sample keeps: all of them, at most ``max_tokens`` (the session's context
    budget; 0: none), and no more than its routing rows cover (rows + 1: a sample's last token has no row)."""
    keep = len(branch.tokens)
    if max_tokens > 0:
        keep = min(keep, max_tokens)
    routed = branch.rollout_routed_experts
    if routed is not None:
        keep = min(keep, len(routed) + 1)
    return keep


def cut(branch: RolloutSample, keep: int) -> RolloutSample:
    """The branch's first ``keep`` tokens (at least its prompt), every per-token array cut alike; views, no copies.
    The response text stays whole (there is no tokenizer here to cut it by tokens)."""
    if keep >= len(branch.tokens):
        return branch
    n = keep - branch.prompt_length
    if n < 0:
        raise ValueError(f"cannot keep {keep} tokens of a branch whose prompt is {branch.prompt_length} tokens")
    ids, offsets = branch.rollout_top_p_token_ids, branch.rollout_top_p_token_offsets
    spans: dict[str, Any] = {}
    if ids is not None and offsets is not None:
        spans = {"rollout_top_p_token_ids": ids[: int(offsets[n])], "rollout_top_p_token_offsets": offsets[: n + 1]}
    routed = branch.rollout_routed_experts
    versions = branch.rollout_weight_version_ids
    return dataclasses.replace(
        branch,
        tokens=branch.tokens[:keep],
        loss_mask=branch.loss_mask[:n],
        rollout_log_probs=branch.rollout_log_probs[:n],
        response_length=n,
        rollout_routed_experts=None if routed is None else routed[: max(0, keep - 1)],
        rollout_weight_version_ids=None if versions is None else versions[:n],
        **spans,
    )


def rollout_id_of(base_sample: Any, session_id: str) -> int:
    """slime's: the base sample's ``rollout_id``, else its ``index``; with neither, a number from the session id
    (every sibling still gets the same one)."""
    for name in ("rollout_id", "index"):
        value = getattr(base_sample, name, None)
        if value is not None:
            return int(value)
    return zlib.crc32(session_id.encode())


def branch_to_sample(
    branch: RolloutSample,
    base_sample: Any,
    *,
    reward: Reward | None,
    rollout_id: int,
    extra_metadata: Mapping[str, Any] | None = None,
    max_tokens: int = 0,
) -> Any | None:
    """One slime ``Sample`` (a copy of ``base_sample``) for one branch of a session, or None when the branch has no
    trained token (within what it keeps: ``kept_tokens``)."""
    keep = kept_tokens(branch, max_tokens)
    if keep <= branch.prompt_length:
        return None
    kept = cut(branch, keep)
    if not bool(kept.loss_mask.any()):
        return None
    sample = copy_sample(base_sample)
    kept.to_slime(sample, narrow_routing=True)
    sample.status = slime_status(sample, "completed")
    sample.rollout_id = rollout_id
    sample.reward = copy.copy(reward)
    sample.metadata = {
        **(getattr(base_sample, "metadata", None) or {}),
        **(extra_metadata or {}),
        "truncated": branch.status == "truncated",
        "use_tool": bool(branch.chat.get("use_tool", False)),
        "ill_formed": bool(branch.chat.get("ill_formed", False)),
        "branch": tree_place(branch, cut_tokens=len(branch.tokens) - keep),
    }
    return sample


def tree_place(branch: RolloutSample, *, cut_tokens: int = 0) -> dict[str, Any]:
    """Where the branch stands in its session's tree (the sample's ``metadata["branch"]``)."""
    return {
        "session_id": branch.session_id,
        "index": branch.branch,
        "branches": branch.branches,
        "parent": branch.parent,
        "fork_token": branch.fork_token,
        "first_difference": branch.first_difference,
        "cause": branch.cause,
        "model": branch.model,
        "turns": branch.turns,
        "cut_tokens": cut_tokens,
    }


def branches_to_samples(
    branches: Sequence[RolloutSample],
    base_sample: Any,
    *,
    reward: Reward | None,
    extra_metadata: Mapping[str, Any] | None = None,
    max_tokens: int = 0,
    split_reward: bool = False,
) -> list[Any]:
    """Every branch with a trained token as a sample, in the session's branch order (parents before their forks),
    all with one ``rollout_id``; ``split_reward``: each gets an even share of a numeric reward instead of all of
    it."""
    if not branches:
        return []
    rollout_id = rollout_id_of(base_sample, branches[0].session_id)
    samples = [
        sample
        for branch in branches
        if (
            sample := branch_to_sample(
                branch,
                base_sample,
                reward=reward,
                rollout_id=rollout_id,
                extra_metadata=extra_metadata,
                max_tokens=max_tokens,
            )
        )
        is not None
    ]
    if split_reward and samples and reward is not None:
        if not isinstance(reward, int | float):
            raise TypeError(f"split_reward needs a numeric reward, not {type(reward).__name__}")
        for sample in samples:
            sample.reward = float(reward) / len(samples)
    return samples


def copy_sample(base_sample: Any) -> Any:
    """A copy of ``base_sample`` whose containers are its own (one level deep), so that a sibling's or the caller's
    changes do not reach it; the fields the conversion writes are not copied first."""
    sample = copy.copy(base_sample)
    fields = getattr(sample, "__dict__", None)
    if fields is None:  # a slotted class: copy it whole
        return copy.deepcopy(base_sample)
    for name, value in fields.items():
        if name in _WRITTEN:
            continue
        if isinstance(value, list | dict | set) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            setattr(sample, name, copy.copy(value))
    return sample


# ---- placeholders ----------------------------------------------------------------------------------------------
def placeholder_sample(
    sample: Any,
    *,
    reward: Reward | None = 0.0,
    status: str = "aborted",
    replay: ReplayShape | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> list[Any]:
    """slime's placeholder for a rollout with nothing to train on (``examples/coding_agent_rl/generate.py``
    ``_abort_result`` / ``_eval_result``), written onto ``sample`` in place and returned in the fan-out shape:
    ``tokens=[0, 0]``, ``response_length=1``, ``loss_mask=[0]``, ``remove_sample=True``, ``status`` (aborted, or
    completed for an evaluation's), ``metadata`` merged. With ``replay``, one routing row and empty top-p spans,
    so that slime's R3 and top-p checks pass on a batch that mixes it with real samples."""
    sample.tokens = [0, 0]
    sample.response = ""
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.reward = reward
    sample.remove_sample = True
    sample.status = slime_status(sample, status)
    if replay is not None and replay.num_layers and replay.topk:
        # Distinct expert ids per layer: slime refuses a routing capture that is all zero for a MoE layer.
        row = torch.arange(replay.topk, dtype=torch.int32).repeat(replay.num_layers, 1)
        sample.rollout_routed_experts = row.unsqueeze(0)
    if replay is not None and replay.top_p:
        sample.rollout_top_p_token_ids = torch.empty(0, dtype=torch.int32)
        sample.rollout_top_p_token_offsets = torch.zeros(2, dtype=torch.int32)
    sample.metadata = {**(getattr(sample, "metadata", None) or {}), **(metadata or {})}
    return [sample]
