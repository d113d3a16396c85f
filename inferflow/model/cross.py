"""Cross-attention memory of many sources, attended in one call per layer.

An encoder-decoder's decoder attends to each source's encoder output through keys and values
computed once per source (``EncoderDecoder.cross_memory``: per decoder layer, (K, V) of shape
(H, S, D)). A ``CrossBank`` keeps them in (slots, S_max, H, D) buffers, one slot per source;
``rows(slots, lengths)`` says which slot each sequence of a flat batch reads, and
``CrossRows.attend`` attends every query row over its own slot in one call: the paged decode
kernel reads each row's keys in place (float32 on the CPU), else one padded attention over the
rows' gathered slots. A batch over many sources costs one call per layer, not one per source,
and a row's result never depends on the other rows.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from inferflow import kernels

CrossMemory = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: (K, V), (H, S, D)


class CrossBank:
    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int, dtype: torch.dtype):
        shape = (0, max_len, heads, head_dim)
        # padding holds zeros: a masked key's weight is 0, and 0 * NaN would still be NaN
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.lens = torch.zeros(0, dtype=torch.long)  # (slots,); 0 = free
        self.free: list[int] = []

    @classmethod
    def of(cls, memories: list[CrossMemory]) -> CrossBank:
        """A bank holding ``memories`` in slots 0, 1, ..."""
        k = memories[0][0][0]
        longest = max(m[0][0].shape[1] for m in memories)
        bank = cls(len(memories[0]), k.shape[0], k.shape[2], longest, k.dtype)
        for m in memories:
            bank.add(m)
        return bank

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def add(self, memory: CrossMemory) -> int:
        """Store one source's memory; its slot."""
        n = memory[0][0].shape[1]
        if not 0 < n <= self.max_len:
            raise ValueError(f"cross memory of {n} positions: the bank holds 1..{self.max_len}")
        if not self.free:
            self._grow()
        slot = self.free.pop()
        for layer, (k, v) in enumerate(memory):
            self.k[layer][slot, :n] = k.transpose(0, 1)
            self.v[layer][slot, :n] = v.transpose(0, 1)
            self.k[layer][slot, n:] = 0
            self.v[layer][slot, n:] = 0
        self.lens[slot] = n
        return slot

    def remove(self, slot: int) -> None:
        self.lens[slot] = 0
        self.free.append(slot)

    def _grow(self) -> None:
        old = self.lens.numel()
        new = max(4, 2 * old)
        for bufs in (self.k, self.v):
            for layer, b in enumerate(bufs):
                bufs[layer] = torch.cat((b, b.new_zeros((new - old, *b.shape[1:]))))
        self.lens = torch.cat((self.lens, torch.zeros(new - old, dtype=torch.long)))
        self.free += reversed(range(old, new))  # the lowest slot is taken first

    def rows(self, slots: list[int], lengths: list[int]) -> CrossRows:
        """What a flat batch's sequences read: sequence i (``lengths[i]`` tokens) reads
        ``slots[i]``."""
        return CrossRows(self, slots, lengths)


class CrossRows:
    """The slots the rows of one flat batch read, with what every layer shares."""

    def __init__(self, bank: CrossBank, slots: list[int], lengths: list[int]) -> None:
        self.bank = bank
        taken = torch.tensor(slots, dtype=torch.long)
        if bool((bank.lens[taken] == 0).any()):
            raise ValueError("a sequence reads a free cross-memory slot")
        self.slot = torch.repeat_interleave(taken, torch.tensor(lengths))  # per token row
        self.lens = bank.lens[self.slot]
        S = bank.max_len
        self.keys = self.slot[:, None] * S + torch.arange(S)  # a row's keys in (slots * S, ...)
        self.kernel = kernels.decode_attention_for(bank.k[0])

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the queries q (rows, H, D) over their slots' memory: (rows, H, D)."""
        b = self.bank
        k, v = b.k[layer], b.v[layer]
        if self.kernel is not None and q.dtype == k.dtype:
            return self.kernel(q, k.flatten(0, 1), v.flatten(0, 1), self.keys, self.lens, scale)
        visible = torch.arange(b.max_len) < self.lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            k[self.slot].transpose(1, 2),
            v[self.slot].transpose(1, 2),
            attn_mask=visible[:, None, None, :],
            scale=scale,
        )
        return out[:, :, 0, :]
