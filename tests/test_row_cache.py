"""The beam-search row cache (inferflow.engine.row_cache): rows never move. Choosing beams
(``fork``) leaves a parent's first child in the parent's row, copies a further child's parent
into a free row (only the positions the parent has filled), frees rows left without a child,
and leaves every row outside the step untouched; attention over a step's rows (kernel, in
place) equals the padded torch path; positions a step reads are finite though buffers start
unset."""

from __future__ import annotations

import pytest
import torch

from inferflow.engine.row_cache import RowCache


def snapshot(cache: RowCache) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.k.clone(), cache.v.clone()


def test_fork_keeps_each_childs_prefix_and_moves_nothing_else() -> None:
    torch.manual_seed(0)
    cache = RowCache(layers=2, max_len=32, kvh=2, d=3, dtype=torch.float32, capacity=8)
    rows = cache.new_rows(6)
    cache.k.normal_()
    cache.v.normal_()
    cache.lens[rows] = torch.tensor([30, 30, 4, 4, 5, 4])
    k0, v0 = snapshot(cache)
    # rows 0 and 1 wait outside the step; of rows 2..5, row 4 has two children, row 2 one
    out = cache.fork([2, 3, 4, 5], [4, 4, 2])
    assert out[0] == 4 and out[2] == 2  # a first child keeps its parent's row
    extra = out[1]
    assert extra not in (0, 1, 2, 4)  # a free row: one of the freed (3, 5) or a new one
    assert sorted(cache.free) == sorted({3, 5, 6, 7} - {extra})
    assert int(cache.lens[extra]) == 5
    assert torch.equal(cache.k[:, extra, :5], k0[:, 4, :5])
    assert torch.equal(cache.v[:, extra, :5], v0[:, 4, :5])
    # past the parent's 5 filled positions nothing was copied, though rows 0 and 1 hold 30
    assert torch.equal(cache.k[:, extra, 5:], k0[:, extra, 5:])
    for r in (0, 1, 2, 4):  # waiting rows and kept parents: not a value changed
        assert torch.equal(cache.k[:, r], k0[:, r]) and torch.equal(cache.v[:, r], v0[:, r])


def test_rows_are_reused_and_the_cache_grows() -> None:
    cache = RowCache(layers=1, max_len=8, kvh=1, d=1, dtype=torch.float32, capacity=2)
    a, b = cache.new_rows(2)
    assert cache.used == 2 and not cache.free
    cache.lens[a] = 3
    cache.k[0, a, :3, 0, 0] = torch.tensor([1.0, 2.0, 3.0])
    out = cache.fork([a, b], [a, a, a])  # b freed and reused, then one more row
    assert out[0] == a and set(out[1:]) == {b, 2} and cache.used == 3
    for r in out:
        assert cache.k[0, r, :3, 0, 0].tolist() == [1.0, 2.0, 3.0] and int(cache.lens[r]) == 3
    assert cache.fork(out, []) == [] and cache.used == 0  # no child: every row freed


def test_masked_positions_read_as_finite_though_the_buffers_start_unset() -> None:
    """Buffers come from empty(): whatever they held (NaN here, as stale memory may), every
    position the padded path reads is finite, in rows added later too, and nothing but the new
    keys is written."""
    cache = RowCache(layers=1, max_len=64, kvh=1, d=2, dtype=torch.float32, capacity=2)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    rows = cache.new_rows(2)

    def fill(row: int, n: int) -> None:  # as earlier steps would have
        cache.k[:, row, :n] = cache.v[:, row, :n] = 1.0
        cache.lens[row] = n

    fill(rows[0], 5)
    step = cache.step(rows)
    k, v, _, mask = step.update(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    step.advance(torch.ones(2, dtype=torch.long))
    assert k.shape[1] == 6 and torch.isfinite(k).all() and torch.isfinite(v).all()
    assert mask[1].tolist() == [True] + [False] * 5  # row 1's stale positions: masked, finite
    assert cache.k[0, rows[1], 1:].isnan().all()  # zeroed in the copy only
    assert cache.k[0, rows[0], 6:].isnan().all()  # nothing past the new keys touched
    more = cache.new_rows(3)  # grows the buffers past their 2 rows
    fill(more[2], 7)
    k, v, _, _ = cache.step(rows + more).update(0, torch.ones(5, 1, 2), torch.ones(5, 1, 2))
    assert k.shape[1] == 8 and torch.isfinite(k).all() and torch.isfinite(v).all()
    assert cache.k[0, rows[0], :6].eq(1).all()  # its filled positions came through the growth


def test_kernel_attention_reads_rows_in_place_as_the_padded_path_does() -> None:
    torch.manual_seed(1)
    cache = RowCache(layers=2, max_len=16, kvh=2, d=8, dtype=torch.float32, capacity=8)
    if cache.kernel is None:
        pytest.skip("the C kernels are off or could not be built here")
    rows = cache.new_rows(8)
    cache.k.normal_()
    cache.v.normal_()
    cache.lens[rows] = torch.tensor([0, 3, 9, 1, 15, 4, 4, 7])
    step = [6, 1, 4, 2]  # rows of a step: any of them, in any order
    q, k, v = torch.randn(4, 4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)  # GQA: 4 over 2
    got = cache.step(step).attend(1, q, k, v, 0.25)
    assert got is not None
    keys, values, _, visible = cache.step(step).update(1, k, v)  # the padded copy
    for i in range(4):
        n = int(visible[i].sum())
        kk = keys[i, :n].repeat_interleave(2, dim=1)  # (n, H, D)
        vv = values[i, :n].repeat_interleave(2, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], kk) * 0.25, dim=-1)
        torch.testing.assert_close(got[i], torch.einsum("hn,nhd->hd", w, vv), rtol=1e-5, atol=1e-5)
