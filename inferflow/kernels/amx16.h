/* AMX builds' tile products with 8-bit rows of x: 16 rows of x times a 16-row tile of W per
   instruction (TDPBSUD: x's signed codes times W's unsigned ones), the same integer sums per
   chunk as tile_dot_rows16_q8's VNNI ones, then the same float32 operations on them: a row's
   outputs are the same bits whichever path computes them. Part of quant_decode.c (after
   tiles16.h). */
#ifndef INFERFLOW_AMX16_H
#define INFERFLOW_AMX16_H

#include "tiles16.h"

#if defined(Q8_TILES16) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_BUILT 1

static void block_dot_q8(const QMat *w, int path, int64_t per, int64_t t, const int8_t *xq,
                         const float *dx, const float *xs, float *y, int add, int64_t mr);
#define AMX_BLOCKS 8 /* 16-row blocks of x per pass over W's tiles (x's codes stay in L2) */

static int amx_on = 0;
static int64_t amx_rows = 0; /* rows of x the AMX products have taken (thread 0 counts) */

/* rows of x the AMX products have taken in this process (tests: that they ran) */
int64_t qmat_amx_rows(void) { return amx_rows; }

/* Turn the AMX products on (where Linux grants this process the tile data state: the
   permission request is once per process) or off; whether they are on */
int qmat_amx_enable(int on) {
    amx_on = on && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_on;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* this thread's tiles: 0 .. 3 integer sums (16 rows of x times 16 of W), 4 and 5 x's codes, 6
   and 7 W's: a chunk of 32 columns (8 sub-blocks of 16 dwords), or (g16) half a chunk */
static void amx_config(const int g16) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = i >= 6 ? (g16 ? 4 : 8) : 16;
        c.colsb[i] = i == 4 || i == 5 ? (g16 ? 16 : 32) : 64;
    }
    _tile_loadconfig(&c);
}

/* this thread's scratch for a tile's codes as bytes (k / 32 chunks of 512) */
static uint8_t *amx_scratch(int64_t bytes) {
    static __thread uint8_t *buf = NULL;
    static __thread int64_t cap = 0;
    if (bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        cap = buf ? bytes : 0;
    }
    return buf;
}

/* tile t's 4-, 5- or 6-bit codes as TDPBSUD's second operand, into b: per chunk its 8
   sub-blocks' 16 dwords of bytes (operand16's; 8-bit tiles are that already) */
static void amx_codes(const QMat *w, int64_t t, uint8_t *b, const int five, const int six) {
    const int64_t J = w->k / 32;
    const uint8_t *c = w->codes + t * J * TILE_CHUNK(0);
    for (int64_t jj = 0; jj < J; jj++, c += TILE_CHUNK(0)) {
        __m512i h[2];
        chunk_bits16(w, t, jj, five, six, h);
        for (int s = 0; s < 8; s++)
            _mm512_storeu_si512((void *)(b + jj * 512 + 64 * s), operand16(c, s, 0, five, six, h));
    }
}

/* sums tile c = x's tile a (16 rows' codes at xa, a row every k bytes) times W's tile b (at
   wb): TDPBSUD, x's signed codes times W's unsigned ones */
#define AMX_DOT(c, a, b)                                                                           \
    do {                                                                                           \
        _tile_zero(c);                                                                             \
        _tile_dpbsud(c, a, b);                                                                     \
    } while (0)

/* tile_dot_rows16_q8 for 16-row blocks r0 .. r0 + nr - 1 (nr <= 2) of x and tiles t0 .. t0 +
   nt - 1 (nt <= 2) of W (b: their amx_codes, J * 512 bytes each): per chunk (or half chunk,
   g16) each of x's blocks and each of W's tiles is loaded once for up to four products (sums
   tile 2 rb + tb: block rb times tile tb), which are then scaled into acc in the chunks'
   order; the mins' sums after, in tile_dot_rows16_q8's order */
