/* The q8 products' pieces on vector types (--dtype act8): rows of x as 8-bit codes, their
   group sums, and 4- and 5-bit tiles and 8-bit rows times them. Part of quant_decode.c (after qmat.h). */
#ifndef INFERFLOW_QMAT_Q8_H
#define INFERFLOW_QMAT_Q8_H

#include "qmat.h"

/* 8-bit activations (the "q8" products): each row of x as int8 codes per `per` columns, x ~=
   dx * xq with dx = max |x| / 127 and xq = rint(x * 127 / max |x|) (nearest even), the 32 codes
   of chunk j stored in the tiles' order: byte 4s + e is column (2s, 2s + 1, 16 + 2s, 17 + 2s)[e]
   (plain: column 4s + e, the order of tiles in groups of 16). per is 32, or a two-level
   plane's super-block (256, on VNNI builds: x_per); there a chunk whose max is at most 2^-e of
   its block's (e <= X_SHIFT) takes codes rint(x * 127 / max |x| * 2^e), sh[j] = X_SHIFT - e,
   and dx = max |x| / 127 / 2^X_SHIFT: x ~= dx * (xq << sh[j]).
   A 4-bit tile's chunk is then one integer dot product per row (exact), times scale * dx in
   float32; the mins' term keeps x's float group sums. Integer sums are exact in any order; the
   float32 operations after them are fixed per build, as for float32 x, so a row's result
   never depends on the other rows. */
/* where x is in blocks of more than 32 columns: bits a chunk of 32 far below its block's max
   may gain (a power of two per chunk, undone by a shift of its integer sums) */
#define X_SHIFT 3

/* max |c[i]| of a chunk of 32 */
static inline float chunk_amax(const float *c) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(c)), _mm512_abs_ps(_mm512_loadu_ps(c + 16))));
#else
    float a = 0.f;
    for (int i = 0; i < 32; i++) a = fabsf(c[i]) > a ? fabsf(c[i]) : a;
    return a;
#endif
}

/* per: 32 or a super-block (at most 512 columns); sh: per > 32, the chunks' shifts */
static void quantize_row_q8(const float *x, int64_t k, int8_t *xq, float *dx, const int plain,
                            const int64_t per, int32_t *sh) {
    for (int64_t b = 0; b < k / per; b++) {
        const int64_t j0 = per / 32 * b, nj = per / 32;
        float am[16], amax = 0.f; /* (each chunk's max, read once; the block's) */
        for (int64_t j = 0; j < nj; j++) {
            am[j] = chunk_amax(x + 32 * (j0 + j));
            amax = am[j] > amax ? am[j] : amax;
        }
        const float id0 = amax > 0.f ? 127.f / amax : 0.f;
        dx[b] = per > 32 ? amax / 127.f / (float)(1 << X_SHIFT) : amax / 127.f;
        for (int64_t j = j0; j < j0 + nj; j++) {
            const float *c = x + 32 * j;
            int8_t *o = xq + 32 * j;
            float id = id0;
            if (per > 32) { /* a chunk far below the block's max takes up to X_SHIFT more bits */
                int e = 0;
                while (e < X_SHIFT && am[j - j0] * (float)(2 << e) <= amax) e++;
                id = id0 * (float)(1 << e), sh[j] = X_SHIFT - e;
            }
#if defined(__AVX512F__) && defined(__AVX512BW__)
            /* 16 at a time: cvtps rounds to nearest even as rintf does, and |x * id| <= 127
               (+ rounding) needs no clamp; columns 2s, 2s + 1 of lo and of hi are
               interleaved as 16-bit pairs */
            const __m512 vid = _mm512_set1_ps(id);
            const __m128i l = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c), vid)));
            const __m128i h = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c + 16), vid)));
            _mm_storeu_si128((__m128i *)o, plain ? l : _mm_unpacklo_epi16(l, h));
            _mm_storeu_si128((__m128i *)(o + 16), plain ? h : _mm_unpackhi_epi16(l, h));
