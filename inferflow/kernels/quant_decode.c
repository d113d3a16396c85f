/* One-token decode over affine-quantized weights, float32 activations.

   A QMat holds a weight W (n, k) as w = code * scale + min per group of `group` weights
   (a multiple of 32; of 16 for 8-bit codes), so W x = sum_g scale_g * (codes_g . x_g) + min_g * sum(x_g).
   - 8-bit codes: row by row, one byte per code; scale and min (n, k / group) float32.
   - 4-bit codes: tiles of 16 rows (n padded to a multiple of 16 with zero rows). Tile t,
     chunk j of 32 columns, sub-block s < 8 holds 32 bytes; byte 2i + e (row 16t + i, e < 2) is
     c[32j + 2s + e] | c[32j + 16 + 2s + e] << 4. Scale and min are (tiles, k / group, 16).
   - 5-bit codes (Q5_0, Q5_1, Q5_K): the 4-bit tiles of their low four bits, and their fifth
     bits beside them, 64 bytes per tile and chunk: byte (t, j, s, h, e) has bit i set where row
     16t + 8h + i's code of column 2s, 16 + 2s, 2s + 1, 17 + 2s (e = 0 .. 3) is >= 16 (the order
     of tile_codes' vectors). They run in the vector-type loops only (also in AVX-512 builds).
     With AVX512-BF16 one vdpbf16ps multiplies a pair of columns of 16 rows: the codes are
     exact in bf16 and x is split into three bf16 parts (x = x0 + x1 + x2 + r, each part the
     bf16 rounding of what is left, |r| <= 2^-24 |x|, every product exact in float32), so the
     result is float32 math on the codec's values: no bf16 rounding of x, scales or mins.
     Without BF16 the same tiles run in float32 FMAs.

   Symmetric formats (min = -zero * scale) may leave min NULL in builds without AVX-512.

   qmat_gemv: y = W x for M rows of x, one at a time, rows (or tiles) of W split over the threads.
   qmat_gemm: Y = X W^T for all rows of X at once, x in bf16 (4-bit tiles, AVX512-BF16 only).
   qmat_gemm_f32: the same in float32 on the codec's values, any codes, any CPU.
   decode_stack: every layer of a pre-norm decoder (RMS norm, fused q/k/v, rotary embedding,
   GQA attention over cache slots, SiLU-gated FFN) for one new token of one sequence, in one
   OpenMP region; the caller embeds the token and runs the final norm and the head.
   Threads come from the OpenMP runtime torch already loaded (the same libgomp.so.1). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attend.h"
#include "rows.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
} Dims;

/* GCC vector types (AVX2 ymm; scalar code where the CPU has no vectors) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Scales and mins are float32, or float16 where every one is exact in it (they come from the
   file's float16 fields: Q4_0 .. Q8_0, Inferflow's min-max formats) in builds whose loops
   below read them: F16C and no AVX-512 (the AVX-512 loops read float32 only). */
#if defined(__F16C__) && !defined(__AVX512F__)
#define HALF_BUILT 1
#include <immintrin.h>
#else
#define HALF_BUILT 0
#endif

int qmat_half_built(void) { return HALF_BUILT; }

/* Symmetric formats (Q4_0, Q5_0, Q8_0, Q6_K: min = -zero * scale, zero a power of two, so
   exact) hold no mins in builds whose loops derive them: the vector-type loops (no AVX-512). */
#if defined(__AVX512F__)
#define SYMMETRIC_BUILT 0
#else
#define SYMMETRIC_BUILT 1
#endif

int qmat_symmetric_built(void) { return SYMMETRIC_BUILT; }

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

/* codes . x over n (a constant where inlined) */
static inline __attribute__((always_inline)) float dot_u8(const uint8_t *c, const float *x,
                                                          const int n) {
    float t = 0.f;
    for (int i = 0; i < n; i++) t += (float)c[i] * x[i];
    return t;
}

/* 8-bit codes of one row, group by group: sum_g scale_g * (codes_g . x_g) + min_g * xs[g]
   (groups of 16 weights or any multiple) */
