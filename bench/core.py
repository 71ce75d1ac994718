"""What every row shares: its result type, the clocks and timing loops, progress lines and the table."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from bench.services import Services
    from bench.workload import Suite


def log(message: str) -> None:
    """A progress line (stderr, so the table on stdout stays clean)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Check:
    """One goal of a row: a measured number compared with its bound (``None``: a number reported without a goal,
    which passes once it is measured)."""

    label: str  # what the number is, e.g. "vs reference"
    value: float
    bound: float | None
    higher_is_better: bool
    unit: str = "x"  # "x" for ratios; "ms", "us" for absolute values

    @property
    def passed(self) -> bool:
        if not math.isfinite(self.value):
            return False
        if self.bound is None:
            return True
        return self.value >= self.bound if self.higher_is_better else self.value <= self.bound

    def render(self) -> str:
        return f"{self.label} {format_value(self.value, self.unit)}"

    def render_goal(self) -> str:
        if self.bound is None:
            return f"{self.label}: reported, no goal"
        return f"{self.label} {'>=' if self.higher_is_better else '<='} {format_value(self.bound, self.unit)}"


def format_value(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "n/a"
    if unit == "x":
        return f"{value:.3g}x" if value < 1 else f"{value:.2f}x" if value < 10 else f"{value:.1f}x"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"


@dataclass(slots=True)
class RowResult:
    """One line of the table, plus the notes RESULTS.md prints under it (method, shapes, raw numbers)."""

    number: int
    name: str
    measured: str  # the measured values, human-readable
    checks: list[Check]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def goal(self) -> str:
        return "; ".join(check.render_goal() for check in self.checks)

    @property
    def ratio(self) -> str:
        return "; ".join(check.render() for check in self.checks)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "MISS"


@dataclass(slots=True)
class Context:
    """What a row gets: the suite of shapes (full or quick) and the shared server processes."""

    suite: Suite
    services: Services


RowFn = Callable[[Context], RowResult]


# ---- clocks and loops ------------------------------------------------------------------------------------------
T = TypeVar("T")


def rotation(names: Sequence[T], round_number: int) -> list[T]:
    """The order of round ``round_number`` when the order rotates every round (A B C, B C A, C A B, ...): each
    runs first, second, ..., last in turn."""
    shift = round_number % len(names)
    return [*names[shift:], *names[:shift]]


def interleaved_best(
    runs: dict[str, Callable[[], object]], repeat: int, clock: Callable[[], float] = time.process_time
) -> dict[str, float]:
    """Best-of-``repeat`` seconds of each callable, run in turns so that a noisy neighbour hurts all of them alike;
    the order rotates every round (A B C, B C A, C A B, ...) so that none always runs in the cache state the same
    other one leaves behind. No ``gc.collect()`` in between: it returns freed memory to the OS, and the page faults
    of taking it back would then be timed, which no steady-state process pays on every call."""
    best = dict.fromkeys(runs, math.inf)
    names = list(runs)
    for round_number in range(repeat):
        for name in rotation(names, round_number):
            start = clock()
            runs[name]()
            best[name] = min(best[name], clock() - start)
    return best


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an unsorted sequence."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


# ---- the table -------------------------------------------------------------------------------------------------
TABLE_HEADER = ("#", "row", "goal", "measured", "ratio", "result")


def render_table(results: Sequence[RowResult]) -> str:
    """A Markdown table (readable in a terminal and in RESULTS.md)."""
    rows = [TABLE_HEADER] + [
        (str(r.number), r.name, r.goal, r.measured, r.ratio, r.verdict) for r in sorted(results, key=lambda r: r.number)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |" for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)
