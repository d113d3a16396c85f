"""Inferflow's own block-wise linear min-max formats (the seed paper's Q8 ... Q2 and Q3H).

Formula (per block of weights ``w`` with ``min = min(w)``, ``max = max(w)``, ``L = 2**k - 1``)::

    q  = round((w - min) / (max - min) * L)        # an integer code in [0, L]
    w' = q / L * (max - min) + min                 # = q * scale + min

Table (name: bits k, weights per block, bytes per block, bits per weight, GGUF tensor type id)::

    Q8      8  32  36  9.0  4096      Q4_B64  4  64  36  4.5  4100
    Q6      6  64  52  6.5  4097      Q3_B32  3  32  16  4.0  4101
    Q5      5  64  44  5.5  4098      Q2      2  32  12  3.0  4102
    Q4_B32  4  32  20  5.0  4099      Q3H   3.5  64  32  4.0  4103

In a GGUF file a tensor of one of these formats has the type id above (outside GGML's range, so
llama.cpp refuses the file instead of misreading it) and its blocks as laid out below, rows
contiguous; the file's ``inferflow.tensor_types`` key lists the ones it uses as "NAME=ID".

Byte layout of every block::

    bytes 0-1   min    fp16, little-endian
    bytes 2-3   scale  fp16, little-endian (scale = (max - min) / L, see rounding below)
    bytes 4-    codes  one little-endian, LSB-first bit stream: code i occupies stream bits
                       [i*c, (i+1)*c), stream bit j is bit (j % 8) of code byte j // 8.

For the k-bit formats ``c = k`` and code i is weight i's q (so Q4 puts weight 2i in the low
nibble of byte i and weight 2i+1 in the high nibble; unlike ggml's Q4_1, which puts the block's
first half in the low nibbles). Q3H (3.5 bits) quantizes each weight to 11 levels (L = 10) and
stores each adjacent pair as one 7-bit code ``q[2p] * 11 + q[2p+1]`` (0..120; decoded with
``// 11`` and ``% 11``): 32 pairs * 7 bits = 28 bytes, so 64 weights take 32 bytes, the same 4.0
bits per weight as Q3_B32 (12 code bytes + 4 per 32). Codes 121..127 never occur; decoding a
block that holds one raises QuantError (the data is corrupt).

fp16 rounding. Only fp16 values are stored, so the codes are chosen against the stored grid, not
the exact one: ``min16`` is ``min`` rounded toward -inf to fp16, ``scale16`` is
``(max - min16) / L`` (float32) rounded toward +inf to fp16, and
``q = clamp(round((w - min16) / scale16), 0, L)`` (round half to even). Rounding outward means
the grid ``[min16, min16 + L * scale16]`` covers ``[min, max]``, so no weight is clamped and
dequantization ``w' = q * scale16 + min16`` (float32; ``q * scale16`` is exact) means exactly what
the codes say. Error bound, for every weight of a block (all after float32 conversion and
saturation, below)::

    |w - w'| <= scale16 / 2 + 2**-20 * max(|min|, |max|)            (float32 arithmetic slack)
    scale16  <= ((max - min) + 2**-10 * |min| + 2**-24) / L * (1 + 2**-9) + 2**-24

i.e. the paper's ``(max - min) / (2L)`` plus fp16 terms: ``2**-10 * |min|`` (min rounded down by
< 1 fp16 ulp), ``2**-9`` relative (scale rounded up by < 1 ulp, plus float32 rounding) and
``2**-24`` absolute (fp16's subnormal spacing, which bounds tiny blocks).

Search (``quantize_search``; ``inferflow quantize``'s default, ``--method minmax`` for the rule
above). The stored bytes are the same; only (min, scale) per block and so the codes are chosen
to minimise the weighted squared error ``sum_i v_i (w_i - w'_i)**2`` instead of spanning [min,
max], as llama.cpp's ``make_qkx2_quants`` does: candidate grids with ``L + (k - 10) / 10``
steps across [min, max] (k = 0..20) give codes, weighted least squares gives the (scale, min)
best for those codes, both rounded to fp16, the codes re-chosen on the stored grid, and the
block keeps whichever candidate -- the min-max grid included -- has the least error. So the
search is never worse than min-max in the weighted error, but extreme weights may be clipped
(the bound above no longer holds). Weights ``v``: ``importance * sqrt(2 * mean(w**2) + w**2)``
with an importance per input column (an importance matrix: the mean squared activation each
weight multiplies, ``inferflow imatrix``), else ``sqrt(mean(w**2)) + |w|`` (llama.cpp's
choices for its k-quants with and without an imatrix). The search runs one block at a time in C
(inferflow/kernels/quant_search.c) where a compiler works, else as torch passes over the tensor;
the two differ only where float32 sums in another order tip a near tie between candidates.

Special cases. A block whose values all equal one fp16-representable value (0, negatives and
subnormals included) gets ``min16 = max``, scale 0 and codes 0, so ``w' = min`` exactly; other
constant blocks fall under the general rule (a tiny scale, error within the bound). Inputs are
converted to float32 and clamped to fp16's finite range [-65504, 65504] first, so larger
magnitudes saturate (their error is not bounded). NaN or infinite inputs raise QuantError.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from inferflow import kernels
from inferflow.errors import QuantError
from inferflow.quant.formats import QuantFormat, register_format

F16_MAX = 65504.0  # largest finite fp16
_MIN_BYTES = 4  # fp16 min + fp16 scale at the head of every block
_Q3H_BASE = 11  # Q3H levels per weight; a pair code is q_even * 11 + q_odd


@dataclass(frozen=True)
class MinMaxLayout:
    """One min-max format: levels per weight and how codes are packed."""

    name: str
    bits: float  # bits per weight of the codes alone (3.5 for Q3H)
    block_size: int
    levels: int  # L + 1
    code_bits: int  # bits per packed code (k, or 7 for a Q3H pair)
    pairs: bool  # Q3H: codes are pairs of 11-level weights
    gguf_type: int  # tensor-type id in GGUF files (stable: files carry it)

    @property
    def bytes_per_block(self) -> int:
        n_codes = self.block_size // 2 if self.pairs else self.block_size
        return _MIN_BYTES + n_codes * self.code_bits // 8


def _kbit(name: str, k: int, block_size: int, gguf_type: int) -> MinMaxLayout:
    return MinMaxLayout(name, k, block_size, 2**k, k, pairs=False, gguf_type=gguf_type)


# Inferflow's min-max formats (the seed paper's names), in README order.
MINMAX_LAYOUTS: tuple[MinMaxLayout, ...] = (
    _kbit("Q8", 8, 32, 4096),
    _kbit("Q6", 6, 64, 4097),
    _kbit("Q5", 5, 64, 4098),
    _kbit("Q4_B32", 4, 32, 4099),
    _kbit("Q4_B64", 4, 64, 4100),
    _kbit("Q3_B32", 3, 32, 4101),
    _kbit("Q2", 2, 32, 4102),
    MinMaxLayout("Q3H", 3.5, 64, _Q3H_BASE, 7, pairs=True, gguf_type=4103),
)
MINMAX_FORMATS: tuple[str, ...] = tuple(lay.name for lay in MINMAX_LAYOUTS)


# --- fp16 directed rounding --------------------------------------------------------------------


def _f16_step(h: torch.Tensor, up: bool) -> torch.Tensor:
    """The fp16 neighbour of finite fp16 ``h`` toward +inf (``up``) or -inf, as fp16."""
    b = h.view(torch.int16).to(torch.int32) & 0xFFFF
    mag = b & 0x7FFF
    neg = (b & 0x8000) != 0
    if up:  # away from zero for positives, toward zero for negatives; +-0 -> smallest subnormal
        nb = torch.where(mag == 0, 0x0001, torch.where(neg, b - 1, b + 1))
    else:
        nb = torch.where(mag == 0, 0x8001, torch.where(neg, b + 1, b - 1))
    nb = torch.where(nb >= 0x8000, nb - 0x10000, nb)  # back to int16 without cast wrapping
    return nb.to(torch.int16).view(torch.float16)


def _f16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 ``x`` (within fp16 range) rounded to fp16 toward +inf or -inf: (same shape) fp16."""
    h = x.to(torch.float16)  # nearest even; one step fixes the wrong side
    back = h.to(torch.float32)
    wrong = back < x if up else back > x
    return torch.where(wrong, _f16_step(h, up), h)


