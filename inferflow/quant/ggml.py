"""GGML tensor types as quant formats: vectorized torch codecs, bit-exact against gguf-py.

Each codec transcribes the numpy code of gguf-py's ``gguf/quants.py`` (itself bit-exact with
ggml's ``ggml-quants.c``) operation for operation: fp16 scales are widened to float32 first and
every float product/sum is done in float32 in the same order, so results match to the bit. Integer
unpacking may differ in form (it is exact either way). Blocks are the rows of a uint8 tensor;
no Python loop runs over blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferflow.errors import QuantError
from inferflow.quant.formats import (
    DequantizeBlocks,
    QuantFormat,
    QuantizeBlocks,
    register_format,
)

QK_K = 256  # super-block size of the k-quants (ggml-common.h)

# GGML type id -> format name, for the GGUF reader (ggml.h ``enum ggml_type``); filled by _add.
GGML_TYPE_NAMES: dict[int, str] = {}


# --- helpers ---------------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of each block, widened to float32: (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _consts(values: list[int], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).reshape(shape)


def _shr(x: torch.Tensor, shifts: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """``x >> shifts`` broadcast like gguf-py's ``>> np.array(shifts).reshape(shape)``."""
    return x >> _consts(shifts, shape, x)


def _check(blocks: torch.Tensor, nbytes: int, name: str) -> int:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nbytes:
        raise QuantError(
            f"{name}: expected uint8 blocks of shape (n, {nbytes}), "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )
    return blocks.shape[0]


def _floats(x: torch.Tensor, block_size: int, name: str) -> torch.Tensor:
    """Quantizer input as float32 (n, block_size), like gguf-py's ``astype(np.float32)``."""
    if x.dim() != 2 or x.shape[1] != block_size or not x.is_floating_point():
        raise QuantError(
            f"{name}: expected float blocks of shape (n, {block_size}), "
            f"got {x.dtype} {list(x.shape)}"
        )
    return x.to(torch.float32)


def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 (n, 1) -> its fp16 bytes (n, 2), rounding to nearest even like numpy's astype."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) packed bytes -> (n, 2k): all low nibbles, then all high nibbles (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _int(x: torch.Tensor, offset: int) -> torch.Tensor:
    """Small unsigned codes minus an offset as float32 (exact: |values| < 2**8)."""
    return (x.to(torch.int16) - offset).to(torch.float32)


# --- plain float types (ggml.c fp16/bf16 conversions; gguf-py quants.quantize/BF16) ---------


def _deq_f32(blocks: torch.Tensor) -> torch.Tensor:
    _check(blocks, 4, "F32")
    return blocks.contiguous().view(torch.float32)


def _q_f32(x: torch.Tensor) -> torch.Tensor:
    return _floats(x, 1, "F32").contiguous().view(torch.uint8)


def _deq_f16(blocks: torch.Tensor) -> torch.Tensor:
    _check(blocks, 2, "F16")
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _q_f16(x: torch.Tensor) -> torch.Tensor:
    return _floats(x, 1, "F16").to(torch.float16).contiguous().view(torch.uint8)


def _deq_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py BF16.dequantize_blocks: (int16 -> int32) << 16, viewed as float32
    _check(blocks, 2, "BF16")
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q_bf16(x: torch.Tensor) -> torch.Tensor:
    # gguf-py BF16.quantize_blocks (= ggml_compute_fp32_to_bf16): quiet NaNs, round to nearest
    # even; uint32 arithmetic is emulated in int64.
    n = _floats(x, 1, "BF16").contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    n = torch.where((n & 0x7FFFFFFF) > 0x7F800000, (n & 0xFFFF0000) | (64 << 16), n)
    n = ((n + (0x7FFF + ((n >> 16) & 1))) >> 16) & 0xFFFF
    n = torch.where(n >= 0x8000, n - 0x10000, n)  # as int16 without relying on cast wrapping
    return n.to(torch.int16).view(torch.uint8)


# --- 32-weight legacy quants (gguf-py Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) ---------------------------


def _deq_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q4_0.dequantize_blocks: d * (nibble - 8)
    _check(blocks, 18, "Q4_0")
    d = _f16(blocks, 0)
    return d * _int(_nibbles(blocks[:, 2:]), 8)


