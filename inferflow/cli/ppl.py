"""``inferflow ppl SPEC --text FILE``: perplexity over a fixed text (llama.cpp's protocol: windows
of --ctx tokens, each starting with BOS where the model adds one, the second half of each
scored) and, with a saved reference, KL divergence.

    inferflow ppl smollm2-135m-instruct --text hamlet.txt --kl-divergence-base base.st   # reference
    inferflow ppl smollm2-135m-instruct --text hamlet.txt --quant Q4_B32 --kl-divergence-base base.st --kl-divergence
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inferflow.cli.common import add_dtype, add_quant, with_quant
from inferflow.errors import InferflowError
from inferflow.evaluate import perplexity, text_ids, windows
from inferflow.runtime import load, require_tokenizer, tokenizer_for
from inferflow.spec import load_spec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ppl",
        help="perplexity / KL divergence over a text file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument(
        "--text",
        type=Path,
        required=True,
        help="UTF-8 text file (make models puts hamlet in ~/.cache/inferflow/texts)",
    )
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many windows")
    add_quant(p)
    add_dtype(p)
    p.add_argument(
        "--kl-divergence-base",
        type=Path,
        default=None,
        help="reference log-probs file: written unless --kl-divergence",
    )
    p.add_argument(
        "--kl-divergence",
        action="store_true",
        help="compare against --kl-divergence-base instead of writing it",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InferflowError(f"cannot read --text {path}: {e}") from None


def run(args: argparse.Namespace) -> int:
    if args.kl_divergence and args.kl_divergence_base is None:
        raise InferflowError("--kl-divergence needs --kl-divergence-base FILE")
    text = read_text(args.text)
    # the text's windows counted before the weights load: too short a text fails at once
    spec = with_quant(load_spec(args.spec), args)
    tok = require_tokenizer(spec, tokenizer_for(spec))
    ids, bos = text_ids(tok, text)
    windows(ids, args.ctx, args.chunks)
    lm = load(spec, args.dtype, args.quant, tok)
    res = perplexity(
        lm.model,
        ids,
        args.ctx,
        args.chunks,
        save_base=None if args.kl_divergence else args.kl_divergence_base,
        kl_base=args.kl_divergence_base if args.kl_divergence else None,
        bos=bos,
    )
    out = {
        "spec": lm.spec.name,
        "quant": args.quant or lm.spec.quant.weights,
        "quant_method": lm.spec.quant.method,
        "text": str(args.text),
        "ctx": res.ctx,
        "chunks": res.chunks,
        "scored_tokens": res.scored_tokens,
        "ppl": round(res.ppl, 4),
    }
    if res.kl:
        out.update(
            kl_mean=res.kl.mean,
            kl_p99=res.kl.p99,
            kl_max=res.kl.maximum,
            top1_agreement=res.kl.top1_agreement,
        )
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0
