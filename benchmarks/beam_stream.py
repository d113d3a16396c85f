"""VAR-STREAM against the non-streaming searches on the real annalog SMILES model
(`annalog-smiles`, `python tools/fetch_models.py annalog`), side by side in one run:

1. fixed width: beam search (width K) batch by batch (B sources a batch, finished sources leave
   their batch at once), as `inferflow translate` runs without --refill;
2. variable width, not streaming: the same with --prune-delta / --max-per-parent;
3. VAR-STREAM (inferflow.engine.var_stream): the same variable-width search, refilled with
   waiting sources (one beam each) up to n = B x K live beams when the live beams drop to
   EPS x n, each step expanding every beam of the smallest length.

The sources are 240 SMILES: 20 drug-like molecules, each with 12 prefixes (none, C, CC, O, N,
F, Cl, Br, CO, OC, CN, C(C)). Times are the best of --repeats runs (interleaved, so that load
from other processes hits every search alike); CPU seconds are this process's. Steps are decoder
passes, beams the hypothesis rows computed over all of them; 2 and 3 compute the same beams, so
what streaming saves is per-step cost (fewer, fuller steps). Peak cache rows are the most
hypotheses held at once: a stream's newcomers widen to K beams each after the refill, so it
holds up to K x n, where a static batch of B sources holds n. The control 2' runs search 2 in
batches of K x B sources, which hold as many rows as the stream: what the stream gains at equal
memory. Outputs of 2 and 3 are compared token for token.

    python benchmarks/beam_stream.py [--beam 4] [--prune-delta 2] [--max-per-parent 2]
        [--batch-size 32] [--refill 0.1 0.25 0.5] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferflow.engine.beam import Hypothesis
from inferflow.engine.search import SearchParams, SearchStats, beam_search
from inferflow.engine.var_stream import stream_search

MOLECULES = [
    "CCO",
    "c1ccccc1O",
    "CC(=O)Nc1ccc(O)cc1",
    "CC(C)Cc1ccc(cc1)[C@@H](C)C(=O)O",
    "Clc1ccc(Br)cc1",
    "CN1C=NC2=C1C(=O)N(C(=O)N2C)C",
    "O=C(O)c1ccccc1OC(C)=O",
    "CCN(CC)CCNC(=O)c1ccc(N)cc1",
    "CC(=O)Oc1ccccc1C(=O)O",
    "c1ccc2ccccc2c1",
    "CCOC(=O)C1=CC=CC=C1",
    "NCCc1ccc(O)c(O)c1",
    "CC12CCC3C(CCC4=CC(=O)CCC34C)C1CCC2O",
    "OC(=O)CCc1ccccc1",
    "CN1CCC[C@H]1c1cccnc1",
    "COc1ccc2[nH]cc(CCNC(C)=O)c2c1",
    "Cc1ccccc1NC(=O)CN(CC)CC",
    "CC(C)NCC(O)c1ccc(O)c(O)c1",
    "O=C1CCCN1",
    "C1CCOC1",
]
PREFIXES = ["", "C", "CC", "O", "N", "F", "Cl", "Br", "CO", "OC", "CN", "C(C)"]


def smiles() -> list[str]:
    return [p + m for p in PREFIXES for m in MOLECULES]


@dataclass
class Result:
    name: str
    run: Callable[[SearchStats], list[list[Hypothesis]]]
    wall: float = float("inf")
    cpu: float = float("inf")
    stats: SearchStats | None = None
    hyps: list[list[Hypothesis]] | None = None


def batched(model, sources, params: SearchParams, batch: int):
    def run(stats: SearchStats) -> list[list[Hypothesis]]:
        out: list[list[Hypothesis]] = []
        for at in range(0, len(sources), batch):
            out += beam_search(model, sources[at : at + batch], params, stats=stats)
        return out

    return run


def streaming(model, sources, params: SearchParams, batch: int, refill: float):
    def run(stats: SearchStats) -> list[list[Hypothesis]]:
        return stream_search(model, sources, params, refill=refill, batch_size=batch, stats=stats)

    return run


def measure(results: list[Result], repeats: int) -> None:
    for r in results:  # warm-up, and the work counts
        r.stats = SearchStats()
        r.hyps = r.run(r.stats)
    for _ in range(repeats):
        for r in results:
            w, c = time.perf_counter(), time.process_time()
            r.run(SearchStats())
            r.wall = min(r.wall, time.perf_counter() - w)
            r.cpu = min(r.cpu, time.process_time() - c)


def compare(a: list[list[Hypothesis]], b: list[list[Hypothesis]]) -> tuple[int, float]:
    """Inputs whose hypotheses agree in tokens and order; largest score difference."""
    same = sum(
        [(h.tokens, h.ended) for h in x] == [(h.tokens, h.ended) for h in y]
        for x, y in zip(a, b, strict=True)
    )
    diff = max(
        (
            abs(h.logprob - g.logprob)
            for x, y in zip(a, b, strict=True)
            for h, g in zip(x, y, strict=False)
        ),
        default=0.0,
    )
    return same, diff


def report(results: list[Result], n: int) -> None:
    print("| search | wall s | CPU s | steps | beams expanded | beams / step | peak cache rows |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        assert r.stats is not None
        s = r.stats
        print(
            f"| {r.name} | {r.wall:.2f} | {r.cpu:.2f} | {s.steps} | {s.rows} "
            f"| {s.rows / s.steps:.1f} | {s.peak_rows} |"
        )
    fixed, var, control, streams = results[0], results[1], results[2], results[3:]
    assert var.hyps is not None and fixed.hyps is not None and var.stats is not None
    print()
    print(
        "| VAR-STREAM | stream / non-stream wall | speed-up | steps ratio | speed-up over 2' "
        "| identical to 2 |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for r in streams:
        assert r.hyps is not None and r.stats is not None
        same, diff = compare(r.hyps, var.hyps)
        print(
            f"| {r.name} | {r.wall / var.wall:.3f} | {var.wall / r.wall:.2f}x "
            f"| {r.stats.steps / var.stats.steps:.3f} | {control.wall / r.wall:.2f}x "
            f"| {'yes' if same == n else 'NO'}: {same}/{n} inputs, max score diff {diff:.1e} |"
        )
    same_best = sum(x[0].tokens == y[0].tokens for x, y in zip(fixed.hyps, var.hyps, strict=True))
    print(f"\nfixed vs variable width: the same best hypothesis for {same_best}/{n} inputs")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--prune-delta", type=float, default=2.0)
    ap.add_argument("--max-per-parent", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--refill", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# benchmarks/beam_stream.py ({torch.get_num_threads()} threads)")
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    try:
        from inferflow.runtime import load

        lm = load("annalog-smiles")
    except Exception as e:  # noqa: BLE001 - the benchmark reports what is missing
        print(f"skipped: annalog model not available ({e})")
        return
    sources = [lm.encode_source(s) for s in smiles()]
    K, B = args.beam, args.batch_size
    fixed = SearchParams(beam_width=K, max_new_tokens=args.max_tokens)
    var = SearchParams(
        beam_width=K,
        max_new_tokens=args.max_tokens,
        prune_delta=args.prune_delta,
        max_per_parent=args.max_per_parent,
    )
    print(
        f"\nannalog-smiles, {len(sources)} SMILES ({min(map(len, sources))}..{max(map(len, sources))}"
        f" tokens), beam {K}, batch {B} sources ({B * K} beams), up to {args.max_tokens} new "
        f"tokens; variable width: prune delta {args.prune_delta}, max per parent "
        f"{args.max_per_parent}\n"
    )
    model = lm.model
    results = [
        Result("1. fixed width", batched(model, sources, fixed, B)),
        Result("2. variable width", batched(model, sources, var, B)),
        # control: static batches as large as the stream's peak (K x B sources, K x n rows)
        Result(f"2'. variable width, batch {K * B}", batched(model, sources, var, K * B)),
        *(
            Result(f"3. VAR-STREAM eps {eps}", streaming(model, sources, var, B, eps))
            for eps in args.refill
        ),
    ]
    measure(results, args.repeats)
    report(results, len(sources))


if __name__ == "__main__":
    main()
