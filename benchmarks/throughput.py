"""Throughput of the in-process engine on SmolLM2-135M: N concurrent requests (all submitted at
t=0) with a fixed mix of prompt and output lengths, for Inferflow's continuous-batching engine
(no HTTP) and transformers' static batching (one padded batch), side by side in one run. The
comparison with llama.cpp's server, both over HTTP, is benchmarks/serve.py.

    python benchmarks/throughput.py [--concurrency 1,8,32,64] [--prompt-len 32,96] [--output-len 16,128] [--dtype float32] [--quant Q4_B32] [--dense-batch 16] [--repeats R]

Prompt and output lengths are drawn uniformly from the given ranges with a fixed seed per N, so
every engine serves the same requests (``--output-len 64,64`` gives every request the same
length). Each request stops at its own output length (end-of-text is ignored). A static batch
runs until its longest request is done, so transformers generates max(lengths) tokens for every
row; only each request's own tokens count as generated, for every engine.

Reports total generated tokens/s (wall clock, prefill included), TTFT and inter-token latency
(mean / p50 / p99). ``--repeats R`` runs R rounds per N, each round every engine back to back,
and reports medians; a ratio is the median of the rounds' own ratios, which cancels most of a
noisy machine's drift (one round alone can be off by a third on a shared 2-core VM).
transformers runs in bfloat16 (its fastest CPU mode here) unless --hf-dtype.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.engine.scheduler import SchedulerConfig  # noqa: E402
from inferflow.runtime import load  # noqa: E402
from inferflow.spec import load_spec  # noqa: E402

SPEC = "smollm2-135m-instruct"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def prompts_for(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (k,), generator=g).tolist() for k in lens]


def output_lens_for(n: int, lo: int, hi: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + n)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def run_inferflow(
    lm, prompts: list[list[int]], out_lens: list[int], max_batched: int, deterministic: bool = False
) -> dict:
    sched = SchedulerConfig(max_batched_tokens=max_batched, max_running=256)
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(sched, deterministic=deterministic))
    t0 = time.perf_counter()
    ids = [
        eng.add_request(p, SamplingParams(max_new_tokens=k, ignore_eos=True))
        for p, k in zip(prompts, out_lens, strict=True)
    ]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    n_tok = 0
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            n_tok += len(o.token_ids)
            if o.request_id not in first:
                first[o.request_id] = now - t0
            else:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    wall = time.perf_counter() - t0
    ttft = [first[i] for i in ids]
    return dict(tps=n_tok / wall, ttft=ttft, itl=gaps, wall=wall)


def run_transformers(model, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """One static batch: it runs until the longest request is done (max(out_lens) steps for
    every row); each request's own out_len tokens count as generated."""
    n, out_len = len(prompts), max(out_lens)
    width = max(map(len, prompts))
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
        wall = time.perf_counter() - t0
    # generate returns at the end, with no per-token stamps: each gap is the mean decode step
    itl = (wall - ttft) / max(1, out_len - 1)
    gaps = [itl] * sum(k - 1 for k in out_lens)
    return dict(tps=sum(out_lens) / wall, ttft=[ttft] * n, itl=gaps, wall=wall)


