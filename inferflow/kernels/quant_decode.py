"""ctypes side of ``quant_decode.c``: affine-quantized weights as ``QPlane`` (codes, scale, min
in the C layout), their one-row product, and one decode token through a whole pre-norm stack.

A plane holds exactly the codec's values (``code * scale + min`` per group), so
``plane.matvec(x)`` equals ``x @ W.dequantize().T`` up to float32 summation order, with no bf16
rounding of x or of the scales (torch's int4pack kernel needs both). ``matvec`` (one row of x at
a time) and ``matmul_f32`` (all rows at once) give every row the same float32 operations: a row's
result does not depend on the other rows of the call (batch invariance).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property

import torch

from inferflow.kernels import _library

log = logging.getLogger(__name__)

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class CQMat(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("min", _P), ("n", _I64), ("k", _I64)]
    _fields_ += [("group", _I64), ("bits", _I32), ("half", _I32), ("high", _P), ("zero", _F)]
    _fields_ += [("sc8", _P), ("mn8", _P), ("sb", _I64), ("ldy", _I64)]  # (ldy 0: n)


class CLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("qkv", CQMat), ("o", CQMat)]
    _fields_ += [("gate_up", CQMat), ("down", CQMat), ("qkv_bias", _P)]
    _fields_ += [("qkv2", CQMat), ("gate_up2", CQMat)]  # (n 0: none)


class CDims(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inner")]
    _fields_ += [("rotary_dim", _I64), ("adjacent", _I32), ("eps", _F), ("norm_offset", _F)]
    _fields_ += [("scale", _F), ("kv_format", _I32), ("act_q8", _I32)]  # (kernels.KV_FORMATS)


@cache
def library() -> ctypes.CDLL | None:
    lib = _library("quant_decode")
    if lib is None:
        return None
    lib.qmat_gemv.argtypes = [ctypes.POINTER(CQMat), _P, _I64, _P, _P, ctypes.c_int]
    lib.qmat_gemv.restype = None
    lib.qmat_gemm_f32.argtypes = [ctypes.POINTER(CQMat), _P, _I64, _P, _P, ctypes.c_int, _P, _P]
    lib.qmat_gemm_f32.restype = None
    lib.qmat_half_built.argtypes, lib.qmat_half_built.restype = [], ctypes.c_int
    lib.qmat_has_q8.argtypes, lib.qmat_has_q8.restype = [ctypes.POINTER(CQMat)], ctypes.c_int
    lib.qmat_x_per.argtypes, lib.qmat_x_per.restype = [ctypes.POINTER(CQMat)], _I64
    lib.qmat_tiles16_built.argtypes, lib.qmat_tiles16_built.restype = [], ctypes.c_int
    lib.decode_stack.argtypes = [ctypes.POINTER(CLayer), _I64, ctypes.POINTER(CDims), _I64, _P]
    lib.decode_stack.argtypes += [_P, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _P, ctypes.c_int]
    lib.decode_stack.restype = None
    lib.decode_stack_scratch.argtypes = [ctypes.POINTER(CDims), _I64, _I64, ctypes.c_int]
    lib.decode_stack_scratch.restype = _I64
    lib.attend_rows_f32.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64]
    lib.attend_rows_f32.argtypes += [ctypes.c_float, _P, _I64, _P, _I64, ctypes.c_int, ctypes.c_int]
    lib.attend_rows_f32.restype = None
    lib.q8_0_rows.argtypes, lib.q8_0_rows.restype = [_P, _I64, _I64, _P], None
    lib.qmat_amx_built.argtypes, lib.qmat_amx_built.restype = [], ctypes.c_int
    lib.qmat_amx_enable.argtypes, lib.qmat_amx_enable.restype = [ctypes.c_int], ctypes.c_int
    lib.qmat_amx_rows.argtypes, lib.qmat_amx_rows.restype = [], _I64
    if lib.qmat_amx_built():
        set_amx(lib, os.environ.get("INFERFLOW_AMX", "1") != "0")
    return lib


def set_amx(lib: ctypes.CDLL, on: bool) -> bool:
    """Turn the AMX products of 8-bit rows (``--dtype act8``, 16 rows of x or more) on or off;
    whether they are on. The same bits as the VNNI products either way; on needs a build with
    AMX-INT8 and Linux granting the process the tile state (``INFERFLOW_AMX=0``: off)."""
    on = bool(lib.qmat_amx_enable(int(on)))
    log.debug("AMX products of 8-bit rows: %s", "on" if on else "off")
    return on


def half_built() -> bool:
    """Whether this build's kernels read float16 scales and mins (F16C)."""
    lib = library()
    return lib is not None and bool(lib.qmat_half_built())