def _q_q4_0(x: torch.Tensor) -> torch.Tensor:
    # gguf-py Q4_0.quantize_blocks: d = (signed value of largest magnitude) / -8
    x = _floats(x, 32, "Q4_0")
    imax = x.abs().argmax(dim=-1, keepdim=True)  # first index on ties, like numpy
    d = torch.gather(x, -1, imax) / -8
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_to_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], dim=-1)


def _deq_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q4_1.dequantize_blocks: (d * nibble) + m
    _check(blocks, 20, "Q4_1")
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return (d * _nibbles(blocks[:, 4:]).to(torch.float32)) + m


def _q_q4_1(x: torch.Tensor) -> torch.Tensor:
    # gguf-py Q4_1.quantize_blocks: d = (max - min) / 15, q = trunc((x - min) / d + 0.5)
    x = _floats(x, 32, "Q4_1")
    mx = x.amax(dim=-1, keepdim=True)
    mn = x.amin(dim=-1, keepdim=True)
    d = (mx - mn) / 15
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.trunc((x - mn) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([_to_f16_bytes(d), _to_f16_bytes(mn), qs], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) little-endian uint32 bytes -> (n, 32) bits, bit j of the word at column j."""
    return (_shr(qh.unsqueeze(-1), list(range(8)), (1, 1, 8)) & 1).reshape(qh.shape[0], 32)


def _pack_bits32(bits: torch.Tensor) -> torch.Tensor:
    """(n, 32) of 0/1 -> (n, 4) bytes, like ``np.packbits(..., bitorder="little")``."""
    weights = _consts([1 << i for i in range(8)], (1, 1, 8), bits)
    return (bits.reshape(-1, 4, 8) * weights).sum(dim=-1).to(torch.uint8)


def _deq_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q5_0.dequantize_blocks: d * ((nibble | qh_bit << 4) - 16)
    _check(blocks, 22, "Q5_0")
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:]) | (_bits32(blocks[:, 2:6]) << 4)
    return d * _int(q, 16)


def _q5_pack(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    return _pack_bits32(q >> 4), qs


def _q_q5_0(x: torch.Tensor) -> torch.Tensor:
    # gguf-py Q5_0.quantize_blocks
    x = _floats(x, 32, "Q5_0")
    imax = x.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(x, -1, imax) / -16
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.trunc(x * inv + 16.5).clamp(0, 31).to(torch.uint8)
    qh, qs = _q5_pack(q)
    return torch.cat([_to_f16_bytes(d), qh, qs], dim=-1)


def _deq_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q5_1.dequantize_blocks: (d * q) + m
    _check(blocks, 24, "Q5_1")
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_bits32(blocks[:, 4:8]) << 4)
    return (d * q.to(torch.float32)) + m


def _q_q5_1(x: torch.Tensor) -> torch.Tensor:
    # gguf-py Q5_1.quantize_blocks
    x = _floats(x, 32, "Q5_1")
    mx = x.amax(dim=-1, keepdim=True)
    mn = x.amin(dim=-1, keepdim=True)
    d = (mx - mn) / 31
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.trunc((x - mn) * inv + 0.5).clamp(0, 31).to(torch.uint8)
    qh, qs = _q5_pack(q)
    return torch.cat([_to_f16_bytes(d), _to_f16_bytes(mn), qh, qs], dim=-1)


def _deq_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q8_0.dequantize_blocks: x * d
    _check(blocks, 34, "Q8_0")
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(torch.int8).to(torch.float32) * d


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, same steps as gguf-py ``np_roundf`` (C ``roundf``)."""
    a = x.abs()
    floored = torch.floor(a)
    b = floored + torch.floor(2 * (a - floored))
    return torch.sign(x) * b


def _q_q8_0(x: torch.Tensor) -> torch.Tensor:
    # gguf-py Q8_0.quantize_blocks (bit-exact with quantize_row_q8_0_ref)
    x = _floats(x, 32, "Q8_0")
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    qs = _roundf(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_to_f16_bytes(d), qs], dim=-1)


# --- k-quants, 256-weight super-blocks (gguf-py Q2_K..Q6_K; ggml dequantize_row_q8_K) --------


