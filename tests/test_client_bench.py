"""bench/bench_client.py stays runnable: both paths agree on a small sample and the report prints."""

from __future__ import annotations

from bench.bench_client import Shape, report, run


def test_bench_runs_on_a_small_sample() -> None:
    shape = Shape(prompt_tokens=30, response_tokens=50, layers=4, topk=2, experts=8, vocab=1000)
    results = run(shape, repeat=1)  # run() asserts that both paths produce the same sample first
    assert results["safetensors_bytes"] < results["raw_json_bytes"]
    assert results["materialize_ratio"] > 0
    assert "SDK materialize" in report(shape, results)
