"""Quantization at load time (``--quant``) against ``inferflow quantize``: for the same format,
method and importance matrix, the blocks read at load time are the bytes ``quantize`` writes
(every tensor, the same set packed: linear weights, the default mix, the head, the embeddings),
and the model loaded with ``--quant`` computes what the model loaded from the written file
computes, exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from inferflow.cli.main import main
from inferflow.errors import QuantError
from inferflow.imatrix import collect
from inferflow.loaders import open_files
from inferflow.model.binding import plan_weights
from inferflow.model.build import build_network, load_model
from inferflow.model.names import NameMap
from inferflow.quant.linear import QuantLinear
from inferflow.quant.source import quantize_on_load
from inferflow.quant.tensor import QuantTensor
from inferflow.quantize import quantize_checkpoint
from inferflow.runtime import LanguageModel
from inferflow.spec import Spec, load_spec
from tests.conftest import all_logits, spec_doc

IDS = torch.tensor([1, 17, 200, 5, 99, 3, 64, 128, 7, 250])


def _spec(write_spec, d: Path, tied: bool, name: str = "spec.yaml", files=None) -> Spec:
    doc = spec_doc("llama", d, "safetensors")
    if files is not None:  # the quantized container, with the float checkpoint's config
        doc["source"] = {"format": "safetensors", "files": [str(files)]}
        doc["source"]["config"] = str(d / "config.json")
    if tied:
        doc["network"] = {"output": {"tied": True}}
    return load_spec(write_spec(doc, name))


@pytest.fixture(scope="module")
def imatrix(quant_llamas, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An importance matrix of each tiny llama, from random ids (``inferflow imatrix``'s
    collection, itself checked against transformers in test_quant_search)."""
    out = {}
    for kind, d in quant_llamas.items():
        path = tmp_path_factory.mktemp("imatrix") / f"{kind}.gguf"
        doc = spec_doc("llama", d, "safetensors")
        if kind == "tied":
            doc["network"] = {"output": {"tied": True}}
        spec_path = path.with_suffix(".yaml")
        spec_path.write_text(yaml.safe_dump(doc))
        spec = load_spec(spec_path)
        ids = torch.randint(3, 256, (256,), generator=torch.Generator().manual_seed(5)).tolist()
        collect(LanguageModel(spec, load_model(spec), None), ids, 64, None, bos=1).write(path)
        out[kind] = path
    return out


CASES = [  # (format, tied head, method, with an importance matrix, the table's, the head's)
    ("Q4_B32", False, "search", True, "Q4_B32", "Q6"),  # the 4-bit mix: V Q6, down Q5
    ("Q3H", True, "search", False, "Q6", "Q6"),  # a tied head: the table in the head's Q6
    ("Q4_B64", True, "search", True, "Q6", "Q6"),
    ("Q4_K", False, "minmax", False, "Q5_0", "Q8_0"),  # rows of 128 / 192: the fallback Q5_0
    ("Q8_0", True, "search", True, "Q8_0", "Q8_0"),
]


