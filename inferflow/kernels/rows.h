/* One row's RMS norm and one head's rotary embedding, float32, shared by rows.c (the batched
   forward's row-wise ops) and quant_decode.c (one token through a whole decoder). Products are
   rounded one by one (no fused multiply-add), as torch computes them: rotation is bit for bit
   the torch path; the norm differs only in the order its sum of squares is added up. */
#ifndef INFERFLOW_ROWS_H
#define INFERFLOW_ROWS_H
#include <math.h>
#include <stdint.h>

/* out[i] = (x[i] * r) * (offset + w[i]), r = 1 / sqrt(mean(x^2) + eps) */
__attribute__((optimize("fp-contract=off"))) static void rms_norm_row(const float *x,
                                                                      const float *w, int64_t D,
                                                                      float eps, float offset,
                                                                      float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < D; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = (x[i] * r) * (offset + w[i]);
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