def tiles16_built() -> bool:
    """Whether this build's kernels walk tiles with AVX-512: 8-bit codes in groups of a multiple
    of 32 as tiles of 16 rows (rather than row by row), and 4-bit tiles with the nibbles of two
    sub-blocks in one byte (rather than one sub-block's in two bytes)."""
    lib = library()
    return lib is not None and bool(lib.qmat_tiles16_built())


@dataclass
class QPlane:
    """A weight (n, k) in the layout of ``quant_decode.c``: for <= 16 levels, 4-bit codes in
    tiles of 16 rows (tiles, k / 32, 8, 16, 2), or (tiles, k / 32, 4, 16, 4) where the build
    walks tiles with AVX-512 (``tiles16_built``: two sub-blocks' nibbles in a byte), with scale
    and min (tiles, k / group, 16); for <= 32 levels in groups of a multiple of 32, the first
    tiles of the low four bits and ``high``, the fifth bits (tiles, k / 32, 8, 2, 4); for <= 64
    levels on AVX-512 builds (Q6_K), 4-bit tiles of the low four bits and ``high``, the top two
    bits (tiles, k / 32, 2, 16, 4: four sub-blocks' per byte, ``_six``); else 8-bit
    codes, in tiles of 16 rows (tiles, k / 32, 8, 16, 4) with tiled scales and mins where the
    groups are multiples of 32 and ``tiles16_built``, or else (n, k) uint8 with scale and min
    (n, k / group). Scales and mins are float32, or float16 where every one is exact in it
    and the build reads them (``half_built``: the file's own float16 fields, 2 bytes less per
    group and per weight array); no mins for a symmetric format (derived as -zero * scale)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None  # None: -zero * scale (a symmetric format)
    n: int
    k: int
    group: int
    bits: int
    high: torch.Tensor | None = None  # 5-bit codes' fifth bits
    zero: int = 0
    # two-level scales (``factor``): scale / min hold a float16 value per ``sb`` groups, and the
    # groups' own are those times sc8 / mn8 (int8, tiled as scale was)
    sc8: torch.Tensor | None = None
    mn8: torch.Tensor | None = None
    sb: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.min, self.high, self.sc8, self.mn8) if t is not None)
        return self.codes.nbytes + self.scale.nbytes + extra

    @cached_property
    def struct(self) -> CQMat:
        """The C view of the tensors above (they must not be replaced afterwards)."""
        mn = None if self.min is None else self.min.data_ptr()
        ptrs = (self.codes.data_ptr(), self.scale.data_ptr(), mn)
        half = int(self.scale.dtype == torch.float16)
        high = None if self.high is None else self.high.data_ptr()
        two = [None if t is None else t.data_ptr() for t in (self.sc8, self.mn8)]
        return CQMat(*ptrs, self.n, self.k, self.group, self.bits, half, high, self.zero, *two,
                     self.sb)  # fmt: skip

    def group_scales(
        self, pick: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and mins (float32, one-level values) of the rows ``pick`` takes from the
        held arrays (groups last): only the rows asked for are computed."""
        mins = None if self.min is None else self._level(pick(self.min), self.mn8, pick)
        scale = self._level(pick(self.scale), self.sc8, pick)
        return scale, -self.zero * scale if mins is None else mins

    def _level(
        self, a: torch.Tensor, a8: torch.Tensor | None, pick: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if a8 is None:
            return a.float()
        return a.float().repeat_interleave(self.sb, dim=-1) * pick(a8).float()

    def factor(
        self, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None,
        m: torch.Tensor | None, sb: int,
    ) -> bool:  # fmt: skip
        """Hold the scales (and mins) in two levels: ``d`` (n, G / sb) float16-exact values per
        ``sb`` groups and ``sc`` (n, G) integer sub-scales in int8, ``d * sc`` being exactly
        the scales held now (mins likewise: ``dmin * m``). Only for AVX-512 tiles, where the
        build reads them; returns whether it did (nothing changes where the products would)."""
        if self.codes.dim() != 5 or sb & (sb - 1) or not (tiles16_built() and half_built()):
            return False
        parts = [(d, sc, self.scale)] + ([] if self.min is None else [(dmin, m, self.min)])
        tiled: list[tuple[torch.Tensor, torch.Tensor]] = []
        for hi, lo, now in parts:
            if hi is None or lo is None or not -128 <= int(lo.min()) <= int(lo.max()) <= 127:
                return False
            hi16, lo8 = _tiled(hi.half(), self.n), _tiled(lo.to(torch.int8), self.n)
            if not torch.equal(hi16.float().repeat_interleave(sb, 1) * lo8.float(), now.float()):
                return False  # (not the values held: keep one level)
            tiled.append((hi16, lo8))
        (self.scale, self.sc8), self.sb = tiled[0], sb
        if self.min is not None:
            self.min, self.mn8 = tiled[1]
        self.__dict__.pop("struct", None)  # (the C view is made again from these tensors)
        return True

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``x (M, k) float32 @ W.T`` -> (M, n) float32, one row of x at a time."""
        lib = library()
        if lib is None:
            raise RuntimeError("the quant_decode kernel is not available")
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        xs = torch.empty(self.k // 16, dtype=torch.float32)  # group sums
        lib.qmat_gemv(ctypes.byref(self.struct), x.data_ptr(), x.shape[0], xs.data_ptr(), y.data_ptr(),
                      torch.get_num_threads())  # fmt: skip
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (N,) of W as float32 (N, k): code * scale + min, the codec's values (an
        embedding lookup from a tied head's plane)."""
        t, i = ids // 16, ids % 16
        flat = self.codes.dim() == 2  # 8-bit rows; else tiles: (tiles, groups, 16) scales
        scale, mn = self.group_scales(lambda a: a[ids] if flat else a[t, :, i])
        if flat:
            codes = self.codes[ids]
        elif self.bits in (6, 8):  # byte (t, j, s, i, e) of 8-bit tiles
            b = self.codes[t, :, :, i, :]
            if self.bits == 6:
                assert self.high is not None
                b = _unsix(b, self.high[t, :, :, i, :])
            if self.group == 16:  # column 32j + 4s + e
                codes = b.reshape(len(ids), self.k)
            else:  # byte (s, 2h + e): column 32j + 16h + 2s + e
                b = b.reshape(len(ids), -1, 8, 2, 2).permute(0, 1, 3, 2, 4)
                codes = b.reshape(len(ids), self.k)
        elif self.codes.shape[2] == 4 and self.group == 16:  # nibble p of byte (t, j, s2, i, e):
            # column 32j + 8 s2 + 4p + e
            b = self.codes[t, :, :, i, :]  # (N, k / 32, s2, e)
            b = torch.stack([b & 15, b >> 4], dim=-2)  # (N, k / 32, s2, p, e)
            codes = b.reshape(len(ids), self.k)
        elif self.codes.shape[2] == 4:  # nibble p of byte (t, j, s2, i, 2h + e): column
            # 32j + 16h + 4 s2 + 2p + e
            b = self.codes[t, :, :, i, :]  # (N, k / 32, s2, (h, e))
            b = torch.stack([b & 15, b >> 4], dim=-1).reshape(len(ids), -1, 4, 2, 2, 2)
            codes = b.permute(0, 1, 3, 2, 5, 4).reshape(len(ids), self.k)
            if self.high is not None:  # bit s of byte (t, j, i, 2h + e): column 32j + 16h + 2s + e
                s = torch.arange(8, dtype=torch.uint8)
                hb = (self.high[t, :, i, :, None] >> s) & 1  # (N, k / 32, (h, e), s)
                hb = hb.reshape(len(ids), -1, 2, 2, 8).permute(0, 1, 2, 4, 3)
                codes = codes | (hb.reshape(len(ids), self.k) << 4)
        else:  # tile t = id // 16, row i = id % 16; byte (t, j, s, i, e): columns 2s + e, +16
            b = self.codes[t, :, :, i, :].reshape(len(ids), -1, 16)  # (N, k / 32, (s, e))
            codes = torch.cat([b & 15, b >> 4], dim=-1).reshape(len(ids), self.k)
            if self.high is not None:  # byte (t, j, s, i // 8, 2 e + h), bit i % 8: + 16
                hb = self.high[t, :, :, i // 8, :] >> (i % 8).reshape(-1, 1, 1, 1).to(torch.uint8)
                hb = (hb & 1).reshape(len(ids), -1, 8, 2, 2).permute(0, 1, 4, 2, 3)
                codes = codes | (hb.reshape(len(ids), self.k) << 4)
        g, scale, mn = self.group, scale.float(), mn.float()
        w = codes.to(torch.float32).reshape(len(ids), -1, g) * scale[..., None] + mn[..., None]
        return w.reshape(len(ids), self.k)

    def has_q8(self) -> bool:
        """Whether ``matmul_f32(x, q8=True)`` takes 8-bit rows of x here (4-bit tiles, on
        AVX-512 builds only with VNNI; 8-bit tiles, with AVX-512 VNNI); else it computes as
        float32."""
        lib = library()
        return lib is not None and bool(lib.qmat_has_q8(ctypes.byref(self.struct)))

    def x_per(self) -> int:
        """Columns of x sharing one 8-bit scale in ``matmul_f32(x, q8=True)``: 32, or where
        the scales are held in two levels (``factor``) and VNNI walks the tiles, a super-block
        (256, as llama.cpp's Q8_K for the same k-quants; a chunk of 32 at most 1/2, 1/4 or 1/8
        of its block's max gains 1, 2 or 3 bits), whose sums are then all integers."""
        lib = library()
        return 32 if lib is None else int(lib.qmat_x_per(ctypes.byref(self.struct)))

    def matmul_f32(self, x: torch.Tensor, q8: bool = False) -> torch.Tensor:
        """``x (M, k) float32 @ W.T`` -> (M, n) float32, all rows at once (each unpacked tile of
        codes meets several rows); every row equals ``matvec``'s bit for bit. ``q8``: each row
        of x rounded to 8 bits per ``x_per()`` values first (``quantize_row_q8``) where the
        codes have an integer path (``has_q8``), the same for every row whatever else is in
        the call."""
        lib = library()
        if lib is None:
            raise RuntimeError("the quant_decode kernel is not available")
        x = x.contiguous()
        M = x.shape[0]
        y = torch.empty((M, self.n), dtype=torch.float32)
        xs = torch.empty((M, self.k // self.group), dtype=torch.float32)  # group sums
        xq = torch.empty(M * self.k, dtype=torch.int8) if q8 else None
        dx = torch.empty(M * self.k // 32, dtype=torch.float32) if q8 else None
        lib.qmat_gemm_f32(ctypes.byref(self.struct), x.data_ptr(), M, xs.data_ptr(), y.data_ptr(),
                          torch.get_num_threads(), None if xq is None else xq.data_ptr(),
                          None if dx is None else dx.data_ptr())  # fmt: skip
        return y


def _tiled(t: torch.Tensor, n: int) -> torch.Tensor:
    """(n, G) per-row values -> (tiles, G, 16) as the tiles read them (zero rows past n)."""
    tiles = -(-n // 16)
    if n % 16:
        t = torch.cat([t, t.new_zeros(tiles * 16 - n, t.shape[1])])
    return t.reshape(tiles, 16, -1).transpose(1, 2).contiguous()


def plane_takes(levels: int, group: int) -> bool:
    """Whether a plane holds codes of ``levels`` values in groups of ``group``: tiles need
    groups of a multiple of 32 (AVX-512 builds: or of 16), 8-bit rows of 16."""
    return levels <= 256 and group % 16 == 0


def _tiles(group: int, k: int | None = None) -> bool:
    """Whether groups of ``group`` (rows of ``k``) go in tiles of 16 rows: groups of a multiple
    of 32, and on AVX-512 builds groups of 16 (k a multiple of 32)."""
    if k is not None and k % 32:
        return False
    return group % 32 == 0 or (group == 16 and tiles16_built())


def plane_bits(levels: int, group: int, k: int | None = None) -> int:
    """The bits per code of the plane ``plane_takes``: 4-bit tiles (<= 16 levels), 5-bit ones
    (<= 32 levels, groups of a multiple of 32), 6-bit ones (<= 64 levels, AVX-512 builds), else
    8-bit codes (tiles on AVX-512 builds, else rows)."""
    if _tiles(group, k) and levels <= 64:
        if levels <= 16:
            return 4
        if levels <= 32 and group % 32 == 0:
            return 5
        if tiles16_built():
            return 6
    return 8


def make_plane(
    codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, levels: int, zero: int | None = None
) -> QPlane | None:
    """The plane of an affine weight (codes (n, k) uint8 < levels; scale, min (n, k / group)
    float32), or None where the kernel cannot take it (no compiler, or not ``plane_takes``).
    ``codes`` is consumed: 8-bit tiles are laid out in its own storage.
    ``zero``: a symmetric format's code offset (min == -zero * scale): no mins are held where
    the build derives them."""
    n, k = codes.shape
    group = k // scale.shape[1]
    if library() is None or not plane_takes(levels, group) or k % group:
        return None
    scale, mn = scale.to(torch.float32), mn.to(torch.float32)
    minless = zero is not None and torch.equal(mn, -zero * scale)
    kept = (scale,) if minless else (scale, mn)
    if half_built() and all(torch.equal(t.half().float(), t) for t in kept):
        scale, mn = scale.half(), mn.half()  # (exact: no value changes)
    z = zero if minless and zero is not None else 0  # (minless implies a zero)
    bits, wide = plane_bits(levels, group, k), tiles16_built()
    if bits == 8 and not (wide and _tiles(group, k)):
        mins = None if minless else mn.contiguous()
        return QPlane(codes.contiguous(), scale.contiguous(), mins, n, k, group, 8, None, z)
    tiles = -(-n // 16)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(tiles * 16 - n, t.shape[1])]) if n % 16 else t

    codes = pad(codes)
    mins = None if minless else _tiled(mn, n)
    # (the moves below take the byte pairs (e = 0, 1) of adjacent columns as one int16: half
    # the elements for torch's strided copy)
    if bits in (6, 8):  # column 32j + 16h + 2s + e of row 16t + i -> byte (t, j, s, i, 2h + e),
        # in the codes' own storage a few tiles at a time (a tile's bytes stay where its rows
        # were): no second copy of a large table (Gemma-3's embedding: 168 MB)
        flat = codes.contiguous().view(tiles, 16 * k)
        step = max(1, (4 << 20) // (16 * k))
        for t0 in range(0, tiles, step):
            chunk = flat[t0 : t0 + step]
            if group == 16:  # column 32j + 4s + e -> byte (t, j, s, i, e)
                quads = chunk.clone().view(torch.int32).reshape(-1, 16, k // 32, 8)
                moved = quads.permute(0, 2, 3, 1)
            else:
                pairs = chunk.clone().view(torch.int16).reshape(-1, 16, k // 32, 2, 8)
                moved = pairs.permute(0, 2, 4, 1, 3)
            chunk.copy_(moved.reshape(len(chunk), -1).view(torch.uint8))
        tiled = flat.view(tiles, k // 32, 8, 16, 4)
        if bits == 6:
            low, top = _six(tiled)
            return QPlane(low, _tiled(scale, n), mins, n, k, group, 6, top, z)
        return QPlane(tiled, _tiled(scale, n), mins, n, k, group, 8, None, z)
    if wide and group == 16:  # column 32j + 8 s2 + 4p + e of row 16t + i -> nibble p of
        # byte (t, j, s2, i, e)
        c = codes.reshape(tiles, 16, k // 32, 4, 2, 4)
        b = c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)
        return QPlane(b.permute(0, 2, 3, 1, 4).contiguous(), _tiled(scale, n), mins, n, k, group, 4,
                      None, z)  # fmt: skip
    if wide:  # column 32j + 16h + 4 s2 + 2p + e of row 16t + i -> nibble p of byte (t, j, s2,
        # i, 2h + e)
        c = (codes & 15 if bits == 5 else codes).reshape(tiles, 16, k // 32, 2, 4, 2, 2)
        b = (c[..., 0, :] | (c[..., 1, :] << 4)).view(torch.int16).squeeze(-1)
        packed = b.permute(0, 2, 4, 1, 3).contiguous().view(torch.uint8)
        high = None
        if bits == 5:  # fifth bit of column 32j + 16h + 2s + e of row 16t + i -> bit s of byte
            # (t, j, i, 2h + e)
            hb = (codes >> 4).reshape(tiles, 16, k // 32, 2, 8, 2).permute(0, 2, 1, 3, 5, 4)
            lanes = torch.tensor([1 << s for s in range(8)], dtype=torch.uint8)
            high = (hb * lanes).sum(-1, dtype=torch.uint8).reshape(tiles, k // 32, 16, 4)
        return QPlane(packed.reshape(tiles, k // 32, 4, 16, 4), _tiled(scale, n), mins, n, k, group,
                      bits, high, z)  # fmt: skip
    # column 32j + 16h + 2s + e of row 16t + i -> nibble h of byte (t, j, s, i, e)
    c = (codes & 15 if bits == 5 else codes).reshape(tiles, 16, k // 32, 2, 8, 2)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()
    high = None
    if bits == 5:  # fifth bit of column 32j + 16 h2 + 2s + e2, row 16t + 8h + i -> bit i of
        # byte (t, j, s, h, 2 e2 + h2)
        hb = (codes >> 4).reshape(tiles, 2, 8, k // 32, 2, 8, 2).permute(0, 3, 5, 1, 6, 4, 2)
        lanes = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
        high = (hb * lanes).sum(-1, dtype=torch.uint8).reshape(tiles, k // 32, 8, 2, 4)

    return QPlane(packed, _tiled(scale, n), mins, n, k, group, bits, high, z)


def _six(tiled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit tiles (tiles, J, 8, 16, 4) of codes < 64 -> their low four bits as 4-bit tiles
    (tiles, J, 4, 16, 4: sub-block 2 s2 + p in nibble p) and their top two bits (tiles, J, 2,
    16, 4: sub-block 4q + r in bits 2r, 2r + 1), a few tiles at a time."""
    tiles, J = tiled.shape[:2]
    low = torch.empty(tiles, J, 4, 16, 4, dtype=torch.uint8)
    top = torch.empty(tiles, J, 2, 16, 4, dtype=torch.uint8)
    step = max(1, (4 << 20) // (J * 512))
    for t0 in range(0, tiles, step):
        b = tiled[t0 : t0 + step]
        low[t0 : t0 + step] = (b[:, :, 0::2] & 15) | ((b[:, :, 1::2] & 15) << 4)
        h = (b >> 4).reshape(len(b), J, 2, 4, 16, 4)
        top[t0 : t0 + step] = (
            h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)
        )
    return low, top


def _unsix(low: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``_six``'s inverse for rows of tiles: low (..., 4, 4), top (..., 2, 4) -> (..., 8, 4)."""
    lo = torch.stack([low & 15, low >> 4], dim=-2).flatten(-3, -2)  # sub-block 2 s2 + p
    hi = torch.stack([(top >> (2 * r)) & 3 for r in range(4)], dim=-2).flatten(-3, -2)
    return lo | (hi << 4)


def q8_0_rows(x: torch.Tensor) -> torch.Tensor:
    """(rows, n) float32 -> (rows, n / 32 * 34) uint8: the Q8_0 blocks decode_stack writes to
    a "q8" KV cache (tests hold them against gguf-py's)."""
    lib = library()
    assert lib is not None
    x = x.float().contiguous()
    out = torch.empty((x.shape[0], x.shape[1] // 32 * 34), dtype=torch.uint8)
    lib.q8_0_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    lens: list[int],
    scale: float,
    one_by_one: bool = False,
) -> torch.Tensor:
    """Rows of one sequence through the one-call decode's attention for one query head (for
    tests): q (R, D) float32; k, v (slots, D) float32 or float16; row r attends to the keys in
    the first lens[r] of ``slots``. At once (a prompt's block of rows), or ``one_by_one`` as
    decode rows alone. Returns (R, D)."""
    lib = library()
    assert lib is not None
    R, D = q.shape
    q, k, v = q.float().contiguous(), k.contiguous(), v.contiguous()
    sl = slots.to(torch.int64).contiguous()
    n = torch.tensor(lens, dtype=torch.int64)
    p = torch.empty(R, len(sl), dtype=torch.float32)
    out = torch.empty(R, D, dtype=torch.float32)
    lib.attend_rows_f32(
        q.data_ptr(), D, k.data_ptr(), v.data_ptr(), sl.data_ptr(), n.data_ptr(), R, D, 0, D,
        scale, p.data_ptr(), len(sl), out.data_ptr(), D, int(k.dtype == torch.float16),
        int(one_by_one),
    )  # fmt: skip
    return out
