"""A test oracle: slime's Python-list fold (``Sample.append_response_tokens``), re-implemented minimally.

Written from slime's semantics (docs/protocol.md section 6), deliberately in slime's own style: plain Python lists
for tokens / loss mask / log-probs, torch tensors for the top-p spans and routed experts, the standard-library
base64 decoder (not the gateway's pybase64), and mutation as it goes (slime validates some things only after
it has already appended, so a failed call can leave this object half-updated: callers fold into a deep copy
when they expect a failure).

It is compared against ``gateway.sample.SessionSample`` in ``tests/test_fold.py``. Not used by the gateway.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

TOP_P_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
TOP_P_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")
FINISH_TO_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


@dataclass(frozen=True)
class ReferenceArgs:
    """The two slime CLI args the fold reads (``args.num_layers``, ``args.moe_router_topk``)."""

    num_layers: int
    moe_router_topk: int


def decode_int32_meta_array(meta_info: dict[str, Any], keys: str | Sequence[str]) -> torch.Tensor | None:
    """slime's ``decode_int32_meta_array``: the first present key, base64 of little-endian int32 -> tensor."""
    for key in (keys,) if isinstance(keys, str) else keys:
        value = meta_info.get(key)
        if value is not None:
            raw = base64.b64decode(value, validate=True)
            return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))
    return None


def _extract_top_p(meta_info: dict[str, Any], expected_num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    token_ids = decode_int32_meta_array(meta_info, TOP_P_ID_KEYS)
    offsets = decode_int32_meta_array(meta_info, TOP_P_OFFSET_KEYS)
    if token_ids is None and offsets is None:
        return None
    if token_ids is None or offsets is None:
        raise ValueError("top-p token replay must include both token ids and offsets")
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        raise ValueError(f"top-p token offsets must start with 0, got {offsets[:1].tolist()}")
    if int(offsets[-1]) != token_ids.numel():
        raise ValueError(f"top-p offsets[-1]={int(offsets[-1])} != len(token_ids)={token_ids.numel()}")
    if offsets.numel() != expected_num_tokens + 1:
        raise ValueError(f"len(top-p offsets)={offsets.numel()} != generated tokens + 1 = {expected_num_tokens + 1}")
    return token_ids, offsets


def _merge_top_p(
    base_ids: torch.Tensor, base_offsets: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    base_offset = int(base_offsets[-1])
    return torch.cat([base_ids, ids]), torch.cat([base_offsets, offsets[1:] + base_offset])


@dataclass
class ReferenceSample:
    """The slice of slime's ``Sample`` that the fold touches."""

    tokens: list[int]
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    rollout_top_p_token_ids: torch.Tensor | None = None
    rollout_top_p_token_offsets: torch.Tensor | None = None
    rollout_routed_experts: torch.Tensor | None = None
    status: str = "pending"
    weight_versions: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    def append_response_tokens(
        self,
        args: ReferenceArgs | None,
        *,
        tokens: Sequence[int],
        log_probs: Sequence[float] | None = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        tokens = [int(token) for token in tokens]
        log_probs = None if log_probs is None else [float(value) for value in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities")
            log_probs = [0.0] * len(tokens)

        if text is not None:
            self.response += text
        self.tokens += tokens
        self.response_length += len(tokens)
        self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            self.rollout_log_probs += log_probs

        pad_missing_top_p = bool(tokens and not trainable)
        if meta_info is not None or pad_missing_top_p:
            self._apply_meta_info(
                args,
                meta_info or {},
                new_token_count=len(tokens),
                pad_missing_top_p=pad_missing_top_p,
                update_terminal_info=update_terminal_info,
            )
        self._validate_lengths()

    def _apply_meta_info(
        self,
        args: ReferenceArgs | None,
        meta_info: dict[str, Any],
        *,
        new_token_count: int,
        pad_missing_top_p: bool,
        update_terminal_info: bool,
    ) -> None:
        applied_top_p = False
        if new_token_count:
            top_p = _extract_top_p(meta_info, new_token_count)
            if top_p is not None:
                applied_top_p = True
                if self.rollout_top_p_token_ids is None and self.rollout_top_p_token_offsets is None:
                    self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = top_p
                else:
                    assert self.rollout_top_p_token_ids is not None and self.rollout_top_p_token_offsets is not None
                    self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = _merge_top_p(
                        self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets, *top_p
                    )
        if pad_missing_top_p and new_token_count and self.rollout_top_p_token_offsets is not None and not applied_top_p:
            offsets = self.rollout_top_p_token_offsets
            self.rollout_top_p_token_offsets = torch.cat(
                [offsets, offsets.new_full((new_token_count,), int(offsets[-1]))]
            )

        routed = decode_int32_meta_array(meta_info, "routed_experts")
        if routed is not None:
            self._apply_routed_experts(args, routed, int(meta_info.get("routed_experts_start_len", 0) or 0))

        if not update_terminal_info or "finish_reason" not in meta_info:
            return
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)
        if new_token_count > 0 and "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        status = FINISH_TO_STATUS.get(meta_info["finish_reason"]["type"])
        if status is not None:
            self.status = status

    def _apply_routed_experts(self, args: ReferenceArgs | None, routed: torch.Tensor, start_len: int) -> None:
        if args is None:
            raise ValueError("args is required to decode routed experts metadata")
        if start_len < 0:
            raise ValueError(f"routed_experts_start_len must be non-negative, got {start_len}")
        expected_rows = max(0, len(self.tokens) - 1 - start_len)
        expected_numel = expected_rows * args.num_layers * args.moe_router_topk
        if routed.numel() != expected_numel:
            raise ValueError(f"routed_experts has {routed.numel()} elements, expected {expected_numel}")
        routed = routed.reshape(expected_rows, args.num_layers, args.moe_router_topk)
        if start_len == 0:
            self.rollout_routed_experts = routed
            return
        existing_rows = 0 if self.rollout_routed_experts is None else int(self.rollout_routed_experts.shape[0])
        if existing_rows == 0:
            raise ValueError(f"cannot append partial routed experts without existing ones (start_len={start_len})")
        if existing_rows < start_len:
            raise ValueError(f"existing routed experts ({existing_rows} rows) shorter than start_len={start_len}")
        assert self.rollout_routed_experts is not None
        self.rollout_routed_experts = torch.cat([self.rollout_routed_experts[:start_len], routed], dim=0)

    def _validate_lengths(self) -> None:
        if len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length {self.response_length}"
            )
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is None and offsets is None:
            return
        if ids is None or offsets is None:
            raise ValueError("rollout top-p replay must include both token ids and offsets")
        if offsets.numel() != self.response_length + 1:
            raise ValueError(
                f"len(top-p offsets)={offsets.numel()} != response_length + 1 = {self.response_length + 1}"
            )
        if int(offsets[-1]) != ids.numel():
            raise ValueError(f"top-p offsets[-1]={int(offsets[-1])} != len(token_ids)={ids.numel()}")
