/* Products over affine-quantized weights, float32 activations, one arithmetic per row.

   A QMat holds a weight W (n, k) as w = code * scale + min per group of `group` weights
   (a multiple of 32; of 16 for 8-bit codes), so W x = sum_g scale_g * (codes_g . x_g) + min_g * sum(x_g).
   - 8-bit codes: row by row, one byte per code; scale and min (n, k / group).
   - 4-bit codes: tiles of 16 rows (n padded to a multiple of 16 with zero rows). Tile t,
     chunk j of 32 columns, sub-block s < 8 holds 32 bytes; byte 2i + e (row 16t + i, e < 2) is
     c[32j + 2s + e] | c[32j + 16 + 2s + e] << 4. Scale and min are (tiles, k / group, 16).
   - 5-bit codes (Q5_0, Q5_1, Q5_K): the 4-bit tiles of their low four bits, and their fifth
     bits beside them, 64 bytes per tile and chunk: byte (t, j, s, h, e) has bit i set where row
     16t + 8h + i's code of column 2s, 16 + 2s, 2s + 1, 17 + 2s (e = 0 .. 3) is >= 16 (the order
     of tile_codes' vectors).
   Scales and mins are float32, or float16 where every one is exact in it (F16C builds);
   symmetric formats (min = -zero * scale, zero a power of two) may leave min NULL.

   Batch invariance: every output y[m][r] is computed by the same sequence of float32 operations
   whatever the number of rows M of x, which other rows are in the call, and how the rows are
   split over threads: the products are written once (tile_dot_rows, row_dot_rows) with the
   rows of x as an inner constant-count loop, so one row's arithmetic is the same whether it
   runs alone (qmat_gemv, decode_stack) or beside others (qmat_gemm_f32). Rows of x share each
   unpacked tile of codes, which is where many rows gain.

   qmat_gemv: y = W x for M rows of x, one at a time, rows (or tiles) of W split over the threads.
   qmat_gemm_f32: Y = X W^T for all rows of X at once, the same arithmetic per row; with 8-bit
   rows of X (--dtype act8: quantize_row_q8) where W has 4-bit tiles, integer dot products.
   decode_stack: every layer of a pre-norm decoder (RMS norm, fused q/k/v, rotary embedding,
   GQA attention over cache slots, SiLU-gated FFN) for one new token of each of B sequences, in
   one OpenMP region; the caller embeds the tokens and runs the final norm and the head. A
   sequence's token gets the same operations whatever B is.
   Threads come from the OpenMP runtime torch already loaded (the same libgomp.so.1). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attend.h"
#include "rows.h"

/* The library's flags allow reassociation and fused multiply-adds wherever the compiler likes,
   and its choices depend on how many rows share a loop: not here. Every multiply-add below is
   written as one (fma8, or AVX-512's) or as two operations. */
#pragma GCC optimize("no-associative-math", "fp-contract=off")

typedef struct {
    const uint8_t *codes;
    const float *scale, *min; /* (n, k / group) */
    int64_t n, k, group;
    int32_t bits; /* 4 or 8 */
    int32_t half; /* scale and min are float16 (only where qmat_half_built()) */
    const uint8_t *high; /* 5-bit codes: their fifth bits (else NULL) */
    float zero;          /* min NULL (symmetric formats, SYMMETRIC_BUILT only): min = -zero * scale */
} QMat;

typedef struct {
    const float *attn_norm, *ffn_norm; /* (hidden,) */
    QMat qkv, o, gate_up, down;        /* gate_up: [gate; up] rows */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inner, rotary_dim;
    int32_t adjacent; /* rotary pairs (2i, 2i + 1); else (i, i + rotary_dim / 2) */
    float eps, norm_offset, scale;
    int32_t kv_q8;  /* the cache holds Q8_0 blocks (kvq8.h), else float32 */
    int32_t act_q8; /* 8-bit rows of x into the products that have a q8 path (gemm_in_team) */
} Dims;

