"""``inferflow quantize MODEL -o OUT.gguf --format FMT``: write MODEL with quantized weights.

MODEL is a built-in spec name, a spec file, or a checkpoint (GGUF, safetensors, pickle, HF
directory; package:// paths too). A .gguf output holds everything a GGUF source has (tokenizer,
chat template, hyperparameters) and runs directly: `inferflow generate OUT.gguf`. GGML formats
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) also run in llama.cpp; Inferflow's (Q8, Q6, Q5, Q4_B32, Q4_B64,
Q3_B32, Q3H, Q2) are stored as tensor types of their own that only Inferflow reads. Another
suffix writes Inferflow's safetensors container (tensors only).

1-D tensors (norms, biases) and integer tensors stay as they are; a tensor whose last dimension
is not a multiple of the format's block size stays float (with a warning). ``--per-tensor
PATTERN=FMT`` (fnmatch globs over the checkpoint's tensor names, first match wins) picks other
formats, ``none`` or ``float`` keeps a tensor unquantized.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from inferflow.quant.formats import METHODS
from inferflow.quantize import quantize_checkpoint


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="write a model with quantized weights (GGUF)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="spec name or file, or a GGUF/safetensors/pickle file, HF directory")
    p.add_argument("-o", "--output", type=Path, required=True, help="output .gguf file")
    p.add_argument("--format", required=True, help="quant format, e.g. Q8_0, Q4_0, Q4_B32")
    p.add_argument(
        "--per-tensor",
        action="append",
        default=[],
        metavar="PATTERN=FMT",
        help="format for tensors matching an fnmatch pattern (repeatable; none = keep float)",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default="search",
        help="Inferflow formats: search each block's grid for the least (weighted) squared "
        "error (default), or the paper's plain min-max; GGML formats always use the reference",
    )
    p.add_argument(
        "--imatrix",
        default=None,
        help="importance matrix of this model (inferflow imatrix, or llama-imatrix's GGUF), or "
        "builtin: computed once from Hamlet (make models fetches it), or generated: from the "
        "model's own samples (no text), each cached",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    result = quantize_checkpoint(
        args.src,
        args.output,
        args.format,
        per_tensor=args.per_tensor,
        force=args.force,
        progress=sys.stderr.isatty(),
        method=args.method,
        imatrix=args.imatrix,
    )
    counts = Counter(result.formats.values())
    summary = ", ".join(f"{n} {fmt}" for fmt, n in counts.most_common())
    print(f"wrote {result.out} ({result.nbytes / 2**20:.1f} MiB): {summary}")
    return 0