static float row_dot(const QMat *w, int64_t r, const float *x, const float *xs) {
    const int64_t G = w->k / w->group;
    const uint8_t *c = w->codes + r * w->k;
#if defined(__AVX512F__)
    if (w->group % 32 == 0) {
        const float *sc = w->scale + r * G, *mn = w->min + r * G;
        const int64_t chunks = w->group / 32;
        __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            __m512 t = _mm512_setzero_ps();
            for (int64_t j = 0; j < chunks; j++, c += 32) {
                const float *xc = x + (g * chunks + j) * 32;
                const __m512 fa = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)));
                const __m512 fb = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
                t = _mm512_fmadd_ps(fa, _mm512_loadu_ps(xc), t);
                t = _mm512_fmadd_ps(fb, _mm512_loadu_ps(xc + 16), t);
            }
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(sc[g]), acc);
        }
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 m = G - g >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g)) - 1);
            mins = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mn + g), _mm512_maskz_loadu_ps(m, xs + g), mins);
        }
        return _mm512_reduce_add_ps(acc) + _mm512_reduce_add_ps(mins);
    }
#endif
    const int64_t step = w->group % 32 ? 16 : 32; /* (fixed-length dots: the compiler unrolls) */
    float total = 0.f;
    for (int64_t g = 0; g < G; g++) {
        float t = 0.f;
        for (int64_t j = 0; j < w->group; j += step, c += step)
            t += step == 32 ? dot_u8(c, x + g * w->group + j, 32) : dot_u8(c, x + g * w->group + j, 16);
        total += ld1(w, w->scale, r * G + g) * t + min1(w, r * G + g) * xs[g];
    }
    return total;
}

#if defined(__AVX512BF16__)
/* vpermw reads the low 5 bits of each word: entry i is bf16(i & 15), so one nibble */
static inline __m512i nibble_table(void) {
    return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                            0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0, 0x4170,
                            0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                            0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0);
}
#endif

/* 4- or 5-bit codes of tile t in GCC vector types: rows 8h .. 8h + 7 of the tile in one vector
   (five: a constant where inlined, so the 4-bit loop carries no test of the fifth bits) */
static inline __attribute__((always_inline)) void tile_dot_body(const QMat *w, int64_t t,
                                                                const float *x, const float *xs,
                                                                float *out, const int five) {
    const int64_t G = w->k / w->group, chunks = w->group / 32;
    const uint8_t *c = w->codes + t * (w->k / 32) * 256;
    v8f acc[2] = {{0}, {0}};
    for (int64_t g = 0; g < G; g++) {
        v8f a[2][2] = {{{0}, {0}}, {{0}, {0}}};
        for (int64_t j = 0; j < chunks; j++, c += 256) {
            const float *xc = x + (g * chunks + j) * 32;
            for (int s = 0; s < 8; s++) /* word i: row i's columns 2s, 16 + 2s, 2s + 1, 17 + 2s */
                for (int h = 0; h < 2; h++) {
                    v8f q[4];
                    tile_codes(c + 32 * s + 16 * h, q);
                    if (five) tile_high(high_bits(w, t, g * chunks + j, s, h), q);
                    a[h][0] += q[0] * xc[2 * s] + q[2] * xc[2 * s + 1];
                    a[h][1] += q[1] * xc[16 + 2 * s] + q[3] * xc[17 + 2 * s];
                }
        }
        for (int h = 0; h < 2; h++)
            acc[h] += (a[h][0] + a[h][1]) * ld8(w, w->scale, (t * G + g) * 16 + 8 * h) +
                      min8(w, (t * G + g) * 16 + 8 * h) * xs[g];
    }
    memcpy(out, acc, sizeof acc);
}

static void tile_dot_v8(const QMat *w, int64_t t, const float *x, const float *xs, float *out) {
    if (w->high) tile_dot_body(w, t, x, xs, out, 1);
    else tile_dot_body(w, t, x, xs, out, 0);
}

