"""``inferflow chat SPEC``: talk with a model in the terminal, as ``ollama run`` or
``llama-cli -cnv`` do. Each line you type is a user message; the model's chat template renders
the whole conversation so far and the reply streams back. ``/reset`` forgets the conversation,
``/exit`` (or Ctrl-D) ends. The serving engine runs the turns, so its prefix cache reuses the
conversation's earlier tokens instead of recomputing them.

With ``--json`` (or input that is not a terminal) nothing is prompted and, with ``--json``,
each reply is one JSON line: ``{"reply", "finish_reason", "prompt_tokens", "cached_tokens"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inferflow.cli.common import with_quant
from inferflow.cli.generate import add_sampling, sampling_params
from inferflow.engine.engine import Engine
from inferflow.runtime import load, require_tokenizer, tokenizer_for
from inferflow.spec import load_spec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal", description=__doc__)
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.add_argument("--system", default=None, help="system message at the start")
    add_sampling(p)
    p.add_argument("--json", action="store_true", help="one JSON line per reply")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = with_quant(load_spec(args.spec), args)
    params = sampling_params(args, spec)
    tok = require_tokenizer(spec, tokenizer_for(spec))
    history: list[dict[str, Any]] = []
    system = [{"role": "system", "content": args.system}] if args.system else []
    # the template must render before the weights load (a model without one fails at once)
    tok.apply_chat_template([*system, {"role": "user", "content": "hi"}])
    lm = load(spec, args.dtype, args.quant, tok)
    engine = Engine(lm.model, tok)
    interactive = sys.stdin.isatty() and not args.json
    if interactive:
        print(f"chatting with {spec.name}; /reset forgets, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        line = line.rstrip("\n")
        if line.strip() == "/reset":
            history.clear()
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = tok.apply_chat_template([*system, *history], add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= engine.max_len:  # (said, and the line dropped: the chat goes on)
            history.pop()
            print(
                f"error: the conversation would have {len(ids)} tokens; the model holds "
                f"{engine.max_len} (/reset to start over)",
                file=sys.stderr,
            )
            continue
        reply, reason, cached = "", None, 0
        for out in engine.stream(ids, params):
            reply, reason = reply + out.text, out.finish_reason
            cached = cached or out.cached_tokens
            if not args.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
        if args.json:
            turn = {
                "reply": reply,
                "finish_reason": reason,
                "prompt_tokens": len(ids),
                "cached_tokens": cached,
            }
            print(json.dumps(turn, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n")
