"""GGML k-quant quantizers (Q2_K .. Q6_K), transcribing ggml-quants.c's ``quantize_row_q*_K_ref``
step for step in float32: the fits (make_qkx2_quants, make_q3_quants, make_qx_quants) run
vectorized over groups, their sums one term at a time as ggml's loops add them, so the bytes
match llama-quantize's for nearly every block (tests/test_llama_cpp_interchange.py). gguf-py has
no k-quant quantizer; its decoders check ours (tests/test_ggml_codecs.py)."""

from __future__ import annotations

import torch

from inferflow.quant.ggml_blocks import QK_K, _floats, _scale_min_k4


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
