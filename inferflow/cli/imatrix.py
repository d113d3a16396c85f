"""``inferflow imatrix SPEC --text FILE -o imatrix.gguf``: an importance matrix for quantize.

Runs the model in float32 over windows of --ctx tokens of the text (llama-perplexity's windows,
BOS first where the model adds one) and records, for every weight matrix, the sum of each input
column's squared activation and the token count, in llama.cpp's imatrix GGUF format. Then:

    inferflow quantize SPEC -o out.gguf --format Q3H --imatrix imatrix.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inferflow.cli.ppl import read_text
from inferflow.errors import CheckpointError
from inferflow.evaluate import text_ids, windows
from inferflow.runtime import load, require_tokenizer, tokenizer_for
from inferflow.spec import load_spec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "imatrix",
        help="importance matrix of a model over a calibration text (for quantize --imatrix)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", help="spec name or file, or a GGUF file")
    p.add_argument("--text", type=Path, required=True, help="UTF-8 calibration text")
    p.add_argument("-o", "--output", type=Path, required=True, help="output .gguf file")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="use at most this many windows")
    p.add_argument(
        "--chunk", type=int, default=0, help="start from this window (llama-imatrix's --chunk)"
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from inferflow.imatrix import collect

    if args.output.exists() and not args.force:
        raise CheckpointError(f"output {args.output} already exists; pass --force to overwrite it")
    text = read_text(args.text)
    spec = load_spec(args.spec)
    tok = require_tokenizer(spec, tokenizer_for(spec))
    ids, bos = text_ids(tok, text)
    last = None if args.chunks is None else args.chunk + args.chunks
    if len(windows(ids, args.ctx, last)) <= args.chunk:  # before the weights load
        raise CheckpointError(f"--chunk {args.chunk}: the text has no window {args.chunk}")
    lm = load(spec, "float32", "none", tok)
    progress = sys.stderr.isatty()
    m = collect(lm, ids, args.ctx, args.chunks, bos, args.text.name, progress, args.chunk)
    m.write(args.output, args.force)
    print(f"wrote {args.output}: {len(m.sums)} tensors, {m.chunks} windows of {args.ctx} tokens")
    return 0
