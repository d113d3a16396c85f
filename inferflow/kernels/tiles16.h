/* AVX-512 builds' tile products (float32 and, with VNNI, 8-bit rows of x). Part of
   quant_decode.c (after qmat.h and qmat_q8.h). */
#ifndef INFERFLOW_TILES16_H
#define INFERFLOW_TILES16_H

#include "qmat.h"
#include "qmat_q8.h"

#if defined(__AVX512F__)
/* AVX-512 builds: 4-bit tiles with all 16 rows of a tile in one vector, 8-bit rows in groups
   of a multiple of 32 sixteen columns at a time; the same rule (a row's operations do not
   depend on the other rows) */
#define MR16 4 /* rows of x per unpacked tile: 4 accumulators each */
#define MRQ 8  /* rows of 8-bit x per unpacked tile (groups of 32k: 3 accumulators each) */

/* 16 float16 values at a + i (HALF_BUILT builds; plain16's planes) */
static inline __attribute__((always_inline)) __m512 half16(const float *a, int64_t i) {
#if HALF_BUILT
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a + i)));
#else
    return _mm512_loadu_ps(a + i); /* (never reached: w->half and plain16 need HALF_BUILT) */
#endif
}

static inline __attribute__((always_inline)) __m512 ld16(const QMat *w, const float *a,
                                                       int64_t i) {
    return HALF_BUILT && w->half ? half16(a, i) : _mm512_loadu_ps(a + i);
}

/* a two-level plane's 16 values of the group at i: its super-block's float16 values d (at
   SB16(i, log2 sb)) times the group's int8 ones a8[i ..] (exact) */
static inline __attribute__((always_inline)) __m512 times8(__m512 d, const int8_t *a8,
                                                         int64_t i) {
    const __m128i s = _mm_loadu_si128((const __m128i *)(a8 + i));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)));
}

/* index of the super-block value of the group at i = 16 (t * G + g) */
#define SB16(i, sbs) ((((i) >> 4) >> (sbs)) << 4)

/* the 16 scales (or mins, from a and a8) of the group at i = 16 (t * G + g): where they are in
   two levels (sb), the super-block's float16 value times the group's int8 one (exact: <= 19
   significant bits), the float32 a one-level plane would hold */
static inline __attribute__((always_inline)) __m512 two16(const QMat *w, const float *a,
                                                        const int8_t *a8, int64_t i) {
    if (!w->sb) return ld16(w, a, i);
    return times8(ld16(w, a, SB16(i, __builtin_ctzll((uint64_t)w->sb))), a8, i); /* (sb: 2^n) */
}

/* Whether the per-32 q8 tile products load W's scales (and mins) as one level of float16 per 32
   columns (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 as the files hold them): a body of its own with the
   same values as scale16's and min16's (fewer branches and registers). Two-level planes
   (Q4_K, Q5_K) take tile_dot_rows16_sb. */
static inline int plain16(const QMat *w) {
    return HALF_BUILT && w->half && w->group == 32 && !w->sb;
}

static inline __attribute__((always_inline)) __m512 scale16(const QMat *w, int64_t i) {
    return two16(w, w->scale, w->sc8, i);
}

static inline __attribute__((always_inline)) __m512 min16(const QMat *w, int64_t i) {
    return w->min ? two16(w, w->min, w->mn8, i) : _mm512_mul_ps(_mm512_set1_ps(-w->zero), scale16(w, i));
}

/* tile t's 16 outputs of rows m < mr: acc + mins, into out (added to it where add) */
static inline __attribute__((always_inline)) void store_tile16(const QMat *w, int64_t t,
                                                               const __m512 *acc,
                                                               const __m512 *mins, float *out,
                                                               int add, const int mr) {
    const int64_t rows = w->n - 16 * t < 16 ? w->n - 16 * t : 16;
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    for (int m = 0; m < mr; m++) {
        float *y = out + m * ldy_of(w) + 16 * t;
        const __m512 o = _mm512_add_ps(acc[m], mins[m]);
        _mm512_mask_storeu_ps(y, keep, add ? _mm512_add_ps(_mm512_maskz_loadu_ps(keep, y), o) : o);
    }
}

