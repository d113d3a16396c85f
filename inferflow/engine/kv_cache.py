"""Paged KV cache: fixed-size blocks in one preallocated pool, per-sequence block tables,
reference-counted sharing (prefix caching, forks) with copy-on-write.

Storage is (layers, blocks, block_size, KV heads, head_dim) for K and for V; only KV heads are
cached, so GQA/MQA models pay for their KV heads alone. A sequence's view for one engine step
precomputes its write and read slots once, then every layer indexes with them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from inferflow import kernels
from inferflow.errors import InferflowError, RequestError
from inferflow.model.batch import lazy_zeros
from inferflow.quant.formats import get_format

log = logging.getLogger(__name__)

KV_DTYPES = ("float32", "float16", "bfloat16", "q8")


class KVCacheFull(InferflowError):
    """No free block is left (the scheduler preempts instead of failing a request)."""


class BlockAllocator:
    """Free blocks in LRU order; freed blocks keep their prefix-cache identity until reused."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.on_reuse: dict[int, bytes] = {}  # block -> prefix hash it still holds (evictable)
        # blocks from here on were never allocated: freed blocks go to the back of ``free``,
        # so these stay at its front, and are taken in order, before any block comes back
        self.fresh = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise KVCacheFull("the KV cache has no free block")
        block, _ = self.free.popitem(last=False)
        self.refs[block] = 1
        self.fresh = max(self.fresh, block + 1)
        return block

    def incref(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]  # a cached prefix block comes back into use
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None


class CachePlan(NamedTuple):
    bytes_per_block: int
    num_blocks: int
    max_len: int  # tokens of the longest sequence: the model's context, or what the cache holds


def plan_cache(
    geometry: tuple[int, int, int],
    block_size: int,
    cache_bytes: int,
    dtype: torch.dtype,
    max_positions: int,
    kv_dtype: str | None = None,
) -> CachePlan:
    """The paged cache a byte budget buys for (layers, KV heads, head_dim) ``geometry`` with
    activations of ``dtype`` (K/V kept as ``kv_dtype``: KVFormat): the engine allocates it,
    inferflow.server.memory bounds a server's memory with it."""
    per_block = PagedKVCache.bytes_per_block(*geometry, block_size, dtype, kv_dtype)
    num_blocks = cache_bytes // per_block
    if num_blocks < 1:
        raise RequestError(
            f"kv_cache_bytes {cache_bytes} holds no block; one block of {block_size} tokens "
            f"needs {per_block} bytes"
        )
    # a sequence never holds more tokens than the cache: past that it would wait forever
    return CachePlan(per_block, num_blocks, min(max_positions, num_blocks * block_size))


def copy_block(k: torch.Tensor, v: torch.Tensor, block_size: int, src: int, dst: int) -> None:
    """Copy one block's K and V in every layer of a (layers, slots, KV heads, D) pool."""
    a, b = src * block_size, dst * block_size
    k[:, b : b + block_size] = k[:, a : a + block_size]
    v[:, b : b + block_size] = v[:, a : a + block_size]


