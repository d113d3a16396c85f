"""QuantLinear kernels against ``F.linear(x, W.dequantize())`` and quantize_model on a tiny model.

Tolerances come from the rounding each path does, written next to each check (u = 2**-8, the
unit roundoff of bf16's 8-bit significand):

- ``dequant``: float32 GEMM of the exact dequantized weight; only the output cast rounds (bf16
  x: u relative) plus float32 accumulation-order noise.
- ``plane``: float32 on the exact codes (as ``dequant``); only with AVX512-BF16, calls of more
  rows on 4-bit codes round x to bf16 for the codes' products (u of |x| times |code * scale|;
  exact for bf16 x), scales, mins and the min term's sums of x float32.
- ``int4pack``: activations are cast to bf16 (u of |x|), the kernel holds each group's scale
  and zero in bf16 (u each, of at most the block's max |w| after pack_int4 centres them),
  may round the dequantized weight to bf16 (u of |w|), and rounds the output to bf16 (u of
  |y| <= sum |x||w|). With A = per-block max |w| >= |w|, the sum is
  ``|y - ref| <= 5u * (|x| @ A^T)``; measured worst cases are ~0.11u * (|x| @ A^T) (every
  format, N <= 64), 45x inside it, as independent roundings mostly cancel.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from inferflow.blocks.linear import Linear
from inferflow.errors import InferflowError, QuantError
from inferflow.kernels import quant_decode
from inferflow.model.batch import ContiguousKVCache, FlatBatch
from inferflow.model.build import load_model
from inferflow.quant import get_format, quantize
from inferflow.quant.apply import QuantPolicy, quantize_model
from inferflow.quant.linear import (
    AFFINE_VIEWS,
    QuantLinear,
    affine_parts,
    dequant_kernel,
    select_kernel,
)
from inferflow.quant.tensor import QuantTensor
from inferflow.spec import load_spec
from tests.conftest import (
    AFFINE_WRITABLE,
    RANDOM_BLOCKS,
    dequantized_copy,
    load_quant_llama,
    random_blocks,
    spec_doc,
)

SHAPES = [(192, 576), (576, 1536), (200, 576)]  # (out, in); 200 % 16 != 0 exercises row padding
BATCH = [1, 7, 64]
EPS_BF16 = 2.0**-8  # u, the unit roundoff of bf16 (8-bit significand)


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a per-row offset makes blocks with min far from 0, where a badly placed zero would show
    return torch.randn(out, inp, generator=g) * 0.05 + torch.randn(out, 1, generator=g) * 0.05


def _block_max(qt: QuantTensor) -> torch.Tensor:
    """A: each weight replaced by its block's max |w| (>= |w|), shape (out, in)."""
    w = qt.dequantize().abs()
    b = qt.qformat.block_size
    return w.reshape(w.shape[0], -1, b).amax(-1, keepdim=True).expand(-1, -1, b).reshape(w.shape)


def _check(ql: QuantLinear, qt: QuantTensor, x: torch.Tensor) -> None:
    y = ql(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], qt.shape[0])
    xf = x.float().reshape(-1, qt.shape[1])
    ref = xf @ qt.dequantize().t()
    err = (y.float().reshape(ref.shape) - ref).abs()
    if ql.kernel_name == "int4pack":
        bound = 5 * EPS_BF16 * (xf.abs() @ _block_max(qt).t())  # derivation in the docstring
    else:
        # output cast (bf16 only) + float32 accumulation noise (K * 2**-24, K <= 1536 here)
        rel = EPS_BF16 if x.dtype == torch.bfloat16 else 0.0
        bound = (rel + 1e-4) * (xf.abs() @ qt.dequantize().abs().t())
        assert ql.plane is not None or ql.kernel_name == "dequant"
    worst = (err - bound).max().item()
    assert worst <= 1e-6, f"{qt.format} {ql.kernel_name} {x.dtype}: exceeds bound by {worst:.2e}"


@pytest.fixture(scope="module")
def layers() -> dict[tuple[str, tuple[int, int], str | None], tuple[QuantLinear, QuantTensor]]:
    """Each format and shape with the auto kernel (None) and with int4pack forced (which auto
    no longer picks where the planes take every call)."""
    out = {}
    for name in AFFINE_WRITABLE:
        for shape in SHAPES:
            qt = quantize(_weight(*shape), name)
            for kernel in (None, "int4pack"):
                out[name, shape, kernel] = (QuantLinear(qt, kernel=kernel), qt)
    return out


