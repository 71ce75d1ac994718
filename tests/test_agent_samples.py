"""A fetched branch -> slime's ``Sample`` (``slime_client.agent.samples``), against slime's contract, no gateway.

Branches are built by hand as the gateway sends them (``RolloutSample``); the samples must pass what slime's trainer
asserts of a fan-out (``slime_shapes.check_fan_out``), hold the branch's arrays exactly, carry slime's metadata, and
be copies of the base sample that share nothing with it or with each other.
"""

from __future__ import annotations

import copy

import pytest
import torch
from slime_shapes import Sample, TrainArgs, check_fan_out, check_sample

from slime_client.agent.samples import (
    ReplayShape,
    branch_to_sample,
    branches_to_samples,
    copy_sample,
    cut,
    kept_tokens,
    placeholder_sample,
    rollout_id_of,
)
from slime_client.sample import RolloutSample

LAYERS, TOPK = 3, 2
R3 = TrainArgs(use_rollout_routing_replay=True, num_layers=LAYERS, moe_router_topk=TOPK, rollout_top_p=0.9)


def make_branch(
    prompt: int,
    mask: list[int],
    *,
    branch: int = 0,
    parent: int | None = None,
    rows: int | None = None,
    status: str = "completed",
    chat: dict[str, bool] | None = None,
) -> RolloutSample:
    """A branch of ``prompt`` prompt tokens and a response with loss mask ``mask``; routing rows (``rows``, default
    all: one per token but the last), top-p spans of two ids per trained token, none per tool token."""
    n = len(mask)
    total = prompt + n
    tokens = torch.arange(100, 100 + total, dtype=torch.int32)
    rows = total - 1 if rows is None else rows
    routed = (torch.arange(rows * LAYERS * TOPK) % 7 + 1).to(torch.uint8).reshape(rows, LAYERS, TOPK)
    counts = torch.tensor([2 * m for m in mask], dtype=torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0).to(torch.int32)])
    return RolloutSample(
        session_id="sid-1",
        status=status,
        tokens=tokens,
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
        rollout_log_probs=torch.tensor([-0.5 * m for m in mask], dtype=torch.float32),
        response="the response text",
        response_length=n,
        prompt_length=prompt,
        weight_versions=["v1"],
        cached_tokens=3,
        prompt_tokens=prompt,
        rollout_top_p_token_ids=torch.arange(int(offsets[-1]), dtype=torch.int32),
        rollout_top_p_token_offsets=offsets,
        rollout_routed_experts=routed,
        rollout_weight_version_ids=torch.zeros(n, dtype=torch.int32),
        weight_version_table=["v1"],
        num_layers=LAYERS,
        moe_router_topk=TOPK,
        turns=2,
        branch=branch,
        branches=2,
        parent=parent,
        fork_token=0 if parent is None else prompt,
        cause=None if branch == 0 else "new_root",
        chat=chat if chat is not None else {"use_tool": True, "ill_formed": False},
    )


def base(**fields: object) -> Sample:
    return Sample(index=7, group_index=2, prompt="fix the bug", label="L", metadata={"task": "t1"}, **fields)


def test_a_branch_becomes_a_sample_exactly_as_the_session_holds_it() -> None:
    branch = make_branch(5, [1, 1, 0, 0, 1, 1])
    sample = branch_to_sample(branch, base(), reward=1.0, rollout_id=7)
    assert sample is not None
    check_sample(sample, R3)
    assert sample.tokens == branch.tokens.tolist() and sample.response_length == 6
    assert sample.loss_mask == [1, 1, 0, 0, 1, 1]
    assert sample.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert torch.equal(sample.rollout_top_p_token_offsets, branch.rollout_top_p_token_offsets)
    assert torch.equal(sample.rollout_top_p_token_ids, branch.rollout_top_p_token_ids)
    # uint8 as stored (slime widens it on its way to the GPU), a copy of its own (not a view of the fetched body)
    assert sample.rollout_routed_experts.dtype == torch.uint8
    assert torch.equal(sample.rollout_routed_experts, branch.rollout_routed_experts)
    for name in ("rollout_routed_experts", "rollout_top_p_token_ids", "rollout_top_p_token_offsets"):
        mine, theirs = getattr(sample, name), getattr(branch, name)
        assert mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr(), name
    assert sample.weight_versions == ["v1"] and sample.response == "the response text"
    assert (sample.prefix_cache_info.cached_tokens, sample.prefix_cache_info.total_prompt_tokens) == (3, 5)
    assert sample.status is Sample.Status.COMPLETED and sample.reward == 1.0 and sample.rollout_id == 7
    assert (sample.index, sample.group_index, sample.prompt, sample.label) == (7, 2, "fix the bug", "L")
    assert sample.metadata == {
        "task": "t1",
        "truncated": False,
        "use_tool": True,
        "ill_formed": False,
        "branch": {
            "session_id": "sid-1",
            "index": 0,
            "branches": 2,
            "parent": None,
            "fork_token": 0,
            "first_difference": None,
            "cause": None,
            "model": None,
            "turns": 2,
            "cut_tokens": 0,
        },
    }


def test_slimes_flags_come_from_the_branch() -> None:
    branch = make_branch(4, [1, 1], status="truncated", chat={"use_tool": False, "ill_formed": True})
    sample = branch_to_sample(branch, base(), reward=0.0, rollout_id=1, extra_metadata={"truncated": "ignored", "x": 1})
    assert sample is not None
    # as slime: the extra metadata first, the flags over it
    assert (sample.metadata["truncated"], sample.metadata["use_tool"], sample.metadata["ill_formed"]) == (
        True,
        False,
        True,
    )
    assert sample.metadata["x"] == 1
    token_session = make_branch(4, [1, 1], chat={})
    flags = branch_to_sample(token_session, base(), reward=0.0, rollout_id=1).metadata  # type: ignore[union-attr]
    assert (flags["use_tool"], flags["ill_formed"]) == (False, False)