/* GCC vector types (AVX2 ymm; scalar code where the CPU has no vectors) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

/* a * b + c, one rounding where the CPU has FMA */
static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Scales and mins are float16 where every one is exact in it (they come from the file's
   float16 fields: Q4_0 .. Q8_0, Inferflow's min-max formats) in builds with F16C. */
#if defined(__F16C__)
#define HALF_BUILT 1
#else
#define HALF_BUILT 0
#endif

int qmat_half_built(void) { return HALF_BUILT; }

/* element i of a scale or min array */
static inline float ld1(const QMat *w, const float *a, int64_t i) {
#if HALF_BUILT
    if (w->half) return _cvtsh_ss(((const uint16_t *)a)[i]);
#else
    (void)w;
#endif
    return a[i];
}

/* elements i .. i + 7 of a scale or min array */
static inline v8f ld8(const QMat *w, const float *a, int64_t i) {
#if HALF_BUILT
    if (w->half) {
        const __m256 h = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + i)));
        v8f v;
        memcpy(&v, &h, sizeof v);
        return v;
    }
#else
    (void)w;
#endif
    return load8(a + i);
}

/* min i, and mins i .. i + 7 */
static inline float min1(const QMat *w, int64_t i) {
    return w->min ? ld1(w, w->min, i) : -w->zero * ld1(w, w->scale, i);
}

static inline v8f min8(const QMat *w, int64_t i) {
    return w->min ? ld8(w, w->min, i) : -w->zero * ld8(w, w->scale, i);
}

/* 4-bit tile bytes: rows 8h .. 8h + 7 of sub-block s (p = chunk + 32 s + 16 h) as the codes of
   columns 2s, 16 + 2s, 2s + 1, 17 + 2s (word i holds row i's four nibbles) */
static inline void tile_codes(const uint8_t *p, v8f q[4]) {
    v8u16 u;
    memcpy(&u, p, sizeof u);
    const v8i d = __builtin_convertvector(u, v8i);
    q[0] = __builtin_convertvector(d & 15, v8f);
    q[1] = __builtin_convertvector((d >> 4) & 15, v8f);
    q[2] = __builtin_convertvector((d >> 8) & 15, v8f);
    q[3] = __builtin_convertvector(d >> 12, v8f);
}

/* 5-bit codes: the fifth bits of tile_codes' q (hb: 4 bytes, byte e for q[e], bit i for row
   8h + i) add 16 */
static inline void tile_high(const uint8_t *hb, v8f q[4]) {
    const v8i lane = {1, 2, 4, 8, 16, 32, 64, 128};
    for (int e = 0; e < 4; e++) q[e] += __builtin_convertvector(((hb[e] & lane) != 0) & 16, v8f);
}

/* the fifth bits of tile t, chunk j, sub-block s, rows 8h .. 8h + 7 */
static inline const uint8_t *high_bits(const QMat *w, int64_t t, int64_t j, int s, int h) {
    return w->high + (((t * (w->k / 32) + j) * 8 + s) * 2 + h) * 4;
}

/* xs[g]: the sum of x's group g (the min term's factor), in order */
static void group_sums(const QMat *w, const float *x, float *xs) {
    for (int64_t g = 0; g < w->k / w->group; g++) {
        float s = 0.f;
        for (int64_t i = 0; i < w->group; i++) s += x[g * w->group + i];
        xs[g] = s;
    }
}

/* tile t's 16 outputs of rows m < mr (lanes of acc[m][0], acc[m][1]) into out (added to it
   where add) */
static inline __attribute__((always_inline)) void store_tile(const QMat *w, int64_t t,
                                                             v8f (*acc)[2], float *out, int add,
                                                             const int mr) {
    const int64_t rows = w->n - 16 * t < 16 ? w->n - 16 * t : 16;
    for (int m = 0; m < mr; m++) {
        float o[16];
        memcpy(o, acc[m], sizeof o);
        float *y = out + m * w->n + 16 * t;
        for (int64_t i = 0; i < rows; i++) y[i] = (add ? y[i] : 0.f) + o[i];
    }
}

/* The one arithmetic of 4- and 5-bit tiles: rows x_m = x + m k (m < mr) times tile t (16 rows
   of W, row 8h + i in lane i of vector h): per group, a = codes . x in two vectors per h, then
   acc += (a0 + a1) * scale + min * sum(x_g). out + m n receives row m's 16 (or fewer) outputs,
   added to what is there where add. mr and five are constants where inlined: the row count
   changes how often a tile's codes are unpacked, never a row's operations. */
