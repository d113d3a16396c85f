"""The keys and values of a batched beam search: one row per hypothesis.

Rows live in (layers, capacity, T, KVH, D) buffers, each row filled up to its own length. A step
computes the rows from some ``start`` to the end (all of them in a static search; the beams of
the smallest length in a streaming one, kept last): ``window(start)`` is that step's
``GroupKVView``, and its ``row(i)`` the ``KVView`` of one of its rows (prompts, and blocks with
an attention bias). Choosing beams moves only rows that change place, and only their filled
positions; positions past a row's length hold stale finite values that attention masks out.
Buffers are zeroed lazily, positions ahead of the longest row in chunks: a search that ends
at 40 tokens never touches (or page-faults) the memory reserved for the length limit.
"""

from __future__ import annotations

import torch


class RowCache:
    CHUNK = 16  # positions zeroed ahead at a time

    def __init__(
        self,
        layers: int,
        rows: int,
        max_len: int,
        kvh: int,
        d: int,
        dtype: torch.dtype,
        capacity: int = 0,  # rows to allocate for (more are added as needed)
    ):
        cap = max(rows, capacity, 1)
        self.k = torch.empty((layers, cap, max_len, kvh, d), dtype=dtype)
        self.v = torch.empty_like(self.k)
        # positions 0 .. ready of every row hold finite values: attention reads masked
        # positions too, and NaN * 0 is NaN
        self.ready = 0
        self.lens = torch.zeros(rows, dtype=torch.long)  # (rows in use,)
        self._pos = torch.arange(max_len, dtype=torch.long)

    def reserve(self, end: int) -> None:
        """Make positions up to ``end`` finite in every row (zeroing ahead by a chunk)."""
        if end > self.ready:
            to = min(self.k.shape[2], max(end, self.ready + self.CHUNK))
            self.k[:, :, self.ready : to] = 0
            self.v[:, :, self.ready : to] = 0
            self.ready = to

    @property
    def rows(self) -> int:
        return self.lens.numel()

    def window(self, start: int = 0) -> RowWindow:
        return RowWindow(self, start)

    def select(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (in that order; a row may repeat: beams sharing a parent)."""
        n = idx.numel()
        moved = (idx != torch.arange(n)).nonzero().flatten()
        if n > self.k.shape[1]:
            self._grow(n)
        if moved.numel():
            end = int(self.lens[idx[moved]].max())  # positions a moving row has filled
            # the right side is gathered first, so a row may take the place of another's source
            self.k[:, moved, :end] = self.k[:, idx[moved], :end]
            self.v[:, moved, :end] = self.v[:, idx[moved], :end]
        self.lens = self.lens[idx]

    def add_rows(self, n: int) -> None:
        """``n`` empty rows after the others (inputs joining a streaming search)."""
        if self.rows + n > self.k.shape[1]:
            self._grow(self.rows + n)
        self.lens = torch.cat((self.lens, torch.zeros(n, dtype=torch.long)))

    def _grow(self, rows: int) -> None:
        cap, r = max(rows, 2 * self.k.shape[1]), self.ready
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], cap, *old.shape[2:]))
            new[:, : old.shape[1], :r] = old[:, :, :r]
            new[:, old.shape[1] :, :r] = 0
            setattr(self, name, new)


class RowWindow:
    """Rows ``start`` .. end of a ``RowCache``: the rows one step computes, one new token each
    (``update``, a ``GroupKVView``) or several (``row(i).update``, a ``KVView``)."""

    def __init__(self, cache: RowCache, start: int) -> None:
        self.cache, self.start = cache, start

    @property
    def lens(self) -> torch.Tensor:
        return self.cache.lens[self.start :]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        c, a = self.cache, self.start
        n = k.shape[0]
        lens = c.lens[a : a + n]
        end = int(lens.max()) + 1
        c.reserve(end)
        rows = torch.arange(a, a + n)
        c.k[layer, rows, lens] = k
        c.v[layer, rows, lens] = v
        pos = c._pos[:end].expand(n, end)
        return c.k[layer, a : a + n, :end], c.v[layer, a : a + n, :end], pos, pos <= lens[:, None]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> None:
        """No kernel path: ``update`` already returns views of contiguous rows, no copy."""
        return None

    def row(self, i: int) -> _Row:
        return _Row(self.cache, self.start + i)

    def advance(self, counts: torch.Tensor) -> None:
        """The window's first ``len(counts)`` rows grew by ``counts`` tokens."""
        self.cache.lens[self.start : self.start + counts.numel()] += counts


class _Row:
    def __init__(self, cache: RowCache, i: int) -> None:
        self.cache, self.i = cache, i

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cache
        start, end = int(positions[0]), int(positions[-1]) + 1
        c.reserve(end)
        c.k[layer, self.i, start:end] = k
        c.v[layer, self.i, start:end] = v
        return c.k[layer, self.i, :end], c.v[layer, self.i, :end], c._pos[:end]
