"""One decode step's attention over the paged KV cache: the torch path (gather every sequence's
keys and values into a copy padded to the longest, one masked SDPA call) against the C kernel
(inferflow.kernels.paged_decode_attention, reads each sequence's own keys straight from its
blocks), side by side in one run, for SmolLM2-135M's geometry (9 query / 3 KV heads of 64).

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
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow import kernels  # noqa: E402
from inferflow.blocks.attention import attend_decode_group  # noqa: E402
from inferflow.engine.kv_cache import gather  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def case(batch: int, lens: list[int], blocks: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    S = max(lens)
    # each sequence's blocks scattered over the pool, as after many requests came and went
    perm = torch.randperm(blocks, generator=g)
    need = [-(-n // BS) for n in lens]
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    pos = torch.arange(S)
    read = torch.zeros((batch, S), dtype=torch.long)
    for i, t in enumerate(tables):
        p = pos[: lens[i]]
        read[i, : lens[i]] = t[p // BS] * BS + p % BS
    valid = pos[None, :] < torch.tensor(lens)[:, None]
    return dict(read=read, valid=valid, lens=valid.sum(1), q_pos=torch.tensor(lens) - 1, pos=pos)


def padded_attention(
    kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, c: dict, scale: float
) -> torch.Tensor:
    """The torch path: every sequence's keys gathered into a copy padded to the longest."""
    k, v = gather(kc, c["read"]), gather(vc, c["read"])
    pos = c["pos"].expand(q.shape[0], -1)
    return attend_decode_group(q, k, v, c["q_pos"], pos, c["valid"], scale)


def time_us(fn, repeat: int) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernels.paged_decode_attention()
    blocks = 16384  # 16k blocks x 16 tokens x 768 bytes: 200 MB a cache tensor
    kc = torch.randn(blocks * BS, KVH, D)
    vc = torch.randn(blocks * BS, KVH, D)
    rows = []
    for b in map(int, args.batch.split(",")):
        g = torch.Generator().manual_seed(b)
        even = torch.randint(96, 161, (b,), generator=g).tolist()
        skewed = [2048] + [128] * (b - 1)
        for name, lens in (("lengths 96-160", even), ("one 2048, rest 128", skewed)):
            if b == 1 and name.startswith("one"):
                lens = [2048]
                name = "length 2048"
            c = case(b, lens, blocks)
            q = torch.randn(b, H, D)
            scale = D**-0.5

            torch_path = partial(padded_attention, kc, vc, q, c, scale)
            kernel_path = (
                partial(kernel, q, kc, vc, c["read"], c["lens"], scale) if kernel else None
            )
            t_torch = time_us(torch_path, args.repeat)
            t_kernel, err = float("nan"), float("nan")
            if kernel_path is not None:
                t_kernel = time_us(kernel_path, args.repeat)
                err = (torch_path() - kernel_path()).abs().max().item()
            padded = 2 * c["read"].numel() * KVH * D * 4
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
