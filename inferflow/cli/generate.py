"""``inferflow generate SPEC --prompt TEXT``: stream a completion to the terminal.

``--prompt -`` reads the prompt from stdin. With ``--ids`` the prompt is space-separated token
ids and the output is printed as ids (a model without a tokenizer takes only these).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from inferflow.cli.common import (
    add_dtype,
    add_ids,
    add_quant,
    add_speculation,
    draft_spec,
    speculation,
    text_or_ids,
    with_quant,
)
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.sampling import SamplingParams
from inferflow.errors import InferflowError, RequestError
from inferflow.runtime import encode_prompt, ids_from_text, load
from inferflow.spec import Spec, load_spec

# extra sampling flags: (flag, type, help); each maps to the SamplingParams field of its name
EXTRA_SAMPLING = [
    ("--min-p", float, "keep tokens with p >= min_p * p_max (0 = off)"),
    ("--typical-p", float, "locally typical sampling mass (1 = off)"),
    ("--tfs-z", float, "tail-free sampling z (1 = off)"),
    ("--mirostat", int, "mirostat version 1 or 2 (0 = off)"),
    ("--mirostat-tau", float, "mirostat target surprise in bits (5)"),
    ("--mirostat-eta", float, "mirostat learning rate (0.1)"),
    ("--fsd-alpha", float, "frustratingly simple decoding strength (0 = off)"),
    ("--repetition-penalty", float, "divide repeated tokens' positive logits by this (1 = off)"),
    ("--presence-penalty", float, "subtract from tokens already generated (-2..2)"),
    ("--frequency-penalty", float, "subtract this times each token's count (-2..2)"),
]


def add_sampling(p: argparse.ArgumentParser) -> None:
    """The sampling flags ``generate`` and ``chat`` share (defaults: the spec's)."""
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (spec default)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (spec default)")
    p.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)"
    )
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the reply where this text appears (not shown; repeatable)",
    )
    for flag, kind, what in EXTRA_SAMPLING:
        p.add_argument(flag, type=kind, default=None, help=what)
    add_dtype(p)
    add_quant(p)


def sampling_params(args: argparse.Namespace, spec: Spec) -> SamplingParams:
    """The flags' SamplingParams (RequestError for a bad value: before anything loads)."""
    g = spec.generation
    extra = {_dest(f): getattr(args, _dest(f)) for f, _, _ in EXTRA_SAMPLING}
    return SamplingParams(
        temperature=g.temperature if args.temperature is None else args.temperature,
        top_k=g.top_k if args.top_k is None else args.top_k,
        top_p=g.top_p if args.top_p is None else args.top_p,
        max_new_tokens=g.max_new_tokens if args.max_tokens is None else args.max_tokens,
        seed=g.seed if args.seed is None else args.seed,
        stop=tuple(args.stop),
        **{k: v for k, v in extra.items() if v is not None},
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt", description=__doc__)
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument(
        "--prompt",
        required=True,
        help="prompt text (a raw completion unless --chat); - reads it from stdin",
    )
    add_ids(p, "--prompt is")
    add_sampling(p)
    add_speculation(p)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming text"
    )
    p.set_defaults(run=run)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def run(args: argparse.Namespace) -> int:
    # every check that needs no weights first: a bad --quant, a missing chat template, a prompt
    # the tokenizer cannot take fail before anything loads
    spec = with_quant(load_spec(args.spec), args)
    params = sampling_params(args, spec)
    spec_cfg = speculation(args)
    if args.ids and args.chat:
        raise RequestError("--ids and --chat do not mix: the chat template renders text")
    tok = text_or_ids(spec, args.ids)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.ids:
        prompt_ids = ids_from_text(prompt, "--prompt")
    else:
        assert tok is not None
        prompt_ids = encode_prompt(tok, prompt, chat=args.chat, system=args.system)
    if not prompt_ids:
        what = "the chat template renders it as no text" if args.chat else "it has no tokens"
        raise InferflowError(f"--prompt: {what}")
    lm = load(spec, args.dtype, args.quant, tok)
    draft_model = draft_spec(args, spec)
    draft = load(draft_model, args.dtype, args.quant) if draft_model else None
    ids: list[int] = []
    text, reason = "", None
    t0 = time.perf_counter()
    # the serving engine's token loop (stop texts, end tokens, the context's end)
    engine = Engine(
        lm.model, tok, EngineConfig(speculative=spec_cfg), draft.model if draft else None
    )
    for step in engine.stream(prompt_ids, params):
        ids += step.token_ids
        text, reason = text + step.text, step.finish_reason
        if not args.json:
            shown = "".join(f"{t} " for t in step.token_ids) if args.ids else step.text
            sys.stdout.write(shown)
            sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    if args.json:
        out = {
            "text": text,
            "prompt_token_ids": prompt_ids,
            "token_ids": ids,
            "finish_reason": reason,
            "seconds": round(elapsed, 3),
        }
        if spec_cfg is not None:
            st = engine.spec_stats
            out |= {"acceptance_rate": round(st.acceptance_rate, 4), "drafted": st.proposed}
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if spec_cfg is not None:
            st = engine.spec_stats
            print(f"[{st.accepted} of {st.proposed} drafted tokens accepted]", file=sys.stderr)
    return 0
