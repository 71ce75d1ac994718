"""``RolloutSample``: a session's compact sample as torch tensors, read from the gateway's safetensors bytes.

The wire format (``GET /v1/sessions/{id}/sample``) is one safetensors file: tensors ``tokens`` int32, ``loss_mask``
uint8, ``rollout_log_probs`` float32, ``rollout_weight_version_ids`` int32 (per response token, an index into the
``weight_version_table`` metadata; -1: tool token or unknown version), optional ``rollout_top_p_token_ids`` /
``..._offsets`` int32 and ``rollout_routed_experts`` [rows, L, K] in the narrowest unsigned type; string metadata
(scalars as text, structures as JSON). ``POST /v1/samples`` packs a group into one file: tensors named
``{i}/{field}`` and the per-sample metadata as a JSON list under ``samples``. Tensors come from
``safetensors.torch.load`` (one buffer copy per tensor, no per-token Python objects); only ``to_slime`` builds the
Python lists slime wants.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import torch

from slime_client.errors import GatewayResponseError
from slime_client.types import TurnResult

# What a sample is read from: the bytes of an answer, or the buffer ``GatewayClient`` received it into.
SampleBody = bytes | bytearray | memoryview | np.ndarray

SAFETENSORS_HEADER_SIZE_BYTES = 8
# safetensors dtype names -> torch dtypes (the ones a sample can hold, and the common rest).
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
# torch dtype -> the numpy dtype its bytes are viewed as (numpy has no bfloat16: its bits, as uint16).
_NUMPY_VIEWS: dict[torch.dtype, type[np.generic]] = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.uint16: np.uint16,
    torch.int16: np.int16,
    torch.uint32: np.uint32,
    torch.int32: np.int32,
    torch.uint64: np.uint64,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}
GROUP_METADATA_KEY = "samples"


@dataclass(slots=True)
class RolloutSample:
    """One session's sample, ready to train on (slime ``Sample`` field names)."""

    session_id: str
    status: str
    tokens: torch.Tensor  # int32 [prompt + response]
    loss_mask: torch.Tensor  # uint8 [response_length]: 1 model tokens, 0 tool/environment tokens
    rollout_log_probs: torch.Tensor  # float32 [response_length]: 0.0 for tool tokens
    response: str
    response_length: int
    prompt_length: int
    weight_versions: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    rollout_top_p_token_ids: torch.Tensor | None = None  # int32, only with top-p replay
    rollout_top_p_token_offsets: torch.Tensor | None = None  # int32 [response_length + 1]
    rollout_routed_experts: torch.Tensor | None = None  # [rows, L, K] uint8/uint16/uint32 as stored
    # Which weights produced each response token: int32 [response_length], an index into ``weight_version_table``,
    # -1 for tool/environment tokens and unknown versions (None from a gateway that predates them). Not a slime
    # ``Sample`` field: ``to_slime`` leaves it out; read it here for per-token off-policy correction.
    rollout_weight_version_ids: torch.Tensor | None = None
    weight_version_table: list[str] = field(default_factory=list)
    # The versions its trained tokens come from (the gateway's summary: first, last, count, tokens per version,
    # unknown_tokens); ``slime_client.staleness`` bounds how far behind they may be.
    trained_versions: dict[str, Any] = field(default_factory=dict)
    num_layers: int | None = None
    moe_router_topk: int | None = None
    spec_counters: dict[str, int] = field(default_factory=dict)
    turns: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    # A chat session grows a tree of branches (edited histories, side conversations), each its own sample: this
    # one's index, how many the session has, and where this one stands (its parent, the tokens it shares with it,
    # the first message that differed, why it exists, the model name of the request that started it).
    branch: int = 0
    branches: int = 1
    parent: int | None = None
    fork_token: int = 0
    first_difference: int | None = None
    cause: str | None = None
    model: str | None = None
    # A chat branch: slime's per-sample flags over its whole conversation (``use_tool``, ``ill_formed``); empty for
    # a token-level session's sample.
    chat: dict[str, bool] = field(default_factory=dict)

    # ---- reading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_safetensors(cls, body: SampleBody) -> RolloutSample:
        """One sample from the bytes of ``GET /v1/sessions/{id}/sample`` (any buffer: the tensors view it)."""
        header, data_start = read_safetensors_header(body)
        return cls.from_parts(_tensors_from_header(body, header, data_start), _metadata(header))

    @classmethod
    def group_from_safetensors(cls, body: SampleBody) -> list[RolloutSample]:
        """A group from the bytes of ``POST /v1/samples`` (request order; a session with branches gives one sample
        per branch, in branch order)."""
        header, data_start = read_safetensors_header(body)
        metadata = _metadata(header)
        try:
            per_sample = orjson.loads(metadata[GROUP_METADATA_KEY])
        except (KeyError, orjson.JSONDecodeError) as exc:
            raise GatewayResponseError(f"group sample has no valid {GROUP_METADATA_KEY!r} metadata") from exc
        grouped: list[dict[str, torch.Tensor]] = [{} for _ in per_sample]
        for name, tensor in _tensors_from_header(body, header, data_start).items():
            index, slash, field_name = name.partition("/")
            if not (slash and index.isdigit() and int(index) < len(grouped)):
                raise GatewayResponseError(f"group sample has an unexpected tensor name {name!r}")
            grouped[int(index)][field_name] = tensor
        return [cls.from_parts(tensors, meta) for tensors, meta in zip(grouped, per_sample, strict=True)]

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> RolloutSample:
        try:
            return cls(
                session_id=meta["session_id"],
                status=meta["status"],
                tokens=tensors["tokens"],
                loss_mask=tensors["loss_mask"],
                rollout_log_probs=tensors["rollout_log_probs"],
                response=meta.get("response", ""),
                response_length=int(meta["response_length"]),
                prompt_length=int(meta["prompt_length"]),
                weight_versions=_json_field(meta, "weight_versions", []),
                cached_tokens=int(meta.get("cached_tokens", 0)),
                prompt_tokens=int(meta.get("prompt_tokens", 0)),
                rollout_top_p_token_ids=tensors.get("rollout_top_p_token_ids"),
                rollout_top_p_token_offsets=tensors.get("rollout_top_p_token_offsets"),
                rollout_routed_experts=tensors.get("rollout_routed_experts"),
                rollout_weight_version_ids=tensors.get("rollout_weight_version_ids"),
                weight_version_table=_json_field(meta, "weight_version_table", []),
                trained_versions=_json_field(meta, "trained_versions", {}),
                num_layers=_optional_int(meta, "num_layers"),
                moe_router_topk=_optional_int(meta, "moe_router_topk"),
                spec_counters=_json_field(meta, "spec_counters", {}),
                turns=int(meta.get("turns", 0)),
                metadata=_json_field(meta, "metadata", {}),
                branch=int(meta.get("branch", 0)),
                branches=int(meta.get("branches", 1)),
                parent=_optional_int(meta, "parent"),
                fork_token=int(meta.get("fork_token") or 0),
                first_difference=_optional_int(meta, "first_difference"),
                cause=meta.get("cause") or None,
                model=meta.get("model") or None,
                chat=_json_field(meta, "chat", {}),
            )
        except (KeyError, ValueError, orjson.JSONDecodeError) as exc:
            raise GatewayResponseError(f"sample is missing or has an invalid field: {exc!r}") from exc

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return len(self.tokens)

    def token_weight_versions(self) -> list[str | None] | None:
        """The weight version of each response token (None: a tool token or an unknown version); None when the
        gateway sent no per-token versions. A Python list per token: for inspection, not for training loops."""
        ids = self.rollout_weight_version_ids
        if ids is None:
            return None
        table = self.weight_version_table
        return [None if i < 0 else table[i] for i in ids.tolist()]

    def routed_experts_int32(self) -> torch.Tensor | None:
        """Routing as slime trains on it: int32 ``[rows, num_layers, topk]`` (a copy, widened)."""
        routed = self.rollout_routed_experts
        return None if routed is None else routed.to(torch.int32, copy=True)

    def check_invariants(self) -> None:
        """docs/protocol.md section 6.6 invariants; raises ``GatewayResponseError`` if the sample breaks them."""
        n = self.response_length
        problems = []
        if len(self.tokens) != self.prompt_length + n:
            problems.append(f"len(tokens)={len(self.tokens)} != prompt_length + response_length")
        if not len(self.loss_mask) == len(self.rollout_log_probs) == n:
            problems.append(f"loss_mask/log_probs lengths {len(self.loss_mask)}/{len(self.rollout_log_probs)} != {n}")
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is not None and offsets is not None and (len(offsets) != n + 1 or int(offsets[-1]) != len(ids)):
            problems.append("top-p offsets do not cover the response / the ids")
        routed = self.rollout_routed_experts
        if routed is not None and (routed.dim() != 3 or len(routed) > max(0, len(self.tokens) - 1)):
            problems.append(f"routed experts shape {tuple(routed.shape)} does not fit {len(self.tokens)} tokens")
        problems += self._weight_version_problems()
        if problems:
            raise GatewayResponseError(f"sample {self.session_id!r}: " + "; ".join(problems))

    def _weight_version_problems(self) -> list[str]:
        ids, n = self.rollout_weight_version_ids, self.response_length
        if ids is None:
            return []
        if ids.dim() != 1 or len(ids) != n:
            return [f"weight version ids shape {tuple(ids.shape)} != ({n},)"]
        if n and not -1 <= int(ids.min()) <= int(ids.max()) < len(self.weight_version_table):
            return [f"weight version ids outside [-1, {len(self.weight_version_table)})"]
        return []

    # ---- slime -----------------------------------------------------------------------------------------------
    def to_slime(self, sample: Any, *, narrow_routing: bool = False) -> Any:
        """Write this sample onto a slime ``Sample`` (duck-typed) with slime's field types; returns ``sample``.

        Replaces the response-side fields with the session's (the session is the whole sample). Lists where
        slime keeps lists; int32 tensors for top-p spans and routed experts (what slime's fold produces), copies of
        their own (a view of the received body would carry the whole body wherever the sample is pickled).
        ``narrow_routing``: routed experts stored in uint8 (up to 256 experts) stay uint8, a quarter of the bytes
        and no widening (slime's routing replay widens the rows to int32 when it moves them to the GPU).
        Only slime's own fields: the per-token versions (``rollout_weight_version_ids``, ``weight_version_table``)
        have no ``Sample`` field, so they stay on this object; slime's per-turn ``weight_versions`` is written.
        """
        # numpy's tolist and copies: ~20% and ~2x faster than torch's for these flat CPU arrays
        sample.tokens = self.tokens.numpy().tolist()
        sample.response = self.response
        sample.response_length = self.response_length
        sample.loss_mask = self.loss_mask.numpy().tolist()
        sample.rollout_log_probs = self.rollout_log_probs.numpy().tolist()
        if self.rollout_top_p_token_ids is not None and self.rollout_top_p_token_offsets is not None:
            sample.rollout_top_p_token_ids = self.rollout_top_p_token_ids.to(torch.int32, copy=True)
            sample.rollout_top_p_token_offsets = self.rollout_top_p_token_offsets.to(torch.int32, copy=True)
        routed = self.rollout_routed_experts
        if routed is not None:
            keep = narrow_routing and routed.dtype == torch.uint8
            sample.rollout_routed_experts = (
                torch.from_numpy(routed.numpy().copy()) if keep else self.routed_experts_int32()
            )
        sample.weight_versions = list(self.weight_versions)
        sample.status = slime_status(sample, self.status)
        set_prefix_cache_totals(sample, cached_tokens=self.cached_tokens, prompt_tokens=self.prompt_tokens)
        return sample


