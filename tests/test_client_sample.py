"""RolloutSample's safetensors reader: the same tensors as safetensors' own loader, and clear errors."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import torch
from safetensors.numpy import save
from safetensors.torch import load

from slime_client import GatewayResponseError
from slime_client.sample import _load_tensors


def sample_bytes() -> bytes:
    rng = np.random.default_rng(0)
    arrays = {
        "tokens": rng.integers(0, 1000, 50, dtype=np.int32),
        "loss_mask": np.ones(40, np.uint8),
        "rollout_log_probs": -rng.random(40, dtype=np.float32),
        "rollout_routed_experts": rng.integers(0, 128, (49, 4, 2)).astype(np.uint8),
        "empty": np.zeros((0, 3), np.int32),
    }
    return save(arrays, metadata={"status": "completed"})


def test_matches_safetensors_own_loader_without_copying() -> None:
    body = sample_bytes()
    ours, reference = _load_tensors(body), load(body)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape
        torch.testing.assert_close(ours[name], tensor)
    # Zero-copy: the tensors' data lies inside the body itself.
    start = np.frombuffer(body, np.uint8).ctypes.data
    assert start <= ours["rollout_routed_experts"].data_ptr() < start + len(body)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda b: b[:4],
        lambda b: (10**9).to_bytes(8, "little") + b[8:],
        lambda b: b[:-10],  # the last tensor's data runs past the end
        lambda b: b.replace(b'"U8"', b'"Q8"', 1),
    ],
)
def test_malformed_bodies_are_clear_errors(corrupt) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(GatewayResponseError):
        _load_tensors(corrupt(sample_bytes()))


def test_tensors_view_a_numpy_body_in_place() -> None:
    """What GatewayClient hands over: the body received into a numpy buffer; the tensors are views of it, writable."""
    body = np.frombuffer(sample_bytes(), np.uint8).copy()
    tensors = _load_tensors(body)
    routing = tensors["rollout_routed_experts"]
    assert body.ctypes.data <= routing.data_ptr() < body.ctypes.data + len(body)
    routing[0, 0, 0] = 200
    assert 200 in body  # the same memory, no copy
    tokens = tensors["tokens"]
    expected = tokens.tolist()
    del body, tensors, routing
    assert tokens.tolist() == expected  # the tensors keep their buffer alive


def test_an_unaligned_entry_is_read_right() -> None:
    """torch views bytes as int32 only at an aligned offset; an entry that is not (safetensors writers align every
    entry, other writers may not) is copied rather than refused."""
    entries = {
        "byte": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "ints": {"dtype": "I32", "shape": [2, 1], "data_offsets": [1, 9]},
    }
    header = orjson.dumps(entries)
    header += b" " * (-len(header) % 8)
    data = b"\x07" + np.array([5, -6], np.int32).tobytes()
    body = len(header).to_bytes(8, "little") + header + data
    tensors = _load_tensors(body)
    assert tensors["byte"].tolist() == [7]
    assert tensors["ints"].tolist() == [[5], [-6]] and tensors["ints"].dtype == torch.int32


def test_big_receive_buffers_are_reused_once_nothing_views_them() -> None:
    from slime_client.sample import POOLED_BODY_BYTES, SampleBuffers

    buffers = SampleBuffers(pool_bytes=3 * POOLED_BODY_BYTES)
    small = buffers.take(1024)
    assert small.base is None and len(small) == 1024  # ordinary bodies: malloc's own reuse, nothing kept
    first = buffers.take(POOLED_BODY_BYTES)
    tensor = torch.from_numpy(first[16:32])  # a sample's tensor viewing the body
    first_base = id(first.base)  # not a reference: one would keep the buffer "viewed"
    del first
    second = buffers.take(POOLED_BODY_BYTES)
    assert id(second.base) != first_base  # the first body is still viewed: not handed out again
    del tensor, second
    third = buffers.take(POOLED_BODY_BYTES)
    assert id(third.base) == first_base and len(third) == POOLED_BODY_BYTES  # free again, warm: reused
    fourth = buffers.take(2 * POOLED_BODY_BYTES)  # over the pool's bytes once kept: a buffer of its own
    assert fourth.base is None and len(fourth) == 2 * POOLED_BODY_BYTES
