"""Chaos with real clients, counted (tests/chaos.py says what runs and how it is counted).

``make test`` runs a short run: a replica killed and a Redis master failed over, under SDK rollouts and real Claude
Code / Codex runs, asserting that no acknowledged turn was lost, duplicated or half-written. ``make test-chaos`` runs
the long ones (marker ``chaos``): each fault for CHAOS_SECONDS (180 by default) on one fleet, then prints the table
of faults x (runs completed, turns lost, duplicated, half-written, errors by kind) and writes it to
``$CHAOS_REPORT`` when that is set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos import FAULTS, TABLE_HEAD, ChaosFleet, Tally, chaos_fleet, chaos_seconds, run_chaos
from fleet import haproxy_binary


def needs_harnesses() -> None:
    import test_harnesses

    test_harnesses.harness("claude")
    test_harnesses.harness("codex")


def harnesses_if_any() -> list[str]:
    """["both"] (Claude Code and Codex in turn) when both are installed; else none, saying why (the SDK rollouts run
    either way)."""
    try:
        needs_harnesses()
    except pytest.skip.Exception as why:
        print(f"\nthe short chaos run goes on without real harnesses: {why}")
        return []
    return ["both"]


def assert_nothing_lost(tally: Tally) -> None:
    detail = f"{tally.row()}\n" + "\n".join(tally.notes)
    assert (tally.lost, tally.duplicated, tally.half_written) == (0, 0, 0), detail
    assert tally.rollouts > 0 and tally.turns_acknowledged > 0, detail  # the load really ran


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[ChaosFleet]:
    haproxy_binary()
    with chaos_fleet(tmp_path_factory.mktemp("chaos"), tokenizer_dir) as running:
        yield running


def test_a_short_chaos_run_loses_no_acknowledged_turn(fleet: ChaosFleet, tokenizer: Any) -> None:
    """~40 s: replicas killed (kill -9) behind HAProxy, then Redis masters failed over, under SDK rollouts and one
    harness at a time (Claude Code and Codex in turn; without them when they are not installed, saying so)."""
    harnesses = harnesses_if_any()
    seconds = float(os.environ.get("CHAOS_SHORT_SECONDS", 20))
    for seed, fault in enumerate(("kill", "failover")):
        tally = run_chaos(fleet, fault, seconds, tokenizer, rollout_concurrency=3, harnesses=harnesses, seed=seed)
        print(f"\n{TABLE_HEAD}\n{tally.row()}")
        assert_nothing_lost(tally)
        assert tally.faults >= 1


@pytest.fixture(scope="module")
def table() -> Iterator[list[Tally]]:
    rows: list[Tally] = []
    yield rows
    text = "\n".join([TABLE_HEAD, *(row.row() for row in rows)])
    print(f"\n\nchaos results ({len(rows)} runs):\n{text}\n")
    report = os.environ.get("CHAOS_REPORT")
    if report:
        notes = "\n".join(f"- {row.fault}: {note}" for row in rows for note in row.notes)
        Path(report).write_text(f"{text}\n\n{notes}\n")


@pytest.mark.chaos
@pytest.mark.parametrize("fault", FAULTS)
def test_chaos(fleet: ChaosFleet, tokenizer: Any, table: list[Tally], fault: str) -> None:
    """CHAOS_SECONDS of real load (4 SDK rollouts at a time, two harness threads: Claude Code and Codex) with
    ``fault`` injected again and again."""
    needs_harnesses()
    seconds = chaos_seconds(180)
    tally = run_chaos(fleet, fault, seconds, tokenizer, rollout_concurrency=4, harnesses=["claude", "codex"])
    table.append(tally)
    print(f"\n{TABLE_HEAD}\n{tally.row()}")
    assert_nothing_lost(tally)
