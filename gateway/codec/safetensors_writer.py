"""Compact samples -> bytes: safetensors, written as they are sent (``SafetensorsStream``) or whole."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from safetensors.numpy import save as safetensors_save


def encode_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """The compact sample on the wire: safetensors bytes (named tensors + string metadata)."""
    return safetensors_save({name: np.ascontiguousarray(a) for name, a in arrays.items()}, metadata=metadata)


# safetensors' names for the dtypes a sample holds
_SAFETENSORS_DTYPES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
}
STREAM_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class SafetensorsStream:
    """A safetensors file written as it is sent: the header, then each array's own bytes, so that a group of big
    samples is never copied whole (the safetensors package only writes a complete file in memory). The layout is
    the package's: an 8-byte little-endian header length, the JSON header padded with spaces to 8 bytes, the data
    with the widest dtypes first (every tensor aligned for zero-copy views); tests read it back with the package."""

    head: bytes
    arrays: tuple[np.ndarray, ...]

    @property
    def size(self) -> int:
        return len(self.head) + sum(a.nbytes for a in self.arrays)

    def chunks(self) -> Iterator[bytes | memoryview]:
        yield self.head
        for values in self.arrays:
            data = memoryview(values).cast("B")
            for start in range(0, len(data), STREAM_CHUNK_BYTES):
                yield data[start : start + STREAM_CHUNK_BYTES]


def safetensors_stream(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> SafetensorsStream:
    ordered = sorted(arrays.items(), key=lambda item: -item[1].dtype.itemsize)  # stable: names keep their order
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    contiguous = []
    for name, values in ordered:
        values = np.ascontiguousarray(values)
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[values.dtype],
            "shape": list(values.shape),
            "data_offsets": [offset, offset + values.nbytes],
        }
        offset += values.nbytes
        if values.nbytes:
            contiguous.append(values)
    header = orjson.dumps(entries)
    header += b" " * (-len(header) % 8)
    return SafetensorsStream(len(header).to_bytes(8, "little") + header, tuple(contiguous))
