"""Partition layouts side by side on CPU processes (gloo), with the planner's predictions.

    python benchmarks/partition.py [--requests 32] [--prompt-len 64] [--output-len 32]
        [--layouts "single,cpu;cpu,cpu&cpu,cpu&cpu;cpu&cpu"] [--hidden 512 --layers 8]

A random llama-style model (GQA) is built with transformers and saved; each layout serves the
same concurrent greedy requests through the continuous-batching engine. Printed per layout:
generated tokens/s (wall clock, prefill included), the mean decode step (ms per token of each
sequence), each rank's resident weight MiB, and `inferflow plan`'s estimate for the same
layout from a Hardware calibrated on this machine (matmul FLOP/s and memory bandwidth at each
rank's thread count, gloo all-reduce latency and bandwidth between two processes).

CPU-process numbers are indicative only: every rank shares this machine's cores and memory bus,
so the split layouts cannot be faster in total than one process using all cores; the planner
is told so (per-rank FLOP/s and bandwidth scaled by cores / ranks when ranks outnumber cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import timed  # noqa: E402

from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.engine.scheduler import SchedulerConfig  # noqa: E402
from inferflow.model.build import load_model  # noqa: E402
from inferflow.parallel import free_port  # noqa: E402
from inferflow.parallel.cost import Hardware, estimate  # noqa: E402
from inferflow.parallel.layout import resolve_layout  # noqa: E402
from inferflow.parallel.runtime import launch, weight_bytes  # noqa: E402
from inferflow.spec import load_spec  # noqa: E402
from inferflow.spec.types import PartitionSpec, Spec  # noqa: E402

CORES = os.cpu_count() or 1


def make_model(d: Path, hidden: int, layers: int) -> Spec:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        vocab_size=4096,
        max_position_embeddings=1024,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(d)
    (d / "spec.yaml").write_text(
        f"name: bench\nbase: arch/llama\nsource: {{format: hf, files: ['{d}']}}\n"
    )
    return load_spec(d / "spec.yaml")


# --- calibration --------------------------------------------------------------------------


def compute_rates(threads: int, hidden: int) -> tuple[float, float]:
    """(matmul FLOP/s, memory bandwidth bytes/s) with ``threads`` threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(256, hidden), torch.randn(hidden, 3 * hidden)
        flops = 2 * 256 * hidden * 3 * hidden / timed(lambda: a @ b, 5)
        w, x = torch.randn(4096, 4096), torch.randn(4, 4096)  # a decode-shaped matmul: weight-bound
        bandwidth = w.numel() * 4 / timed(lambda: x @ w.t(), 5)
    finally:
        torch.set_num_threads(saved)
    return flops, bandwidth


def _link_rank(rank: int, address: str, out: dict) -> None:  # type: ignore[type-arg]
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    small, big = torch.ones(256), torch.ones(1 << 21)  # 1 KiB, 8 MiB
    lat = timed(lambda: dist.all_reduce(small), 50)
    bw = big.numel() * 4 / timed(lambda: dist.all_reduce(big), 5)
    if rank == 0:
        out["latency"], out["link"] = lat, bw
    dist.destroy_process_group()