@pytest.mark.parametrize(("fmt", "tied", "method", "with_imatrix", "table", "head"), CASES)
def test_runtime_quantization_is_the_quantize_output(
    quant_llamas, imatrix, write_spec, tmp_path: Path, fmt, tied, method, with_imatrix, table, head
) -> None:
    d = quant_llamas["tied" if tied else "untied"]
    matrix = imatrix["tied" if tied else "untied"] if with_imatrix else None
    out = tmp_path / "q.safetensors"
    res = quantize_checkpoint(d, out, fmt, method=method, imatrix=matrix)
    spec = _spec(write_spec, d, tied)
    quant = replace(spec.quant, weights=fmt, method=method, imatrix=matrix)

    # the bytes: every tensor as the view reads it is the file's, packed in the same format
    model = build_network(spec)
    source = open_files("hf", [d])
    written = open_files("safetensors", [out])
    try:
        plan = plan_weights(model, source, NameMap(spec.network.tensors))
        view, after = quantize_on_load(source, plan, quant, getattr(model, "tied_outputs", ()))
        assert after is None  # (every tensor lands as stored)
        packed = {n for n, f in res.formats.items() if f == view.dtype_name(n)}
        assert packed == set(res.formats)
        assert view.dtype_name("model.embed_tokens.weight") == table
        for name in written.names():
            a, b = view.get(name), written.get(name)
            if isinstance(b, QuantTensor):
                assert isinstance(a, QuantTensor) and a.format == b.format, name
                assert torch.equal(a.data.reshape(-1), b.data.reshape(-1)), name
            else:
                assert torch.equal(a, b), name
    finally:
        source.close()
        written.close()

    # the models: the same layers in the same formats, the same logits bit for bit
    at_load = load_model(spec, quant=quant)
    from_file = load_model(_spec(write_spec, d, tied, "q.yaml", out))
    formats = [(p, m.format) for p, m in at_load.named_modules() if isinstance(m, QuantLinear)]
    assert formats == [
        (p, m.format) for p, m in from_file.named_modules() if isinstance(m, QuantLinear)
    ]
    assert ("dec.output", head) in formats
    table = at_load.get_submodule("dec.tok_embed")  # its lookups read packed rows
    assert table.blocks is not None or table.plane is not None
    assert torch.equal(all_logits(at_load, IDS), all_logits(from_file, IDS))


def test_method_and_imatrix_change_the_codes(quant_llamas, imatrix, write_spec) -> None:
    """The default is the search: min-max (``--quant-method minmax``) and an importance matrix
    each give other blocks (so the test above compares something)."""
    d = quant_llamas["untied"]
    spec = _spec(write_spec, d, False)
    logits = {}
    for method, matrix in (("search", None), ("minmax", None), ("search", imatrix["untied"])):
        quant = replace(spec.quant, weights="Q4_B32", method=method, imatrix=matrix)
        logits[method, matrix] = all_logits(load_model(spec, quant=quant), IDS)
    assert spec.quant.method == "search"
    values = list(logits.values())
    assert not torch.equal(values[0], values[1]) and not torch.equal(values[0], values[2])


def test_quant_flags_and_matrices_checked(
    quant_llamas, imatrix, write_spec, capsys: pytest.CaptureFixture[str]
) -> None:
    """--quant-method / --imatrix without a format, a missing matrix file, another model's
    matrix: refused, naming the problem, before any weight is read."""
    spec = write_spec(spec_doc("llama", quant_llamas["untied"], "safetensors"))
    rc = main(["ppl", str(spec), "--text", str(spec), "--imatrix", str(imatrix["untied"])])
    assert rc == 2 and "give --quant FORMAT" in capsys.readouterr().err
    rc = main(["ppl", str(spec), "--text", str(spec), "--quant", "Q4_B32", "--imatrix", "/nope"])
    assert rc == 2 and "--imatrix /nope: no such file" in capsys.readouterr().err
    tied = _spec(write_spec, quant_llamas["tied"], True, "tied.yaml")
    quant = replace(tied.quant, weights="Q4_B32", imatrix=imatrix["untied"])  # has lm_head
    with pytest.raises(QuantError, match="another model.*lm_head.weight"):
        load_model(tied, quant=quant)


