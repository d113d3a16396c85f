"""Selective batching vs padding: one engine prefill step of N prompts of mixed lengths, run
padding-free (one flat batch of the real tokens, attention per request) and padded (every
prompt lengthened to the longest, as a padded [N, max_len] batch computes), side by side.

    python benchmarks/padding.py [--n 16] [--lengths 16,256] [--repeat 3]

Prints the tokens computed and the wall time of each; the ratio is what padding wastes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.engine.scheduler import SchedulerConfig  # noqa: E402
from inferflow.runtime import load  # noqa: E402


def prefill_seconds(lm, prompts: list[list[int]], repeat: int) -> float:  # noqa: ANN001
    best = float("inf")
    budget = sum(map(len, prompts))
    for _ in range(repeat):
        cfg = EngineConfig(
            SchedulerConfig(budget, len(prompts), prefix_caching=False), kv_cache_bytes=1 << 30
        )
        eng = Engine(lm.model, None, cfg)
        for p in prompts:
            eng.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        eng.step()  # every prompt in one step (the budget covers them all)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--lengths", default="16,256", help="min,max prompt tokens")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    lo, hi = map(int, args.lengths.split(","))
    lm = load(args.spec)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (args.n,), generator=g).tolist()
    prompts = [torch.randint(100, 10000, (k,), generator=g).tolist() for k in lens]
    longest = max(lens)
    padded = [p + [p[-1]] * (longest - len(p)) for p in prompts]
    free = prefill_seconds(lm, prompts, args.repeat)
    pad = prefill_seconds(lm, padded, args.repeat)
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"{args.n} prompts of {lo}-{hi} tokens (mean {sum(lens) / len(lens):.0f}), one prefill step each way"
    )
    print(f"{'batching':<14} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    print(f"{'padding-free':<14} {sum(lens):>7} {free:>8.3f} {sum(lens) / free:>9.0f}")
    print(
        f"{'padded':<14} {longest * args.n:>7} {pad:>8.3f} {sum(lens) / pad:>9.0f}  (useful tokens/s)"
    )
    print(f"padded / padding-free time: {pad / free:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