#define MR 3 /* rows of x per unpacked tile (the accumulators of 3 rows fit AVX2's registers) */
static inline __attribute__((always_inline)) void tile_dot_rows(const QMat *w, int64_t t,
                                                                const float *x, const float *xs,
                                                                float *out, int add, const int mr,
                                                                const int five) {
    const int64_t k = w->k, G = k / w->group, chunks = w->group / 32;
    const uint8_t *c = w->codes + t * (k / 32) * 256;
    v8f acc[MR][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = (v8f){0};
    for (int64_t g = 0; g < G; g++) {
        v8f a[MR][2][2];
        for (int m = 0; m < mr; m++) a[m][0][0] = a[m][0][1] = a[m][1][0] = a[m][1][1] = (v8f){0};
        for (int64_t j = 0; j < chunks; j++, c += 256) {
            const int64_t col = (g * chunks + j) * 32;
            for (int s = 0; s < 8; s++) /* word i: row i's columns 2s, 16 + 2s, 2s + 1, 17 + 2s */
                for (int h = 0; h < 2; h++) {
                    v8f q[4];
                    tile_codes(c + 32 * s + 16 * h, q);
                    if (five) tile_high(high_bits(w, t, g * chunks + j, s, h), q);
                    for (int m = 0; m < mr; m++) {
                        const float *xc = x + m * k + col;
                        a[m][h][0] = fma8(q[0], (v8f){0} + xc[2 * s], a[m][h][0]);
                        a[m][h][1] = fma8(q[1], (v8f){0} + xc[16 + 2 * s], a[m][h][1]);
                        a[m][h][0] = fma8(q[2], (v8f){0} + xc[2 * s + 1], a[m][h][0]);
                        a[m][h][1] = fma8(q[3], (v8f){0} + xc[17 + 2 * s], a[m][h][1]);
                    }
                }
        }
        for (int h = 0; h < 2; h++) {
            const v8f sc = ld8(w, w->scale, (t * G + g) * 16 + 8 * h);
            const v8f mn = min8(w, (t * G + g) * 16 + 8 * h);
            for (int m = 0; m < mr; m++) {
                acc[m][h] = fma8(a[m][h][0] + a[m][h][1], sc, acc[m][h]);
                acc[m][h] = fma8(mn, (v8f){0} + xs[m * G + g], acc[m][h]);
            }
        }
    }
    store_tile(w, t, acc, out, add, mr);
}

/* The one arithmetic of 8-bit rows: rows r0 .. r0 + RW - 1 of W (rw of them) times rows x_m
   (m < mr): per group, a = codes . x_g as 8 lanes, acc += a * scale; the mins' sum
   min_g * sum(x_g) separately, in order; y = (lanes summed pairwise) + mins. */
#define RW 4 /* rows of W at once: independent chains for one row of x */
static inline __attribute__((always_inline)) void row_dot_rows(const QMat *w, int64_t r0,
                                                               const int rw, const float *x,
                                                               const float *xs, float *out,
                                                               int add, const int mr) {
    const int64_t k = w->k, G = k / w->group;
    v8f acc[RW][MR];
    float mins[RW][MR];
    for (int r = 0; r < rw; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = (v8f){0}, mins[r][m] = 0.f;
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < rw; r++) {
            const uint8_t *c = w->codes + (r0 + r) * k + g * w->group;
            v8f a[MR];
            for (int m = 0; m < mr; m++) a[m] = (v8f){0};
            for (int64_t j = 0; j < w->group; j += 8) {
                v8u8 b;
                memcpy(&b, c + j, sizeof b);
                const v8f q = __builtin_convertvector(__builtin_convertvector(b, v8i), v8f);
                for (int m = 0; m < mr; m++) a[m] = fma8(q, load8(x + m * k + g * w->group + j), a[m]);
            }
            const float sc = ld1(w, w->scale, (r0 + r) * G + g), mn = min1(w, (r0 + r) * G + g);
            for (int m = 0; m < mr; m++) {
                acc[r][m] = fma8(a[m], (v8f){0} + sc, acc[r][m]);
                mins[r][m] += mn * xs[m * G + g];
            }
        }
    }
    for (int r = 0; r < rw; r++)
        for (int m = 0; m < mr; m++) {
            const v8f v = acc[r][m];
            const float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            float *y = out + m * w->n + r0 + r;
            *y = (add ? *y : 0.f) + (s + mins[r][m]);
        }
}