class KVFormat:
    """How the paged cache keeps K and V: ``float32`` / ``float16`` / ``bfloat16`` as such
    (float16 rounded to nearest even, llama.cpp's default cache type); ``q8`` as GGML
    Q8_0 blocks (32 values of a head, int8 codes and a float16 scale: 34 bytes), the codec of
    inferflow.quant.ggml, as llama.cpp keeps a ``--cache-type-k q8_0`` cache. Reads give the
    activations' dtype."""

    def __init__(self, name: str | None, compute: torch.dtype, head_dim: int) -> None:
        if name is not None and name not in KV_DTYPES:
            raise InferflowError(
                f"KV cache dtype {name!r} is unknown; known: {', '.join(KV_DTYPES)}"
            )
        self.compute, self.head_dim = compute, head_dim
        self.name = name or str(compute).removeprefix("torch.")  # None: as the activations
        self.codec = None
        self.width = head_dim  # stored elements per KV head
        if name == "q8":
            if head_dim % 32:
                raise InferflowError(
                    f"KV cache dtype q8 keeps Q8_0 blocks of 32 values: it needs a head size "
                    f"that is a multiple of 32, this model's is {head_dim}"
                )
            self.codec = get_format("Q8_0")
            self.width = head_dim // 32 * self.codec.bytes_per_block
        stores = {
            "q8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float32": torch.float32,
        }  # fmt: skip
        self.store = stores[name] if name is not None else compute

    def bytes_per_value(self) -> float:
        return torch.empty((), dtype=self.store).element_size() * self.width / self.head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(N, KV heads, head_dim) -> what the cache stores, (N, KV heads, width)."""
        if self.codec is None:
            return x.to(self.store)
        assert self.codec.quantize_blocks is not None
        blocks = self.codec.quantize_blocks(x.float().reshape(-1, 32))
        return blocks.reshape(*x.shape[:-1], self.width)

    def decode(self, y: torch.Tensor) -> torch.Tensor:
        """(..., KV heads, width) as stored -> (..., KV heads, head_dim) in the activations'
        dtype."""
        if self.codec is None:
            return y.to(self.compute)
        blocks = y.reshape(-1, self.codec.bytes_per_block)
        x = self.codec.dequantize_blocks(blocks).reshape(*y.shape[:-1], self.head_dim)
        return x.to(self.compute)


@dataclass
class SeqBlocks:
    """One sequence's block table and how many of its positions hold computed K/V. ``salt``
    (a request's ``cache_salt``) starts its chain of prefix hashes: sequences of different
    salts never share a block, so a prefix-cache hit (``cached_tokens``, a faster answer)
    tells a client nothing about another salt's prompts."""

    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[bytes] = field(default_factory=list)  # prefix hash of each full block
    salt: str = ""


class KVPool:
    """K and V of every layer by slot, (layers, slots, KV heads, ...), kept in a ``format``:
    what the views write and read (the engine's PagedKVCache, a partitioned rank's pool)."""

    k: torch.Tensor
    v: torch.Tensor
    format: KVFormat

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New K/V rows (N, KV heads, head_dim) into their slots of ``layer``."""
        self.k[layer][slots] = self.format.encode(k)
        self.v[layer][slots] = self.format.encode(v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots`` (any shape), in the activations' dtype."""
        dec = self.format.decode
        return dec(gather(self.k[layer], slots)), dec(gather(self.v[layer], slots))


class PagedKVCache(KVPool):
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        kv_dtype: str | None = None,  # KVFormat's name; None: ``dtype``, the activations'
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InferflowError(
                f"KV cache needs at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.format = fmt = KVFormat(kv_dtype, dtype, head_dim)
        shape = (n_layers, num_blocks * block_size, n_kv_heads, fmt.width)
        self.k, self.v = lazy_zeros(shape, fmt.store), lazy_zeros(shape, fmt.store)
        self.block_size = block_size
        self.block_bytes = self.bytes_per_block(
            n_layers, n_kv_heads, head_dim, block_size, dtype, kv_dtype
        )
        self.alloc = BlockAllocator(num_blocks)
        self.written = 0  # blocks before this one had their pages written (warm_ahead)
        self.prefix: dict[bytes, int] = {}  # prefix hash -> block
        # prefix hashes are keyed by a secret of this cache: a client cannot search offline for
        # token blocks whose hash collides with another's (Python's hash of ints can be)
        self._hash_key = os.urandom(16)
        # (source, copy) of each copy-on-write, when a partitioned model mirrors them elsewhere
        self.copy_log: list[tuple[int, int]] | None = None

    @staticmethod
    def bytes_per_block(
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: str | None = None,
    ) -> int:
        per_value = KVFormat(kv_dtype, dtype, head_dim).bytes_per_value()
        return int(2 * n_layers * block_size * n_kv_heads * head_dim * per_value)

    def warm_ahead(self, ahead: int, most: int) -> bool:
        """Write zeros to the never-used blocks next in line for allocation, up to ``ahead``
        bytes of them, at most ``most`` bytes a call (at least a block). Their pages are mapped
        on first write, a page fault each 4 KiB: paid here, when the engine is idle, instead
        of by the next step's keys and values. Blocks in use or holding a cached prefix are
        never touched. False when that much is written already."""
        per_block, fresh = self.block_bytes, self.alloc.fresh
        start = max(self.written, fresh)
        end = min(
            self.alloc.num_blocks,
            fresh + max(1, ahead // per_block),
            start + max(1, most // per_block),
        )
        if end <= start:
            return False
        rows = slice(start * self.block_size, end * self.block_size)
        self.k[:, rows].zero_()
        self.v[:, rows].zero_()
        self.written = end
        return True

    def kernel_decode(self) -> bool:
        """Whether decode steps read the blocks with the C kernel (inferflow.kernels): then a
        step of even one sequence is best run as a group (no gathered copy of its keys)."""
        return kernels.decode_attention_for(self.k) is not None

    # --- block tables ---------------------------------------------------------------------

    def blocks_needed(self, seq: SeqBlocks, upto: int) -> int:
        return max(0, -(-upto // self.block_size) - len(seq.blocks))

    def _shared_to_write(self, seq: SeqBlocks, upto: int) -> list[int]:
        """Indexes of blocks that positions [num_computed, upto) would write but others share."""
        first = seq.num_computed // self.block_size
        last = min(len(seq.blocks), -(-upto // self.block_size))
        return [i for i in range(first, last) if self.alloc.refs[seq.blocks[i]] > 1]

    def reserve(self, seq: SeqBlocks, upto: int) -> None:
        """Give ``seq`` writable blocks for positions [num_computed, upto): new blocks, and
        private copies of shared blocks it will write (copy-on-write). All or nothing."""
        shared = self._shared_to_write(seq, upto)
        need = self.blocks_needed(seq, upto) + len(shared)
        if need > self.alloc.num_free:
            raise KVCacheFull(f"need {need} blocks, {self.alloc.num_free} free")
        for i in shared:
            self._writable(seq, i)
        for _ in range(self.blocks_needed(seq, upto)):
            block = self.alloc.allocate()
            self._forget(block)
            seq.blocks.append(block)

    def release(self, seq: SeqBlocks) -> None:
        for b in seq.blocks:
            self.alloc.decref(b)
        seq.blocks.clear()
        seq.hashes.clear()
        seq.num_computed = 0

    def fork(self, seq: SeqBlocks) -> SeqBlocks:
        """A copy sharing every block (n > 1 samples, beams); writes copy on demand."""
        for b in seq.blocks:
            self.alloc.incref(b)
        return SeqBlocks(list(seq.blocks), seq.num_computed, list(seq.hashes), seq.salt)

    def _forget(self, block: int) -> None:
        h = self.alloc.on_reuse.pop(block, None)
        if h is not None and self.prefix.get(h) == block:
            del self.prefix[h]

    def _writable(self, seq: SeqBlocks, index: int) -> None:
        block = seq.blocks[index]
        if self.alloc.refs[block] > 1:  # copy-on-write
            new = self.alloc.allocate()
            self._forget(new)
            copy_block(self.k, self.v, self.block_size, block, new)
            if self.copy_log is not None:
                self.copy_log.append((block, new))
            self.alloc.decref(block)
            seq.blocks[index] = new
            del seq.hashes[index:]

    # --- prefix caching -------------------------------------------------------------------

    def match_prefix(self, seq: SeqBlocks, tokens: list[int]) -> int:
        """Share cached blocks for the longest run of full blocks of ``tokens``; returns tokens
        covered. At least one token is always left to compute (its logits are needed)."""
        bs, h = self.block_size, self._root(seq)
        n_full = (len(tokens) - 1) // bs
        for i in range(n_full):
            h = self._chain(h, tokens[i * bs : (i + 1) * bs])
            block = self.prefix.get(h)
            if block is None:
                break
            self.alloc.incref(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
        seq.num_computed = len(seq.blocks) * bs
        return seq.num_computed

    def _root(self, seq: SeqBlocks) -> bytes:
        """The hash a sequence's chain starts from: its salt's."""
        return self._chain(b"", [], seq.salt.encode("utf-8", "surrogatepass"))

    def _chain(self, parent: bytes, tokens: list[int], salt: bytes = b"") -> bytes:
        """The prefix hash of a block of ``tokens`` after the prefix hashed ``parent``."""
        data = parent + array("q", tokens).tobytes() + salt
        return hashlib.blake2b(data, digest_size=16, key=self._hash_key).digest()

    def register_full_blocks(self, seq: SeqBlocks, tokens: list[int]) -> None:
        """Publish newly completed blocks (all tokens computed) for prefix sharing."""
        bs = self.block_size
        h = seq.hashes[-1] if seq.hashes else self._root(seq)
        for i in range(len(seq.hashes), seq.num_computed // bs):
            h = self._chain(h, tokens[i * bs : (i + 1) * bs])
            seq.hashes.append(h)
            block = seq.blocks[i]
            if h not in self.prefix:
                self.prefix[h] = block
                self.alloc.on_reuse[block] = h

    # --- the per-step view the model calls ----------------------------------------------------

    def view(self, seq: SeqBlocks, start: int, end: int) -> PagedView:
        """K/V access for positions [start, end) being computed this step (blocks reserved)."""
        bs = self.block_size
        for i in range(start // bs, -(-end // bs)):
            self._writable(seq, i)
        table = torch.tensor(seq.blocks, dtype=torch.long)
        pos = torch.arange(end, dtype=torch.long)
        slots = table[pos // bs] * bs + pos % bs
        return PagedView(self, slots[start:end], slots, pos)

    def group_view(self, seqs: list[SeqBlocks], positions: list[int]) -> PagedGroupView:
        """A decode step of several sequences, each writing one token at ``positions[i]``."""
        bs = self.block_size
        for seq, p in zip(seqs, positions, strict=True):
            self._writable(seq, p // bs)
        S = max(positions) + 1
        pos = torch.arange(S, dtype=torch.long)
        tables = torch.zeros((len(seqs), -(-S // bs)), dtype=torch.long)
        for i, seq in enumerate(seqs):
            n = -(-(positions[i] + 1) // bs)
            tables[i, :n] = torch.tensor(seq.blocks[:n], dtype=torch.long)
        slots = tables[:, pos // bs] * bs + pos % bs  # (B, S); padding reads block 0, masked out
        at = torch.tensor(positions, dtype=torch.long)
        valid = pos[None, :] <= at[:, None]
        write = slots.gather(1, at[:, None]).squeeze(1)
        return PagedGroupView(self, write, slots, pos.expand(len(seqs), S), valid)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` for a (slots, KVH, D) layer and any shape of slot ids: index_select on
    the flat ids is 4-5x faster on CPU than advanced indexing (a decode step of 32 sequences
    gathers every layer's K and V this way)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class PagedRows:
    """Query rows of one step at once, each over its own sequence's keys: row t reads slot list
    lists[which[t]] of the paged cache (``which`` None: list t; lists (S,): that one list for
    every row), its first positions[t] + 1 slots. One K/V write and one kernel call a layer for all of them: a decode step's rows
    (PagedGroupView), or several prompts' (PagedView.join; one call per sequence and layer
    before: 1,110 of each for 32 SmolLM2 prompts). Each row gets the operations it gets alone."""

    def __init__(
        self,
        cache: KVPool,
        write: torch.Tensor,
        lists: torch.Tensor,
        positions: torch.Tensor,
        which: torch.Tensor | None = None,
    ) -> None:
        self.cache, self.write, self.lists = cache, write, lists
        self.positions, self.which = positions, which
        self.kernel = kernels.decode_attention_for(cache.k)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """Writes the new K/V and returns causal attention (within ``window`` positions, no
        bias or soft-cap) of the queries (rows, H, D), read from the blocks by the C kernel
        (inferflow.kernels.causal_rows): no padded copy. None, with nothing written, where the
        kernel cannot run."""
        if self.kernel is None:
            return None
        c = self.cache
        c.write(layer, self.write, k, v)
        return kernels.causal_rows(
            self.kernel, q, c.k[layer], c.v[layer], self.lists, self.positions, scale, window,
            self.which,
        )  # fmt: skip


class PagedGroupView(PagedRows):
    """A decode step: one row per sequence, ``read`` (B, S) its slots, ``valid`` marking its
    keys, a prefix of them (the rest is padding); where ``attend`` cannot run, ``update``."""

    def __init__(
        self,
        cache: KVPool,
        write: torch.Tensor,
        read: torch.Tensor,
        pos: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        # (each sequence's new position, once, not per layer)
        super().__init__(cache, write, read, valid.sum(1) - 1)
        self.read, self.pos, self.valid = read, pos, valid

    def slot_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For inferflow.model.fused: the whole cache and each sequence's slots (B, S), its
        first positions + 1 being its keys, the last of them where this step writes."""
        return self.cache.k, self.cache.v, self.read

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        self.cache.write(layer, self.write, k, v)
        return *self.cache.read(layer, self.read), self.pos, self.valid


class PagedView:
    def __init__(
        self, cache: KVPool, write: torch.Tensor, read: torch.Tensor, pos: torch.Tensor
    ) -> None:
        self.cache, self.write, self.read, self.pos = cache, write, read, pos

    def decode_slots(self, position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For inferflow.model.fused: the whole cache and the slots of positions 0..position,
        the last being where this step writes."""
        return self.cache.k, self.cache.v, self.read[: position + 1]

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
        """Writes the new K/V and returns causal attention of the new rows' queries (T, H, D)
        by the C decode kernel, each row as in any other batch or chunking
        (inferflow.kernels.causal_rows); None, with nothing written, where it cannot run."""
        rows = PagedRows(self.cache, self.write, self.read, positions)
        return rows.attend(layer, q, k, v, scale, window)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.cache.write(layer, self.write, k, v)
        return *self.cache.read(layer, self.read), self.pos

    @staticmethod
    def join(views: Sequence[object], positions: torch.Tensor) -> PagedRows | None:
        """The views of a step's sequences (in row order; ``positions`` their rows') as one
        PagedRows, where there are several, all PagedViews of one cache."""
        paged = [v for v in views if isinstance(v, PagedView)]
        if len(paged) < 2 or len(paged) != len(views):
            return None
        cache = paged[0].cache
        if any(v.cache is not cache for v in paged):
            return None
        lists = torch.zeros((len(paged), max(len(v.read) for v in paged)), dtype=torch.long)
        for i, v in enumerate(paged):  # (past a list's end: never read, lens stop before)
            lists[i, : len(v.read)] = v.read
        counts = torch.tensor([len(v.write) for v in paged])
        which = torch.repeat_interleave(torch.arange(len(paged)), counts)
        write = torch.cat([v.write for v in paged])
        return PagedRows(cache, write, lists, positions, which)
