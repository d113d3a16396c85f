"""The keys and values of a batched beam search: one row per hypothesis, addressed by row id.

Rows live in (layers, capacity, T, KVH, D) buffers, each row filled up to its own length. A step
computes any set of rows (all live hypotheses in a static search; the beams of the smallest
length in a streaming one): ``step(rows)`` is that step's ``GroupKVView``, its ``row(i)`` the
``KVView`` of one of them (prompts, and blocks with an attention bias). Rows never move: when
beams are chosen (``fork``) a parent's first child takes over the parent's row, each further
child gets a free row holding a copy of the parent's filled positions, and rows left without a
child are freed; rows waiting outside the step are untouched. Attention reads each row's keys
in place (the paged decode kernel, float32 on the CPU) or from a padded gathered copy.
Nothing is zeroed: positions past a row's length hold whatever the memory held (NaN too). The
kernel never reads them, and the padded path zeroes them in its copy (masked attention weights
are 0, but 0 * NaN is not), so a search that ends at 40 tokens never touches (or page-faults)
the memory reserved for the length limit.
"""

from __future__ import annotations

import torch

from inferflow import kernels


class RowCache:
    def __init__(
        self,
        layers: int,
        max_len: int,
        kvh: int,
        d: int,
        dtype: torch.dtype,
        capacity: int = 1,  # rows to allocate for (more are added as needed)
    ):
        cap = max(capacity, 1)
        self.k = torch.empty((layers, cap, max_len, kvh, d), dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.lens = torch.zeros(cap, dtype=torch.long)  # per row id
        self.free = list(reversed(range(cap)))  # the lowest id is taken first
        self._pos = torch.arange(max_len, dtype=torch.long)
        self.kernel = kernels.decode_attention_for(self.k)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def used(self) -> int:
        """Rows held by hypotheses."""
        return self.lens.numel() - len(self.free)

    def new_rows(self, n: int) -> list[int]:
        """``n`` empty rows (new hypotheses)."""
        rows = [self._take() for _ in range(n)]
        self.lens[rows] = 0
        return rows

    def fork(self, rows: list[int], parents: list[int]) -> list[int]:
        """Choose beams: the rows of children whose parents hold ``parents`` (one per child,
        in order), all of them among ``rows``, the rows that competed; those without a child
        are freed."""
        out: list[int] = []
        extra: list[tuple[int, int]] = []  # (child's place in out, parent row)
        seen: set[int] = set()
        for i, p in enumerate(parents):
            if p in seen:
                extra.append((i, p))
                out.append(-1)
            else:
                seen.add(p)
                out.append(p)
        self.free += [r for r in rows if r not in seen]
        if extra:
            src = [p for _, p in extra]
            dst = [self._take() for _ in extra]
            for (i, _), r in zip(extra, dst, strict=True):
                out[i] = r
            end = int(self.lens[src].max())  # positions the parents have filled
            self.k[:, dst, :end] = self.k[:, src, :end]
            self.v[:, dst, :end] = self.v[:, src, :end]
            self.lens[dst] = self.lens[src]
        return out

    def _take(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        old = self.lens.numel()
        cap, filled = 2 * old, int(self.lens.max())  # (a freed row's stale length: more, no harm)
        for name in ("k", "v"):
            buf = getattr(self, name)
            new = buf.new_empty((buf.shape[0], cap, *buf.shape[2:]))
            new[:, :old, :filled] = buf[:, :, :filled]
            setattr(self, name, new)
        self.lens = torch.cat((self.lens, torch.zeros(cap - old, dtype=torch.long)))
        self.free += reversed(range(old, cap))

    def step(self, rows: list[int]) -> StepRows:
        return StepRows(self, rows)


class StepRows:
    """The rows one step computes, one new token each (``update`` / ``attend``, a
    ``GroupKVView``) or several (``row(i).update``, a ``KVView``)."""

    def __init__(self, cache: RowCache, rows: list[int]) -> None:
        self.cache, self.ids = cache, rows
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.lens = cache.lens[self.rows]
        self.end = int(self.lens.max()) + 1  # positions a one-token step reads (every layer)
        self._read = None  # the kernel's list of them, flat in a layer
        if cache.kernel is not None:
            self._read = self.rows[:, None] * cache.max_len + cache._pos[: self.end]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each row's new key and value."""
        c = self.cache
        c.k[layer, self.rows, self.lens] = k
        c.v[layer, self.rows, self.lens] = v

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        c, end = self.cache, self.end
        self._write(layer, k, v)
        pos = c._pos[:end].expand(len(self.ids), end)
        valid = pos <= self.lens[:, None]
        unset = ~valid[:, :, None, None]  # past the row's length (stale, NaN too): 0 in the copy
        keys = c.k[layer, self.rows, :end].masked_fill_(unset, 0)
        values = c.v[layer, self.rows, :end].masked_fill_(unset, 0)
        return keys, values, pos, valid

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """Each row's keys read in place by the kernel (no padded copy); None, with nothing
        written, where it cannot run."""
        c = self.cache
        if c.kernel is None or self._read is None:
            return None
        self._write(layer, k, v)
        ck, cv = c.k[layer].flatten(0, 1), c.v[layer].flatten(0, 1)
        return kernels.causal_rows(c.kernel, q, ck, cv, self._read, self.lens, scale, window)

    def row(self, i: int) -> _Row:
        return _Row(self.cache, self.ids[i])

    def advance(self, counts: torch.Tensor) -> None:
        """The step's rows grew by ``counts`` tokens each."""
        self.cache.lens[self.rows] += counts


class _Row:
    def __init__(self, cache: RowCache, i: int) -> None:
        self.cache, self.i = cache, i

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cache
        start, end = int(positions[0]), int(positions[-1]) + 1
        c.k[layer, self.i, start:end] = k
        c.v[layer, self.i, start:end] = v
        return c.k[layer, self.i, :end], c.v[layer, self.i, :end], c._pos[:end]
