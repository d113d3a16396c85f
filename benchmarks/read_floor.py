"""How close a step's products come to the machine's floors: every quantized product of a model
(``--spec``; the layers' fused planes and the head, in the order a step runs them) on ``--rows``
rows of x, timed in passes that alternate with a plain read of as many bytes (torch's sum over a
float32 buffer of that size, the serving benchmark's bandwidth measure) and with the machine's
8-bit multiply-add peak (``compute_peak.c``: independent chains of 512-bit ``vpdpbusd``, the
instruction the act8 products spend most of their time in; AVX-512 VNNI builds only), so all
three meet the same spell of a machine whose read rate drifts from minute to minute.

    python benchmarks/read_floor.py [--spec NAME] [--rows 1] [--rounds 25] [--threads 2]
                                    [--dtype auto|float32|act8]

At one row a step's products read every weight once and do little else: their time against the
read's is how far the kernels stand from the bandwidth floor. With many rows (a batch of decode
rows, a prompt's chunk) the same weights serve every row and the products are bound by their
arithmetic: their multiply-adds a second against the peak is how far they stand from the
compute floor (the rest of a step, norms, attention and Python, is benchmarks/step_profile.py's).
Each product here is a call of its own (an OpenMP region each, a few microseconds), where the
one-call decode runs a step's products in one region: a small model's many small products pay
that here. Prints the median pass of each, their rates and ratios, and the products per format.
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
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.kernel_build import FLAGS, compile_kernel  # noqa: E402
from inferflow.kernels.quant_decode import library  # noqa: E402
from inferflow.quant.linear import QuantLinear  # noqa: E402
from inferflow.runtime import load  # noqa: E402


class Product(NamedTuple):
    """One planed product of a pass: its C call, format, bytes and multiply-adds."""

    run: Callable[[], None]
    fmt: str
    nbytes: int
    macs: int


def products(model: torch.nn.Module, rows: int, threads: int) -> list[Product]:
    """Every planed QuantLinear's product on ``rows`` random rows (the buffers made once: a pass
    is the C calls alone); a layer in two planes is its plane's product under the layer's
    format (Q4_K+Q6_K) and its ``tail``'s, a layer of its own, under the tail's (Q6_K)."""
    out = []
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.plane is not None:
            out.append(_product(m, rows, threads))
    if not out:
        raise SystemExit("the model has no quantized products on a plane (a float checkpoint?)")
    return out


def _product(m: QuantLinear, rows: int, threads: int) -> Product:
    """The C call of ``m``'s plane on ``rows`` random rows (its buffers held by the call)."""
    lib, p = library(), m.plane
    assert lib is not None and p is not None
    x, y = torch.randn(rows, p.k), torch.empty(rows, p.n)
    xs = torch.empty(rows * p.k // 16)  # (group sums: the smallest group is 16)
    xq = torch.empty(rows * p.k, dtype=torch.int8) if m.act8 else None
    dx = torch.empty(rows * p.k // 32) if m.act8 else None

    def run() -> None:
        lib.qmat_gemm_f32(ctypes.byref(p.struct), x.data_ptr(), rows, xs.data_ptr(), y.data_ptr(),
                          threads, None if xq is None else xq.data_ptr(),
                          None if dx is None else dx.data_ptr())  # fmt: skip

    return Product(run, m.format, p.nbytes, p.n * p.k * rows)


def vnni_peak() -> Callable[[float], float] | None:
    """``peak(seconds)``: the machine's 8-bit multiply-adds a second over ``--threads`` threads,
    measured for about that long; None where the build has no AVX-512 VNNI."""
    lib = ctypes.CDLL(str(compile_kernel(Path(__file__).resolve().parent, "compute_peak", FLAGS)))
    lib.vnni_peak.restype = ctypes.c_double
    lib.vnni_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
    threads = torch.get_num_threads()
    probe = lib.vnni_peak(100_000, threads)
    if probe <= 0:
        return None

    def peak(seconds: float) -> float:
        reps = max(1000, int(seconds * probe / (12 * 64 * threads)))
        return float(lib.vnni_peak(reps, threads))

    return peak


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
    if library() is None:
        raise SystemExit("the quant_decode kernel is not available (INFERFLOW_KERNELS=0?)")
    lm = load(args.spec, args.dtype)
    if not isinstance(lm.model, torch.nn.Module):
        raise SystemExit(f"{args.spec}: the network is not one module (a partitioned model?)")
    calls = products(lm.model, args.rows, args.threads)
    nbytes, macs = sum(c.nbytes for c in calls), sum(c.macs for c in calls)
    buf = torch.ones(nbytes // 4)
    peak = vnni_peak()
    formats = sorted({c.fmt for c in calls})

    def run() -> dict[str, float]:
        """one pass; seconds per format"""
        spent = dict.fromkeys(formats, 0.0)
        for c in calls:
            t = time.perf_counter()
            c.run()
            spent[c.fmt] += time.perf_counter() - t
        return spent

    run(), buf.sum()  # warm-up: kernels built, pages touched
    passes: dict[str, list[float]] = {"products": [], "plain read": []}
    rates: list[float] = []
    by_format: dict[str, list[float]] = {f: [] for f in formats}
    for _ in range(args.rounds):
        spent = run()
        passes["products"].append(sum(spent.values()))
        for f, t in spent.items():
            by_format[f].append(t)
        t = time.perf_counter()
        buf.sum()
        passes["plain read"].append(time.perf_counter() - t)
        if peak is not None:
            rates.append(peak(passes["products"][-1]))
    med = {name: statistics.median(ts) for name, ts in passes.items()}
    top = statistics.median(rates) if rates else None
    print(
        f"{args.spec}, {args.rows} row(s) of x, dtype {args.dtype}, threads={args.threads}: "
        f"{nbytes / 1e6:.0f} MB of weights and {macs / 1e9:.2f} G multiply-adds a pass, "
        f"{args.rounds} alternating passes (medians)"
    )
    if top is None:
        print("8-bit multiply-add peak: not measured (the build has no AVX-512 VNNI)")
    else:
        print(
            f"8-bit multiply-add peak (vpdpbusd, {args.threads} threads): {top / 1e9:.0f} G/s; "
            f"the products' multiply-adds at that rate: {macs / top * 1e3:.2f} ms"
        )
    print("| pass | ms | GB/s | G multiply-adds/s | vs plain read | vs 8-bit peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in med.items():
        rate = f"{macs / t / 1e9:.0f}" if name == "products" else ""
        vs_peak = f"{macs / t / top:.2f}x" if name == "products" and top else ""
        print(
            f"| {name} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | {rate} | "
            f"{med['plain read'] / t:.2f}x | {vs_peak} |"
        )
    print("| format | products | MB | ms | share | GB/s | G multiply-adds/s | vs 8-bit peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for f in formats:
        mine = [c for c in calls if c.fmt == f]
        b, n = sum(c.nbytes for c in mine), sum(c.macs for c in mine)
        t = statistics.median(by_format[f])
        vs_peak = f"{n / t / top:.2f}x" if top else ""
        print(
            f"| {f} | {len(mine)} | {b / 1e6:.0f} | {t * 1e3:.2f} | {t / med['products']:.0%} | "
            f"{b / t / 1e9:.1f} | {n / t / 1e9:.0f} | {vs_peak} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
