"""The simulated model: pure, deterministic, no I/O (beyond reading a tokenizer once, at start).

Everything a `/generate` answer contains is a function of the simulator seed, the request's input ids and its
`sampling_seed`, so tests can predict and compare answers:

- the generated tokens, their log-probs, the length and the finish reason come from a numpy Generator seeded
  from `(seed, crc32(input id bytes), sampling_seed)`;
- the routing of a position depends only on `(seed, position, token id at that position)`, so a later turn
  that re-sends an earlier turn's tokens gets the same rows for them, as with a real prefix cache;
- the top-p kept sets are drawn from a second stream of the same seed, so asking for them never changes tokens;
- a weight update set to land mid-answer (`WeightUpdate.after_tokens`) switches at a generated position, not at a
  time, so the answer's `weight_versions` spans do not depend on timing either; so does one made while a paused
  answer waits (`Generation.continue_on`: it goes on from where it stopped, on the version of that moment);
- an answer aborted part-way (`Engine.note_abort`) is the model's continuation of its own prefix: a later request
  whose input is exactly that prompt plus the tokens generated before the abort (a client resuming it) goes on with
  the rest of the same answer (`Continuation`), as a deterministic model would, so a resumed answer equals the
  uninterrupted one token for token.

The vocabulary (`Vocabulary`) is synthetic by default: `vocab_size` ids whose text is `" w{id}"`, the eos id's text
empty. With `SimulatorConfig.tokenizer` (a Hugging Face tokenizer directory) it is that tokenizer's: `len(tokenizer)`
ids, its eos, each id's text as the tokenizer decodes it alone, and every special token's text empty (SGLang
detokenizes with `skip_special_tokens`; a request that sets it false gets their texts); text prompts are encoded with
it. A random answer never draws a special id
(the eos only ends it), and its `text` is always the concatenation of its tokens' texts.

A scripted answer (`ScriptedAnswer`, queued by `POST /sim/script`, see `parse_script` and `ScriptBook`) replaces the
random draw of one request's tokens; everything else (log-probs, routing, top-p, weight versions, stop token ids) is
computed from them exactly as for random tokens, so the answer is as deterministic as a random one.

`Generation` turns one planned answer into SGLang-shaped JSON for any prefix of it (cumulative stream chunks,
the final answer, an aborted partial answer). `Distortion` is how fault injection makes an answer wrong without
the builders knowing about fault modes.
"""

from __future__ import annotations

import re
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pybase64

# Token ids travel as int32 on the wire (routing, top-p) and in the crc of the input.
MAX_TOKEN_ID = 2**31 - 1
MAX_NEW_TOKENS = 1 << 20  # the simulated context length: keeps a typo from allocating gigabytes
MAX_EXPERTS = 1 << 16  # the routing table is num_experts x topk
MAX_CONTINUATIONS = 4096  # aborted answers kept for the requests that resume them
_U64 = 2**64
_ELEMENT_END = re.compile(rb"null\]")
ABORT_FINISH: dict[str, Any] = {"type": "abort", "message": "Abort requested", "status_code": None, "err_type": None}

# splitmix64 constants: a cheap, well-mixed 64-bit hash that vectorizes over numpy uint64 arrays.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


class BadRequest(ValueError):
    """The request is invalid; SGLang answers these with HTTP 400 `{"error": {"message": ...}}`."""


