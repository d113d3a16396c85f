"""A checkpoint's own quantized weights (GGUF Q4_1, Q8_0 ...) stay in their blocks by default;
``--quant none`` / ``quant: {weights: none}`` runs everything in float."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from inferflow.blocks.linear import Embedding, Linear
from inferflow.engine.generate import new_cache, prefill
from inferflow.errors import CheckpointError, WeightBindingError
from inferflow.loaders import open_files
from inferflow.model import build
from inferflow.model import materialise as materialise_module
from inferflow.model.binding import plan_weights
from inferflow.model.materialise import _Loading, check_memory, materialise
from inferflow.model.names import NameMap
from inferflow.quant import quantize
from inferflow.quant.apply import stack_rows
from inferflow.quant.linear import QuantLinear, select_kernel
from inferflow.quant.tensor import QuantTensor
from inferflow.runtime import load
from inferflow.spec import load_spec
from inferflow.spec.types import MapEntry, TensorsSpec
from tests.conftest import needs_proc, random_blocks, rss, smollm2_path


def test_smollm2_keeps_gguf_blocks_and_agrees_with_float() -> None:
    smollm2_path()  # skips without the model package
    kept = load("smollm2-135m-instruct")
    ref = load("smollm2-135m-instruct", "float32", "none")
    quant = {p: m for p, m in kept.model.named_modules() if isinstance(m, QuantLinear)}
    # 30 layers x (wqkv, wo, w13, w2) in the file's Q4_1, plus the tied head over token_embd
    assert len(quant) == 30 * 4 + 1
    assert {m.format for p, m in quant.items() if p != "dec.output"} == {"Q4_1"}
    assert quant["dec.output"].format == "Q8_0"
    assert not any(isinstance(m, QuantLinear) for m in ref.model.modules())
    # the kept blocks are the file's blocks: each layer equals x @ dequantize(file tensor)^T,
    # in float32 on the C plane (the layers' only copy)
    src = open_files("gguf", [smollm2_path()])
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    w = src.get("blk.7.attn_output.weight").dequantize()
    want = x.double() @ w.double().t()
    got = quant["dec.7.self_attn.wo"](x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # the table: one copy, the tied head's plane; lookups give the file's Q8_0 values
    (table,) = [m for m in kept.model.modules() if isinstance(m, Embedding)]
    assert table.plane is quant["dec.output"].plane and table.blocks is None
    ids = torch.tensor([[0, 5, 49151], [17, 17, 300]])
    assert torch.equal(table(ids), src.get("token_embd.weight").dequantize()[ids])
    src.close()
    # whole model: float32 on the codec's values, so the float32 model's logits up to
    # summation order
    ids = kept.tokenizer.encode("The three primary colors are red, yellow and")
    a = prefill(kept.model, ids, new_cache(kept.model, 64))
    b = prefill(ref.model, ids, new_cache(ref.model, 64))
    assert (a - b).abs().max() < 1e-4 * b.abs().max()
    assert int(a.argmax()) == int(b.argmax())


def test_spec_quant_section_controls_keeping(write_spec) -> None:  # noqa: ANN001
    path = smollm2_path()
    base = load_spec("smollm2-135m-instruct").raw
    for quant, want in (
        ({"checkpoint": "dequantize"}, "dequantize"),
        ({"weights": "none"}, "dequantize"),
        ({}, "keep"),
    ):
        doc = {**base, "source": {"format": "gguf", "files": [str(path)]}, "quant": quant}
        assert load_spec(write_spec(doc)).quant.checkpoint == want


def _q(rows: int, fmt: str, seed: int) -> tuple[torch.Tensor, object]:
    w = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    return w, quantize(w, fmt)


def test_stack_rows_concatenates_one_format_only() -> None:
    (_, qa), (_, qb) = _q(16, "Q4_1", 1), _q(8, "Q4_1", 2)
    both = stack_rows({0: qa, 16: qb}, 24)  # type: ignore[dict-item]
    assert both is not None and both.shape == (24, 64)
    assert torch.equal(both.dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))  # type: ignore[attr-defined]
    _, q8 = _q(8, "Q8_0", 3)
    assert stack_rows({0: qa, 16: q8}, 24) is None  # type: ignore[dict-item]  mixed formats
    assert stack_rows({0: qa}, 24) is None  # type: ignore[dict-item]  rows missing


@pytest.mark.parametrize("narrow", ["Q4_0", "Q5_0"])
def test_stack_rows_widens_exactly_to_a_common_format(narrow: str) -> None:
    """A fused q/k/v stored as Q5_0 (or Q4_0) with a Q8_0 v becomes one Q8_0 tensor whose
    every value gguf-py's Q8_0 decoder reads as its own decoder reads the narrow blocks."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T

    qn = random_blocks(narrow, 16, 64)  # every code, random bits
    _, q8 = _q(8, "Q8_0", 3)
    both = stack_rows({0: qn, 16: q8}, 24)  # type: ignore[dict-item]
    assert both is not None and both.format == "Q8_0" and both.shape == (24, 64)
    got = gguf_quants.dequantize(both.data.numpy(), T.Q8_0).reshape(24, 64)
    want_n = gguf_quants.dequantize(qn.data.numpy(), T[narrow]).reshape(16, 64)
    want_8 = gguf_quants.dequantize(q8.data.numpy(), T.Q8_0).reshape(8, 64)  # type: ignore[attr-defined]
    assert (got[:16] == want_n).all() and (got[16:] == want_8).all()