/* 8-bit activations (the "q8" products): each row of x as int8 codes per 32 columns, x ~= dx *
   xq with dx = max |x| / 127 and xq = rint(x * 127 / max |x|) (nearest even), the 32 codes of
   chunk j stored in the tiles' order: byte 4s + e is column (2s, 2s + 1, 16 + 2s, 17 + 2s)[e].
   A 4-bit tile's chunk is then one integer dot product per row (exact), times scale * dx in
   float32; the mins' term keeps x's float group sums. Integer sums are exact in any order; the
   float32 operations after them are fixed per build, as for float32 x, so a row's result
   never depends on the other rows. */
static void quantize_row_q8(const float *x, int64_t k, int8_t *xq, float *dx) {
    for (int64_t j = 0; j < k / 32; j++) {
        const float *c = x + 32 * j;
        int8_t *o = xq + 32 * j;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* the same operations 16 at a time: cvtps rounds to nearest even as rintf does, and
           |x * id| <= 127 (+ rounding) needs no clamp; columns 2s, 2s + 1 of lo and of hi are
           interleaved as 16-bit pairs */
        const __m512 lo = _mm512_loadu_ps(c), hi = _mm512_loadu_ps(c + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        dx[j] = amax / 127.f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m128i l = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, vid)));
        const __m128i h = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, vid)));
        _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi16(l, h));
        _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi16(l, h));
#else
        float amax = 0.f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(c[i]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        dx[j] = amax / 127.f;
        for (int s = 0; s < 8; s++) {
            const float v[4] = {c[2 * s], c[2 * s + 1], c[16 + 2 * s], c[17 + 2 * s]};
            for (int e = 0; e < 4; e++) {
                const float r = rintf(v[e] * id);
                o[4 * s + e] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
            }
        }
#endif
    }
}

/* The mins' term of 8-bit rows takes the group sums of the rounded row (dx * xq), as the codes'
   term does: the product is then sum((scale * code + min) * dx * xq), whose error is the
   weights' own size times x's rounding, not the codes' offset's (128 for Q8_0) times it. */
static void q8_group_sums(const QMat *w, const int8_t *xq, const float *dx, float *xs) {
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

/* tile_dot_rows with 8-bit rows of x (xq, dx: their codes and scales, k / 32 per row) */
static inline __attribute__((always_inline)) void tile_dot_rows_q8(const QMat *w, int64_t t,
                                                                   const int8_t *xq, const float *dx,
                                                                   const float *xs, float *out,
                                                                   int add, const int mr) {
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
                    const v8i q0 = d & 15, q1 = (d >> 8) & 15, q2 = (d >> 4) & 15, q3 = d >> 12;
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

#if defined(__AVX512F__)
/* AVX-512 builds: 4-bit tiles with all 16 rows of a tile in one vector, 8-bit rows in groups
   of a multiple of 32 sixteen columns at a time; the same rule (a row's operations do not
   depend on the other rows) */
#define MR16 4 /* rows of x per unpacked tile: 4 accumulators each */

static inline __m512 ld16(const QMat *w, const float *a, int64_t i) {
#if HALF_BUILT
    if (w->half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a + i)));
#endif
    return _mm512_loadu_ps(a + i);
}

static inline __m512 min16(const QMat *w, int64_t i) {
    return w->min ? ld16(w, w->min, i) : _mm512_mul_ps(_mm512_set1_ps(-w->zero), ld16(w, w->scale, i));
}

/* tile t's 16 outputs of rows m < mr: acc + mins, into out (added to it where add) */
static inline __attribute__((always_inline)) void store_tile16(const QMat *w, int64_t t,
                                                               const __m512 *acc,
                                                               const __m512 *mins, float *out,
                                                               int add, const int mr) {
    const int64_t rows = w->n - 16 * t < 16 ? w->n - 16 * t : 16;
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    for (int m = 0; m < mr; m++) {
        float *y = out + m * w->n + 16 * t;
        const __m512 o = _mm512_add_ps(acc[m], mins[m]);
        _mm512_mask_storeu_ps(y, keep, add ? _mm512_add_ps(_mm512_maskz_loadu_ps(keep, y), o) : o);
    }
}

/* Tile t of 16 rows, 4-bit (eight = 0) or 8-bit codes, a 32-column chunk at a time: per
   sub-block s, dword i of a vector holds row i's codes of columns (2s, 2s + 1, 16 + 2s, 17 + 2s)
   [e] as byte e (8-bit: the chunk's 512 bytes (s, i, e)), or 4-bit ones as byte e's low nibble
   for an even s and high nibble for the odd s after it (the chunk's 256 bytes (s / 2, i, e)):
   one mask, or a shift and a mask, gives the VNNI operand of a sub-block. */
