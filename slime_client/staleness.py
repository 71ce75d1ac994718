"""A staleness bound on a sample's trained tokens: how many weight versions behind the newest they may be.

In fully-async training the engine's weights change while rollouts run, and an agent's episode spans many turns: a
sample's early tokens may come from weights many updates old (each token's version is in
``RolloutSample.rollout_weight_version_ids``; the gateway sums them up per branch as ``trained_versions``). A bound
says how far behind a trained token may be, and what happens to a sample that has tokens past it:

- ``"drop"``: the sample is left out (``within_bound`` returns None; ``Session.fetch_all`` leaves it out of its list);
- ``"mask"``: the too-stale tokens stop being trained: their loss mask becomes 0 (a copy; their log-probs stay, the
  tokens stay in the sequence as context).

"Behind" counts weight updates. Versions that are all integers (slime's ``weight_version`` counts the updates: "1",
"2", ...) are compared as integers: a token of version 5 is 3 behind 8. Others are ordered as the sample met them
(its ``weight_version_table``, first seen first): a token is as many behind as the versions met after its own. The
newest is the ``newest`` given (the trainer's current version), else the newest the sample's tokens come from; a
``newest`` the sample never met, with versions that are not integers, counts as one after the last it met. Tokens of
no known version (an upstream that sent none) and tool tokens are never too stale.

    from slime_client.staleness import StalenessBound
    samples = await session.fetch_all(staleness=StalenessBound(max_behind=2, policy="mask", newest=str(step)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from slime_client.sample import RolloutSample

StalePolicy = Literal["drop", "mask"]
POLICIES: tuple[StalePolicy, ...] = ("drop", "mask")


@dataclass(frozen=True, slots=True)
class StalenessBound:
    """At most ``max_behind`` weight versions behind ``newest`` (None: the newest the sample met); past it the
    sample is dropped (``policy="drop"``) or its too-stale tokens are not trained (``"mask"``)."""

    max_behind: int
    policy: StalePolicy = "drop"
    newest: str | None = None

    def __post_init__(self) -> None:
        if type(self.max_behind) is not int or self.max_behind < 0:
            raise ValueError(f"max_behind must be an int >= 0 (got {self.max_behind!r})")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {self.policy!r})")


def versions_behind(table: Sequence[str], newest: str | None = None) -> list[int]:
    """How many versions each entry of a sample's ``weight_version_table`` is behind ``newest`` (0 for the newest
    and for any newer one)."""
    numbers = _integers([*table, *([] if newest is None else [newest])])
    if numbers is not None:
        top = numbers[-1] if newest is not None else max(numbers, default=0)
        return [max(0, top - number) for number in numbers[: len(table)]]
    newest_rank = len(table) if newest not in table else table.index(newest)  # never met: after the last
    top = len(table) - 1 if newest is None else newest_rank
    return [max(0, top - rank) for rank in range(len(table))]


def too_stale(sample: RolloutSample, bound: StalenessBound) -> torch.Tensor | None:
    """A bool mask over the response: the trained tokens past the bound; None when the sample has no per-token
    versions (a gateway that sent none: nothing to judge by)."""
    ids = sample.rollout_weight_version_ids
    if ids is None:
        return None
    behind = torch.tensor(versions_behind(sample.weight_version_table, bound.newest) or [0], dtype=torch.int64)
    known = ids >= 0
    staleness = torch.where(known, behind[ids.clamp(min=0).to(torch.int64)], torch.zeros_like(ids, dtype=torch.int64))
    return known & (staleness > bound.max_behind) & sample.loss_mask.bool()


def within_bound(sample: RolloutSample, bound: StalenessBound) -> RolloutSample | None:
    """``sample`` as the bound keeps it: itself when no trained token is past it, else None (``drop``) or a copy
    whose too-stale tokens have loss mask 0 (``mask``). What the slime adapter's ``finish_session`` calls."""
    stale = too_stale(sample, bound)
    if stale is None or not bool(stale.any()):
        return sample
    if bound.policy == "drop":
        return None
    mask = sample.loss_mask.clone()
    mask[stale] = 0
    return dataclasses.replace(sample, loss_mask=mask)


def keep_within(samples: Sequence[RolloutSample], bound: StalenessBound | None) -> list[RolloutSample]:
    """``within_bound`` over a group: the dropped ones left out, in order."""
    if bound is None:
        return list(samples)
    return [kept for sample in samples if (kept := within_bound(sample, bound)) is not None]


def _integers(values: Sequence[str]) -> list[int] | None:
    """The values as integers when every one is one (``"12"``, not ``"v12"``), else None."""
    out = []
    for value in values:
        text = value.strip()
        if not text or not (text.isdigit() or (text[0] == "-" and text[1:].isdigit())):
            return None
        out.append(int(text))
    return out