# --- bit streams -------------------------------------------------------------------------------


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, m) codes < 2**bits -> (n, m * bits / 8) uint8: LSB-first stream, code 0 lowest (m a
    multiple of 8: every 8 codes fill ``bits`` bytes, one little-endian int64 word)."""
    n, m = codes.shape
    if bits == 8:
        return codes.to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.int64, device=codes.device) * bits
    words = (codes.to(torch.int64).reshape(n, m // 8, 8) << shifts).sum(dim=-1)
    return _le_bytes(words)[..., :bits].reshape(n, m * bits // 8)


def unpack_bits(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """Inverse of pack_bits: (n, m * bits / 8) uint8 -> (n, m) int32 codes."""
    n = packed.shape[0]
    if bits == 8:
        return packed.to(torch.int32)
    groups = packed.reshape(n, m // 8, bits).to(torch.int64)
    words = (groups << torch.arange(bits, dtype=torch.int64, device=packed.device) * 8).sum(-1)
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * bits
    return ((words.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(n, m).to(torch.int32)


def _le_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 (...) -> uint8 (..., 8), least significant byte first."""
    if sys.byteorder == "little":
        return words.contiguous().view(torch.uint8).reshape(*words.shape, 8)
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


# --- codecs ------------------------------------------------------------------------------------


