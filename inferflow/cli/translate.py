"""``inferflow translate SPEC``: one output line per input line (stdin or ``--input FILE``).

Lines are searched in batches (``--batch-size``) with beam search (greedy at ``--beam 1``);
each source is encoded once. An empty input line gives an empty output line. With ``--ids``
input and output lines are space-separated token ids (models without a tokenizer). A line
longer than the model's maximum is an error naming the line, before anything runs.
"""

from __future__ import annotations

import argparse

from inferflow.cli.common import add_dtype, read_lines
from inferflow.engine.search import SearchParams
from inferflow.errors import RequestError
from inferflow.runtime import load


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "translate", help="translate / transduce lines with a sequence model", description=__doc__
    )
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument("--input", default="-", help="source lines: a file, or - for stdin (default)")
    p.add_argument("--beam", type=int, default=4, help="beam width (1 = greedy; default 4)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="score / len ** this (1.0)")
    p.add_argument(
        "--no-early-stopping",
        action="store_true",
        help="go on after W finished while a live beam may still win",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (spec default)")
    p.add_argument("--min-tokens", type=int, default=0, help="new tokens at least (0)")
    p.add_argument("--no-repeat-ngram", type=int, default=0, help="ban repeated n-grams (0 = off)")
    p.add_argument("--n-best", type=int, default=1, help="hypotheses per line, tab-separated (1)")
    p.add_argument("--batch-size", type=int, default=32, help="lines searched together (32)")
    p.add_argument("--ids", action="store_true", help="lines are space-separated token ids")
    add_dtype(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise RequestError(f"--batch-size: must be at least 1, got {args.batch_size}")
    lm = load(args.spec, dtype=args.dtype)
    params = SearchParams(
        beam_width=args.beam,
        length_penalty=args.length_penalty,
        early_stopping=not args.no_early_stopping,
        num_return=args.n_best,
        max_new_tokens=args.max_tokens or lm.spec.generation.max_new_tokens,
        min_new_tokens=args.min_tokens,
        no_repeat_ngram=args.no_repeat_ngram,
    )
    lines = read_lines(args.input)
    sources = [
        lm.encode_source(line, ids=args.ids, where=f"line {n}") for n, line in enumerate(lines, 1)
    ]
    for start in range(0, len(sources), args.batch_size):
        for outs in lm.translate_ids(sources[start : start + args.batch_size], params):
            texts = [lm.decode_target(o, ids_only=args.ids) for o in outs]
            print("\t".join(texts), flush=True)
    return 0