def test_weights_that_do_not_land_as_stored_are_quantized_after_reading(
    tmp_path: Path, write_spec
) -> None:
    """GPT-2 stores its projections transposed (Conv1D): no block of the stored tensor is a
    block of the layer, so they are quantized once read, in the format quantize gives them;
    the model stays within Q8_0's error of the float one."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    tf.GPT2LMHeadModel(cfg).eval().save_pretrained(tmp_path)
    spec = load_spec(write_spec({"name": "g", "base": "arch/gpt2", "source": {
        "format": "hf", "files": [str(tmp_path)]}}))  # fmt: skip
    at_load = load_model(spec, quant=replace(spec.quant, weights="Q8_0"))
    linear = [p for p, m in at_load.named_modules() if isinstance(m, QuantLinear)]
    assert len(linear) == 2 * 4 + 1  # qkv, out, fc, proj per layer; the tied head
    diff = all_logits(at_load, IDS) - all_logits(load_model(spec), IDS)
    assert 0 < float(diff.abs().max()) < 0.05


def _loads_cached(monkeypatch: pytest.MonkeyPatch, name: str, path: Path) -> None:
    """``--quant ... --imatrix name`` on SmolLM2 takes the cached ``path``, computing nothing."""
    from argparse import Namespace

    from inferflow import imatrix as im
    from inferflow.cli.common import with_quant

    def no_second_pass(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("computed twice")

    monkeypatch.setattr(im, "collect", no_second_pass)
    args = Namespace(quant="Q4_B32", quant_method=None, imatrix=name)
    assert with_quant(load_spec("smollm2-135m-instruct"), args).quant.imatrix == path


def test_builtin_imatrix_is_computed_once_from_hamlet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--imatrix builtin``: the importance matrix of the calibration windows (those after the
    ones perplexity runs score) of the text ``make models`` fetches, computed once and cached;
    ``inferflow imatrix`` over the same windows writes the same statistics."""

    from inferflow import imatrix as im
    from inferflow.imatrix import ImportanceMatrix
    from tests.conftest import smollm2_path

    smollm2_path()
    text = tmp_path / "calibration.txt"
    text.write_text("To be, or not to be, that is the question. " * 40)
    monkeypatch.setattr(im, "CALIBRATION_TEXT", text)
    monkeypatch.setattr(im, "CALIBRATION_CTX", 32)
    monkeypatch.setattr(im, "CALIBRATION_FIRST", 1)
    monkeypatch.setattr(im, "CALIBRATION_CHUNKS", 2)
    monkeypatch.setattr(im, "IMATRIX_CACHE", tmp_path / "cache")
    path = im.named_imatrix(im.BUILTIN, "smollm2-135m-instruct")
    assert path.parent == tmp_path / "cache"
    own = tmp_path / "own.gguf"
    rc = main(["imatrix", "smollm2-135m-instruct", "--text", str(text), "-o", str(own),
               "--ctx", "32", "--chunk", "1", "--chunks", "2"])  # fmt: skip
    assert rc == 0
    got, want = ImportanceMatrix.read(path), ImportanceMatrix.read(own)
    assert got.chunks == want.chunks == 2 and set(got.sums) == set(want.sums)
    for name in want.sums:
        assert torch.equal(got.sums[name], want.sums[name]), name

    _loads_cached(monkeypatch, "builtin", path)


