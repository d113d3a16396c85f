"""``inferflow convert SRC -o OUT``: convert a checkpoint between pickle, safetensors and GGUF.

The output format comes from ``--to`` or OUT's suffix (.gguf, .safetensors, .bin/.pt).
``--type`` re-encodes the tensors: F32, F16, BF16, Q8_0, Q4_0 or Q4_1 for GGUF (1-D tensors and
norms stay F32, as llama.cpp's converter keeps them), F32, F16 or BF16 for the others; without
it every tensor keeps its type. Safetensors and pickle cannot hold quantized data: writing a
quantized source to them needs --dequantize (float32, several times larger). A GGUF source
keeps all its metadata, so converting a llama.cpp model gives a llama.cpp model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inferflow.convert import OUTPUT_FORMATS, convert_checkpoint


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint between pickle, safetensors and GGUF",
        description=__doc__,
    )
    p.add_argument("src", type=Path, help="GGUF, safetensors, pickle file or HF model directory")
    p.add_argument("-o", "--output", type=Path, required=True, help="output file")
    p.add_argument("--to", choices=OUTPUT_FORMATS, default=None, help="output format")
    p.add_argument("--type", default=None, help="tensor type, e.g. F16 or Q8_0 (default: keep)")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="write quantized tensors as float to safetensors / pickle (refused without it)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = convert_checkpoint(
        args.src,
        args.output,
        to=args.to,
        type_name=args.type,
        force=args.force,
        progress=sys.stderr.isatty(),
        dequantize=args.dequantize,
    )
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0