@pytest.mark.parametrize("kernel", [None, "int4pack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", AFFINE_WRITABLE)
def test_kernel_matches_dequantize(
    name: str, dtype: torch.dtype, kernel: str | None, layers
) -> None:
    g = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        ql, qt = layers[name, shape, kernel]
        for n in BATCH:
            _check(ql, qt, torch.randn(n, shape[1], generator=g).to(dtype))


def _fast_kernel() -> str:
    """The C plane takes every call where the C kernels build; else torch's int4 kernel."""
    return "plane" if quant_decode.library() is not None else "int4pack"


@pytest.mark.parametrize("name", AFFINE_WRITABLE)
def test_affine_formats_use_a_fast_kernel(name: str, layers) -> None:
    # the point of the layer: every writable affine format gets a kernel on its codes
    assert layers[name, SHAPES[0], None][0].kernel_name == _fast_kernel()


@pytest.mark.parametrize("name", list(RANDOM_BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_only_formats(name: str, dtype: torch.dtype) -> None:
    """k-quants and IQ4_NL from random blocks: Q4_K/Q5_K (32-weight groups) take the affine
    kernels (and int4pack when forced), Q2_K, Q3_K and Q6_K (16-weight groups) the C plane
    alone, the non-affine ones dequant."""
    qt = random_blocks(name, 192, 512)
    affine = name in ("Q4_K", "Q5_K")
    plane = affine or (name in ("Q2_K", "Q3_K", "Q6_K") and quant_decode.library() is not None)
    assert select_kernel(get_format(name)) == (_fast_kernel() if plane else "dequant")
    ql = QuantLinear(qt)
    assert ql.kernel_name == (_fast_kernel() if plane else "dequant")
    _check(ql, qt, torch.randn(7, 512).to(dtype))
    if affine:
        _check(QuantLinear(qt, kernel="int4pack"), qt, torch.randn(7, 512).to(dtype))
    else:
        with pytest.raises(QuantError, match=f"{name} cannot use the int4pack kernel"):
            QuantLinear(qt, kernel="int4pack")


@pytest.mark.parametrize("name", [*AFFINE_WRITABLE, "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_affine_views_are_exact(name: str) -> None:
    # codes * scale + min must be the codec's float32 output to the bit, for every block
    qt = random_blocks(name, 64, 256) if name in RANDOM_BLOCKS else quantize(_weight(64, 256), name)
    codes, scale, mn = affine_parts(qt)
    view = AFFINE_VIEWS.get(name)
    assert int(codes.max()) < view.levels
    w = codes.float().reshape(64, -1, view.group) * scale[..., None] + mn[..., None]
    assert torch.equal(w.reshape(64, 256), qt.dequantize())


def test_torch_int4pack_convention() -> None:
    """torch's CPU int4pack dequantizes (code - 8) * scale + zero, zero a float offset (not a
    zero-point code): pack_int4's mapping rests on this."""
    n, k, group = 32, 128, 32
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    sz = torch.stack([torch.rand(k // group, n, generator=g), torch.randn(k // group, n)], -1)
    sz = sz.to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    s, z = (sz[..., i].float().t().repeat_interleave(group, dim=1) for i in (0, 1))
    w = (codes.float() - 8) * s + z  # (n, k)
    x = torch.randn(4, k, generator=g).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz).float()
    ref = x.float() @ w.t()
    # bf16 weight and output rounding only: 2u of sum |x||w|
    assert ((y - ref).abs() <= 2 * EPS_BF16 * (x.float().abs() @ w.abs().t()) + 1e-6).all()


def test_dequant_kernel_tiles_and_bias() -> None:
    qt = quantize(_weight(200, 256), "Q4_1")
    x = torch.randn(5, 3, 256)
    ref = x @ qt.dequantize().t()
    tiled = dequant_kernel(qt, tile_bytes=37 * 256 * 4)(x.reshape(-1, 256))  # 6 uneven tiles
    torch.testing.assert_close(tiled.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    b = torch.randn(200)
    ql = QuantLinear(qt, b, kernel="dequant")
    torch.testing.assert_close(ql(x), F.linear(x, qt.dequantize(), b), rtol=1e-5, atol=1e-5)
    assert ql.nbytes == qt.data.nbytes  # the dequant kernel keeps the raw blocks only
    with pytest.raises(QuantError, match="unknown QuantLinear kernel 'fast'"):
        QuantLinear(qt, kernel="fast")


# --- quantize_model on a tiny transformers llama ------------------------------------------------


def _logits(model, dtype: torch.dtype) -> torch.Tensor:
    h = model.spec.hparams
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(4))
    cache = ContiguousKVCache(h.n_layers, h.n_kv_heads, h.head_dim, 64, dtype)
    batch = FlatBatch.single(ids, 0, cache)
    batch.logits_rows = torch.arange(ids.numel())
    with torch.no_grad():
        return model(batch).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_matches_dequantized_model(dtype, quant_llamas, write_spec) -> None:
    model = load_quant_llama(quant_llamas["untied"], write_spec, dtype)
    policy = QuantPolicy(
        default="Q4_B32",
        overrides=[("dec.*.feed_forward.*", "Q3H"), ("dec.output", "Q8"), ("dec.1.*.wo", None)],
    )
    float_logits = _logits(model, dtype)
    ref = _logits(dequantized_copy(model, policy), dtype)
    report = quantize_model(model, policy)
    ours = _logits(model, dtype)
    scale = ref.abs().max()
    kernel_err = (ours - ref).abs().max() / scale
    quant_err = (float_logits - ref).abs().max() / scale
    # bf16-level error compounded over 2 layers and the head: a few 2**-8; the kernel's error must
    # also be well under what quantization itself changes (else we would test the wrong thing)
    assert kernel_err <= 8 * 2.0**-8, f"kernel error {kernel_err:.2e}"
    assert kernel_err <= quant_err / 4, f"kernel {kernel_err:.2e} vs quant {quant_err:.2e}"

    by_path = {r.path: r for r in report.layers}
    assert by_path["dec.0.feed_forward.w13"].format == "Q3H"
    assert by_path["dec.0.self_attn.wqkv"].format == "Q4_B32"
    assert by_path["dec.output"].format == "Q8"
    assert by_path["dec.1.self_attn.wo"].format is None
    assert isinstance(model.dec.get_submodule("1.self_attn.wo"), Linear)
    assert all(r.kernel in ("int4pack", "plane") for r in report.layers if r.format)
    # the C planes of int4pack layers (one-row calls) are a second copy (tests/test_fused.py);
    # without them the quantized layers take less than half the float bytes
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    planes = sum(m.plane.nbytes for m in qls if m.kernel_name == "int4pack" and m.plane)
    assert report.bytes_after - planes < report.bytes_before / 2
    assert "total" in report.table()


def test_tied_head_gets_quantized_copy(quant_llamas, write_spec) -> None:
    model = load_quant_llama(quant_llamas["tied"], write_spec, output={"tied": True})
    assert model.dec.output is None
    before = _logits(model, torch.float32)
    plain = quantize_model(copy.deepcopy(model), QuantPolicy(default="Q8_0"))
    assert "dec.output" not in {r.path for r in plain.layers}  # tied heads stay float by default
    policy = QuantPolicy(
        overrides=[("dec.output", "Q8_0")], tie_outputs=[("dec.output", "dec.tok_embed")]
    )
    report = quantize_model(model, policy)
    assert isinstance(model.dec.output, QuantLinear)
    assert model.dec.tok_embed.weight.dtype == torch.float32  # lookups stay float
    (row,) = report.layers[-1:]
    assert (row.path, row.format, row.bytes_before) == ("dec.output", "Q8_0", 0)
    after = _logits(model, torch.float32)
    # Q8_0 weights (2**-8 of each block's max), x rounded to bf16 in the head: small, nonzero
    assert 0 < (after - before).abs().max() / before.abs().max() < 2e-2


def test_policy_errors(quant_llamas, write_spec) -> None:
    with pytest.raises(InferflowError, match=r"unknown quant format 'Q4'; known: .*Q4_B32"):
        QuantPolicy(default="Q4")
    with pytest.raises(InferflowError, match="unknown quant format 'Q9'"):
        QuantPolicy(overrides=[("dec.output", "Q9")])
    model = load_quant_llama(quant_llamas["untied"], write_spec)
    # Q6_K's 256-weight blocks do not divide in_features 128 / 192: named, not padded
    with pytest.raises(QuantError, match=r"dec\.0\.self_attn\.wqkv\.weight of shape \[256, 128\]"):
        quantize_model(model, QuantPolicy(default="Q4_K"))
    p = QuantPolicy(default="Q8", overrides=[("dec.*", "Q2"), ("dec.output", None)])
    assert [p.format_for(s) for s in ("x", "dec.0.wq", "dec.output")] == ["Q8", "Q2", None]


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q3H", "Q4_B64"])
def test_dense_batch_copy(name: str) -> None:
    """``attach_dense(rows)``: calls below ``rows`` rows are int4pack's, bit for bit; from
    ``rows`` on a bf16 GEMM with int4pack's own effective weights, each rounded once more to bf16
    (u of |w| <= A), so within 6u * (|x| @ A^T) of the exact product (one rounding
    more than int4pack's bound in the module docstring); 8-bit codes (two nibble planes) too."""
    qt = quantize(_weight(200, 576, seed=3), name)  # 200 rows: int4pack pads them to 208
    plain, ql = QuantLinear(qt, kernel="int4pack"), QuantLinear(qt, kernel="int4pack")
    before = ql.nbytes
    ql.attach_dense(16)
    assert ql.dense_rows == 16 and ql.nbytes == before + 200 * 576 * 2
    assert "dense_rows=16" in repr(ql)
    g = torch.Generator().manual_seed(4)
    small = torch.randn(15, 576, generator=g)
    assert torch.equal(ql(small), plain(small))
    for n in (16, 64):
        x = torch.randn(n, 576, generator=g)
        y = ql(x)
        ref = x @ qt.dequantize().t()
        bound = 6 * EPS_BF16 * (x.abs() @ _block_max(qt).t())
        assert ((y - ref).abs() - bound).max().item() <= 1e-6
        # and it is the same product as int4pack's, up to the extra weight rounding
        assert ((y - plain(x)).abs() - 2 * EPS_BF16 * (x.abs() @ _block_max(qt).t())).max() <= 1e-6
    ql.attach_dense(8)  # a second call changes nothing
    assert ql.dense_rows == 16
    with pytest.raises(QuantError, match="at least 1 row"):
        QuantLinear(qt, kernel="int4pack").attach_dense(0)
    dq, auto = QuantLinear(qt, kernel="dequant"), QuantLinear(qt)
    dq.attach_dense(16)  # only int4pack layers get a copy (the plane is as fast without one)
    auto.attach_dense(16)
    assert dq.dense_rows is None
    assert auto.dense_rows == (16 if auto.kernel_name == "int4pack" else None)


def test_dense_batch_from_the_spec(quant_llamas, write_spec) -> None:
    """``quant: {dense_batch: N}`` gives every int4pack layer its copy; logits of a prefill (rows
    >= N) stay within bf16 rounding of the model without it; bad values are spec errors."""

    def spec(**quant: object) -> Path:
        quant = {"weights": "Q4_B32", "kernel": "int4pack", **quant}
        doc = {**spec_doc("llama", quant_llamas["untied"], "safetensors"), "quant": quant}
        return write_spec(doc, f"spec{len(quant)}{quant.get('dense_batch')}.yaml")

    a, b = load_model(load_spec(spec())), load_model(load_spec(spec(dense_batch=4)))
    qls = [m for m in b.modules() if isinstance(m, QuantLinear)]
    assert qls and all(m.dense_rows == 4 for m in qls)
    la, lb = _logits(a, torch.float32), _logits(b, torch.float32)
    assert (la - lb).abs().max() / la.abs().max() < 2e-2
    assert not torch.equal(la, lb)  # the prefill really took the dense path
    for bad in (0, "x"):
        with pytest.raises(InferflowError, match="dense_batch"):
            load_spec(spec(dense_batch=bad))


def test_serve_dense_batch_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """``inferflow serve --dense-batch 0`` fails before loading or opening a port."""
    from inferflow.cli.main import main
    from tests.conftest import smollm2_path

    smollm2_path()  # (the built-in spec names the model package's file)
    assert main(["serve", "smollm2-135m-instruct", "--dense-batch", "0"]) == 2
    assert "--dense-batch: must be >= 1, got 0" in capsys.readouterr().err


def test_row_parts_in_two_formats_are_two_planes() -> None:
    """A fused q/k/v whose rows a Q4_K_M file stores as Q4_K and Q6_K (no exact widening joins
    them) is one layer of two C planes, each run's rows as its own layer holds them: products
    against gguf-py's decoding of each part, its bias added, rows read back exactly, a row's
    result the same in any company, with 8-bit inputs too the bits of each part's own layer;
    no more bytes than the two layers. (One plane of both, the Q4_K rows widened to 6-bit
    codes in groups of 16, held ~40% more bytes for them; a float32 copy before that.)"""
    gguf = pytest.importorskip("gguf")
    if quant_decode.library() is None:
        pytest.skip("no C compiler here: the plane cannot be built")
    a, b = random_blocks("Q4_K", 48, 512), random_blocks("Q6_K", 24, 512)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(1))
    ql = QuantLinear.from_row_parts([a, b], bias)
    assert ql is not None and ql.kernel_name == "plane" and ql.format == "Q4_K+Q6_K"
    assert ql.plane is not None and ql.tail is not None and ql.tail.plane is not None
    alone = [QuantLinear(t) for t in (a, b)]
    assert sum(m.nbytes for m in ql.modules()) == sum(one.nbytes for one in alone)
    w = _gguf_rows(gguf, [a, b])
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ w.T + bias.double()
    assert float((ql(x).double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert torch.equal(ql.plane.rows(torch.tensor([0, 47])), w.float()[[0, 47]])
    assert torch.equal(ql.tail.plane.rows(torch.tensor([0, 23])), w.float()[[48, 71]])
    assert torch.equal(ql(x[[2, 5]]), ql(x)[[2, 5]])
    assert QuantLinear.from_row_parts([a, quantize(torch.randn(24, 512), "F16")]) is None
    for one in (ql, *alone):
        one.set_act8(True)
    assert torch.equal(ql(x), torch.cat([one(x) for one in alone], dim=1) + bias)
    if quant_decode.tiles16_built() and quant_decode.half_built():  # (super-block rounding)
        from tests.test_act8 import _rounded  # (x as the super-block rounding makes it, numpy)

        want = _rounded(x, 256) @ w.T + bias.double()
        assert float((ql(x).double() - want).abs().max() / want.abs().max()) < 2e-6


def test_row_parts_in_more_runs_share_one_plane() -> None:
    """Three runs of formats (Q4_K, Q6_K, Q4_K rows) are one C plane of the parts' own values,
    the groups brought to the smallest group size by repeating their scale and min and the
    codes at the widest part's bits: products against gguf-py's decoding, a row's result the
    same in any company."""
    gguf = pytest.importorskip("gguf")
    if quant_decode.library() is None:
        pytest.skip("no C compiler here: the plane cannot be built")
    parts = [random_blocks("Q4_K", 32, 512), random_blocks("Q6_K", 16, 512)]
    parts.append(random_blocks("Q4_K", 16, 512))
    ql = QuantLinear.from_row_parts(parts)
    assert ql is not None and ql.plane is not None and ql.tail is None and ql.plane.bits == 6
    w = _gguf_rows(gguf, parts)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ w.T
    assert float((ql(x).double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert torch.equal(ql.plane.rows(torch.tensor([0, 40, 63])), w.float()[[0, 40, 63]])
    assert torch.equal(ql(x[[1, 3]]), ql(x)[[1, 3]])


def _gguf_rows(gguf, parts: list[QuantTensor]) -> torch.Tensor:  # noqa: ANN001
    """The parts' rows as gguf-py decodes them, float64."""
    return torch.cat(
        [
            torch.from_numpy(
                gguf.quants.dequantize(t.data.numpy(), getattr(gguf.GGMLQuantizationType, t.format))
            )
            .reshape(t.shape)
            .double()
            for t in parts
        ]
    )