def test_generated_imatrix_needs_no_text_and_weights_what_text_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--imatrix generated``: SmolLM2's importance matrix from its own samples, with no
    calibration text on the machine, computed once and cached. Against what real text's
    activations weigh (an imatrix of an English passage, the independent reference), Q4_B64
    blocks searched with it have less error than without one, tensor by tensor."""

    from inferflow import imatrix as im
    from inferflow.evaluate import text_ids
    from inferflow.imatrix import ImportanceMatrix
    from inferflow.loaders import open_files
    from inferflow.quant import quantize
    from inferflow.runtime import load
    from tests.conftest import smollm2_path

    smollm2_path()
    monkeypatch.setattr(im, "CALIBRATION_TEXT", tmp_path / "absent.txt")
    monkeypatch.setattr(im, "CALIBRATION_CTX", 64)
    monkeypatch.setattr(im, "CALIBRATION_CHUNKS", 8)
    monkeypatch.setattr(im, "GENERATED_SEQS", 8)
    monkeypatch.setattr(im, "IMATRIX_CACHE", tmp_path / "cache")
    path = im.named_imatrix("generated", "smollm2-135m-instruct")
    got = ImportanceMatrix.read(path)
    assert path.parent == tmp_path / "cache" and got.chunks == 8 and got.chunk_size == 64

    _loads_cached(monkeypatch, "generated", path)
    monkeypatch.undo()
    spec = load_spec("smollm2-135m-instruct")

    lm = load(spec, "float32", "none")
    passage = (
        "In the beginning God created the heaven and the earth. And the earth was without "
        "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
        "moved upon the face of the waters. And God said, Let there be light: and there was "
        "light. And God saw the light, that it was good: and God divided the light from the "
        "darkness. And God called the light Day, and the darkness he called Night. "
    )
    ids, bos = text_ids(lm._tok(), passage * 4)
    text = im.collect(lm, ids, 64, 4, bos)
    src = open_files(spec.source.format, spec.source.files, spec.source.keys)
    names = ["blk.0.attn_q.weight", "blk.7.ffn_gate.weight", "blk.15.attn_v.weight"]
    names += ["blk.22.ffn_up.weight", "blk.29.ffn_down.weight", "token_embd.weight"]
    try:
        for name in names:
            stored = src.get(name)
            w = stored.dequantize() if isinstance(stored, QuantTensor) else stored.float()
            truth = text.importance(name)
            assert truth is not None and got.importance(name) is not None

            def error(
                imp: torch.Tensor | None, w: torch.Tensor = w, t: torch.Tensor = truth
            ) -> float:
                q = quantize(w, "Q4_B64", "search", imp).dequantize()
                return float((((w - q) ** 2) * t).sum())

            assert error(got.importance(name)) < error(None), name
    finally:
        src.close()


def test_spec_quant_method_and_imatrix(quant_llamas, imatrix, write_spec) -> None:
    """``quant: {method, imatrix}`` in a spec: the imatrix path resolved against the spec's
    folder, a method outside METHODS refused naming the allowed ones."""
    from inferflow.errors import SpecError

    doc = spec_doc("llama", quant_llamas["untied"], "safetensors")
    name = imatrix["untied"].name
    doc["quant"] = {"weights": "Q4_B32", "method": "minmax", "imatrix": name}
    spec = load_spec(write_spec(doc, str(imatrix["untied"].parent / "s.yaml")))
    assert spec.quant.method == "minmax" and spec.quant.imatrix == imatrix["untied"]
    doc["quant"]["method"] = "best"
    with pytest.raises(SpecError, match="best.*minmax.*search|minmax.*search.*best"):
        load_spec(write_spec(doc, str(imatrix["untied"].parent / "t.yaml")))


@pytest.mark.parametrize("checkpoint", ["keep", "dequantize"])
def test_overrides_alone_keep_or_dequantize_the_rest(
    quant_llamas, tmp_path: Path, checkpoint: str
) -> None:
    """``quant.overrides`` without a default format re-quantize only the layers they name; the
    checkpoint's other blocks stay as stored (``checkpoint: keep``) or become float
    (``dequantize``), as without overrides."""
    from inferflow.blocks.linear import Linear
    from inferflow.spec.types import QuantSpec

    q4 = tmp_path / "q4.gguf"
    quantize_checkpoint(quant_llamas["untied"], q4, "Q4_0")
    spec = load_spec(str(q4))
    quant = QuantSpec(overrides=(("dec.0.*", "Q8_0"),), checkpoint=checkpoint)
    model = load_model(spec, quant=quant)
    wo0, wo1 = model.get_submodule("dec.0.self_attn.wo"), model.get_submodule("dec.1.self_attn.wo")
    assert isinstance(wo0, QuantLinear) and wo0.format == "Q8_0"
    if checkpoint == "keep":
        assert isinstance(wo1, QuantLinear) and wo1.format == "Q4_0"
    else:
        assert type(wo1) is Linear


def test_draft_model_quantized_with_the_main_method(quant_llamas, imatrix, write_spec) -> None:
    """--quant-method reaches a --draft model too; the main model's imatrix does not (it is
    another checkpoint's)."""
    from argparse import Namespace

    from inferflow.cli.common import draft_spec, with_quant

    main_spec = write_spec(spec_doc("llama", quant_llamas["untied"], "safetensors"), "m.yaml")
    draft = write_spec(spec_doc("llama", quant_llamas["tied"], "safetensors"), "d.yaml")
    args = Namespace(
        quant="Q4_B32", quant_method="minmax", imatrix=str(imatrix["untied"]), draft=str(draft)
    )
    spec = with_quant(load_spec(main_spec), args)
    got = draft_spec(args, spec)
    assert got is not None and got.quant.method == "minmax" and got.quant.imatrix is None
    assert spec.quant.imatrix == imatrix["untied"]
    assert draft_spec(Namespace(draft=None), spec) is None