def _deq_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q2_K.dequantize_blocks: (d * sc) * q - (dmin * m), 16 sub-blocks of 16
    n = _check(blocks, 84, "Q2_K")
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _shr(qs.reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q_q2_k(x: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``quantize_row_q2_K_ref``: 16 sub-blocks of 16, each fitted by
    make_qkx2_quants over 4 levels (weights |x|, absolute error, grids widened from -0.5 in 15
    steps); scales and minimums in 4 bits against the super-block's fp16 d and dmin (the
    largest / 15), then the codes re-chosen on the stored grid."""
    x = _floats(x, QK_K, "Q2_K")
    n = x.shape[0]
    sub = x.reshape(n * 16, 16)
    scales, mins, first = _make_qkx2(sub, sub.abs(), 3, -0.5, 0.1, 15, mad=True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    head, nibbles = [], []
    for v in (scales, mins):
        top = v.amax(1, keepdim=True).clamp(min=0)
        inv = 15 / torch.where(top > 0, top, 1.0)
        nibbles.append(torch.where(top > 0, _nearest(inv * v), 0.0).to(torch.uint8))
        head.append((top / 15).to(torch.float16))
    packed = nibbles[0] | (nibbles[1] << 4)  # (n, 16)
    d = head[0].to(torch.float32) * nibbles[0].to(torch.float32)
    dm = head[1].to(torch.float32) * nibbles[1].to(torch.float32)
    safe = torch.where(d != 0, d, 1.0)[..., None]
    q = _nearest((x.reshape(n, 16, 16) + dm[..., None]) / safe).clamp(0, 3)
    q = torch.where(d[..., None] != 0, q, first.reshape(n, 16, 16)).to(torch.uint8)
    d16 = torch.cat(head, dim=-1).contiguous().view(torch.uint8)
    return torch.cat([packed, _crumbs(q), d16], dim=-1)


def _crumbs(q: torch.Tensor) -> torch.Tensor:
    """2-bit codes (n, 256) -> 64 bytes: byte l of 32 in half h holds codes 128h + l at bits
    0-1, + 32 at 2-3, + 64 at 4-5, + 96 at 6-7 (Q2_K's and Q3_K's qs)."""
    q = q.reshape(q.shape[0], 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _make_q3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml-quants.c ``make_q3_quants`` (nmax 4, do_rmse) over rows of ``x`` (m, n): codes in
    [-4, 4) on the grid -4 / max (max: the first value of largest magnitude), then up to 5
    passes moving one code at a time where that raises the x^2-weighted fit (sum l x w)^2 /
    sum l^2 w, in ggml's order. Returns (the least-squares scale (m,), codes + 4 (m, n)); an
    all-zero row gives scale 0 and codes 0."""
    ax = x.abs()
    top = x.gather(1, ax.argmax(1, keepdim=True))  # (first of the largest |x|)
    zero = ax.amax(1, keepdim=True) < _GROUP_MAX_EPS
    iscale = -4 / torch.where(zero, 1.0, top)
    L = _nearest(iscale * x).clamp(-4, 3)
    w = x * x
    sumlx = _seq_sum((w * x * L).t())[0]
    suml2 = _seq_sum((w * L * L).t())[0]
    live = torch.ones(x.shape[0], dtype=torch.bool)
    for _ in range(5):
        changed = torch.zeros_like(live)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = _nearest(xi * sl2 / torch.where(slx > 0, slx, 1.0)).clamp(-4, 3)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = live & (slx > 0) & (new != li) & (sl22 > 0)
            take &= slx2 * slx2 * suml2 > sumlx * sumlx * sl22
            L[:, i] = torch.where(take, new, li)
            sumlx, suml2 = torch.where(take, slx2, sumlx), torch.where(take, sl22, suml2)
            changed |= take
        live &= changed
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), 0.0)
    zero = zero[:, 0]
    return torch.where(zero, 0.0, scale), torch.where(zero[:, None], 0.0, L + 4)


