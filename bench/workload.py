"""The shapes every row runs on (full and ``--quick``) and the SGLang answers they are measured on.

Answers come from the gateway's SGLang simulator (``sglang_sim``), byte for byte what its ``/generate``
sends: the same keys and encodings as SGLang 0.5 (docs/protocol.md sections 1-2), top-p kept sets of 1-20 ids, routing
as base64 of int32 ``[prompt + response - 1, L, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from sglang_sim.engine import Engine, GenItem, SimulatorConfig

QWEN3_VOCAB = 151_936
TOP_P_FLAG = {"custom_params": {"return_top_p_token_ids": True}}


@dataclass(frozen=True, slots=True)
class MoE:
    layers: int = 48
    topk: int = 8
    experts: int = 128

    def describe(self) -> str:
        return f"{self.layers}-layer top-{self.topk} MoE, {self.experts} experts"


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """One non-streamed model answer with routing replay (and top-p replay)."""

    prompt_tokens: int
    response_tokens: int
    moe: MoE = field(default_factory=MoE)
    top_p: bool = True
    vocab: int = QWEN3_VOCAB

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def describe(self) -> str:
        replay = "routing + top-p replay" if self.top_p else "routing replay"
        tokens = f"{self.prompt_tokens}-token prompt + {self.response_tokens}-token response"
        return f"{tokens}, {self.moe.describe()}, {replay}"


@dataclass(frozen=True, slots=True)
class MultiTurnShape:
    prompt_tokens: int
    turns: int
    turn_tokens: int  # generated per model turn (ignore_eos: exact)
    tool_tokens: int  # appended between model turns

    def describe(self, moe: MoE) -> str:
        total = self.prompt_tokens + self.turns * self.turn_tokens + (self.turns - 1) * self.tool_tokens
        return (
            f"{self.turns} model turns of {self.turn_tokens} tokens, {self.tool_tokens}-token tool turns between, "
            f"{self.prompt_tokens}-token prompt ({total} tokens in the end), {moe.describe()}"
        )


@dataclass(frozen=True, slots=True)
class PassthroughShape:
    prompt_tokens: int = 16
    max_new_tokens: int = 8
    rounds: int = 5  # interleaved direct / gateway rounds
    requests_c1: int = 1_500
    requests_c32: int = 4_000
    warmup: int = 200


@dataclass(frozen=True, slots=True)
class EventLoopShape:
    answer: AnswerShape
    concurrent_turns: int = 8
    waves: int = 6  # bursts of concurrent_turns, one after the other: enough probes for a p99
    probe_interval_s: float = 0.005


@dataclass(frozen=True, slots=True)
class MemoryShape:
    sessions: int
    prompt_tokens: int
    response_tokens: int
    moe: MoE = field(default_factory=MoE)
    distinct_answers: int = 4  # answers are decoded afresh for every session; only their bytes are reused

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True, slots=True)
class StreamShape:
    lengths: tuple[int, ...] = (1_024, 4_096, 16_384)
    chunk_tokens: int = 8
    repeat: int = 3


@dataclass(frozen=True, slots=True)
class StreamTurnShape:
    """Row 9: one big MoE turn, streamed with a cumulative chunk every ``chunk_tokens`` tokens, vs unary."""

    prompt_tokens: int = 2_048
    response_tokens: int = 8_192
    chunk_tokens: int = 64
    rounds: int = 8


@dataclass(frozen=True, slots=True)
class ReceiveShape:
    """Row 10: body sizes received from a canned server, and how many samples of each side."""

    sizes: tuple[int, ...] = (4 << 20, 20 << 20)
    rounds: int = 5


@dataclass(frozen=True, slots=True)
class DropinShape:
    """Row 11: one multi-turn sample through the slime drop-in, turn by turn."""

    prompt_tokens: int = 2_048
    turns: int = 20
    turn_tokens: int = 256
    rounds: int = 3


@dataclass(frozen=True, slots=True)
class GroupShape:
    """Row 12: a training step's group of big samples, fetched in one call."""

    samples: int = 64
    steps: int = 3  # fetches after the first (steady state)


@dataclass(frozen=True, slots=True)
class ChatTurnShape:
    """Row 13: the second turn of a chat session (OpenAI Chat Completions) vs that of a token-level session: a
    ~``prompt_tokens`` first prompt, a first answer, then a ~``followup_tokens`` user message and the timed answer,
    each answer ``response_tokens`` long."""

    prompt_tokens: int = 2_048
    response_tokens: int = 8_192
    followup_tokens: int = 200
    rounds: int = 32


