/* Paged attention of one decode step (one new query per sequence), float32.

   For sequence b and KV head g, the r = H / KVH query heads of g attend over the keys in the
   first lens[b] cache slots listed in slots[b * S ...]; every listed key is visible (a plain
   causal decode step: no window, bias or soft-cap). kc and vc are one layer of the paged cache
   viewed as (slots, KVH, D); q and out are (B, H, D); all row-major and contiguous.

   Reads the keys and values straight from their blocks: no gathered or padded copy (with
   AVX-512, one query head at a time: the query heads of one KV head read its keys again, from
   the CPU's caches). The (b, g) tasks are independent, so a sequence's result never depends on the rest of the batch.
   OpenMP threads come from the runtime torch already loaded (the same libgomp.so.1). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>

/* exp of 16 floats <= 0 (Cephes' expf polynomial on x - n ln 2, then times 2^n): within 2 ulp
   of expf; below -87.3 it returns about 1e-38 instead of a denormal or 0 */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* p[0..n) = exp(p - mx), returns their sum */
static float exp_sum(float *p, int64_t n, float mx) {
    float sum = 0.f;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + t), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(p + t, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; t < n; t++) {
        p[t] = expf(p[t] - mx);
        sum += p[t];
    }
    return sum;
}

#if defined(__AVX512F__)
/* One query head q over the n keys listed in sl (row t's key at kc + sl[t] * stride + off, its
   value likewise in vc), D a multiple of 16, at most 256: the query and the output stay in
   registers, each score is one vector dot product. p holds the n scores, out gets the head's
   D outputs. Inlined with D a constant, so that the loops over D unroll. */
static inline __attribute__((always_inline)) void head16(const float *q, const float *kc,
                                                         const float *vc, const int64_t *sl,
                                                         int64_t n, int64_t stride, int64_t off,
                                                         const int64_t D, float scale, float *p,
                                                         float *out) {
    const int64_t nv = D / 16;
    __m512 qv[16], acc[16];
    for (int64_t i = 0; i < nv; i++) qv[i] = _mm512_loadu_ps(q + 16 * i);
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const float *k = kc + sl[t] * stride + off;
        if (t + 8 < n) { /* keys are scattered over blocks: fetch ahead of use */
            const char *ahead = (const char *)(kc + sl[t + 8] * stride + off);
            for (int64_t c = 0; c < D * 4; c += 64) __builtin_prefetch(ahead + c);
        }
        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int64_t i = 1; i < nv; i++) s = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), s);
        const float x = _mm512_reduce_add_ps(s) * scale;
        p[t] = x;
        if (x > mx) mx = x;
    }
    const float inv = 1.f / exp_sum(p, n, mx);
    for (int64_t i = 0; i < nv; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) { /* weighted sum of the values */
        const float *v = vc + sl[t] * stride + off;
        if (t + 8 < n) {
            const char *ahead = (const char *)(vc + sl[t + 8] * stride + off);
            for (int64_t c = 0; c < D * 4; c += 64) __builtin_prefetch(ahead + c);
        }
        const __m512 w = _mm512_set1_ps(p[t] * inv);
        for (int64_t i = 0; i < nv; i++)
            acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * i), acc[i]);
    }
    for (int64_t i = 0; i < nv; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

/* head16 with D a constant for the common head sizes (any other multiple of 16 up to 256 runs
   the same code with D a variable) */
static void head_vec(const float *q, const float *kc, const float *vc, const int64_t *sl,
                     int64_t n, int64_t stride, int64_t off, int64_t D, float scale, float *p,
                     float *out) {
    switch (D) {
    case 32: head16(q, kc, vc, sl, n, stride, off, 32, scale, p, out); break;
    case 64: head16(q, kc, vc, sl, n, stride, off, 64, scale, p, out); break;
    case 128: head16(q, kc, vc, sl, n, stride, off, 128, scale, p, out); break;
    default: head16(q, kc, vc, sl, n, stride, off, D, scale, p, out);
    }
}
#endif

int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *slots,
                     const int64_t *lens, int64_t B, int64_t S, int64_t H, int64_t KVH,
                     int64_t D, float scale, float *out, int nthreads) {
    const int64_t r = H / KVH;
    /* a task is one sequence and a run of its KV heads: all of them when there are sequences
       enough to keep the threads busy (each slot's keys are then read as one contiguous row),
       one per task otherwise (a lone long sequence still spreads over the threads) */
    const int64_t per = B >= 4 * nthreads ? KVH : 1, runs = KVH / per; /* runs per sequence */
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t task = 0; task < B * runs; task++) {
        const int64_t b = task / runs, g0 = task % runs * per, n = lens[b];
        const int64_t h0 = g0 * r, nh = per * r; /* query heads h0 .. h0 + nh */
        const int64_t *sl = slots + b * S;
        const int64_t span = per * D * 4;        /* bytes of one slot's keys read here */
        float *p = malloc(sizeof(float) * (size_t)(nh * n + nh));
        if (p == NULL) {
            failed = 1;
            continue;
        }
#if defined(__AVX512F__)
        if (D % 16 == 0 && D <= 256) {
            for (int64_t j = 0; j < nh; j++)
                head_vec(q + (b * H + h0 + j) * D, kc, vc, sl, n, KVH * D, (g0 + j / r) * D, D,
                         scale, p, out + (b * H + h0 + j) * D);
            free(p);
            continue;
        }
#endif
        float *mx = p + nh * n;
        for (int64_t j = 0; j < nh; j++) mx[j] = -INFINITY;
        for (int64_t t = 0; t < n; t++) { /* scores q . k, and each head's largest */
            const float *krow = kc + (sl[t] * KVH + g0) * D;
            if (t + 8 < n) { /* keys are scattered over blocks: fetch ahead of use */
                const char *ahead = (const char *)(kc + (sl[t + 8] * KVH + g0) * D);
                for (int64_t c = 0; c < span; c += 64) __builtin_prefetch(ahead + c);
            }
            for (int64_t j = 0; j < nh; j++) {
                const float *qj = q + (b * H + h0 + j) * D, *k = krow + j / r * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qj[d] * k[d];
                s *= scale;
                p[j * n + t] = s;
                if (s > mx[j]) mx[j] = s;
            }
        }
        for (int64_t j = 0; j < nh; j++) { /* softmax */
            const float sum = exp_sum(p + j * n, n, mx[j]);
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) p[j * n + t] *= inv;
            float *o = out + (b * H + h0 + j) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        }
        for (int64_t t = 0; t < n; t++) { /* weighted sum of the values */
            const float *vrow = vc + (sl[t] * KVH + g0) * D;
            if (t + 8 < n) {
                const char *ahead = (const char *)(vc + (sl[t + 8] * KVH + g0) * D);
                for (int64_t c = 0; c < span; c += 64) __builtin_prefetch(ahead + c);
            }
            for (int64_t j = 0; j < nh; j++) {
                const float w = p[j * n + t], *v = vrow + j / r * D;
                float *o = out + (b * H + h0 + j) * D;
                for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
            }
        }
        free(p);
    }
    return failed;
}