def _q_q3_k(x: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``quantize_row_q3_K_ref``: 16 sub-blocks of 16 fitted by make_q3_quants;
    their scales as 6-bit signed multiples of the super-block's fp16 d (-max / 32, max the
    scale of largest magnitude), then the codes re-chosen on the stored grid: low 2 bits in qs,
    the third in hmask (bit k of byte m: code 32k + m)."""
    x = _floats(x, QK_K, "Q3_K")
    n = x.shape[0]
    scales, first = _make_q3(x.reshape(n * 16, 16))
    scales = scales.reshape(n, 16)
    top = scales.gather(1, scales.abs().argmax(1, keepdim=True))  # (n, 1)
    nz = top != 0
    iscale = -32 / torch.where(nz, top, 1.0)
    ls = torch.where(nz, _nearest(iscale * scales).clamp(-32, 31) + 32, 0.0).to(torch.uint8)
    low = (ls[:, :8] & 0x0F) | ((ls[:, 8:] & 0x0F) << 4)
    hi = (ls >> 4).reshape(n, 4, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[None, :, None]
    packed = torch.cat([low, hi[:, 0] | hi[:, 1] | hi[:, 2] | hi[:, 3]], dim=-1)  # (n, 12)
    d16 = torch.where(nz, 1 / iscale, 0.0).to(torch.float16)
    d = d16.to(torch.float32) * (ls.to(torch.float32) - 32)  # (n, 16)
    safe = torch.where(d != 0, d, 1.0)[..., None]
    q = _nearest(x.reshape(n, 16, 16) / safe).clamp(-4, 3) + 4
    q = torch.where(d[..., None] != 0, q, first.reshape(n, 16, 16)).to(torch.uint8).reshape(n, 256)
    high = q > 3
    hmask = (
        high.reshape(n, 8, 32).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)[None, :, None]
    ).sum(1)
    q = torch.where(high, q - 4, q)
    return torch.cat(
        [hmask.to(torch.uint8), _crumbs(q), packed, d16.contiguous().view(torch.uint8)], dim=-1
    )


def _deq_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q3_K.dequantize_blocks: 6-bit signed scales, q = low2 - 4 * (not hmask bit)
    n = _check(blocks, 110, "Q3_K")
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    lsc = _shr(scales[:, :8].reshape(n, 1, 8), [0, 4], (1, 2, 1)).reshape(n, 16)
    hsc = _shr(scales[:, 8:].reshape(n, 1, 4), [0, 2, 4, 6], (1, 4, 1)).reshape(n, 16)
    sc = (lsc & 0x0F) | ((hsc & 0x03) << 4)
    dl = (d * _int(sc, 32)).reshape(n, 16, 1)
    ql = _shr(qs.reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = _shr(hmask.reshape(n, -1, 1, 32), list(range(8)), (1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = (ql.to(torch.int16) - ((qh ^ 1).to(torch.int16) << 2)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py Q4_K.get_scale_min: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _deq_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q4_K.dequantize_blocks: (d * sc) * q - (dmin * m), 8 sub-blocks of 32
    n = _check(blocks, 144, "Q4_K")
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    q = _shr(blocks[:, 16:].reshape(n, -1, 1, 32), [0, 4], (1, 1, 2, 1)) & 0x0F
    q = q.reshape(n, -1, 32).to(torch.float32)
    return (dl * q - dm).reshape(n, QK_K)


def _nearest(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``: round half to even (its float trick), as float32."""
    return torch.round(x)


