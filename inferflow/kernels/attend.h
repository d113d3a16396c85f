/* One query head's attention over keys and values listed by slot (float32 or float16:
   attend_head, GGML Q8_0 blocks: attend_head_q8; a few rows of one prompt at once with
   attend_head's bits: attend_rows_any), shared by
   paged_attention.c (a decode step of many sequences) and quant_decode.c (one token through a
   whole decoder): scores, softmax (max subtracted) and the weighted sum of the values. */
#ifndef INFERFLOW_ATTEND_H
#define INFERFLOW_ATTEND_H
#include "expf.h"
#include "kvq8.h"
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>

/* lane t = the sum of v[t]'s 16 lanes, for 16 vectors at once: the tree of
   _mm512_reduce_add_ps (lanes i + i + 8, then i + i + 4, i + i + 2, i + i + 1), so each sum
   has the same bits as that reduction gives, in ~3 operations a vector instead of ~8 */
static inline __m512 sum16x16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes: v[2i]'s (i, i + 8) sums, then v[2i + 1]'s */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* lane j: v[4i + j]'s 4 sums (+ i + 4) */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) { /* lane j: v[8i + j]'s 2 sums (+ i + 2), then v[8i + 4 + j]'s */
        const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* (+ i + 1): element 4j + m is v[4m + j]'s sum */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}
#endif

/* p[0..n) = exp(p - mx) (expf.h: the same bits in every build), returns their sum */
EXPF_EXACT static inline float exp_sum(float *p, int64_t n, float mx) {
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
        p[t] = expf_one(p[t] - mx);
        sum += p[t];
    }
    return sum;
}

/* element i of a float32 cache, or of a float16 one (half) */
static inline __attribute__((always_inline)) const void *kv_at(const void *c, int64_t i,
                                                               const int half) {
    return half ? (const void *)((const uint16_t *)c + i) : (const void *)((const float *)c + i);
}

static inline __attribute__((always_inline)) float kv1(const void *e, int64_t i, const int half) {
    return half ? half_to_float(((const uint16_t *)e)[i]) : ((const float *)e)[i];
}

#if defined(__AVX512F__)
/* 16 values of a key or value from i (float16 ones exactly as float32) */
static inline __attribute__((always_inline)) __m512 kv16(const void *e, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)e + i)))
                : _mm512_loadu_ps((const float *)e + i);
}
#endif

/* fetch the key (or value) 8 places ahead of t in sl: keys are scattered over blocks */
static inline __attribute__((always_inline)) void fetch_ahead(const void *c, const int64_t *sl,
                                                              int64_t t, int64_t n, int64_t stride,
                                                              int64_t off, int64_t D,
                                                              const int half) {
    if (t + 8 < n) {
        const char *ahead = (const char *)kv_at(c, sl[t + 8] * stride + off, half);
        for (int64_t b = 0; b < D * (half ? 2 : 4); b += 64) __builtin_prefetch(ahead + b);
    }
}

/* One query head q (D floats) over the n keys listed in sl: key t at element sl[t] * stride +
   off of kc (stride: elements between slots; off: the KV head's first), its value likewise in
   vc; elements are float32, or float16 where half (each read exactly as a float32: the same
   operations after it). p holds the n scores, out gets the head's D outputs. With AVX-512 and
   D a multiple of 16 (at most 256) the query and the output stay in registers and each score
   is one vector dot product (inlined with D a constant where the caller's is, so that the
   loops over D unroll); otherwise plain loops. */
