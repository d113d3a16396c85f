"""``inferflow classify SPEC --text TEXT [--text ...] [--query Q --doc D ...] [--input FILE]``:
print label probabilities of a model with a classification head (``network.head``).

One JSON object a line, in input order: ``{"label": best, "probs": {label: p, ...}}``. With
``--query``, each ``--doc`` (and each line of ``--input``) is scored as the pair (query, doc)
by a cross-encoder: ``{"score": p}`` (a one-label head's sigmoid). A head of several label
groups adds ``"labels"``, one per group. With ``--ids`` each input is space-separated token ids.
Inputs longer than the model's maximum length are an error, never truncated.
"""

from __future__ import annotations

import argparse
import json

from inferflow.cli.common import add_dtype, add_ids, read_lines, text_or_ids
from inferflow.engine.classify import best_labels, classify_head
from inferflow.errors import RequestError
from inferflow.runtime import ids_from_text, load
from inferflow.spec import load_spec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "classify", help="classify texts or score (query, doc) pairs", description=__doc__
    )
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument("--text", action="append", default=[], help="a text to classify (repeat)")
    p.add_argument("--query", default=None, help="score each --doc against this query")
    p.add_argument("--doc", action="append", default=[], help="a document for --query (repeat)")
    p.add_argument(
        "--input", default=None, help="a file with one text (or doc) a line; - for stdin"
    )
    add_ids(p, "each --text and --input line is")
    add_dtype(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    lines = [line for line in read_lines(args.input) if line.strip()] if args.input else []
    if args.query is None and args.doc:
        raise RequestError("--doc needs --query (the text each document is scored against)")
    if args.query is not None and args.text:
        raise RequestError("--text and --query do not mix: classify texts or score pairs")
    inputs: list[str | tuple[str, str] | list[int]]
    if args.ids and args.query is not None:
        raise RequestError("--ids and --query do not mix: a pair needs the tokenizer's template")
    if args.query is not None:
        inputs = [(args.query, d) for d in [*args.doc, *lines]]
    else:
        inputs = [*args.text, *lines]
    if not inputs:
        raise RequestError("nothing to classify: give --text, --query with --doc, or --input")
    spec = load_spec(args.spec)
    if spec.network.head is None:  # before the weights load
        raise RequestError(
            f"spec {spec.name!r} declares no classification head (network.head: {{type: classify}})"
        )
    tok = text_or_ids(spec, args.ids)
    if args.ids:
        inputs = [ids_from_text(str(t), f"input {n}") for n, t in enumerate(inputs, 1)]
    lm = load(spec, args.dtype, tokenizer=tok)
    labels, head = lm.spec.hparams.labels, classify_head(lm.model)
    spans = head.spans()
    if head.per_token:  # a label (per group) for every token
        if args.query is not None:
            raise RequestError("--query: this model labels tokens, not (query, doc) pairs")
        for x in lm.token_classify([x for x in inputs if not isinstance(x, tuple)]):
            tags = [best_labels(t, labels, spans) for t in x.tolist()]
            print(json.dumps({"labels": [t[0] if len(t) == 1 else t for t in tags]}))
        return 0
    for p in lm.classify(inputs).tolist():
        if args.query is not None and len(p) == 1:
            print(json.dumps({"score": float(f"{p[0]:.9g}")}))
        else:
            best = best_labels(p, labels, spans)
            probs = {label: float(f"{x:.9g}") for label, x in zip(labels, p, strict=True)}
            # one label per group (a head of several independent choices: "labels" too)
            line = {"label": best[0], **({"labels": best} if len(best) > 1 else {})}
            print(json.dumps({**line, "probs": probs}))
    return 0