def _seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Column sums of ``t`` (n, m) as ggml's loops add a group's n terms: one at a time in
    float32 (1, m). (The fits below hold groups as columns, so each term is a contiguous row.)"""
    acc = torch.zeros(t.shape[1], dtype=t.dtype)
    for term in t:
        acc += term
    return acc[None, :]


def _make_qkx2(
    x: torch.Tensor,
    w: torch.Tensor,
    nmax: int,
    rmin: float = -1.0,
    rdelta: float = 0.1,
    nstep: int = 20,
    mad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml-quants.c ``make_qkx2_quants`` over rows of ``x`` (m, n) with weights ``w``: the
    (scale, -min) of least weighted squared error among min-max and ``nstep`` + 1 widened
    grids, each refitted by least squares with the minimum held <= 0 (``mad``: the grids
    compared by weighted absolute instead of squared error). Returns (m, 1) each and
    the best grid's codes (m, n). Float32 throughout, sums one term at a time as ggml's loops
    (test_llama_cpp_interchange measures how often the bytes match llama-quantize's)."""
    x, w = x.t().contiguous(), w.t().contiguous()  # (n, m): groups as columns
    mn = x.amin(0, keepdim=True).clamp(max=0)
    mx = x.amax(0, keepdim=True)
    flat = mx == mn
    rng = torch.where(flat, 1.0, mx - mn)
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    iscale = nmax / rng
    scale = 1 / iscale
    lq = _nearest(iscale * (x - mn)).clamp(0, nmax)

    def loss(d: torch.Tensor) -> torch.Tensor:
        return d.abs() if mad else d.square()

    best = _seq_sum(w * loss(scale * lq + mn - x))
    best_scale, best_min, best_l = scale, mn, lq
    for step in range(nstep + 1):
        # (as in ggml: each grid starts from the best minimum so far, not the block's own)
        f32 = torch.float32  # rmin + rdelta * step + nmax, each step rounded to float32
        top = (torch.tensor(rmin, dtype=f32) + torch.tensor(rdelta, dtype=f32) * step) + nmax
        iscale = top / torch.where(flat, 1.0, mx - best_min)
        lq = _nearest(iscale * (x - best_min)).clamp(0, nmax)
        sum_l, sum_l2, sum_xl = _seq_sum(w * lq), _seq_sum(w * lq * lq), _seq_sum(w * lq * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = torch.where(pos, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_min = torch.where(pos, 0.0, this_min)
        err = _seq_sum(w * loss(this_scale * lq + this_min - x))
        better = ok & (err < best)
        best = torch.where(better, err, best)
        best_scale = torch.where(better, this_scale, best_scale)
        best_min = torch.where(better, this_min, best_min)
        best_l = torch.where(better, lq, best_l)
    codes = torch.where(flat, 0.0, best_l).t()
    return torch.where(flat, 0.0, best_scale).t(), -torch.where(flat, mn, best_min).t(), codes


def _k_affine(
    x: torch.Tensor, name: str, nmax: int, rmin: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ggml-quants.c ``quantize_row_q4_K_ref`` and ``quantize_row_q5_K_ref`` share: 8
    sub-blocks of 32, each fitted by make_qkx2_quants (weights: rms + |x|; ``nmax`` levels,
    widened grids from ``rmin``), their scales and minimums stored in 6 bits against the
    super-block's fp16 d and dmin, then the codes re-chosen on the stored grid. Returns the
    head (d, dmin: 4 bytes), the 12 bytes of scales and minimums, and the codes (n, 8, 32)."""
    x = _floats(x, QK_K, name)
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av = (_seq_sum(sub.t().square()).t() / 32).sqrt()
    scales, mins, first = _make_qkx2(sub, av + sub.abs(), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = scales.amax(1, keepdim=True)
    max_min = mins.amax(1, keepdim=True)
    inv_scale = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1.0), 0.0)
    ls = _nearest(inv_scale * scales).clamp(max=63).to(torch.uint8)
    lm = _nearest(inv_min * mins).clamp(max=63).to(torch.uint8)
    packed = torch.cat(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4),
        ],
        dim=-1,
    )
    d16, dmin16 = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    sc, m = _scale_min_k4(packed)
    d = d16.to(torch.float32) * sc.to(torch.float32)  # (n, 8)
    dm = dmin16.to(torch.float32) * m.to(torch.float32)
    safe = torch.where(d != 0, d, 1.0)[..., None]
    q = _nearest((x.reshape(n, 8, 32) + dm[..., None]) / safe).clamp(0, nmax)
    q = torch.where(d[..., None] != 0, q, first.reshape(n, 8, 32))  # (scale 0: the fit's codes)
    head = torch.cat([d16, dmin16], dim=-1).contiguous().view(torch.uint8)
    return head, packed, q.to(torch.uint8)


def _low_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes (n, 8, 32) of sub-blocks 2c and 2c + 1 as one byte each (low, high nibble)."""
    q = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _q_q4_k(x: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``quantize_row_q4_K_ref`` (``_k_affine`` with 15 levels)."""
    head, packed, q = _k_affine(x, "Q4_K", 15, -1.0, 20)
    return torch.cat([head, packed, _low_nibbles(q)], dim=-1)


def _q_q5_k(x: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``quantize_row_q5_K_ref``: ``_k_affine`` with 31 levels (grids widened
    from -0.5, 15 steps); the fifth bits in qh (bit s of byte j: sub-block s's code j)."""
    head, packed, q = _k_affine(x, "Q5_K", 31, -0.5, 15)
    bits = (q >> 4).to(torch.int32) << torch.arange(8, dtype=torch.int32)[None, :, None]
    qh = bits.sum(1).to(torch.uint8)  # (n, 32)
    return torch.cat([head, packed, qh, _low_nibbles(q)], dim=-1)


def _deq_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q5_K.dequantize_blocks: as Q4_K with a fifth bit from qh
    n = _check(blocks, 176, "Q5_K")
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    ql = _shr(blocks[:, 48:].reshape(n, -1, 1, 32), [0, 4], (1, 1, 2, 1)) & 0x0F
    qh = _shr(blocks[:, 16:48].reshape(n, -1, 1, 32), list(range(8)), (1, 1, 8, 1)) & 1
    q = (ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << 4)).to(torch.float32)
    return (dl * q - dm).reshape(n, QK_K)


def _deq_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py Q6_K.dequantize_blocks: (d * int8 scale) * (q6 - 32), 16 sub-blocks of 16
    n = _check(blocks, 210, "Q6_K")
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(blocks, 208) * scales).reshape(n, 16, 1)
    lo = (_shr(ql.reshape(n, -1, 1, 64), [0, 4], (1, 1, 2, 1)) & 0x0F).reshape(n, -1, 32)
    hi = (_shr(qh.reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)) & 3).reshape(n, -1, 32)
    q = _int(lo | (hi << 4), 32).reshape(n, 16, -1)
    return (d * q).reshape(n, QK_K)


_GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a group whose largest |x| is below it is all zeros


def _make_qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml-quants.c ``make_qx_quants`` with rmse_type 1 (weights x^2) over rows of ``x``
    (m, n): signed codes in [-nmax, nmax) on the grid -nmax / max (max: the first value of
    largest magnitude) and 18 neighbours -(nmax + 0.1 is) / max, the least-squares scale of the
    best. Returns (scale (m, 1), codes + nmax (m, n) float32); sums in ggml's order."""
    f32 = torch.float32
    x = x.t().contiguous()  # (n, m): groups as columns
    top = torch.gather(x, 0, x.abs().argmax(0, keepdim=True))
    zero = top.abs() < _GROUP_MAX_EPS
    safe = torch.where(zero, 1.0, top)
    w = x * x
    wx = w * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = _nearest(iscale * x).clamp(-nmax, nmax - 1)
        return q, _seq_sum(wx * q), _seq_sum(w * q * q)

    q, sumlx, suml2 = fit(-nmax / safe)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), 0.0)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        top_q = torch.tensor(nmax, dtype=f32) + torch.tensor(0.1, dtype=f32) * step
        q2, lx, l2 = fit(-top_q / safe)
        better = (l2 > 0) & (lx * lx > best * l2)
        q = torch.where(better, q2, q)
        scale = torch.where(better, lx / torch.where(l2 > 0, l2, 1.0), scale)
        best = torch.where(better, scale * lx, best)
    return torch.where(zero, 0.0, scale).t(), torch.where(zero, 0.0, q + nmax).t()


