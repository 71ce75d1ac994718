"""slime's trainer-side path, as the rollout process runs it today (the baseline of rows 1 and 3).

``sglang_rollout.generate`` + ``Sample.append_response_tokens``: stdlib ``json.loads`` of the raw ``/generate``
answer, token ids and log-probs pulled out of ``output_token_logprobs`` by list comprehensions, the sample's
tokens / loss mask / log-probs kept as Python lists, the base64 int32 arrays decoded the way slime's ``generate``
decodes routed experts (``pybase64.b64decode(value.encode("ascii"))``, then a frombuffer view: here
``torch.frombuffer``, no copy), top-p spans and routing rows appended with ``torch.cat``. The same semantics as
``tests/slime_reference.py`` (the test oracle), with slime's decoder calls rather than the oracle's stdlib ones.
"""

from __future__ import annotations

import enum
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import pybase64
import torch

TOP_P_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
TOP_P_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")
FINISH_TO_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def decode_int32(value: str) -> torch.Tensor:
    """base64 of little-endian int32 -> a tensor over the decoded bytes (no copy), with slime's call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": the tensor is only read
        return torch.frombuffer(pybase64.b64decode(value.encode("ascii")), dtype=torch.int32)


def _first(meta: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if meta.get(key) is not None:
            return meta[key]
    return None


@dataclass
class ReferenceSample:
    """The slice of slime's ``Sample`` the fold touches: Python lists and torch tensors."""

    tokens: list[int]
    num_layers: int
    topk: int
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    rollout_top_p_token_ids: torch.Tensor | None = None
    rollout_top_p_token_offsets: torch.Tensor | None = None
    rollout_routed_experts: torch.Tensor | None = None
    status: str = "pending"
    weight_versions: list[str] = field(default_factory=list)

    def append_answer(self, raw: bytes, *, routing_start_len: int = 0) -> None:
        """``generate``'s handling of one ``/generate`` answer: parse, pull the lists out, fold."""
        output = json.loads(raw)
        meta = output["meta_info"]
        items = meta["output_token_logprobs"]
        new_tokens = [item[1] for item in items]
        new_log_probs = [item[0] for item in items]
        self.append_response_tokens(new_tokens, new_log_probs, meta, output["text"], routing_start_len)

    def append_response_tokens(
        self, tokens: list[int], log_probs: list[float], meta: dict[str, Any], text: str, routing_start_len: int
    ) -> None:
        n = len(tokens)
        if len(log_probs) != n:
            raise ValueError("log_probs and tokens differ in length")
        self.response += text
        self.tokens += tokens
        self.response_length += n
        self.loss_mask += [1] * n
        self.rollout_log_probs += log_probs
        raw_ids, raw_offsets = _first(meta, TOP_P_ID_KEYS), _first(meta, TOP_P_OFFSET_KEYS)
        if n and raw_ids is not None and raw_offsets is not None:
            ids, offsets = decode_int32(raw_ids), decode_int32(raw_offsets)
            if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or offsets.numel() != n + 1:
                raise ValueError("top-p offsets do not match the ids / the new tokens")
            if self.rollout_top_p_token_ids is None or self.rollout_top_p_token_offsets is None:
                self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = ids, offsets
            else:
                base = int(self.rollout_top_p_token_offsets[-1])
                self.rollout_top_p_token_ids = torch.cat([self.rollout_top_p_token_ids, ids])
                self.rollout_top_p_token_offsets = torch.cat([self.rollout_top_p_token_offsets, offsets[1:] + base])
        if meta.get("routed_experts") is not None:
            self._apply_routing(decode_int32(meta["routed_experts"]), routing_start_len)
        if meta.get("finish_reason") is not None:
            if n and "weight_version" in meta:
                self.weight_versions.append(meta["weight_version"])
            self.status = FINISH_TO_STATUS.get(meta["finish_reason"]["type"], self.status)

    def append_tool_tokens(self, tokens: list[int]) -> None:
        n = len(tokens)
        self.tokens += tokens
        self.response_length += n
        self.loss_mask += [0] * n
        self.rollout_log_probs += [0.0] * n
        if self.rollout_top_p_token_offsets is not None:
            offsets = self.rollout_top_p_token_offsets
            self.rollout_top_p_token_offsets = torch.cat([offsets, offsets.new_full((n,), int(offsets[-1]))])

    def _apply_routing(self, routed: torch.Tensor, start_len: int) -> None:
        rows = len(self.tokens) - 1 - start_len
        if routed.numel() != rows * self.num_layers * self.topk:
            raise ValueError(f"routed_experts has {routed.numel()} elements, expected {rows} rows")
        routed = routed.reshape(rows, self.num_layers, self.topk)
        if start_len == 0 or self.rollout_routed_experts is None:
            self.rollout_routed_experts = routed
        else:
            self.rollout_routed_experts = torch.cat([self.rollout_routed_experts[:start_len], routed])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The training tensors (what the SDK's ``RolloutSample`` holds), built from the lists."""
        out = {
            "tokens": torch.tensor(self.tokens, dtype=torch.int32),
            "loss_mask": torch.tensor(self.loss_mask, dtype=torch.uint8),
            "rollout_log_probs": torch.tensor(self.rollout_log_probs, dtype=torch.float32),
        }
        if self.rollout_top_p_token_ids is not None and self.rollout_top_p_token_offsets is not None:
            out["rollout_top_p_token_ids"] = self.rollout_top_p_token_ids
            out["rollout_top_p_token_offsets"] = self.rollout_top_p_token_offsets
        if self.rollout_routed_experts is not None:
            out["rollout_routed_experts"] = self.rollout_routed_experts
        return out


@dataclass
class Sample:
    """A faithful stand-in for slime's ``slime.utils.types.Sample``: the fields and ``Status`` values the slime
    drop-in and an agent rollout (``slime_client.agent``) fill or slime reads back (the benchmarks' and the tests'
    one copy: slime itself is not importable here)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
