/* expf in float for the row kernels (rows.h's SiLU gate) and attention's softmax (attend.h):
   one algorithm in a scalar, an AVX2 (8 floats) and an AVX-512 (16 floats) form with the same
   operations, so every value gets the same bits whichever form computes it. x clamped to
   [-104, 89] (below, the float result is 0; above, inf; NaN passes), n = x log2 e rounded to
   the nearest integer, r = x - n ln 2 by two fused steps (ln 2's high part has 15 significant
   bits: n hi is exact), e^r by Taylor's polynomial to r^7 (|r| <= 0.35: the truncation is
   below 6e-9 relative) in fused steps, times 2^n rounded once (denormals included). The SiLU
   gate is then within 2.4 ulp of float64, as torch's is (tests/test_kernels.py); 2.5x faster
   than the correctly rounded double-precision exp it replaced (256 x 1536 values on one
   thread: 0.21 -> 0.085 ms); AVX2 builds take 8 at a time (0.16 ms there, against 1.2 ms with
   libm's expf one at a time before). */
#ifndef INFERFLOW_EXPF_H
#define INFERFLOW_EXPF_H
#include <math.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define EXPF_LO (-104.f)
#define EXPF_HI 89.f
#define EXPF_LOG2E 1.44269502f
#define EXPF_LN2_HI 0.693145751953125f
#define EXPF_LN2_LO 1.4286068203094173e-06f
static const float expf_poly[8] = {1.f,         1.f,           0.5f,           1.f / 6,
                                   1.f / 24,    1.f / 120,     1.f / 720,      1.f / 5040};

/* (every function of it, and every caller that needs its bits, keeps the order its operations
   are written in: the libraries' -fassociative-math would fold exp8's two powers of 2 into
   one, which overflows) */
#define EXPF_EXACT __attribute__((optimize("no-associative-math", "fp-contract=off")))

EXPF_EXACT static inline float expf_one(float x) {
    if (x != x) return x; /* NaN */
    float a = x < EXPF_LO ? EXPF_LO : x;
    a = a > EXPF_HI ? EXPF_HI : a;
    const float n = nearbyintf(a * EXPF_LOG2E);
    const float r = fmaf(-n, EXPF_LN2_LO, fmaf(-n, EXPF_LN2_HI, a));
    float p = expf_poly[7];
    for (int k = 6; k >= 0; k--) p = fmaf(p, r, expf_poly[k]);
    return ldexpf(p, (int)n);
}

/* the vector forms' common part: n and e^r (p) of x, V the intrinsics' prefix, T the vector
   type, ROUND(v) to the nearest integer (max / min return their second operand where one is
   NaN: NaN passes) */
#define EXPF_VECTOR_BODY(V, T, ROUND)                                                             \
    const T a = V##_min_ps(V##_set1_ps(EXPF_HI), V##_max_ps(V##_set1_ps(EXPF_LO), x));          \
    const T n = ROUND(V##_mul_ps(a, V##_set1_ps(EXPF_LOG2E)));                                   \
    const T m = V##_sub_ps(V##_setzero_ps(), n);                                                 \
    T r = V##_fmadd_ps(m, V##_set1_ps(EXPF_LN2_HI), a);                                          \
    r = V##_fmadd_ps(m, V##_set1_ps(EXPF_LN2_LO), r);                                            \
    T p = V##_set1_ps(expf_poly[7]);                                                             \
    for (int k = 6; k >= 0; k--) p = V##_fmadd_ps(p, r, V##_set1_ps(expf_poly[k]))

#if defined(__AVX512F__)
#define EXPF_ROUND16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* expf_one of 16 floats */
EXPF_EXACT static inline __m512 exp16(__m512 x) {
    EXPF_VECTOR_BODY(_mm512, __m512, EXPF_ROUND16);
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define EXPF_ROUND8(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^k for integers k in [-126, 127] */
EXPF_EXACT static inline __m256 pow2_8(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

/* expf_one of 8 floats. 2^n as two normal powers (n in [-150, 128]): p times the first is
   exact, the second product rounds once, as ldexpf does */
EXPF_EXACT static inline __m256 exp8(__m256 x) {
    EXPF_VECTOR_BODY(_mm256, __m256, EXPF_ROUND8);
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(n1)), pow2_8(_mm256_sub_epi32(ni, n1)));
}
#endif

#endif /* INFERFLOW_EXPF_H */