#define TILE_CHUNK(eight) ((eight) ? 512 : 256)

/* sub-block s's 16 dwords of codes as bytes (c: the chunk) */
static inline __attribute__((always_inline)) __m512i tile16_dwords(const uint8_t *c, int s,
                                                                   const int eight) {
    if (eight) return _mm512_loadu_si512((const void *)(c + 64 * s));
    const __m512i d = _mm512_loadu_si512((const void *)(c + 64 * (s >> 1)));
    return _mm512_and_si512(s & 1 ? _mm512_srli_epi32(d, 4) : d, _mm512_set1_epi8(0x0F));
}

/* sub-block s's codes as floats, q[e]: column (2s, 2s + 1, 16 + 2s, 17 + 2s)[e] of the 16 rows
   (4-bit: vpermps reads the low 4 bits of each index, one nibble per lookup) */
static inline __attribute__((always_inline)) void tile16_codes(const uint8_t *c, int s,
                                                               const int eight, __m512 q[4]) {
    if (eight) {
        const __m512i d = tile16_dwords(c, s, 1), byte = _mm512_set1_epi32(0xFF);
        for (int e = 0; e < 3; e++)
            q[e] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 8 * e), byte));
        q[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 24));
    } else {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i d = _mm512_loadu_si512((const void *)(c + 64 * (s >> 1)));
        for (int e = 0; e < 4; e++)
            q[e] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 8 * e + 4 * (s & 1)), iota);
    }
}

static inline __attribute__((always_inline)) void tile_dot_rows16(const QMat *w, int64_t t,
                                                                  const float *x, const float *xs,
                                                                  float *out, int add, const int mr,
                                                                  const int eight) {
    const int64_t k = w->k, G = k / w->group, chunks = w->group / 32;
    const uint8_t *c = w->codes + t * (k / 32) * TILE_CHUNK(eight);
    __m512 acc[MR16], mins[MR16];
    for (int m = 0; m < mr; m++) acc[m] = mins[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 a0[MR16], a1[MR16];
        for (int m = 0; m < mr; m++) a0[m] = a1[m] = _mm512_setzero_ps();
        for (int64_t j = 0; j < chunks; j++) {
            const int64_t col = (g * chunks + j) * 32;
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                __m512 q[4];
                tile16_codes(c, s, eight, q);
                for (int m = 0; m < mr; m++) {
                    const float *xc = x + m * k + col;
                    a0[m] = _mm512_fmadd_ps(q[0], _mm512_set1_ps(xc[2 * s]), a0[m]);
                    a1[m] = _mm512_fmadd_ps(q[2], _mm512_set1_ps(xc[16 + 2 * s]), a1[m]);
                    a0[m] = _mm512_fmadd_ps(q[1], _mm512_set1_ps(xc[2 * s + 1]), a0[m]);
                    a1[m] = _mm512_fmadd_ps(q[3], _mm512_set1_ps(xc[17 + 2 * s]), a1[m]);
                }
            }
            c += TILE_CHUNK(eight);
        }
        const __m512 sc = ld16(w, w->scale, (t * G + g) * 16), mn = min16(w, (t * G + g) * 16);
        for (int m = 0; m < mr; m++) {
            acc[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), sc, acc[m]);
            mins[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * G + g]), mins[m]);
        }
    }
    store_tile16(w, t, acc, mins, out, add, mr);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) /* (inside __AVX512F__) */
#define Q8_TILES16 1
/* tile_dot_rows16 with 8-bit rows of x: sub-block s's 16 dwords of codes (as bytes, in the x
   codes' column order) times the chunk's four x codes (one broadcast dword), by VNNI */
