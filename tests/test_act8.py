"""``--dtype act8``: float32, with the inputs of quantized products rounded to 8 bits per 32
values and multiplied by integer dot products (quant_decode.c's q8 path: every plane on AVX-512
VNNI and on portable builds), as llama.cpp's CPU kernels do. Checked against gguf-py's decoding of the weights, for batch invariance, and for
its quality cost on a real model against the float32 run."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from inferflow.engine.sampling import SamplingParams
from inferflow.kernels import quant_decode
from inferflow.quant import quantize
from inferflow.quant.linear import QuantLinear
from inferflow.runtime import load
from tests.conftest import random_blocks, smollm2_path
from tests.test_batch_invariance import PROMPTS, _check

gguf = pytest.importorskip("gguf")

# every GGML block type with an affine view (k-quants from random blocks: no writer here)
GGML = {name: getattr(gguf.GGMLQuantizationType, name) for name in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}  # fmt: skip


@pytest.fixture(
    params=[[], ["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2"]],
    ids=["native", "portable", "no-avx2"],
)
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory):  # noqa: ANN001, ANN201
    """The kernels as this machine builds them (AVX-512 VNNI here), as a CPU without AVX-512
    does (GCC vector types, AVX2's 16-bit pair sums) and one without AVX2 (plain integer sums):
    the integer sums are the same, exact. One cache for the
    session (its builds are keyed by the flags): each build compiles once, not per test."""
    from inferflow import kernels
    from tests.test_fused import _reset

    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, *request.param])
    _reset()
    yield request.param
    monkeypatch.undo()
    _reset()


def _x_per(fmt: str, flags: list[str]) -> int:
    """Columns of x sharing one 8-bit scale: a k-quant's super-block of 256 weights where the
    build walks AVX-512 VNNI tiles (its sub-scales are then integers inside the super-block:
    llama.cpp's Q8_K for the same types), else 32 (Q8_0 / Q8_1's blocks)."""
    from inferflow.kernel_build import _cpu_key

    vnni = not flags and "avx512_vnni" in _cpu_key().split()
    return 256 if fmt.endswith("_K") and vnni else 32


def _layer(fmt: str, n: int, k: int, seed: int) -> tuple[QuantLinear, torch.Tensor]:
    """A QuantLinear on its C plane, and its weights as gguf-py decodes the blocks (Inferflow's
    own formats: as their codec does)."""
    if quant_decode.library() is None:
        pytest.skip("no C compiler here: the plane kernel cannot be built")
    if fmt.endswith("_K"):
        qt = random_blocks(fmt, n, k)
    else:
        qt = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, fmt)
    layer = QuantLinear(qt, None)
    assert layer.plane is not None
    if fmt not in GGML:
        return layer, qt.dequantize().double()
    blocks = qt.data.numpy().reshape(n, -1)
    ref = gguf.quants.dequantize(blocks, GGML[fmt]).reshape(n, k)
    return layer, torch.from_numpy(np.ascontiguousarray(ref)).double()


def _width(fmt: str) -> int:
    """Rows of W as wide as a format allows and not a multiple of 256 where it can be (k-quants'
    super-blocks are 256 weights)."""
    return 768 if fmt.endswith("_K") else 480


@pytest.mark.parametrize("fmt", list(GGML))
def test_inputs_on_the_8_bit_grid_give_the_exact_product(fmt: str, build) -> None:  # noqa: ANN001
    """x whose every 32 values (256 where x_per says so) are integers times a power of two, one
    of them +-127: the rounding keeps x exactly, so the integer dot products must give W x as
    gguf-py's weights say (a code paired with the wrong column, or a wrong scale, would not)."""
    k = _width(fmt)
    layer, w = _layer(fmt, 71, k, 0)  # (4 full tiles of 16 rows and 7 rows)
    per = _x_per(fmt, build)
    assert layer.plane.x_per() == per  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(1)
    xi = torch.randint(-127, 128, (6, k // per, per), generator=g)
    xi[:, :, 5] = 127 * (1 - 2 * (torch.arange(k // per) % 2))  # amax 127 in every block
    x = (xi * 2.0 ** torch.randint(-9, -3, (6, k // per, 1), generator=g)).reshape(6, k)
    want = x.double() @ w.T
    for act8 in (False, True):
        layer.act8 = act8
        got = layer.plane.matmul_f32(x.float(), q8=act8).double()  # type: ignore[union-attr]
        assert float((got - want).abs().max() / want.abs().max()) < 2e-6, act8


@pytest.mark.parametrize("fmt", list(GGML))
def test_general_inputs_within_the_rounding_of_x(fmt: str, build) -> None:  # noqa: ANN001
    """Any x: the product moves from W x by at most what rounding x to 8 bits per 32 (or
    x_per) values can move it (half a step per value, times |w|), and rows alone equal rows
    together."""
    k = _width(fmt)
    layer, w = _layer(fmt, 63, k, 2)
    if not layer.plane.has_q8():  # type: ignore[union-attr]
        pytest.skip(f"this build has no integer path for {fmt} (AVX-512 without VNNI)")
    per = _x_per(fmt, build)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    x[1] *= 1e-4
    x[2, :64] = 0.0
    got = layer.plane.matmul_f32(x, q8=True).double()  # type: ignore[union-attr]
    half_step = x.reshape(5, -1, per).abs().amax(-1, keepdim=True) / 127 / 2
    bound = (half_step.expand(-1, -1, per).reshape(5, k).double() @ w.abs().T) * 1.01 + 1e-7
    err = (got - x.double() @ w.T).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 1e-4  # (the inputs were rounded: not the float32 product)
    alone = torch.cat([layer.plane.matmul_f32(x[i : i + 1], q8=True) for i in range(5)])  # type: ignore[union-attr]
    assert torch.equal(alone.double(), got)


def _rounded(x: torch.Tensor, per: int = 32) -> torch.Tensor:
    """x as the q8 path rounds it: per 32 (or ``per``) values, dx = max|x| / 127 and x ~= dx *
    rint(x / dx) (nearest even), each step one IEEE float32 operation as quant_decode.c's
    quantize_row_q8 does: numpy's float32 division is correctly rounded (torch's vectorized
    one may be an ulp off, which moves a tie such as 60.5). In blocks of more than 32, a chunk
    of 32 whose max is at most 1/2, 1/4 or 1/8 of its block's takes a step of dx / 2, 4 or 8."""
    c = x.numpy().astype(np.float32).reshape(x.shape[0], -1, per // 32, 32)
    amax = np.abs(c).max((-2, -1), keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    e = np.zeros_like(amax[..., :1].repeat(per // 32, -2))
    if per > 32:  # (2^e: the largest of 1, 2, 4, 8 with the chunk's max * 2^e <= the block's)
        chunk = np.abs(c).max(-1, keepdims=True)
        e = sum((chunk * 2.0**i <= amax).astype(np.float32) for i in (1, 2, 3))
    q = np.clip(np.rint(c * (inv * np.float32(2) ** e)), -127, 127)
    step = (amax / np.float32(127)).astype(np.float64) / 2.0**e
    return torch.from_numpy((q.astype(np.float64) * step).reshape(x.shape))


@pytest.mark.parametrize("fmt", list(GGML))
def test_the_product_is_that_of_the_rounded_row(fmt: str, build) -> None:  # noqa: ANN001
    """Any x: the q8 product is W times x rounded to 8 bits (to float32 accuracy), the mins'
    term included: it takes the rounded row's group sums, as llama.cpp's Q8_1 sums do. With
    x's own float sums there, the error would be the codes' offset (8 for Q4_0) times x's
    rounding instead of the weights' size times it. Chunks of 32 at scales from 1 to 1e-3, so
    that in super-blocks every shift is taken (chunks at most 1/2, 1/4, 1/8 of their block's max)."""
    k = _width(fmt)
    layer, w = _layer(fmt, 65, k, 4)
    if not layer.plane.has_q8():  # type: ignore[union-attr]
        pytest.skip(f"this build has no integer path for {fmt} (AVX-512 without VNNI)")
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)) + 0.5
    scales = torch.tensor([1.0, 0.6, 0.4, 0.26, 0.2, 0.1, 0.03, 1e-3])
    x = (x.reshape(5, -1, 32) * scales[torch.arange(k // 32) % 8, None]).reshape(5, k)
    got = layer.plane.matmul_f32(x, q8=True).double()  # type: ignore[union-attr]
    rounded = _rounded(x, _x_per(fmt, build))
    want, size = rounded @ w.T, rounded.abs() @ w.abs().T  # (float32 sums err with the terms)
    assert float(((got - want).abs() / size.max()).max()) < 2e-6
    for rows in ([3], [4, 0], [1, 2, 3]):  # a row's result whatever else is in the call
        assert torch.equal(layer.plane.matmul_f32(x[rows], q8=True).double(), got[rows])  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def smollm2_act8():  # noqa: ANN201
    smollm2_path()  # skips when the model package is missing
    lm = load("smollm2-135m-instruct", "act8")
    if not lm.model.dec.layers()[0].self_attn.wqkv.plane.has_q8():
        pytest.skip("this build has no integer path for 4-bit tiles (AVX-512 without VNNI)")
    assert lm.model.dec.fused_decode() is not None  # decode rows through the C decode's q8 path
    return lm


def test_act8_requests_together_equal_alone_bit_for_bit(smollm2_act8) -> None:  # noqa: ANN001
    """Each row's 8-bit rounding is its own: 16 concurrent greedy requests give the tokens and
    log-probabilities each gives alone."""
    _check(smollm2_act8, PROMPTS, lambda i: SamplingParams(max_new_tokens=16, ignore_eos=True,
                                                            logprobs=2))  # fmt: skip


def test_act8_costs_little_against_float32(smollm2_act8) -> None:  # noqa: ANN001
    """Teacher-forced next-token distributions over a text, through the modules (prompt rows)
    and token by token through the C decode (decode rows): close to the float32 run's (mean KL
    measured 0.0022 and 0.0027; Hamlet's perplexity 42.69 float32, 42.74 act8, llama.cpp's on
    the same file 42.93), yet not equal (the products did take 8-bit inputs)."""
    from tests.conftest import all_logits
    from tests.test_fused import _token_by_token

    f32 = load("smollm2-135m-instruct")
    ids = f32._tok().encode(" ".join(PROMPTS))[:64]
    want = torch.log_softmax(all_logits(f32.model, torch.tensor(ids)).double(), -1)
    modules = all_logits(smollm2_act8.model, torch.tensor(ids))
    decoded = _token_by_token(smollm2_act8.model, ids)  # (one-token steps: the C decode)
    for got in (modules, decoded):
        b = torch.log_softmax(got.double(), -1)
        kl = float((want.exp() * (want - b)).sum(-1).mean())
        assert 1e-5 < kl < 0.05, kl
        assert float((want.argmax(-1) == b.argmax(-1)).double().mean()) > 0.8


@pytest.mark.parametrize("flags", [[], ["-mno-avx512f"], ["-mno-avx512vnni"]])
def test_which_planes_take_8_bit_inputs(
    flags: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,  # noqa: ANN001
) -> None:
    """Every plane does on AVX-512 VNNI builds (4-, 5-, 6- and 8-bit tiles, groups of 16 too)
    and on portable builds (4- and 5-bit tiles, 8-bit rows: AVX2's or plain integer sums);
    AVX-512 builds without VNNI keep float32 inputs, bit for bit the float32 product."""
    from inferflow import kernels
    from tests.test_fused import _reset

    if quant_decode.library() is None:
        pytest.skip("no C compiler here")
    from inferflow.kernel_build import _cpu_key

    cpu = _cpu_key().split()
    avx512 = "avx512f" in cpu and "-mno-avx512f" not in flags
    vnni = "avx512_vnni" in cpu and "-mno-avx512vnni" not in flags
    tiles = not avx512 or vnni  # (vector-type tiles and rows always have the integer path)
    monkeypatch.setenv("INFERFLOW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, *flags])
    _reset()
    try:
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
        for fmt in ("Q4_0", "Q4_1", "Q4_B64", "Q5_0", "Q8_0", "Q6_K"):
            w = torch.randn(32, 256, generator=torch.Generator().manual_seed(5))
            qt = random_blocks(fmt, 32, 256) if fmt.endswith("_K") else quantize(w, fmt)
            plane = QuantLinear(qt, None).plane
            assert plane is not None
            assert plane.has_q8() is tiles, fmt
            same = torch.equal(plane.matmul_f32(x, q8=True), plane.matmul_f32(x))
            assert same is not plane.has_q8(), fmt
    finally:
        monkeypatch.undo()
        _reset()


@pytest.fixture
def amx():  # noqa: ANN201
    """The AMX products (TDPBSUD on 16 rows of x at once), where this build has them and Linux
    grants the process AMX's tile state; afterwards as INFERFLOW_AMX has them."""
    lib = quant_decode.library()
    if lib is None or not lib.qmat_amx_built():
        pytest.skip("this build has no AMX-INT8 products (CPU without AMX, or no compiler)")
    if not quant_decode.set_amx(lib, True):
        pytest.skip("Linux refused this process AMX's tile state (arch_prctl)")
    yield lib
    quant_decode.set_amx(lib, os.environ.get("INFERFLOW_AMX", "1") != "0")


AMX_FORMATS = [*GGML, "Q4_B32", "Q4_B64", "Q3H", "Q4_E32", "Q8"]


@pytest.mark.parametrize("fmt", AMX_FORMATS)
def test_amx_products_are_the_rounded_rows_times_w_and_the_vnni_bits(fmt: str, amx) -> None:  # noqa: ANN001
    """Calls of 16 rows or more take AMX tiles for whole blocks of 16 rows (up to 8 blocks per
    pass over W, two of W's tiles and two blocks of x per chunk) and the VNNI path for the rest:
    with 16, 37 and 290 rows over widths that are not multiples of 256, W's last tile partly
    filled and an odd tile count, the product is W (gguf-py's decoding where it has the
    format) times x rounded to 8 bits, bit for bit the VNNI path's, and a row alone (VNNI)
    equals it within a call (AMX)."""
    k = 768 if fmt.endswith("_K") else 576
    layer, w = _layer(fmt, 71, k, 6)
    g = torch.Generator().manual_seed(7)
    for rows in (16, 37, 290):
        x = torch.randn(rows, k, generator=g) + 0.25
        x[3] *= 1e-3
        before = amx.qmat_amx_rows()
        on = layer.plane.matmul_f32(x, q8=True)  # type: ignore[union-attr]
        per = _x_per(fmt, [])  # (x in super-blocks: VNNI's integer sub-scales, not the tiles)
        assert amx.qmat_amx_rows() - before == (rows // 16 * 16 if per == 32 else 0)
        quant_decode.set_amx(amx, False)
        off = layer.plane.matmul_f32(x, q8=True)  # type: ignore[union-attr]
        quant_decode.set_amx(amx, True)
        assert torch.equal(on, off), (fmt, rows)
        want = _rounded(x, per) @ w.T
        assert float((on.double() - want).abs().max() / want.abs().max()) < 2e-6, (fmt, rows)
        for r in (0, 3, rows - 1):
            assert torch.equal(layer.plane.matmul_f32(x[r : r + 1], q8=True), on[r : r + 1])  # type: ignore[union-attr]


def test_super_block_sums_at_their_bound(build) -> None:  # noqa: ANN001
    """The largest integer sums a super-block can make: Q6_K blocks of code 63 (31 after the
    offset) under sub-scales of -128 against x of all one value (codes 127, every chunk shifted
    by 3): -2.097e9, within int32 by 2%. The product is still W x (an overflow would flip it)."""
    from inferflow.quant.tensor import QuantTensor

    n, k = 16, 512
    block = np.zeros(210, np.uint8)
    block[:192] = 0xFF  # ql, qh: every code 63
    block[192:208] = 0x80  # sub-scales -128
    block[208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    data = torch.from_numpy(np.tile(block, (n * k // 256, 1)).reshape(n, -1))
    layer = QuantLinear(QuantTensor(data, "Q6_K", (n, k)), None)
    assert layer.plane is not None
    w = gguf.quants.dequantize(data.numpy().reshape(n, -1), GGML["Q6_K"]).reshape(n, k)
    assert float(w.min()) == float(w.max()) == -31 * 128
    x = torch.full((3, k), 0.5)
    got = layer.plane.matmul_f32(x, q8=True).double()
    assert torch.allclose(
        got, torch.full((3, n), -31 * 128 * 0.5 * k, dtype=torch.float64), rtol=1e-6
    )
