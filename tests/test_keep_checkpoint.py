"""A checkpoint's own quantized weights (GGUF Q4_1, Q8_0 ...) stay in their blocks by default;
``--quant none`` / ``quant: {weights: none}`` runs everything in float."""

from __future__ import annotations

import torch
from torch import nn

from inferflow.blocks.linear import Linear
from inferflow.engine.generate import new_cache, prefill
from inferflow.loaders import open_files
from inferflow.quant import quantize
from inferflow.quant.apply import _stack_rows, keep_checkpoint
from inferflow.quant.linear import QuantLinear
from inferflow.quant.tensor import QuantTensor
from inferflow.runtime import load
from inferflow.spec import load_spec
from tests.conftest import smollm2_path


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
    # the kept blocks are the file's blocks: each layer equals x @ dequantize(file tensor)^T
    src = open_files("gguf", [smollm2_path()])
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    w = src.get("blk.7.attn_output.weight").dequantize()
    want = x.bfloat16().float() @ w.t()
    got = quant["dec.7.self_attn.wo"](x)
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()
    src.close()
    # whole model: bf16 activations in the int4pack kernels, so close, not equal, to float32
    ids = kept.tokenizer.encode("The three primary colors are red, yellow and")
    a = prefill(kept.model, ids, new_cache(kept.model, 64))
    b = prefill(ref.model, ids, new_cache(ref.model, 64))
    assert (a - b).abs().max() < 0.05 * b.abs().max()
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
    both = _stack_rows({0: qa, 16: qb}, 24)  # type: ignore[dict-item]
    assert both is not None and both.shape == (24, 64)
    assert torch.equal(both.dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))  # type: ignore[attr-defined]
    _, q8 = _q(8, "Q8_0", 3)
    assert _stack_rows({0: qa, 16: q8}, 24) is None  # type: ignore[dict-item]  mixed formats
    assert _stack_rows({0: qa}, 24) is None  # type: ignore[dict-item]  rows missing


def test_keep_checkpoint_skips_slow_formats_and_mixed_shards() -> None:
    model = nn.Module()
    for name, inp in (("fast", 64), ("mixed", 64), ("slow", 256)):
        model.add_module(name, Linear(inp, 24))
    (_, a), (_, b), (_, c) = _q(16, "Q4_1", 1), _q(8, "Q4_1", 2), _q(8, "Q8_0", 3)
    # Q6_K (16-weight groups) has no int4pack view: dequantize-per-call would be slower than float
    q6 = QuantTensor(torch.zeros(24 * 210, dtype=torch.uint8), "Q6_K", (24, 256))
    quantized = {
        "fast.weight": {0: a, 16: b},
        "mixed.weight": {0: a, 16: c},
        "slow.weight": {0: q6},
    }
    report = keep_checkpoint(model, quantized)  # type: ignore[arg-type]
    assert isinstance(model.fast, QuantLinear) and model.fast.format == "Q4_1"
    assert isinstance(model.mixed, Linear) and isinstance(model.slow, Linear)
    assert [r.path for r in report.layers] == ["fast"]
