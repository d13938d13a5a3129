"""glibc malloc's mmap threshold for a fit (option ``malloc_mmap_threshold``; issue 30's memory target).

CPU tensors come from ``malloc``. glibc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with a mapping of its
own, unmapped when freed; smaller blocks come from the heap (an arena per thread), where freed memory stays
resident until it can be trimmed from the top. By default the threshold is dynamic: once a mapped block is freed,
the threshold rises to that block's size (up to 32 MiB), so after the first freed bucket buffer every later
gradient bucket, sliced optimizer state and step temporary is served from the heap, and the memory of the
start-up's closed engines and of the communication worker's temporaries stays resident, free, in the heaps. The
saving of a sharded optimizer state then does not show in the process's resident set (BENCHMARKS.md, "Where the
memory went"). A fixed threshold (``mallopt(M_MMAP_THRESHOLD, n)``, as the ``MALLOC_MMAP_THRESHOLD_`` environment
variable sets it) keeps every block of ``n`` bytes or more in its own mapping, returned when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any, Optional, Union

__all__ = ["AUTO_THRESHOLD", "MAX_THRESHOLD", "applied_threshold", "set_mmap_threshold"]

#: the threshold ``"auto"`` fixes (bytes): 128 KiB, glibc's own starting value
AUTO_THRESHOLD = 128 * 1024
#: the largest threshold glibc accepts on 64-bit systems (``HEAP_MAX_SIZE / 2``)
MAX_THRESHOLD = 32 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # (glibc's malloc.h)
ENV = "MALLOC_MMAP_THRESHOLD_"


def applied_threshold(option: Union[str, int, None], shard_optimizer: Any, device_type: str) -> Optional[int]:
    """The threshold (bytes) that ``option`` (``malloc_mmap_threshold``) sets for a fit, or None (glibc left as it
    is): ``"auto"``: :data:`AUTO_THRESHOLD` when ``shard_optimizer`` is on (True or ``"auto"``) and the parameters
    are CPU tensors (``device_type``), unless the environment sets ``MALLOC_MMAP_THRESHOLD_`` (the user's choice,
    read by glibc at start); an integer: that many bytes for any fit; None: nothing."""
    if option is None:
        return None
    if option == "auto":
        if not shard_optimizer or device_type != "cpu" or ENV in os.environ:
            return None
        return AUTO_THRESHOLD
    return int(option)


def set_mmap_threshold(nbytes: int) -> Optional[str]:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` in this process (for every thread, until it exits; glibc's dynamic
    threshold is off from then on), then ``malloc_trim(0)`` (the free memory already in the heaps is returned).
    Returns None when applied, else why not (not Linux with glibc, or glibc refused the value)."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError) as exc:
        return f"no glibc malloc here ({exc})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return f"glibc refused mallopt(M_MMAP_THRESHOLD, {nbytes})"
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return None