static inline __attribute__((always_inline)) void attend_head(const float *q, const void *kc,
                                                              const void *vc, const int64_t *sl,
                                                              int64_t n, int64_t stride,
                                                              int64_t off, const int64_t D,
                                                              float scale, float *p, float *out,
                                                              const int half) {
    float mx = -INFINITY;
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 256) {
        const int64_t nv = D / 16;
        __m512 qv[16], acc[16];
        for (int64_t i = 0; i < nv; i++) qv[i] = _mm512_loadu_ps(q + 16 * i);
        int64_t t = 0;
        if (nv <= 8) { /* 16 keys' dot products, then their 16 sums at once */
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (; t + 16 <= n; t += 16) {
                __m512 s[16];
                for (int u = 0; u < 16; u++) {
                    const void *k = kv_at(kc, sl[t + u] * stride + off, half);
                    fetch_ahead(kc, sl, t + u, n, stride, off, D, half);
                    s[u] = _mm512_mul_ps(qv[0], kv16(k, 0, half));
                    for (int64_t i = 1; i < nv; i++)
                        s[u] = _mm512_fmadd_ps(qv[i], kv16(k, 16 * i, half), s[u]);
                }
                const __m512 x = _mm512_mul_ps(sum16x16(s), _mm512_set1_ps(scale));
                _mm512_storeu_ps(p + t, x);
                top = _mm512_max_ps(top, x);
            }
            mx = _mm512_reduce_max_ps(top);
        }
        for (; t < n; t++) {
            const void *k = kv_at(kc, sl[t] * stride + off, half);
            fetch_ahead(kc, sl, t, n, stride, off, D, half);
            __m512 s = _mm512_mul_ps(qv[0], kv16(k, 0, half));
            for (int64_t i = 1; i < nv; i++) s = _mm512_fmadd_ps(qv[i], kv16(k, 16 * i, half), s);
            const float x = _mm512_reduce_add_ps(s) * scale;
            p[t] = x;
            if (x > mx) mx = x;
        }
        const float inv = 1.f / exp_sum(p, n, mx);
        for (int64_t i = 0; i < nv; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const void *v = kv_at(vc, sl[t] * stride + off, half);
            fetch_ahead(vc, sl, t, n, stride, off, D, half);
            const __m512 w = _mm512_set1_ps(p[t] * inv);
            for (int64_t i = 0; i < nv; i++)
                acc[i] = _mm512_fmadd_ps(w, kv16(v, 16 * i, half), acc[i]);
        }
        for (int64_t i = 0; i < nv; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const void *k = kv_at(kc, sl[t] * stride + off, half);
        fetch_ahead(kc, sl, t, n, stride, off, D, half);
        float s = 0.f;
        for (int64_t i = 0; i < D; i++) s += q[i] * kv1(k, i, half);
        p[t] = s * scale;
        if (p[t] > mx) mx = p[t];
    }
    const float inv = 1.f / exp_sum(p, n, mx);
    for (int64_t i = 0; i < D; i++) out[i] = 0.f;
    for (int64_t t = 0; t < n; t++) {
        const void *v = kv_at(vc, sl[t] * stride + off, half);
        const float w = p[t] * inv;
        fetch_ahead(vc, sl, t, n, stride, off, D, half);
        for (int64_t i = 0; i < D; i++) out[i] += w * kv1(v, i, half);
    }
}

/* fetch the key (or value) 8 places ahead of t, `bytes` long (a Q8_0 cache) */
static inline __attribute__((always_inline)) void fetch_ahead_q8(const uint8_t *c, const int64_t *sl,
                                                                 int64_t t, int64_t n, int64_t stride,
                                                                 int64_t off, int64_t bytes) {
    if (t + 8 < n) {
        const uint8_t *ahead = c + sl[t + 8] * stride + off;
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
    }
}

#if defined(__AVX512F__)
/* a Q8_0 key's products with the query (qv: its 2 nb vectors), summed per lane */
static inline __attribute__((always_inline)) __m512 key_dot_q8(const __m512 *qv, const uint8_t *k,
                                                               int64_t nb) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = k + 34 * b;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        const __m512 a = _mm512_fmadd_ps(qv[2 * b + 1], hi, _mm512_mul_ps(qv[2 * b], lo));
        s = _mm512_fmadd_ps(a, _mm512_set1_ps(q8_scale(blk)), s);
    }
    return s;
}
#endif