def link_rates() -> tuple[float, float]:
    """(seconds per small gloo all-reduce, bytes/s of a large one) between two processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_link_rank, args=(r, address, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return out["latency"], out["link"]


# --- runs -----------------------------------------------------------------------------------


def run(
    model: torch.nn.Module, prompts: list[list[int]], out_len: int
) -> tuple[float, float, float]:
    """(generated tokens/s, mean seconds of a pure decode step, of its forward pass alone)
    serving every prompt at once."""
    cfg = EngineConfig(SchedulerConfig(max_batched_tokens=4096, max_running=256), block_size=16)
    engine = Engine(model, None, cfg)
    params = SamplingParams(max_new_tokens=out_len, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm up
    for p in prompts:
        engine.add_request(p, params)
    forward = engine._execute
    spent: list[float] = []

    def execute(batch):  # type: ignore[no-untyped-def]
        f0 = time.perf_counter()
        out = forward(batch)
        spent.append(time.perf_counter() - f0)
        return out

    engine._execute = execute  # type: ignore[method-assign]
    steps, passes, t0 = [], [], time.perf_counter()
    while engine.has_unfinished():
        pure = all(r.kv.num_computed == len(r.tokens) - 1 for r in engine.scheduler.running) and (
            not engine.scheduler.waiting
        )
        s0 = time.perf_counter()
        engine.step()
        if pure:
            steps.append(time.perf_counter() - s0)
            passes.append(spent[-1])
    wall = time.perf_counter() - t0
    n = max(1, len(steps))
    return len(prompts) * out_len / wall, sum(steps) / n, sum(passes) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layouts", default="single,cpu;cpu,cpu&cpu,cpu&cpu;cpu&cpu")
    args = ap.parse_args()
    print("command: python benchmarks/partition.py " + shlex.join(sys.argv[1:]))
    print("CPU-process numbers are indicative only: all ranks share this machine's "
          f"{CORES} cores and one memory bus.")  # fmt: skip

    d = Path(tempfile.mkdtemp(prefix="inferflow-partition-"))
    spec = make_model(d, args.hidden, args.layers)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 4096, (args.requests, args.prompt_len), generator=g).tolist()
    latency, link = link_rates()
    rates = {}
    context = args.prompt_len + args.output_len // 2
    print(f"calibration: gloo all-reduce {latency * 1e6:.0f} us, {link / 1e9:.2f} GB/s")

    rows = []
    for name in args.layouts.split(","):
        if name == "single":
            world, model, close = 1, load_model(spec), None
            shares = [weight_bytes(model)]
            stages, tp = 1, 1
        else:
            p = dataclasses.replace(spec, partition=PartitionSpec(devices=name))
            layout = resolve_layout(p.partition, p)  # type: ignore[arg-type]
            world, stages, tp = layout.world_size, layout.stages, layout.tensor_parallel
            model = launch(p, layout)
            shares, close = model.rank_bytes, model.close
        try:
            tok_s, step_s, pass_s = run(model, prompts, args.output_len)
        finally:
            if close is not None:
                close()
        threads = max(1, CORES // world)
        if threads not in rates:
            rates[threads] = compute_rates(threads, args.hidden)
        flops, bw = rates[threads]
        share = min(1.0, CORES / world)  # ranks beyond the core count time-share the cores
        hw = Hardware(64 << 30, bw * share, link, latency, flops * share)
        est = estimate(spec, stages, tp, hw, args.requests, context, 32, act_bytes=4)
        rows.append([name, world, tok_s, step_s, pass_s, est.decode_s, shares])

    # a second prediction with the device rates fitted to the first layout's measured pass
    # (what microbenchmarks miss: per-op overhead of small eager matmuls)
    fit = rows[0][5] / rows[0][4]
    print(f"{'layout':<18}{'ranks':>6}{'tok/s':>8}{'ms/step':>9}{'ms/pass':>9}"
          f"{'plan ms':>9}{'err':>7}{'fitted':>8}{'err':>7}  weights MiB per rank")  # fmt: skip
    for name, world, tok_s, step_s, pass_s, plan_s, shares in rows:
        fitted = plan_s / fit
        mib = " ".join(f"{b / 2**20:.1f}" for b in shares)
        print(f"{name:<18}{world:>6}{tok_s:>8.1f}{step_s * 1e3:>9.1f}{pass_s * 1e3:>9.1f}"
              f"{plan_s * 1e3:>9.1f}{(plan_s - pass_s) / pass_s:>+7.0%}{fitted * 1e3:>8.1f}"
              f"{(fitted - pass_s) / pass_s:>+7.0%}  {mib}")  # fmt: skip
    print("ms/step: a decode step of every sequence (sampling included); ms/pass: its forward "
          "pass; plan: inferflow plan's decode step from the calibrated rates; fitted: the same "
          "with rates scaled so the first layout's prediction equals its measurement")  # fmt: skip


if __name__ == "__main__":
    main()
