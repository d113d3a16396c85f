"""What structured output costs: generated tokens per second of the in-process engine with a
JSON Schema constraint against the same requests without one.

    python benchmarks/structured.py [--spec smollm2-135m-instruct] [--batch 1,32] [--tokens 96]
                                    [--rounds 3]

N distinct chat prompts at once, each generating up to --tokens tokens at temperature 0.8 (a
fixed seed per prompt). The constraint is an object holding an array of at least 1000
strings, so every constrained reply runs to the token limit; the free ones ignore the end token
for the same reason (both ways keep N sequences running to the end). Each round runs both ways one after the other on the same engine; the table has the
medians of the rounds and the ratio (constrained / free). The mask is computed per sample on
the engine thread (``inferflow.engine.constrain``); the llguidance tokenizer is built before
timing.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine.constrain import compile_grammar, lltokenizer  # noqa: E402
from inferflow.engine.engine import Engine  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.runtime import load  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 1000}},
    "required": ["notes"],
}
TOPICS = ["cats", "rivers", "trains", "music", "stars", "bread", "chess", "snow"]


def tok_per_s(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    t0 = time.perf_counter()
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    reqs = [r for rid in rids for r in engine.requests[rid]]
    while engine.has_unfinished():
        engine.step()
    return sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lm = load(args.spec)
    assert lm.tokenizer is not None
    t0 = time.perf_counter()
    ll = lltokenizer(lm.tokenizer, lm.spec.hparams.vocab_size)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compile_grammar("json_schema", SCHEMA, ll)
    compiled = time.perf_counter() - t0
    engine = Engine(lm.model, lm.tokenizer)
    rows = []
    for n in (int(b) for b in args.batch.split(",")):
        prompts = [
            lm.encode_prompt(f"Write notes about {TOPICS[i % 8]} ({i}) as JSON.", chat=True)
            for i in range(n)
        ]
        base = [
            SamplingParams(temperature=0.8, seed=i, max_new_tokens=args.tokens) for i in range(n)
        ]
        free = [SamplingParams(**{**vars(p), "ignore_eos": True}) for p in base]
        bound = [SamplingParams(**{**vars(p), "grammar": grammar}) for p in base]
        got: dict[str, list[float]] = {"free": [], "schema": []}
        for _ in range(args.rounds):
            for name, params in (("free", free), ("schema", bound)):
                got[name].append(tok_per_s(engine, prompts, params))
        f, s = (statistics.median(got[k]) for k in ("free", "schema"))
        rows.append((n, f, s))
    print(f"command: python {shlex.join(sys.argv)}")
    print(
        f"llguidance tokenizer built in {built:.2f} s; schema compiled in {1e3 * compiled:.1f} ms"
    )
    print(f"{'N':>4} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6}")
    for n, f, s in rows:
        print(f"{n:>4} {f:>11.1f} {s:>13.1f} {s / f:>6.3f}")


if __name__ == "__main__":
    main()