/* Tile t of 16 rows, 4-bit (eight = 0; six: plus top16's two bits) or 8-bit codes, a 32-column
   chunk at a time: per sub-block s, dword i of a vector holds row i's codes of columns (2s,
   2s + 1, 16 + 2s, 17 + 2s)[e] as byte e (8-bit: the chunk's 512 bytes (s, i, e)), or 4-bit
   ones as byte e's low nibble for an even s and high nibble for the odd s after it (the
   chunk's 256 bytes (s / 2, i, e)): one mask, or a shift and a mask, gives the VNNI operand of
   a sub-block. */
#define TILE_CHUNK(eight) ((eight) ? 512 : 256)

/* sub-block s's 16 dwords of codes as bytes (c: the chunk) */
static inline __attribute__((always_inline)) __m512i tile16_dwords(const uint8_t *c, int s,
                                                                   const int eight) {
    if (eight) return _mm512_loadu_si512((const void *)(c + 64 * s));
    const __m512i d = _mm512_loadu_si512((const void *)(c + 64 * (s >> 1)));
    return _mm512_and_si512(s & 1 ? _mm512_srli_epi32(d, 4) : d, _mm512_set1_epi8(0x0F));
}

/* 5-bit tiles (AVX-512 builds): the 4-bit tiles of the codes' low four bits, and per chunk 64
   bytes of their fifth bits: byte (i, e) of the chunk's bits holds bit s for sub-block s's
   column (2s, 2s + 1, 16 + 2s, 17 + 2s)[e] of row i (dword i of a vector, as the codes) */
static inline __attribute__((always_inline)) const uint8_t *high16(const QMat *w, int64_t t,
                                                                int64_t jj) {
    return w->high + (t * (w->k / 32) + jj) * 64;
}

/* sub-block s's fifth bits as 16 in each byte of a code that has one (h: the chunk's bits) */
static inline __attribute__((always_inline)) __m512i high16_bytes(__m512i h, int s) {
    const __m512i b = s <= 4 ? _mm512_slli_epi32(h, 4 - s) : _mm512_srli_epi32(h, s - 4);
    return _mm512_and_si512(b, _mm512_set1_epi8(0x10));
}

/* 6-bit tiles (AVX-512 builds, Q6_K): the 4-bit tiles of the codes' low four bits, and per
   chunk 128 bytes of their top two bits: byte (q, i, e) holds bits 2r, 2r + 1 for sub-block
   4q + r's column of byte e of dword i (the codes' own order, either layout) */
static inline __attribute__((always_inline)) const uint8_t *top16(const QMat *w, int64_t t,
                                                               int64_t jj) {
    return w->high + (t * (w->k / 32) + jj) * 128;
}

/* sub-block s's 16 dwords of 6-bit codes as bytes (c: the chunk's 4-bit tile, h: the top bits
   of sub-blocks 4 (s / 4) .. 4 (s / 4) + 3) */
static inline __attribute__((always_inline)) __m512i six16_dwords(const uint8_t *c, __m512i h,
                                                                  int s) {
    const int r = s & 3;
    const __m512i b = r <= 2 ? _mm512_slli_epi32(h, 4 - 2 * r) : _mm512_srli_epi32(h, 2);
    return _mm512_or_si512(tile16_dwords(c, s, 0), _mm512_and_si512(b, _mm512_set1_epi8(0x30)));
}

/* sub-block s's codes as floats, q[e]: column (2s, 2s + 1, 16 + 2s, 17 + 2s)[e] of the 16 rows
   (4-bit: vpermps reads the low 4 bits of each index, one nibble per lookup; five: plus 16
   where the fifth bit is set, h the chunk's bits) */