def _q_q6_k(x: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``quantize_row_q6_K_ref``: 16 sub-blocks of 16, each fitted by
    make_qx_quants(nmax 32); their scales stored as int8 against the super-block's fp16 d (the
    scale of largest magnitude maps to -128), then the codes re-chosen on the stored grid (a
    sub-block whose stored scale is 0 keeps make_qx_quants' codes)."""
    x = _floats(x, QK_K, "Q6_K")
    n = x.shape[0]
    scales, first = _make_qx(x.reshape(n * 16, 16), 32)
    scales, codes = scales.reshape(n, 16), first.reshape(n, 16, 16)
    at = scales.abs().argmax(1, keepdim=True)
    max_scale = torch.gather(scales, 1, at)
    zero = max_scale.abs() < _GROUP_MAX_EPS
    iscale = -128 / torch.where(zero, 1.0, max_scale)
    d16 = torch.where(zero, 0.0, 1 / iscale).to(torch.float16)
    sc = _nearest(iscale * scales).clamp(max=127)
    sc = torch.where(zero, 0.0, sc)
    d = d16.to(torch.float32) * sc  # (n, 16)
    safe = torch.where(d != 0, d, 1.0)[..., None]
    again = _nearest(x.reshape(n, 16, 16) / safe).clamp(-32, 31) + 32
    codes = torch.where(d[..., None] != 0, again, codes)
    codes = torch.where(zero[..., None], 0.0, codes).to(torch.uint8).reshape(n, 2, 4, 32)
    # per half of 128: ql[l] = q[l] | q[l + 64] << 4, ql[32 + l] = q[32 + l] | q[96 + l] << 4,
    # qh[l] = bits 4-5 of q[l], q[32 + l], q[64 + l], q[96 + l] at 0, 2, 4, 6
    lo, hi = codes & 0x0F, codes >> 4
    ql = torch.cat([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=-1)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    scale_bytes = sc.to(torch.int8).view(torch.uint8)
    head = d16.contiguous().view(torch.uint8)
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), scale_bytes, head], dim=-1)


