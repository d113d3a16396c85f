"""Where the engine's time goes: N concurrent requests (SmolLM2, or ``--spec``; random token-id
prompts, greedy, a fixed length each) through the in-process engine, with timers around its
stages: the one-call C decode of the layers (prompt and decode rows where the stack has one), the
module path (the rest), final norm and head, sampling and bookkeeping.

    python benchmarks/step_profile.py [--spec NAME] [--n 32] [--prompt-len 64] [--output-len 128]
                                      [--dtype auto|float32|act8]
"""

from __future__ import annotations

import argparse
import collections
import random
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.engine.scheduler import SchedulerConfig  # noqa: E402
from inferflow.model.fused import FusedDecode  # noqa: E402
from inferflow.model.stack import Stack  # noqa: E402
from inferflow.runtime import load  # noqa: E402

STAGES = [
    (FusedDecode, "run", "layers, one-call C decode (all rows it takes)"),
    (Stack, "_run_modules", "layers, module path (rows it cannot take)"),
    (Stack, "logits", "final norm and head"),
    (Engine, "_update", "sampling and bookkeeping"),
]


def timed(cls: type, name: str, key: str, into: collections.Counter) -> None:
    f: Callable[..., Any] = getattr(cls, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            into[key] += time.perf_counter() - t

    setattr(cls, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument(
        "--dtype", default="auto", help="auto (serve's default), float32, or act8 (8-bit inputs)"
    )
    ap.add_argument("--kv-cache-dtype", default=None, help="float32 (default), bfloat16 or q8")
    args = ap.parse_args()
    lm = load(args.spec, args.dtype)
    spent: collections.Counter = collections.Counter()
    for cls, name, key in STAGES:
        timed(cls, name, key, spent)
    rng = random.Random(0)
    sched = SchedulerConfig(max_batched_tokens=512)
    for warm in (True, False):
        spent.clear()
        eng = Engine(
            lm.model,
            lm.tokenizer,
            EngineConfig(scheduler=sched, kv_cache_dtype=args.kv_cache_dtype),
        )
        n = 2 if warm else args.n
        for _ in range(n):
            prompt = [rng.randint(1000, 40000) for _ in range(args.prompt_len)]
            eng.add_request(prompt, SamplingParams(max_new_tokens=args.output_len, ignore_eos=True))
        t0, tokens, steps = time.perf_counter(), 0, 0
        while eng.has_unfinished():
            tokens += sum(len(o.token_ids) for o in eng.step())
            steps += 1
        wall = time.perf_counter() - t0
    print("command: python benchmarks/step_profile.py " + shlex.join(sys.argv[1:]))
    print(
        f"{args.spec}, N={args.n}, {args.prompt_len}-token prompts, {args.output_len} generated "
        f"each, threads={torch.get_num_threads()}: {tokens / wall:.1f} tok/s, {steps} steps"
    )
    for key, secs in [*spent.most_common(), ("(rest)", wall - sum(spent.values()))]:
        print(f"  {key:42} {secs:7.2f} s {100 * secs / wall:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