def test_a_branch_without_a_trained_token_is_no_sample() -> None:
    assert branch_to_sample(make_branch(4, [0, 0, 0]), base(), reward=1.0, rollout_id=1) is None
    assert branch_to_sample(make_branch(4, []), base(), reward=1.0, rollout_id=1) is None


def test_tokens_past_the_routing_rows_are_cut_so_slimes_r3_assertion_holds() -> None:
    """An aborted streamed turn's tokens came without their routing rows: the sample ends where the rows do."""
    branch = make_branch(4, [1, 1, 0, 1, 1, 1], rows=6)  # rows for 7 tokens of 10
    assert kept_tokens(branch) == 7
    sample = branch_to_sample(branch, base(), reward=0.0, rollout_id=1)
    assert sample is not None
    check_sample(sample, R3)
    assert len(sample.tokens) == 7 and sample.loss_mask == [1, 1, 0] and sample.metadata["branch"]["cut_tokens"] == 3
    assert len(sample.rollout_top_p_token_offsets) == 4 and int(sample.rollout_top_p_token_offsets[-1]) == 4
    # only the tool tokens after the last routed model token: nothing of the model's is lost... but nothing trained
    assert branch_to_sample(make_branch(4, [1, 1], rows=1), base(), reward=0.0, rollout_id=1) is None


def test_a_sample_is_cut_to_the_sessions_context_budget() -> None:
    branch = make_branch(4, [1, 1, 1, 1, 1, 1])
    sample = branch_to_sample(branch, base(), reward=0.0, rollout_id=1, max_tokens=7)
    assert sample is not None
    check_sample(sample, R3)
    assert sample.tokens == branch.tokens[:7].tolist() and sample.response_length == 3
    assert len(sample.rollout_routed_experts) == 6
    # a budget inside the prompt keeps nothing to train on
    assert branch_to_sample(branch, base(), reward=0.0, rollout_id=1, max_tokens=4) is None


def test_cut_refuses_to_cut_into_the_prompt() -> None:
    with pytest.raises(ValueError, match="prompt"):
        cut(make_branch(4, [1, 1]), 3)


def test_siblings_share_the_rollout_id_and_each_gets_the_whole_reward() -> None:
    branches = [make_branch(4, [1, 1]), make_branch(6, [0, 0]), make_branch(3, [1, 0, 1], branch=2, parent=0)]
    samples = branches_to_samples(branches, base(), reward=1.0)
    check_fan_out(samples, R3)
    assert len(samples) == 2  # the untrained branch is left out
    assert [s.rollout_id for s in samples] == [7, 7] and [s.reward for s in samples] == [1.0, 1.0]
    assert [s.metadata["branch"]["index"] for s in samples] == [0, 2]  # branch order
    assert samples[1].metadata["branch"]["parent"] == 0
    split = branches_to_samples(branches, base(), reward=1.0, split_reward=True)
    assert [s.reward for s in split] == [0.5, 0.5]
    with pytest.raises(TypeError):
        branches_to_samples(branches, base(), reward={"score": 1.0}, split_reward=True)
    assert branches_to_samples(branches, base(), reward=None)[0].reward is None  # left to slime's reward model


def test_the_rollout_id_is_the_base_samples_then_its_index() -> None:
    assert rollout_id_of(base(rollout_id=3), "s") == 3
    assert rollout_id_of(base(), "s") == 7
    anonymous = Sample()
    assert rollout_id_of(anonymous, "s") == rollout_id_of(anonymous, "s") != rollout_id_of(anonymous, "t")


def test_samples_are_copies_that_share_nothing() -> None:
    original = base()
    snapshot = copy.deepcopy(original)
    first, second = branches_to_samples([make_branch(4, [1]), make_branch(3, [1], branch=1)], original, reward=1.0)
    first.metadata["mine"] = 1
    first.prefix_cache_info.cached_tokens = 99
    first.weight_versions.append("x")
    assert "mine" not in second.metadata and second.prefix_cache_info.cached_tokens == 3
    assert second.weight_versions == ["v1"]
    assert original == snapshot  # the base sample is untouched


def test_copy_sample_copies_the_base_samples_containers() -> None:
    original = base(tokens=[1, 2, 3])
    copied = copy_sample(original)
    copied.prefix_cache_info.cached_tokens = 5
    assert original.prefix_cache_info.cached_tokens == 0 and copied is not original


# ---- placeholders --------------------------------------------------------------------------------------------
def test_the_placeholder_is_slimes_abort_result() -> None:
    sample = base()
    (placeholder,) = placeholder_sample(sample, metadata={"abort_reason": "wall_clock_timeout"})
    assert placeholder is sample  # in place, as slime's _abort_result
    assert (placeholder.tokens, placeholder.response_length, placeholder.loss_mask) == ([0, 0], 1, [0])
    assert placeholder.rollout_log_probs == [0.0] and placeholder.reward == 0.0
    assert placeholder.remove_sample is True and placeholder.status is Sample.Status.ABORTED
    assert placeholder.metadata == {"task": "t1", "abort_reason": "wall_clock_timeout"}


def test_a_placeholder_passes_slimes_r3_and_top_p_checks() -> None:
    (placeholder,) = placeholder_sample(base(), replay=ReplayShape(LAYERS, TOPK, top_p=True))
    check_sample(placeholder, R3)
    (evaluation,) = placeholder_sample(base(), reward=0.75, status="completed")
    assert evaluation.status is Sample.Status.COMPLETED and evaluation.reward == 0.75 and evaluation.remove_sample