@dataclass(frozen=True)
class SimulatorConfig:
    """Everything that shapes the simulated server (the CLI flags of `python -m sglang_sim`)."""

    num_layers: int = 4
    topk: int = 2
    num_experts: int = 8
    seed: int = 0
    vocab_size: int = 1000
    weight_version: str = "sim-v0"
    latency_ms: float = 0.0
    token_delay_ms: float = 0.0
    stream_chunk_tokens: int = 1
    default_max_new_tokens: int = 16
    eos_token_id: int | None = None  # None: vocab_size - 1
    enable_routed_experts: bool = True  # False: like SGLang without --enable-return-routed-experts
    tokenizer: str | None = None  # a Hugging Face tokenizer directory: its vocabulary replaces vocab_size and eos
    # SGLang's context length: a request whose prompt + max_new_tokens is longer is a 400 (None: no such check, only
    # max_new_tokens <= MAX_NEW_TOKENS)
    context_length: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.num_layers >= 1, "num_layers must be >= 1"),
            (1 <= self.topk <= self.num_experts, "topk must be in [1, num_experts]"),
            (self.num_experts <= MAX_EXPERTS, f"num_experts must be <= {MAX_EXPERTS}"),
            (2 <= self.vocab_size <= MAX_TOKEN_ID, "vocab_size must be in [2, 2**31-1]"),
            (self.latency_ms >= 0 and self.token_delay_ms >= 0, "latencies must be >= 0"),
            (self.stream_chunk_tokens >= 1, "stream_chunk_tokens must be >= 1"),
            (self.default_max_new_tokens >= 0, "default_max_new_tokens must be >= 0"),
            (
                self.eos_token_id is None or 0 <= self.eos_token_id < self.vocab_size,
                "eos_token_id must be in [0, vocab_size)",
            ),
            (self.tokenizer is None or bool(self.tokenizer), "tokenizer must be a non-empty path"),
            (self.context_length is None or self.context_length >= 1, "context_length must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def eos(self) -> int:
        """The eos of the synthetic vocabulary (a tokenizer brings its own: `Vocabulary.eos`)."""
        return self.vocab_size - 1 if self.eos_token_id is None else self.eos_token_id


@dataclass(frozen=True)
class GenItem:
    """One validated prompt of a /generate call (a batch has several)."""

    rid: str
    input_ids: np.ndarray  # int64, non-empty
    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int = 0
    ignore_eos: bool = False  # run to max_new_tokens (finish "length"): fixed-size answers for benchmarks
    skip_special_tokens: bool = True  # false: special tokens keep their text in the answer (SGLang's sampling param)
    return_logprob: bool = False
    return_routed_experts: bool = False  # already False when the server has routing disabled
    start_len: int = 0
    return_top_p: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Plan:
    """The full answer a request would get if nothing stops it early."""

    output_ids: np.ndarray  # int64
    logprobs: np.ndarray  # float64, all < 0
    finish: dict[str, Any]
    entropy: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class Continuation:
    """The rest of an answer aborted after some of its tokens, waiting for the request that resumes it."""

    output_ids: np.ndarray  # int64
    logprobs: np.ndarray  # float64
    finish: dict[str, Any]  # how the whole answer would have ended


@dataclass(frozen=True)
class Distortion:
    """Ways to make an otherwise correct answer wrong; set by fault injection, honoured by `Generation`."""

    drop_keys: frozenset[str] = frozenset()
    null_first_logprob: bool = False
    routing_from_zero: bool = False  # as if routed_experts_start_len had been ignored
    routing_rows_delta: int = 0  # negative: drop that many trailing rows
    garble_routing: bool = False  # not valid base64 any more
    garble_offsets: bool = False  # top-p offsets[-1] != len(ids)
    garble_weight_versions: bool = False  # the last weight_versions span ends one past the generated tokens


NO_DISTORTION = Distortion()


@dataclass(frozen=True)
class WeightUpdate:
    """`POST /sim/weight_version`: the new version, and where it lands. `after_tokens` None: now (answers already
    running keep their version; later ones run on the new one). `after_tokens` K: the next answer to start runs its
    first K generated tokens on the current version and the rest on the new one (two `weight_versions` spans when it
    generates more than K), and every answer after it runs on the new one."""

    version: str
    after_tokens: int | None = None


def parse_weight_update(body: Any) -> WeightUpdate:
    """Validate a `/sim/weight_version` body: `{"weight_version": "<non-empty string>", "after_tokens": K >= 0}`."""
    version = body.get("weight_version") if isinstance(body, dict) else None
    if not isinstance(version, str) or not version:
        raise BadRequest('body must be {"weight_version": "<non-empty string>", "after_tokens": <optional int >= 0>}')
    after = body.get("after_tokens")
    if after is not None and (not _is_int(after) or not 0 <= after <= MAX_NEW_TOKENS):
        raise BadRequest(f"after_tokens must be an int in [0, {MAX_NEW_TOKENS}] (got {after!r})")
    return WeightUpdate(version, after)


# ------------------------------------------------------------------------------------ vocabulary, scripts


@dataclass(frozen=True)
class Vocabulary:
    """The ids the model speaks: each one's text, the eos id, and the special ids a random answer never draws."""

    words: list[str] = field(repr=False)  # words[id]: the id's text in an answer ("" for special tokens)
    eos: int
    special_ids: tuple[int, ...]  # ascending, eos included
    tokenizer: Any = field(default=None, repr=False, compare=False)  # a transformers tokenizer; None: synthetic
    # The special tokens' own texts, for a request with skip_special_tokens false.
    special_words: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.words)

    def ordinary_ids(self, index: np.ndarray) -> np.ndarray:
        """The index-th ids that are not special: each index steps past the special ids at or below its id.

        The j-th special id (ascending) s_j is passed by every index >= s_j - j, so one search counts them all.
        """
        special = np.array(self.special_ids, dtype=np.int64)
        passed = special - np.arange(len(special), dtype=np.int64)
        return index + np.searchsorted(passed, index, side="right")

    def encode_prompt(self, text: str) -> np.ndarray:
        """A `text` prompt's ids: the tokenizer's (as SGLang encodes it), else one synthetic id per word."""
        if self.tokenizer is None:
            return tokenize(text, self.size)
        return np.array(self.tokenizer.encode(text), dtype=np.int64)

    def encode_answer(self, text: str) -> list[int]:
        """A scripted answer's ids: exactly the text, no special tokens around it."""
        if self.tokenizer is None:
            raise BadRequest('"text" answers need a simulator started with a tokenizer; give "token_ids"')
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def synthetic_vocabulary(vocab_size: int, eos: int) -> Vocabulary:
    words = [f" w{i}" for i in range(vocab_size)]
    words[eos] = ""  # skip_special_tokens: the eos token has no text
    return Vocabulary(words, eos, (eos,))


