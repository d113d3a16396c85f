"""The C heap's settings for a process that runs a model: freed activation buffers stay with the
process for the next step instead of going back to Linux and being faulted in again; and the
weights the kernels stream, on 2 MiB pages where Linux allows (``on_huge_pages``).

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
from collections.abc import Callable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks past it are always mapped apart
TRIM_THRESHOLD = 512 << 20  # freed memory at the heap's top kept up to this much
MADV_COLLAPSE = 25  # Linux 6.1+ (asm-generic/mman-common.h): back a range by huge pages now
HUGE_PAGE = 2 << 20


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


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f  # type: ignore[no-any-return]


def on_huge_pages(address: int, nbytes: int) -> int:
    """Back the 2 MiB-aligned part of ``nbytes`` at ``address`` by 2 MiB pages, in place
    (``madvise(MADV_COLLAPSE)``: the kernel copies each 2 MiB into a huge page and frees the
    small ones; no second copy stays). A product streaming a weight then crosses no 4 KiB page
    boundary, where the hardware prefetchers stop and the TLB misses: Qwen2.5's one-row
    products 5-7% faster than on 4 KiB copies, alternating passes (issue 44). Returns the bytes
    now on huge pages: 0 where Linux declines (before 6.1, transparent huge pages off, no
    contiguous memory free), which changes nothing but speed."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    madvise = _madvise()
    if end <= start or madvise is None:
        return 0
    if madvise(start, end - start, MADV_COLLAPSE) != 0:
        log.debug(
            "huge pages declined for %d MiB: errno %d", (end - start) >> 20, ctypes.get_errno()
        )
        return 0
    return end - start