def check_floats(
    x: torch.Tensor, name: str, block_size: int, importance: torch.Tensor | None = None
) -> torch.Tensor:
    """Float blocks (n, ``block_size``) of format ``name`` as float32 within fp16's range;
    non-finite values are refused, naming the first, and ``importance`` of another shape."""
    if importance is not None and importance.shape != x.shape:
        raise QuantError(
            f"{name}: importance of shape {list(importance.shape)} for blocks of shape "
            f"{list(x.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != block_size or not x.is_floating_point():
        raise QuantError(
            f"{name}: expected float blocks of shape (n, {block_size}), "
            f"got {x.dtype} {list(x.shape)}"
        )
    x = x.to(torch.float32)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        # name the first offender: silently quantizing NaN/inf would poison the whole block
        blk, col = (int(i) for i in bad.nonzero()[0])
        raise QuantError(
            f"{name}: cannot quantize non-finite values ({int(bad.sum())} NaN/inf; first "
            f"is {float(x[blk, col])} at block {blk}, weight {col})"
        )
    return x.clamp(-F16_MAX, F16_MAX)  # saturate: fp16 cannot store a wider min or scale


def _minmax_grid(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min16, scale16), fp16 (n, 1) each, of the min-max rule: rounded outward, so the stored
    grid [min16, min16 + L*scale16] covers [min, max] (scale 0 only when max == min16)."""
    min16 = _f16_round(x.amin(dim=-1, keepdim=True), up=False)
    mx = x.amax(dim=-1, keepdim=True)
    return min16, _f16_round((mx - min16.to(torch.float32)) / top, up=True)


def _quantize(x: torch.Tensor, lay: MinMaxLayout) -> torch.Tensor:
    x = check_floats(x, lay.name, lay.block_size)  # (n, block)
    top = lay.levels - 1  # L
    min16, scale16 = _minmax_grid(x, top)
    # (the clamp in _codes only absorbs float32 noise here)
    q = codes_on_grid(x, min16.to(torch.float32), scale16.to(torch.float32), top)
    return _pack(q.to(torch.int32), min16, scale16, lay)


_SEARCH_STEPS = 20  # candidate grids: L - 1 ... L + 1 steps across [min, max], 0.1 apart
# re-code and re-fit rounds on the winner: on Gemma-3-270M with an imatrix, 3 rounds took
# Q4_B64 from 1.077x to 1.068x float perplexity and Q4_B32 from 1.043x to 1.040x
_REFITS = 3


def codes_on_grid(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, top: int) -> torch.Tensor:
    """Nearest codes of ``x`` on the grid ``lo + q * scale`` (scale 0: all codes 0), as float."""
    safe = torch.where(scale > 0, scale, 1.0)
    return torch.where(scale > 0, torch.round((x - lo) / safe), 0.0).clamp(0, top)


def _search_grid(
    x: torch.Tensor, lay: MinMaxLayout, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min16, scale16), fp16 (n, 1) each: the candidate grid of least weighted error.

    Each candidate's error comes in closed form from the sums its least-squares fit needs
    (no second pass over the block); only the winner and the min-max grid are re-coded on their
    fp16 grids and compared exactly."""
    top = lay.levels - 1
    v = search_weights(x, importance)
    best_lo, best_sc = best_fit(x, top, v)

    def exact(lo16: torch.Tensor, sc16: torch.Tensor) -> torch.Tensor:
        lo, sc = lo16.to(torch.float32), sc16.to(torch.float32)
        return (v * (codes_on_grid(x, lo, sc, top) * sc + lo - x).square()).sum(1, keepdim=True)

    lo16 = best_lo.clamp(-F16_MAX, F16_MAX).to(torch.float16)
    sc16 = best_sc.clamp(max=F16_MAX).to(torch.float16)
    mm_lo, mm_sc = _minmax_grid(x, top)  # the min-max grid, kept where it is no worse
    keep = exact(mm_lo, mm_sc) <= exact(lo16, sc16)
    return torch.where(keep, mm_lo, lo16), torch.where(keep, mm_sc, sc16)


def search_weights(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """Each weight's weight in the search's squared error (module docstring), (n, block)."""
    sq = x.square()
    if importance is None:
        return sq.mean(1, keepdim=True).sqrt() + x.abs()
    return importance * (2 * sq.mean(1, keepdim=True) + sq).sqrt()


def best_fit(x: torch.Tensor, top: int, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, scale) float32 (n, 1) each of the candidate grid with codes 0..``top`` of least
    ``v``-weighted squared error, before any rounding of the two (module docstring)."""
    sq = x.square()
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    rng = mx - mn
    sw, sx, sxx = (
        v.sum(1, keepdim=True),
        (v * x).sum(1, keepdim=True),
        (v * sq).sum(1, keepdim=True),
    )
    vx = v * x
    best = torch.full_like(mn, torch.inf)
    best_lo, best_sc = mn.clone(), torch.zeros_like(mn)

    def fit(q: torch.Tensor) -> None:
        """Least-squares (scale, lo) for codes ``q``, kept per block where its error is lower."""
        nonlocal best, best_lo, best_sc
        vq = v * q
        sq_, sqq, sqx = (
            vq.sum(1, keepdim=True),
            (vq * q).sum(1, keepdim=True),
            (vx * q).sum(1, keepdim=True),
        )
        det = sw * sqq - sq_ * sq_
        ok = det > 0
        det = torch.where(ok, det, 1.0)
        scale = ((sw * sqx - sq_ * sx) / det).clamp(min=0)
        lo = (sqq * sx - sq_ * sqx) / det
        # sum v (scale q + lo - x)^2, expanded
        err = (
            scale * scale * sqq + 2 * scale * lo * sq_ + lo * lo * sw
            - 2 * scale * sqx - 2 * lo * sx + sxx
        )  # fmt: skip
        better = ok & (err < best)
        best = torch.where(better, err, best)
        best_lo = torch.where(better, lo, best_lo)
        best_sc = torch.where(better, scale, best_sc)

    pos = torch.where(rng > 0, rng, 1.0)
    t = (x - mn) / pos  # in [0, 1]: codes of every candidate grid are round(t * steps)
    for k in range(_SEARCH_STEPS + 1):
        fit(torch.round(t * (top - 1 + k / 10)).clamp_(0, top))
    for _ in range(_REFITS):  # re-code on the best grid and fit again (never worse)
        fit(codes_on_grid(x, best_lo, best_sc, top))
    return best_lo, best_sc


def _quantize_search(
    x: torch.Tensor, lay: MinMaxLayout, importance: torch.Tensor | None = None
) -> torch.Tensor:
    x = check_floats(x, lay.name, lay.block_size, importance)
    kernel = kernels.search_blocks()
    if kernel is not None and lay.block_size <= 256:
        head, codes = kernel(x, importance, lay.levels - 1)
        return _pack(codes.to(torch.int32), head[:, :1], head[:, 1:], lay)
    min16, scale16 = _search_grid(x, lay, importance)
    q = codes_on_grid(x, min16.to(torch.float32), scale16.to(torch.float32), lay.levels - 1)
    return _pack(q.to(torch.int32), min16, scale16, lay)


def _pack(
    q: torch.Tensor, min16: torch.Tensor, scale16: torch.Tensor, lay: MinMaxLayout
) -> torch.Tensor:
    """Blocks of codes ``q`` (n, block) int32 on the grid (min16, scale16) (n, 1) fp16 each."""
    if lay.pairs:
        q = q[:, 0::2] * _Q3H_BASE + q[:, 1::2]  # (n, block/2) pair codes 0..120
    head = torch.cat([min16, scale16], dim=-1).contiguous().view(torch.uint8)  # (n, 4)
    return torch.cat([head, pack_bits(q, lay.code_bits)], dim=-1)


def check_blocks(blocks: torch.Tensor, name: str, bytes_per_block: int) -> None:
    """Refuse anything but uint8 blocks (n, ``bytes_per_block``) of format ``name``."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != bytes_per_block:
        raise QuantError(
            f"{name}: expected uint8 blocks of shape (n, {bytes_per_block}), "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )


def _dequantize(blocks: torch.Tensor, lay: MinMaxLayout) -> torch.Tensor:
    check_blocks(blocks, lay.name, lay.bytes_per_block)
    head = blocks[:, :_MIN_BYTES].contiguous().view(torch.float16).to(torch.float32)  # (n, 2)
    lo, scale = head[:, :1], head[:, 1:]
    n_codes = lay.block_size // 2 if lay.pairs else lay.block_size
    q = unpack_bits(blocks[:, _MIN_BYTES:], lay.code_bits, n_codes)
    if lay.pairs:
        if bool((q >= _Q3H_BASE * _Q3H_BASE).any()):
            blk = int((q >= _Q3H_BASE * _Q3H_BASE).any(dim=-1).nonzero()[0])
            raise QuantError(f"{lay.name}: block {blk} holds a pair code > 120 (corrupt data)")
        q = torch.stack([q // _Q3H_BASE, q % _Q3H_BASE], dim=-1).reshape(q.shape[0], -1)
    return q.to(torch.float32) * scale + lo  # q * scale is exact in float32 (<= 19 bits)


def _register(lay: MinMaxLayout) -> QuantFormat:
    def deq(blocks: torch.Tensor) -> torch.Tensor:
        return _dequantize(blocks, lay)

    def quant(x: torch.Tensor) -> torch.Tensor:
        return _quantize(x, lay)

    def search(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
        return _quantize_search(x, lay, importance)

    fmt = QuantFormat(
        lay.name,
        lay.block_size,
        lay.bytes_per_block,
        deq,
        quant,
        inferflow_type=lay.gguf_type,
        quantize_search=search,
    )
    return register_format(fmt)


for _lay in MINMAX_LAYOUTS:
    _register(_lay)
