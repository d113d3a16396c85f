"""The weights the products stream on 2 MiB pages: inferflow.heap.on_huge_pages takes the whole
2 MiB pages inside a range and Linux collapses them (its return is madvise's success), the
contents unchanged; every QPlane hands it what its products stream."""

from __future__ import annotations

import mmap

import pytest
import torch

from inferflow import heap
from inferflow.kernels import quant_decode

MiB = 1 << 20


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


def test_a_plane_asks_for_huge_pages_for_what_it_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plane hands its codes and its fifth / top bits (the arrays a product streams) to
    on_huge_pages, whole, and its products stay the codec's (Q6_K-like 64 levels in groups of
    16: codes and top bits)."""
    if quant_decode.library() is None:
        pytest.skip("the quant_decode kernel is not built here")
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(quant_decode, "on_huge_pages", lambda a, n: asked.append((a, n)) or n)
    torch.manual_seed(0)
    n, k = 48, 512
    codes = torch.randint(0, 64, (n, k), dtype=torch.uint8)
    scale, mn = torch.rand(n, k // 16) / 16, -torch.rand(n, k // 16)
    x = torch.randn(3, k)
    want = x @ (codes.float().view(n, k // 16, 16) * scale[..., None] + mn[..., None]).view(n, k).T
    plane = quant_decode.make_plane(codes.clone(), scale, mn, 64)
    assert plane is not None
    streamed = [t for t in (plane.codes, plane.high) if t is not None]
    assert asked == [(t.data_ptr(), t.nbytes) for t in streamed]
    if quant_decode.tiles16_built():
        assert len(streamed) == 2  # (6-bit codes: 4-bit tiles and their top bits)
    torch.testing.assert_close(plane.matmul_f32(x), want, rtol=1e-4, atol=1e-3)
