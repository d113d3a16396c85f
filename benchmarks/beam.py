"""Beam search: the fused (Amun) output layer against the naive one, and finished inputs dropped
from the batch against kept in it, side by side in one run.

1. Output layer alone: rows = sources x beam, hidden 512, vocabularies of 32k and 128k; the
   naive layer computes all logits, log_softmax and topk; the fused one walks the vocabulary
   in chunks with an online normaliser and top-k (inferflow.engine.output_layer).
2. Whole beam search on a random Marian-shaped model (d_model 256, 3+3 layers, vocab 32k):
   time per decoder step, fused vs naive, beam 1 / 4 / 8.
3. Finished inputs dropped (Amun's mini-batching) vs kept (static batch) on the real annalog
   checkpoint when installed (`python tools/fetch_models.py annalog`), whose sources finish at
   different lengths: total time and hypothesis-rows computed.

    python benchmarks/beam.py [--sources 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from timing import timed

from inferflow.engine.output_layer import fused_topk, naive_topk
from inferflow.engine.search import SearchParams, SearchStats, beam_search
from inferflow.model.build import load_model
from inferflow.spec import load_spec


def output_layer_table(sources: int, repeats: int) -> None:
    print("\n## 1. Output layer alone (hidden 512, k = 2 x beam), ms per call")
    print("| vocab | beam | rows | naive | fused | naive / fused |")
    print("|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for vocab in (32000, 128000):
        w = torch.randn(vocab, 512, generator=g) * 0.05
        b = torch.randn(vocab, generator=g)
        for beam in (1, 4, 8):
            h = torch.randn(sources * beam, 512, generator=g)
            k = 2 * beam
            t_naive = timed(
                lambda h=h, k=k, w=w, b=b: naive_topk(
                    h, lambda x: torch.nn.functional.linear(x, w, b), k
                ),
                repeats,
            )
            t_fused = timed(lambda h=h, k=k, w=w, b=b: fused_topk(h, w, b, k), repeats)
            print(
                f"| {vocab} | {beam} | {h.shape[0]} | {t_naive * 1e3:.2f} | {t_fused * 1e3:.2f} "
                f"| {t_naive / t_fused:.2f} |"
            )


def random_marian(d: Path) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.MarianConfig(
        vocab_size=32000,
        d_model=256,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        max_position_embeddings=256,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        scale_embedding=True,
        activation_function="swish",
    )
    torch.manual_seed(0)
    tf.MarianMTModel(cfg).save_pretrained(d)
    (d / "spec.yaml").write_text(
        f'name: bench-marian\nbase: arch/marian\nsource: {{format: hf, files: ["{d}"]}}\n'
    )
    return load_model(load_spec(d / "spec.yaml"))


def search_table(model: torch.nn.Module, sources: list[list[int]], repeats: int) -> None:
    print(
        f"\n## 2. Beam search on a random Marian (vocab 32000, d 256, 3+3 layers), {len(sources)} sources, 24 new tokens"
    )
    print("| beam | steps | naive ms/step | fused ms/step | naive / fused |")
    print("|---:|---:|---:|---:|---:|")
    for beam in (1, 4, 8):
        p = SearchParams(beam_width=beam, max_new_tokens=24)
        c = SearchStats()
        beam_search(model, sources, p, stats=c)
        t_naive = timed(lambda p=p: beam_search(model, sources, p, fused=False), repeats)
        t_fused = timed(lambda p=p: beam_search(model, sources, p, fused=True), repeats)
        print(
            f"| {beam} | {c.steps} | {t_naive / c.steps * 1e3:.1f} | {t_fused / c.steps * 1e3:.1f} "
            f"| {t_naive / t_fused:.2f} |"
        )


def drop_table(repeats: int) -> None:
    try:
        from inferflow.runtime import load

        lm = load("annalog-smiles")
    except Exception as e:  # noqa: BLE001 - the benchmark reports what is missing
        print(f"\n## 3. skipped: annalog model not available ({e})")
        return
    smiles = [
        "CCO",
        "c1ccccc1O",
        "CC(=O)Nc1ccc(O)cc1",
        "CC(C)Cc1ccc(cc1)C(C)C(=O)O",
        "Clc1ccc(Br)cc1",
        "CN1C=NC2=C1C(=O)N(C(=O)N2C)C",
        "O=C(O)c1ccccc1OC(C)=O",
        "CCN(CC)CCNC(=O)c1ccc(N)cc1",
    ] * 2
    sources = [lm.encode_source(s) for s in smiles]
    print(
        f"\n## 3. Finished inputs dropped vs kept: annalog (real checkpoint), {len(sources)} sources"
    )
    print("| beam | kept: s | rows | dropped: s | rows | kept / dropped |")
    print("|---:|---:|---:|---:|---:|---:|")
    for beam in (1, 4, 8):
        p = SearchParams(beam_width=beam, max_new_tokens=100)
        out = {}
        for drop in (False, True):
            c = SearchStats()
            beam_search(lm.model, sources, p, drop_finished=drop, stats=c)
            t = timed(
                lambda p=p, drop=drop: beam_search(lm.model, sources, p, drop_finished=drop),
                repeats,
            )
            out[drop] = (t, c.rows)
        (tk, rk), (td, rd) = out[False], out[True]
        print(f"| {beam} | {tk:.2f} | {rk} | {td:.2f} | {rd} | {tk / td:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sources", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"# benchmarks/beam.py ({torch.get_num_threads()} threads)")
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    output_layer_table(args.sources, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        model = random_marian(Path(tmp))
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(8, 40, (args.sources,), generator=g).tolist()
        sources = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in lengths]
        search_table(model, sources, args.repeats)
    drop_table(args.repeats)


if __name__ == "__main__":
    main()