#else
            for (int s = 0; s < 8; s++) {
                const float v[4] = {c[2 * s], c[2 * s + 1], c[16 + 2 * s], c[17 + 2 * s]};
                for (int e = 0; e < 4; e++) {
                    const float r = rintf((plain ? c[4 * s + e] : v[e]) * id);
                    o[4 * s + e] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
                }
            }
#endif
        }
    }
}

/* The mins' term of 8-bit rows takes the group sums of the rounded row (dx * xq), as the codes'
   term does: the product is then sum((scale * code + min) * dx * xq), whose error is the
   weights' own size times x's rounding, not the codes' offset's (128 for Q8_0) times it. */
static void q8_group_sums(const QMat *w, const int8_t *xq, const float *dx, float *xs) {
    if (w->group == 16) { /* (tiles only: x in column order) */
        for (int64_t j = 0; j < w->k / 32; j++)
            for (int h = 0; h < 2; h++) {
                int32_t q = 0;
                for (int i = 0; i < 16; i++) q += xq[32 * j + 16 * h + i];
                xs[2 * j + h] = dx[j] * (float)q;
            }
        return;
    }
    const int64_t chunks = w->group / 32;
    for (int64_t g = 0; g < w->k / w->group; g++) {
        float s = 0.f;
        for (int64_t j = g * chunks; j < (g + 1) * chunks; j++) {
            int32_t q = 0;
            for (int i = 0; i < 32; i++) q += xq[32 * j + i];
            s += dx[j] * (float)q;
        }
        xs[g] = s;
    }
}

/* the integer sums of each group of 16 or 32 columns of a row in blocks (xs16: k / group;
   either code order: a group is whole sub-blocks), each code << its chunk's shift: |sum| <=
   32 * 127 * 8 */
static void q8_group_sums16(const QMat *w, const int8_t *xq, const int32_t *sh, int16_t *xs16) {
    for (int64_t g = 0; g < w->k / w->group; g++) {
        int32_t q = 0;
        for (int64_t i = 0; i < w->group; i++) q += xq[g * w->group + i];
        xs16[g] = (int16_t)(q * (1 << sh[g * w->group / 32]));
    }
}

/* tile_dot_rows with 8-bit rows of x (xq, dx: their codes and scales, k / 32 per row); five:
   5-bit tiles, their fifth bits (tile_high's order) adding 16 to a code */
static inline __attribute__((always_inline)) void tile_dot_rows_q8(const QMat *w, int64_t t,
                                                                   const int8_t *xq, const float *dx,
                                                                   const float *xs, float *out,
                                                                   int add, const int mr,
                                                                   const int five) {
    const int64_t k = w->k, G = k / w->group, chunks = w->group / 32, J = k / 32;
    const uint8_t *c = w->codes + t * J * 256;
    v8f acc[MR][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = (v8f){0};
    for (int64_t g = 0; g < G; g++) {
        v8f sc[2], mn[2];
        for (int h = 0; h < 2; h++) {
            sc[h] = ld8(w, w->scale, (t * G + g) * 16 + 8 * h);
            mn[h] = min8(w, (t * G + g) * 16 + 8 * h);
        }
        for (int64_t j = 0; j < chunks; j++) {
            const int64_t jj = g * chunks + j;
            v8i a[MR][2];
            for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = (v8i){0};
            for (int s = 0; s < 8; s++, c += 32)
                for (int h = 0; h < 2; h++) {
                    v8u16 u;
                    memcpy(&u, c + 16 * h, sizeof u);
                    const v8i d = __builtin_convertvector(u, v8i);
                    v8i q0 = d & 15, q1 = (d >> 8) & 15, q2 = (d >> 4) & 15, q3 = d >> 12;
                    if (five) { /* (byte e of the bits is tile_codes' q[e]: columns 2s, 16 + 2s,
                                   2s + 1, 17 + 2s) */
                        const uint8_t *hb = high_bits(w, t, jj, s, h);
                        const v8i lane = {1, 2, 4, 8, 16, 32, 64, 128};
                        q0 += ((hb[0] & lane) != 0) & 16, q2 += ((hb[1] & lane) != 0) & 16;
                        q1 += ((hb[2] & lane) != 0) & 16, q3 += ((hb[3] & lane) != 0) & 16;
                    }
                    for (int m = 0; m < mr; m++) {
                        const int8_t *xc = xq + m * k + jj * 32 + 4 * s;
                        a[m][h] += q0 * xc[0] + q1 * xc[1] + q2 * xc[2] + q3 * xc[3];
                    }
                }
            for (int h = 0; h < 2; h++)
                for (int m = 0; m < mr; m++)
                    acc[m][h] = fma8(__builtin_convertvector(a[m][h], v8f),
                                     sc[h] * ((v8f){0} + dx[m * J + jj]), acc[m][h]);
        }
        for (int h = 0; h < 2; h++)
            for (int m = 0; m < mr; m++) acc[m][h] = fma8(mn[h], (v8f){0} + xs[m * G + g], acc[m][h]);
    }
    store_tile(w, t, acc, out, add, mr);
}

/* 16 bytes as 16-bit lanes: codes (0 .. 255) and 8-bit x (-127 .. 127) */
typedef int16_t v16s __attribute__((vector_size(32)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));

static inline v16s widen_u8(const uint8_t *p) {
    v16u8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v16s);
}

