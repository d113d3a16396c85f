"""A burst of N prompts at once through the in-process engine (SmolLM2, or ``--spec``; random
token-id prompts, greedy): the mean time from the burst to each request's first token, and the
tokens a second, for each prefill budget (``SchedulerConfig.max_prefill_tokens``: the prompt
tokens one step takes at most), the settings alternating round by round in one process so that
a slow or fast spell of the machine falls on all of them alike. No HTTP: the scheduling alone.
Each burst gets a fresh KV pool; ``--warm`` runs every budget also with the pool's next blocks
mapped first (``Engine.warm_cache``, what an idle server does), against pages mapped by the
step's own writes.

    python benchmarks/prefill_burst.py [--spec NAME] [--n 32] [--prompt-len 64]
                                       [--output-len 8] [--prefill-tokens 512,256,128]
                                       [--max-batched-tokens 512] [--rounds 15] [--warm]
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.engine.scheduler import SchedulerConfig  # noqa: E402
from inferflow.runtime import LanguageModel, load  # noqa: E402


def burst(
    lm: LanguageModel,
    sched: SchedulerConfig,
    prompts: list[list[int]],
    output_len: int,
    warm: bool = False,
) -> tuple[float, float]:
    """(mean seconds to the first token, generated tokens a second) of one burst on a fresh KV
    pool; ``warm``: its next blocks mapped first, as an idle server does (Engine.warm_cache)."""
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(scheduler=sched))
    while warm and eng.warm_cache():
        pass
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    first: dict[str, float] = {}
    tokens, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter() - t0
        for o in outs:
            if o.token_ids:
                tokens += len(o.token_ids)
                first.setdefault(o.request_id, now)
    wall = time.perf_counter() - t0
    return statistics.mean(first.values()), tokens / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--prefill-tokens", default="512,256,128")
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--warm", action="store_true", help="each budget also with the KV pool mapped ahead"
    )
    args = ap.parse_args()
    lm = load(args.spec, "auto")
    budgets = [int(b) for b in args.prefill_tokens.split(",")]
    scheds = {
        b: SchedulerConfig(max_batched_tokens=args.max_batched_tokens, max_prefill_tokens=b)
        for b in budgets
    }
    rng = random.Random(0)
    burst(lm, scheds[budgets[0]], [[rng.randint(1000, 40000)] * 8] * 2, 2)  # warm-up
    settings = [(b, w) for b in budgets for w in ((False, True) if args.warm else (False,))]
    ttft: dict[tuple[int, bool], list[float]] = {s: [] for s in settings}
    tps: dict[tuple[int, bool], list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        prompts = [
            [rng.randint(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.n)
        ]
        for b, w in settings:  # (the same prompts for every setting in a round)
            t, r = burst(lm, scheds[b], prompts, args.output_len, w)
            ttft[b, w].append(t)
            tps[b, w].append(r)
    print("command: python benchmarks/prefill_burst.py " + shlex.join(sys.argv[1:]))
    print(
        f"{args.spec}, {args.n} prompts of {args.prompt_len} tokens at once, {args.output_len} "
        f"generated each, --max-batched-tokens {args.max_batched_tokens}, "
        f"threads={torch.get_num_threads()}, {args.rounds} rounds (medians)"
    )
    base = statistics.median(ttft[settings[0]])
    print("| max_prefill_tokens | KV pool | mean TTFT | vs first | tok/s |")
    print("|---:|---|---:|---:|---:|")
    for b, w in settings:
        t, r = statistics.median(ttft[b, w]), statistics.median(tps[b, w])
        pool = "mapped ahead" if w else "fresh"
        print(f"| {b} | {pool} | {t:.3f} s | {t / base:.2f}x | {r:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
