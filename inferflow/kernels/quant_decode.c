/* One-token decode over affine-quantized weights, float32 activations.

   A QMat holds a weight W (n, k) as w = code * scale + min per group of `group` weights
   (a multiple of 32): codes of 4 bits (16 bytes per 32 weights, byte j = c[j] | c[j + 16] << 4)
   or 8 bits (one byte each); scale and min (n, k / group) in float32.
   W x is then sum_g scale_g * (codes_g . x_g) + min_g * sum(x_g): exact float32 math on the
   codec's own values, no bf16 rounding of x, scales or mins.

   qmat_gemv: y = W x for M rows of x, rows of W split over the threads.
   decode_stack: every layer of a pre-norm decoder (RMS norm, fused q/k/v, rotary embedding,
   GQA attention over cache slots, SiLU-gated FFN) for one new token of one sequence, in one
   OpenMP region; the caller embeds the token and runs the final norm and the head.
   Threads come from the OpenMP runtime torch already loaded (the same libgomp.so.1). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *codes;
    const float *scale, *min; /* (n, k / group) */
    int64_t n, k, group;
    int32_t bits; /* 4 or 8 */
} QMat;

typedef struct {
    const float *attn_norm, *ffn_norm; /* (hidden,) */
    QMat qkv, o, gate_up, down;        /* gate_up: [gate; up] rows */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inner, rotary_dim;
    int32_t adjacent; /* rotary pairs (2i, 2i + 1); else (i, i + rotary_dim / 2) */
    float eps, norm_offset, scale;
} Dims;

/* codes of one row, group by group: sum_g scale_g * (codes_g . x_g) + min_g * xs[g] */
static float row_dot(const QMat *w, int64_t r, const float *x, const float *xs) {
    const int64_t G = w->k / w->group, chunks = w->group / 32, bytes = w->bits == 4 ? 16 : 32;
    const uint8_t *c = w->codes + r * (w->k / 32) * bytes;
    const float *sc = w->scale + r * G, *mn = w->min + r * G;
#if defined(__AVX512F__)
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 t = _mm512_setzero_ps();
        for (int64_t j = 0; j < chunks; j++, c += bytes) {
            const float *xc = x + (g * chunks + j) * 32;
            __m512 fa, fb;
            if (w->bits == 4) { /* vpermps reads the low 4 bits of each index: one nibble */
                const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
                fa = _mm512_permutexvar_ps(idx, iota);
                fb = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), iota);
            } else {
                fa = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)));
                fb = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
            }
            t = _mm512_fmadd_ps(fa, _mm512_loadu_ps(xc), t);
            t = _mm512_fmadd_ps(fb, _mm512_loadu_ps(xc + 16), t);
        }
        acc = _mm512_fmadd_ps(t, _mm512_set1_ps(sc[g]), acc);
    }
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 m = G - g >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        mins = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mn + g), _mm512_maskz_loadu_ps(m, xs + g), mins);
    }
    return _mm512_reduce_add_ps(acc) + _mm512_reduce_add_ps(mins);
#else
    float total = 0.f;
    for (int64_t g = 0; g < G; g++) {
        float t = 0.f;
        for (int64_t j = 0; j < chunks; j++, c += bytes) {
            const float *xc = x + (g * chunks + j) * 32;
            for (int i = 0; i < 16; i++) {
                const int lo = w->bits == 4 ? c[i] & 0x0F : c[i];
                const int hi = w->bits == 4 ? c[i] >> 4 : c[16 + i];
                t += (float)lo * xc[i] + (float)hi * xc[16 + i];
            }
        }
        total += sc[g] * t + mn[g] * xs[g];
    }
    return total;
#endif
}

static void group_sums(const QMat *w, const float *x, float *xs) {
    for (int64_t g = 0; g < w->k / w->group; g++) {
        float s = 0.f;
        for (int64_t i = 0; i < w->group; i++) s += x[g * w->group + i];
        xs[g] = s;
    }
}

/* inside a parallel region: y[r] = (add ? y[r] : 0) + W x; xs: scratch of k / group floats */
static void gemv_in_team(const QMat *w, const float *x, float *xs, float *y, int add) {
#pragma omp single
    group_sums(w, x, xs);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < w->n; r++) y[r] = (add ? y[r] : 0.f) + row_dot(w, r, x, xs);
}

void qmat_gemv(const QMat *w, const float *x, int64_t M, float *xs, float *y, int nthreads) {
    for (int64_t m = 0; m < M; m++) {
#pragma omp parallel num_threads(nthreads)
        gemv_in_team(w, x + m * w->k, xs, y + m * w->n, 0);
    }
}

