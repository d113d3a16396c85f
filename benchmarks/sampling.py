"""Sampling one decode step: each request's sampler alone vs one vectorized call over the batch.

    python benchmarks/sampling.py [--batch 1,8,32,64] [--vocab 49152] [--top-p-share 0.5]

Random logits over SmolLM2's vocabulary; a mix of greedy rows and temperature 0.8 / top-p 0.9
rows. Three ways, the median time of one step each:

- ``before``: the per-request path before vectorizing (1-D filters, torch.multinomial);
- ``per-request``: each request's Sampler called alone (what the engine falls back to);
- ``vectorized``: ``sample_batch`` over all rows at once (what the engine runs).
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import timed  # noqa: E402

from inferflow.engine.sampling import (  # noqa: E402
    Sampler,
    SamplingParams,
    finite,
    make_sampler,
    sample_batch,
    scaled,
    truncate,
)


def before(s: Sampler, x: torch.Tensor) -> int:
    """The per-request draw as it was (no processors in this benchmark)."""
    x, p = finite(x), s.params
    if p.temperature == 0:
        return int(torch.argmax(x))
    probs = torch.softmax(truncate(scaled(x, p.temperature), p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=s.gen))


def step_ms(fn: Callable[[], object], steps: int) -> float:
    return 1e3 * timed(fn, steps, statistics.median)


def compare(b: int, n_top_p: int, vocab: int, steps: int) -> tuple[float, float, float]:
    """Milliseconds per step: before, per-request, vectorized."""
    x = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * 4
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
    samplers = [make_sampler(sampled if i < n_top_p else SamplingParams()) for i in range(b)]
    empty: list[list[int]] = [[] for _ in range(b)]
    return (
        step_ms(lambda: [before(s, x[i]) for i, s in enumerate(samplers)], steps),
        step_ms(lambda: [s(x[i]) for i, s in enumerate(samplers)], steps),
        step_ms(lambda: sample_batch(samplers, x, empty, empty), steps),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32,64", help="batch sizes, comma-separated")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    ap.add_argument("--top-p-share", type=float, default=0.5, help="share of top-p rows")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per cell (median)")
    args = ap.parse_args()
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"vocab {args.vocab}, {args.top_p_share:.0%} top-p rows (T 0.8, p 0.9), the rest greedy; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps}"
    )
    print(
        f"{'batch':>5} {'top-p rows':>10} {'before ms':>10} {'per-request ms':>15} "
        f"{'vectorized ms':>14} {'per-request / vectorized':>25} {'before / vectorized':>20}"
    )
    for b in map(int, args.batch.split(",")):
        n_top_p = math.ceil(b * args.top_p_share)
        old, alone, vec = compare(b, n_top_p, args.vocab, args.steps)
        print(
            f"{b:>5} {n_top_p:>10} {old:>10.2f} {alone:>15.2f} {vec:>14.2f} "
            f"{alone / vec:>24.2f}x {old / vec:>19.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