static inline __attribute__((always_inline)) void tile16_codes(const uint8_t *c, int s,
                                                               const int eight, const int five,
                                                               const int six, __m512i h,
                                                               __m512 q[4]) {
    if (eight || six) { /* (six: h, the top bits of sub-blocks 4 (s / 4) ..) */
        const __m512i d = six ? six16_dwords(c, h, s) : tile16_dwords(c, s, 1);
        const __m512i byte = _mm512_set1_epi32(0xFF);
        for (int e = 0; e < 3; e++)
            q[e] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 8 * e), byte));
        q[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 24));
    } else {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i d = _mm512_loadu_si512((const void *)(c + 64 * (s >> 1)));
        for (int e = 0; e < 4; e++) {
            q[e] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 8 * e + 4 * (s & 1)), iota);
            if (five) {
                const __mmask16 m = _mm512_test_epi32_mask(h, _mm512_set1_epi32(1 << (8 * e + s)));
                q[e] = _mm512_mask_add_ps(q[e], m, q[e], _mm512_set1_ps(16.f));
            }
        }
    }
}

/* The float32 products of a tile. Groups of a multiple of 32 take one scale per group; groups
   of 16 (g16: Q6_K, Q3_K, Q2_K) are tiles in column order, sub-block s holding columns 4s + e
   (e < 4; make_plane lays them out so), and split each chunk: columns 0 .. 15 (sub-blocks 0 .. 3: a0) and 16 .. 31
   (a1) under their own scales. */
static inline __attribute__((always_inline)) void tile_dot_rows16(const QMat *w, int64_t t,
                                                                  const float *x, const float *xs,
                                                                  float *out, int add, const int mr,
                                                                  const int eight, const int five,
                                                                  const int six, const int g16) {
    const int64_t k = w->k, G = k / w->group, chunks = g16 ? 1 : w->group / 32;
    const int64_t steps = g16 ? k / 32 : G; /* a group, or (g16) a chunk of two */
    const uint8_t *c = w->codes + t * (k / 32) * TILE_CHUNK(eight);
    __m512 acc[MR16], mins[MR16];
    for (int m = 0; m < mr; m++) acc[m] = mins[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < steps; g++) {
        __m512 a0[MR16], a1[MR16];
        for (int m = 0; m < mr; m++) a0[m] = a1[m] = _mm512_setzero_ps();
        for (int64_t j = 0; j < chunks; j++) {
            const int64_t col = (g * chunks + j) * 32;
            const int64_t jj = g * chunks + j;
            const __m512i h = five ? _mm512_loadu_si512((const void *)high16(w, t, jj))
                            : six  ? _mm512_loadu_si512((const void *)top16(w, t, jj))
                                   : _mm512_setzero_si512();
            const __m512i h2 = six ? _mm512_loadu_si512((const void *)(top16(w, t, jj) + 64))
                                   : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                __m512 q[4];
                tile16_codes(c, s, eight, five, six, six && s >= 4 ? h2 : h, q);
                for (int m = 0; m < mr; m++) {
                    const float *xc = x + m * k + col;
                    if (g16) { /* columns 4s + e: group 0 for s < 4, group 1 after */
                        __m512 *a = s < 4 ? &a0[m] : &a1[m];
                        for (int e = 0; e < 4; e++)
                            *a = _mm512_fmadd_ps(q[e], _mm512_set1_ps(xc[4 * s + e]), *a);
                        continue;
                    }
                    a0[m] = _mm512_fmadd_ps(q[0], _mm512_set1_ps(xc[2 * s]), a0[m]);
                    a1[m] = _mm512_fmadd_ps(q[2], _mm512_set1_ps(xc[16 + 2 * s]), a1[m]);
                    a0[m] = _mm512_fmadd_ps(q[1], _mm512_set1_ps(xc[2 * s + 1]), a0[m]);
                    a1[m] = _mm512_fmadd_ps(q[3], _mm512_set1_ps(xc[17 + 2 * s]), a1[m]);
                }
            }
            c += TILE_CHUNK(eight);
        }
        if (g16) {
            const int64_t i = (t * G + 2 * g) * 16;
            const __m512 s0 = scale16(w, i), s1 = scale16(w, i + 16);
            const __m512 n0 = min16(w, i), n1 = min16(w, i + 16);
            for (int m = 0; m < mr; m++) {
                acc[m] = _mm512_fmadd_ps(a0[m], s0, acc[m]);
                acc[m] = _mm512_fmadd_ps(a1[m], s1, acc[m]);
                mins[m] = _mm512_fmadd_ps(n0, _mm512_set1_ps(xs[m * G + 2 * g]), mins[m]);
                mins[m] = _mm512_fmadd_ps(n1, _mm512_set1_ps(xs[m * G + 2 * g + 1]), mins[m]);
            }
        } else {
            const __m512 sc = scale16(w, (t * G + g) * 16), mn = min16(w, (t * G + g) * 16);
            for (int m = 0; m < mr; m++) {
                acc[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), sc, acc[m]);
                mins[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * G + g]), mins[m]);
            }
        }
    }
    store_tile16(w, t, acc, mins, out, add, mr);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) /* (inside __AVX512F__) */
