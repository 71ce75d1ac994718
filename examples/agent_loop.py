"""A multi-turn agent loop on the gateway with the slime_client SDK.

    python examples/agent_loop.py --gateway-url http://127.0.0.1:8000

Creates a session with the MoE routing shape (defaults: the simulator's 4 layers x top-2), lets the model take
a turn, appends a (fake) tool result as non-trainable tokens, lets the model continue, then fetches the
training sample as torch tensors and prints its shapes. Exits 1 with the gateway's error if anything fails.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from slime_client import GatewayClient, GatewayError, RolloutSample, Session, TurnDelta, TurnResult

PROMPT_IDS = [1, 15, 27, 39, 42, 58, 63, 77, 81, 99]
# A pretend tool: it "answers" with a fixed header and echoes a few ids of the model's call.
TOOL_HEADER_IDS = [900, 901, 902]
TOOL_ECHO_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    parser.add_argument("--turns", type=int, default=3, help="model turns (a tool result between each)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--num-layers", type=int, default=4, help="the model's num_hidden_layers (routing replay)")
    parser.add_argument("--topk", type=int, default=2, help="the model's num_experts_per_tok (routing replay)")
    parser.add_argument("--no-replay", action="store_true", help="no routing / top-p replay (dense model)")
    parser.add_argument("--seed", type=int, default=7, help="sampling_seed of the first turn (+1 per turn)")
    parser.add_argument("--session-id", help="choose the session id (default: the gateway picks one)")
    parser.add_argument("--keep-session", action="store_true", help="leave the session on the gateway (for curl)")
    return parser.parse_args(argv)


def fake_tool_output(model_turn: TurnResult) -> list[int]:
    return TOOL_HEADER_IDS + model_turn.new_token_ids[:TOOL_ECHO_TOKENS]


def describe_turn(index: int, turn: TurnResult) -> str:
    routing = (
        f", routing rows {turn.routed_experts_rows} (asked from row {turn.routed_experts_start_len})"
        if turn.routed_experts_start_len is not None
        else ""
    )
    return (
        f"[agent] turn {index}: model +{turn.completion_tokens} tokens, finish={turn.finish_type}, "
        f"session {turn.total_tokens} tokens, cached {turn.cached_tokens}{routing}"
    )


def describe_sample(sample: RolloutSample) -> list[str]:
    lines = [
        f"[agent] sample {sample.session_id}: status={sample.status}, {sample.turns} turns, "
        f"prompt {sample.prompt_length} + response {sample.response_length} tokens",
        f"[agent]   tokens            {tuple(sample.tokens.shape)} {sample.tokens.dtype}",
        f"[agent]   loss_mask         {tuple(sample.loss_mask.shape)} {sample.loss_mask.dtype} "
        f"(trainable {int(sample.loss_mask.sum())})",
        f"[agent]   rollout_log_probs {tuple(sample.rollout_log_probs.shape)} {sample.rollout_log_probs.dtype}",
    ]
    if sample.rollout_routed_experts is not None:
        routed = sample.rollout_routed_experts
        lines.append(f"[agent]   routed_experts    {tuple(routed.shape)} {routed.dtype}")
    lines.append(f"[agent]   weight_versions   {sample.weight_versions}")
    return lines


async def run(args: argparse.Namespace) -> None:
    async with GatewayClient(args.gateway_url) as gw:
        health = await gw.health()
        print(f"[agent] gateway {args.gateway_url} is up (version {health.get('version')})")
        moe = {} if args.no_replay else {"num_layers": args.num_layers, "moe_router_topk": args.topk}
        session = await gw.create_session(
            prompt_ids=PROMPT_IDS, session_id=args.session_id, metadata={"example": "agent_loop"}, **moe
        )
        print(f"[agent] session {session.session_id}: prompt of {len(PROMPT_IDS)} tokens, replay {moe or 'off'}")
        sampling: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0}
        if not args.no_replay:
            sampling["custom_params"] = {"return_top_p_token_ids": True}  # top-p replay, the slime way
        try:
            for index in range(args.turns):
                last = index == args.turns - 1
                params = sampling | {"sampling_seed": args.seed + index}
                turn = await (streamed_turn(session, params) if last else session.generate(params))
                print(describe_turn(index, turn))
                if not last:
                    tool_ids = fake_tool_output(turn)
                    summary = await session.append(tool_ids, text=" <tool result>")
                    print(f"[agent] tool: +{len(tool_ids)} tokens (not trainable), session {summary.total_tokens}")
            sample = await session.fetch()
            sample.check_invariants()
            print("\n".join(describe_sample(sample)))
        finally:
            if not args.keep_session:
                await session.delete()
        print("[agent] done" + (" (session kept)" if args.keep_session else " (session deleted)"))


async def streamed_turn(session: Session, sampling: dict[str, Any]) -> TurnResult:
    """The last turn streamed: deltas print as they arrive, the folded turn comes at the end."""
    print("[agent] streaming: ", end="", flush=True)
    async with session.generate(sampling, stream=True) as stream:
        async for event in stream:
            if isinstance(event, TurnDelta):
                print(event.text, end="", flush=True)
    print()
    assert stream.result is not None
    return stream.result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except GatewayError as exc:
        print(f"[agent] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
