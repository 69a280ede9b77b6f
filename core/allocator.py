"""Keep freed memory inside the process (glibc malloc) for CPU runs.

CPU training, capture and evaluation allocate and free tensors of tens to hundreds of
MB every step ([N, Vd] logits, [B, H, T, T] scores). glibc serves blocks over its mmap
threshold with fresh mmaps and unmaps them on free, so every step page-faults the same
memory in again; on the 2-core reference machine that makes an elementwise op over such
a tensor ~3x slower than its arithmetic. Turning off mmap-served blocks and heap trimming
keeps the pages mapped for reuse. The price: the process's resident memory stays at its
peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above, once per process. A no-op (False) off Linux/glibc or
    with EYAS_KEEP_FREED_MEMORY=0 in the environment. Returns whether it is in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("EYAS_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: leave its defaults alone
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return _applied