@dataclass(slots=True)
class TurnTensors:
    """One model turn as the gateway answers it with ``Accept: application/vnd.safetensors`` (``Session.generate_turn``,
    ``GatewayClient.start_session``): the turn's own tensors, so that a caller folding turns itself never fetches the
    session's history. Tensors view the received body (no copy)."""

    result: TurnResult  # the summary (``result.new_token_ids`` is empty here: ``tokens`` has them)
    tokens: torch.Tensor  # int32 [n]: this turn's new token ids
    loss_mask: torch.Tensor  # uint8 [n]: ones
    rollout_log_probs: torch.Tensor  # float32 [n]
    rollout_top_p_token_ids: torch.Tensor | None  # int32, with top-p replay
    rollout_top_p_token_offsets: torch.Tensor | None  # int32 [n + 1], from 0
    # The routing rows this turn brought, [rows, L, K] as stored (uint8 up to 256 experts): they replace the caller's
    # rows from ``routed_experts_first_row`` on (slime's fold with ``routed_experts_start_len``).
    rollout_routed_experts: torch.Tensor | None
    routed_experts_first_row: int | None
    rollout_weight_version_ids: torch.Tensor | None  # int32 [n], indexes ``weight_version_table``
    weight_version_table: list[str]

    @classmethod
    def from_safetensors(cls, body: SampleBody) -> TurnTensors:
        header, data_start = read_safetensors_header(body)
        meta = _metadata(header)
        tensors = _tensors_from_header(body, header, data_start)
        try:
            summary = orjson.loads(meta["turn"])
            return cls(
                result=TurnResult.from_json({"new_token_ids": [], **summary}),
                tokens=tensors["tokens"],
                loss_mask=tensors["loss_mask"],
                rollout_log_probs=tensors["rollout_log_probs"],
                rollout_top_p_token_ids=tensors.get("rollout_top_p_token_ids"),
                rollout_top_p_token_offsets=tensors.get("rollout_top_p_token_offsets"),
                rollout_routed_experts=tensors.get("rollout_routed_experts"),
                routed_experts_first_row=_optional_int(meta, "routed_experts_first_row"),
                rollout_weight_version_ids=tensors.get("rollout_weight_version_ids"),
                weight_version_table=_json_field(meta, "weight_version_table", []),
            )
        except (KeyError, ValueError, orjson.JSONDecodeError) as exc:
            raise GatewayResponseError(f"a turn's tensors without the expected fields: {exc!r}") from exc

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def slime_status(sample: Any, value: str) -> Any:
    """``Sample.Status(value)`` when the sample's class has slime's ``Status`` enum, else the string."""
    status_enum = getattr(type(sample), "Status", None)
    return value if status_enum is None else status_enum(value)


