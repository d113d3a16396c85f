"""A rank's share of a tensor-parallel group, and how a block's weights are cut for it.

Attention is split by heads (KV heads too; with fewer KV heads than ranks each rank keeps the
one KV head its query heads read), FFNs column-then-row (Megatron-LM): the first projection
keeps this rank's output rows, the second this rank's input columns, and the partial outputs
are summed across the group (one all-reduce per branch). A row-parallel bias lives on rank 0
only, so the sum adds it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSplit:
    rank: int = 0
    size: int = 1

    def part(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` units (``n`` divisible by the group size)."""
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def kv_heads(self, n_kv: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps; replicated when n_kv < size."""
        return self.rank * n_kv // self.size, max(1, n_kv // self.size)

    def row_parallel(self, leaf: str, t: torch.Tensor, cols: slice) -> torch.Tensor:
        """A row-parallel layer's slice: the weight's input columns; the bias on rank 0 only."""
        if leaf == "weight":
            return t[:, cols]
        return t if self.rank == 0 else torch.zeros_like(t)


WHOLE = TensorSplit()
