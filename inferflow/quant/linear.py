"""QuantLinear: a linear layer over quantized weights, with one CPU kernel chosen per format.

Kernels (``benchmarks/quant_kernels.py`` times them; each layer holds one copy of its weights
unless ``dense_rows`` adds one):

- ``int4pack`` (where no C plane can be made, or forced): torch's tinygemm-style
  ``_weight_int4pack_mm_for_cpu`` for every format whose blocks are affine in small integer
  codes, ``w = code * scale + min`` per group of 32..256 weights (GGML Q4_0/Q4_1/Q5_0/Q5_1/
  Q8_0/Q4_K/Q5_K, all min-max formats). Codes of up to 4 bits
  are one int4 plane; 5..8-bit codes split into a high and a low nibble plane laid side by side
  along K (``[x, x] @ [W_hi | W_lo]^T``), so one call sums both. 2-6x faster than any dense or
  dequantizing path at decode sizes, but only with bf16 activations (fp32 and fp16 inputs are
  20-50x slower), so activations are cast to bf16 and back.
- ``dense_rows`` (optional, on top of int4pack; spec ``quant.dense_batch``): int4pack's cost
  grows linearly with the rows M of x (a 576x1536 weight: 16 us at M=1, 184 us at M=32,
  721 us at M=128), while a dense bf16 GEMM costs about the same up to M=16 (45-68 us) and 2.5x
  less at M=128. ``attach_dense`` gives such a layer a bf16 copy of int4pack's own effective
  weights (2 more bytes per weight) and calls of at least ``dense_rows`` rows use it: batched
  decode steps and prefill chunks; single-sequence decode stays on int4pack (or ``plane``).
- ``plane`` (when ``kernel`` is auto and a C compiler works; then the layer's only copy): the
  codes in the layout of ``inferflow/kernels/quant_decode.c`` with float32 scales and mins (0.75
  bytes per weight for 4-bit codes, 0.875 for 5-bit, 1.25 for 8-bit in groups of 32; float16
  ones where exact and the build reads them: 0.625, 0.75 and 1.125; symmetric formats, Q4_0,
  Q5_0, Q8_0, Q6_K, hold no mins: -zero * scale). Every call computes on the codec's exact
  values in float32, and each row of x gets the same operations whatever else is in the call
  (one row alone, many rows sharing each unpacked tile of codes in ``qmat_gemm_f32``): a
  request's outputs do not depend on its batch. The same plane feeds the one-call decode of a
  whole stack (inferflow.model.fused), with the same arithmetic.
  ``quant: {kernel: int4pack}`` keeps int4pack alone.
- ``dequant``: everything else (IQ/TQ/MXFP4, float formats):
  dequantize a bounded tile of rows (``TILE_BYTES`` of float32) at a time from the raw blocks and
  multiply in float32 (float32 GEMM is no slower than bf16 on this CPU, and the codecs emit
  float32 anyway). Keeps the format's own memory footprint; slow per call.

Numerics. ``dequant`` equals ``F.linear(x.float(), W.dequantize())`` rounded to x.dtype. torch's
int4pack dequantizes ``(c - 8) * s + z`` per group (z is a float offset, *not* a zero-point code:
checked against a float reference in the tests) with s and z held in bf16. pack_int4 maps a
format's (code, scale, min) so that c is centred on 8 and z is the block's midpoint; s and z are
each rounded once to bf16 (unit roundoff 2**-8), so each effective weight is off by at most
about 2**-8 * 2 * (block's max |w|). With the bf16 cast of x and of the output, a layer's output
is within ``5 * 2**-8 * (|x| @ A^T)`` of the exact product (A: per-block max |w|); measured
worst cases are ~0.11 * 2**-8 * (|x| @ A^T). Symmetric formats (Q4_0, Q5_0, Q8_0) get z = 0 exactly.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from inferflow.errors import QuantError
from inferflow.kernels import quant_decode
from inferflow.kernels.quant_decode import (
    QPlane,
    make_plane,
    plane_bits,
    plane_takes,
)
from inferflow.quant import ggml
from inferflow.quant.formats import QuantFormat
from inferflow.quant.logscale import BLOCK, LOGSCALE_LAYOUTS, unpack
from inferflow.quant.minmax import _MIN_BYTES, MINMAX_LAYOUTS, MinMaxLayout, unpack_bits
from inferflow.quant.tensor import QuantTensor
from inferflow.registry import Registry

log = logging.getLogger(__name__)

TILE_BYTES = 4 << 20  # float32 rows dequantized at once by the ``dequant`` kernel
INT4_GROUPS = (32, 64, 128, 256)  # group sizes _weight_int4pack_mm_for_cpu accepts
_INT4_ROWS = 16  # _convert_weight_to_int4pack_for_cpu needs out_features % 16 == 0: pad
_CHECK_BLOCKS = 64  # blocks compared against the codec when a layer is built
_CHUNK_ROWS = 1024  # rows repacked at a time (a multiple of _INT4_ROWS)

Kernel = Callable[[torch.Tensor], torch.Tensor]  # (M, in) -> (M, out), same dtype

# --- affine views: how a format's blocks read as code * scale + min ---------------------------

Unpack = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Factored = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
Factors = Callable[[torch.Tensor], Factored]


@dataclass(frozen=True)
class AffineView:
    """``unpack(blocks uint8 (n, bytes)) -> codes (n, block) uint8, scale, min float32 (n,
    block // group)``, with ``codes * scale + min`` (float32) equal to the codec's output."""

    levels: int  # codes lie in [0, levels)
    group: int  # weights sharing one (scale, min)
    unpack: Unpack
    zero: int | None = None  # symmetric formats: min == -zero * scale always
    # k-quants: their scales (and mins) in the file's two levels, ``unpack``'s exactly as d * sc
    # (dmin * m): blocks -> (d (n, 1), sc (n, G) integers, dmin (n, 1) or None, m or None)
    factors: Factors | None = None

    @property
    def bits(self) -> int:
        return max(1, (self.levels - 1).bit_length())


AFFINE_VIEWS: Registry[AffineView] = Registry("affine view")


def _u8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.uint8)


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = ggml._f16(b, 0)  # gguf-py Q4_0: d * (nibble - 8)
    return ggml._nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ggml._nibbles(b[:, 4:]), ggml._f16(b, 0), ggml._f16(b, 2)  # d * nibble + m