static inline v16s widen_s8(const int8_t *p) {
    v16s8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v16s);
}

/* 8 lanes of pair sums a[2l] b[2l] + a[2l + 1] b[2l + 1] (exact: |255 * 127 * 2| < 2^31) */
static inline v8i pair_sums(v16s a, v16s b) {
#if defined(__AVX2__)
    const __m256i p = _mm256_madd_epi16((__m256i)a, (__m256i)b);
    v8i r;
    memcpy(&r, &p, sizeof r);
    return r;
#else
    v8i r;
    for (int l = 0; l < 8; l++) r[l] = a[2 * l] * b[2 * l] + a[2 * l + 1] * b[2 * l + 1];
    return r;
#endif
}

/* row_dot_rows with 8-bit rows of x in column order (k a multiple of 32): per 16 columns an
   integer dot product (pair_sums of the widened codes and x, each widened once), acc += that *
   (scale * dx); the mins' term from xs, the rounded row's group sums (q8_group_sums). A row's
   operations are in column order whatever rw and mr are. */
static inline __attribute__((always_inline)) void row_dot_rows_q8(const QMat *w, int64_t r0,
                                                                  const int rw, const int8_t *xq,
                                                                  const float *dx, const float *xs,
                                                                  float *out, int add,
                                                                  const int mr) {
    const int64_t k = w->k, G = k / w->group, J = k / 32;
    v8f acc[RW][MR];
    float mins[RW][MR];
    for (int r = 0; r < rw; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = (v8f){0}, mins[r][m] = 0.f;
    for (int64_t g = 0; g < G; g++) {
        float sc[RW];
        for (int r = 0; r < rw; r++) {
            sc[r] = ld1(w, w->scale, (r0 + r) * G + g);
            const float mn = min1(w, (r0 + r) * G + g);
            for (int m = 0; m < mr; m++) mins[r][m] += mn * xs[m * G + g];
        }
        for (int64_t c0 = g * w->group; c0 < (g + 1) * w->group; c0 += 16) {
            v16s xw[MR];
            for (int m = 0; m < mr; m++) xw[m] = widen_s8(xq + m * k + c0);
            for (int r = 0; r < rw; r++) {
                const v16s cw = widen_u8(w->codes + (r0 + r) * k + c0);
                for (int m = 0; m < mr; m++)
                    acc[r][m] = fma8(__builtin_convertvector(pair_sums(cw, xw[m]), v8f),
                                     (v8f){0} + sc[r] * dx[m * J + c0 / 32], acc[r][m]);
            }
        }
    }
    for (int r = 0; r < rw; r++)
        for (int m = 0; m < mr; m++) {
            const v8f v = acc[r][m];
            const float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            float *y = out + m * ldy_of(w) + r0 + r;
            *y = (add ? *y : 0.f) + (s + mins[r][m]);
        }
}

#endif /* INFERFLOW_QMAT_Q8_H */
