"""The annalog package's trained SMILES seq2seq model (``annalog==1.0.6``), served by the built-in
spec ``annalog-smiles`` alone, against the package's own PyTorch code: teacher-forced decoder
logits, and the tokenizer (``pickle_vocab`` with the spec's regex) against the package's
``SMILESTokenizer`` + vocabulary field.

The package imports rdkit and partialsmiles at import time but uses them only to filter and
normalise molecules, never on the model path; where they are not installed, empty stand-ins are
put in ``sys.modules`` just for the import and taken out again.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from inferflow.model.batch import ContiguousKVCache, FlatBatch
from inferflow.model.build import load_model
from inferflow.model.cross import CrossBank
from inferflow.runtime import tokenizer_for
from inferflow.spec import load_spec

_found = importlib.util.find_spec("annalog")
if _found is None or not _found.submodule_search_locations:
    pytest.skip(
        "annalog is not installed (python tools/fetch_models.py annalog)", allow_module_level=True
    )
PKG_DIR = Path(next(iter(_found.submodule_search_locations)))
CKPT = PKG_DIR / "ckpt_and_vocab" / "Lev_extended.pt"
VOCAB = PKG_DIR / "ckpt_and_vocab" / "stereo_experiment_vocab_ttf.pkl"
MAX_LEN = 102  # model_handler.py's default max_length: the position tables' size

SMILES = [
    "CCO",
    "c1ccccc1O",
    "CC(=O)Nc1ccc(O)cc1",
    "CC(C)Cc1ccc(cc1)[C@@H](C)C(=O)O",
    "Clc1ccc(Br)cc1",
]
# bracket atoms (in and out of the vocabulary), %NN ring numbers, Br / Cl, characters the
# vocabulary lacks (P, a space) and a lone '[': what the package's recursive split must agree on
TOKENIZER_EXTRA = [
    "C[N+](C)(C)CC%11CCBr.Cl",
    "C%10CC%12C[C@H]1Cl[O-]",
    "[Na+].[Cl-]",
    "CP(=O)(O)OC",
    "CC O",
    "C[C",
    "BrCl%1%123",
]


@pytest.fixture(scope="module")
def package() -> dict[str, Any]:
    return load_package()


def load_package() -> dict[str, Any]:
    """The package's model handler (its model, fields and vocabulary) and tokenizer class."""
    stubs: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("rdkit") is None:
        rdkit, chem = types.ModuleType("rdkit"), types.ModuleType("rdkit.Chem")
        rdkit.Chem = chem  # type: ignore[attr-defined]
        stubs.update({"rdkit": rdkit, "rdkit.Chem": chem})
    if importlib.util.find_spec("partialsmiles") is None:
        ps = types.ModuleType("partialsmiles")
        ps.Error = Exception  # type: ignore[attr-defined]
        stubs["partialsmiles"] = ps
    saved = {k: sys.modules.get(k) for k in stubs}
    before = set(sys.modules)
    sys.modules.update(stubs)
    try:
        from annalog.model_files.vocabulary import SMILESTokenizer
        from annalog.model_handler import SMILESModelHandler

        handler = SMILESModelHandler(str(VOCAB), str(VOCAB), str(CKPT), "cpu", MAX_LEN)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        if stubs:  # annalog modules bound to the stand-ins must not outlive this fixture
            for k in set(sys.modules) - before:
                if k.split(".")[0] == "annalog":
                    del sys.modules[k]
    src, trg, model, _, _ = handler.get_model_and_fields()
    return {"src": src, "trg": trg, "model": model, "tokenizer": SMILESTokenizer()}


@pytest.fixture(scope="module")
def ours() -> tuple[torch.nn.Module, Any]:
    spec = load_spec("annalog-smiles")
    return load_model(spec), tokenizer_for(spec)


def package_source_ids(package: dict[str, Any], smiles: str) -> list[int]:
    # multi_gen_final.py / SimpleField.process: [<sos>] + tokens + [<eos>], OOV -> <unk>
    field = package["src"]
    return [int(i) for i in field.process([field.preprocess(smiles)])[0]]


