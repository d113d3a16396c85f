"""KV-cache dtypes (``--kv-cache-dtype``): what a fixed memory budget holds, what quantized K/V
cost in quality, and in speed.

    python benchmarks/kv_cache.py [--models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,gemma-3-270m] [--tokens 1024] [--chunk 64] [--budget 1GiB] [--speed-requests 8]

- **capacity**: tokens the paged cache holds in ``--budget`` (serve's default 1 GiB), and how
  many sequences of 2,048 tokens that is, per dtype.
- **quality**: hamlet.txt (tools/fetch_models.py), its first ``--tokens`` tokens fed through
  the engine's paged cache in chunks of ``--chunk`` (so that most keys a row reads were written
  by earlier chunks, as in serving), the logits of every row against the float32 cache's: mean
  and max KL(float32 || dtype) in nats, top-1 agreement, and perplexity.
- **keys**: the float32 cache's key magnitudes (what q8 blocks have to span).
- **speed**: ``--speed-requests`` greedy requests of 128 tokens at once through the engine,
  generated tok/s (median of 3 rounds;
  bfloat16 K/V are read in torch, float32, float16 and q8 by the C kernels).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.cli.serve import memory_bytes  # noqa: E402
from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.forward import Rows, forward_rows  # noqa: E402
from inferflow.engine.kv_cache import KV_DTYPES, PagedKVCache, SeqBlocks, plan_cache  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.runtime import LanguageModel, load  # noqa: E402

TEXT = Path.home() / ".cache" / "inferflow" / "texts" / "hamlet.txt"


def logits_through(
    lm: LanguageModel, ids: list[int], chunk: int, kv_dtype: str
) -> tuple[torch.Tensor, PagedKVCache]:
    """(len(ids), V) logits, the text fed in chunks through a paged cache of ``kv_dtype``, and
    the cache."""
    model = lm.model
    geometry = model.kv_geometry()
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(*geometry, 16, blocks, torch.float32, kv_dtype)
    seq = SeqBlocks()
    cache.reserve(seq, len(ids))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            out.append(forward_rows(model, cache, [Rows(seq, start, part, False, len(part))]))
            seq.num_computed = start + len(part)
    return torch.cat(out), cache


def key_spread(cache: PagedKVCache, n: int) -> tuple[float, float, float]:
    """Of a float32 cache's first n keys: the largest |k|, the median |k|, and the 99th
    percentile over 32-value blocks of (largest / median |k| of the block)."""
    k = cache.k[:, :n].abs()
    blocks = k.unflatten(-1, (-1, 32))
    ratio = (blocks.amax(-1) / blocks.median(-1).values.clamp_min(1e-12)).flatten()
    return float(k.max()), float(k.median()), float(ratio.kthvalue(int(0.99 * len(ratio))).values)


def quality(
    ref: torch.Tensor, got: torch.Tensor, ids: list[int]
) -> tuple[float, float, float, float]:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    nxt = torch.tensor(ids[1:])
    ppl = torch.exp(-lq[:-1].gather(1, nxt[:, None]).mean())
    return float(kl.mean()), float(kl.max()), float(top1), float(ppl)


def speed(lm: LanguageModel, kv_dtype: str, n: int, rounds: int = 3) -> float:
    words = "sea river mountain city forest desert island winter summer music".split()
    tps = []
    for r in range(rounds):
        prompts = [f"Write a story about a {words[(i + r) % 10]}, part {i}." for i in range(n)]
        eng = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_dtype=kv_dtype))
        t0 = time.perf_counter()
        done = eng.generate(prompts, SamplingParams(max_new_tokens=128, ignore_eos=True))
        tps.append(sum(len(x.output_ids) for x in done) / (time.perf_counter() - t0))
    return statistics.median(tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,gemma-3-270m"
    )
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--speed-requests", type=int, default=8)
    args = ap.parse_args()
    if not TEXT.exists():
        sys.exit(f"{TEXT} is missing: run `make models` (tools/fetch_models.py hamlet)")
    budget = memory_bytes(args.budget)
    rows, spreads = [], []
    for name in args.models.split(","):
        lm = load(name)
        ids = lm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[: args.tokens]
        ref, cache = logits_through(lm, ids, args.chunk, "float32")
        spreads.append((name, *key_spread(cache, len(ids))))
        h = lm.spec.hparams
        for kd in KV_DTYPES:
            plan = plan_cache(lm.model.kv_geometry(), 16, budget, torch.float32, 1 << 30, kd)
            tokens = plan.num_blocks * 16
            got = ref if kd == "float32" else logits_through(lm, ids, args.chunk, kd)[0]
            q = quality(ref, got, ids)
            rows.append(
                (
                    name,
                    kd,
                    plan.bytes_per_block / 16,
                    tokens,
                    tokens // 2048,
                    *q,
                    speed(lm, kd, args.speed_requests),
                )
            )
        del lm, h
    print(
        f"\nKV cache dtypes, budget {args.budget}; quality on hamlet.txt's first {args.tokens} tokens in chunks of {args.chunk}, against float32 K/V; speed: {args.speed_requests} greedy requests x 128 tokens, {torch.get_num_threads()} threads\n"
    )
    print(
        "| model | KV dtype | bytes/token | tokens in budget | 2048-token seqs | mean KL | max KL | top-1 agree | ppl | tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, kd, bpt, tokens, seqs, kl, klmax, top1, ppl, tps in rows:
        print(
            f"| {name} | {kd} | {bpt:.0f} | {tokens} | {seqs} | {kl:.2e} | {klmax:.2e} | {top1:.2%} | {ppl:.3f} | {tps:.1f} |"
        )
    print("\n| model | max abs key | median abs key | p99 of a 32-value block's max / median |")
    print("|---|---|---|---|")
    for name, mx, med, p99 in spreads:
        print(f"| {name} | {mx:.1f} | {med:.2f} | {p99:.1f} |")
    print(f"\ncommand: python benchmarks/kv_cache.py {shlex.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