static inline __attribute__((always_inline)) void amx_tiles(const QMat *w, int64_t t0, int nt,
                                                            const uint8_t *b, const int8_t *xq,
                                                            const float *dx, const float *xs,
                                                            float *out, int add, int nr,
                                                            const int g16) {
    const int64_t k = w->k, G = k / w->group, chunks = g16 ? 1 : w->group / 32, J = k / 32;
    const int64_t steps = g16 ? J : G;
    int32_t sums[4][256] __attribute__((aligned(64)));
    float acc[4][256] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    for (int64_t jj = 0; jj < J; jj++)
        for (int h = 0; h < 1 + g16; h++) { /* (g16: the chunk's two groups of 16) */
            const int64_t off = jj * 32 + 16 * h, woff = jj * 512 + 256 * h;
            _tile_loadd(4, xq + off, k);
            _tile_loadd(6, b + woff, 64);
            AMX_DOT(0, 4, 6);
            if (nt > 1) {
                _tile_loadd(7, b + J * 512 + woff, 64);
                AMX_DOT(1, 4, 7);
            }
            if (nr > 1) {
                _tile_loadd(5, xq + 16 * k + off, k);
                AMX_DOT(2, 5, 6);
                if (nt > 1) AMX_DOT(3, 5, 7);
            }
            _tile_stored(0, sums[0], 64);
            if (nt > 1) _tile_stored(1, sums[1], 64);
            if (nr > 1) _tile_stored(2, sums[2], 64);
            if (nr > 1 && nt > 1) _tile_stored(3, sums[3], 64);
            for (int tb = 0; tb < nt; tb++) {
                const int64_t i = ((t0 + tb) * G + (g16 ? 2 * jj + h : jj / chunks)) * 16;
                const __m512 sc = scale16(w, i);
                for (int rb = 0; rb < nr; rb++) {
                    const int c = 2 * rb + tb;
                    const float *d = dx + rb * 16 * J + jj;
                    for (int m = 0; m < 16; m++) {
                        const __m512i v = _mm512_load_si512((const void *)(sums[c] + 16 * m));
                        const __m512 a = _mm512_load_ps(acc[c] + 16 * m);
                        _mm512_store_ps(acc[c] + 16 * m,
                                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(v),
                                                        _mm512_mul_ps(sc, _mm512_set1_ps(d[m * J])), a));
                    }
                }
            }
        }
    for (int tb = 0; tb < nt; tb++)
        for (int rb = 0; rb < nr; rb++) {
            const float *sr = xs + rb * 16 * G;
            __m512 a[16], mins[16];
            for (int m = 0; m < 16; m++)
                a[m] = _mm512_load_ps(acc[2 * rb + tb] + 16 * m), mins[m] = _mm512_setzero_ps();
            for (int64_t g = 0; g < steps; g++) {
                const int64_t i = ((t0 + tb) * G + (g16 ? 2 * g : g)) * 16;
                const __m512 mn = min16(w, i), n1 = g16 ? min16(w, i + 16) : mn;
                for (int m = 0; m < 16; m++) {
                    mins[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sr[m * G + (g16 ? 2 * g : g)]), mins[m]);
                    if (g16) mins[m] = _mm512_fmadd_ps(n1, _mm512_set1_ps(sr[m * G + 2 * g + 1]), mins[m]);
                }
            }
            store_tile16(w, t0 + tb, a, mins, out + rb * 16 * ldy_of(w), add, 16);
        }
}

/* inside a parallel region: rows 0 .. 16 nb - 1 of x (8-bit codes, gemm_in_team's) times W
   on an AVX-512 tile path (>= 2): two tiles of W against AMX_BLOCKS blocks of 16 rows (x's
   codes stay in L2), two blocks at a time */
static void amx_gemm_in_team(const QMat *w, int path, int64_t nb, const int8_t *xq,
                             const float *dx, const float *xs, float *y, int add) {
    const int64_t k = w->k, G = k / w->group, J = k / 32, T = (w->n + 15) / 16;
    const int64_t P = (nb + AMX_BLOCKS - 1) / AMX_BLOCKS, T2 = (T + 1) / 2;
    const int eight = path == 3 || path == 6, five = path == 4, six = path == 7 || path == 8;
    const int g16 = path == 5 || path == 6 || path == 8;
    uint8_t *buf = eight ? NULL : amx_scratch(2 * J * 512);
    const int ok = eight || buf != NULL;
    amx_config(g16);
    if (omp_get_thread_num() == 0) amx_rows += 16 * nb;
#pragma omp for collapse(2) schedule(static)
    for (int64_t p = 0; p < P; p++)
        for (int64_t t2 = 0; t2 < T2; t2++) {
            const int64_t t = 2 * t2, r1 = p * AMX_BLOCKS + AMX_BLOCKS < nb ? p * AMX_BLOCKS + AMX_BLOCKS : nb;
            const int nt = T - t < 2 ? 1 : 2;
            if (!ok) { /* (no scratch: the VNNI products, the same bits) */
                for (int64_t m = p * AMX_BLOCKS * 16; m < r1 * 16; m += MRQ)
                    for (int64_t u = t; u < t + nt; u++)
                        block_dot_q8(w, path, 32, u, xq + m * k, dx + m * J, xs + m * G, y + m * ldy_of(w),
                                     add, r1 * 16 - m < MRQ ? r1 * 16 - m : MRQ);
                continue;
            }
            const uint8_t *b = eight ? w->codes + t * J * 512 : buf;
            if (!eight)
                for (int u = 0; u < nt; u++) amx_codes(w, t + u, buf + u * J * 512, five, six);
            for (int64_t r = p * AMX_BLOCKS; r < r1; r += 2) {
                const int nr = r1 - r < 2 ? 1 : 2;
                const int64_t m = r * 16;
                if (g16)
                    amx_tiles(w, t, nt, b, xq + m * k, dx + m * J, xs + m * G, y + m * ldy_of(w), add, nr, 1);
                else
                    amx_tiles(w, t, nt, b, xq + m * k, dx + m * J, xs + m * G, y + m * ldy_of(w), add, nr, 0);
            }
        }
    _tile_release();
}
#else
#define AMX_BUILT 0
int qmat_amx_enable(int on) {
    (void)on;
    return 0;
}
int64_t qmat_amx_rows(void) { return 0; }
#endif

#endif /* INFERFLOW_AMX16_H */
