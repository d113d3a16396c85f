"""The flat batch a network's forward takes (DESIGN.md, Engine contract).

All scheduled tokens of all sequences are concatenated into one (N,) tensor for every token-wise
op; attention runs per sequence against that sequence's KV view, or for all sequences at once
where their views join (``FlatBatch.joined``, the paged cache's; ``group`` for a decode step). A
KV view is anything with ``update(layer, k_new, v_new, positions) -> (k_all, v_all,
k_positions)``: the simple contiguous cache below, or the engine's paged cache.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from inferflow import kernels
from inferflow.errors import RequestError
from inferflow.model.cross import CrossRows


class RowsKVView(Protocol):
    """The rows of every sequence of a step at once: a pure decode step's (GroupKVView) or
    several prompts' (FlatBatch.joined)."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """Writes the new K/V and returns causal attention (within ``window`` positions; no
        bias or soft-cap) of q (rows, H, D) without a padded copy; None, with nothing written,
        where the view has no such path."""
        ...


class GroupKVView(RowsKVView, Protocol):
    """All sequences of a pure decode step (one new token each) at once: where ``attend``
    cannot run, ``update`` writes the new K/V and returns keys padded to the longest sequence:
    (B, S, KVH, D) x 2, positions (B, S), valid (B, S)."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


class KVView(Protocol):
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SeqSlice:
    start: int  # first row of this sequence in the flat batch
    length: int  # number of new tokens of this sequence in the batch


@dataclass
class FlatBatch:
    token_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    seqs: list[SeqSlice]
    kv: list[KVView]  # one per sequence, same order as seqs
    logits_rows: torch.Tensor | None = None  # rows that need logits; None = last row of each seq
    group: GroupKVView | None = None  # set when every sequence has exactly one new token
    # encoder-decoder: which source's cross-attention memory each sequence reads
    # (inferflow.model.cross: a CrossBank's rows)
    cross: CrossRows | None = None
    token_types: torch.Tensor | None = None  # (N,) segment ids (text pairs); None: all 0

    @cached_property
    def joined(self) -> RowsKVView | None:
        """The sequences' KV views as one (built once per batch), where their type can join
        them (a ``join(views, positions)`` static method: the paged cache's) and the sequences'
        rows follow each other in order; else None (then each sequence attends alone)."""
        join = getattr(type(self.kv[0]), "join", None) if self.kv else None
        if join is None:
            return None
        ends = [s.start + s.length for s in self.seqs]
        if [s.start for s in self.seqs] != [0, *ends[:-1]] or ends[-1] != len(self.positions):
            return None
        return join(self.kv, self.positions)

    @classmethod
    def single(cls, token_ids: torch.Tensor, start_pos: int, kv: KVView) -> FlatBatch:
        n = token_ids.numel()
        pos = torch.arange(start_pos, start_pos + n, dtype=torch.long)
        return cls(token_ids.reshape(-1).long(), pos, [SeqSlice(0, n)], [kv])

    def default_logits_rows(self) -> torch.Tensor:
        return torch.tensor([s.start + s.length - 1 for s in self.seqs], dtype=torch.long)


class NoCache:
    """The KV view of a pass with nothing to remember (an encoder): keys are the new tokens."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return k, v, positions


def check_input(ids: list[int], vocab_size: int, limit: int, name: str) -> None:
    """A token-id input a network can take whole: not empty, every id in the vocabulary, at most
    ``limit`` tokens (never truncated). Errors name the input (``name``) and the bounds."""
    if not ids:
        raise RequestError(f"{name} is empty: give at least one token", name)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"{name}: token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}"
        )
    if len(ids) > limit:
        raise RequestError(
            f"{name} has {len(ids)} tokens; the model takes at most {limit} (max_positions)",
            name,
        )


def check_inputs(inputs: list[list[int]], vocab_size: int, limit: int, what: str) -> None:
    for i, ids in enumerate(inputs):
        check_input(ids, vocab_size, limit, f"{what} {i}")


def packed(seqs: list[list[int]], types: list[list[int]] | None = None) -> FlatBatch:
    """Several sequences in one flat batch without padding, each at positions 0..len-1, for a
    pass without a cache (encoders); ``types``: each token's segment (a text pair's second
    text is 1), for networks with token-type embeddings."""
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.cat([torch.arange(len(s), dtype=torch.long) for s in seqs])
    starts = [0]
    for s in seqs[:-1]:
        starts.append(starts[-1] + len(s))
    slices = [SeqSlice(a, len(s)) for a, s in zip(starts, seqs, strict=True)]
    batch = FlatBatch(ids, pos, slices, [NoCache()] * len(seqs))
    if types is not None:
        if [len(t) for t in types] != [len(s) for s in seqs]:
            raise ValueError("packed: one token type per token")
        batch.token_types = torch.tensor([t for s in types for t in s], dtype=torch.long)
    return batch


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the system maps only when written, 4 KiB at a time: an
    anonymous memory map of fresh zero pages (torch.zeros writes every byte; numpy's zeros ask
    for transparent huge pages, so writing one cache row made 2 MiB resident: 120 MiB for
    SmolLM2's first prefill). A KV cache costs no time and no resident memory until used."""
    size = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, n * size)  # (private, anonymous: zeros; freed with the tensor)
    return torch.from_numpy(np.frombuffer(pages, dtype=_UINT[size]).reshape(shape)).view(dtype)


class ContiguousKVCache:
    """One sequence's keys and values in preallocated (layers, max_len, KVH, D) tensors.

    Rows are indexed by absolute position, so a sequence may be extended (or re-fed from an
    earlier position, overwriting) in any chunking.
    """

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype
    ) -> None:
        shape = (n_layers, max_len, n_kv_heads, head_dim)
        self.k, self.v = lazy_zeros(shape, dtype), lazy_zeros(shape, dtype)
        self.max_len = max_len
        self._pos = torch.arange(max_len, dtype=torch.long)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start, end = int(positions[0]), int(positions[-1]) + 1
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is past the cache length {self.max_len}")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end], self._pos[:end]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """As the engine's paged views: the new rows' causal attention by the C decode kernel,
        or None (nothing written) where it cannot run."""
        kernel = kernels.decode_attention_for(self.k)
        start, end = int(positions[0]), int(positions[-1]) + 1
        if kernel is None or end > self.max_len:
            return None
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        slots = self._pos[:end]
        return kernels.causal_rows(
            kernel, q, self.k[layer], self.v[layer], slots, positions, scale, window
        )

    def decode_slots(self, position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For inferflow.model.fused: the whole cache and the rows of positions 0..position."""
        if position >= self.max_len:
            raise ValueError(f"position {position} is past the cache length {self.max_len}")
        return self.k, self.v, self._pos[: position + 1]
