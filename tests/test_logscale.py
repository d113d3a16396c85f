"""The quantized-scale formats (``inferflow/quant/logscale.py``: Q3_E32, Q4_E32, Q5_E32) against
a plain-Python reference of the documented layout written here, the min-max rule's error bound,
the search's objective, and GGUF files (written, read back, run).

Expected values never come from the codec under test: the reference decodes bytes with struct-free
bit arithmetic and numpy float32 scalars, and the bounds are computed from the inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from inferflow.errors import QuantError
from inferflow.quant import LOGSCALE_FORMATS, get_format, quantize
from inferflow.quant.linear import QuantLinear

BITS = {"Q3_E32": 3, "Q4_E32": 4, "Q5_E32": 5}


def ref_dequantize(block: bytes, bits: int) -> np.ndarray:
    """The docstring's layout: e, z, then 32 codes of ``bits`` bits, LSB-first."""
    e, z = block[0], block[1]
    scale = np.float32(np.float16(2.0 ** ((e - 240) / 16)))
    lo = np.float32(np.float16(np.float32((z - 120) / 8 - 2**bits / 2) * scale))
    stream = int.from_bytes(block[2:], "little")
    codes = [(stream >> (bits * i)) & (2**bits - 1) for i in range(32)]
    return np.array([np.float32(np.float32(q) * scale) + lo for q in codes], np.float32)


def _blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.empty(n, 1).uniform_(-3, 0, generator=g)
    return torch.randn(n, 32, generator=g) * mag + torch.randn(n, 1, generator=g) * mag * 0.3


@pytest.mark.parametrize("name", LOGSCALE_FORMATS)
@pytest.mark.parametrize("method", ["minmax", "search"])
def test_layout_matches_plain_python_reference(name: str, method: str) -> None:
    fmt = get_format(name)
    assert fmt.bytes_per_block == 2 + 4 * BITS[name] and fmt.bits_per_weight == BITS[name] + 0.5
    x = _blocks(64, 1)
    x[0] = 0.0  # exact zeros: scale code 0, min 0, codes 0
    q = quantize(x, name, method)
    out = q.dequantize()
    for i in range(x.shape[0]):
        ref = ref_dequantize(bytes(q.data[i].tolist()), BITS[name])
        assert np.array_equal(out[i].numpy().view(np.uint32), ref.view(np.uint32)), i
    assert bool((out[0] == 0).all())


@pytest.mark.parametrize("name", LOGSCALE_FORMATS)
def test_min_max_error_bound(name: str) -> None:
    """Min-max: the scale rounds up to its table (at most 2**(1/16) over (max - min) / L) and the
    min down by less than 1/8 step, so every weight is within half a step plus that 1/8."""
    x = _blocks(2048, 2)
    out = quantize(x, name, "minmax").dequantize()
    top = 2 ** BITS[name] - 1
    step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)).double() / top * 2 ** (1 / 16)
    err = (out.double() - x.double()).abs()
    assert bool((err <= step * (0.5 + 1 / 8) * (1 + 1e-5)).all())
    assert float((err / step).amax(1).median()) > 0.4  # not vacuous: near half a step


@pytest.mark.parametrize("name", LOGSCALE_FORMATS)
def test_search_never_worse_than_min_max(name: str) -> None:
    """The min-max grid is one of the search's candidates: in the search's objective (the
    weights minmax.py documents) no block is worse, and over the tensor it is clearly better."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 32, generator=g) * 0.02
    x[:, 7] *= 6  # outliers, as trained weights have
    imp = torch.rand(32, generator=g) + 0.1
    v = imp * (2 * x.square().mean(1, keepdim=True) + x.square()).sqrt()

    def objective(method: str) -> torch.Tensor:
        d = quantize(x, name, method, imp.repeat(1)).dequantize()
        return (v * (d - x).square()).sum(1)

    mm, se = objective("minmax"), objective("search")
    assert bool((se <= mm * (1 + 1e-6)).all())
    assert float(se.sum()) < 0.9 * float(mm.sum())  # measured 0.74 (Q3) .. 0.83 (Q5)


def test_bad_input_named() -> None:
    with pytest.raises(QuantError, match="Q4_E32: cannot quantize non-finite"):
        quantize(torch.tensor([[float("nan")] * 32]), "Q4_E32")
    with pytest.raises(QuantError, match="expected uint8 blocks of shape \\(n, 18\\)"):
        get_format("Q4_E32").dequantize_blocks(torch.zeros(1, 17, dtype=torch.uint8))


@pytest.mark.parametrize("name", LOGSCALE_FORMATS)
def test_gguf_round_trip_and_kernel(name: str, tmp_path: Path, quant_llamas) -> None:
    """``inferflow quantize`` writes the format under its own tensor type; the file reads back
    as the same blocks, and the layer's kernel multiplies as the dequantized weight does."""
    from inferflow.loaders.gguf import open_gguf
    from inferflow.quantize import quantize_checkpoint

    out = tmp_path / "q.gguf"
    res = quantize_checkpoint(quant_llamas["untied"], out, name)
    assert res.formats["blk.0.ffn_up.weight"] == name
    src = open_gguf([out])
    try:
        w = src.get("blk.0.ffn_up.weight")
        assert w.format == name  # type: ignore[union-attr]
        lin = QuantLinear(w, None)  # type: ignore[arg-type]
        x = torch.randn(3, w.shape[1])
        want = x.double() @ w.dequantize().double().T  # type: ignore[union-attr]
        torch.testing.assert_close(lin(x).double(), want, rtol=1e-4, atol=1e-5)
    finally:
        src.close()
