"""``inferflow translate SPEC``: one output line per input line (stdin or ``--input FILE``).

Lines are searched in batches (``--batch-size``) with beam search (greedy at ``--beam 1``);
each source is encoded once. An empty input line gives an empty output line. With ``--ids``
input and output lines are space-separated token ids (models without a tokenizer). A line
longer than the model's maximum is an error naming the line, before anything runs.

Variable width: ``--prune-delta D`` drops candidates more than D (log-probability) below the
line's best candidate of each step, ``--max-per-parent M`` keeps at most M live children per
beam. ``--refill EPS`` streams (VAR-STREAM): waiting lines join until --batch-size x --beam
beams are live whenever the live beams drop to EPS x that, each step expanding every beam of the
shortest length and only those; outputs are those of the same search without --refill, printed
at the end.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterable

from inferflow.cli.common import add_dtype, read_lines
from inferflow.engine.search import SearchParams
from inferflow.engine.var_stream import check_stream_args
from inferflow.errors import RequestError
from inferflow.runtime import load
from inferflow.spec import load_spec

# the search's parameter names -> the flags that set them (its errors are shown naming the flags)
FLAGS = {
    "beam_width": "--beam",
    "length_penalty": "--length-penalty",
    "num_return": "--n-best",
    "max_new_tokens": "--max-tokens",
    "min_new_tokens": "--min-tokens",
    "no_repeat_ngram": "--no-repeat-ngram",
    "prune_delta": "--prune-delta",
    "max_per_parent": "--max-per-parent",
    "refill": "--refill",
    "batch_size": "--batch-size",
}


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
    p.add_argument(
        "--prune-delta",
        type=float,
        default=None,
        metavar="D",
        help="variable width: drop candidates more than D below the line's best (>= 0; off)",
    )
    p.add_argument(
        "--max-per-parent",
        type=int,
        default=None,
        metavar="M",
        help="variable width: live children of one beam at most (1 .. --beam; default --beam)",
    )
    p.add_argument(
        "--refill",
        type=float,
        default=None,
        metavar="EPS",
        help="stream: refill with waiting lines up to --batch-size x --beam live beams when the "
        "live beams drop to EPS x that (0 .. 1); same outputs, off by default",
    )
    p.add_argument("--ids", action="store_true", help="lines are space-separated token ids")
    add_dtype(p)
    p.set_defaults(run=run)


def search_params(args: argparse.Namespace, default_max_tokens: int) -> SearchParams:
    """The search the flags ask for, checked by the library (refill and batch size too); an
    error names the flags."""
    try:
        check_stream_args(args.refill, args.batch_size)
        return SearchParams(
            beam_width=args.beam,
            length_penalty=args.length_penalty,
            early_stopping=not args.no_early_stopping,
            num_return=args.n_best,
            max_new_tokens=default_max_tokens if args.max_tokens is None else args.max_tokens,
            min_new_tokens=args.min_tokens,
            no_repeat_ngram=args.no_repeat_ngram,
            prune_delta=math.inf if args.prune_delta is None else args.prune_delta,
            max_per_parent=args.max_per_parent,
        )
    except RequestError as e:
        names = re.compile(r"\b(" + "|".join(FLAGS) + r")\b")
        raise RequestError(names.sub(lambda m: FLAGS[m[1]], str(e))) from None


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    params = search_params(args, spec.generation.max_new_tokens)  # before the weights load
    lm = load(spec, dtype=args.dtype)
    lines = read_lines(args.input)
    sources = [
        lm.encode_source(line, ids=args.ids, where=f"line {n}") for n, line in enumerate(lines, 1)
    ]
    chunks: Iterable[list[list[list[int]]]]
    if args.refill is not None:  # one stream over all lines
        chunks = [lm.translate_ids(sources, params, args.refill, args.batch_size)]
    else:  # batch by batch, each printed when done
        chunks = (
            lm.translate_ids(sources[at : at + args.batch_size], params)
            for at in range(0, len(sources), args.batch_size)
        )
    for chunk in chunks:
        for outs in chunk:
            print("\t".join(lm.decode_target(o, ids_only=args.ids) for o in outs), flush=True)
    return 0
