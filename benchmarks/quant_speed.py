"""Decode speed and resident weight memory per weight format on SmolLM2-135M, batch 1 and 16,
side by side with float32 / bfloat16 and llama.cpp (llama-cpp-python, when installed) in one run.

    python benchmarks/quant_speed.py [--formats checkpoint,Q4_B32,...] [--batch 1,16] [--decode 48]

Rows: ``float32`` / ``bfloat16`` are the GGUF dequantized to float; ``checkpoint`` keeps the
GGUF's own Q4_1 blocks (and the Q8_0 embedding as the tied head's weight) in QuantLinear, the
default load; every other row re-quantizes all linear layers (and the tied head) to that format.
Each row runs the continuous-batching engine with B requests of a 64-token prompt: prefill, then
--decode greedy steps of B tokens each; decode tok/s counts all B sequences. Resident weight MB
counts every parameter, buffer and QuantLinear's packed weight. llama.cpp decodes one sequence
(batch 1) of the same Q4_1 file, teacher-forced as in benchmarks/decode.py, measured first.
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

from decode import bench_llama_cpp  # noqa: E402

from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.quant.linear import QuantLinear  # noqa: E402
from inferflow.runtime import load, tokenizer_for  # noqa: E402
from inferflow.spec import load_spec  # noqa: E402

SPEC = "smollm2-135m-instruct"
FORMATS = "checkpoint,Q8,Q6,Q5,Q4_B32,Q4_B64,Q3H,Q3_B32,Q2,Q8_0,Q4_1,Q4_0"


def weight_mb(model: torch.nn.Module) -> float:
    n = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    n += sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    return n / 1e6


def decode_speed(model: torch.nn.Module, prompt: list[int], batch: int, steps: int) -> float:
    eng = Engine(model, None, EngineConfig(kv_cache_bytes=64 << 20))
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(prompt, params)
    eng.step()  # prefill of every request (64 * batch <= the 1024-token budget below)
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        n += sum(len(o.token_ids) for o in eng.step())
    return n / (time.perf_counter() - t0)


def load_row(name: str) -> torch.nn.Module:
    if name in ("float32", "bfloat16"):
        return load(SPEC, name, "none").model
    if name == "checkpoint":
        return load(SPEC, "float32").model
    return load(SPEC, "float32", name).model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2, help="best of N runs per cell")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    spec = load_spec(SPEC)
    tok = tokenizer_for(spec)
    assert tok is not None
    prompt = tok.encode(Path(__file__).read_text())[:64]
    path = spec.source.files[0]
    # llama.cpp first, in a process that has run no torch work yet (busy torch threads slow it)
    ref = bench_llama_cpp(path, prompt, args.decode, args.threads, args.repeat)
    llama = ref[1] if ref else None

    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(
        f"model: {SPEC} ({path.name}), threads={args.threads}, prompt 64 tokens, {args.decode} decode steps, best of {args.repeat}"
    )
    cols = "".join(f" {'B=' + str(b) + ' tok/s':>13}" for b in batches)
    print(f"{'weights':<12} {'weight MB':>10}{cols} {'B=1 vs bf16':>12} {'B=1 vs llama.cpp':>17}")
    rows = ["float32", "bfloat16", *args.formats.split(",")]
    bf16 = None
    for name in rows:
        model = load_row(name)
        speeds = [
            max(decode_speed(model, prompt, b, args.decode) for _ in range(args.repeat))
            for b in batches
        ]
        if name == "bfloat16":
            bf16 = speeds[0]
        vs_bf16 = f"{speeds[0] / bf16:.2f}x" if bf16 else "-"
        vs_llama = f"{speeds[0] / llama:.2f}x" if llama else "-"
        cells = "".join(f" {s:>13.1f}" for s in speeds)
        print(
            f"{name:<12} {weight_mb(model):>10.1f}{cells} {vs_bf16:>12} {vs_llama:>17}", flush=True
        )
        del model
    if llama:
        print(
            f"{'llama.cpp':<12} {path.stat().st_size / 1e6:>10.1f} {llama:>13.1f}  (Q4_1 file, batch 1)"
        )
    else:
        print("llama.cpp: llama-cpp-python not installed (pip install llama-cpp-python)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