def _deq_q8_k(blocks: torch.Tensor) -> torch.Tensor:
    # ggml-quants.c dequantize_row_q8_K: y = d * qs with a float32 d (gguf-py has no Q8_K);
    # the 16 int16 bsums after qs are only used by dot products.
    _check(blocks, 292, "Q8_K")
    d = blocks[:, :4].contiguous().view(torch.float32)
    return d * blocks[:, 4:260].view(torch.int8).to(torch.float32)


# --- other cheap types (gguf-py IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4) -------------------------

_IQ4_NL_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _iq4_lookup(idx: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_IQ4_NL_VALUES, dtype=torch.float32, device=idx.device)
    return table[idx.long()]


def _deq_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py IQ4_NL.dequantize_blocks: d * kvalues[nibble]
    _check(blocks, 18, "IQ4_NL")
    return _f16(blocks, 0) * _iq4_lookup(_nibbles(blocks[:, 2:]))


def _deq_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py IQ4_XS.dequantize_blocks: (d * (6-bit scale - 32)) * kvalues[nibble]
    n = _check(blocks, 136, "IQ4_XS")
    d = _f16(blocks, 0)
    sh = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sl = _shr(blocks[:, 4:8].reshape(n, -1, 1), [0, 4], (1, 1, 2)).reshape(n, -1) & 0x0F
    sh = _shr(sh.reshape(n, 1, -1), [2 * i for i in range(8)], (1, -1, 1)).reshape(n, -1) & 3
    dl = (d * _int(sl.to(torch.int32) | (sh << 4), 32)).reshape(n, -1, 1)
    q = _shr(blocks[:, 8:].reshape(n, -1, 1, 16), [0, 4], (1, 1, 2, 1)) & 0x0F
    return (dl * _iq4_lookup(q.reshape(n, -1, 32))).reshape(n, -1)


def _deq_tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py TQ1_0.dequantize_blocks: base-3 digits via uint8 (wrapping) multiplies, then
    # (q * 3) >> 8 - 1
    n = _check(blocks, 54, "TQ1_0")
    qs = blocks[:, :52].to(torch.int32)
    d = _f16(blocks, 52)
    pow3 = _consts([1, 3, 9, 27, 81], (1, 1, 5, 1), qs)
    q0 = (qs[:, :32].reshape(n, -1, 1, 32) * pow3).reshape(n, -1)
    q1 = (qs[:, 32:48].reshape(n, -1, 1, 16) * pow3).reshape(n, -1)
    qh = (qs[:, 48:52].reshape(n, -1, 1, 4) * pow3[:, :, :4]).reshape(n, -1)
    q = torch.cat([q0, q1, qh], dim=-1) & 0xFF
    return d * ((q * 3) >> 8).sub(1).to(torch.float32)