/* 4-bit codes of tile t (16 rows): out[i] = row 16t + i of W x. xp: x's three bf16 parts */
static void tile_dot(const QMat *w, int64_t t, const float *x, const uint16_t *xp,
                     const float *xs, float *out) {
#if defined(__AVX512F__)
    if (w->high) { /* 5-bit codes */
        tile_dot_v8(w, t, x, xs, out);
        return;
    }
    const int64_t G = w->k / w->group, chunks = w->group / 32;
    const uint8_t *c = w->codes + t * (w->k / 32) * 256;
    const float *sc = w->scale + t * G * 16, *mn = w->min + t * G * 16;
    __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    const __m512i bf = nibble_table();
    (void)x;
    for (int64_t g = 0; g < G; g++) {
        __m512 a[6];
        for (int i = 0; i < 6; i++) a[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < chunks; j++, c += 256) {
            const int64_t col = (g * chunks + j) * 32;
            for (int s = 0; s < 8; s++) { /* columns 2s, 2s + 1 (low nibbles), 16 + 2s, 17 + 2s */
                const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c + 32 * s)));
                const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(b, bf);
                const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), bf);
                for (int p = 0; p < 3; p++) {
                    const int32_t *pair = (const int32_t *)(xp + p * w->k + col) + s;
                    a[2 * p] = _mm512_dpbf16_ps(a[2 * p], lo, (__m512bh)_mm512_set1_epi32(pair[0]));
                    a[2 * p + 1] = _mm512_dpbf16_ps(a[2 * p + 1], hi, (__m512bh)_mm512_set1_epi32(pair[8]));
                }
            }
        }
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                                         _mm512_add_ps(a[4], a[5]));
        acc = _mm512_fmadd_ps(sum, _mm512_loadu_ps(sc + g * 16), acc);
        mins = _mm512_fmadd_ps(_mm512_loadu_ps(mn + g * 16), _mm512_set1_ps(xs[g]), mins);
    }
#else
    (void)xp;
    /* vpermps reads the low 4 bits of each index: one nibble */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = 0; g < G; g++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t j = 0; j < chunks; j++) {
            const float *xc = x + (g * chunks + j) * 32;
            for (int s = 0; s < 8; s++, c += 32) { /* dword i: bytes 2i, 2i + 1 of row i */
                const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)c));
                a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(d, iota), _mm512_set1_ps(xc[2 * s]), a0);
                a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), iota),
                                     _mm512_set1_ps(xc[16 + 2 * s]), a1);
                a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 8), iota),
                                     _mm512_set1_ps(xc[2 * s + 1]), a0);
                a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 12), iota),
                                     _mm512_set1_ps(xc[17 + 2 * s]), a1);
            }
        }
        acc = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), _mm512_loadu_ps(sc + g * 16), acc);
        mins = _mm512_fmadd_ps(_mm512_loadu_ps(mn + g * 16), _mm512_set1_ps(xs[g]), mins);
    }
#endif
    _mm512_storeu_ps(out, _mm512_add_ps(acc, mins));
#else
    (void)xp;
    tile_dot_v8(w, t, x, xs, out);
#endif
}

static uint16_t to_bf16(float f) { /* round to nearest even (x is finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* xs[g]: the sum of x's group g (the min term's factor) */
static void group_sums(const QMat *w, const float *x, float *xs) {
    for (int64_t g = 0; g < w->k / w->group; g++) {
        float s = 0.f;
        for (int64_t i = 0; i < w->group; i++) s += x[g * w->group + i];
        xs[g] = s;
    }
}

/* group sums of x; for 4-bit tiles also x's three bf16 parts (k each) after them */
static void prepare_x(const QMat *w, const float *x, float *xs) {
    group_sums(w, x, xs);
    if (w->bits == 4) {
        uint16_t *xp = (uint16_t *)(xs + w->k / 32);
        for (int64_t i = 0; i < w->k; i++) { /* each subtraction is exact in float32 */
            float left = x[i];
            for (int p = 0; p < 3; p++) {
                xp[p * w->k + i] = to_bf16(left);
                left -= from_bf16(xp[p * w->k + i]);
            }
        }
    }
}

/* inside a parallel region: y[r] = (add ? y[r] : 0) + W x; xs: scratch of k / 32 + 2k floats */
static void gemv_in_team(const QMat *w, const float *x, float *xs, float *y, int add) {
#pragma omp single
    prepare_x(w, x, xs);
    if (w->bits != 8) { /* 4- or 5-bit tiles */
        const uint16_t *xp = (const uint16_t *)(xs + w->k / 32);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (w->n + 15) / 16; t++) {
            float out[16];
            tile_dot(w, t, x, xp, xs, out);
            for (int64_t i = 0; i < 16 && t * 16 + i < w->n; i++)
                y[t * 16 + i] = (add ? y[t * 16 + i] : 0.f) + out[i];
        }
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < w->n; r++) y[r] = (add ? y[r] : 0.f) + row_dot(w, r, x, xs);
    }
}

void qmat_gemv(const QMat *w, const float *x, int64_t M, float *xs, float *y, int nthreads) {
    for (int64_t m = 0; m < M; m++) {
#pragma omp parallel num_threads(nthreads)
        gemv_in_team(w, x + m * w->k, xs, y + m * w->n, 0);
    }
}

