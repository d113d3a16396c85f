"""How close a decode step's products come to the machine's read rate: every quantized product of
a model (``--spec``; the layers' fused planes and the head, in the order a step runs them) on
``--rows`` rows of x, timed in passes that alternate with a plain read of as many bytes (torch's
sum over a float32 buffer of that size, the serving benchmark's bandwidth measure), so both meet
the same spell of a machine whose read rate drifts from minute to minute.

    python benchmarks/read_floor.py [--spec NAME] [--rows 1] [--rounds 25] [--threads 2]
                                    [--dtype auto|float32|act8]

At one row a step's products read every weight once and do little else: their time against the
read's is how far the kernels stand from the bandwidth floor (the rest of a step, norms,
attention and Python, is benchmarks/step_profile.py's). Each product here is a call of its own
(an OpenMP region each, a few microseconds), where the one-call decode runs a step's products in
one region: a small model's many small products pay that here. Prints the median pass of each,
its rate and their ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.kernels.quant_decode import library  # noqa: E402
from inferflow.quant.linear import QuantLinear  # noqa: E402
from inferflow.runtime import load  # noqa: E402


def products(model: torch.nn.Module, rows: int, threads: int) -> tuple[Callable[[], None], int]:
    """One pass of every planed QuantLinear's product on ``rows`` random rows (the buffers made
    once: a pass is the C calls alone) and the bytes of weights it reads."""
    lib = library()
    if lib is None:
        raise SystemExit("the quant_decode kernel is not available (INFERFLOW_KERNELS=0?)")
    calls, nbytes = [], 0
    for m in model.modules():
        if not isinstance(m, QuantLinear) or m.plane is None:
            continue
        p = m.plane
        x, y = torch.randn(rows, p.k), torch.empty(rows, p.n)
        xs = torch.empty(rows * p.k // 16)  # (group sums: the smallest group is 16)
        xq = torch.empty(rows * p.k, dtype=torch.int8) if m.act8 else None
        dx = torch.empty(rows * p.k // 32) if m.act8 else None
        calls.append((ctypes.byref(p.struct), x, xs, y, xq, dx))
        nbytes += p.nbytes
    if not calls:
        raise SystemExit("the model has no quantized products on a plane (a float checkpoint?)")

    def run() -> None:
        for s, x, xs, y, xq, dx in calls:
            lib.qmat_gemm_f32(s, x.data_ptr(), rows, xs.data_ptr(), y.data_ptr(), threads,
                              None if xq is None else xq.data_ptr(),
                              None if dx is None else dx.data_ptr())  # fmt: skip

    return run, nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="auto (serve's default), float32 or act8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("command: python benchmarks/read_floor.py " + shlex.join(sys.argv[1:]))
    lm = load(args.spec, args.dtype)
    if not isinstance(lm.model, torch.nn.Module):
        raise SystemExit(f"{args.spec}: the network is not one module (a partitioned model?)")
    run, nbytes = products(lm.model, args.rows, args.threads)
    buf = torch.ones(nbytes // 4)

    def read() -> None:
        buf.sum()

    passes: dict[str, list[float]] = {"products": [], "plain read": []}
    for fn in (run, read):  # warm-up: kernels built, pages touched
        fn()
    for _ in range(args.rounds):
        for name, fn in (("products", run), ("plain read", read)):
            t = time.perf_counter()
            fn()
            passes[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in passes.items()}
    print(
        f"{args.spec}, {args.rows} row(s) of x, dtype {args.dtype}, threads={args.threads}: "
        f"{nbytes / 1e6:.0f} MB of weights a pass, {args.rounds} alternating passes (medians)"
    )
    print("| pass | ms | GB/s | vs plain read |")
    print("|---|---:|---:|---:|")
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | {med['plain read'] / t:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