#define Q8_TILES16 1
/* chunk jj's fifth bits (h[0]) or top bits (h[0], h[1]) of tile t, where the codes have them */
static inline __attribute__((always_inline)) void chunk_bits16(const QMat *w, int64_t t,
                                                               int64_t jj, const int five,
                                                               const int six, __m512i h[2]) {
    h[0] = five ? _mm512_loadu_si512((const void *)high16(w, t, jj))
         : six  ? _mm512_loadu_si512((const void *)top16(w, t, jj))
                : _mm512_setzero_si512();
    h[1] = six ? _mm512_loadu_si512((const void *)(top16(w, t, jj) + 64)) : _mm512_setzero_si512();
}

/* chunk jj of tile t + 1 (c: tile t's), fetched from memory while tile t's computes: W streams
   through the products once a step (a 1536 x 151936 Q4_K head at 32 rows: ~410 -> ~555 G
   MAC/s; nothing where W stays in the caches). Past the last tile the addresses are W's end:
   a prefetch never faults. */
static inline __attribute__((always_inline)) void fetch_next_tile(const QMat *w, const uint8_t *c,
                                                                  int64_t t, int64_t jj,
                                                                  const int eight, const int five,
                                                                  const int six) {
    const char *next = (const char *)(c + w->k / 32 * TILE_CHUNK(eight));
    for (int l = 0; l < TILE_CHUNK(eight); l += 64) __builtin_prefetch(next + l);
    if (five || six) {
        const char *bits = (const char *)(six ? top16(w, t + 1, jj) : high16(w, t + 1, jj));
        for (int l = 0; l < (six ? 128 : 64); l += 64) __builtin_prefetch(bits + l);
    }
}

/* sub-block s's 16 dwords of codes as bytes, the integer products' operand (c: the chunk's
   tile, h: chunk_bits16's) */
static inline __attribute__((always_inline)) __m512i operand16(const uint8_t *c, int s,
                                                               const int eight, const int five,
                                                               const int six, const __m512i h[2]) {
    const __m512i q = six ? six16_dwords(c, h[s >= 4], s) : tile16_dwords(c, s, eight);
    return five ? _mm512_or_si512(q, high16_bytes(h[0], s)) : q;
}

/* acc[m] += a sub-block's 16 dwords of codes q times row m's four x codes at x + m k (one
   broadcast dword, VNNI), m < mr */
static inline __attribute__((always_inline)) void dots16(__m512i *acc, __m512i q, const int8_t *x,
                                                         int64_t k, const int mr) {
    for (int m = 0; m < mr; m++) {
        uint32_t xv;
        memcpy(&xv, x + m * k, sizeof xv);
        acc[m] = _mm512_dpbusd_epi32(acc[m], q, _mm512_set1_epi32((int)xv));
    }
}

/* tile_dot_rows16 with 8-bit rows of x: sub-block s's 16 dwords of codes (as bytes, in the x
   codes' column order) times the chunk's four x codes (one broadcast dword), by VNNI. Groups of
   16 (g16): x in column order too (quantize_row_q8's plain), sub-blocks 0 .. 3 summed for the
   chunk's first group, 4 .. 7 for its second. plain: plain16(w), a body per value. */
