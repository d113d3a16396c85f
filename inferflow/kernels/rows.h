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
#include "expf.h"

/* out[i] = g[i] / (1 + expf(-g[i])) * u[i] (SiLU of the gate times the up projection) for n
   values, each rounded as that scalar expression with expf_one (expf.h) */
EXPF_EXACT static void silu_gate_row(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.f + expf_one(-g[i])) * u[i];
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
