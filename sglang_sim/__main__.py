"""`python -m sglang_sim --port P ...`: serve one simulated SGLang worker with uvicorn.

By default the vocabulary is synthetic (--vocab-size ids, each one's text " w<id>"). With --tokenizer DIR (a Hugging
Face tokenizer directory, e.g. one made by `python -m sglang_sim.tiny_tokenizer DIR`) it is that tokenizer's:
its size and eos replace --vocab-size and --eos-token-id, answers decode with it, random answers never contain
special tokens but the final eos, and `text` prompts are encoded with it.

Test controls under /sim/ (faults, request log, stats, weight updates, reset). Scripted answers:
POST /sim/script {"rid_prefix": "agent-", "answers": [{"text": "..."}, {"token_ids": [1, 2], "eos": false}]} makes
the next requests whose rid starts with "agent-" answer those tokens in order ("text" needs --tokenizer).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn

from slime_wire.memory import keep_freed_memory

from .app import create_app
from .engine import SimulatorConfig

logger = logging.getLogger("sglang_sim")

# Logged by uvicorn whenever a response is left unfinished, which is exactly what the cut_stream fault does.
_CUT_MESSAGE = "ASGI callable returned without completing response."


class _HideDeliberateCuts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _CUT_MESSAGE


class _Server(uvicorn.Server):
    """Logs the listening line once the socket is bound (so `--port 0` reports the real port)."""

    def __init__(self, config: uvicorn.Config, sim: SimulatorConfig) -> None:
        super().__init__(config)
        self._sim = sim

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets=sockets)
        if not self.started:
            return
        host, port = self.config.host, self.config.port
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
        s = self._sim
        logger.info(
            "simulator listening on http://%s:%s layers=%s topk=%s experts=%s seed=%s",
            host, port, s.num_layers, s.topk, s.num_experts, s.seed,
        )  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sglang_sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0 picks a free port (logged)")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=1000, help="synthetic vocabulary size (without --tokenizer)")
    p.add_argument("--weight-version", default="sim-v0")
    p.add_argument("--latency-ms", type=float, default=0.0, help="per request, before the first token")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="per generated token (pacing, abort)")
    p.add_argument("--stream-chunk-tokens", type=int, default=1, help="tokens per SSE chunk")
    p.add_argument("--default-max-new-tokens", type=int, default=16)
    p.add_argument("--eos-token-id", type=int, default=None, help="default: vocab size - 1 (without --tokenizer)")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="a Hugging Face tokenizer directory (read locally, never downloaded): the vocabulary, eos and token "
        "texts of the answers; enables text answers in POST /sim/script",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="the model's context length: a request whose prompt + max_new_tokens is longer is a 400, as in SGLang",
    )
    p.add_argument(
        "--no-routed-experts",
        action="store_true",
        help="like SGLang without --enable-return-routed-experts: return_routed_experts is silently ignored",
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    return SimulatorConfig(
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        seed=args.seed,
        vocab_size=args.vocab_size,
        weight_version=args.weight_version,
        latency_ms=args.latency_ms,
        token_delay_ms=args.token_delay_ms,
        stream_chunk_tokens=args.stream_chunk_tokens,
        default_max_new_tokens=args.default_max_new_tokens,
        eos_token_id=args.eos_token_id,
        enable_routed_experts=not args.no_routed_experts,
        tokenizer=args.tokenizer,
        context_length=args.context_length,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        sim = config_from_args(args)
        app = create_app(sim)  # loads the tokenizer, if any: a bad one is a configuration error too
    except (ValueError, OSError) as exc:
        sys.exit(f"invalid simulator configuration: {exc}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    keep_freed_memory()  # its answers are tens of MB: built in mapped pages, not faulted in afresh each time
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    server = _Server(config, sim)
    # uvicorn.Config configured uvicorn's loggers just now; the filter must go on after that.
    logging.getLogger("uvicorn.error").addFilter(_HideDeliberateCuts())
    server.run()


if __name__ == "__main__":
    main()