def set_prefix_cache_totals(sample: Any, *, cached_tokens: int, prompt_tokens: int) -> None:
    """slime's ``PrefixCacheInfo`` (cached_tokens, total_prompt_tokens), when the sample has one.

    Set to the session's totals rather than added: the session's counters already sum every turn of this
    sample, so adding them to whatever the sample held would count earlier turns twice.
    """
    info = getattr(sample, "prefix_cache_info", None)
    if info is None:
        return
    info.cached_tokens = cached_tokens
    info.total_prompt_tokens = prompt_tokens


# glibc's largest mmap threshold (``keep_freed_memory`` sets it): below it a freed body's malloc memory is reused warm,
# above it every allocation is a fresh map whose pages fault in (~1 ms per MB here): a group of 64 big samples,
# ~250 MB, would cost a quarter of a second of page faults per training step.
POOLED_BODY_BYTES = 32 << 20
DEFAULT_POOL_BYTES = 1 << 30


class SampleBuffers:
    """Receive memory for sample bodies: ``new_sample_buffer``'s for ordinary ones; a big body (a group) gets a kept
    buffer back once nothing views the previous body in it any more (the tensors of a finished training step were
    dropped), so a training loop's group fetches reuse warm memory. At most ``pool_bytes`` are kept."""

    def __init__(self, pool_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self._pool_bytes = pool_bytes
        self._kept: list[np.ndarray] = []

    def take(self, size: int) -> np.ndarray:
        if size < POOLED_BODY_BYTES:
            return new_sample_buffer(size)
        for kept in self._kept:
            # References: the list, this loop's name, getrefcount's argument. One more is a view still alive (the
            # tensors of a previous body keep their views, and the views this buffer).
            if len(kept) >= size and sys.getrefcount(kept) <= 3:
                return kept[:size]
        buffer = new_sample_buffer(size)
        if sum(len(kept) for kept in self._kept) + size <= self._pool_bytes:
            self._kept.append(buffer)
            return buffer[:size]
        return buffer


def new_sample_buffer(size: int) -> np.ndarray:
    """Memory for a sample's body, which ``GatewayClient`` receives straight into and the sample's tensors then
    view: ``malloc``'s, owned by a numpy array that the tensors keep alive and free with the last of them. Not a
    recycled receive buffer (it cannot be reused while tensors view it), not an anonymous map (fresh pages fault in
    at ~1 ms per MB on a VM), not a ``bytearray`` (which zero-fills): with ``keep_freed_memory`` in force (see
    ``slime_client.client.keep_freed_memory_once``) a freed sample's memory is reused warm for the next one."""
    return np.empty(size, np.uint8)


def read_safetensors_header(body: SampleBody) -> tuple[dict[str, Any], int]:
    """(the header JSON, where the data starts). The format is an 8-byte little-endian length, then the JSON."""
    view = _bytes_view(body)
    if len(view) < SAFETENSORS_HEADER_SIZE_BYTES:
        raise GatewayResponseError(f"sample body is {len(view)} bytes, too short for safetensors")
    header_size = int.from_bytes(view[:SAFETENSORS_HEADER_SIZE_BYTES], "little")
    header_end = SAFETENSORS_HEADER_SIZE_BYTES + header_size
    if header_end > len(view):
        raise GatewayResponseError("safetensors header is longer than the sample body")
    try:
        header = orjson.loads(view[SAFETENSORS_HEADER_SIZE_BYTES:header_end])
    except orjson.JSONDecodeError as exc:
        raise GatewayResponseError(f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise GatewayResponseError("safetensors header is not a JSON object")
    return header, header_end


def read_safetensors_metadata(body: SampleBody) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (safetensors' Python API reads it only from files)."""
    return _metadata(read_safetensors_header(body)[0])


def _metadata(header: dict[str, Any]) -> dict[str, str]:
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _bytes_view(body: SampleBody) -> memoryview:
    view = memoryview(body)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _load_tensors(body: SampleBody) -> dict[str, torch.Tensor]:
    """Tensors as zero-copy views into the response body (``torch.frombuffer`` at each tensor's offsets)."""
    header, data_start = read_safetensors_header(body)
    return _tensors_from_header(body, header, data_start)


def _tensors_from_header(body: SampleBody, header: dict[str, Any], data_start: int) -> dict[str, torch.Tensor]:
    """Tensors as zero-copy views into the response body: numpy views of the body at each tensor's offsets, handed to
    ``torch.from_numpy`` (right after a multi-megabyte receive the CPU's caches are cold, and this costs about half
    of a ``torch.frombuffer`` per tensor or of slicing one torch tensor over the body).

    ``safetensors.torch.load`` copies every tensor out of the bytes (~10x this for a 4 MB MoE sample), and its
    zero-copy API needs a file; the format (8-byte length, JSON header, raw data) is simple enough to map
    directly. The tensors share the body's memory, which nothing else holds (they keep its owner alive): a body
    received by ``GatewayClient`` is a writable buffer of the sample's own; over ``bytes``, ``.clone()`` a tensor
    before writing to it in place (``to_slime`` and ``routed_experts_int32`` already hand out copies).
    """
    view = _bytes_view(body)
    if isinstance(body, np.ndarray) and body.dtype == np.uint8 and body.ndim == 1:
        array = body
    else:
        array = np.frombuffer(view, np.uint8)
    specs = [(name, spec) for name, spec in header.items() if name != "__metadata__"]
    if array.flags.writeable:
        return {name: _tensor_view(array, data_start, name, spec) for name, spec in specs}
    with warnings.catch_warnings():
        # torch warns that a bytes object is not writable; the views are handed out as documented above.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return {name: _tensor_view(array, data_start, name, spec) for name, spec in specs}


def _tensor_view(array: np.ndarray, data_start: int, name: str, spec: Any) -> torch.Tensor:
    try:
        dtype = SAFETENSORS_DTYPES[spec["dtype"]]
        shape = [int(dim) for dim in spec["shape"]]
        begin, end = (data_start + int(offset) for offset in spec["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise GatewayResponseError(f"safetensors entry {name!r} is invalid: {spec!r:.200}") from exc
    count, size = math.prod(shape), len(array)
    if not data_start <= begin <= end <= size or end - begin != count * dtype.itemsize or min(shape, default=0) < 0:
        raise GatewayResponseError(f"safetensors entry {name!r} has offsets that do not match its shape and dtype")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    values = array[begin:end].view(_NUMPY_VIEWS[dtype])  # numpy takes any offset (safetensors writers align them)
    tensor = torch.from_numpy(values if len(shape) == 1 else values.reshape(shape))
    return tensor if tensor.dtype == dtype else tensor.view(dtype)  # bfloat16: numpy has none, its bits as uint16


def _json_field(meta: dict[str, str], key: str, default: Any) -> Any:
    value = meta.get(key)
    return default if value is None else orjson.loads(value)


def _optional_int(meta: dict[str, str], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None or value == "" else int(value)  # "": none (safetensors metadata is all text)