static inline __attribute__((always_inline)) void tile_dot_rows16_q8(const QMat *w, int64_t t,
                                                                     const int8_t *xq,
                                                                     const float *dx,
                                                                     const float *xs, float *out,
                                                                     int add, const int mr,
                                                                     const int eight,
                                                                     const int five,
                                                                     const int six,
                                                                     const int g16,
                                                                     const int plain) {
    const int64_t k = w->k, G = k / w->group, chunks = g16 || plain ? 1 : w->group / 32;
    const int64_t J = k / 32;
    const uint8_t *c = w->codes + t * J * TILE_CHUNK(eight);
    const int8_t *xr = xq;
    __m512 acc[MRQ], mins[MRQ];
    for (int m = 0; m < mr; m++) acc[m] = mins[m] = _mm512_setzero_ps();
    for (int64_t jj = 0; jj < J; jj++, c += TILE_CHUNK(eight), xr += 32) {
        const int64_t i = (t * G + (g16 ? 2 * jj : jj / chunks)) * 16; /* its (first) group */
        const __m512 sc = plain ? half16(w->scale, i) : scale16(w, i);
        const __m512 s1 = g16 ? scale16(w, i + 16) : sc;
        __m512i h[2];
        fetch_next_tile(w, c, t, jj, eight, five, six);
        chunk_bits16(w, t, jj, five, six, h);
        __m512i a[MRQ], b[MRQ];
        for (int m = 0; m < mr; m++) a[m] = b[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            dots16(g16 && s >= 4 ? b : a, operand16(c, s, eight, five, six, h), xr + 4 * s, k, mr);
        }
        for (int m = 0; m < mr; m++) {
            const __m512 d = _mm512_set1_ps(dx[m * J + jj]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m]), _mm512_mul_ps(sc, d), acc[m]);
            if (g16)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b[m]), _mm512_mul_ps(s1, d), acc[m]);
        }
    }
    /* the mins' term in a pass of its own: the same operations in the same order as beside
       the codes' chunks (the same bits), but its accumulators are out of the registers the
       chunks use (at 512 rows: Q4_1 576 x 3072 ~545 -> ~600 G MAC/s, Q5_0 896 x 4864 453 ->
       525, Q8_0 575 -> 620) */
    for (int64_t g = 0; g < G; g += g16 ? 2 : 1) {
        const int64_t i = (t * G + g) * 16;
        const __m512 mn = !plain   ? min16(w, i)
                          : !w->min ? _mm512_mul_ps(_mm512_set1_ps(-w->zero), half16(w->scale, i))
                                    : half16(w->min, i);
        const __m512 n1 = g16 ? min16(w, i + 16) : mn;
        for (int m = 0; m < mr; m++) {
            mins[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * G + g]), mins[m]);
            if (g16) mins[m] = _mm512_fmadd_ps(n1, _mm512_set1_ps(xs[m * G + g + 1]), mins[m]);
        }
    }
    store_tile16(w, t, acc, mins, out, add, mr);
}

/* row m's scales of x where it is in super-blocks (after its G int16 group sums) */
static inline const float *xdx(const float *xs, int m, int64_t G) {
    return (const float *)((const int16_t *)(xs + m * G) + G);
}

/* columns of a two-level plane's super-block: one scale of x per super-block (x_per) */
static inline int64_t x_per_sb(const QMat *w) { return w->group * w->sb; }

/* Two-level planes (sb > 0: k-quants) with x in super-blocks (quantize_row_q8 with per =
   x_per_sb: one scale per super-block, as llama.cpp's Q8_K for the same formats, and a shift
   per chunk of 32 for the chunks far below the super-block's max: up to 3 more bits): the
   scales inside a super-block are W's int8 sub-scales, so a super-block is all integers, sum
   over chunks of (sum_g sc8_g (codes_g . xq_g)) << shift, scaled once by d * dx in float32;
   the mins' term likewise, sum_g mn8_g sum(xq_g << shift) (symmetric codes: sc8 and -zero *
   d), by 16-bit pair products. Row m's shifts are int32 at dx + m J; its group sums (int16) and super-block
   scales in its G floats of xs (xdx). No int32 sum can overflow: |codes . x| <= 32 * 63 * 127
   per chunk, times |sc8| <= 128, << 3, over 8 chunks: 2.097e9 < 2^31. Sub-blocks 0 .. 3 of a
   chunk are its first group where groups are 16. */
