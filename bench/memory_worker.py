"""Row 7's measurement, run in a fresh process: ``python -m bench.memory_worker --sessions N ...`` prints JSON.

Builds ``N`` sessions in-process the way the gateway does (decode the raw answer, fold it into a fresh
``SessionSample``, keep it in a ``SessionStore``), one answer at a time, and reports the growth of the resident
set (``/proc/self/statm``) per stored token next to the compact payload's bytes per token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys

import orjson

from bench.workload import AnswerShape, MoE, build_answer
from gateway.codec import decode_generate_response
from gateway.sample import MoEShape, SessionSample
from gateway.store import SessionStore
from gateway.views import sample_payload

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_worker", description=__doc__)
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--response-tokens", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--topk", type=int, required=True)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--distinct-answers", type=int, default=4)
    args = parser.parse_args(argv)
    shape = AnswerShape(args.prompt_tokens, args.response_tokens, MoE(args.layers, args.topk, args.experts))
    moe = MoEShape(args.layers, args.topk)
    answers = [build_answer(shape, seed=i, prompt_seed=100 + i) for i in range(args.distinct_answers)]

    def new_sample(i: int) -> SessionSample:
        answer = answers[i % len(answers)]
        sample = SessionSample.from_prompt(answer.prompt, moe)
        sample.fold_model_turn(decode_generate_response(answer.raw, want_routing=True, want_top_p=shape.top_p))
        return sample

    store = SessionStore(max_sessions=args.sessions + 1)
    run = asyncio.new_event_loop().run_until_complete  # the store's API is async (the in-memory one never waits)
    warm = run(store.create(new_sample(0), session_id="warm-up"))  # first-use costs (imports, arenas) not counted
    payload_bytes = len(sample_payload(warm).encode())
    run(store.delete("warm-up"))
    del warm
    gc.collect()
    before = resident_bytes()
    for i in range(args.sessions):
        run(store.create(new_sample(i), session_id=f"s{i}"))
        if (i + 1) % max(1, args.sessions // 5) == 0:
            print(f"memory worker: {i + 1}/{args.sessions} sessions", file=sys.stderr, flush=True)
    gc.collect()
    after = resident_bytes()
    tokens = args.sessions * shape.total_tokens
    result = {
        "sessions": args.sessions,
        "tokens_per_session": shape.total_tokens,
        "rss_growth_bytes": after - before,
        "rss_bytes_per_token": (after - before) / tokens,
        "stored_bytes_per_token": store.stored_bytes / tokens,
        "payload_bytes_per_token": payload_bytes / shape.total_tokens,
        "peak_rss_bytes": peak_resident_bytes(),
        "raw_answer_bytes": len(answers[0].raw),
    }
    sys.stdout.buffer.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