def _q5_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = ggml._f16(b, 0)  # gguf-py Q5_0: d * (q5 - 16)
    return _u8(ggml._nibbles(b[:, 6:]) | (ggml._bits32(b[:, 2:6]) << 4)), d, -16 * d


def _q5_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = ggml._nibbles(b[:, 8:]) | (ggml._bits32(b[:, 4:8]) << 4)
    return _u8(q), ggml._f16(b, 0), ggml._f16(b, 2)


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = ggml._f16(b, 0)  # int8 q * d == (q + 128) * d - 128 * d exactly (<= 19-bit products)
    return _u8(b[:, 2:].view(torch.int8).to(torch.int16) + 128), d, -128 * d


def _k_factors(b: torch.Tensor) -> Factored:  # Q4_K / Q5_K: d * sc and -(dmin) * m
    sc, mn = ggml._scale_min_k4(b[:, 4:16])
    return ggml._f16(b, 0), sc, -ggml._f16(b, 2), mn


def _q6_k_factors(b: torch.Tensor) -> Factored:
    return ggml._f16(b, 208), b[:, 192:208].contiguous().view(torch.int8), None, None


def _q3_k_scales(b: torch.Tensor) -> torch.Tensor:  # the 16 six-bit scales minus 32
    n = b.shape[0]
    lsc = ggml._shr(b[:, 96:104].reshape(n, 1, 8), [0, 4], (1, 2, 1)).reshape(n, 16)
    hsc = ggml._shr(b[:, 104:108].reshape(n, 1, 4), [0, 2, 4, 6], (1, 4, 1)).reshape(n, 16)
    return ((lsc & 0x0F) | ((hsc & 0x03) << 4)).to(torch.int16) - 32


