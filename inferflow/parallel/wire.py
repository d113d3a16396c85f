"""What rank 0 tells the other ranks each engine step, as int64 tensors (no pickle).

A step is a list of micro-batches plus the KV block copies (copy-on-write) the engine made
since the last step. A micro-batch carries its tokens, positions, sequence lengths, the rows
that need logits, and each sequence's KV read slots in the paged cache (block * block_size +
offset); write slots follow from the positions. Every rank keeps K/V for its own layers and
heads in a pool with the same block numbering, so slots mean the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferflow.engine.kv_cache import KVFormat, KVPool, PagedGroupView, PagedView, copy_block
from inferflow.model.batch import FlatBatch, SeqSlice

HEADER = 6  # ints: kind, payload length, micro-batches, copies, blocks, block size
STOP, STEP = 0, 1
_MB = 5  # ints per micro-batch header: tokens, sequences, logits rows, grouped, group width


class KVStore(KVPool):
    """One rank's K/V pool: (layers, blocks * block_size, KV heads, head dim) for K and V, in
    the activations' dtype."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, block_size: int) -> None:
        self.k, self.v, self.block_size = k, v, block_size
        self.format = KVFormat(None, k.dtype, k.shape[-1])

    @classmethod
    def allocate(
        cls,
        geometry: tuple[int, int, int],
        blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVStore:
        layers, kv_heads, head_dim = geometry
        shape = (layers, blocks * block_size, kv_heads, head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            block_size,
        )

    @property
    def blocks(self) -> int:
        return self.k.shape[1] // self.block_size

    def copy_blocks(self, copies: torch.Tensor) -> None:
        for src, dst in copies.view(-1, 2).tolist():
            copy_block(self.k, self.v, self.block_size, src, dst)


@dataclass
class MicroBatch:
    token_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    lengths: list[int]  # new tokens of each sequence
    rows: torch.Tensor  # rows of this micro-batch that need logits
    reads: list[torch.Tensor] | torch.Tensor  # per sequence (S_i,), or (B, S) for a decode group

    def to_batch(self, store: KVStore, device: torch.device) -> FlatBatch:
        """The flat batch this rank runs, its KV views over ``store``."""
        pos = self.positions.to(device)
        seqs, start = [], 0
        for n in self.lengths:
            seqs.append(SeqSlice(start, n))
            start += n
        flat = FlatBatch(self.token_ids.to(device), pos, seqs, [], self.rows.to(device))
        if isinstance(self.reads, torch.Tensor):  # one new token per sequence, grouped
            read = self.reads.to(device)
            S = read.shape[1]
            k_pos = torch.arange(S, device=device).expand(len(seqs), S)
            write = read.gather(1, pos[:, None]).squeeze(1)
            valid = k_pos <= pos[:, None]
            flat.group = PagedGroupView(store, write, read, k_pos, valid)  # type: ignore[arg-type]
            return flat
        for s, read in zip(seqs, self.reads, strict=True):
            read = read.to(device)
            write = read[pos[s.start] : pos[s.start + s.length - 1] + 1]
            k_pos = torch.arange(read.shape[0], device=device)
            flat.kv.append(PagedView(store, write, read, k_pos))  # type: ignore[arg-type]
        return flat


def split(flat: FlatBatch, n: int) -> list[MicroBatch]:
    """The engine's flat batch as ``n`` micro-batches of consecutive sequences, balanced by
    token count (fewer when there are fewer sequences)."""
    n = max(1, min(n, len(flat.seqs)))
    total = flat.token_ids.shape[0]
    rows = flat.logits_rows if flat.logits_rows is not None else flat.default_logits_rows()
    cuts, acc = [0], 0
    for i, s in enumerate(flat.seqs):
        acc += s.length
        if len(cuts) < n and acc * n >= total * len(cuts) and i + 1 < len(flat.seqs):
            cuts.append(i + 1)
    cuts.append(len(flat.seqs))
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        lo = flat.seqs[a].start
        hi = flat.seqs[b - 1].start + flat.seqs[b - 1].length
        mine = rows[(rows >= lo) & (rows < hi)] - lo
        reads: list[torch.Tensor] | torch.Tensor
        if flat.group is not None:
            reads = flat.group.read[a:b]  # type: ignore[attr-defined]
        else:
            reads = [flat.kv[i].read for i in range(a, b)]  # type: ignore[attr-defined]
        out.append(
            MicroBatch(
                flat.token_ids[lo:hi],
                flat.positions[lo:hi],
                [s.length for s in flat.seqs[a:b]],
                mine,
                reads,
            )
        )
    return out


def encode(
    mbs: list[MicroBatch], copies: list[tuple[int, int]], blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step."""
    parts: list[torch.Tensor] = [torch.tensor(copies, dtype=torch.long).view(-1)]
    for mb in mbs:
        if isinstance(mb.reads, torch.Tensor):  # a decode group: one (B, width) table
            grouped, width, reads = 1, mb.reads.shape[1], mb.reads.reshape(-1)
        else:
            grouped, width, reads = 0, 0, torch.cat(mb.reads)
        head = [mb.token_ids.shape[0], len(mb.lengths), mb.rows.shape[0], grouped, width]
        parts += [torch.tensor(head + mb.lengths, dtype=torch.long), mb.token_ids, mb.positions]
        parts += [mb.rows, reads]
    payload = torch.cat([p.long() for p in parts])
    header = torch.tensor(
        [STEP, payload.shape[0], len(mbs), len(copies), blocks, block_size], dtype=torch.long
    )
    return header, payload


def decode(header: torch.Tensor, payload: torch.Tensor) -> tuple[torch.Tensor, list[MicroBatch]]:
    """(copies (C, 2), micro-batches) of a step ``encode`` wrote."""
    _, _, n_mbs, n_copies, _, _ = header.tolist()
    at = 2 * n_copies
    copies, mbs = payload[:at].view(-1, 2), []

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return payload[at - n : at]

    for _ in range(n_mbs):
        n_tok, n_seq, n_rows, grouped, width = take(_MB).tolist()
        lengths = take(n_seq).tolist()
        ids, pos, rows = take(n_tok), take(n_tok), take(n_rows)
        reads: list[torch.Tensor] | torch.Tensor
        if grouped:
            reads = take(n_seq * width).view(n_seq, width)
        else:
            ends, start = [], 0
            for n in lengths:  # a sequence reads slots 0 .. its last position
                ends.append(int(pos[start + n - 1]) + 1)
                start += n
            reads = [take(e) for e in ends]
        mbs.append(MicroBatch(ids, pos, lengths, rows, reads))
    return copies, mbs