/* --- many rows of x at once (4-bit tiles, AVX512-BF16) ---------------------------------------
   Y (M, n) = X (M, k) W^T with X rounded to bf16 for the codes' products (the precision of the
   batched calls, as torch's int4pack kernel; scales, mins and the min term's group sums of X
   stay float32). Rows of X go MB at a time, so each tile's codes are unpacked once per MB rows.
   xb: scratch of M k uint16, xs: of M k / group floats. Returns 1 (nothing written) where it
   cannot run: 8-bit codes, or no AVX512-BF16 in this build. */
#if defined(__AVX512BF16__)
#define MB 6
static inline __attribute__((always_inline)) void tile_rows(const QMat *w, int64_t t,
                                                            const uint16_t *xb, const float *xs,
                                                            int64_t m0, const int mb, float *y) {
    const int64_t G = w->k / w->group, chunks = w->group / 32, k = w->k;
    const uint8_t *c = w->codes + t * (k / 32) * 256;
    const float *sc = w->scale + t * G * 16, *mn = w->min + t * G * 16;
    const __m512i bf = nibble_table();
    __m512 acc[MB], lo_acc[MB], hi_acc[MB];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int m = 0; m < mb; m++) lo_acc[m] = hi_acc[m] = _mm512_setzero_ps();
        for (int64_t j = 0; j < chunks; j++, c += 256) {
            const int64_t col = (g * chunks + j) * 32;
            for (int s = 0; s < 8; s++) {
                const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c + 32 * s)));
                const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(b, bf);
                const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), bf);
                for (int m = 0; m < mb; m++) {
                    const int32_t *pair = (const int32_t *)(xb + (m0 + m) * k + col) + s;
                    lo_acc[m] = _mm512_dpbf16_ps(lo_acc[m], lo, (__m512bh)_mm512_set1_epi32(pair[0]));
                    hi_acc[m] = _mm512_dpbf16_ps(hi_acc[m], hi, (__m512bh)_mm512_set1_epi32(pair[8]));
                }
            }
        }
        const __m512 scv = _mm512_loadu_ps(sc + g * 16), mnv = _mm512_loadu_ps(mn + g * 16);
        for (int m = 0; m < mb; m++) {
            acc[m] = _mm512_fmadd_ps(_mm512_add_ps(lo_acc[m], hi_acc[m]), scv, acc[m]);
            acc[m] = _mm512_fmadd_ps(mnv, _mm512_set1_ps(xs[(m0 + m) * G + g]), acc[m]);
        }
    }
    const int64_t rows = w->n - 16 * t < 16 ? w->n - 16 * t : 16;
    for (int m = 0; m < mb; m++)
        _mm512_mask_storeu_ps(y + (m0 + m) * w->n + 16 * t, (__mmask16)((1u << rows) - 1), acc[m]);
}
#endif

int qmat_gemm_built(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int qmat_gemm(const QMat *w, const float *x, int64_t M, uint16_t *xb, float *xs, float *y,
              int nthreads) {
#if defined(__AVX512BF16__)
    if (w->bits != 4) return 1;
    const int64_t k = w->k, G = k / w->group, T = (w->n + 15) / 16, blocks = (M + MB - 1) / MB;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            for (int64_t i = 0; i < k; i++) xb[m * k + i] = to_bf16(x[m * k + i]);
            group_sums(w, x + m * k, xs + m * G);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t m0 = b * MB;
                switch (M - m0 < MB ? M - m0 : MB) { /* constant row counts: accumulators in registers */
                case 1: tile_rows(w, t, xb, xs, m0, 1, y); break;
                case 2: tile_rows(w, t, xb, xs, m0, 2, y); break;
                case 3: tile_rows(w, t, xb, xs, m0, 3, y); break;
                case 4: tile_rows(w, t, xb, xs, m0, 4, y); break;
                case 5: tile_rows(w, t, xb, xs, m0, 5, y); break;
                default: tile_rows(w, t, xb, xs, m0, MB, y);
                }
            }
    }
    return 0;
#else
    (void)w, (void)x, (void)M, (void)xb, (void)xs, (void)y, (void)nthreads;
    return 1;
#endif
}

