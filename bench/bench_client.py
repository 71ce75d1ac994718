"""Trainer-side cost of one MoE sample: slime's own path vs the SDK's, on the same answer, in one process.

    python bench/bench_client.py [--prompt-tokens 2000 --response-tokens 8000 --layers 48 --topk 8 --experts 128]

- reference (what slime's rollout process does with SGLang's answer): stdlib ``json.loads`` of the raw
  ``/generate`` JSON, token ids / log-probs / loss mask as Python lists, ``pybase64`` + ``torch.frombuffer`` for
  the routed experts and top-p arrays.
- SDK: ``RolloutSample.from_safetensors`` on the gateway's compact bytes for the same sample (tensors and
  metadata; no per-token Python objects). ``to_slime`` (building slime's Python lists) is timed separately.

The compact bytes are produced in-process by the gateway's own code (codec -> fold -> views), from the same
raw answer. CPU time (``time.process_time``), best of N runs; ratios are what matter (shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pybase64
import torch

from gateway.codec import decode_generate_response
from gateway.sample import MoEShape, SessionSample
from gateway.store import Session
from gateway.views import sample_payload
from slime_client.sample import RolloutSample


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int = 2_000
    response_tokens: int = 8_000
    layers: int = 48
    topk: int = 8
    experts: int = 128
    vocab: int = 150_000
    top_p: bool = True

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


def b64_int32(array: np.ndarray) -> str:
    return pybase64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode()


def build_sglang_answer(shape: Shape, seed: int = 0) -> tuple[list[int], bytes]:
    """(prompt ids, the raw SGLang /generate JSON answer) for one final non-streamed MoE turn."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, shape.vocab, shape.prompt_tokens).tolist()
    n = shape.response_tokens
    output_ids = rng.integers(0, shape.vocab, n)
    log_probs = -rng.exponential(1.0, n)  # float64, as SGLang's JSON carries them
    rows = shape.total_tokens - 1
    routed = rng.integers(0, shape.experts, (rows, shape.layers, shape.topk))
    meta: dict[str, Any] = {
        "id": "bench",
        "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": shape.prompt_tokens,
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": "bench-v1",
        "output_token_logprobs": [[float(lp), int(t), None] for lp, t in zip(log_probs, output_ids, strict=True)],
        "routed_experts": b64_int32(routed),
    }
    if shape.top_p:
        sizes = np.minimum(rng.geometric(0.4, n), 80)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        meta["top_p_token_ids"] = b64_int32(rng.integers(0, shape.vocab, int(offsets[-1])))
        meta["top_p_token_offsets"] = b64_int32(offsets)
    answer = {"text": "x" * (4 * n), "output_ids": output_ids.tolist(), "meta_info": meta}
    return prompt, orjson.dumps(answer)


def build_gateway_bytes(prompt: list[int], raw: bytes, shape: Shape) -> bytes:
    """The gateway's compact sample for the same answer: decode -> fold -> safetensors, with its own code."""
    turn = decode_generate_response(raw, want_routing=True, want_top_p=shape.top_p)
    sample = SessionSample.from_prompt(prompt, MoEShape(shape.layers, shape.topk))
    sample.fold_model_turn(turn)
    return sample_payload(Session(session_id="bench", sample=sample)).encode()


def decode_b64_tensor(value: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(pybase64.b64decode(value)), dtype=torch.int32)


def reference_materialize(prompt: list[int], raw: bytes, shape: Shape) -> dict[str, Any]:
    """slime's trainer-side path for one answer (sglang_rollout.generate + Sample.append_response_tokens)."""
    output = json.loads(raw)
    meta = output["meta_info"]
    items = meta["output_token_logprobs"]
    new_tokens = [item[1] for item in items]
    log_probs = [item[0] for item in items]
    sample = {
        "tokens": prompt + new_tokens,
        "response": output["text"],
        "response_length": len(new_tokens),
        "loss_mask": [1] * len(new_tokens),
        "rollout_log_probs": log_probs,
        "rollout_routed_experts": decode_b64_tensor(meta["routed_experts"]).reshape(-1, shape.layers, shape.topk),
    }
    if "top_p_token_ids" in meta:
        sample["rollout_top_p_token_ids"] = decode_b64_tensor(meta["top_p_token_ids"])
        sample["rollout_top_p_token_offsets"] = decode_b64_tensor(meta["top_p_token_offsets"])
    return sample


