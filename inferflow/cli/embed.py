"""``inferflow embed SPEC --text TEXT [--text ...] [--input FILE] [--ids]``: print embeddings.

One JSON array a line, in input order (the --text values first, then the file's lines): the
pooled vector, or under ``--pooling none`` an array of per-token vectors. Pooling and L2
normalisation default to the spec's ``embeddings:`` (an encoder-only network without one: mean,
normalised). Inputs longer than the model's maximum length are an error, never truncated.
With ``--ids`` each input is space-separated token ids.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from inferflow.cli.common import add_dtype, add_ids, read_lines, text_or_ids
from inferflow.engine.embed import resolve_pooling
from inferflow.errors import RequestError
from inferflow.runtime import ids_from_text, load
from inferflow.spec import load_spec
from inferflow.spec.types import POOLINGS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embed texts (one JSON array a line)", description=__doc__)
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument("--text", action="append", default=[], help="a text to embed (repeat for more)")
    p.add_argument(
        "--input",
        default=None,
        help="a file with one text a line (- for stdin); blank lines skipped",
    )
    # no argparse choices: an unknown pooling gets the library's error (names the allowed ones)
    p.add_argument("--pooling", default=None, help=f"one of {', '.join(POOLINGS)} (spec default)")
    p.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        default=None,
        help="skip the L2 normalisation the spec declares",
    )
    add_ids(p, "each --text and --input line is")
    add_dtype(p)
    p.set_defaults(run=run)


def _short(v: list[Any]) -> list[Any]:
    # 9 significant digits read back as the same float32: exact, without float64's 17
    return [_short(x) if isinstance(x, list) else float(f"{x:.9g}") for x in v]


def run(args: argparse.Namespace) -> int:
    texts = list(args.text)
    if args.input:
        texts += [line for line in read_lines(args.input) if line.strip()]  # blank: skipped
    if not texts:
        raise RequestError("nothing to embed: give --text or --input")
    spec = load_spec(args.spec)
    pooling, normalize = resolve_pooling(spec, args.pooling, args.normalize)
    # after the cheap checks: bad input fails before weights load
    tok = text_or_ids(spec, args.ids)
    inputs: list[str | list[int]] = list(texts)
    if args.ids:
        inputs = [ids_from_text(t, f"input {n}") for n, t in enumerate(texts, 1)]
    lm = load(spec, args.dtype, tokenizer=tok)
    for v in lm.embed(inputs, pooling, normalize):
        print(json.dumps(_short(v.tolist())))
    return 0
