/* Paged attention of one decode step (one new query per sequence), float32 queries over a
   float32, float16 or Q8_0 cache.

   For query row b and KV head g, the r = H / KVH query heads of g attend over the keys in the
   first lens[b] cache slots listed in slots[i * S ...], i = which[b] (which NULL: i = b; a
   prompt's rows share their sequence's list); every listed key is visible (a plain
   causal decode step: no window, bias or soft-cap). kc and vc are one layer of the paged cache
   viewed as (slots, KVH, D); q and out are (B, H, D); all row-major and contiguous.

   Reads the keys and values straight from their blocks, one query head at a time (attend.h):
   no gathered or padded copy; the query heads of one KV head read its keys again, from the
   CPU's caches. The tasks are independent, so a sequence's result never depends on the rest of
   the batch. OpenMP threads come from the runtime torch already loaded (libgomp.so.1). */
#include <stdlib.h>

#include "attend.h"

/* kc, vc: float32 (kind 0), Q8_0 blocks, D / 32 * 34 bytes per KV head (kind 1), or float16
   (kind 2): inferflow.kernels.KV_FORMATS. Nonzero where a task found no memory for its scores. */
int paged_decode(const float *q, const void *kc, const void *vc, const int64_t *slots,
                 const int64_t *which, const int64_t *lens, int64_t B, int64_t S, int64_t H,
                 int64_t KVH, int64_t D, float scale, float *out, int nthreads, int kind) {
    const int64_t r = H / KVH, W = D / 32 * 34; /* (W: a Q8_0 KV head's bytes) */
    /* a task is one sequence and a run of its KV heads: all of them when there are sequences
       enough to keep the threads busy (fewer, larger tasks), one per task otherwise (a lone
       long sequence still spreads over the threads) */
    const int64_t per = B >= 4 * nthreads ? KVH : 1, runs = KVH / per; /* runs per sequence */
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t task = 0; task < B * runs; task++) {
        const int64_t b = task / runs, g0 = task % runs * per, n = lens[b];
        const int64_t *list = slots + (which ? which[b] : b) * S;
        float *p = malloc(sizeof(float) * (size_t)n); /* one head's scores */
        if (p == NULL) {
            failed = 1;
            continue;
        }
        for (int64_t h = g0 * r; h < (g0 + per) * r; h++) {
            if (kind == 1)
                attend_head_q8_any(q + (b * H + h) * D, kc, vc, list, n, KVH * W,
                                   h / r * W, D, scale, p, out + (b * H + h) * D);
            else
                attend_head_any(q + (b * H + h) * D, kc, vc, list, n, KVH * D,
                                h / r * D, D, scale, p, out + (b * H + h) * D, kind == 2);
        }
        free(p);
    }
    return failed;
}