@dataclass(frozen=True, slots=True)
class RedisTurnShape:
    """Row 14: the big MoE turn on the Redis store vs the in-memory one: a session on a ``prompt_tokens`` prompt, a
    first model turn of ``response_tokens``, then ``tool_tokens`` appended and a second model turn of
    ``second_response_tokens`` (what it writes is the new bytes only, not the session's)."""

    prompt_tokens: int = 2_048
    response_tokens: int = 8_192
    tool_tokens: int = 256
    second_response_tokens: int = 1_024
    rounds: int = 12


@dataclass(frozen=True, slots=True)
class AgentLoopShape:
    """Row 18: one agent session, ``turns`` chat completions of a tool loop (each answer a tool call, each result
    ``tool_result_bytes`` of text, the whole history sent every turn), the gateway's CPU per turn early and late."""

    turns: int = 128
    tool_result_bytes: int = 1_024
    window: int = 9  # turns averaged at each end: 2-10 and 120-128


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """Row 15: ``sessions`` concurrent agent loops (create, generate, append, generate, fetch the sample, delete),
    ``loops`` each per measurement, against one gateway replica or two sharing one Redis."""

    sessions: int = 16
    loops: int = 3
    prompt_tokens: int = 2_048
    turn_tokens: int = 1_024
    tool_tokens: int = 128
    rounds: int = 5


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """Row 17: ``agents`` concurrent agent loops, each running ``sessions`` short sessions one after another (a
    ``prompt_tokens`` prompt, ``turns`` model turns of ``turn_tokens`` with ``tool_tokens`` appended between them),
    against 1 gateway on one Redis and 1, 2 and 4 on a Redis Cluster."""

    agents: int = 16
    sessions: int = 12  # per agent and measurement, one after another
    turns: int = 3
    prompt_tokens: int = 256
    turn_tokens: int = 32
    tool_tokens: int = 16
    rounds: int = 5


@dataclass(frozen=True, slots=True)
class AgentFinishShape:
    """Row 19: a Claude-Code-shaped session of ``main_turns`` + ``sub_turns`` turns (a main conversation and a
    subagent's), ``sessions`` of them, each finished once (``finish_session`` consumes it); and ``rollouts`` whole
    rollouts of ``rollout_turns`` model turns through ``generate``."""

    main_turns: int = 56
    sub_turns: int = 8
    system_bytes: int = 30_000
    tool_result_bytes: int = 2_300
    sessions: int = 5
    raw_repeat: int = 3
    rollout_turns: int = 16
    rollouts: int = 2


@dataclass(frozen=True, slots=True)
class ResumeTurnShape:
    """Row 20: one big MoE turn that the engine aborts half-way and the gateway resumes, against the same turn
    uninterrupted; unary and streamed."""

    prompt_tokens: int = 2_048
    response_tokens: int = 8_192
    rounds: int = 6


@dataclass(frozen=True, slots=True)
class Suite:
    """Every size the rows use. ``FULL`` is the realistic shape; ``QUICK`` keeps the smoke test fast."""

    name: str
    answer: AnswerShape
    decode_repeat: int
    materialize_repeat: int
    multiturn: MultiTurnShape
    passthrough: PassthroughShape
    event_loop: EventLoopShape
    memory: MemoryShape
    stream: StreamShape
    stream_turn: StreamTurnShape
    receive: ReceiveShape
    dropin: DropinShape
    group: GroupShape
    chat_turn: ChatTurnShape
    redis_turn: RedisTurnShape
    replicas: ReplicaShape
    agent_loop: AgentLoopShape = AgentLoopShape()
    cluster: ClusterShape = ClusterShape()
    agent_finish: AgentFinishShape = AgentFinishShape()
    resume_turn: ResumeTurnShape = ResumeTurnShape()

    @property
    def moe(self) -> MoE:
        return self.answer.moe


FULL = Suite(
    name="full",
    answer=AnswerShape(prompt_tokens=2_000, response_tokens=8_000),
    decode_repeat=30,
    materialize_repeat=5,
    multiturn=MultiTurnShape(prompt_tokens=2_000, turns=8, turn_tokens=1_000, tool_tokens=200),
    passthrough=PassthroughShape(),
    event_loop=EventLoopShape(AnswerShape(prompt_tokens=2_000, response_tokens=8_000)),
    memory=MemoryShape(sessions=1_000, prompt_tokens=1_024, response_tokens=3_072),
    stream=StreamShape(),
    stream_turn=StreamTurnShape(),
    receive=ReceiveShape(),
    dropin=DropinShape(),
    group=GroupShape(),
    chat_turn=ChatTurnShape(),
    redis_turn=RedisTurnShape(),
    replicas=ReplicaShape(),
)

