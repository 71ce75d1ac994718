"""``python -m bench [--quick] [--rows 1,5] [--out bench/RESULTS.md]``: run the rows, print the table, write it."""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

from bench import report
from bench.core import Context, RowResult, log, render_table
from bench.rows import ROWS, Row
from bench.services import Services
from bench.workload import FULL, QUICK

DEFAULT_OUT = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds per row (smoke test)")
    parser.add_argument("--rows", help="comma-separated row numbers to run (default: all)")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write the results (default: bench/RESULTS.md for a full run, none for --quick)",
    )
    return parser.parse_args(argv)


def select(rows_arg: str | None) -> list[Row]:
    if not rows_arg:
        return list(ROWS)
    wanted = {int(part) for part in rows_arg.split(",") if part.strip()}
    unknown = wanted - {row.number for row in ROWS}
    if unknown:
        sys.exit(f"unknown rows: {sorted(unknown)}")
    return [row for row in ROWS if row.number in wanted]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suite = QUICK if args.quick else FULL
    rows = select(args.rows)
    ctx = Context(suite=suite, services=Services(suite.moe, suite.stream_turn.chunk_tokens))
    # As the gateway does at startup (gateway/app.py): the objects alive now (torch, numpy, the modules) stay out of
    # the collector's way, so a full collection triggered by a decode costs both sides microseconds, not ~25 ms.
    gc.freeze()
    results: list[RowResult] = []
    failed: list[int] = []
    started = time.perf_counter()
    try:
        for row in rows:
            log(f"row {row.number}: {row.name}")
            try:
                result = row.run(ctx)
            except Exception:  # one broken row must not hide the others' numbers
                traceback.print_exc()
                failed.append(row.number)
                continue
            log(f"row {row.number}: {result.ratio} -> {result.verdict}")
            results.append(result)
    finally:
        ctx.services.stop()
    elapsed = time.perf_counter() - started
    table = render_table(results)
    print(table)
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    if out is not None:
        out.write_text(report.markdown(suite, results, table, elapsed))
        log(f"wrote {out}")
    if failed:
        log(f"rows that raised: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
