"""``python -m bench --quick`` (the benchmark suite on small shapes) runs every row and prints a number for each.

No timed assertions: whether a goal passes depends on the machine; ``make bench`` is where the numbers count.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench.core import TABLE_HEADER
from bench.rows import ROWS

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK_TIMEOUT_S = 300
NUMBER = re.compile(r"\d+(\.\d+)?")


def table_rows(stdout: str) -> dict[int, dict[str, str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == len(TABLE_HEADER) and cells[0].isdigit():
            rows[int(cells[0])] = dict(zip(TABLE_HEADER, cells, strict=True))
    return rows


def test_quick_bench_prints_a_number_for_every_row() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = table_rows(done.stdout)
    assert sorted(rows) == [row.number for row in ROWS], done.stdout
    for number, row in rows.items():
        assert NUMBER.search(row["measured"]), f"row {number} measured nothing: {row}"
        assert NUMBER.search(row["ratio"]) and "n/a" not in row["ratio"], f"row {number} has no ratio: {row}"
        assert row["result"] in ("PASS", "MISS"), row
    assert "[bench" in done.stderr  # progress lines go to stderr, the table alone to stdout
