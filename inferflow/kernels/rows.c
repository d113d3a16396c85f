/* Row-wise float32 ops of a forward pass that torch runs as several kernels each: rotary
   embedding in place (Rotary.rotate_) and RMS norm (RMSNorm). Each row is computed on its own,
   the same way whatever the other rows, so results never depend on the batch. OpenMP threads
   come from the runtime torch already loaded (the same libgomp.so.1). */
#include <math.h>
#include <stdint.h>

/* Rotary embedding in place, float32: row i of x holds `heads` heads of D floats (the heads
   contiguous, rows `stride` floats apart); the first rd dims of every head are rotated by the
   angles of row i, cos and sin (N, rd / 2). Pairs are (j, j + rd / 2) ("half") or (2j, 2j + 1)
   ("adjacent"); each output is a * c - b * s or b * c + a * s, each product rounded as in the
   torch path (no fused multiply-add), so the two paths agree bit for bit. */
__attribute__((optimize("fp-contract=off"))) void rope_f32(float *x, int64_t N, int64_t stride, int64_t heads, int64_t D, int64_t rd,
              const float *cos, const float *sin, int adjacent, int nthreads) {
    const int64_t h = rd / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * heads >= 256)
    for (int64_t i = 0; i < N; i++) {
        const float *c = cos + i * h, *s = sin + i * h;
        for (int64_t g = 0; g < heads; g++) {
            float *v = x + i * stride + g * D;
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
    }
}

/* out[i] = (x[i] * r) * w[i] per row of D, r = 1 / sqrt(mean(x^2) + eps): torch's rms_norm
   order of operations (only the sum of squares is summed in another order) */
__attribute__((optimize("fp-contract=off"))) void rms_norm_f32(const float *x, int64_t N,
                                                               int64_t D, const float *w,
                                                               float eps, float *out,
                                                               int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * D >= 65536)
    for (int64_t i = 0; i < N; i++) {
        const float *xi = x + i * D;
        float ss = 0.f;
        for (int64_t d = 0; d < D; d++) ss += xi[d] * xi[d];
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        float *o = out + i * D;
        for (int64_t d = 0; d < D; d++) o[d] = (xi[d] * r) * w[d];
    }
}