def _q3_k_factors(b: torch.Tensor) -> Factored:
    return ggml._f16(b, 108), _q3_k_scales(b), None, None


def _q2_k_factors(b: torch.Tensor) -> Factored:
    return ggml._f16(b, 80), b[:, :16] & 0x0F, -ggml._f16(b, 82), b[:, :16] >> 4


def _two_level(f: Factored, zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A k-quant's group scales and mins from its two levels: d * sc, and dmin * m (or
    -zero * scale for a symmetric one); float32 products of <= 17 significant bits, exact."""
    d, sc, dmin, m = f
    scale = d * sc.to(torch.float32)
    if dmin is None or m is None:
        return scale, -zero * scale
    return scale, dmin * m.to(torch.float32)


def _q2_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # gguf-py Q2_K: (d * sc) * q - (dmin * m), 4-bit sc and m per 16 weights
    n = b.shape[0]
    q = ggml._shr(b[:, 16:80].reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)) & 3
    return (_u8(q.reshape(n, -1)), *_two_level(_q2_k_factors(b)))


def _q3_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # gguf-py Q3_K: (d * (sc - 32)) * (q3 - 4), q3 = low two bits | hmask bit << 2; the codec's
    # s * (q3 - 4) equals q3 * s - 4 s exactly (<= 20-bit products)
    n = b.shape[0]
    ql = ggml._shr(b[:, 32:96].reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)) & 3
    qh = ggml._shr(b[:, :32].reshape(n, -1, 1, 32), list(range(8)), (1, 1, 8, 1)) & 1
    return (_u8(ql.reshape(n, -1) | (qh.reshape(n, -1) << 2)), *_two_level(_q3_k_factors(b), 4))


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    q = ggml._shr(b[:, 16:].reshape(n, -1, 1, 32), [0, 4], (1, 1, 2, 1)) & 0x0F
    return (q.reshape(n, -1), *_two_level(_k_factors(b)))


def _q5_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    ql = ggml._shr(b[:, 48:].reshape(n, -1, 1, 32), [0, 4], (1, 1, 2, 1)) & 0x0F
    qh = ggml._shr(b[:, 16:48].reshape(n, -1, 1, 32), list(range(8)), (1, 1, 8, 1)) & 1
    return (_u8(ql.reshape(n, -1) | (qh.reshape(n, -1) << 4)), *_two_level(_k_factors(b)))


def _q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # gguf-py Q6_K: (d * int8 scale) * (q6 - 32) per 16 weights; q6 * s - 32 s is exact in float32
    n = b.shape[0]
    lo = ggml._shr(b[:, :128].reshape(n, -1, 1, 64), [0, 4], (1, 1, 2, 1)) & 0x0F
    hi = ggml._shr(b[:, 128:192].reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)) & 3
    q = _u8(lo.reshape(n, -1, 32) | (hi.reshape(n, -1, 32) << 4)).reshape(n, -1)
    return (q, *_two_level(_q6_k_factors(b), 32))


def _minmax_view(lay: MinMaxLayout) -> AffineView:
    # inferflow.quant.minmax layout: fp16 min, fp16 scale, LSB-first codes (Q3H: base-11 pairs)
    n_codes = lay.block_size // 2 if lay.pairs else lay.block_size

    def unpack(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head = b[:, :_MIN_BYTES].contiguous().view(torch.float16).to(torch.float32)
        q = unpack_bits(b[:, _MIN_BYTES:], lay.code_bits, n_codes)
        if lay.pairs:
            q = torch.stack([q // lay.levels, q % lay.levels], dim=-1).reshape(q.shape[0], -1)
        return _u8(q), head[:, 1:], head[:, :1]

    return AffineView(lay.levels, lay.block_size, unpack)


for _name, _levels, _group, _fn, _zero, _factors in [
    ("Q4_0", 16, 32, _q4_0, 8, None),
    ("Q4_1", 16, 32, _q4_1, None, None),
    ("Q5_0", 32, 32, _q5_0, 16, None),
    ("Q5_1", 32, 32, _q5_1, None, None),
    ("Q8_0", 256, 32, _q8_0, 128, None),
    ("Q4_K", 16, 32, _q4_k, None, _k_factors),
    ("Q5_K", 32, 32, _q5_k, None, _k_factors),
    ("Q6_K", 64, 16, _q6_k, 32, _q6_k_factors),
    ("Q2_K", 4, 16, _q2_k, None, _q2_k_factors),
    ("Q3_K", 8, 16, _q3_k, 4, _q3_k_factors),
]:
    AFFINE_VIEWS.add(_name, AffineView(_levels, _group, _fn, _zero, _factors))
for _lay in MINMAX_LAYOUTS:
    AFFINE_VIEWS.add(_lay.name, _minmax_view(_lay))
for _log in LOGSCALE_LAYOUTS:  # quant.logscale: the codec's own unpacking is the view
    AFFINE_VIEWS.add(_log.name, AffineView(_log.levels, BLOCK, functools.partial(unpack, lay=_log)))


def affine_parts(w: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-D weight as (codes uint8 (out, in), scale, min float32 (out, in // group))."""
    return affine_parts_factored(w)[0]