static void rms_norm(const float *x, const float *wt, const Dims *d, float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < d->hidden; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss / (float)d->hidden + d->eps);
    for (int64_t i = 0; i < d->hidden; i++) out[i] = x[i] * inv * (d->norm_offset + wt[i]);
}

static void rotate(float *v, const float *cos, const float *sin, const Dims *d) {
    const int64_t half = d->rotary_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t a = d->adjacent ? 2 * i : i, b = d->adjacent ? 2 * i + 1 : i + half;
        const float x1 = v[a], x2 = v[b];
        v[a] = x1 * cos[i] - x2 * sin[i];
        v[b] = x2 * cos[i] + x1 * sin[i];
    }
}

/* query head h over the n keys listed in slots (the last one is this token's) */
static void attend_head(const float *q, const float *kc, const float *vc, const int64_t *slots,
                        int64_t n, int64_t h, const Dims *d, float *p, float *out) {
    const int64_t D = d->head_dim, KVH = d->kv_heads, g = h / (d->heads / KVH);
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) {
        const float *k = kc + (slots[t] * KVH + g) * D;
        if (t + 8 < n) { /* keys are scattered (paged blocks): fetch ahead of use */
            const char *ahead = (const char *)(kc + (slots[t + 8] * KVH + g) * D);
            for (int64_t b = 0; b < D * 4; b += 64) __builtin_prefetch(ahead + b);
        }
        float s = 0.f;
        for (int64_t i = 0; i < D; i++) s += q[i] * k[i];
        p[t] = s * d->scale;
        if (p[t] > mx) mx = p[t];
    }
    for (int64_t t = 0; t < n; t++) {
        p[t] = expf(p[t] - mx);
        sum += p[t];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < D; i++) out[i] = 0.f;
    for (int64_t t = 0; t < n; t++) {
        const float *v = vc + (slots[t] * KVH + g) * D, w = p[t] * inv;
        if (t + 8 < n) {
            const char *ahead = (const char *)(vc + (slots[t + 8] * KVH + g) * D);
            for (int64_t b = 0; b < D * 4; b += 64) __builtin_prefetch(ahead + b);
        }
        for (int64_t i = 0; i < D; i++) out[i] += w * v[i];
    }
}

/* x (hidden) in place through every layer. kc / vc: layer 0 of the cache, layer l at
   l * layer_stride floats, slot s of KV head g at (s * KV heads + g) * head_dim; this token's
   K / V go to slots[n - 1]. scratch: at least hidden + (heads + 2 kv_heads) head_dim + heads
   head_dim + 3 inner + heads * n + max(hidden, inner, heads * head_dim) / 32 floats (the
   group sums of the widest product's input). */
void decode_stack(const Layer *layers, int64_t L, const Dims *d, float *x, const float *cos,
                  const float *sin, float *kc, float *vc, int64_t layer_stride,
                  const int64_t *slots, int64_t n, float *scratch, int nthreads) {
    const int64_t H = d->heads, KVH = d->kv_heads, D = d->head_dim, F = d->inner;
    float *h = scratch, *qkv = h + d->hidden, *att = qkv + (H + 2 * KVH) * D;
    float *gu = att + H * D, *act = gu + 2 * F, *p = act + F, *xs = p + H * n;
    const int64_t w = slots[n - 1];
#pragma omp parallel num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        const Layer *ly = layers + l;
        float *k = kc + l * layer_stride, *v = vc + l * layer_stride;
#pragma omp single
        rms_norm(x, ly->attn_norm, d, h);
        gemv_in_team(&ly->qkv, h, xs, qkv, 0);
#pragma omp single
        {
            for (int64_t j = 0; j < H + KVH; j++) rotate(qkv + j * D, cos, sin, d);
            memcpy(k + w * KVH * D, qkv + H * D, sizeof(float) * KVH * D);
            memcpy(v + w * KVH * D, qkv + (H + KVH) * D, sizeof(float) * KVH * D);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < H; j++) attend_head(qkv + j * D, k, v, slots, n, j, d, p + j * n, att + j * D);
        gemv_in_team(&ly->o, att, xs, x, 1);
#pragma omp single
        rms_norm(x, ly->ffn_norm, d, h);
        gemv_in_team(&ly->gate_up, h, xs, gu, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < F; i++) act[i] = gu[i] / (1.f + expf(-gu[i])) * gu[F + i];
        gemv_in_team(&ly->down, act, xs, x, 1);
    }
}
