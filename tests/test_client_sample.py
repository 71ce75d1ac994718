"""RolloutSample's safetensors reader: the same tensors as safetensors' own loader, and clear errors."""

from __future__ import annotations

import numpy as np
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