class _DictSource:
    """A checkpoint held in a dict (the WeightSource calls materialise makes)."""

    metadata: dict[str, object] = {}

    def __init__(self, tensors: dict[str, torch.Tensor | QuantTensor]) -> None:
        self.tensors, self.reads = tensors, 0

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype_name(self, name: str) -> str:
        t = self.tensors[name]
        return t.format if isinstance(t, QuantTensor) else "F32"

    def get(self, name: str) -> torch.Tensor | QuantTensor:
        self.reads += 1
        return self.tensors[name]


def test_materialise_keeps_fast_formats_only_and_reads_the_rest(monkeypatch, caplog) -> None:  # noqa: ANN001
    """On a network built on the meta device: a Linear whose checkpoint weight is stored whole
    in a fast (C plane / int4pack) format becomes a QuantLinear over those very blocks; a slow
    format (IQ4_NL: no C plane) and a float weight are read into float parameters equal to the checkpoint's values;
    a quantized embedding keeps its blocks and looks up exactly the dequantized rows."""
    with build._meta_parameters():
        model = nn.Module()
        for name, inp in (("fast", 64), ("plain", 64), ("slow", 256)):
            model.add_module(name, Linear(inp, 24, bias=name == "fast"))
        model.add_module("table", Embedding(24, 64))
    assert all(p.is_meta for p in model.parameters())
    (_, a), (_, b) = _q(16, "Q4_1", 1), _q(8, "Q4_1", 2)
    q4 = QuantTensor(torch.cat([a.data, b.data]), "Q4_1", (24, 64))
    slow_q = random_blocks("IQ4_NL", 24, 256)  # (no writer here)
    assert slow_q.dequantize().abs().sum() > 0
    assert select_kernel(slow_q.qformat) == "dequant"  # (the premise: a format with no C plane)
    plain, bias = torch.randn(24, 64), torch.randn(24)
    src = {
        "fast.weight": q4,
        "fast.bias": bias,
        "plain.weight": plain,
        "slow.weight": slow_q,
        "table.weight": a,  # 16 rows: does not fit 24
    }
    names = NameMap(TensorsSpec(map=tuple(MapEntry(k, k) for k in src)))
    with pytest.raises(WeightBindingError, match=r"table.weight: shape \[16, 64\] does not fit"):
        plan_weights(model, _DictSource(src), names)  # (checked before anything is read)
    src["table.weight"] = q4
    source = _DictSource(src)
    plan = plan_weights(model, source, names)
    assert source.reads == 0  # planning reads names and shapes only
    monkeypatch.setattr(_Loading, "PROGRESS_S", 0.0)  # a progress line per parameter
    with caplog.at_level(logging.INFO, logger="inferflow.model.materialise"):
        assert materialise(model, source, plan, keep=True) == 1
    progress = [r.getMessage() for r in caplog.records if "loading weights" in r.getMessage()]
    assert progress[-1].startswith("loading weights: 100% (5 of 5 tensors)")
    assert isinstance(model.fast, QuantLinear) and model.fast.format == "Q4_1"
    x = torch.randn(3, 64)
    want = x.bfloat16().float() @ q4.dequantize().t() + bias
    assert (model.fast(x) - want).abs().max() <= 2**-6 * want.abs().max()
    assert type(model.plain) is Linear and torch.equal(model.plain.weight, plain)
    assert type(model.slow) is Linear and torch.equal(model.slow.weight, slow_q.dequantize())
    ids = torch.tensor([[5, 0], [23, 5]])
    blocks = model.table.blocks  # (the checkpoint's blocks)
    assert blocks is not None and torch.equal(blocks.data, q4.data.reshape(blocks.data.shape))
    assert not hasattr(model.table, "weight")
    assert torch.equal(model.table(ids), q4.dequantize()[ids])
    assert not any(p.is_meta for p in model.parameters())


