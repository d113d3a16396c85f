"""The beam-search row cache (inferflow.engine.row_cache): choosing beams keeps each chosen row's
filled positions (a parent may be chosen twice, rows may trade places), leaves rows that stay
where they are untouched, and moves only what it must: positions a moving row has filled, not
those of a longer row waiting elsewhere in the cache (a streaming search's older inputs)."""

from __future__ import annotations

import torch

from inferflow.engine.row_cache import RowCache


def filled(cache: RowCache, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(cache.lens[row])
    return cache.k[:, row, :n].clone(), cache.v[:, row, :n].clone()


def test_select_keeps_each_chosen_rows_filled_positions() -> None:
    torch.manual_seed(0)
    lens = [30, 30, 4, 4, 4, 4]  # two long rows waiting, four short ones choosing
    cache = RowCache(layers=2, rows=len(lens), max_len=32, kvh=2, d=3, dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    cache.lens = torch.tensor(lens)
    before = [filled(cache, r) for r in range(len(lens))]
    idx = [0, 1, 5, 5, 2, 3]  # the waiting rows stay; row 5 twice; 2 and 3 move down one place
    cache.select(torch.tensor(idx))
    assert cache.lens.tolist() == [lens[i] for i in idx]
    for r, src in enumerate(idx):
        k, v = filled(cache, r)
        assert torch.equal(k, before[src][0]) and torch.equal(v, before[src][1]), (r, src)


def test_select_copies_no_more_than_the_moving_rows_have_filled() -> None:
    cache = RowCache(layers=1, rows=3, max_len=16, kvh=1, d=1, dtype=torch.float32)
    cache.lens = torch.tensor([12, 2, 2])
    cache.k[0, 1, :, 0, 0] = 1.0  # row 1: 2 filled positions, then stale values
    cache.k[0, 2, :, 0, 0] = 2.0
    cache.select(torch.tensor([0, 2, 1]))  # rows 1 and 2 trade places
    assert cache.k[0, 1, :2, 0, 0].tolist() == [2.0, 2.0]
    assert cache.k[0, 2, :2, 0, 0].tolist() == [1.0, 1.0]
    # past the moving rows' 2 filled positions nothing moved, though row 0 has 12
    assert cache.k[0, 1, 2:, 0, 0].eq(1.0).all() and cache.k[0, 2, 2:, 0, 0].eq(2.0).all()


def test_masked_positions_read_as_finite_though_the_buffers_start_unset() -> None:
    """Buffers come from empty(): whatever they held (NaN here, as stale memory may), every
    position a step reads is finite, in rows added later too, and nothing past the chunk ahead
    of the longest row is written."""
    cache = RowCache(layers=1, rows=2, max_len=64, kvh=1, d=2, dtype=torch.float32, capacity=2)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    cache.lens = torch.tensor([5, 0])
    k, v, _, mask = cache.window(0).update(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert k.shape[1] == 6 and torch.isfinite(k).all() and torch.isfinite(v).all()
    assert mask[1].tolist() == [True] + [False] * 5  # row 1's stale positions: masked, finite
    assert cache.k[:, :, RowCache.CHUNK :].isnan().all()  # never touched
    cache.add_rows(3)  # grows the buffers past their 2 rows
    cache.lens = torch.tensor([5, 0, 0, 0, 7])
    k, v, _, _ = cache.window(0).update(0, torch.ones(5, 1, 2), torch.ones(5, 1, 2))
    assert k.shape[1] == 8 and torch.isfinite(k).all() and torch.isfinite(v).all()
