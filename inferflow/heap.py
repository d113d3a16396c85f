"""The C heap's settings for a process that runs a model: freed activation buffers stay with the
process for the next step instead of going back to Linux and being faulted in again.

glibc serves an allocation of 128 KiB or more (adjusted up to 32 MiB as such blocks are freed)
with a fresh ``mmap`` and returns freed memory at the heap's top past a trim threshold, so a
prefill step's temporaries (hundreds of rows times the FFN width) were zero-filled page by page
at every step: about 12% of Qwen2.5-1.5B's prompt time on a 2-core Zen 5
(``benchmarks/step_profile.py``). ``keep_freed_memory`` raises both thresholds once per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks past it are always mapped apart
TRIM_THRESHOLD = 512 << 20  # freed memory at the heap's top kept up to this much


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); False where the C library has
    no mallopt or refuses them (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no mallopt in the C library (%s): heap settings unchanged", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    log.debug("glibc heap: mmap threshold %d MiB, trim threshold %d MiB (%s)",
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, "set" if ok else "refused")  # fmt: skip
    return ok