static inline __attribute__((always_inline)) void tile_dot_rows16_sb(const QMat *w, int64_t t,
                                                                     const int8_t *xq,
                                                                     const float *dx,
                                                                     const float *xs, float *out,
                                                                     int add, const int mr,
                                                                     const int eight,
                                                                     const int five,
                                                                     const int six,
                                                                     const int g16) {
    const int64_t k = w->k, G = k / w->group, J = k / 32, per = x_per_sb(w), NS = k / per;
    const int64_t cps = per / 32, gpb = per / w->group; /* chunks, groups per block of x */
    const int sbs = __builtin_ctzll((uint64_t)w->sb);
    const uint8_t *c = w->codes + t * J * TILE_CHUNK(eight);
    const int8_t *xr = xq;
    __m512 acc[MRQ], mins[MRQ];
    for (int m = 0; m < mr; m++) acc[m] = mins[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < NS; b++) {
        __m512i is[MRQ];
        for (int m = 0; m < mr; m++) is[m] = _mm512_setzero_si512();
        for (int64_t jj = b * cps; jj < (b + 1) * cps; jj++, c += TILE_CHUNK(eight), xr += 32) {
            const int64_t i = (t * G + (g16 ? 2 * jj : jj)) * 16;
            fetch_next_tile(w, c, t, jj, eight, five, six);
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w->sc8 + i)));
            __m512i h[2];
            chunk_bits16(w, t, jj, five, six, h);
            __m512i a[MRQ];
            for (int m = 0; m < mr; m++) a[m] = _mm512_setzero_si512();
            __m512i a0[MRQ];
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                if (g16 && s == 4) { /* the chunk's first group is done */
                    for (int m = 0; m < mr; m++) {
                        a0[m] = _mm512_mullo_epi32(a[m], s0);
                        a[m] = _mm512_setzero_si512();
                    }
                }
                dots16(a, operand16(c, s, eight, five, six, h), xr + 4 * s, k, mr);
            }
            const __m512i s1 = g16 ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w->sc8 + i + 16))) : s0;
            for (int m = 0; m < mr; m++) { /* (the row's shift for the chunk: dx holds them) */
                __m512i p = _mm512_mullo_epi32(a[m], s1);
                if (g16) p = _mm512_add_epi32(p, a0[m]);
                p = _mm512_sllv_epi32(p, _mm512_set1_epi32(((const int32_t *)(dx + m * J))[jj]));
                is[m] = _mm512_add_epi32(is[m], p);
            }
        }
        const int64_t i0 = (t * G + b * gpb) * 16;
        const __m512 d = half16(w->scale, SB16(i0, sbs));
        for (int m = 0; m < mr; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[m]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xdx(xs, m, G)[b])), acc[m]);
    }
    /* the mins' term: per super-block, pairs of groups (g, g + 1) as 16-bit lanes */
    const int8_t *a8 = w->min ? w->mn8 : w->sc8;
    for (int64_t b = 0; b < NS; b++) {
        __m512i ms[MRQ];
        for (int m = 0; m < mr; m++) ms[m] = _mm512_setzero_si512();
        for (int64_t g = b * gpb; g < (b + 1) * gpb; g += 2) {
            const int64_t i = (t * G + g) * 16;
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a8 + i))));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a8 + i + 16))));
            const __m512i pair = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
            for (int m = 0; m < mr; m++) {
                uint32_t sv; /* (sums g, g + 1 of row m) */
                memcpy(&sv, (const int16_t *)(xs + m * G) + g, sizeof sv);
                ms[m] = _mm512_dpwssd_epi32(ms[m], pair, _mm512_set1_epi32((int)sv));
            }
        }
        const int64_t i0 = (t * G + b * gpb) * 16;
        const __m512 mn = w->min ? half16(w->min, SB16(i0, sbs))
                                 : _mm512_mul_ps(_mm512_set1_ps(-w->zero), half16(w->scale, SB16(i0, sbs)));
        for (int m = 0; m < mr; m++)
            mins[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms[m]),
                                      _mm512_mul_ps(mn, _mm512_set1_ps(xdx(xs, m, G)[b])), mins[m]);
    }
    store_tile16(w, t, acc, mins, out, add, mr);
}
#endif
#endif

#endif /* INFERFLOW_TILES16_H */
