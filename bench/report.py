"""``bench/RESULTS.md``: the table, the machine, the date, the exact shapes and each row's method notes."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from bench.core import RowResult
from bench.workload import Suite

PACKAGES = ("numpy", "orjson", "pybase64", "torch", "safetensors", "httpx", "uvicorn", "uvloop", "httptools", "fastapi")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def machine() -> list[str]:
    return [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; memory {memory_gib()}",
        f"- OS: {platform.platform()}",
        f"- Python {platform.python_version()} ({platform.python_implementation()}); {versions()}",
    ]


def shapes(suite: Suite) -> list[str]:
    return [f"- `{name}`: `{value}`" for name, value in asdict(suite).items() if name != "name"]


def markdown(suite: Suite, results: Sequence[RowResult], table: str, elapsed_s: float) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"`python -m bench{' --quick' if suite.name == 'quick' else ''}` ({suite.name} shapes), "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {elapsed_s:.0f} s. Every ratio is measured side by side in the same "
        "run on the same machine; absolute times on a shared machine are noise, the ratios are the result.",
        "",
        "CPU-bound rows take the best of N runs of `time.process_time`, the sides interleaved; the bench process calls "
        "`gc.freeze()` after its imports, as the gateway does at startup. Servers (the SGLang simulator, gateways), "
        "the load generator, the prober and the memory worker each run in their own process.",
        "",
        table,
        "",
        "## Machine",
        *machine(),
        "",
        "## Shapes",
        *shapes(suite),
        "",
        "## How each row is measured",
    ]
    for result in sorted(results, key=lambda r: r.number):
        lines += ["", f"### {result.number}. {result.name}: {result.verdict}", f"- measured: {result.measured}"]
        lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"
