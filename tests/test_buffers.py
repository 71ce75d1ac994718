"""GrowableArray: the contiguous, amortized-O(1)-append buffer behind every session field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gateway.buffers import GROWTH_FACTOR, MIN_GROWTH_ITEMS, GrowableArray


def capacity(buffer: GrowableArray) -> int:
    """Items the buffer holds room for, derived from its public ``nbytes``."""
    row_bytes = buffer.dtype.itemsize * math.prod(buffer.row_shape)
    return buffer.nbytes // row_bytes


def reallocations(appends: int) -> int:
    """How many times the buffer reallocates over ``appends`` single-item appends (capacity changes)."""
    buffer = GrowableArray(np.int32)
    count, last = 0, capacity(buffer)
    for i in range(appends):
        buffer.append_repeat(i, 1)
        if capacity(buffer) != last:
            count, last = count + 1, capacity(buffer)
    assert buffer.view().tolist() == list(range(appends))
    return count


def test_append_and_append_repeat() -> None:
    buffer = GrowableArray(np.int32)
    assert len(buffer) == 0 and buffer.view().tolist() == []
    buffer.append(np.array([1, 2, 3]))
    buffer.append_repeat(7, 2)
    buffer.append(np.array([], dtype=np.int32))
    buffer.append_repeat(9, 0)
    buffer.append_repeat(9, -1)
    buffer.append([4])  # any sequence numpy can assign
    assert len(buffer) == 6
    assert buffer.view().tolist() == [1, 2, 3, 7, 7, 4]
    assert buffer.last() == 4 and isinstance(buffer.last(), int)
    assert buffer.dtype == np.int32


def test_rows_of_fixed_shape() -> None:
    buffer = GrowableArray(np.uint8, (3, 2))
    rows = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)
    buffer.append(rows)
    buffer.append(rows[:1])
    assert buffer.row_shape == (3, 2)
    assert buffer.view().shape == (3, 3, 2)
    np.testing.assert_array_equal(buffer.view(), np.concatenate([rows, rows[:1]]))


def test_from_array_is_exact_and_copies() -> None:
    source = np.array([[1, 2], [3, 4]], dtype=np.int64)
    buffer = GrowableArray.from_array(source, np.int32)
    assert (buffer.dtype, buffer.row_shape, len(buffer), capacity(buffer)) == (np.int32, (2,), 2, 2)
    source[0, 0] = 99
    assert buffer.view().tolist() == [[1, 2], [3, 4]]
    empty = GrowableArray.from_array(np.array([], dtype=np.float32))
    assert (len(empty), empty.nbytes) == (0, 0)


def test_view_is_read_only_and_not_a_copy() -> None:
    buffer = GrowableArray.from_array(np.array([1, 2, 3], dtype=np.int32))
    view = buffer.view()
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 5
    assert np.shares_memory(view, buffer.view())
    buffer.append_repeat(4, 1)  # the buffer itself stays writable
    assert buffer.view().tolist() == [1, 2, 3, 4]
    assert view.tolist() == [1, 2, 3]


def test_replace_tail_never_writes_over_visible_items() -> None:
    buffer = GrowableArray.from_array(np.arange(5, dtype=np.int32))
    snapshot = buffer.view()  # e.g. handed to a thread encoding the sample
    buffer.replace_tail(2, np.array([7, 8, 9], dtype=np.int32))
    assert buffer.view().tolist() == [0, 1, 7, 8, 9]
    assert snapshot.tolist() == [0, 1, 2, 3, 4]  # the earlier view is still a valid snapshot
    buffer.replace_tail(5, np.array([10], dtype=np.int32))  # keeping everything: a plain append
    assert buffer.view().tolist() == [0, 1, 7, 8, 9, 10]
    buffer.replace_tail(0, np.array([], dtype=np.int32))
    assert len(buffer) == 0


@pytest.mark.parametrize("keep", [-1, 5])
def test_replace_tail_refuses_to_keep_what_is_not_there(keep: int) -> None:
    buffer = GrowableArray.from_array(np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError):
        buffer.replace_tail(keep, np.array([1], dtype=np.int32))
    assert buffer.view().tolist() == [0, 1, 2, 3]


def test_adopt_takes_the_array_without_copying() -> None:
    values = np.arange(6, dtype=np.uint8).reshape(3, 2)
    buffer = GrowableArray.adopt(values)
    assert np.shares_memory(buffer.view(), values)
    buffer.append(np.array([[6, 7]], dtype=np.uint8))  # grows into a new array
    assert buffer.view().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert values.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_widen_keeps_values() -> None:
    buffer = GrowableArray(np.uint8, (2,))
    buffer.append(np.array([[0, 255], [7, 8]], dtype=np.uint8))
    buffer.widen(np.uint16)
    buffer.append(np.array([[300, 65_535]]))
    assert buffer.dtype == np.uint16 and buffer.row_shape == (2,)
    assert buffer.view().tolist() == [[0, 255], [7, 8], [300, 65_535]]


def test_appends_are_amortized_with_logarithmic_reallocations() -> None:
    n = 10_000
    count = reallocations(n)
    # Geometric growth: about log_{1.25}(n) reallocations (exact growth would be n), and doubling n adds only a
    # constant number more.
    assert count <= math.log(n, GROWTH_FACTOR)
    assert reallocations(2 * n) - count <= math.ceil(math.log(2, GROWTH_FACTOR)) + 1


def test_slack_stays_bounded_after_many_appends() -> None:
    rng = np.random.default_rng(0)
    for row_shape in [(), (4, 2)]:
        buffer = GrowableArray(np.uint8, row_shape)
        for size in [*rng.integers(1, 40, size=500).tolist(), 5_000, 1, 1, 3_000, *([1] * 2_000)]:
            buffer.append(np.ones((size, *row_shape), dtype=np.uint8))
            assert capacity(buffer) <= GROWTH_FACTOR * len(buffer) + MIN_GROWTH_ITEMS
        assert buffer.nbytes <= (GROWTH_FACTOR * len(buffer) + MIN_GROWTH_ITEMS) * max(1, math.prod(row_shape))


def test_first_allocation_is_exact() -> None:
    buffer = GrowableArray(np.float32)
    buffer.append(np.zeros(1_000, dtype=np.float32))
    assert capacity(buffer) == 1_000