/* --- many rows of x at once, float32 (every CPU) --------------------------------------------
   Y (M, n) = X (M, k) W^T on the codec's values in float32: each 16-row tile of W is
   dequantized (code * scale + min) KB columns at a time into a small float buffer, which then
   meets every row of X (its 16 outputs per row stay in y). The weights are read once per call
   whatever M is; no copy of W besides the plane. Written with GCC vector types of 8 floats (one ymm
   on AVX2 and AVX-512, scalar code elsewhere). */
#define KB 128 /* columns dequantized at once: 8 KiB of floats */

/* columns [c0, c0 + KB) (a multiple of 32 wide, inside k) of 4- or 5-bit tile t as wt[c][i] */
static void tile_floats(const QMat *w, int64_t t, int64_t c0, int64_t cols, float *wt) {
    const int64_t G = w->k / w->group;
    for (int64_t j = c0 / 32; j < (c0 + cols) / 32; j++) {
        const uint8_t *c = w->codes + (t * (w->k / 32) + j) * 256;
        const int64_t at = (t * G + j * 32 / w->group) * 16;
        float *out = wt + 16 * (j * 32 - c0);
        for (int s = 0; s < 8; s++)
            for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
                const v8f sc = ld8(w, w->scale, at + 8 * h), mn = min8(w, at + 8 * h);
                const int col[4] = {2 * s, 16 + 2 * s, 2 * s + 1, 17 + 2 * s};
                v8f q[4];
                tile_codes(c + 32 * s + 16 * h, q);
                if (w->high) tile_high(high_bits(w, t, j, s, h), q);
                for (int e = 0; e < 4; e++) {
                    const v8f f = q[e] * sc + mn;
                    memcpy(out + 16 * col[e] + 8 * h, &f, sizeof f);
                }
            }
    }
}

/* rows m0 .. m0 + mr of Y's tile t += X's columns [c0, c0 + cols) times wt; mr <= MR is a
   constant where inlined, so the 2 mr accumulators stay in registers */
#define MR 4
static inline __attribute__((always_inline)) void tile_update(const float *wt, const float *x,
                                                               int64_t k, int64_t c0, int64_t cols,
                                                               float *y, int64_t n, int64_t rows,
                                                               int64_t m0, const int mr) {
    v8f acc[MR][2];
    for (int m = 0; m < mr; m++) {
        float *ym = y + (m0 + m) * n;
        if (c0 == 0) acc[m][0] = acc[m][1] = (v8f){0};
        else if (rows == 16) memcpy(acc[m], ym, sizeof acc[m]);
        else {
            float t[16] = {0};
            memcpy(t, ym, sizeof(float) * rows);
            memcpy(acc[m], t, sizeof t);
        }
    }
    for (int64_t c = 0; c < cols; c++) {
        v8f w0, w1;
        memcpy(&w0, wt + 16 * c, sizeof w0);
        memcpy(&w1, wt + 16 * c + 8, sizeof w1);
        for (int m = 0; m < mr; m++) {
            const float xv = x[(m0 + m) * k + c0 + c];
            acc[m][0] += w0 * xv;
            acc[m][1] += w1 * xv;
        }
    }
    for (int m = 0; m < mr; m++) memcpy(y + (m0 + m) * n, acc[m], sizeof(float) * rows);
}

/* 8-bit rows: row r of W dequantized (wr, k floats) meets rows m0 .. m0 + mr of X */
static inline __attribute__((always_inline)) void row_update(const float *wr, const float *x,
                                                              int64_t k, float *y, int64_t n,
                                                              int64_t r, int64_t m0, const int mr) {
    v8f acc[MR];
    for (int m = 0; m < mr; m++) acc[m] = (v8f){0};
    for (int64_t c = 0; c < k; c += 8) {
        v8f wv;
        memcpy(&wv, wr + c, sizeof wv);
        for (int m = 0; m < mr; m++) {
            v8f xv;
            memcpy(&xv, x + (m0 + m) * k + c, sizeof xv);
            acc[m] += wv * xv;
        }
    }
    for (int m = 0; m < mr; m++) {
        float s = 0.f;
        for (int i = 0; i < 8; i++) s += acc[m][i];
        y[(m0 + m) * n + r] = s;
    }
}