def _deq_tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py TQ2_0.dequantize_blocks: d * (2-bit q - 1)
    n = _check(blocks, 66, "TQ2_0")
    d = _f16(blocks, 64)
    q = _shr(blocks[:, :64].reshape(n, -1, 1, 32), [0, 2, 4, 6], (1, 1, 4, 1)) & 3
    return d * _int(q.reshape(n, -1), 1)


_MXFP4_VALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]  # e2m1, doubled


def _deq_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py MXFP4.dequantize_blocks with ggml_e8m0_to_fp32_half for the shared exponent
    n = _check(blocks, 17, "MXFP4")
    e = blocks[:, :1].to(torch.int64)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.to(torch.int32).view(torch.float32)
    q = _shr(blocks[:, 1:].reshape(n, 1, 16), [0, 4], (1, 2, 1)).reshape(n, 32) & 0x0F
    table = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    return d * table[q.long()]


# --- exact widenings: blocks rewritten in a wider format with the same values ---------------
# (a fused q/k/v whose parts a converter stored as Q5_0 and Q8_0 becomes one Q8_0 tensor)

Reencode = Callable[[torch.Tensor], torch.Tensor]  # (n, bytes) blocks -> (n, bytes) blocks


def _as_q8_0(codes: Callable[[torch.Tensor], torch.Tensor], offset: int) -> Reencode:
    def run(blocks: torch.Tensor) -> torch.Tensor:  # d * (q - offset) == d * int8(q - offset)
        q = (codes(blocks).to(torch.int16) - offset).to(torch.int8).view(torch.uint8)
        return torch.cat([blocks[:, :2], q], dim=-1)

    return run


EXACT_WIDENINGS: dict[tuple[str, str], Reencode] = {
    ("Q4_0", "Q8_0"): _as_q8_0(lambda b: _nibbles(b[:, 2:]), 8),
    ("Q5_0", "Q8_0"): _as_q8_0(lambda b: _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4), 16),
}


def common_format(formats: set[str]) -> str | None:
    """The one format every block format in ``formats`` is, or widens to exactly; None when
    there is none."""
    for target in sorted(formats):
        if all(f == target or (f, target) in EXACT_WIDENINGS for f in formats):
            return target
    return None


# --- the table -------------------------------------------------------------------------------


def _add(
    name: str,
    type_id: int,
    block_size: int,
    nbytes: int,
    deq: DequantizeBlocks,
    quant: QuantizeBlocks | None = None,
) -> None:
    register_format(QuantFormat(name, block_size, nbytes, deq, quant, ggml_type=type_id))
    GGML_TYPE_NAMES[type_id] = name


# (name, ggml type id, weights per block, bytes per block): ggml.h / ggml.c type_traits
_add("F32", 0, 1, 4, _deq_f32, _q_f32)
_add("F16", 1, 1, 2, _deq_f16, _q_f16)
_add("Q4_0", 2, 32, 18, _deq_q4_0, _q_q4_0)
_add("Q4_1", 3, 32, 20, _deq_q4_1, _q_q4_1)
_add("Q5_0", 6, 32, 22, _deq_q5_0, _q_q5_0)
_add("Q5_1", 7, 32, 24, _deq_q5_1, _q_q5_1)
_add("Q8_0", 8, 32, 34, _deq_q8_0, _q_q8_0)
_add("Q2_K", 10, QK_K, 84, _deq_q2_k, _q_q2_k)
_add("Q3_K", 11, QK_K, 110, _deq_q3_k, _q_q3_k)
_add("Q4_K", 12, QK_K, 144, _deq_q4_k, _q_q4_k)
_add("Q5_K", 13, QK_K, 176, _deq_q5_k, _q_q5_k)
_add("Q6_K", 14, QK_K, 210, _deq_q6_k, _q_q6_k)
_add("Q8_K", 15, QK_K, 292, _deq_q8_k)
_add("IQ4_NL", 20, 32, 18, _deq_iq4_nl)
_add("IQ4_XS", 23, QK_K, 136, _deq_iq4_xs)
_add("BF16", 30, 1, 2, _deq_bf16, _q_bf16)
_add("TQ1_0", 34, QK_K, 54, _deq_tq1_0)
_add("TQ2_0", 35, QK_K, 66, _deq_tq2_0)
_add("MXFP4", 39, 32, 17, _deq_mxfp4)
