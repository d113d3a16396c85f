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

from inferflow.quant.formats import (
    DequantizeBlocks,
    QuantFormat,
    QuantizeBlocks,
    register_format,
)
from inferflow.quant.ggml_blocks import (  # (the codecs' shared helpers; linear.py reads them here)
    QK_K,
    _check,
    _consts,
    _f16,
    _floats,
    _int,
    _nibbles,
    _scale_min_k4,
    _shr,
    _to_f16_bytes,
)
from inferflow.quant.kquant_fit import _q_q2_k, _q_q3_k, _q_q4_k, _q_q5_k, _q_q6_k

# GGML type id -> format name, for the GGUF reader (ggml.h ``enum ggml_type``); filled by _add.
GGML_TYPE_NAMES: dict[int, str] = {}


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
