/* GGML Q8_0 blocks of a KV cache (inferflow.engine.kv_cache.KVFormat "q8"): 32 values as a
   float16 scale d = max |x| / 127 and 32 int8 codes round(x / d) (half away from zero), 34
   bytes; the bytes gguf-py's Q8_0.quantize_blocks gives. Read by attend.h, written by
   quant_decode.c's decode_stack. */
#ifndef INFERFLOW_KVQ8_H
#define INFERFLOW_KVQ8_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* IEEE float16 bits -> float */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        const float f = (float)m * (1.f / 16777216.f);
        return sign ? -f : f;
    }
    const uint32_t bits = e == 31 ? sign | 0x7F800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float -> IEEE float16 bits, rounded to nearest even (as numpy's astype(float16)) */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00; /* NaN */
    if (a >= 0x47800000u) return sign | 0x7C00; /* >= 2^16: infinity */
    if (a < 0x38800000u) { /* below 2^-14: a subnormal half, units of 2^-24 */
        const uint32_t e = a >> 23;
        if (e < 102) return sign; /* below 2^-25 */
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return sign | (uint16_t)q;
    }
    /* normal: exponent 127 -> 15 bias, 23 -> 10 mantissa bits; a carry may reach infinity */
    uint32_t h = (a - 0x38000000u) >> 13;
    const uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return sign | (uint16_t)h;
#endif
}

/* the float16 scale of a Q8_0 block */
static inline float q8_scale(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return half_to_float(h);
}

/* n floats (a multiple of 32) -> n / 32 Q8_0 blocks */
static inline void q8_0_row(const float *x, int64_t n, uint8_t *out) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        uint8_t *o = out + 34 * b;
        float amax = 0.f;
        for (int64_t i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const uint16_t h = float_to_half(d);
        memcpy(o, &h, sizeof h);
        for (int64_t i = 0; i < 32; i++) ((int8_t *)o)[2 + i] = (int8_t)roundf(xb[i] * id);
    }
}
#endif
