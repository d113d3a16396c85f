"""Prefill and batch-1 decode speed on SmolLM2-135M (Q4_1 GGUF): Inferflow (float32 and bfloat16
weights dequantized from the file, and the file's own Q4_1 blocks kept, the default) side by
side with llama.cpp (llama-cpp-python) on the same file, in one run.

    python benchmarks/decode.py [--prefill 128] [--decode 64] [--threads 2] [--repeat 3]

Both engines get the same token ids; decode steps are teacher-forced (a fixed next token), so
only the forward pass is timed, not sampling. Best of --repeat runs is reported.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine.generate import new_cache, prefill  # noqa: E402
from inferflow.runtime import load  # noqa: E402

SPEC = "smollm2-135m-instruct"


def bench_inferflow(
    dtype: str, quant: str | None, ids: list[int], n_decode: int, repeat: int
) -> tuple[float, float]:
    lm = load(SPEC, dtype, quant)
    best_p, best_d = 0.0, 0.0
    for _ in range(repeat):
        cache = new_cache(lm.model, len(ids) + n_decode + 1)
        t0 = time.perf_counter()
        prefill(lm.model, ids, cache)
        t1 = time.perf_counter()
        for i in range(n_decode):
            prefill(lm.model, [ids[i % len(ids)]], cache, len(ids) + i)
        t2 = time.perf_counter()
        best_p, best_d = max(best_p, len(ids) / (t1 - t0)), max(best_d, n_decode / (t2 - t1))
    return best_p, best_d


def bench_llama_cpp(
    path: Path, ids: list[int], n_decode: int, threads: int, repeat: int
) -> tuple[float, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(
        model_path=str(path),
        n_ctx=len(ids) + n_decode + 8,
        n_threads=threads,
        n_batch=512,
        verbose=False,
    )
    best_p, best_d = 0.0, 0.0
    for _ in range(repeat):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for i in range(n_decode):
            llm.eval([ids[i % len(ids)]])
        t2 = time.perf_counter()
        best_p, best_d = max(best_p, len(ids) / (t1 - t0)), max(best_d, n_decode / (t2 - t1))
    return best_p, best_d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--configs",
        default="float32:none,bfloat16:none,float32:checkpoint",
        help="dtype:quant pairs; quant none = dequantized float, checkpoint = the GGUF's own blocks",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    lm = load(SPEC, "float32")
    text = Path(__file__).read_text() * 4
    ids = lm.tokenizer.encode(text)[: args.prefill]
    path = lm.spec.source.files[0]
    del lm

    rows = []
    for cfg in args.configs.split(","):
        dt, _, quant = cfg.partition(":")
        p, d = bench_inferflow(
            dt, None if quant == "checkpoint" else quant, ids, args.decode, args.repeat
        )
        rows.append((f"inferflow {dt} {quant}", p, d))
    ref = bench_llama_cpp(path, ids, args.decode, args.threads, args.repeat)
    rows.append(
        ("llama.cpp (llama-cpp-python)", *ref)
        if ref
        else ("llama.cpp: not installed", float("nan"), float("nan"))
    )

    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"model: {SPEC} ({path.name}), threads={args.threads}, prefill={len(ids)} tokens, decode={args.decode} steps, best of {args.repeat}"
    )
    base = rows[-1][2] if ref else None
    print(f"{'engine':<32} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs llama.cpp':>20}")
    for name, p, d in rows:
        ratio = f"{d / base:.2f}x" if base else "-"
        print(f"{name:<32} {p:>14.1f} {d:>13.1f} {ratio:>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
