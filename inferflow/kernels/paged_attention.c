/* Paged attention of one decode step (one new query per sequence), float32.

   For sequence b and KV head g, the r = H / KVH query heads of g attend over the keys in the
   first lens[b] cache slots listed in slots[b * S ...]; every listed key is visible (a plain
   causal decode step: no window, bias or soft-cap). kc and vc are one layer of the paged cache
   viewed as (slots, KVH, D); q and out are (B, H, D); all row-major and contiguous.

   Reads each key and value once, straight from its block: no gathered or padded copy. The
   (b, g) tasks are independent, so a sequence's result never depends on the rest of the batch.
   OpenMP threads come from the runtime torch already loaded (the same libgomp.so.1). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *slots,
                     const int64_t *lens, int64_t B, int64_t S, int64_t H, int64_t KVH,
                     int64_t D, float scale, float *out, int nthreads) {
    const int64_t r = H / KVH;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KVH; task++) {
        const int64_t b = task / KVH, g = task % KVH, n = lens[b];
        const int64_t *sl = slots + b * S;
        float *p = malloc(sizeof(float) * (size_t)(r * n + r));
        if (p == NULL) {
            failed = 1;
            continue;
        }
        float *mx = p + r * n;
        for (int64_t j = 0; j < r; j++) mx[j] = -INFINITY;
        for (int64_t t = 0; t < n; t++) { /* scores q . k, and each head's largest */
            const float *k = kc + (sl[t] * KVH + g) * D;
            for (int64_t j = 0; j < r; j++) {
                const float *qj = q + (b * H + g * r + j) * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qj[d] * k[d];
                s *= scale;
                p[j * n + t] = s;
                if (s > mx[j]) mx[j] = s;
            }
        }
        for (int64_t j = 0; j < r; j++) { /* softmax */
            float sum = 0.f;
            for (int64_t t = 0; t < n; t++) {
                const float e = expf(p[j * n + t] - mx[j]);
                p[j * n + t] = e;
                sum += e;
            }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) p[j * n + t] *= inv;
            float *o = out + (b * H + g * r + j) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        }
        for (int64_t t = 0; t < n; t++) { /* weighted sum of the values */
            const float *v = vc + (sl[t] * KVH + g) * D;
            for (int64_t j = 0; j < r; j++) {
                const float w = p[j * n + t];
                float *o = out + (b * H + g * r + j) * D;
                for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
            }
        }
        free(p);
    }
    return failed;
}