static inline __attribute__((always_inline)) void tile_dot_rows16_q8(const QMat *w, int64_t t,
                                                                     const int8_t *xq,
                                                                     const float *dx,
                                                                     const float *xs, float *out,
                                                                     int add, const int mr,
                                                                     const int eight) {
    const int64_t k = w->k, G = k / w->group, chunks = w->group / 32, J = k / 32;
    const uint8_t *c = w->codes + t * J * TILE_CHUNK(eight);
    __m512 acc[MR16], mins[MR16];
    for (int m = 0; m < mr; m++) acc[m] = mins[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const __m512 sc = ld16(w, w->scale, (t * G + g) * 16), mn = min16(w, (t * G + g) * 16);
        for (int64_t j = 0; j < chunks; j++) {
            const int64_t jj = g * chunks + j;
            __m512i a[MR16];
            for (int m = 0; m < mr; m++) a[m] = _mm512_setzero_si512();
            for (int s = 0; s < 8; s++) {
                const __m512i q = tile16_dwords(c, s, eight);
                for (int m = 0; m < mr; m++) {
                    int32_t xv;
                    memcpy(&xv, xq + m * k + jj * 32 + 4 * s, sizeof xv);
                    a[m] = _mm512_dpbusd_epi32(a[m], q, _mm512_set1_epi32(xv));
                }
            }
            c += TILE_CHUNK(eight);
            for (int m = 0; m < mr; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m]),
                                         _mm512_mul_ps(sc, _mm512_set1_ps(dx[m * J + jj])), acc[m]);
        }
        for (int m = 0; m < mr; m++)
            mins[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * G + g]), mins[m]);
    }
    store_tile16(w, t, acc, mins, out, add, mr);
}
#endif
#endif

/* How W is walked: 0 = 4/5-bit tiles (vector types), 1 = 8-bit rows RW at a time (vector
   types), 2 = 4-bit tiles (AVX-512), 3 = 8-bit tiles (AVX-512, groups of 32k). A property of W
   and the build (qmat_tiles16_built), never of the rows of x. */
static inline int path_of(const QMat *w) {
#if defined(__AVX512F__)
    if (w->bits == 4 && !w->high) return 2;
    if (w->bits == 8 && w->group % 32 == 0) return 3;
#endif
    return w->bits == 8 ? 1 : 0;
}

/* rows of W per block, rows of x per block */
static const int64_t BLOCK_ROWS[4] = {16, RW, 16, 16};
#if defined(__AVX512F__)
static const int64_t X_ROWS[4] = {MR, MR, MR16, MR16};
#else
static const int64_t X_ROWS[4] = {MR, MR, MR, MR};
#endif

/* one body per path and constant row count, so that every body is inlined with constants */
#define CASES(call)                                                                                 \
    switch (mr) {                                                                                   \
    case 1: call(1); break;                                                                         \
    case 2: call(2); break;                                                                         \
    case 3: call(3); break;                                                                         \
    default: call(4); break;                                                                        \
    }

/* rows x .. x + mr - 1 (mr <= X_ROWS[path]) times block t of W */
static void block_dot(const QMat *w, int path, int64_t t, const float *x, const float *xs,
                      float *y, int add, int64_t mr) {
    switch (path) {
    case 0:
        if (w->high) {
#define C0(n) tile_dot_rows(w, t, x, xs, y, add, (n) < MR ? (n) : MR, 1)
            CASES(C0);
        }
#if !defined(__AVX512F__) /* (AVX-512 builds walk 4-bit tiles by path 2: less to compile) */
        else {
#define C1(n) tile_dot_rows(w, t, x, xs, y, add, (n) < MR ? (n) : MR, 0)
            CASES(C1);
        }
#endif
        break;
    case 1: {
        const int64_t r0 = t * RW, rw = w->n - r0 < RW ? w->n - r0 : RW;
        if (rw == RW) {
#define C2(n) row_dot_rows(w, r0, RW, x, xs, y, add, (n) < MR ? (n) : MR)
            CASES(C2);
        } else
            for (int64_t r = r0; r < r0 + rw; r++) {
#define C3(n) row_dot_rows(w, r, 1, x, xs, y, add, (n) < MR ? (n) : MR)
                CASES(C3);
            }
        break;
    }
#if defined(__AVX512F__)
    case 2:
#define C4(n) tile_dot_rows16(w, t, x, xs, y, add, n, 0)
        CASES(C4);
        break;
    case 3:
#define C5(n) tile_dot_rows16(w, t, x, xs, y, add, n, 1)
        CASES(C5);
        break;
#endif
    default: break;
    }
}

/* Whether block_dot_q8 takes W: 4-bit tiles, and 8-bit tiles where the build has AVX-512 VNNI;
   other codes keep float32 x */
static inline int q8_path(const QMat *w, int path) {
#if defined(Q8_TILES16)
    (void)w;
    return path == 2 || path == 3;
#elif defined(__AVX512F__)
    (void)w, (void)path;
    return 0;
#else
    return path == 0 && !w->high;
#endif
}

