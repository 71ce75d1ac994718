"""Keep freed memory in the process: big receives should land in pages that are already mapped.

glibc serves allocations of 128 KiB and more (every 256 KiB piece of a received body, every cumulative stream
event, every decode buffer) with a fresh ``mmap`` and gives the pages back on ``free``; and it trims the top of
the heap once more than a few hundred KiB lie free there. Each such allocation then costs a page fault per 4 KiB
when it is first written: about 1 ms per MB on a VM, more than receiving or parsing the bytes. A process that
receives tens of MB per request is better off keeping that memory: ``keep_freed_memory`` raises both thresholds.

Nothing changes where the thresholds were set in the environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), or on a C library without ``mallopt`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("slime_wire.memory")

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
DEFAULT_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the threshold it adapts by itself
DEFAULT_TRIM_THRESHOLD = 256 << 20  # free memory kept at the top of the heap
_ENV_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory(
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set here."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _ENV_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if done:
        log.debug("malloc: mmap threshold %d, trim threshold %d", mmap_threshold, trim_threshold)
    return done