def affine_parts_factored(
    w: QuantTensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], Factored | None]:
    """``affine_parts``, and where the view has them its two-level factors, each (out, ...):
    d and dmin (out, in // block), sc and m (out, in // group); read in the same pass."""
    view = AFFINE_VIEWS.get(w.format)
    fmt = w.qformat
    rows, cols = w.shape
    g = cols // view.group
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scale, mn = torch.empty(rows, g), torch.empty(rows, g)
    blocks = w.data.reshape(rows, -1)
    per_row = blocks.shape[1]
    factors: list[list[torch.Tensor]] = []
    for r in range(0, rows, _CHUNK_ROWS):  # (the unpacking's temporaries stay a chunk's size)
        chunk = blocks[r : r + _CHUNK_ROWS].reshape(-1, fmt.bytes_per_block)
        c, s, m = view.unpack(chunk)
        n = c.numel() // cols
        codes[r : r + n], scale[r : r + n], mn[r : r + n] = (
            c.reshape(n, cols),
            s.reshape(n, g),
            m.reshape(n, g),
        )
        if view.factors is not None:
            parts = view.factors(chunk)
            factors.append([t if t is None else t.reshape(n, -1) for t in parts])  # type: ignore[misc]
        if w.release is not None:  # the chunk's file pages: read, so let them go
            w.release(r * per_row, (r + n) * per_row)
    if not factors:
        return (codes, scale, mn), None
    joined = [None if f[0] is None else torch.cat(list(f)) for f in zip(*factors, strict=True)]
    return (codes, scale, mn), (joined[0], joined[1], joined[2], joined[3])  # type: ignore[return-value]