/* block_dot for 8-bit rows of x (q8_path) */
static void block_dot_q8(const QMat *w, int path, int64_t t, const int8_t *xq, const float *dx,
                         const float *xs, float *y, int add, int64_t mr) {
#if defined(Q8_TILES16)
    if (path == 2) {
#define C6(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0)
        CASES(C6);
        return;
    }
    if (path == 3) {
#define C8(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 1)
        CASES(C8);
        return;
    }
#endif
    (void)path;
#if !defined(__AVX512F__) /* (q8_path: on AVX-512 builds only paths 2 and 3 take 8-bit x) */
#define C7(n) tile_dot_rows_q8(w, t, xq, dx, xs, y, add, (n) < MR ? (n) : MR)
    CASES(C7);
#else
    (void)w, (void)t, (void)xq, (void)dx, (void)xs, (void)y, (void)add, (void)mr;
#endif
}

/* blocks of W (tiles or rows) */
static inline int64_t blocks_of(const QMat *w, int path) {
    return (w->n + BLOCK_ROWS[path] - 1) / BLOCK_ROWS[path];
}

/* inside a parallel region: Y = (add ? Y : 0) + X W^T for M rows of X, X_ROWS rows per unpacked
   block of W; xs: scratch of M k / group floats; xq, dx: NULL, or scratch of M k bytes and
   M k / 32 floats for 8-bit rows of X where W has a q8 path. A row's outputs are the same bits
   whatever M is and whichever rows share its blocks. */
static void gemm_in_team(const QMat *w, const float *x, int64_t M, float *xs, float *y, int add,
                         int8_t *xq, float *dx) {
    const int path = path_of(w), q8 = xq != NULL && q8_path(w, path);
    const int64_t k = w->k, G = k / w->group, T = blocks_of(w, path), R = X_ROWS[path];
    const int64_t B = (M + R - 1) / R, J = k / 32;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (q8) {
            quantize_row_q8(x + m * k, k, xq + m * k, dx + m * J);
            q8_group_sums(w, xq + m * k, dx + m * J, xs + m * G);
        } else
            group_sums(w, x + m * k, xs + m * G);
    }
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < B; b++) {
            const int64_t m0 = b * R, mr = M - m0 < R ? M - m0 : R;
            if (q8)
                block_dot_q8(w, path, t, xq + m0 * k, dx + m0 * J, xs + m0 * G, y + m0 * w->n,
                             add, mr);
            else
                block_dot(w, path, t, x + m0 * k, xs + m0 * G, y + m0 * w->n, add, mr);
        }
}

/* y = W x for M rows of x, one row per call (xs: k / 16 floats) */
void qmat_gemv(const QMat *w, const float *x, int64_t M, float *xs, float *y, int nthreads) {
    for (int64_t m = 0; m < M; m++) {
#pragma omp parallel num_threads(nthreads)
        gemm_in_team(w, x + m * w->k, 1, xs, y + m * w->n, 0, NULL, NULL);
    }
}

/* Y (M, n) = X (M, k) W^T, all rows in one call (xs: M k / group floats; xq, dx: NULL for
   float32 X, else scratch of M k bytes and M k / 32 floats: 8-bit rows of X where W's codes
   have a q8 path) */
void qmat_gemm_f32(const QMat *w, const float *x, int64_t M, float *xs, float *y, int nthreads,
                   int8_t *xq, float *dx) {
#pragma omp parallel num_threads(nthreads)
    gemm_in_team(w, x, M, xs, y, 0, xq, dx);
}

/* whether products over W take 8-bit rows of X where asked (this build's path for W has one) */
int qmat_has_q8(const QMat *w) { return q8_path(w, path_of(w)); }

/* whether this build walks tiles with AVX-512 (paths 2 and 3): 8-bit codes in groups of a
   multiple of 32 as 16-row tiles (codes (tiles, k / 32, 8, 16, 4), scale and min (tiles, k /
   group, 16)), and 4-bit tiles with two sub-blocks' nibbles in a byte ((tiles, k / 32, 4, 16,
   4)); else 8-bit rows and 4-bit tiles of one sub-block's nibbles per two bytes */
