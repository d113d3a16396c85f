"""Per-tensor quantization error: for each kind of matrix of a model (attn_q, ffn_down, ...: the
name after ``blk.N.``, summed over layers, and the token table), the type its checkpoint stores it
in and the relative squared error ``sum (w' - w)**2 / sum w**2`` of each format (searched codes,
no imatrix), quantized from the checkpoint's float values. A near-zero error marks a format that
reproduces the checkpoint's own grid (its source is a quantized file), not a better quantizer.

    python benchmarks/quant_tensors.py [--model gemma-3-270m] [--formats Q4_E32,Q5_0,...]
        [--dither H]

``--dither H``: uniform noise in [-H, H] * row RMS added first (as quant_quality.py's --dither).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quant_quality import dither_rows  # noqa: E402

from inferflow.loaders import open_files  # noqa: E402
from inferflow.quant import get_format, quantize  # noqa: E402
from inferflow.quant.tensor import QuantTensor  # noqa: E402
from inferflow.spec import load_spec  # noqa: E402

FORMATS = "Q4_B32,Q4_B64,Q4_E32,Q5_E32,Q4_0,Q5_0,Q4_K,Q6_K,Q8_0"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--dither", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    spec = load_spec(args.model)
    src = open_files(spec.source.format, spec.source.files)
    errs: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    norms: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    stored: dict[str, set[str]] = defaultdict(set)
    try:
        for name in src.names():
            shape = src.shape(name)
            if len(shape) < 2:
                continue
            kind = re.sub(r"^blk\.\d+\.", "", name)
            w = src.get(name)
            stored[kind].add(src.dtype_name(name))
            x = (w.dequantize() if isinstance(w, QuantTensor) else w).float()
            if args.dither:
                x = dither_rows(name, x, args.dither)
            norms[kind] += float(x.double().square().sum())
            count[kind] += x.numel()
            for fmt in formats:
                if shape[-1] % get_format(fmt).block_size:
                    errs[kind][fmt] = float("nan")
                    continue
                d = quantize(x, fmt, "search").dequantize()
                errs[kind][fmt] += float((d.double() - x.double()).square().sum())
    finally:
        src.close()
    total = sum(count.values())
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"\n{spec.name}: relative squared error per kind of matrix (x 1e-3; '-': rows no")
    print("multiple of the format's block)\n")
    print("| tensor | stored as | share of weights | " + " | ".join(formats) + " |")
    print("|---|---|---|" + "---|" * len(formats))
    for kind in sorted(errs, key=lambda k: -count[k]):
        cells = [
            "-" if errs[kind][f] != errs[kind][f] else f"{1e3 * errs[kind][f] / norms[kind]:.2f}"
            for f in formats
        ]
        share = f"{100 * count[kind] / total:.1f}%"
        print(
            f"| {kind} | {'/'.join(sorted(stored[kind]))} | {share} | " + " | ".join(cells) + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