/* attend_head over a Q8_0 cache (KVFormat "q8"): a key is D / 32 blocks of 34 bytes at
   kc + sl[t] * stride + off (stride, off in bytes); each block's dot product with the query
   is scaled once. D a multiple of 32. */
static inline __attribute__((always_inline)) void attend_head_q8(const float *q, const uint8_t *kc,
                                                                 const uint8_t *vc, const int64_t *sl,
                                                                 int64_t n, int64_t stride,
                                                                 int64_t off, const int64_t D,
                                                                 float scale, float *p, float *out) {
    const int64_t nb = D / 32, bytes = nb * 34;
    float mx = -INFINITY;
#if defined(__AVX512F__)
    if (D <= 256) {
        __m512 qv[16], acc[16];
        for (int64_t i = 0; i < 2 * nb; i++) qv[i] = _mm512_loadu_ps(q + 16 * i);
        int64_t t = 0;
        if (nb <= 4) { /* 16 keys' dot products, then their 16 sums at once (attend_head) */
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (; t + 16 <= n; t += 16) {
                __m512 s[16];
                for (int u = 0; u < 16; u++) {
                    fetch_ahead_q8(kc, sl, t + u, n, stride, off, bytes);
                    s[u] = key_dot_q8(qv, kc + sl[t + u] * stride + off, nb);
                }
                const __m512 x = _mm512_mul_ps(sum16x16(s), _mm512_set1_ps(scale));
                _mm512_storeu_ps(p + t, x);
                top = _mm512_max_ps(top, x);
            }
            mx = _mm512_reduce_max_ps(top);
        }
        for (; t < n; t++) {
            fetch_ahead_q8(kc, sl, t, n, stride, off, bytes);
            const __m512 s = key_dot_q8(qv, kc + sl[t] * stride + off, nb);
            const float x = _mm512_reduce_add_ps(s) * scale;
            p[t] = x;
            if (x > mx) mx = x;
        }
        const float inv = 1.f / exp_sum(p, n, mx);
        for (int64_t i = 0; i < 2 * nb; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *v = vc + sl[t] * stride + off;
            fetch_ahead_q8(vc, sl, t, n, stride, off, bytes);
            const float w = p[t] * inv;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = v + 34 * b;
                const __m512 wd = _mm512_set1_ps(w * q8_scale(blk));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
                acc[2 * b] = _mm512_fmadd_ps(wd, lo, acc[2 * b]);
                acc[2 * b + 1] = _mm512_fmadd_ps(wd, hi, acc[2 * b + 1]);
            }
        }
        for (int64_t i = 0; i < 2 * nb; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *k = kc + sl[t] * stride + off;
        fetch_ahead_q8(kc, sl, t, n, stride, off, bytes);
        float s = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = k + 34 * b;
            const int8_t *c = (const int8_t *)(blk + 2);
            float a = 0.f;
            for (int64_t i = 0; i < 32; i++) a += q[32 * b + i] * (float)c[i];
            s += a * q8_scale(blk);
        }
        p[t] = s * scale;
        if (p[t] > mx) mx = p[t];
    }
    const float inv = 1.f / exp_sum(p, n, mx);
    for (int64_t i = 0; i < D; i++) out[i] = 0.f;
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *v = vc + sl[t] * stride + off;
        fetch_ahead_q8(vc, sl, t, n, stride, off, bytes);
        const float w = p[t] * inv;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = v + 34 * b;
            const int8_t *c = (const int8_t *)(blk + 2);
            const float wd = w * q8_scale(blk);
            for (int64_t i = 0; i < 32; i++) out[32 * b + i] += wd * (float)c[i];
        }
    }
}

