"""The weights the products stream on 2 MiB pages (inferflow.heap.on_huge_pages, called by every
QPlane): Linux's own report (/proc/self/smaps_rollup) grows by the huge pages a new plane's
codes take, and the products are unchanged."""

from __future__ import annotations

import mmap

import pytest
import torch

from inferflow import heap
from inferflow.kernels import quant_decode

MiB = 1 << 20


def _huge_kib() -> int:
    """The process's AnonHugePages (KiB), as Linux reports it."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _collapses() -> bool:
    """Whether Linux here backs an anonymous range by huge pages on request (6.1+, THP on)."""
    m = mmap.mmap(-1, 6 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"\1" * len(m))
    import ctypes

    try:
        return heap.on_huge_pages(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)) > 0
    finally:
        m.close()


def test_on_huge_pages_takes_the_aligned_part_only() -> None:
    """The range given is widened by nothing: only the 2 MiB pages wholly inside it (none for
    less than one such page), so no neighbour's memory is touched."""
    if not _collapses():
        pytest.skip("Linux declines MADV_COLLAPSE here (before 6.1, or THP off)")
    import ctypes

    m = mmap.mmap(-1, 8 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"\2" * len(m))
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    first = -(-base // (2 * MiB)) * 2 * MiB  # the first 2 MiB boundary in the mapping
    assert heap.on_huge_pages(first + 4096, 2 * MiB) == 0  # no whole page inside
    assert heap.on_huge_pages(first + 4096, 4 * MiB) == 2 * MiB
    assert heap.on_huge_pages(first, 4 * MiB) == 4 * MiB
    assert bytes(m[:16]) == b"\2" * 16 and m[len(m) - 1] == 2  # (the contents stay)
    m.close()


def test_a_planes_codes_are_on_huge_pages_and_its_products_unchanged() -> None:
    if quant_decode.library() is None:
        pytest.skip("the quant_decode kernel is not built here")
    if not _collapses():
        pytest.skip("Linux declines MADV_COLLAPSE here (before 6.1, or THP off)")
    torch.manual_seed(0)
    n, k = 1024, 8192  # 4-bit codes: 4 MiB, two whole 2 MiB pages at least
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, mn = torch.rand(n, k // 32) / 16, -torch.rand(n, k // 32)
    x = torch.randn(3, k)
    want = x @ (codes.float().view(n, k // 32, 32) * scale[..., None] + mn[..., None]).view(n, k).T
    before = _huge_kib()
    plane = quant_decode.make_plane(codes.clone(), scale, mn, 16)
    assert plane is not None
    assert (_huge_kib() - before) * 1024 >= 2 * MiB
    torch.testing.assert_close(plane.matmul_f32(x), want, rtol=1e-4, atol=1e-3)
