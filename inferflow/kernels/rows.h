/* One row's RMS norm, one head's rotary embedding and one row's SiLU gate, float32, shared by
   rows.c (the batched forward's row-wise ops) and quant_decode.c (one token through a whole
   decoder): both libraries give the same bits, so a token prefilled and the same token decoded
   agree. Products are rounded one by one (no fused multiply-add), as torch computes them:
   rotation is bit for bit the torch path; the norm differs from torch's only in the order its
   sum of squares is added up, the gate by its exp (torch's and ours each within 2 ulp). */
#ifndef INFERFLOW_ROWS_H
#define INFERFLOW_ROWS_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
/* expf in float, the same operations in the vector and the scalar code (so every value gets
   the same bits whichever loop computes it, and a build without AVX-512 the same as one with):
   x clamped to [-104, 89] (below, the float result is 0; above, inf; NaN passes), n = x log2 e
   rounded to the nearest integer, r = x - n ln 2 by two fused steps (ln 2's high part has 15
   significant bits: n hi is exact), e^r by Taylor's polynomial to r^7 (|r| <= 0.35: the
   truncation is below 6e-9 relative) in fused steps, times 2^n rounded once (denormals
   included). The gate below is then within 2.4 ulp of float64, as torch's is (tests/
   test_kernels.py); 2.5x faster than the correctly rounded double-precision exp it replaced
   (256 x 1536 values on one thread: 0.21 -> 0.085 ms); AVX2 builds take 8 at a time (0.16 ms
   there, against 1.2 ms with libm's expf one at a time before). */
#define EXPF_LO (-104.f)
#define EXPF_HI 89.f
#define EXPF_LOG2E 1.44269502f
#define EXPF_LN2_HI 0.693145751953125f
#define EXPF_LN2_LO 1.4286068203094173e-06f
static const float expf_poly[8] = {1.f,         1.f,           0.5f,           1.f / 6,
                                   1.f / 24,    1.f / 120,     1.f / 720,      1.f / 5040};

/* (every function of the gate keeps the order its operations are written in: the library's
   -fassociative-math would fold exp8_rows's two powers of 2 into one, which overflows) */
#define EXPF_EXACT __attribute__((optimize("no-associative-math", "fp-contract=off")))

EXPF_EXACT static inline float expf_rows(float x) {
    if (x != x) return x; /* NaN */
    float a = x < EXPF_LO ? EXPF_LO : x;
    a = a > EXPF_HI ? EXPF_HI : a;
    const float n = nearbyintf(a * EXPF_LOG2E);
    const float r = fmaf(-n, EXPF_LN2_LO, fmaf(-n, EXPF_LN2_HI, a));
    float p = expf_poly[7];
    for (int k = 6; k >= 0; k--) p = fmaf(p, r, expf_poly[k]);
    return ldexpf(p, (int)n);
}

#if defined(__AVX512F__)
/* expf_rows of 16 floats (max / min return their second operand where one is NaN) */
EXPF_EXACT static inline __m512 exp16_rows(__m512 x) {
    const __m512 a = _mm512_min_ps(_mm512_set1_ps(EXPF_HI), _mm512_max_ps(_mm512_set1_ps(EXPF_LO), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(EXPF_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), n);
    __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(EXPF_LN2_HI), a);
    r = _mm512_fmadd_ps(m, _mm512_set1_ps(EXPF_LN2_LO), r);
    __m512 p = _mm512_set1_ps(expf_poly[7]);
    for (int k = 6; k >= 0; k--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(expf_poly[k]));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 2^k for integers k in [-126, 127] */
EXPF_EXACT static inline __m256 pow2_8(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

/* expf_rows of 8 floats (AVX2 builds). 2^n as two normal powers (n in [-150, 128]): p times
   the first is exact, the second product rounds once, as ldexpf does */
EXPF_EXACT static inline __m256 exp8_rows(__m256 x) {
    const __m256 a = _mm256_min_ps(_mm256_set1_ps(EXPF_HI), _mm256_max_ps(_mm256_set1_ps(EXPF_LO), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(EXPF_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 m = _mm256_sub_ps(_mm256_setzero_ps(), n);
    __m256 r = _mm256_fmadd_ps(m, _mm256_set1_ps(EXPF_LN2_HI), a);
    r = _mm256_fmadd_ps(m, _mm256_set1_ps(EXPF_LN2_LO), r);
    __m256 p = _mm256_set1_ps(expf_poly[7]);
    for (int k = 6; k >= 0; k--) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(expf_poly[k]));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(n1)), pow2_8(_mm256_sub_epi32(ni, n1)));
}
#endif

/* out[i] = g[i] / (1 + expf(-g[i])) * u[i] (SiLU of the gate times the up projection) for n
   values, each rounded as that scalar expression with expf_rows */
EXPF_EXACT static void silu_gate_row(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = exp16_rows(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp8_rows(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.f + expf_rows(-g[i])) * u[i];
}

/* out[i] = (x[i] * r) * (offset + w[i]), r = 1 / sqrt(mean(x^2) + eps). The sum of squares
   in one fixed order (16 lanes, then _mm512_reduce_add_ps's tree; else one by one) and no
   reassociation: every library that includes this (rows.c's batched norm, the one-call
   decode) gives the same bits, whatever the compiler makes of its other loops. */
__attribute__((optimize("no-associative-math", "fp-contract=off"))) static void rms_norm_row(
    const float *x, const float *w, int64_t D, float eps, float offset, float *out) {
    float ss = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i < D; i += 16) {
        const __mmask16 m = D - i >= 16 ? 0xFFFF : (__mmask16)((1u << (D - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < D; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    for (i = 0; i < D; i++) out[i] = (x[i] * r) * (offset + w[i]);
}

/* the first rd dims of one head v in place, by angles cos / sin (rd / 2): pairs (j, j + rd / 2),
   or (2j, 2j + 1) where adjacent; a * c - b * s and b * c + a * s */
__attribute__((optimize("fp-contract=off"))) static void rope_head(float *v, const float *c,
                                                                   const float *s, int64_t rd,
                                                                   int adjacent) {
    const int64_t h = rd / 2;
    if (adjacent) {
        for (int64_t j = 0; j < h; j++) {
            const float a = v[2 * j], b = v[2 * j + 1];
            v[2 * j] = a * c[j] - b * s[j];
            v[2 * j + 1] = b * c[j] + a * s[j];
        }
    } else {
        for (int64_t j = 0; j < h; j++) {
            const float a = v[j], b = v[j + h];
            v[j] = a * c[j] - b * s[j];
            v[j + h] = b * c[j] + a * s[j];
        }
    }
}
#endif