def tokenizer_vocabulary(path: str) -> Vocabulary:
    """The vocabulary of the Hugging Face tokenizer in `path` (read from disk only, never downloaded)."""
    from transformers import AutoTokenizer  # a slow import: only a simulator with a tokenizer pays for it

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer {path!r}: {exc}") from exc
    size, eos = len(tokenizer), tokenizer.eos_token_id
    if not 2 <= size <= MAX_TOKEN_ID:
        raise ValueError(f"tokenizer {path}: {size} tokens, must be in [2, 2**31-1]")
    if not _is_int(eos) or not 0 <= eos < size:
        raise ValueError(f"tokenizer {path} has no eos token id in [0, {size})")
    special = tuple(sorted({i for i in tokenizer.all_special_ids if 0 <= i < size} | {eos}))
    if len(special) == size:
        raise ValueError(f"tokenizer {path} has only special tokens")
    # Each id decoded on its own, without the space clean-up that would make the texts not concatenate.
    words = tokenizer.batch_decode([[i] for i in range(size)], clean_up_tokenization_spaces=False)
    special_words = {i: words[i] for i in special}
    for i in special:
        words[i] = ""  # SGLang detokenizes with skip_special_tokens
    return Vocabulary(words, eos, special, tokenizer, special_words)


def load_vocabulary(config: SimulatorConfig) -> Vocabulary:
    if config.tokenizer is None:
        return synthetic_vocabulary(config.vocab_size, config.eos)
    return tokenizer_vocabulary(config.tokenizer)


@dataclass(frozen=True, eq=False)
class ScriptedAnswer:
    """One answer queued by `POST /sim/script`: the tokens a request generates instead of random ones."""

    output_ids: np.ndarray  # int64, the eos id already appended when `eos`
    eos: bool
    text: str | None = None  # as given, when given as text

    def to_dict(self) -> dict[str, Any]:
        ids = self.output_ids[:-1] if self.eos else self.output_ids
        out: dict[str, Any] = {"token_ids": ids.tolist(), "eos": self.eos}
        if self.text is not None:
            out["text"] = self.text
        return out


_SCRIPT_SHAPE = (
    'body must be {"rid_prefix": "<str>", "answers": [{"text": "<str>"} or {"token_ids": [<int>, ...]}, '
    'optionally with "eos": <bool>]}'
)
_ANSWER_KEYS = frozenset({"text", "token_ids", "eos"})


def parse_script(body: Any, vocab: Vocabulary) -> tuple[str, list[ScriptedAnswer]]:
    """Validate a `POST /sim/script` body; raises BadRequest. Returns the rid prefix and its answers, in order."""
    if not isinstance(body, dict) or set(body) != {"rid_prefix", "answers"}:
        raise BadRequest(_SCRIPT_SHAPE)
    prefix, answers = body["rid_prefix"], body["answers"]
    if not isinstance(prefix, str) or not isinstance(answers, list) or not answers:
        raise BadRequest(_SCRIPT_SHAPE)
    return prefix, [_scripted_answer(answer, i, vocab) for i, answer in enumerate(answers)]


def _scripted_answer(answer: Any, index: int, vocab: Vocabulary) -> ScriptedAnswer:
    where = f"answers[{index}]"
    if not isinstance(answer, dict) or not set(answer) <= _ANSWER_KEYS or ("text" in answer) == ("token_ids" in answer):
        raise BadRequest(f'{where} must have exactly one of "text" or "token_ids", and optionally "eos"')
    eos = answer.get("eos", True)
    if not isinstance(eos, bool):
        raise BadRequest(f"{where}.eos must be a boolean (got {eos!r})")
    text = answer.get("text")
    if "text" in answer:
        if not isinstance(text, str):
            raise BadRequest(f"{where}.text must be a string")
        ids = vocab.encode_answer(text)
    else:
        ids = answer["token_ids"]
        if not isinstance(ids, list) or not all(_is_int(i) and 0 <= i < vocab.size for i in ids):
            raise BadRequest(f"{where}.token_ids must be a list of ints in [0, {vocab.size})")
    if len(ids) + eos > MAX_NEW_TOKENS:
        raise BadRequest(f"{where} is longer than {MAX_NEW_TOKENS} tokens")
    return ScriptedAnswer(np.array([*ids, vocab.eos] if eos else ids, dtype=np.int64), eos, text)


