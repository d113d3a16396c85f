"""Inferflow's formats with quantized scales: Q3_E32, Q4_E32, Q5_E32 (new, beside the paper's
bit-exact formats in ``quant/minmax.py``).

Why. The paper's formats store an fp16 min and scale per block: 32 bits, so blocks of 32
weights cost 1 bit per weight on top of the codes (Q4_B32: 5.0) and the 4.5-bit Q4_B64 halves
that by halving the granularity. k-quants keep 32-weight granularity at 4.5 bits by quantizing
each block's scale and min to 6 bits inside a 256-weight super-block, but rows must then be a
multiple of 256, which the widths of small models are not (SmolLM2 576, Gemma-3 640, Qwen2.5
896: llama.cpp falls back to 32-block formats on nearly every matrix there). These formats keep
blocks of 32 weights, which any such row holds, and quantize the scale and min on their own:
one byte each, 16 bits per block.

Block (32 weights; bytes per block 2 + 4k: Q3_E32 14, Q4_E32 18, Q5_E32 22, i.e. k + 0.5 bits
per weight)::

    byte 0      e     scale = 2 ** ((e - 240) / 16)     (2**-15 .. 2**(15/16), 16 steps an octave)
    byte 1      z     min   = ((z - 120) / 8 - 2**k / 2) * scale   (steps of 1/8 around the
                      codes' centre: Q3 -19 .. 12.875 steps, Q4 -23 .. 8.875, Q5 -31 .. 0.875;
                      0 in range, so zero blocks are exact)
    bytes 2-    codes k bits each, the LSB-first bit stream of ``quant/minmax.py``

    w' = q * scale + min     (float32)

The scale table is ``2 ** ((e - 240) / 16)`` computed in float64 and rounded to float16; the min
is the product rounded to float16 (both exact in float32 and float16, so the kernels' planes hold
them in float16: 5 bits per weight resident for Q4_E32, as for Q4_B32; 6 for Q5_E32). A
scale off the ideal by at most half a step (2.2%) and a min off by 1/16 of a step cost little
next to the codes' own rounding, and the search below chooses codes against the stored grid.

Quantizers. ``quantize_blocks`` (min-max): the smallest table scale whose grid spans [min, max]
with a min in range (a block far from zero takes a larger scale), the min rounded down to its
1/8 steps. ``quantize_search`` (the
default of ``inferflow quantize`` and ``--quant``): the searched (scale, min) of
``minmax.best_fit`` (same weights, importance matrix included), then for the four table scales
around it and the min-max grid, the min rounded to its steps, the codes chosen on that grid,
the min refitted to those codes (weighted least squares) and rounded again: the block keeps the
candidate of least weighted squared error on its stored grid.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from inferflow import kernels
from inferflow.quant.formats import QuantFormat, register_format
from inferflow.quant.minmax import (
    best_fit,
    check_blocks,
    check_floats,
    codes_on_grid,
    pack_bits,
    search_weights,
    unpack_bits,
)

BLOCK = 32
E_BIAS, E_STEPS = 240, 16  # scale = 2 ** ((e - E_BIAS) / E_STEPS)
Z_BIAS, Z_STEPS = 120, 8  # min = ((z - Z_BIAS) / Z_STEPS - levels / 2) * scale
HEAD = 2  # bytes e, z
# rounded to float16 (as is each min): the kernels' planes hold both in float16, exactly
SCALES = (2.0 ** ((torch.arange(256, dtype=torch.float64) - E_BIAS) / E_STEPS)).half().float()


@dataclass(frozen=True)
class LogScaleLayout:
    name: str
    bits: int  # per code
    gguf_type: int

    @property
    def levels(self) -> int:
        return 2**self.bits

    @property
    def bytes_per_block(self) -> int:
        return HEAD + BLOCK * self.bits // 8


LOGSCALE_LAYOUTS: tuple[LogScaleLayout, ...] = (
    LogScaleLayout("Q3_E32", 3, 4104),
    LogScaleLayout("Q4_E32", 4, 4105),
    LogScaleLayout("Q5_E32", 5, 4106),
)
LOGSCALE_FORMATS: tuple[str, ...] = tuple(lay.name for lay in LOGSCALE_LAYOUTS)


def _scale_code(s: torch.Tensor, up: bool) -> torch.Tensor:
    """The table index of ``s`` rounded up (``up``) or down on the log grid, clamped: (n, 1)."""
    t = torch.log2(s.clamp(min=1e-30)) * E_STEPS + E_BIAS
    t = torch.ceil(t - 1e-4) if up else torch.floor(t + 1e-4)  # (table values land exactly)
    return t.clamp(0, 255).to(torch.int64)


def _offset(top: int) -> float:
    """Min in steps at code z = Z_BIAS: minus half the levels (the codes' centre at zero)."""
    return -(top + 1) / 2


def _min_code(lo: torch.Tensor, scale: torch.Tensor, top: int, up: bool | None) -> torch.Tensor:
    """The min code of ``lo`` on ``scale``'s grid: nearest (``up`` None), up or down."""
    t = (lo / scale - _offset(top)) * Z_STEPS + Z_BIAS
    t = torch.round(t) if up is None else torch.ceil(t) if up else torch.floor(t)
    return t.clamp(0, 255).to(torch.int64)


def _grid(e: torch.Tensor, z: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) float32 of codes (e, z), as dequantization computes them."""
    scale = SCALES[e]
    lo = ((z - Z_BIAS).to(torch.float32) / Z_STEPS + _offset(top)) * scale  # (exact: <= 20 bits)
    return scale, lo.half().float()


def _error(
    x: torch.Tensor, v: torch.Tensor, e: torch.Tensor, z: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted squared error (n, 1), codes) of ``x`` on the stored grid (e, z)."""
    scale, lo = _grid(e, z, top)
    q = codes_on_grid(x, lo, scale, top)
    return (v * (q * scale + lo - x).square()).sum(1, keepdim=True), q


def _minmax_codes(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, z) of the min-max rule: the least table scale spanning [min, max] with the min in
    range (its lowest and highest steps m0, m1: a block above zero needs (m1 + L) * scale >=
    max, one below it m0 * scale <= min), the min rounded down."""
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    m0 = -Z_BIAS / Z_STEPS + _offset(top)
    m1 = (255 - Z_BIAS) / Z_STEPS + _offset(top)
    need = ((mx - mn) / top).maximum(mx / (m1 + top)).maximum(mn / m0)
    e = _scale_code(need, up=True)
    return e, _min_code(mn, SCALES[e], top, up=False)


def _pack(e: torch.Tensor, z: torch.Tensor, q: torch.Tensor, lay: LogScaleLayout) -> torch.Tensor:
    head = torch.cat([e, z], dim=1).to(torch.uint8)
    return torch.cat([head, pack_bits(q.to(torch.int32), lay.bits)], dim=1)


def _quantize(x: torch.Tensor, *, lay: LogScaleLayout) -> torch.Tensor:
    x = check_floats(x, lay.name, BLOCK)
    top = lay.levels - 1
    e, z = _minmax_codes(x, top)
    scale, lo = _grid(e, z, top)
    return _pack(e, z, codes_on_grid(x, lo, scale, top), lay)


def _quantize_search(
    x: torch.Tensor, importance: torch.Tensor | None = None, *, lay: LogScaleLayout
) -> torch.Tensor:
    x = check_floats(x, lay.name, BLOCK, importance)
    top = lay.levels - 1
    v = search_weights(x, importance)
    kernel = kernels.search_blocks()
    if kernel is not None:  # the same fit in C (its fp16 rounding: only a starting point here)
        head = kernel(x, importance, top)[0].to(torch.float32)
        lo, sc = head[:, :1], head[:, 1:]
    else:
        lo, sc = best_fit(x, top, v)
    e, z = _minmax_codes(x, top)
    best, q = _error(x, v, e, z, top)

    def consider(ec: torch.Tensor, zc: torch.Tensor) -> torch.Tensor:
        """Keep grid (ec, zc) per block where it has the least error so far; its codes."""
        nonlocal best, e, z, q
        err, qc = _error(x, v, ec, zc, top)
        better = err < best
        best, q = torch.where(better, err, best), torch.where(better, qc, q)
        e, z = torch.where(better, ec, e), torch.where(better, zc, z)
        return qc

    sw = v.sum(1, keepdim=True)
    base = _scale_code(sc, up=False)
    for step in (-1, 0, 1, 2):
        ec = (base + step).clamp(0, 255)
        scale = SCALES[ec]
        qc = consider(ec, _min_code(lo, scale, top, None))
        # the min refitted to those codes (weighted least squares), rounded again
        fitted = (v * (x - qc * scale)).sum(1, keepdim=True) / sw
        consider(ec, _min_code(fitted, scale, top, None))
    return _pack(e, z, q, lay)


def unpack(
    blocks: torch.Tensor, lay: LogScaleLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 (n, 32), scale float32 (n, 1), min float32 (n, 1)) of raw blocks."""
    check_blocks(blocks, lay.name, lay.bytes_per_block)
    e, z = blocks[:, :1].to(torch.int64), blocks[:, 1:2].to(torch.int64)
    scale, lo = _grid(e, z, lay.levels - 1)
    return unpack_bits(blocks[:, HEAD:], lay.bits, BLOCK).to(torch.uint8), scale, lo


def _dequantize(blocks: torch.Tensor, *, lay: LogScaleLayout) -> torch.Tensor:
    q, scale, lo = unpack(blocks, lay)
    return q.to(torch.float32) * scale + lo


def _register(lay: LogScaleLayout) -> QuantFormat:
    return register_format(
        QuantFormat(
            lay.name,
            BLOCK,
            lay.bytes_per_block,
            functools.partial(_dequantize, lay=lay),
            functools.partial(_quantize, lay=lay),
            inferflow_type=lay.gguf_type,
            quantize_search=functools.partial(_quantize_search, lay=lay),
        )
    )


for _lay in LOGSCALE_LAYOUTS:
    _register(_lay)