static void gemm_rows_f32(const QMat *w, const float *x, int64_t M, float *y, float *wr,
                          int64_t r) {
    const int64_t k = w->k, G = k / w->group;
    const uint8_t *c = w->codes + r * k;
    for (int64_t g = 0; g < G; g++) {
        const float sc = ld1(w, w->scale, r * G + g), mn = min1(w, r * G + g);
        for (int64_t j = g * w->group; j < (g + 1) * w->group; j++) wr[j] = (float)c[j] * sc + mn;
    }
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR) row_update(wr, x, k, y, w->n, r, m0, MR);
    switch (M - m0) {
    case 1: row_update(wr, x, k, y, w->n, r, m0, 1); break;
    case 2: row_update(wr, x, k, y, w->n, r, m0, 2); break;
    case 3: row_update(wr, x, k, y, w->n, r, m0, 3); break;
    default: break;
    }
}

void qmat_gemm_f32(const QMat *w, const float *x, int64_t M, float *y, float *scratch,
                   int nthreads) {
    const int64_t k = w->k, n = w->n, T = (n + 15) / 16;
    if (w->bits == 8) {
#pragma omp parallel num_threads(nthreads)
        {
            float *wr = scratch + (int64_t)omp_get_thread_num() * k;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) gemm_rows_f32(w, x, M, y, wr, r);
        }
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        float wt[16 * KB] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const int64_t rows = n - 16 * t < 16 ? n - 16 * t : 16;
            float *yt = y + 16 * t;
            for (int64_t c0 = 0; c0 < k; c0 += KB) {
                const int64_t cols = k - c0 < KB ? k - c0 : KB;
                const float *f = wt;
                tile_floats(w, t, c0, cols, wt);
                int64_t m0 = 0;
                for (; m0 + MR <= M; m0 += MR) tile_update(f, x, k, c0, cols, yt, n, rows, m0, MR);
                switch (M - m0) {
                case 1: tile_update(f, x, k, c0, cols, yt, n, rows, m0, 1); break;
                case 2: tile_update(f, x, k, c0, cols, yt, n, rows, m0, 2); break;
                case 3: tile_update(f, x, k, c0, cols, yt, n, rows, m0, 3); break;
                default: break;
                }
            }
        }
    }
}

/* x (hidden) in place through every layer. kc / vc: layer 0 of the cache, layer l at
   l * layer_stride floats, slot s of KV head g at (s * KV heads + g) * head_dim; this token's
   K / V go to slots[n - 1]. scratch: at least hidden + (heads + 2 kv_heads) head_dim + heads
   head_dim + 3 inner + heads * n + K / 32 + 2K floats, K = max(hidden, inner, heads * head_dim)
   (the widest product's input: its group sums and bf16 parts). */
void decode_stack(const Layer *layers, int64_t L, const Dims *d, float *x, const float *cos,
                  const float *sin, float *kc, float *vc, int64_t layer_stride,
                  const int64_t *slots, int64_t n, float *scratch, int nthreads) {
    const int64_t H = d->heads, KVH = d->kv_heads, D = d->head_dim, F = d->inner;
    float *h = scratch, *qkv = h + d->hidden, *att = qkv + (H + 2 * KVH) * D;
    float *gu = att + H * D, *act = gu + 2 * F, *p = act + F, *xs = p + H * n;
    const int64_t w = slots[n - 1];
#pragma omp parallel num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        const Layer *ly = layers + l;
        float *k = kc + l * layer_stride, *v = vc + l * layer_stride;
#pragma omp single
        rms_norm_row(x, ly->attn_norm, d->hidden, d->eps, d->norm_offset, h);
        gemv_in_team(&ly->qkv, h, xs, qkv, 0);
#pragma omp single
        {
            for (int64_t j = 0; j < H + KVH; j++)
                rope_head(qkv + j * D, cos, sin, d->rotary_dim, d->adjacent);
            memcpy(k + w * KVH * D, qkv + H * D, sizeof(float) * KVH * D);
            memcpy(v + w * KVH * D, qkv + (H + KVH) * D, sizeof(float) * KVH * D);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < H; j++) /* (the last slot is this token's) */
            attend_head_any(qkv + j * D, k, v, slots, n, KVH * D, j / (H / KVH) * D, D, d->scale,
                            p + j * n, att + j * D);
        gemv_in_team(&ly->o, att, xs, x, 1);
#pragma omp single
        rms_norm_row(x, ly->ffn_norm, d->hidden, d->eps, d->norm_offset, h);
        gemv_in_team(&ly->gate_up, h, xs, gu, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < F; i++) act[i] = gu[i] / (1.f + expf(-gu[i])) * gu[F + i];
        gemv_in_team(&ly->down, act, xs, x, 1);
    }
}