QUICK = Suite(
    name="quick",
    answer=AnswerShape(prompt_tokens=256, response_tokens=1_024),
    decode_repeat=3,
    materialize_repeat=2,
    multiturn=MultiTurnShape(prompt_tokens=128, turns=3, turn_tokens=64, tool_tokens=16),
    passthrough=PassthroughShape(rounds=1, requests_c1=100, requests_c32=320, warmup=20),
    event_loop=EventLoopShape(AnswerShape(prompt_tokens=128, response_tokens=512), concurrent_turns=2, waves=1),
    memory=MemoryShape(sessions=20, prompt_tokens=256, response_tokens=768),
    stream=StreamShape(lengths=(256, 1_024), repeat=1),
    stream_turn=StreamTurnShape(prompt_tokens=256, response_tokens=1_024, rounds=2),
    receive=ReceiveShape(sizes=(1 << 20,), rounds=2),
    dropin=DropinShape(prompt_tokens=128, turns=4, turn_tokens=32, rounds=1),
    group=GroupShape(samples=4, steps=2),
    chat_turn=ChatTurnShape(prompt_tokens=256, response_tokens=1_024, followup_tokens=32, rounds=2),
    redis_turn=RedisTurnShape(
        prompt_tokens=256, response_tokens=1_024, tool_tokens=32, second_response_tokens=128, rounds=2
    ),
    replicas=ReplicaShape(sessions=4, loops=1, prompt_tokens=128, turn_tokens=128, tool_tokens=16, rounds=1),
    agent_loop=AgentLoopShape(turns=24, tool_result_bytes=512, window=4),
    cluster=ClusterShape(agents=4, sessions=1, turns=2, rounds=1),
    agent_finish=AgentFinishShape(
        main_turns=6, sub_turns=2, system_bytes=4_000, tool_result_bytes=500, sessions=1, raw_repeat=1, rollout_turns=3
    ),
    resume_turn=ResumeTurnShape(prompt_tokens=256, response_tokens=1_024, rounds=2),
)


# ---- answers -----------------------------------------------------------------------------------------------------
def simulator_config(moe: MoE, vocab: int = QWEN3_VOCAB, seed: int = 0) -> SimulatorConfig:
    return SimulatorConfig(num_layers=moe.layers, topk=moe.topk, num_experts=moe.experts, vocab_size=vocab, seed=seed)


def simulator_args(moe: MoE, vocab: int = QWEN3_VOCAB, seed: int = 0) -> list[str]:
    """The same configuration as ``python -m sglang_sim`` flags."""
    return [
        *("--num-layers", str(moe.layers), "--topk", str(moe.topk), "--num-experts", str(moe.experts)),
        *("--vocab-size", str(vocab), "--seed", str(seed)),
    ]


def prompt_ids(length: int, vocab: int = QWEN3_VOCAB, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab - 1, length).tolist()


def generate_request(prompt: list[int], max_new_tokens: int, *, routing: bool, top_p: bool) -> dict[str, Any]:
    """A ``/generate`` body the way the gateway (and slime) ask for a trainable turn; fixed-length answers."""
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    if top_p:
        sampling |= TOP_P_FLAG
    body: dict[str, Any] = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
    if routing:
        body["return_routed_experts"] = True
    return body


@dataclass(frozen=True, slots=True)
class Answer:
    prompt: list[int]
    raw: bytes  # the /generate answer as the simulator sends it

    def routing_b64(self) -> bytes:
        """The routed_experts base64 value, as bytes (what a bare decode pass reads)."""
        meta = orjson.loads(self.raw)["meta_info"]
        return meta["routed_experts"].encode()


def build_answer(shape: AnswerShape, seed: int = 0, prompt_seed: int = 1) -> Answer:
    """The simulator's final non-streamed answer for ``shape`` (built in-process, same bytes as over HTTP)."""
    prompt = prompt_ids(shape.prompt_tokens, shape.vocab, prompt_seed)
    engine = Engine(simulator_config(shape.moe, shape.vocab, seed))
    item = GenItem(
        rid=f"bench-{prompt_seed}",
        input_ids=np.asarray(prompt, dtype=np.int64),
        max_new_tokens=shape.response_tokens,
        ignore_eos=True,
        return_logprob=True,
        return_routed_experts=True,
        return_top_p=shape.top_p,
    )
    generation = engine.start(item)
    answer = generation.final(generation.n, generation.plan.finish, e2e_latency=1.0)
    return Answer(prompt, orjson.dumps(answer))
