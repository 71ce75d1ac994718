"""Row 2: bytes the trainer receives per sample: the gateway's compact safetensors vs SGLang's raw JSON."""

from __future__ import annotations

from bench.core import Check, Context, RowResult, log
from bench.workload import build_answer
from gateway.codec import decode_generate_response
from gateway.sample import MoEShape, SessionSample
from gateway.store import Session
from gateway.views import sample_payload

NAME = "bytes to the trainer"


def run(ctx: Context) -> RowResult:
    shape = ctx.suite.answer
    log(f"row 2: building the answer ({shape.describe()})")
    answer = build_answer(shape)
    sample = SessionSample.from_prompt(answer.prompt, MoEShape(shape.moe.layers, shape.moe.topk))
    sample.fold_model_turn(decode_generate_response(answer.raw, want_routing=True, want_top_p=shape.top_p))
    compact = sample_payload(Session.of("bench-bytes", sample)).encode()
    raw, small = len(answer.raw), len(compact)
    per_token = small / shape.total_tokens
    return RowResult(
        number=2,
        name=NAME,
        measured=f"raw JSON {raw / 2**20:.2f} MiB, safetensors {small / 2**20:.2f} MiB ({per_token:.0f} B/token)",
        checks=[Check("smaller", raw / small, 4.5, higher_is_better=True)],
        notes=[
            f"sample: {shape.describe()}",
            "raw: the simulator's /generate answer for the sample (the bytes slime's rollout process receives); "
            "compact: gateway.views.sample_payload(session).encode() after decode + fold of that answer (the body of "
            "GET /v1/sessions/{id}/sample): int32 tokens, uint8 loss mask, float32 log-probs, int32 top-p spans, "
            "uint8 routing [rows, L, K], metadata incl. the response text",
        ],
    )
