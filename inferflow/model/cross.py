"""Cross-attention memory of many sources, attended in one call per layer.

An encoder-decoder's decoder attends to each source's encoder output through keys and values
computed once per source (``EncoderDecoder.cross_memory``: per decoder layer, (K, V) of shape
(H, S, D)). A ``CrossBank`` keeps them in one pool of positions per layer, a source in blocks
of its own (one slot per source); ``rows(slots, lengths)`` says which slot each sequence of a
flat batch reads, and ``CrossRows.attend`` attends every query row over its own slot in one
call: the paged decode kernel reads each row's keys in place (float32 on the CPU), else one
padded attention over the rows' gathered keys. A batch over many sources costs one call per
layer, not one per source, and a row's result never depends on the other rows.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from inferflow import kernels

CrossMemory = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: (K, V), (H, S, D)


class CrossBank:
    """Sources' memory in blocks of ``BLOCK`` positions, so that a source takes room for its
    own length, not the longest one's; ``table`` lists each slot's positions."""

    BLOCK = 16

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype):
        shape = (0, heads, head_dim)
        # buffers start zeroed and hold finite values only: a masked key's weight is 0, and
        # 0 * NaN would still be NaN
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.free_blocks: list[int] = []
        self.table = torch.zeros((0, 0), dtype=torch.long)  # (slots, longest): positions
        self.lens = torch.zeros(0, dtype=torch.long)  # (slots,); 0 = free
        self.blocks: list[list[int]] = []  # each slot's blocks
        self.free_slots: list[int] = []

    @classmethod
    def of(cls, memories: list[CrossMemory]) -> CrossBank:
        """A bank holding ``memories`` in slots 0, 1, ..."""
        k = memories[0][0][0]
        bank = cls(len(memories[0]), k.shape[0], k.shape[2], k.dtype)
        for m in memories:
            bank.add(m)
        return bank

    def add(self, memory: CrossMemory) -> int:
        """Store one source's memory; its slot."""
        n = memory[0][0].shape[1]
        if n < 1:
            raise ValueError("cross memory of 0 positions: a source has at least one")
        blocks = [self._block() for _ in range(-(-n // self.BLOCK))]
        pos = (torch.tensor(blocks)[:, None] * self.BLOCK + torch.arange(self.BLOCK)).flatten()[:n]
        for layer, (k, v) in enumerate(memory):
            self.k[layer][pos] = k.transpose(0, 1)
            self.v[layer][pos] = v.transpose(0, 1)
        slot = self._slot(n)
        self.table[slot, :n] = pos
        self.lens[slot] = n
        self.blocks[slot] = blocks
        return slot

    def remove(self, slot: int) -> None:
        self.free_blocks += self.blocks[slot]
        self.blocks[slot] = []
        self.lens[slot] = 0
        self.free_slots.append(slot)

    def _block(self) -> int:
        if not self.free_blocks:
            old = self.k[0].shape[0] // self.BLOCK
            new = max(8, 2 * old)
            for bufs in (self.k, self.v):
                for layer, b in enumerate(bufs):
                    grown = b.new_zeros(((new - old) * self.BLOCK, *b.shape[1:]))
                    bufs[layer] = torch.cat((b, grown))
            self.free_blocks += reversed(range(old, new))  # the lowest block is taken first
        return self.free_blocks.pop()

    def _slot(self, n: int) -> int:
        slots, width = self.table.shape
        if n > width:
            self.table = torch.cat((self.table, self.table.new_zeros((slots, n - width))), 1)
        if not self.free_slots:
            self.table = torch.cat(
                (self.table, self.table.new_zeros((max(4, slots), max(n, width))))
            )
            self.lens = torch.cat((self.lens, self.lens.new_zeros(self.table.shape[0] - slots)))
            self.blocks += [[] for _ in range(self.table.shape[0] - slots)]
            self.free_slots += reversed(range(slots, self.table.shape[0]))
        slot = self.free_slots.pop()
        self.table[slot] = 0  # (position 0 of the pool: finite, and masked)
        return slot

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
        self.keys = bank.table[self.slot, : int(self.lens.max())]  # each row's positions
        self.kernel = kernels.decode_attention_for(bank.k[0])

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the queries q (rows, H, D) over their slots' memory: (rows, H, D)."""
        k, v = self.bank.k[layer], self.bank.v[layer]
        if self.kernel is not None:
            return self.kernel(q, k, v, self.keys, self.lens, scale)
        visible = torch.arange(self.keys.shape[1]) < self.lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            k[self.keys].transpose(1, 2),
            v[self.keys].transpose(1, 2),
            attn_mask=visible[:, None, None, :],
            scale=scale,
        )
        return out[:, :, 0, :]
