/* QMat (an affine-quantized W, layouts in quant_decode.c's comment) and the float32 products
   over it on vector types: 4- and 5-bit tiles (tile_dot_rows), 8-bit rows (row_dot_rows). Part
   of quant_decode.c, which includes it after its pragma (no reassociation, no contraction). */
#ifndef INFERFLOW_QMAT_H
#define INFERFLOW_QMAT_H

#include <stdint.h>
#if defined(__FMA__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *codes;
    const float *scale, *min; /* (n, k / group) */
    int64_t n, k, group;
    int32_t bits; /* 4, 6 (AVX-512 tiles) or 8 (5-bit codes: 4 and high) */
    int32_t half; /* scale and min are float16 (only where qmat_half_built()) */
    const uint8_t *high; /* 5-bit codes: their fifth bits; 6-bit: their top two (else NULL) */
    float zero;          /* min NULL (symmetric formats, SYMMETRIC_BUILT only): min = -zero * scale */
    /* sb > 0 (AVX-512 tiles, k-quants): scales and mins in two levels, as the file holds them:
       scale and min are float16 (tiles, k / group / sb, 16), one per sb groups, and the groups'
       own are those times sc8 and mn8 (tiles, k / group, 16) int8; sb is a power of two */
    const int8_t *sc8, *mn8;
    int64_t sb;
    int64_t ldy; /* floats between rows of the products' output (0: n; more where W's rows are
                    some of the output's columns: a layer held as several planes) */
} QMat;

/* floats between rows of W's products' output */
static inline int64_t ldy_of(const QMat *w) { return w->ldy ? w->ldy : w->n; }

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
        float *y = out + m * ldy_of(w) + 16 * t;
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
            float *y = out + m * ldy_of(w) + r0 + r;
            *y = (add ? *y : 0.f) + (s + mins[r][m]);
        }
}

#endif /* INFERFLOW_QMAT_H */