class ScriptBook:
    """Scripted answers queued per rid prefix. A rid takes the next answer of the longest prefix it starts with
    that still has answers queued; a prefix whose answers are all taken matches nothing any more."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[ScriptedAnswer]] = {}

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def add(self, prefix: str, answers: Sequence[ScriptedAnswer]) -> None:
        self._queues.setdefault(prefix, deque()).extend(answers)

    def take(self, rid: str) -> ScriptedAnswer | None:
        matching = [prefix for prefix in self._queues if rid.startswith(prefix)]
        if not matching:
            return None
        prefix = max(matching, key=len)
        queue = self._queues[prefix]
        answer = queue.popleft()
        if not queue:
            del self._queues[prefix]
        return answer

    def pending(self) -> dict[str, list[dict[str, Any]]]:
        return {prefix: [answer.to_dict() for answer in queue] for prefix, queue in self._queues.items()}

    def clear(self) -> int:
        cleared = len(self)
        self._queues.clear()
        return cleared


# --------------------------------------------------------------------------------------------- hashing


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over a uint64 array (wrapping arithmetic is what we want here)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def ids_crc32(ids: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(ids, dtype="<i4").tobytes())


def tokenize(text: str, vocab_size: int) -> np.ndarray:
    """Deterministic stand-in tokenizer: one token per whitespace-separated word."""
    return np.array([zlib.crc32(w.encode()) % vocab_size for w in text.split()], dtype=np.int64)


def embeds_to_ids(embeds: Sequence[Sequence[float]], vocab_size: int) -> np.ndarray:
    """One pseudo token id per embedding row, so routing still has a token to depend on."""
    ids = [zlib.crc32(np.asarray(row, dtype="<f4").tobytes()) % vocab_size for row in embeds]
    return np.array(ids, dtype=np.int64)


def encode_i32(arr: np.ndarray) -> str:
    """Standard base64 of a C-order little-endian int32 array, the wire format of routing and top-p."""
    data = np.ascontiguousarray(arr, dtype="<i4")
    # A byte view of the array (memoryview.cast refuses a shape with a zero in it: no routing rows, max_new_tokens 0).
    return pybase64.b64encode_as_string(data.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------- prefix cache


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PrefixCache:
    """Earlier sequences that went through the model, to answer `cached_tokens` like a radix cache would.

    Exact (page size 1). Candidates are indexed by their first token and the newest few are compared with
    numpy, which keeps a lookup cheap even when every request shares one system prompt. Bounded by a token
    budget, oldest evicted first; a stored sequence that a newer one extends is replaced by it.
    """

    def __init__(self, max_tokens: int = 1 << 23, max_candidates: int = 64) -> None:
        self._max_tokens = max_tokens
        self._max_candidates = max_candidates
        self._seqs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._by_first: dict[int, list[int]] = {}
        self._next_key = 0
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def clear(self) -> None:
        self._seqs.clear()
        self._by_first.clear()
        self._tokens = 0

    def _candidates(self, ids: np.ndarray) -> list[int]:
        keys = self._by_first.get(int(ids[0]), [])
        return keys[-self._max_candidates :][::-1]

    def lookup(self, ids: np.ndarray) -> int:
        """Longest cached prefix of `ids`, capped at len - 1 (the last prompt token is always computed)."""
        if len(ids) == 0:
            return 0
        best = max((common_prefix_len(ids, self._seqs[k]) for k in self._candidates(ids)), default=0)
        return min(best, len(ids) - 1)

    def insert(self, seq: np.ndarray) -> None:
        if len(seq) == 0:
            return
        for key in self._candidates(seq):
            stored = self._seqs[key]
            common = common_prefix_len(seq, stored)
            if common == len(seq):
                return  # already covered by a longer sequence
            if common == len(stored):
                self._remove(key)  # the new sequence extends it
        key = self._next_key
        self._next_key += 1
        self._seqs[key] = seq.copy()
        self._by_first.setdefault(int(seq[0]), []).append(key)
        self._tokens += len(seq)
        while self._tokens > self._max_tokens and len(self._seqs) > 1:
            self._remove(next(iter(self._seqs)))

    def _remove(self, key: int) -> None:
        seq = self._seqs.pop(key)
        self._tokens -= len(seq)
        bucket = self._by_first[int(seq[0])]
        bucket.remove(key)
        if not bucket:
            del self._by_first[int(seq[0])]


# ---------------------------------------------------------------------------------------------- engine


class Engine:
    """Per-server model state: the vocabulary text, routing tables and the prefix cache."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.vocab = load_vocabulary(config)
        self.weight_version = config.weight_version  # mutable: /sim/weight_version simulates weight updates
        self.pending_update: WeightUpdate | None = None  # one set to land inside the next answer
        self.cache = PrefixCache()
        # aborted answers' rests, by the sequence a resuming request sends (the oldest dropped past the bound)
        self.continuations: OrderedDict[bytes, Continuation] = OrderedDict()
        words = self._words = self.vocab.words
        self._word_lens = np.fromiter((len(w) for w in words), dtype=np.int64, count=len(words))
        # The same with special tokens spelled out (skip_special_tokens false), made once.
        self._raw_words = list(words)
        for i, text in self.vocab.special_words.items():
            self._raw_words[i] = text
        self._raw_word_lens = np.fromiter((len(w) for w in self._raw_words), dtype=np.int64, count=len(words))
        seed = config.seed % _U64
        rng = np.random.default_rng([seed, 7])
        # Row b is experts perm[b], perm[b+1], ... (mod E) of a per-seed permutation: K distinct ids, so a
        # routing row is one lookup of a base value per (position, layer).
        perm = rng.permutation(config.num_experts).astype(np.int32)
        doubled = np.concatenate([perm, perm])
        self._expert_rows = np.stack([doubled[b : b + config.topk] for b in range(config.num_experts)])
        self._seed_salt = mix64(np.array([seed], dtype=np.uint64) + _GOLDEN)[0]
        self._layer_salts = mix64(np.arange(config.num_layers, dtype=np.uint64) * _GOLDEN + self._seed_salt)

    # -- planning

    def start(
        self, item: GenItem, script: ScriptedAnswer | None = None, continuation: Continuation | None = None
    ) -> Generation:
        """The request in flight: random tokens, `script`'s tokens when one is given, or the rest of an aborted
        answer that this request resumes (`take_continuation`)."""
        version, switch = self.weight_version, self.pending_update
        if switch is not None:  # this answer carries the update: the ones after it run on the new weights
            self.pending_update = None
            self.weight_version = switch.version
        plan = self.plan(item, script) if continuation is None else self.plan_continuation(item, continuation)
        return Generation(self, item, plan, self.cache.lookup(item.input_ids), version, switch)

    def take_continuation(self, item: GenItem) -> Continuation | None:
        """The rest of the aborted answer whose prompt and tokens so far are exactly this request's input, if any."""
        return self.continuations.pop(_sequence_key(item.input_ids), None)

    def note_abort(self, gen: Generation, m: int) -> None:
        """`gen` was aborted after `m` of its tokens: keep the rest for the request that resumes it."""
        if m >= gen.n:
            return
        plan = gen.plan
        key = _sequence_key(np.concatenate([gen.item.input_ids, plan.output_ids[:m]]))
        self.continuations[key] = Continuation(plan.output_ids[m:].copy(), plan.logprobs[m:].copy(), plan.finish)
        while len(self.continuations) > MAX_CONTINUATIONS:
            self.continuations.popitem(last=False)

    def plan_continuation(self, item: GenItem, continuation: Continuation) -> Plan:
        """The rest of an aborted answer, cut to this request's max_new_tokens (a "length" finish then)."""
        ids, logprobs, cap = continuation.output_ids, continuation.logprobs, item.max_new_tokens
        finish = continuation.finish
        if len(ids) > cap:
            ids, logprobs, finish = ids[:cap], logprobs[:cap], {"type": "length", "length": cap}
        elif finish.get("type") == "length":
            finish = {"type": "length", "length": cap}
        entropy = (self.config.seed % _U64, ids_crc32(item.input_ids), item.sampling_seed % _U64)
        return _stopped_early(item, Plan(ids.copy(), logprobs.copy(), finish, entropy))

    def update_weights(self, update: WeightUpdate) -> None:
        """Apply `/sim/weight_version`: now, or inside the next answer (see `WeightUpdate`)."""
        if update.after_tokens is None:
            self.pending_update = None  # a later update overrides one still waiting
            self.weight_version = update.version
        else:
            self.pending_update = update

    def plan(self, item: GenItem, script: ScriptedAnswer | None = None) -> Plan:
        entropy = (self.config.seed % _U64, ids_crc32(item.input_ids), item.sampling_seed % _U64)
        rng = np.random.default_rng(list(entropy))
        tokens, finish = self._draw(item, rng) if script is None else scripted_tokens(item, script)
        scale = max(item.temperature, 0.05)
        logprobs = -(rng.exponential(scale, size=len(tokens)) + 1e-4)
        return _stopped_early(item, Plan(tokens, logprobs, finish, entropy))

    def _draw(self, item: GenItem, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
        """Random tokens: a random length up to max_new_tokens, ending with eos when shorter than that."""
        vocab, cap = self.vocab, item.max_new_tokens
        drawn = int(rng.integers(1, cap + 1)) if cap > 0 else 0
        n = cap if item.ignore_eos else drawn
        # Draw among the ordinary ids only, so eos appears only where we decide the answer stops.
        tokens = vocab.ordinary_ids(rng.integers(0, vocab.size - len(vocab.special_ids), size=n, dtype=np.int64))
        if n < cap:
            tokens[-1] = vocab.eos
            return tokens, {"type": "stop", "matched": vocab.eos}
        return tokens, {"type": "length", "length": cap}

    # -- per-position data

    def routing_rows(self, seq: np.ndarray, start: int) -> np.ndarray:
        """int32 [len(seq) - 1 - start, L, K]: routing of positions start .. len(seq)-2.

        Depends only on (seed, position, token at position): the same prefix always routes the same.
        """
        cfg = self.config
        rows = max(0, len(seq) - 1 - start)
        pos = np.arange(start, start + rows, dtype=np.uint64)
        tok = seq[start : start + rows].astype(np.uint64)
        key = mix64(pos * _GOLDEN ^ mix64(tok + self._seed_salt))
        base = (mix64(key[:, None] ^ self._layer_salts[None, :]) % np.uint64(cfg.num_experts)).astype(np.intp)
        return self._expert_rows[base]

    def top_p_sets(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """(ids, offsets) int32: 1..20 distinct ids per generated token, the sampled token first."""
        n = plan.n
        rng = np.random.default_rng([*plan.entropy, 1])
        # Geometric sizes: median ~2 and a long tail, like real nucleus sets (docs/protocol.md section 2.4).
        sizes = np.minimum(rng.geometric(0.4, size=n), min(20, self.vocab.size))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        owner = np.repeat(np.arange(n), sizes)
        within = np.arange(offsets[-1], dtype=np.int64) - offsets[owner]
        ids = (plan.output_ids[owner] + within) % self.vocab.size
        return ids.astype(np.int32), offsets.astype(np.int32)

    def text_ends(self, ids: np.ndarray, *, skip_special: bool = True) -> np.ndarray:
        """Character offset where the text of each token ends, so any prefix's text is one slice."""
        lens = self._word_lens if skip_special else self._raw_word_lens
        return np.cumsum(lens[ids]) if len(ids) else np.zeros(0, dtype=np.int64)

    def detokenize(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        words = self._words if skip_special else self._raw_words
        return "".join([words[i] for i in ids])


def _stopped_early(item: GenItem, plan: Plan) -> Plan:
    """The plan ended at its first stop token id (`stop_token_ids`), if it has one."""
    tokens = plan.output_ids
    if not item.stop_token_ids or not len(tokens):
        return plan
    hits = np.flatnonzero(np.isin(tokens, np.array(item.stop_token_ids, dtype=np.int64)))
    if not hits.size:
        return plan
    n = int(hits[0]) + 1
    return Plan(tokens[:n], plan.logprobs[:n], {"type": "stop", "matched": int(tokens[n - 1])}, plan.entropy)


def _sequence_key(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def scripted_tokens(item: GenItem, script: ScriptedAnswer) -> tuple[np.ndarray, dict[str, Any]]:
    """A scripted answer's tokens and finish, as SGLang would end them: its eos within max_new_tokens stops it
    (SGLang checks stop tokens before the length); otherwise reaching max_new_tokens is a "length" finish (the
    answer cut to it); an answer without eos that ends earlier stops on nothing: `"matched": None`, which keeps
    SGLang's key set and its whole text (only a matched stop token's text is trimmed). ignore_eos does not apply:
    the script is the answer."""
    ids, cap = script.output_ids, item.max_new_tokens
    if script.eos and len(ids) <= cap:
        return ids.copy(), {"type": "stop", "matched": int(ids[-1])}
    if len(ids) >= cap:
        return ids[:cap].copy(), {"type": "length", "length": cap}
    return ids.copy(), {"type": "stop", "matched": None}


@dataclass
class Generation:
    """One request in flight: its plan plus builders for the answer after `m` generated tokens.

    Builders are cumulative-stream friendly: the text and the serialized log-probs are computed once and each
    chunk takes a slice, so a chunk costs a memcpy of its size rather than re-encoding every token.
    """

    engine: Engine
    item: GenItem
    plan: Plan
    cached_tokens: int
    weight_version: str  # the version it started on
    switch: WeightUpdate | None = None  # an update landing after `switch.after_tokens` generated tokens
    distortion: Distortion = NO_DISTORTION
    retractions: int = 0  # times a `retract` pause took it back to the queue (meta_info.num_retractions)
    # (first generated position, version) of each version its tokens come from, in order
    _versions: list[tuple[int, str]] = field(default_factory=list, init=False, repr=False)
    _ids: list[int] = field(default_factory=list, init=False, repr=False)
    _text: str | None = field(default=None, init=False, repr=False)
    _text_ends: np.ndarray | None = field(default=None, init=False, repr=False)
    _lp_json: bytes | None = field(default=None, init=False, repr=False)
    _lp_ends: list[int] = field(default_factory=list, init=False, repr=False)
    _top_p: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._ids = self.plan.output_ids.tolist()
        self._versions = [(0, self.weight_version)]
        if self.switch is not None:
            self._switch_at(self.switch.after_tokens, self.switch.version)

    def continue_on(self, m: int, version: str) -> None:
        """It goes on after `m` generated tokens on the weights `version` (after a pause that a weight update may
        have landed in)."""
        self._switch_at(m, version)

    def _switch_at(self, position: int, version: str) -> None:
        versions = self._versions
        while versions and versions[-1][0] >= position and len(versions) > 1:
            versions.pop()  # a later switch at or before an earlier one's position replaces it
        if versions[-1][0] >= position:
            versions[-1] = (versions[-1][0], version)
        elif versions[-1][1] != version:
            versions.append((position, version))

    @property
    def n(self) -> int:
        return self.plan.n

    def fed_sequence(self, m: int) -> np.ndarray:
        """Tokens that went through the model after `m` generated ones (the last sampled one never did)."""
        return np.concatenate([self.item.input_ids, self.plan.output_ids[: max(m - 1, 0)]])

    def payload_size(self, m: int) -> int:
        """Rough element count of the final answer; large ones are built off the event loop."""
        routing = (self.item.prompt_len + m) * self.engine.config.num_layers * self.engine.config.topk
        return m * 8 + (routing if self.item.return_routed_experts else 0)

    # -- pieces

    def text(self, m: int) -> str:
        if self._text is None:
            skip = self.item.skip_special_tokens
            self._text = self.engine.detokenize(self._ids, skip_special=skip)
            self._text_ends = self.engine.text_ends(self.plan.output_ids, skip_special=skip)
        assert self._text_ends is not None
        return self._text[: int(self._text_ends[m - 1])] if m else ""

    def logprobs(self, m: int) -> orjson.Fragment:
        """`output_token_logprobs[:m]` as pre-serialized JSON: [[logprob, token_id, null], ...]."""
        if self._lp_json is None:
            values: list[float | None] = self.plan.logprobs.tolist()
            if self.distortion.null_first_logprob and values:
                values[0] = None
            self._lp_json = orjson.dumps([[lp, tok, None] for lp, tok in zip(values, self._ids, strict=True)])
            # Every element is [logprob, id, null], so "null]" closes each one: their ends index any prefix.
            self._lp_ends = [match.end() for match in _ELEMENT_END.finditer(self._lp_json)]
        body = self._lp_json[: self._lp_ends[m - 1]] if m else b"["
        return orjson.Fragment(body + b"]")

    def routed_experts(self, m: int) -> str:
        d = self.distortion
        seq = np.concatenate([self.item.input_ids, self.plan.output_ids[:m]])
        rows = self.engine.routing_rows(seq, 0 if d.routing_from_zero else self.item.start_len)
        if d.routing_rows_delta:
            rows = rows[: max(0, len(rows) + d.routing_rows_delta)]
        encoded = encode_i32(rows)
        return "*" + encoded if d.garble_routing else encoded  # "*" is outside the base64 alphabet

    def top_p(self, m: int) -> tuple[str, str]:
        if self._top_p is None:
            self._top_p = self.engine.top_p_sets(self.plan)
        ids, offsets = self._top_p
        offsets = offsets[: m + 1].copy()
        ids = ids[: offsets[-1]]
        if self.distortion.garble_offsets:
            offsets[-1] += 1
        return encode_i32(ids), encode_i32(offsets)

    def version_at(self, m: int) -> str:
        """`weight_version` after `m` generated tokens: the version of the newest one (of the first one to come
        while there is none), as SGLang reports the server's version when it sends a chunk."""
        newest = max(m - 1, 0)
        return next(version for start, version in reversed(self._versions) if start <= newest)

    def version_spans(self, m: int) -> list[dict[str, Any]]:
        """`weight_versions` after `m` generated tokens, as SGLang builds them: contiguous from 0, one per version,
        and a single empty span when there is no token yet."""
        if not m:
            spans = [{"version": self.version_at(0), "start": 0, "end": 0}]
        else:
            ends = [start for start, _ in self._versions[1:]] + [m]
            spans = [
                {"version": version, "start": start, "end": min(end, m)}
                for (start, version), end in zip(self._versions, ends, strict=True)
                if start < m
            ]
        if self.distortion.garble_weight_versions:
            spans[-1]["end"] += 1
        return spans

    # -- whole answers

    def _meta(self, m: int, finish: dict[str, Any] | None) -> dict[str, Any]:
        """meta_info as SGLang 0.5 sends it on every stream chunk (keys verified against a real server)."""
        cached = self.cached_tokens
        meta: dict[str, Any] = {
            "id": self.item.rid,
            "finish_reason": finish,
            "prompt_tokens": self.item.prompt_len,
            "weight_version": self.version_at(m),
            "num_retractions": self.retractions,
            "reasoning_tokens": 0,
            "completion_tokens": m,
            "cached_tokens": cached,
            "cached_tokens_details": {"device": cached, "host": 0} if cached else None,
            "dp_rank": None,
        }
        if self.item.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = self.logprobs(m)
            meta["output_token_logprobs_length"] = m
        return meta

    def _final_meta(self, m: int, finish: dict[str, Any], e2e_latency: float) -> dict[str, Any]:
        """Plus what only the finished answer (the last chunk of a stream) carries."""
        meta = self._meta(m, finish)
        meta["weight_versions"] = self.version_spans(m)
        if self.item.return_routed_experts:
            meta["routed_experts"] = self.routed_experts(m)
        if self.item.return_top_p:
            meta["top_p_token_ids"], meta["top_p_token_offsets"] = self.top_p(m)
        meta["e2e_latency"] = e2e_latency
        return meta

    def _answer(self, m: int, meta: dict[str, Any]) -> dict[str, Any]:
        for key in self.distortion.drop_keys:
            meta.pop(key, None)
        return {"text": self.text(m), "output_ids": self._ids[:m], "meta_info": meta}

    def chunk(self, m: int, *, first: bool = False) -> dict[str, Any]:
        """A cumulative, unfinished stream chunk after `m` tokens (SGLang stamps only the first one)."""
        meta = self._meta(m, None)
        if first:
            meta["response_sent_to_client_ts"] = time.time()
        return self._answer(m, meta)

    def final(self, m: int, finish: dict[str, Any], e2e_latency: float, *, streamed: bool = False) -> dict[str, Any]:
        """The finished answer (or last stream chunk) after `m` tokens, with routing and top-p arrays."""
        meta = self._final_meta(m, finish, e2e_latency)
        if not streamed:
            meta["response_sent_to_client_ts"] = time.time()
        answer = self._answer(m, meta)
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), int) and m:
            # SGLang trims the matched stop token's text (no_stop_trim defaults to false); ids and log-probs keep it.
            answer["text"] = self.text(m - 1)
        return answer


# --------------------------------------------------------------------------------------- request parsing


@dataclass(frozen=True)
class GenerateRequest:
    items: tuple[GenItem, ...]
    batch: bool
    stream: bool


_INPUT_KEYS = ("input_ids", "text", "input_embeds")


def parse_generate(
    body: Any, config: SimulatorConfig, vocab: Vocabulary, new_rid: Callable[[], str]
) -> GenerateRequest:
    """Validate a /generate body the way SGLang does; raises BadRequest. `new_rid()` makes a default rid."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    given = [k for k in _INPUT_KEYS if body.get(k) is not None]
    if len(given) != 1:
        raise BadRequest(f"exactly one of input_ids, text or input_embeds must be given (got {given or 'none'})")
    prompts, batch = _prompts(given[0], body[given[0]], vocab)
    count = len(prompts)
    params = _per_item(body.get("sampling_params"), count, batch, "sampling_params")
    rids = _rids(body.get("rid"), count, batch, new_rid)
    logprob = _per_item(body.get("return_logprob"), count, batch, "return_logprob")
    routing = _per_item(body.get("return_routed_experts"), count, batch, "return_routed_experts")
    starts = _per_item(body.get("routed_experts_start_len"), count, batch, "routed_experts_start_len")
    stream = body.get("stream") is True
    if stream and batch:
        raise BadRequest("the simulator does not stream batched requests")
    items = tuple(
        _item(config, prompts[i], params[i], rids[i], logprob[i], routing[i], starts[i]) for i in range(count)
    )
    return GenerateRequest(items, batch, stream)


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass and not a token id


def _ids(value: Any) -> np.ndarray:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise BadRequest("input_ids must be a list of ints (or a list of such lists for a batch)")
    if value and (min(value) < 0 or max(value) > MAX_TOKEN_ID):
        raise BadRequest("input_ids must be in [0, 2**31-1]")
    return np.array(value, dtype=np.int64)


def _prompts(key: str, value: Any, vocab: Vocabulary) -> tuple[list[np.ndarray], bool]:
    if key == "input_ids":
        batch = isinstance(value, list) and bool(value) and isinstance(value[0], list)
        prompts = [_ids(v) for v in value] if batch else [_ids(value)]
    elif key == "text":
        batch = isinstance(value, list)
        texts = value if batch else [value]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        prompts = [vocab.encode_prompt(t) for t in texts]
    else:
        batch = nesting_depth(value) == 3
        try:
            prompts = [embeds_to_ids(v, vocab.size) for v in (value if batch else [value])]
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"input_embeds must be a list of float vectors: {exc}") from exc
    if batch and not prompts:
        raise BadRequest("empty batch")
    if any(len(p) == 0 for p in prompts):
        raise BadRequest("the input is empty")
    return prompts, batch


def nesting_depth(value: Any) -> int:
    """How many list levels the first element path has: 1 for a prompt of ids, 2 for a batch of them."""
    depth = 0
    while isinstance(value, list) and value:
        depth, value = depth + 1, value[0]
    return depth


def _per_item(value: Any, count: int, batch: bool, name: str) -> list[Any]:
    """A batch may give one value for all prompts or a list with one per prompt."""
    if batch and isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


def _rids(value: Any, count: int, batch: bool, new_rid: Callable[[], str]) -> list[str]:
    if value is None:
        return [new_rid() for _ in range(count)]
    if batch and isinstance(value, list) and len(value) == count and all(isinstance(r, str) for r in value):
        return value
    if isinstance(value, str):
        return [value] if not batch else [f"{value}-{i}" for i in range(count)]
    raise BadRequest("rid must be a string (or a list of strings for a batch)")


def _item(
    config: SimulatorConfig,
    input_ids: np.ndarray,
    params: Any,
    rid: str,
    logprob: Any,
    routing: Any,
    start_len: Any,
) -> GenItem:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    start = 0 if start_len is None else start_len
    if not _is_int(start) or not 0 <= start <= len(input_ids):
        raise BadRequest(f"routed_experts_start_len must be an int in [0, {len(input_ids)}] (got {start_len!r})")
    custom = params.get("custom_params") or {}
    if not isinstance(custom, dict):
        raise BadRequest("sampling_params.custom_params must be an object")
    max_new_tokens = _int_param(params, "max_new_tokens", config.default_max_new_tokens, 0, MAX_NEW_TOKENS)
    context = config.context_length
    if context is not None and len(input_ids) + max_new_tokens > context:
        # SGLang's own words for it (tokenizer_manager's input-length validation)
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested a "
            f"total of {len(input_ids) + max_new_tokens} tokens: {len(input_ids)} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )
    return GenItem(
        rid=rid,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        temperature=_temperature(params.get("temperature")),
        stop_token_ids=_stop_ids(params.get("stop_token_ids")),
        sampling_seed=_int_param(params, "sampling_seed", 0, minimum=None),
        ignore_eos=bool(params.get("ignore_eos")),
        skip_special_tokens=params.get("skip_special_tokens") is not False,
        return_logprob=bool(logprob),
        return_routed_experts=bool(routing) and config.enable_routed_experts,
        start_len=start,
        return_top_p=bool(custom.get("return_top_p_token_ids")),
    )


def _int_param(
    params: dict[str, Any], name: str, default: int, minimum: int | None = 0, maximum: int | None = None
) -> int:
    value = params.get(name)
    if value is None:
        return default
    too_low = minimum is not None and _is_int(value) and value < minimum
    too_high = maximum is not None and _is_int(value) and value > maximum
    if not _is_int(value) or too_low or too_high:
        raise BadRequest(f"sampling_params.{name} must be an int in [{minimum}, {maximum}] (got {value!r})")
    return value


def _temperature(value: Any) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise BadRequest(f"sampling_params.temperature must be a number >= 0 (got {value!r})")
    return float(value)


def _stop_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise BadRequest("sampling_params.stop_token_ids must be a list of ints")
    return tuple(value)
