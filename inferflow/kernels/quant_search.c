/* The searching quantizer of Inferflow's min-max formats (inferflow.quant.minmax, "Search"),
   one block at a time in registers and L1 instead of some 250 torch passes over the whole
   tensor: per block, candidate grids across [min, max], a weighted least-squares fit of (scale,
   min) for each one's codes, three re-code-and-fit rounds on the best, then the best and the
   min-max grid compared exactly on their float16 values. The same algorithm and float32
   operations as minmax.py's torch path; only the order of the sums differs. */
#include <math.h>
#include <stdint.h>

#include "kvq8.h"

#define MAX_BLOCK 256
#define SEARCH_STEPS 20 /* candidate grids L - 1 ... L + 1 steps across [min, max], 0.1 apart */
#define REFITS 3
#define F16_MAX 65504.f

/* the float16 neighbour of h toward +inf (up) or -inf */
static inline uint16_t f16_step(uint16_t h, int up) {
    const int neg = (h & 0x8000) != 0;
    if ((h & 0x7FFF) == 0) return up ? 0x0001 : 0x8001;
    return (uint16_t)(up == !neg ? h + 1 : h - 1);
}

/* x rounded to float16 toward +inf (up) or -inf */
static inline uint16_t f16_directed(float x, int up) {
    const uint16_t h = float_to_half(x);
    const float back = half_to_float(h);
    return (up ? back < x : back > x) ? f16_step(h, up) : h;
}

/* the nearest code of x on the grid lo + q * sc (sc <= 0: code 0) */
static inline float code_of(float x, float lo, float sc, int top) {
    if (!(sc > 0.f)) return 0.f;
    const float c = rintf((x - lo) / sc);
    return c < 0.f ? 0.f : (c > (float)top ? (float)top : c);
}

typedef struct {
    float err, lo, sc;
} Fit;

/* least-squares (sc, lo) for codes q, kept in *best where its weighted error is lower; sw, sx,
   sxx: the block's sums of v, v x, v x^2 */
static inline void fit(const float *x, const float *v, const float *q, int64_t B, float sw,
                       float sx, float sxx, Fit *best) {
    float sq = 0.f, sqq = 0.f, sqx = 0.f;
    for (int64_t i = 0; i < B; i++) {
        const float vq = v[i] * q[i];
        sq += vq;
        sqq += vq * q[i];
        sqx += vq * x[i];
    }
    const float det = sw * sqq - sq * sq;
    if (!(det > 0.f)) return;
    float sc = (sw * sqx - sq * sx) / det;
    sc = sc < 0.f ? 0.f : sc;
    const float lo = (sqq * sx - sq * sqx) / det;
    const float err = sc * sc * sqq + 2.f * sc * lo * sq + lo * lo * sw - 2.f * sc * sqx
                      - 2.f * lo * sx + sxx;
    if (err < best->err) *best = (Fit){err, lo, sc};
}

/* the weighted squared error of the block on the float16 grid (lo16, sc16) */
static inline float exact_err(const float *x, const float *v, int64_t B, int top, uint16_t lo16,
                              uint16_t sc16) {
    const float lo = half_to_float(lo16), sc = half_to_float(sc16);
    float e = 0.f;
    for (int64_t i = 0; i < B; i++) {
        const float d = code_of(x[i], lo, sc, top) * sc + lo - x[i];
        e += v[i] * d * d;
    }
    return e;
}

static void search_block(const float *x, const float *imp, int64_t B, int top, uint16_t *head,
                         uint8_t *codes) {
    float v[MAX_BLOCK], t[MAX_BLOCK], q[MAX_BLOCK];
    float ss = 0.f, mn = x[0], mx = x[0];
    for (int64_t i = 0; i < B; i++) {
        ss += x[i] * x[i];
        mn = fminf(mn, x[i]);
        mx = fmaxf(mx, x[i]);
    }
    const float mean = ss / (float)B;
    float sw = 0.f, sx = 0.f, sxx = 0.f;
    for (int64_t i = 0; i < B; i++) {
        v[i] = imp ? imp[i] * sqrtf(2.f * mean + x[i] * x[i]) : sqrtf(mean) + fabsf(x[i]);
        sw += v[i];
        sx += v[i] * x[i];
        sxx += v[i] * x[i] * x[i];
    }
    const float rng = mx - mn, pos = rng > 0.f ? rng : 1.f;
    for (int64_t i = 0; i < B; i++) t[i] = (x[i] - mn) / pos;
    Fit best = {INFINITY, mn, 0.f};
    for (int k = 0; k <= SEARCH_STEPS; k++) {
        const float steps = (float)(top - 1) + (float)k / 10.f;
        for (int64_t i = 0; i < B; i++) {
            const float c = rintf(t[i] * steps);
            q[i] = c < 0.f ? 0.f : (c > (float)top ? (float)top : c);
        }
        fit(x, v, q, B, sw, sx, sxx, &best);
    }
    for (int r = 0; r < REFITS; r++) { /* re-code on the best grid and fit again */
        for (int64_t i = 0; i < B; i++) q[i] = code_of(x[i], best.lo, best.sc, top);
        fit(x, v, q, B, sw, sx, sxx, &best);
    }
    const float lo_c = fminf(fmaxf(best.lo, -F16_MAX), F16_MAX);
    uint16_t lo16 = float_to_half(lo_c), sc16 = float_to_half(fminf(best.sc, F16_MAX));
    /* the min-max grid (rounded outward), kept where it is no worse */
    const uint16_t mm_lo = f16_directed(mn, 0);
    const uint16_t mm_sc = f16_directed((mx - half_to_float(mm_lo)) / (float)top, 1);
    if (exact_err(x, v, B, top, mm_lo, mm_sc) <= exact_err(x, v, B, top, lo16, sc16)) {
        lo16 = mm_lo;
        sc16 = mm_sc;
    }
    head[0] = lo16;
    head[1] = sc16;
    const float lo = half_to_float(lo16), sc = half_to_float(sc16);
    for (int64_t i = 0; i < B; i++) codes[i] = (uint8_t)code_of(x[i], lo, sc, top);
}

/* x (n, B) float32 blocks (finite, within float16's range), imp (n, B) importance or NULL ->
   head (n, 2) float16 bits (min, scale) and codes (n, B) in [0, top]. Returns 1 if B is too
   large, else 0. */
int search_blocks_f32(const float *x, const float *imp, int64_t n, int64_t B, int top,
                      uint16_t *head, uint8_t *codes, int nthreads) {
    if (B > MAX_BLOCK || B < 1) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 256)
    for (int64_t b = 0; b < n; b++)
        search_block(x + b * B, imp ? imp + b * B : 0, B, top, head + 2 * b, codes + b * B);
    return 0;
}