int qmat_tiles16_built(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* B new tokens, one per sequence, through every layer: x (B, hidden) in place. cos / sin: (B,
   rotary_dim / 2), row b's angles. kc / vc: layer 0 of the cache, layer l at l * layer_stride
   floats, slot s of KV head g at (s * KV heads + g) * head_dim. slots (B, S): row b's keys are
   in its first lens[b] slots, the last one where its own K / V go. scratch: at least B (hidden +
   (heads + 2 kv_heads) head_dim + heads head_dim + 3 inner + heads S + K / 16) floats, K = max(
   hidden, inner, heads * head_dim) (the widest product's input: its group sums), and with
   act_q8 B (K / 32 + K / 4) more (its 8-bit rows). Every row gets the same operations whatever
   B is and whichever rows are beside it. */
void decode_stack(const Layer *layers, int64_t L, const Dims *d, int64_t B, float *x,
                  const float *cos, const float *sin, uint8_t *kc, uint8_t *vc, int64_t layer_stride,
                  const int64_t *slots, int64_t S, const int64_t *lens, float *scratch,
                  int nthreads) {
    const int64_t H = d->heads, KVH = d->kv_heads, D = d->head_dim, F = d->inner, E = d->hidden;
    const int64_t QKV = (H + 2 * KVH) * D, R2 = d->rotary_dim / 2;
    const int64_t W = d->kv_q8 ? D / 32 * 34 : D * 4; /* bytes of a KV head in the cache */
    float *h = scratch, *qkv = h + B * E, *att = qkv + B * QKV;
    float *gu = att + B * H * D, *act = gu + B * 2 * F, *p = act + B * F, *xs = p + B * H * S;
    const int64_t K = E > F ? (E > H * D ? E : H * D) : (F > H * D ? F : H * D);
    float *dx = d->act_q8 ? xs + B * K / 16 : NULL;
    int8_t *xq = d->act_q8 ? (int8_t *)(dx + B * K / 32) : NULL;
#pragma omp parallel num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        const Layer *ly = layers + l;
        uint8_t *k = kc + l * layer_stride, *v = vc + l * layer_stride; /* (layer_stride: bytes) */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            rms_norm_row(x + b * E, ly->attn_norm, E, d->eps, d->norm_offset, h + b * E);
        gemm_in_team(&ly->qkv, h, B, xs, qkv, 0, xq, dx);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * QKV;
            const int64_t w = slots[b * S + lens[b] - 1];
            for (int64_t j = 0; j < H + KVH; j++)
                rope_head(row + j * D, cos + b * R2, sin + b * R2, d->rotary_dim, d->adjacent);
            if (d->kv_q8) {
                q8_0_row(row + H * D, KVH * D, k + w * KVH * W);
                q8_0_row(row + (H + KVH) * D, KVH * D, v + w * KVH * W);
            } else {
                memcpy(k + w * KVH * W, row + H * D, sizeof(float) * KVH * D);
                memcpy(v + w * KVH * W, row + (H + KVH) * D, sizeof(float) * KVH * D);
            }
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < H; j++) { /* (the last slot is this token's) */
                float *pj = p + (b * H + j) * S, *out = att + (b * H + j) * D;
                if (d->kv_q8)
                    attend_head_q8_any(qkv + b * QKV + j * D, k, v, slots + b * S, lens[b],
                                       KVH * W, j / (H / KVH) * W, D, d->scale, pj, out);
                else
                    attend_head_any(qkv + b * QKV + j * D, (const float *)k, (const float *)v,
                                    slots + b * S, lens[b], KVH * D, j / (H / KVH) * D, D,
                                    d->scale, pj, out);
            }
        gemm_in_team(&ly->o, att, B, xs, x, 1, xq, dx);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            rms_norm_row(x + b * E, ly->ffn_norm, E, d->eps, d->norm_offset, h + b * E);
        gemm_in_team(&ly->gate_up, h, B, xs, gu, 0, xq, dx);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < B * F; i++) {
            const float *g = gu + (i / F) * 2 * F + i % F;
            act[i] = g[0] / (1.f + expf(-g[0])) * g[F];
        }
        gemm_in_team(&ly->down, act, B, xs, x, 1, xq, dx);
    }
}

/* rows of n floats -> their Q8_0 blocks, as decode_stack writes them (for tests) */
void q8_0_rows(const float *x, int64_t rows, int64_t n, uint8_t *out) {
    for (int64_t r = 0; r < rows; r++) q8_0_row(x + r * n, n, out + r * (n / 32) * 34);
}