def sdk_materialize(body: bytes) -> RolloutSample:
    return RolloutSample.from_safetensors(body)


def sdk_to_slime(body: bytes) -> Any:
    return RolloutSample.from_safetensors(body).to_slime(SimpleNamespace())


def best_cpu_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def check_same_sample(reference: dict[str, Any], sdk: RolloutSample) -> None:
    """Both paths must produce the same sample, or the timing comparison means nothing."""
    assert sdk.tokens.tolist() == reference["tokens"]
    assert sdk.response == reference["response"]
    assert torch.equal(sdk.rollout_log_probs, torch.tensor(reference["rollout_log_probs"], dtype=torch.float32))
    assert torch.equal(sdk.routed_experts_int32(), reference["rollout_routed_experts"])
    if "rollout_top_p_token_ids" in reference:
        assert torch.equal(sdk.rollout_top_p_token_offsets, reference["rollout_top_p_token_offsets"])


def run(shape: Shape, repeat: int = 7) -> dict[str, float]:
    prompt, raw = build_sglang_answer(shape)
    body = build_gateway_bytes(prompt, raw, shape)
    check_same_sample(reference_materialize(prompt, raw, shape), sdk_materialize(body))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_s = best_cpu_seconds(lambda: reference_materialize(prompt, raw, shape), repeat)
        sdk_s = best_cpu_seconds(lambda: sdk_materialize(body), repeat)
        to_slime_s = best_cpu_seconds(lambda: sdk_to_slime(body), repeat)
    return {
        "raw_json_bytes": len(raw),
        "safetensors_bytes": len(body),
        "reference_cpu_s": reference_s,
        "sdk_materialize_cpu_s": sdk_s,
        "sdk_to_slime_cpu_s": to_slime_s,
        "materialize_ratio": sdk_s / reference_s,
        "to_slime_ratio": to_slime_s / reference_s,
    }


def report(shape: Shape, results: dict[str, float]) -> str:
    return "\n".join(
        [
            f"sample: {shape.prompt_tokens} prompt + {shape.response_tokens} response tokens, "
            f"{shape.layers} layers x top-{shape.topk} of {shape.experts} experts, top-p replay {shape.top_p}",
            f"bytes to the trainer: raw SGLang JSON {results['raw_json_bytes'] / 2**20:8.2f} MiB  "
            f"gateway safetensors {results['safetensors_bytes'] / 2**20:8.2f} MiB  "
            f"({results['safetensors_bytes'] / results['raw_json_bytes']:.3f}x)",
            f"reference (json.loads + pybase64 + frombuffer + lists): {results['reference_cpu_s'] * 1e3:9.2f} ms CPU",
            f"SDK materialize (safetensors -> tensors):               {results['sdk_materialize_cpu_s'] * 1e3:9.2f} ms "
            f"CPU  ratio {results['materialize_ratio']:.4f}x  ({1 / results['materialize_ratio']:.0f}x faster)",
            f"SDK materialize + to_slime (slime's Python lists):      {results['sdk_to_slime_cpu_s'] * 1e3:9.2f} ms "
            f"CPU  ratio {results['to_slime_ratio']:.4f}x",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Shape()
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--response-tokens", type=int, default=defaults.response_tokens)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--topk", type=int, default=defaults.topk)
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--no-top-p", action="store_true")
    parser.add_argument("--repeat", type=int, default=7, help="best of N")
    args = parser.parse_args(argv)
    shape = Shape(
        prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens,
        layers=args.layers,
        topk=args.topk,
        experts=args.experts,
        top_p=not args.no_top_p,
    )
    print(report(shape, run(shape, repeat=args.repeat)))


if __name__ == "__main__":
    main()