def summarize(rs: list[dict], runs: dict[str, list[dict]]) -> dict:
    """Medians over the rounds of one engine; ratios to a peer are the median of the per-round
    ratios (each round's engines ran back to back)."""

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    out = dict(
        tps=med([r["tps"] for r in rs]),
        all_tps=[r["tps"] for r in rs],
        ttft_mean=med([statistics.mean(r["ttft"]) for r in rs]),
        ttft_p99=med([pct(r["ttft"], 0.99) for r in rs]),
        itl_mean=med([statistics.mean(r["itl"]) if r["itl"] else float("nan") for r in rs]),
        itl_p50=med([pct(r["itl"], 0.5) for r in rs]),
        itl_p99=med([pct(r["itl"], 0.99) for r in rs]),
    )
    for label, prefix in (("vs transformers", "transformers"),):
        base = next((b for name, b in runs.items() if name.startswith(prefix)), None)
        out[label] = (
            f"{med([r['tps'] / b['tps'] for r, b in zip(rs, base, strict=True)]):.2f}x"
            if base
            else "-"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-len", default="32,96", help="min,max prompt tokens")
    ap.add_argument("--output-len", default="16,128", help="min,max generated tokens")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument(
        "--deterministic", action="store_true", help="add a row for the batch-invariant mode"
    )
    ap.add_argument(
        "--dense-batch",
        type=int,
        default=None,
        metavar="ROWS",
        help="add a row with quant.dense_batch ROWS (int4pack layers use a dense bf16 copy for "
        "steps of at least ROWS tokens)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--repeats", type=int, default=1, help="interleaved rounds per N (medians are reported)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lo, hi = length_range(args.prompt_len)
    out_lo, out_hi = length_range(args.output_len)
    lm = load(SPEC, args.dtype, args.quant)
    dense = None
    if args.dense_batch is not None:
        spec = load_spec(SPEC)
        spec = replace(spec, quant=replace(spec.quant, dense_batch=args.dense_batch))
        dense = load(spec, args.dtype, args.quant)
    hf = None
    if not args.no_transformers:
        import transformers

        path = lm.spec.source.files[0]
        hf_dtype = getattr(torch, args.hf_dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=hf_dtype
        ).eval()
    for model in (lm, dense):  # warm-up: the first engine run of a process pays one-off costs
        if model is not None:
            run_inferflow(model, prompts_for(2, lo, hi, lm.spec.hparams.vocab_size), [8, 8], 512)
    rows: list[tuple[int, str, dict]] = []
    for n in map(int, args.concurrency.split(",")):
        prompts = prompts_for(n, lo, hi, lm.spec.hparams.vocab_size)
        outs = output_lens_for(n, out_lo, out_hi)
        name = f"inferflow {args.dtype}" + (f" {args.quant}" if args.quant else "")
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # rounds interleave the engines: noise hits each alike
            runs.setdefault(name, []).append(
                run_inferflow(lm, prompts, outs, args.max_batched_tokens)
            )
            if dense is not None:
                r = run_inferflow(dense, prompts, outs, args.max_batched_tokens)
                runs.setdefault(f"{name} dense_batch {args.dense_batch}", []).append(r)
            if args.deterministic:
                r = run_inferflow(lm, prompts, outs, args.max_batched_tokens, True)
                runs.setdefault(f"{name} deterministic", []).append(r)
            if hf is not None:
                r = run_transformers(hf, prompts, outs)
                runs.setdefault(f"transformers {args.hf_dtype} static", []).append(r)
        rows += [(n, engine, summarize(rs, runs)) for engine, rs in runs.items()]
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"model: {SPEC}; prompts {lo}-{hi} tokens, {out_lo}-{out_hi} generated each (uniform, fixed seed), all submitted at t=0; threads={args.threads}; "
        f"{args.repeats} interleaved round(s): medians over rounds; a ratio is the median of the rounds' ratios"
    )
    hdr = f"{'N':>3} {'engine':<40} {'gen tok/s':>9} {'TTFT mean':>9} {'TTFT p99':>8} {'ITL mean':>8} {'ITL p50':>8} {'ITL p99':>8} {'vs transformers':>15}"
    print(hdr)
    for n, name, r in rows:
        print(
            f"{n:>3} {name:<40} {r['tps']:>9.1f} {r['ttft_mean']:>8.2f}s {r['ttft_p99']:>7.2f}s "
            f"{1000 * r['itl_mean']:>6.1f}ms {1000 * r['itl_p50']:>6.1f}ms "
            f"{1000 * r['itl_p99']:>6.1f}ms {r['vs transformers']:>15}"
        )
        if len(r["all_tps"]) > 1:
            print(f"{'':>4}{'':<40} rounds: {', '.join(f'{t:.1f}' for t in r['all_tps'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
