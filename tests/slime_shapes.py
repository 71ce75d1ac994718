"""slime's ``Sample`` and the checks its trainer makes on a fan-out, in the tests' own words (slime is not on the
package registry, and nothing here may import it).

``Sample`` (``bench.reference.Sample``, the one stand-in) has the fields and the ``Status`` values of slime's
``slime/utils/types.py`` that an agent rollout fills or slime reads back; ``check_fan_out`` asserts what slime asserts
before it trains on a generate function's ``list[Sample]``
(``slime.observability.rollout_data_utils.validate_rollout_id_annotated`` and the per-sample checks of
``slime.ray.rollout``'s conversion to train data, R3 and top-p replay included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.reference import Sample

__all__ = ["Sample", "TrainArgs", "check_fan_out", "check_sample"]


@dataclass(frozen=True)
class TrainArgs:
    """The slime arguments the checks read."""

    use_rollout_routing_replay: bool = False
    num_layers: int | None = None
    moe_router_topk: int | None = None
    rollout_top_p: float = 1.0


def check_fan_out(samples: list[Sample], args: TrainArgs) -> None:
    """What slime asserts of one rollout's samples before training on them."""
    assert samples, "a generate function returns at least one sample"
    if len(samples) > 1:
        ids = [s.rollout_id for s in samples]
        assert None not in ids, f"rollout_id unset on some siblings: {ids}"
        assert len(set(ids)) == 1, f"siblings must share one rollout_id: {ids}"
    for s in samples:
        check_sample(s, args)


def check_sample(s: Sample, args: TrainArgs) -> None:
    assert s.loss_mask is not None and len(s.loss_mask) == s.response_length, "loss mask != response length"
    assert s.rollout_log_probs is not None and len(s.rollout_log_probs) == s.response_length
    assert 0 < s.response_length <= len(s.tokens)
    if args.rollout_top_p != 1.0:
        assert s.rollout_top_p_token_ids is not None and s.rollout_top_p_token_offsets is not None
        assert len(s.rollout_top_p_token_offsets) == s.response_length + 1
        assert int(s.rollout_top_p_token_offsets[-1]) == len(s.rollout_top_p_token_ids)
    if args.use_rollout_routing_replay:
        experts = torch.as_tensor(s.rollout_routed_experts)
        assert experts.ndim == 3 and tuple(experts.shape[1:]) == (args.num_layers, args.moe_router_topk)
        assert experts.shape[0] == len(s.tokens) - 1, f"routing rows {experts.shape[0]} != len(tokens) - 1"
        if args.moe_router_topk and args.moe_router_topk > 1:
            for layer in range(experts.shape[1]):
                assert torch.count_nonzero(experts[:, layer, :]), f"routing all zero for layer {layer}"
