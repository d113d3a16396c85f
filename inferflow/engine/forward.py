"""One forward pass of a decoder over the paged KV cache: the engine's step and a draft model's
proposals (inferflow.engine.speculative) both run their rows through ``forward_rows``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks
from inferflow.model.batch import FlatBatch, KVView, SeqSlice
from inferflow.model.network import PagedDecoder


@dataclass(frozen=True)
class Rows:
    """``tokens`` of one sequence at positions ``start``.. (its blocks reserved), computed in
    this pass; the last ``logits`` of them return logits."""

    seq: SeqBlocks
    start: int
    tokens: list[int]
    # every row is a token the model generated, fed back; such rows are computed one by one
    # as decode rows, so that a token's arithmetic is the same whether it comes alone or with
    # speculated tokens after it (a decode step alone attends as one group)
    decode: bool
    logits: int = 1


def forward_rows(model: PagedDecoder, cache: PagedKVCache, items: list[Rows]) -> torch.Tensor:
    """Float32 logits of every item's last ``logits`` rows, in order."""
    parts: list[tuple[SeqBlocks, int, list[int], bool]] = []  # one sequence slice each
    for it in items:
        if it.decode:
            parts += [(it.seq, it.start + j, [t], True) for j, t in enumerate(it.tokens)]
        else:
            parts.append((it.seq, it.start, it.tokens, False))
    # decode rows alone attend in one grouped call (even one sequence, read by the C kernel)
    grouped = all(d and len(t) == 1 for _, _, t, d in parts)
    grouped = grouped and (len(parts) > 1 or cache.kernel_decode())
    ids: list[int] = []
    pos, seqs = [], []
    views: list[KVView] = []
    for seq, start, toks, _ in parts:
        seqs.append(SeqSlice(len(ids), len(toks)))
        ids.extend(toks)
        pos.append(torch.arange(start, start + len(toks)))
        if not grouped:
            views.append(cache.view(seq, start, start + len(toks)))
    rows: list[int] = []
    row = 0
    for it in items:
        row += len(it.tokens)
        rows.extend(range(row - it.logits, row))
    flat = FlatBatch(
        torch.tensor(ids),
        torch.cat(pos),
        seqs,
        views,
        torch.tensor(rows, dtype=torch.long),
    )
    if grouped:
        flat.group = cache.group_view([p[0] for p in parts], [p[1] for p in parts])
    return model(flat).float()