static inline void attend_head_q8_any(const float *q, const uint8_t *kc, const uint8_t *vc,
                                      const int64_t *sl, int64_t n, int64_t stride, int64_t off,
                                      int64_t D, float scale, float *p, float *out) {
    switch (D) {
    case 64: attend_head_q8(q, kc, vc, sl, n, stride, off, 64, scale, p, out); break;
    case 128: attend_head_q8(q, kc, vc, sl, n, stride, off, 128, scale, p, out); break;
    case 256: attend_head_q8(q, kc, vc, sl, n, stride, off, 256, scale, p, out); break;
    default: attend_head_q8(q, kc, vc, sl, n, stride, off, D, scale, p, out);
    }
}

/* attend_head with D a constant for the common head sizes, per element type */
#define ATTEND_BY_D(half)                                                                           \
    switch (D) {                                                                                    \
    case 32: attend_head(q, kc, vc, sl, n, stride, off, 32, scale, p, out, half); break;           \
    case 64: attend_head(q, kc, vc, sl, n, stride, off, 64, scale, p, out, half); break;           \
    case 128: attend_head(q, kc, vc, sl, n, stride, off, 128, scale, p, out, half); break;         \
    default: attend_head(q, kc, vc, sl, n, stride, off, D, scale, p, out, half);                   \
    }

static inline void attend_head_any(const float *q, const void *kc, const void *vc,
                                   const int64_t *sl, int64_t n, int64_t stride, int64_t off,
                                   int64_t D, float scale, float *p, float *out, int half) {
    if (half) {
        ATTEND_BY_D(1)
    } else {
        ATTEND_BY_D(0)
    }
}

/* rows of a prompt whose attention reads the keys at once (per thread, the scores' scratch is
   ATTEND_ROWS times a row's S) */
#define ATTEND_ROWS 4

#if defined(__AVX512F__)
/* attend_head for R rows of one sequence and one query head (R <= ATTEND_ROWS, R nv <= 16:
   their outputs' accumulators stay in the registers), D = 16 nv with nv <= 8: row r's query
   at q + r qs, its keys the first n[r] of sl, its scores at p + r ps, its output at out + r
   os. Each row gets attend_head's operations in its order (the same bits), but a block of 16
   keys is read (and its addresses found) once for all the rows that have it, and each value
   once for all R rows. */
