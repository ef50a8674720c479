"""Keep freed memory in the process (glibc): a large CPU tensor is not page-faulted in afresh at every step.

glibc's ``malloc`` serves a block over its mmap threshold (at most 32 MB) with a fresh ``mmap`` and gives it
back to the kernel on ``free``. A training step on CPU allocates many such blocks and frees them within the
step: at a 49k vocabulary the tied embedding's gradient is [49,152, 576] fp32 (113 MB, zero-filled by the
embedding's backward), its bf16 cast and fp32 recast are as large, and each head chunk's logits are [256,
49,152] (50 MB). Every one is then faulted in page by page, and the kernel zeroes each page first: on
SmolLM2-135M's bf16 update (40 sequences, micro-batches of 8) those faults cost a fifth to a quarter of the
update (docs/performance.md, "Where the bf16 update goes").

``keep_freed_memory`` turns both off with ``mallopt``: no mmap for large blocks (``M_MMAP_MAX`` 0) and no
return of the heap's free top to the kernel below 2 GB (``M_TRIM_THRESHOLD``), so a freed block is reused
from the heap without new faults. The peak RSS is the same (measured: docs/performance.md); what changes is
that the process keeps its peak instead of shrinking between steps.

Why by hand: the field's answer is to preload jemalloc or tcmalloc (PyTorch's CPU tuning guide), a system
library a ``pip install`` cannot bring and a stage cannot load after it starts. ``mallopt`` is glibc's own,
takes effect at once for every later allocation, and is a no-op where glibc is not the C library (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's free top over 2 GB still goes back


def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse freed blocks instead of unmapping them; True when it took effect (glibc),
    False where the C library is not glibc. Idempotent; it changes no result, only where memory comes from."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD: large tensors stay mmapped")
    return ok
