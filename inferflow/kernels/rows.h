/* One row's RMS norm, one head's rotary embedding and one row's SiLU gate, float32, shared by
   rows.c (the batched forward's row-wise ops) and quant_decode.c (one token through a whole
   decoder): both libraries give the same bits, so a token prefilled and the same token decoded
   agree. Products are rounded one by one (no fused multiply-add), as torch computes them:
   rotation is bit for bit the torch path; the norm differs from torch's only in the order its
   sum of squares is added up, the gate by torch's exp (within an ulp; ours correctly rounded). */
#ifndef INFERFLOW_ROWS_H
#define INFERFLOW_ROWS_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)

/* expf of 16 floats, each correctly rounded but where the exact value lies within ~1e-14 of a
   rounding boundary (libm's expf is correctly rounded too, torch's vectorized one within an
   ulp): exp in double (x - n ln 2 by two fused steps, Taylor to the 11th power: relative error
   below 1e-14), then one rounding to float, denormals and overflow to inf included. NaN stays
   NaN. */
static inline __m512 exp16_cr(__m512 x) {
    __m512d h[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                    _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))};
    static const double inv_fact[12] = {1.0,
                                        1.0,
                                        1.0 / 2,
                                        1.0 / 6,
                                        1.0 / 24,
                                        1.0 / 120,
                                        1.0 / 720,
                                        1.0 / 5040,
                                        1.0 / 40320,
                                        1.0 / 362880,
                                        1.0 / 3628800,
                                        1.0 / 39916800};
    __m256 f[2];
    for (int i = 0; i < 2; i++) {
        /* below -104 the float result is 0, above 89 inf: clamp there (NaN passes: max / min
           return their second operand where one is NaN) */
        const __m512d a = _mm512_min_pd(_mm512_set1_pd(89.0), _mm512_max_pd(_mm512_set1_pd(-104.0), h[i]));
        const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(a, _mm512_set1_pd(1.4426950408889634)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), a);
        r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
        __m512d p = _mm512_set1_pd(inv_fact[11]);
        for (int k = 10; k >= 0; k--) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inv_fact[k]));
        f[i] = _mm512_cvtpd_ps(_mm512_scalef_pd(p, n));
    }
    return _mm512_insertf32x8(_mm512_castps256_ps512(f[0]), f[1], 1);
}
#endif

/* out[i] = g[i] / (1 + expf(-g[i])) * u[i] (SiLU of the gate times the up projection) for n
   values, each rounded as the scalar expression with a correctly rounded expf */
__attribute__((optimize("fp-contract=off"))) static void silu_gate_row(const float *g,
                                                                       const float *u, int64_t n,
                                                                       float *out) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = exp16_cr(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
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
