"""Speculative decoding in the engine: generated tokens/s with and without drafts, and the
acceptance rate, on SmolLM2-135M-Instruct (its GGUF's quantized blocks, float32 activations),
for two kinds of request:

- ``edit``: "add type hints to this function" with a ~150-token Python function: the answer
  repeats most of the prompt (where prompt lookup helps);
- ``free``: "write a short story": little to look up.

    python benchmarks/speculative.py [--concurrency 1,2,4,8] [--lookahead 3] [--max-tokens 128] [--rounds 3] [--draft SPEC | --draft-layers N]

Each round serves N distinct greedy chat requests (all added at t=0) with the plain engine and
with prompt lookup (and with ``--draft SPEC``'s model when given) back to back, on the same
engine settings and threads; greedy speculation gives the same tokens, so both generate the
same count. Reports the median tokens/s over the rounds, the median of the rounds' own ratios
against the plain engine, and the acceptance rate (accepted / drafted tokens).

No shipped model shares SmolLM2's vocabulary; ``--draft-layers N`` drafts with SmolLM2's own
first N layers (a copy of its GGUF cut to N blocks, written to a temp dir): a cheap draft that
rarely agrees, where a request's drafting pauses (SpecConfig.min_acceptance) — measured both
with the pause and without it ("never paused").
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine.engine import Engine, EngineConfig  # noqa: E402
from inferflow.engine.sampling import SamplingParams  # noqa: E402
from inferflow.engine.speculative import SpecConfig  # noqa: E402
from inferflow.loaders.gguf import GGUFSource  # noqa: E402
from inferflow.loaders.gguf_writer import GGUFTensorPlan, write_gguf  # noqa: E402
from inferflow.runtime import (  # noqa: E402
    LanguageModel,  # noqa: E402
    encode_prompt,
    load,
)

SPEC = "smollm2-135m-instruct"
NAMES = "total price score weight count limit offset ratio width height".split()


def function(i: int) -> str:
    a, b, c = NAMES[i % 10], NAMES[(i + 3) % 10], NAMES[(i + 7) % 10]
    return (
        f"def update_{a}_{i}(items, {b}, {c}=None):\n"
        f"    result = []\n"
        f"    for item in items:\n"
        f"        if {c} is not None and item.{a} > {c}:\n"
        f"            continue\n"
        f"        value = item.{a} * {b} + item.{b}\n"
        f"        if value < 0:\n"
        f"            value = 0\n"
        f"        result.append((item.name, value))\n"
        f"    result.sort(key=lambda pair: pair[1])\n"
        f"    return result\n"
    )


def prompt(task: str, i: int) -> str:
    if task == "edit":
        return f"Add type hints to this Python function. Reply with the code only.\n\n{function(i)}"
    w = NAMES[i % 10]
    return f"Write a short story about a {w} that changed a small town, number {i}."


def run(
    lm: LanguageModel,
    spec: SpecConfig | None,
    draft: LanguageModel | None,
    prompts: list[list[int]],
    max_tokens: int,
) -> tuple[float, int, float | None]:
    """Generated tokens/s (wall clock, prefill included), tokens, acceptance rate (None when
    nothing was drafted)."""
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(speculative=spec), draft and draft.model)
    params = SamplingParams(max_new_tokens=max_tokens)
    t0 = time.perf_counter()
    done = eng.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(r.output_ids) for r in done)
    st = eng.spec_stats
    return n / dt, n, st.acceptance_rate if st.proposed else None


def cut_gguf(src_path: str, layers: int, out: Path) -> Path:
    """A copy of a GGUF with only its first ``layers`` blocks (the same tensors' bytes)."""
    src = GGUFSource(src_path)
    arch = src.metadata["general.architecture"]
    meta = dict(src.metadata) | {f"{arch}.block_count": layers}
    keep = [
        n for n in src.names()
        if not (m := re.match(r"blk\.(\d+)\.", n)) or int(m.group(1)) < layers
    ]  # fmt: skip
    plans = [GGUFTensorPlan(n, src.shape(n), src.dtype_name(n)) for n in keep]

    def produce(plan: GGUFTensorPlan) -> object:
        w = src.get(plan.name)
        return getattr(w, "data", w)  # a QuantTensor's raw blocks, or the plain tensor

    with out.open("wb") as f:
        write_gguf(f, meta, plans, produce, dict(src.metadata_types))
    return out


def acceptance(rates: list[float | None]) -> float | None:
    got = [r for r in rates if r is not None]
    return statistics.median(got) if got else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--lookahead", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft", default=None, help="also a draft model (a spec)")
    ap.add_argument("--draft-layers", type=int, default=0, help="draft: SmolLM2's first N layers")
    args = ap.parse_args()
    lm = load(SPEC)
    name = args.draft
    if args.draft_layers:
        tmp = Path(tempfile.mkdtemp(prefix="inferflow-draft-"))
        name = str(cut_gguf(lm.spec.source.files[0], args.draft_layers, tmp / "draft.gguf"))
    draft = load(name) if name else None
    modes: list[tuple[str, SpecConfig | None]] = [
        ("plain", None),
        ("prompt lookup", SpecConfig("ngram", args.lookahead)),
    ]
    if draft is not None:
        label = f"{args.draft_layers} layers" if args.draft_layers else args.draft
        modes.append((f"draft {label}", SpecConfig("draft", args.lookahead)))
        never = SpecConfig("draft", args.lookahead, min_acceptance=0)
        modes.append((f"draft {label}, never paused", never))
    rows = []
    for task in ("edit", "free"):
        for n in (int(x) for x in args.concurrency.split(",")):
            got: dict[str, list[tuple[float, int, float | None]]] = {m: [] for m, _ in modes}
            for r in range(args.rounds):
                prompts = [
                    encode_prompt(lm.tokenizer, prompt(task, r * 100 + i), chat=True)
                    for i in range(n)
                ]
                for name, spec in modes:
                    got[name].append(run(lm, spec, draft, prompts, args.max_tokens))
            base = got["plain"]
            for name, _ in modes:
                runs = got[name]
                ratio = statistics.median(x[0] / b[0] for x, b in zip(runs, base, strict=True))
                rows.append(
                    (
                        task, n, name,
                        statistics.median(x[0] for x in runs),
                        statistics.median(x[1] for x in runs),
                        acceptance([x[2] for x in runs]),
                        ratio,
                    )
                )  # fmt: skip
    print(f"\n{SPEC}, {torch.get_num_threads()} threads, greedy, lookahead {args.lookahead}, "
          f"medians of {args.rounds} rounds\n")  # fmt: skip
    print("| task | N | mode | tok/s | tokens | acceptance | vs plain |")
    print("|---|---|---|---|---|---|---|")
    for task, n, name, tps, toks, acc, ratio in rows:
        a = "" if name == "plain" else "none drafted" if acc is None else f"{acc:.0%}"
        print(f"| {task} | {n} | {name} | {tps:.1f} | {toks} | {a} | {ratio:.2f}x |")
    print(f"\ncommand: python benchmarks/speculative.py {shlex.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
