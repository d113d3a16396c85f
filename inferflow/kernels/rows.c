/* Row-wise float32 ops of a forward pass that torch runs as several kernels each: rotary
   embedding in place (Rotary.rotate_) and RMS norm (RMSNorm), the per-row code in rows.h. Each
   row is computed on its own, the same way whatever the other rows, so results never depend on
   the batch. OpenMP threads come from the runtime torch already loaded (libgomp.so.1). */
#include "rows.h"

/* x: N rows, `stride` floats apart, each of `heads` contiguous heads of D floats, rotated in
   place by row i's angles cos / sin (N, rd / 2) */
void rope_f32(float *x, int64_t N, int64_t stride, int64_t heads, int64_t D, int64_t rd,
              const float *cos, const float *sin, int adjacent, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * heads >= 256)
    for (int64_t i = 0; i < N; i++)
        for (int64_t g = 0; g < heads; g++)
            rope_head(x + i * stride + g * D, cos + i * (rd / 2), sin + i * (rd / 2), rd, adjacent);
}

/* out (N, D) = the RMS norm of each row of x (N, D), scaled by w */
void rms_norm_f32(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * D >= 65536)
    for (int64_t i = 0; i < N; i++) rms_norm_row(x + i * D, w, D, eps, 0.f, out + i * D);
}

/* out (N, F) = SiLU(h[:, :F]) * h[:, F:] for h (N, 2F), the gated FFN's [gate | up] rows */
void silu_gate_f32(const float *h, int64_t N, int64_t F, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * F >= 65536)
    for (int64_t i = 0; i < N; i++) silu_gate_row(h + i * 2 * F, h + i * 2 * F + F, F, out + i * F);
}
