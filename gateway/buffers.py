"""A growable numpy array: amortized O(new items) appends with a small, bounded over-allocation.

numpy has no append-in-place (``np.append`` copies the whole array), and a Python list costs ~36 bytes per
int; this keeps the session state in one contiguous buffer per field, like ``std::vector``.
"""

from __future__ import annotations

import secrets

import numpy as np
import numpy.typing as npt

# 1.25x keeps the worst-case slack at 25% (the memory goal is bytes-per-token close to the payload) while
# still making n appends cost O(n) in total.
GROWTH_FACTOR = 1.25
MIN_GROWTH_ITEMS = 64


class GrowableArray:
    """A 1-D (or rows-of-fixed-shape) array that grows at the end."""

    __slots__ = ("_data", "_len", "generation")

    def __init__(self, dtype: npt.DTypeLike, row_shape: tuple[int, ...] = (), capacity: int = 0) -> None:
        self._data = np.empty((capacity, *row_shape), dtype=dtype)
        self._len = 0
        # Changes whenever items already there change (a cut, a replaced tail, a wider dtype), and differs between
        # arrays: while it stays the same, the items only grew at the end, so a persistent store appends only the
        # new ones (``gateway.redis_store``).
        self.generation = secrets.randbits(62)

    @classmethod
    def from_array(cls, values: np.ndarray, dtype: npt.DTypeLike | None = None) -> GrowableArray:
        array = np.asarray(values, dtype=dtype)
        buf = cls(array.dtype, array.shape[1:], capacity=len(array))
        buf.append(array)
        return buf

    @classmethod
    def adopt(cls, values: np.ndarray) -> GrowableArray:
        """Take ``values`` (C-contiguous) as the buffer itself, without a copy. The caller gives the array up: it
        must not write to it afterwards (the buffer never writes over its visible items either, see
        ``replace_tail``, and grows into a new array)."""
        if not values.flags.c_contiguous:
            return cls.from_array(values)
        buf = cls(values.dtype, values.shape[1:])
        buf._data, buf._len = values, len(values)
        return buf

    def __len__(self) -> int:
        return self._len

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes held in the buffer, slack included (what the process actually keeps resident)."""
        return self._data.nbytes

    def view(self) -> np.ndarray:
        """The live items, without copying. Read-only so callers cannot corrupt the session state."""
        out = self._data[: self._len]
        out.flags.writeable = False
        return out

    def last(self) -> int | float:
        return self._data[self._len - 1].item()

    def append(self, values: np.ndarray) -> None:
        n = len(values)
        if n == 0:
            return
        self._reserve(self._len + n)
        self._data[self._len : self._len + n] = values
        self._len += n

    def append_repeat(self, value: int | float, count: int) -> None:
        if count <= 0:
            return
        self._reserve(self._len + count)
        self._data[self._len : self._len + count] = value
        self._len += count

    def replace_tail(self, keep: int, values: np.ndarray) -> None:
        """Keep the first ``keep`` items and append ``values``, never writing over visible items in place.

        Views handed out earlier (e.g. to a thread encoding the sample) stay valid snapshots: when the new
        items would land on visible ones, the data moves to a fresh array instead.
        """
        if not 0 <= keep <= self._len:
            raise ValueError(f"cannot keep {keep} of {self._len} items")
        if keep < self._len:
            self.generation += 1
            fresh = np.empty((keep + len(values), *self._data.shape[1:]), dtype=self._data.dtype)
            fresh[:keep] = self._data[:keep]
            self._data, self._len = fresh, keep
        self.append(values)

    def truncate(self, keep: int) -> None:
        """Drop the items past ``keep``, keeping the capacity. The kept items move to a fresh array, so views handed
        out earlier stay valid snapshots (as in ``replace_tail``)."""
        if not 0 <= keep <= self._len:
            raise ValueError(f"cannot keep {keep} of {self._len} items")
        if keep < self._len:
            self.generation += 1
        fresh = np.empty_like(self._data)
        fresh[:keep] = self._data[:keep]
        self._data, self._len = fresh, keep

    def widen(self, dtype: npt.DTypeLike) -> None:
        """Switch to a wider dtype (e.g. uint8 -> uint16 routing ids) keeping the values."""
        self._data = self._data.astype(dtype)
        self.generation += 1

    def _reserve(self, needed: int) -> None:
        capacity = len(self._data)
        if needed <= capacity:
            return
        # The first allocation is exact (most sessions are one or two big turns); later ones grow geometrically.
        new_capacity = needed if capacity == 0 else max(needed, int(capacity * GROWTH_FACTOR) + MIN_GROWTH_ITEMS)
        grown = np.empty((new_capacity, *self._data.shape[1:]), dtype=self._data.dtype)
        grown[: self._len] = self._data[: self._len]
        self._data = grown
