"""One decode step's attention over the paged KV cache: the torch path (gather every sequence's
keys and values into a copy padded to the longest, one masked SDPA call) against the C kernel
(inferflow.kernels.paged_decode_attention, reads each sequence's own keys straight from its
blocks), side by side in one run, for SmolLM2-135M's geometry (9 query / 3 KV heads of 64). Both
run as the engine runs them, through the step's ``PagedGroupView`` (``update`` then
``attend_decode_group``, against ``attend``), the new token's K/V write included.

    python benchmarks/decode_attention.py [--batch 1,8,32] [--repeat 200] [--threads N]

Cases: every sequence about as long as the others, and one long sequence among short ones
(where padding to the longest multiplies the torch path's work). Prints microseconds per layer
call (median of --repeat, the cache much larger than the CPU's caches, so keys come from memory
as in a real step) and the peak bytes of the padded copy the torch path makes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import timed  # noqa: E402

from inferflow import kernels  # noqa: E402
from inferflow.blocks.attention import attend_decode_group  # noqa: E402
from inferflow.engine.kv_cache import PagedGroupView, PagedKVCache, SeqBlocks  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def group_view(cache: PagedKVCache, lens: list[int], seed: int) -> PagedGroupView:
    """The engine's view of a decode step of sequences of ``lens`` tokens (the last one new),
    each sequence's blocks scattered over the pool, as after many requests came and went."""
    perm = torch.randperm(cache.alloc.num_blocks, generator=torch.Generator().manual_seed(seed))
    seqs, at = [], 0
    for n in lens:
        need = -(-n // cache.block_size)
        seqs.append(SeqBlocks(perm[at : at + need].tolist()))
        at += need
    return cache.group_view(seqs, [n - 1 for n in lens])


def torch_path(
    view: PagedGroupView, q: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    """The engine's torch path: every sequence's keys gathered into a copy padded to the longest."""
    k, v, pos, valid = view.update(0, kv, kv)
    return attend_decode_group(q, k, v, q_pos, pos, valid, D**-0.5)


def kernel_path(view: PagedGroupView, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The C kernel, reading each sequence's own keys from its blocks."""
    out = view.attend(0, q, kv, kv, D**-0.5)
    assert out is not None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernels.paged_decode_attention()
    # 16k blocks x 16 tokens x 768 bytes: 200 MB a cache tensor, far beyond the CPU's caches
    cache = PagedKVCache(1, KVH, D, BS, 16384, torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    rows = []
    for b in map(int, args.batch.split(",")):
        g = torch.Generator().manual_seed(b)
        even = torch.randint(96, 161, (b,), generator=g).tolist()
        skewed = [2048] + [128] * (b - 1)
        for name, lens in (("lengths 96-160", even), ("one 2048, rest 128", skewed)):
            if b == 1 and name.startswith("one"):
                name, lens = "length 2048", [2048]
            view = group_view(cache, lens, b)
            q, kv = torch.randn(b, H, D, generator=g), torch.randn(b, KVH, D, generator=g)
            q_pos = torch.tensor(lens) - 1  # (view.lens exists only where the kernel does)
            t_torch = 1e6 * timed(
                partial(torch_path, view, q, kv, q_pos), args.repeat, statistics.median, 5
            )
            t_kernel, err = float("nan"), float("nan")
            if kernel is not None:
                t_kernel = 1e6 * timed(
                    partial(kernel_path, view, q, kv), args.repeat, statistics.median, 5
                )
                want = torch_path(view, q, kv, q_pos)
                err = (want - kernel_path(view, q, kv)).abs().max().item()
            padded = 2 * view.read.numel() * KVH * D * 4
            rows.append((b, name, t_torch, t_kernel, err, padded))
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"threads={args.threads}; kernel: {'built' if kernel else 'not available'}")
    print(
        f"{'B':>3} {'lengths':<22} {'torch us':>9} {'kernel us':>9} {'speed-up':>8} {'max |diff|':>10} {'padded copy':>11}"
    )
    for b, name, t1, t2, err, padded in rows:
        print(
            f"{b:>3} {name:<22} {t1:>9.1f} {t2:>9.1f} {t1 / t2:>7.2f}x {err:>10.1e} {padded / 2**20:>9.1f}MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