def _regrouped(
    f: Factored, view: AffineView, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A part's two levels with its groups split to ``group`` columns (each sub-scale and min
    repeated: the same values), the mins of a symmetric one in two levels too (-zero * d
    times sc): the factors of one plane over row parts of several k-quants."""
    d, sc, dmin, m = f
    if dmin is None or m is None:
        dmin, m = -(view.zero or 0) * d, sc
    r = view.group // group
    return d, sc.repeat_interleave(r, dim=1), dmin, m.repeat_interleave(r, dim=1)


def _view_matches(w: QuantTensor, view: AffineView) -> bool:
    """Whether the view reproduces the codec bit for bit on a sample of blocks."""
    fmt = w.qformat
    blocks = w.data.reshape(-1, fmt.bytes_per_block)[:_CHECK_BLOCKS]
    codes, scale, mn = view.unpack(blocks)
    n = blocks.shape[0]
    mine = codes.to(torch.float32).reshape(n, -1, view.group) * scale.reshape(n, -1, 1)
    mine = mine + mn.reshape(n, -1, 1)
    return torch.equal(mine.reshape(n, -1), fmt.dequantize_blocks(blocks))


# --- kernels -----------------------------------------------------------------------------------


def _has_int4pack() -> bool:
    # torch < 2.6 names the CPU ops differently (or lacks them): fall back to dequant there
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def int4pack_takes(fmt: QuantFormat) -> bool:
    """int4pack: an affine view of <= 8-bit codes in groups it accepts, and torch has the op."""
    view = AFFINE_VIEWS.get(fmt.name) if fmt.name in AFFINE_VIEWS else None
    return view is not None and view.bits <= 8 and view.group in INT4_GROUPS and _has_int4pack()


def select_kernel(fmt: QuantFormat) -> str:
    """The kernel a weight of ``fmt`` gets: ``plane`` where its affine view fits the C kernel's
    planes (``plane_takes``) and the kernel builds, else ``int4pack`` where torch's op takes
    it, else ``dequant``."""
    if fmt.name in AFFINE_VIEWS:
        view = AFFINE_VIEWS.get(fmt.name)
        if plane_takes(view.levels, view.group) and quant_decode.library() is not None:
            return "plane"
        if int4pack_takes(fmt):
            return "int4pack"
    return "dequant"


def kernel_bytes(fmt: QuantFormat, rows: int, cols: int) -> int | None:
    """The bytes a (rows, cols) QuantLinear of ``fmt`` holds with the auto kernel, from the shape
    alone, at most: its plane (4- or 5-bit codes in 16-row tiles or one byte per code, a
    float32 scale and min per group, float16 where exact, no mins for a symmetric format;
    int4pack, where no plane can be made, holds no more). None where no
    fast kernel takes the format (such weights are read as float)."""
    if select_kernel(fmt) == "dequant":
        return None
    view = AFFINE_VIEWS.get(fmt.name)
    bits = plane_bits(view.levels, view.group)
    if bits < 8:  # tiles of 16 rows
        rows = -(-rows // 16) * 16
    per_group = 4 if view.zero is not None else 8
    return rows * cols * bits // 8 + per_group * rows * (cols // view.group)


@dataclass(frozen=True)
class Int4Pack:
    """A weight in torch's CPU int4pack form: ``planes`` nibble planes side by side along K."""

    packed: torch.Tensor  # uint8, torch's private layout (out_padded, planes * in / 2)
    scales_zeros: torch.Tensor  # bf16 (planes * in // group, out_padded, 2)
    group: int
    planes: int
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def pack_int4(
    w: QuantTensor, affine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
) -> Int4Pack:
    """Repack an affine-format 2-D weight for ``_weight_int4pack_mm_for_cpu``.

    int4pack computes ``(c - 8) * s + z`` per group. Codes with ``n <= 16`` levels map as
    ``c = code + 8 - n // 2``, ``s = scale``, ``z = min + (n // 2) * scale``: codes centred on 8
    and z at the block's midpoint, so both bf16 roundings (of s and z) stay relative to the
    block's magnitude (``z = min + 8 * scale`` for 2-bit codes would be 3x the block's range).
    Wider codes split as ``code = 16 * hi + lo``: plane hi maps like a code of ``ceil(n / 16)``
    levels with scale ``16 * scale``, plane lo is ``(lo, scale, 8 * scale)``; the planes sum to
    the weight and only plane hi carries min. Symmetric GGML formats (Q4_0, Q5_0, Q8_0) get
    z = 0 exactly, and 16 * s, 8 * s stay exact in bf16.
    """
    view = AFFINE_VIEWS.get(w.format)
    codes, scale, mn = affine or affine_parts(w)  # (out, in), (out, G), (out, G)
    # per plane: its codes from a chunk of ``codes`` (made per chunk), its scales and zeros
    parts: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]]
    if view.levels <= 16:
        half = view.levels // 2
        parts = [(lambda c: c + (8 - half), scale, mn + half * scale)]
    else:
        half = -(-view.levels // 16) // 2  # half the levels of plane hi
        parts = [
            (lambda c: (c >> 4) + (8 - half), 16 * scale, mn + 16 * half * scale),
            (lambda c: c & 0x0F, scale, 8 * scale),
        ]
    s = torch.cat([p[1] for p in parts], dim=1)  # (out, planes * G)
    z = torch.cat([p[2] for p in parts], dim=1)
    out, cols = codes.shape
    pad = -out % _INT4_ROWS  # zero rows (code 0, scale 0, zero 0) give 0 and are sliced off
    if pad:
        s, z = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (s, z))
    # row chunks (their int32 codes are 4 bytes per weight and plane), packed row by row
    packed = torch.empty(out + pad, len(parts) * cols // 2, dtype=torch.uint8)
    for r in range(0, out, _CHUNK_ROWS):
        rows = codes[r : r + _CHUNK_ROWS]
        c = torch.cat([p[0](rows) for p in parts], dim=1).to(torch.int32)
        if r + _CHUNK_ROWS >= out and pad:
            c = nn.functional.pad(c, (0, 0, 0, pad))
        chunk = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1)
        packed[r : r + chunk.shape[0]] = chunk
    sz = torch.stack([s, z], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return Int4Pack(packed, sz, view.group, len(parts), out)


def int4pack_kernel(p: Int4Pack) -> Kernel:
    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    packed, sz, group, out = p.packed, p.scales_zeros, p.group, p.out_features
    sliced, two = packed.shape[0] != out, p.planes == 2

    def run(x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)  # the op is fast only for bf16 (fp32 is ~20x slower)
        if two:
            xb = torch.cat([xb, xb], dim=1)  # (M, 2 * in): hi and lo planes in one call
        y = op(xb, packed, group, sz)
        if sliced:
            y = y[:, :out]
        return y.to(x.dtype)

    return run


def int4pack_dense(run: Kernel, in_features: int, chunk: int = 1024) -> torch.Tensor:
    """int4pack's effective weights as a dense bf16 (out, in) matrix: its kernel ``run`` applied
    to rows of the identity (both planes summed), so the dense path multiplies by exactly the
    weights int4pack dequantizes, each rounded once to bf16."""
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    cols = [run(eye[a : a + chunk]) for a in range(0, in_features, chunk)]  # (rows, out) each
    return torch.cat(cols).t().contiguous()


def rows_switch(small: Kernel, dense: torch.Tensor, rows: int) -> Kernel:
    """``small`` below ``rows`` rows of x, a bf16 GEMM with ``dense`` from there on."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < rows:
            return small(x)
        return nn.functional.linear(x.to(torch.bfloat16), dense).to(x.dtype)

    return run


def plane_kernel(plane: QPlane, q8: bool = False) -> Kernel:
    """Every call on the C kernel's plane, float32 on the codec's exact values (``q8``: x
    rounded to 8 bits per 32 values where the codes have an integer path); a row's result is
    the same bit for bit whatever else is in the call (``matmul_f32``)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise QuantError(f"the plane kernel reads host memory; got x on {x.device}")
        xf = x.float()
        return plane.matmul_f32(xf, q8).to(x.dtype)

    return run


# What ``--dtype`` may name besides torch dtypes: float32 weights and activations, with the
# inputs of quantized products rounded to 8 bits per 32 values where the codes have an integer
# path (with AVX-512 VNNI every tile: 4-, 5- and 8-bit codes, groups of 16 too, so every GGML
# type from Q2_K to Q8_0; portable builds: 4-bit tiles), as llama.cpp's CPU kernels do
ACT8 = "act8"


def set_activations(model: nn.Module, act8: bool) -> int:
    """Round the inputs of every plane layer's products to 8 bits (``act8``) or not; returns
    how many layers then take integer dot products (``QPlane.has_q8``; the others stay
    float32)."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.plane is not None:
            n += mod.set_act8(act8)
    return n


def _rows_joined(run: list[QuantTensor]) -> QuantTensor:
    """Row blocks of one format (the same columns) as one tensor of their rows in order."""
    if len(run) == 1:
        return run[0]
    data = torch.cat([p.data.reshape(-1) for p in run])
    return QuantTensor(data, run[0].format, (sum(p.shape[0] for p in run), run[0].shape[1]))


def dequant_kernel(w: QuantTensor, tile_bytes: int = TILE_BYTES) -> Kernel:
    fmt = w.qformat
    rows, cols = w.shape
    blocks = w.data.reshape(rows, -1)  # (out, bytes per row)
    tile = max(1, tile_bytes // (4 * cols))

    def run(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        outs = []
        for r in range(0, rows, tile):
            wt = fmt.dequantize_blocks(blocks[r : r + tile].reshape(-1, fmt.bytes_per_block))
            outs.append(xf @ wt.reshape(-1, cols).t())  # (M, tile)
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.to(x.dtype)

    return run


# --- the layer ---------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """``y = x @ W^T + b`` for a quantized 2-D weight W (out, in); x (..., in) fp32 or bf16.

    The kernel is picked once here (``kernel_name``); ``kernel=`` forces one (``"dequant"``
    keeps the raw blocks, e.g. to keep Q2's 3 bits/weight instead of int4pack's 5; a forced
    ``"int4pack"`` builds no C ``plane`` for one-row calls). Kernels run
    on CPU: the packed weight is a plain attribute, not a buffer, so ``.to()`` leaves it alone.
    """

    nbytes: int  # resident weight bytes (bias excluded)
    kernel: Kernel
    dense_rows: int | None
    plane: QPlane | None
    act8: bool  # set_activations: 8-bit inputs into the plane's products
    # the rows after the plane's, a plane layer of their own (from_row_parts: row blocks in
    # two formats): a submodule (its nbytes its own), which the layer's kernel calls (set_act8)
    tail: QuantLinear | None

    def __init__(
        self, weight: QuantTensor, bias: torch.Tensor | None = None, kernel: str | None = None
    ) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise QuantError(f"QuantLinear needs a 2-D weight, got shape {list(weight.shape)}")
        self._shape(*weight.shape, weight.format, bias)
        name = kernel or select_kernel(weight.qformat)
        if kernel == "int4pack" and not int4pack_takes(weight.qformat):
            raise QuantError(f"{self.format} cannot use the int4pack kernel; use dequant")
        if name in ("plane", "int4pack"):
            view = AFFINE_VIEWS.get(weight.format)
            if not _view_matches(weight, view):  # a wrong view would be silently wrong output
                log.warning("%s: affine view disagrees with the codec; using dequant", self.format)
                name = "dequant"
        if name in ("plane", "int4pack"):
            parts, factors = affine_parts_factored(weight)
            if name == "plane":  # every call on the plane: one copy of the weights
                self.plane = make_plane(*parts, view.levels, view.zero)
                assert self.plane is not None  # (select_kernel checked what make_plane needs)
                if factors is not None:  # (the file's two levels of scales, where read)
                    self.plane.factor(*factors, sb=weight.qformat.block_size // view.group)
                self.kernel, self.nbytes = plane_kernel(self.plane), self.plane.nbytes
            else:
                p = pack_int4(weight, parts)
                self.kernel, self.nbytes = int4pack_kernel(p), p.nbytes
        elif name == "dequant":
            self.kernel, self.nbytes = dequant_kernel(weight), weight.data.nbytes
        else:
            raise QuantError(f"unknown QuantLinear kernel {name!r}; known: dequant, int4pack")
        self.kernel_name = name

    def _shape(self, out: int, inp: int, fmt: str, bias: torch.Tensor | None) -> None:
        """What every QuantLinear holds before its kernel: shape, format, bias (checked)."""
        self.out_features, self.in_features, self.format = out, inp, fmt
        if bias is not None and tuple(bias.shape) != (out,):
            raise QuantError(f"bias of shape {list(bias.shape)} for {out} outputs")
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.dense_rows, self.plane, self.act8, self.tail = None, None, False, None

    @classmethod
    def from_row_parts(
        cls, parts: list[QuantTensor], bias: torch.Tensor | None = None
    ) -> QuantLinear | None:
        """One layer over row blocks stored in different formats that no exact widening joins
        (a fused q/k/v of Q4_K q/k and a Q6_K v, as Q4_K_M files hold). Two runs of formats
        (q/k then v): a plane for each, as each run's own layer holds it (``tail``: the
        second), the one-call decode writing both into the output's rows. Else each part's
        affine values (code * scale + min) in one C plane, the groups brought to the smallest
        group size by repeating their scale and min (the same values), the codes at the widest
        part's bits (Q4_K rows widened to Q6_K's 6-bit codes in groups of 16: ~40% more bytes,
        and those products at Q6_K's speed). None where some part has no affine view or no
        plane can hold them."""
        split = cls._two_planes(parts, bias)
        if split is not None:
            return split
        views = [AFFINE_VIEWS.get(p.format) for p in parts if p.format in AFFINE_VIEWS]
        if len(views) != len(parts) or any(len(p.shape) != 2 for p in parts):
            return None
        group, levels = min(v.group for v in views), max(v.levels for v in views)
        cols = parts[0].shape[1]
        if any(p.shape[1] != cols for p in parts) or cols % group or quant_decode.library() is None:
            return None
        if not plane_takes(levels, group):
            return None
        codes, scales, mins, factors = [], [], [], []
        for p, v in zip(parts, views, strict=True):
            if not _view_matches(p, v):
                return None
            (c, sc, mn), f = affine_parts_factored(p)
            codes.append(c)
            scales.append(sc.repeat_interleave(v.group // group, dim=1))
            mins.append(mn.repeat_interleave(v.group // group, dim=1))
            factors.append(None if f is None else _regrouped(f, v, group))
        plane = make_plane(torch.cat(codes), torch.cat(scales), torch.cat(mins), levels)
        if plane is None:
            return None
        blocks = {p.qformat.block_size for p in parts}
        if len(blocks) == 1 and all(f is not None for f in factors):  # (k-quants: two levels)
            d, sc, dmin, m = (torch.cat(t) for t in zip(*factors, strict=True))
            plane.factor(d, sc, dmin, m, sb=blocks.pop() // group)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shape(plane.n, cols, "+".join(dict.fromkeys(p.format for p in parts)), bias)
        layer.plane, layer.kernel_name = plane, "plane"
        layer.kernel, layer.nbytes = plane_kernel(plane), plane.nbytes
        return layer

    @classmethod
    def _two_planes(
        cls, parts: list[QuantTensor], bias: torch.Tensor | None
    ) -> QuantLinear | None:
        """from_row_parts's layer of two runs of formats, each run's rows one plane layer; None
        where there are more runs or a run's layer has no plane."""
        runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.format)]
        if len(runs) != 2 or any(len(p.shape) != 2 for p in parts):
            return None
        if len({p.shape[1] for p in parts}) != 1:
            return None
        layers = [cls(_rows_joined(run)) for run in runs]
        if any(one.plane is None or one.kernel_name != "plane" for one in layers):
            return None
        head, tail = layers
        plane = head.plane
        fmt = "+".join(dict.fromkeys(p.format for p in parts))
        head._shape(head.out_features + tail.out_features, head.in_features, fmt, bias)
        head.plane, head.tail = plane, tail
        head.set_act8(False)
        return head

    def set_act8(self, act8: bool) -> bool:
        """Round the inputs of the plane's products (and the tail's) to 8 bits or not; returns
        whether the plane takes integer products then (``QPlane.has_q8``)."""
        assert self.plane is not None
        self.act8, first, tail = act8, plane_kernel(self.plane, act8), self.tail
        self.kernel = first
        if tail is not None:
            tail.set_act8(act8)
            self.kernel = lambda x: torch.cat([first(x), tail(x)], dim=-1)
        return self.plane.has_q8()

    def attach_dense(self, rows: int) -> None:
        """Calls of ``rows`` rows or more multiply by a dense bf16 copy of the int4pack
        weights (a no-op for other kernels: ``plane`` is as fast without a copy)."""
        if self.kernel_name != "int4pack" or self.dense_rows is not None:
            return
        if rows < 1:
            raise QuantError(f"dense_batch: must be at least 1 row, got {rows}")
        dense = int4pack_dense(self.kernel, self.in_features)
        self.kernel = rows_switch(self.kernel, dense, rows)
        self.dense_rows, self.nbytes = rows, self.nbytes + dense.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, kernel={self.kernel_name}, bias={self.bias is not None}"
            + (f", dense_rows={self.dense_rows}" if self.dense_rows else "")
            + (f", plane={self.plane.bits}-bit" if self.plane is not None else "")
        )