def test_declared_sizes_that_cannot_fit_fail_before_allocating(monkeypatch) -> None:  # noqa: ANN001
    """From the plan alone (shapes and stored formats, nothing read or allocated): a float
    parameter counts its dtype's bytes, one stored in blocks a kernel reads its kernel's bytes;
    over the available memory, the error names the largest tensors."""
    with build._meta_parameters():
        model = nn.Module()
        model.add_module("big", Linear(64, 4096))
        model.add_module("small", Linear(64, 32))
    q = quantize(torch.randn(32, 64), "Q4_1")
    src = _DictSource({"big.weight": torch.randn(4096, 64), "small.weight": q})
    names = NameMap(
        TensorsSpec(
            map=(MapEntry("big.weight", "big.weight"), MapEntry("small.weight", "small.weight"))
        )
    )
    plan = plan_weights(model, src, names)
    # float32; Q4_1 as its plane: 4-bit codes, a float32 scale and min per 32 weights
    need = 4096 * 64 * 4 + 32 * 64 // 2 + 8 * 32 * 64 // 32
    check_memory(model, src, plan, need)  # fits exactly
    with pytest.raises(CheckpointError, match=r"the largest tensors: big.weight \[4096, 64\]"):
        check_memory(model, src, plan, need - 1)
    assert src.reads == 0 and all(p.is_meta for p in model.parameters())
    # load_model asks the system: a real model refused the same way, before any weight is read
    smollm2_path()  # (skips without the model package)
    monkeypatch.setattr(materialise_module, "available_memory", lambda: 64 << 20)
    with pytest.raises(CheckpointError, match="needs about 0.[0-9] GiB and 0.1 GiB"):
        load("smollm2-135m-instruct")


@needs_proc
def test_a_kept_table_from_a_gguf_is_resident_only_where_read(tmp_path: Path) -> None:
    """A quantized embedding table kept from a GGUF stays a view of the file's mapping: after
    loading, its pages are not resident (the file's 34 MiB table adds little), and lookups
    return gguf-py's values of the rows asked for."""
    gguf = pytest.importorskip("gguf")
    from gguf.constants import GGMLQuantizationType as GT

    from inferflow.loaders.gguf import GGUFSource
    from inferflow.model.materialise import trim_heap

    rows, dim = 8192, 4096
    rng = np.random.default_rng(0)
    blocks = rng.integers(-127, 128, (rows * dim // 32, 34), dtype=np.int8).view(np.uint8)
    blocks[:, :2] = np.full((1, 1), 0.01, np.float16).view(np.uint8)  # d
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_tensor("table.weight", blocks.reshape(rows, -1), raw_dtype=GT.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with build._meta_parameters():
        model = nn.Module()
        model.add_module("table", Embedding(rows, dim))
    source = GGUFSource(tmp_path / "t.gguf")
    names = NameMap(TensorsSpec(map=(MapEntry("table.weight", "table.weight"),)))
    trim_heap()
    before = rss()
    materialise(model, source, plan_weights(model, source, names), keep=True)
    trim_heap()
    assert rss() - before < (8 << 20)  # (a copy: + 34 MiB)
    ids = torch.tensor([3, rows - 1, 3])
    ref = gguf.quants.dequantize(blocks.reshape(rows, -1), GT.Q8_0)[ids.numpy()]
    assert np.array_equal(model.table(ids).numpy(), ref)