@torch.no_grad()
def package_greedy(package: dict[str, Any], src_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """The package model's greedy output (``beam_search_decode`` with width 1 reruns the whole
    decoder each step, as here), and its decoder logits over that output fed back in."""
    model = package["model"]
    src = torch.tensor([src_ids])
    src_mask = model.make_src_mask(src)
    enc = model.encoder(src, src_mask)
    sos, eos = src_ids[0], package["trg"].vocab.stoi["<eos>"]
    ys = [sos]
    while ys[-1] != eos and len(ys) < MAX_LEN:
        trg = torch.tensor([ys])
        logits, _ = model.decoder(trg, enc, model.make_trg_mask(trg), src_mask)
        ys.append(int(logits[0, -1].argmax()))
    trg = torch.tensor([ys[:-1]])
    logits, _ = model.decoder(trg, enc, model.make_trg_mask(trg), src_mask)
    return ys, logits[0]


@torch.no_grad()
def our_logits(model: torch.nn.Module, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
    h = model.spec.hparams
    memory = model.cross_memory(model.encode([src_ids])[0])
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, MAX_LEN, torch.float32)
    tgt = torch.tensor(tgt_ids)
    batch = FlatBatch.single(tgt, 0, cache)
    batch.cross = CrossBank.of([memory]).rows([0], [tgt.numel()])
    batch.logits_rows = torch.arange(tgt.numel())
    return model(batch)


@pytest.mark.parametrize("smiles", SMILES)
def test_decoder_logits_match_package(smiles: str, package, ours) -> None:
    model, tok = ours
    src_ids = package_source_ids(package, smiles)
    assert tok.encode(smiles) == src_ids
    ys, ref = package_greedy(package, src_ids)
    assert model.start_id == ys[0]
    got = our_logits(model, src_ids, ys[:-1])
    diff = (got - ref).abs().max()
    rel = diff / ref.abs().max()
    print(f"{smiles}: {len(ys) - 1} steps, max |diff| {diff:.2e}, relative {rel:.2e}")
    assert rel <= 1e-4, f"{smiles}: max relative logit difference {rel:.2e}"
    # teacher-forced on the package's greedy output, our argmax picks the same next token
    assert got.argmax(-1).tolist() == ys[1:]


@pytest.mark.parametrize("smiles", SMILES + TOKENIZER_EXTRA)
def test_tokenizer_matches_package(smiles: str, package, ours) -> None:
    _, tok = ours
    ids = tok.encode(smiles)
    assert ids == package_source_ids(package, smiles)
    itos = package["src"].vocab.itos
    assert tok.decode(ids) == package["tokenizer"].untokenize(
        [itos[i] for i in ids[1:-1] if i != tok.unk_id]
    )
    pieces = package["tokenizer"].tokenize(smiles)
    if set(pieces) <= set(itos):  # no unk (the package's stoi adds what it is asked for)
        assert tok.decode(ids) == smiles
        assert tok.encode(smiles, add_special_tokens=False) == ids[1:-1]


def test_special_tokens(ours) -> None:
    _, tok = ours
    assert (tok.unk_id, tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, 2, [3])
    assert tok.vocab_size == 59
    assert tok.decode([2, 5, 0, 9, 3, 1]) == "CO"  # specials dropped
    assert tok.decode([2, 5, 9, 3], skip_special_tokens=False) == "<sos>CO<eos>"


def test_greedy_outputs_match_package(package, ours) -> None:
    """All sources greedy-decoded in one batch (inferflow.engine.search, width 1) equal the
    package model's greedy outputs token for token; the text round-trips through the spec's
    tokenizer."""
    from inferflow.engine.search import SearchParams, beam_search

    model, tok = ours
    sources = [package_source_ids(package, s) for s in SMILES]
    hyps = beam_search(model, sources, SearchParams(beam_width=1, max_new_tokens=MAX_LEN - 1))
    for src, (h,) in zip(sources, hyps, strict=True):
        ys, _ = package_greedy(package, src)
        assert h.tokens == ys[1:]
        assert h.ended == (ys[-1] == 3)
    itos = package["trg"].vocab.itos
    for (h,), smiles in zip(hyps, SMILES, strict=True):
        want = "".join(itos[i] for i in h.tokens if i > 3)
        assert tok.decode(h.tokens) == want, smiles


def test_translate_cli(package, ours, monkeypatch, capsys) -> None:
    """`inferflow translate annalog-smiles` from stdin: one line out per line in (empty stays
    empty), the package's greedy outputs as text."""
    import io

    from inferflow.cli.main import main

    _, tok = ours
    monkeypatch.setattr("sys.stdin", io.StringIO("CCO\n\nClc1ccc(Br)cc1\n"))
    assert main(["translate", "annalog-smiles", "--beam", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = [
        tok.decode(package_greedy(package, package_source_ids(package, s))[0])
        for s in ("CCO", "Clc1ccc(Br)cc1")
    ]
    assert lines == [want[0], "", want[1]]
