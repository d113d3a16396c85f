"""Micro-benchmark of QuantLinear's candidate CPU paths on SmolLM2-135M's layer shapes.

    python benchmarks/quant_kernels.py [--formats Q4_1,Q8_0] [--batch 1,16] [--budget 0.2]

Per format, (in -> out) shape and batch N, the median time of one call of each path, in us:

    fp32       F.linear on a float32 copy of the dequantized weight (the unquantized baseline)
    bf16       F.linear on a kept bf16 copy, bf16 activations (the "cache a dense copy" option)
    plane      QuantLinear's C planes (its path for every call), float32 in and out, the same
               operations per row whatever the batch
    plane/act8 the same under ``--dtype act8``: x rounded to 8 bits per 32 values, integer
               dot products where the plane has them (QPlane.has_q8)
    act8/vnni  plane/act8 with the AMX products off (their VNNI path: the same bits), where the
               build has AMX and Linux grants it; plane/act8 then takes AMX tiles from 16 rows
    int4pack   QuantLinear's int4pack kernel, bf16 activations (the chosen path for other affine
               formats)
    int4p/f32  the same with float32 activations: includes the casts in and out
    tiled      QuantLinear's dequant kernel: 4 MiB row tiles dequantized per call, fp32 GEMM
    full       dequantize the whole matrix per call, then F.linear
    int8pack   torch's _weight_int8pack_mm with per-channel scales (8-bit formats only; NOT the
               format's per-block numerics, shown as the speed a per-channel int8 kernel would give)

Each path rotates over enough independent copies of its weight to fill ``--working-set`` MB
(default 600, beyond this machine's 260 MB L3), so weights stream from DRAM as in a real decode
step; ``--working-set 0`` reuses one copy (cache-hot, flatters the large dense formats).
Timings use torch.set_num_threads(2) (this project's machine has 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from inferflow.kernels import quant_decode
from inferflow.quant import quantize
from inferflow.quant.linear import (
    Int4Pack,
    QuantLinear,
    int4pack_kernel,
    int4pack_takes,
    pack_int4,
    plane_kernel,
)
from inferflow.quant.tensor import QuantTensor

# SmolLM2-135M (in, out): wo/wq, wk and wv, ffn up/gate, ffn down, output head
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
DEFAULT_FORMATS = "Q4_0,Q4_1,Q8_0,Q4_B32,Q4_B64,Q8,Q6,Q5,Q3_B32,Q3H,Q2"
PATHS = [
    "fp32",
    "bf16",
    "plane",
    "plane/act8",
    "act8/vnni",
    "int4pack",
    "int4p/f32",
    "tiled",
    "full",
    "int8pack",
]
MAX_COPIES = 4096

Call = Callable[[], object]


def bench(make: Callable[[], Call], nbytes: int, working_set: float, budget: float) -> float:
    """Median seconds of one call, rotating over copies from ``make`` that fill the working set
    (each call touches another copy's weight), over as many calls as fit in ``budget``."""
    n = max(1, min(MAX_COPIES, int(working_set // max(nbytes, 1))))
    calls = [make() for _ in range(n)]
    it = itertools.cycle(calls)
    for _ in range(min(n, 64) + 2):
        next(it)()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < budget:
        fn = next(it)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _int8pack(w: torch.Tensor, x: torch.Tensor) -> Callable[[], Call]:
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # per output channel
    q = torch.round(w / scale[:, None]).to(torch.int8)
    s = scale.to(torch.bfloat16)
    op = torch.ops.aten._weight_int8pack_mm

    def make() -> Call:
        qc = q.clone()
        return lambda: op(x, qc, s)

    return make


def _int4(ql: QuantLinear, p: Int4Pack, x: torch.Tensor) -> Callable[[], Call]:
    def make() -> Call:
        c = copy.copy(ql)  # the real forward, over its own copy of the packed weight
        c.kernel = int4pack_kernel(
            Int4Pack(p.packed.clone(), p.scales_zeros.clone(), p.group, p.planes, p.out_features)
        )
        return lambda: c(x)

    return make


def _plane(qt: QuantTensor, x: torch.Tensor, act8: bool = False) -> Callable[[], Call]:
    def make() -> Call:
        c = QuantLinear(QuantTensor(qt.data.clone(), qt.format, qt.shape))  # its own planes
        if act8:
            c.kernel = plane_kernel(c.plane, True)  # type: ignore[arg-type]
        return lambda: c(x)

    return make


def _dense(w: torch.Tensor, x: torch.Tensor) -> Callable[[], Call]:
    def make() -> Call:
        wc = w.clone()
        return lambda: F.linear(x, wc)

    return make


def _raw(qt: QuantTensor, x: torch.Tensor, full: bool) -> Callable[[], Call]:
    def make() -> Call:
        qc = QuantTensor(qt.data.clone(), qt.format, qt.shape)
        if full:
            return lambda: F.linear(x, qc.dequantize())
        tiled = QuantLinear(qc, kernel="dequant")
        return lambda: tiled(x)

    return make


_DENSE_CACHE: dict[tuple[int, int, int], tuple[float, float]] = {}


def run_shape(fmt: str, inp: int, out: int, batches: list[int], ws: float, budget: float) -> None:
    g = torch.Generator().manual_seed(0)
    qt = quantize(torch.randn(out, inp, generator=g) * 0.05, fmt)
    w32 = qt.dequantize()
    fast = QuantLinear(qt)
    takes = int4pack_takes(qt.qformat)  # (Q6_K's groups of 16: no)
    pack = pack_int4(qt) if takes and fast.kernel_name in ("int4pack", "plane") else None
    for n in batches:
        x = torch.randn(n, inp, generator=g)
        xb = x.to(torch.bfloat16)
        us: dict[str, float] = {}
        if (inp, out, n) not in _DENSE_CACHE:  # dense paths do not depend on the format
            _DENSE_CACHE[inp, out, n] = (
                bench(_dense(w32, x), w32.nbytes, ws, budget),
                bench(_dense(w32.to(torch.bfloat16), xb), w32.nbytes // 2, ws, budget),
            )
        us["fp32"], us["bf16"] = _DENSE_CACHE[inp, out, n]
        if fast.kernel_name == "plane":
            us["plane"] = bench(_plane(qt, x), fast.nbytes, ws, budget)
            us["plane/act8"] = bench(_plane(qt, x, act8=True), fast.nbytes, ws, budget)
            lib = quant_decode.library()
            if lib is not None and quant_decode.set_amx(lib, True):  # (where AMX runs at all)
                quant_decode.set_amx(lib, False)
                us["act8/vnni"] = bench(_plane(qt, x, act8=True), fast.nbytes, ws, budget)
                quant_decode.set_amx(lib, os.environ.get("INFERFLOW_AMX", "1") != "0")
        if pack is not None:
            us["int4pack"] = bench(_int4(fast, pack, xb), pack.nbytes, ws, budget)
            us["int4p/f32"] = bench(_int4(fast, pack, x), pack.nbytes, ws, budget)
        us["tiled"] = bench(_raw(qt, x, full=False), qt.data.nbytes, ws, budget)
        us["full"] = bench(_raw(qt, x, full=True), qt.data.nbytes, ws, budget)
        if fmt in ("Q8_0", "Q8"):
            us["int8pack"] = bench(_int8pack(w32, xb), w32.numel(), ws, budget)
        cells = [f"{us[p] * 1e6:.0f}" if p in us else "-" for p in PATHS]
        print(f"| {fmt} | {inp}->{out} | {n} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--shapes", default=",".join(f"{i}x{o}" for i, o in SHAPES), help="in x out")
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per measurement")
    ap.add_argument("--working-set", type=float, default=600, help="MB of weight copies")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print("command: python " + " ".join(sys.argv))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, working set "
        f"{args.working_set:g} MB; median us per call\n"
    )
    print("| format | in->out | N | " + " | ".join(PATHS) + " |")
    print("|---" * (3 + len(PATHS)) + "|")
    for fmt in args.formats.split(","):
        for inp, out in shapes:
            run_shape(fmt, inp, out, batches, args.working_set * 1e6, args.budget)
    inp, out = shapes[0]
    print(f"\nresident bits per weight ({inp}x{out}): format's own blocks vs QuantLinear's kernel")
    for fmt in args.formats.split(","):
        qt = quantize(torch.zeros(out, inp), fmt)
        ql = QuantLinear(qt)
        bits = ql.nbytes * 8 / qt.numel()
        print(f"  {fmt:7} raw {qt.bits_per_weight:.2f}  {ql.kernel_name} {bits:.2f}")


if __name__ == "__main__":
    main()
