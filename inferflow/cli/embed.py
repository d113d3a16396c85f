"""``inferflow embed SPEC --text TEXT [--text ...] [--input FILE]``: print embeddings.

One JSON array a line, in input order (the --text values first, then the file's lines): the
pooled vector, or under ``--pooling none`` an array of per-token vectors. Pooling and L2
normalisation default to the spec's ``embeddings:`` (an encoder-only network without one: mean,
normalised). Inputs longer than the model's maximum length are an error, never truncated.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inferflow.engine.embed import check_pooling, spec_pooling
from inferflow.errors import RequestError
from inferflow.runtime import load
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
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="activation and weight dtype",
    )
    p.set_defaults(run=run)


def _read_lines(path: str) -> list[str]:
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise RequestError(f"--input: cannot read {path}: {e.strerror}") from None
    return [line for line in lines if line.strip()]


def _short(v: list[Any]) -> list[Any]:
    # 9 significant digits read back as the same float32: exact, without float64's 17
    return [_short(x) if isinstance(x, list) else float(f"{x:.9g}") for x in v]


def run(args: argparse.Namespace) -> int:
    texts = list(args.text) + (_read_lines(args.input) if args.input else [])
    if not texts:
        raise RequestError("nothing to embed: give --text or --input")
    spec = load_spec(args.spec)
    if args.pooling is None:
        pooling, normalize = spec_pooling(spec)
    else:
        check_pooling(args.pooling)
        pooling, normalize = args.pooling, spec.embedding_normalize
    if args.normalize is not None:
        normalize = args.normalize
    # after the cheap checks: bad input fails before weights load
    lm = load(spec, args.dtype)
    for v in lm.embed(texts, pooling, normalize):
        print(json.dumps(_short(v.tolist())))
    return 0