static inline __attribute__((always_inline)) void attend_rows16(const float *q, int64_t qs,
                                                                const void *kc, const void *vc,
                                                                const int64_t *sl, const int64_t *n,
                                                                const int R, int64_t stride,
                                                                int64_t off, const int64_t nv,
                                                                float scale, float *p, int64_t ps,
                                                                float *out, int64_t os,
                                                                const int half) {
    const int64_t D = 16 * nv;
    int64_t nmax = 0, nmin = n[0];
    for (int r = 0; r < R; r++) {
        nmax = n[r] > nmax ? n[r] : nmax;
        nmin = n[r] < nmin ? n[r] : nmin;
    }
    __m512 top[ATTEND_ROWS];
    float mx[ATTEND_ROWS];
    for (int r = 0; r < R; r++) top[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t + 16 <= nmax; t += 16) {
        const void *kp[16];
        for (int u = 0; u < 16; u++) kp[u] = kv_at(kc, sl[t + u] * stride + off, half);
        if (t + 32 <= nmax) /* the next block, while this one computes */
            for (int u = 0; u < 16; u++) {
                const char *a = (const char *)kv_at(kc, sl[t + 16 + u] * stride + off, half);
                for (int64_t b = 0; b < D * (half ? 2 : 4); b += 64) __builtin_prefetch(a + b);
            }
#pragma GCC unroll 4
        for (int r = 0; r < ATTEND_ROWS; r++) {
            if (r >= R || t + 16 > n[r]) continue;
            __m512 qv[8], s[16];
            for (int64_t i = 0; i < nv; i++) qv[i] = _mm512_loadu_ps(q + r * qs + 16 * i);
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) {
                s[u] = _mm512_mul_ps(qv[0], kv16(kp[u], 0, half));
                for (int64_t i = 1; i < nv; i++)
                    s[u] = _mm512_fmadd_ps(qv[i], kv16(kp[u], 16 * i, half), s[u]);
            }
            const __m512 x = _mm512_mul_ps(sum16x16(s), _mm512_set1_ps(scale));
            _mm512_storeu_ps(p + r * ps + t, x);
            top[r] = _mm512_max_ps(top[r], x);
        }
    }
    for (int r = 0; r < R; r++) { /* each row's last n % 16 keys, one at a time */
        mx[r] = _mm512_reduce_max_ps(top[r]);
        for (int64_t t = n[r] / 16 * 16; t < n[r]; t++) {
            const void *k = kv_at(kc, sl[t] * stride + off, half);
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q + r * qs), kv16(k, 0, half));
            for (int64_t i = 1; i < nv; i++)
                s = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * qs + 16 * i), kv16(k, 16 * i, half), s);
            const float x = _mm512_reduce_add_ps(s) * scale;
            p[r * ps + t] = x;
            if (x > mx[r]) mx[r] = x;
        }
        /* the weights p[t] / sum, each rounded as attend_head's p[t] * inv */
        float *pr = p + r * ps;
        const __m512 inv = _mm512_set1_ps(1.f / exp_sum(pr, n[r], mx[r]));
        for (int64_t t = 0; t < n[r]; t += 16) {
            const __mmask16 m = n[r] - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n[r] - t)) - 1);
            _mm512_mask_storeu_ps(pr + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pr + t), inv));
        }
    }
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nmax; t++) {
        const void *v = kv_at(vc, sl[t] * stride + off, half);
        fetch_ahead(vc, sl, t, nmax, stride, off, D, half);
        __m512 vv[8];
        for (int64_t i = 0; i < nv; i++) vv[i] = kv16(v, 16 * i, half);
        const int all = t < nmin;
#pragma GCC unroll 4
        for (int r = 0; r < ATTEND_ROWS && (r + 1) * nv <= 16; r++) {
            if (r >= R || (!all && t >= n[r])) continue;
            const __m512 w = _mm512_set1_ps(p[r * ps + t]);
            for (int64_t i = 0; i < nv; i++)
                acc[r * nv + i] = _mm512_fmadd_ps(w, vv[i], acc[r * nv + i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < nv; i++) _mm512_storeu_ps(out + r * os + 16 * i, acc[r * nv + i]);
}
#endif

/* attend_rows16 for two rows or more where D allows (a multiple of 16 up to 128: the rows
   16 / (D / 16) at a time), with D a constant for the common head sizes; else attend_head row
   by row (a decode row) */
static inline void attend_rows_any(const float *q, int64_t qs, const void *kc, const void *vc,
                                   const int64_t *sl, const int64_t *n, int R, int64_t stride,
                                   int64_t off, int64_t D, float scale, float *p, int64_t ps,
                                   float *out, int64_t os, int half) {
#if defined(__AVX512F__)
    if (R > 1 && D % 16 == 0 && D <= 128) {
        const int per = (int)(16 / (D / 16)) < ATTEND_ROWS ? (int)(16 / (D / 16)) : ATTEND_ROWS;
        for (int r = 0; r < R; r += per) {
            const int m = R - r < per ? R - r : per;
#define ROWS16(nv, h)                                                                               \
    attend_rows16(q + r * qs, qs, kc, vc, sl, n + r, m, stride, off, nv, scale, p + r * ps, ps,    \
                  out + r * os, os, h)
            if (D == 64 && half)
                ROWS16(4, 1);
            else if (D == 64)
                ROWS16(4, 0);
            else if (D == 128 && half)
                ROWS16(8, 1);
            else if (D == 128)
                ROWS16(8, 0);
            else
                ROWS16(D / 16, half);
#undef ROWS16
        }
        return;
    }
#endif
    for (int r = 0; r < R; r++)
        attend_head_any(q + r * qs, kc, vc, sl, n[r], stride, off, D, scale, p + r * ps, out + r * os, half);
}

#endif
