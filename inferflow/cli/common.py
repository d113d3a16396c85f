"""Flags and input reading that several subcommands share."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from inferflow.errors import RequestError

if TYPE_CHECKING:
    from inferflow.engine.speculative import SpecConfig
    from inferflow.spec import Spec
    from inferflow.tokenizer import Tokenizer

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "act8")


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="activation and weight dtype; act8: float32, with the inputs of quantized products "
        "rounded to 8 bits per 32 values for integer dot products where the build has them "
        "(faster; not exact, as llama.cpp's CPU kernels); float32: the exact mode; auto "
        "(default): act8 where some quantized layer has an integer path, else float32",
    )


def add_quant(p: argparse.ArgumentParser) -> None:
    from inferflow.quant import METHODS

    p.add_argument(
        "--quant",
        default=None,
        help="quantize weights at load time: a format name (the tensors, mix and codes "
        "`inferflow quantize` writes for it), or none (float, the checkpoint's own blocks too)",
    )
    p.add_argument(
        "--quant-method",
        default=None,
        choices=METHODS,
        help="how --quant chooses codes: search (default: each block's grid for the least "
        "squared error) or minmax (the format's own rule)",
    )
    p.add_argument(
        "--imatrix",
        default=None,
        metavar="FILE",
        help="importance matrix of this checkpoint (`inferflow imatrix`, llama-imatrix) "
        "weighting --quant's search; or builtin: computed once from Hamlet (make models "
        "fetches it), or generated: from the model's own samples (no text), each cached in "
        "~/.cache/inferflow/imatrix",
    )


def with_quant(spec: Spec, args: argparse.Namespace) -> Spec:
    """``spec`` with --quant-method / --imatrix in its quant section (load passes --quant);
    a bad --quant, or those flags without a format to quantize to, fail here."""
    from dataclasses import replace
    from pathlib import Path

    from inferflow.errors import InferflowError
    from inferflow.imatrix import NAMED, named_imatrix
    from inferflow.runtime import quant_for

    named = args.imatrix in NAMED
    if args.imatrix and not named and not Path(args.imatrix).is_file():
        raise InferflowError(
            f"--imatrix {args.imatrix}: no such file, nor one of {', '.join(NAMED)}"
        )
    imatrix = Path(args.imatrix) if args.imatrix and not named else spec.quant.imatrix
    quant = replace(spec.quant, method=args.quant_method or spec.quant.method, imatrix=imatrix)
    spec = replace(spec, quant=quant)
    runs = quant_for(spec, args.quant) or spec.quant
    if (args.quant_method or args.imatrix) and not (runs.weights or runs.overrides):
        flags = " / ".join(
            f for f, v in (("--quant-method", args.quant_method), ("--imatrix", args.imatrix)) if v
        )
        raise InferflowError(
            f"{flags}: choose how weights are quantized at load time; give --quant FORMAT "
            "too (or a spec with quant.weights)"
        )
    if named:  # (computed once, before the weights load)
        matrix = named_imatrix(args.imatrix, spec)
        spec = replace(spec, quant=replace(spec.quant, imatrix=matrix))
    return spec


def draft_spec(args: argparse.Namespace, spec: Spec) -> Spec | None:
    """The --draft model's spec, quantized (--quant) with the main model's method; not with
    its importance matrix, which is the main checkpoint's."""
    if not args.draft:
        return None
    from dataclasses import replace

    from inferflow.spec import load_spec

    draft = load_spec(args.draft)
    return replace(draft, quant=replace(draft.quant, method=spec.quant.method))


def add_ids(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--ids",
        action="store_true",
        help=f"{what} space-separated token ids, not text (a model without a tokenizer takes "
        "only these)",
    )


def text_or_ids(spec: Spec, ids: bool) -> Tokenizer | None:
    """The tokenizer a command needs, made before any weight loads: text input needs one (a
    spec without one fails here, pointing at --ids); ids need none."""
    from inferflow.runtime import require_tokenizer, tokenizer_for

    tok = tokenizer_for(spec)
    return tok if ids else require_tokenizer(spec, tok)


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 file, or of stdin for ``-``, without their line ends ("\n" or
    "\r\n"). Only those end a line: not str.splitlines' others (form feed, U+2028, ...), which
    may sit inside a source text and would give more outputs than input lines."""
    if path == "-":
        return [line.rstrip("\r\n") for line in sys.stdin]
    try:
        with open(path, encoding="utf-8", newline="\n") as f:  # (a lone "\r" ends no line)
            return [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"--input: cannot read {path}: {e}") from None


def add_speculation(p: argparse.ArgumentParser) -> None:
    from inferflow.engine.speculative import RULES

    g = p.add_argument_group("speculative decoding (inferflow.engine.speculative)")
    g.add_argument(
        "--draft",
        default=None,
        metavar="SPEC",
        help="draft model (a decoder_only spec with the model's vocabulary)",
    )
    g.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft by n-gram prompt lookup: no draft model; helps where the output repeats "
        "the prompt",
    )
    g.add_argument("--lookahead", type=int, default=3, help="drafted tokens per step at most (3)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram looked up (4)")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram looked up (2)")
    g.add_argument(
        "--spec-max-rows",
        type=int,
        default=4,
        help="draft only while a step's decode rows, drafts included, are at most this many "
        "(4: one request drafts 3, two 1 each, four or more none; 0: no bound)",
    )
    g.add_argument(
        "--spec-min-acceptance",
        type=float,
        default=0.2,
        help="a request whose drafts are accepted less often than this (over its last 16) "
        "drafts nothing for 16 tokens, then 32, ... up to 512 (0.2; 0: never pause)",
    )
    g.add_argument(
        "--spec-rule",
        default="exact",
        choices=RULES,
        help="exact: the model's own distribution; relaxed: accept drafts in its kept set",
    )


def speculation(args: argparse.Namespace) -> SpecConfig | None:
    """The speculative decoding the flags of ``add_speculation`` ask for; None: off."""
    from inferflow.engine.speculative import SpecConfig

    if args.draft and args.prompt_lookup:
        raise RequestError("--draft and --prompt-lookup: choose one way to draft tokens")
    if not (args.draft or args.prompt_lookup):
        return None
    return SpecConfig(
        "draft" if args.draft else "ngram",
        args.lookahead,
        ngram_max=args.prompt_lookup_max,
        ngram_min=args.prompt_lookup_min,
        rule=args.spec_rule,
        max_rows=args.spec_max_rows or None,
        min_acceptance=args.spec_min_acceptance,
    )
