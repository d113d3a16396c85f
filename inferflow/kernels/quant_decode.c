/* Products over affine-quantized weights, float32 activations, one arithmetic per row.

   A QMat holds a weight W (n, k) as w = code * scale + min per group of `group` weights
   (a multiple of 32; of 16 for 8-bit codes), so W x = sum_g scale_g * (codes_g . x_g) + min_g * sum(x_g).
   - 8-bit codes: row by row, one byte per code; scale and min (n, k / group).
   - 4-bit codes: tiles of 16 rows (n padded to a multiple of 16 with zero rows). Tile t,
     chunk j of 32 columns, sub-block s < 8 holds 32 bytes; byte 2i + e (row 16t + i, e < 2) is
     c[32j + 2s + e] | c[32j + 16 + 2s + e] << 4. Scale and min are (tiles, k / group, 16).
   - 5-bit codes (Q5_0, Q5_1, Q5_K): the 4-bit tiles of their low four bits, and their fifth
     bits beside them, 64 bytes per tile and chunk: byte (t, j, s, h, e) has bit i set where row
     16t + 8h + i's code of column 2s, 16 + 2s, 2s + 1, 17 + 2s (e = 0 .. 3) is >= 16 (the order
     of tile_codes' vectors).
   AVX-512 builds hold other tiles (tiles16.h): 4-bit ones with two sub-blocks per byte, 5-bit
   ones with their fifth bits as bit s of a byte per (row, column of the sub-block), 6-bit
   ones (Q6_K) as 4-bit ones and their top two bits, four sub-blocks per byte, 8-bit ones;
   tiles there also take groups of 16 (Q2_K, Q3_K, Q6_K: two scales per chunk).
   Scales and mins are float32, or float16 where every one is exact in it (F16C builds);
   symmetric formats (min = -zero * scale, zero a power of two) may leave min NULL.

   Batch invariance: every output y[m][r] is computed by the same sequence of float32 operations
   whatever the number of rows M of x, which other rows are in the call, and how the rows are
   split over threads: the products are written once (tile_dot_rows, row_dot_rows) with the
   rows of x as an inner constant-count loop, so one row's arithmetic is the same whether it
   runs alone (qmat_gemv, decode_stack) or beside others (qmat_gemm_f32). Rows of x share each
   unpacked tile of codes, which is where many rows gain.

   qmat_gemv: y = W x for M rows of x, one at a time, rows (or tiles) of W split over the threads.
   qmat_gemm_f32: Y = X W^T for all rows of X at once, the same arithmetic per row; with 8-bit
   rows of X (--dtype act8: quantize_row_q8) where W has 4-bit tiles, integer dot products.
   decode_stack: every layer of a pre-norm decoder (RMS norm, fused q/k/v, rotary embedding,
   GQA attention over cache slots, SiLU-gated FFN) for one new token of each of B sequences, in
   one OpenMP region; the caller embeds the tokens and runs the final norm and the head. A
   sequence's token gets the same operations whatever B is.
   Threads come from the OpenMP runtime torch already loaded (the same libgomp.so.1).
   The per-block products are in qmat.h (float32 on vector types), qmat_q8.h (8-bit rows of x)
   and tiles16.h (AVX-512); this file walks W with them and holds the exported calls. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attend.h"
#include "rows.h"

/* The library's flags allow reassociation and fused multiply-adds wherever the compiler likes,
   and its choices depend on how many rows share a loop: not here. Every multiply-add below is
   written as one (fma8, or AVX-512's) or as two operations. */
#pragma GCC optimize("no-associative-math", "fp-contract=off")

#include "qmat.h"
#include "qmat_q8.h"
#include "tiles16.h"
#include "amx16.h"

typedef struct {
    const float *attn_norm, *ffn_norm; /* (hidden,) */
    QMat qkv, o, gate_up, down;        /* gate_up: [gate; up] rows */
    const float *qkv_bias;             /* NULL, or added to the q/k/v rows before the rotation */
    /* n > 0: the rows after qkv's (gate_up's), in a plane of their own (rows stored in another
       format); both planes' ldy is then the whole output row's width */
    QMat qkv2, gate_up2;
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inner, rotary_dim;
    int32_t adjacent; /* rotary pairs (2i, 2i + 1); else (i, i + rotary_dim / 2) */
    float eps, norm_offset, scale;
    int32_t kv_format; /* the cache: 0 float32, 1 Q8_0 blocks (kvq8.h), 2 float16 (KV_FORMATS) */
    int32_t act_q8; /* 8-bit rows of x into the products that have a q8 path (gemm_in_team) */
} Dims;

int qmat_half_built(void) { return HALF_BUILT; }

/* How W is walked: 0 = 4/5-bit tiles (vector types), 1 = 8-bit rows RW at a time (vector
   types); AVX-512 tiles: 2 = 4-bit, 3 = 8-bit, 4 = 5-bit (groups of 32k), 5 = 4-bit and 6 =
   8-bit in groups of 16. A property of W and the build (qmat_tiles16_built), never of the rows
   of x. */
static inline int path_of(const QMat *w) {
#if defined(__AVX512F__)
    if (w->k % 32 == 0 && (w->group % 32 == 0 || w->group == 16)) {
        const int g16 = w->group == 16;
        if (w->bits == 4) return g16 ? 5 : 2;
        if (w->bits == 8) return g16 ? 6 : 3;
        if (w->bits == 6) return g16 ? 8 : 7;
        if (w->high && !g16) return 4;
    }
#endif
    return w->bits == 8 ? 1 : 0;
}

/* rows of W per block, rows of x per block */
static const int64_t BLOCK_ROWS[9] = {16, RW, 16, 16, 16, 16, 16, 16, 16};
#if defined(__AVX512F__)
static const int64_t X_ROWS[9] = {MR, MR, MR16, MR16, MR16, MR16, MR16, MR16, MR16};
#else
static const int64_t X_ROWS[9] = {MR, MR, MR, MR, MR, MR, MR, MR, MR};
#endif
/* with 8-bit rows of x (q8_path): more rows share each unpacked tile where their accumulators
   fit the registers (groups of 32k; groups of 16 keep two integer sums a row) */
#if defined(Q8_TILES16)
static const int64_t XQ_ROWS[9] = {MR, MR, MRQ, MRQ, MRQ, MR16, MR16, MRQ, MR16};
#else
static const int64_t XQ_ROWS[9] = {MR, MR, MR, MR, MR, MR, MR, MR, MR};
#endif

/* one body per path and constant row count, so that every body is inlined with constants */
#define CASES(call)                                                                                 \
    switch (mr) {                                                                                   \
    case 1: call(1); break;                                                                         \
    case 2: call(2); break;                                                                         \
    case 3: call(3); break;                                                                         \
    default: call(4); break;                                                                        \
    }
#define CASES8(call)                                                                                \
    switch (mr) {                                                                                   \
    case 1: call(1); break;                                                                         \
    case 2: call(2); break;                                                                         \
    case 3: call(3); break;                                                                         \
    case 4: call(4); break;                                                                         \
    case 5: call(5); break;                                                                         \
    case 6: call(6); break;                                                                         \
    case 7: call(7); break;                                                                         \
    default: call(8); break;                                                                        \
    }

/* rows x .. x + mr - 1 (mr <= X_ROWS[path]) times block t of W */
static void block_dot(const QMat *w, int path, int64_t t, const float *x, const float *xs,
                      float *y, int add, int64_t mr) {
    switch (path) {
    case 0:
        if (w->high) {
#define C0(n) tile_dot_rows(w, t, x, xs, y, add, (n) < MR ? (n) : MR, 1)
            CASES(C0);
        }
#if !defined(__AVX512F__) /* (AVX-512 builds walk 4-bit tiles by path 2: less to compile) */
        else {
#define C1(n) tile_dot_rows(w, t, x, xs, y, add, (n) < MR ? (n) : MR, 0)
            CASES(C1);
        }
#endif
        break;
    case 1: {
        const int64_t r0 = t * RW, rw = w->n - r0 < RW ? w->n - r0 : RW;
        if (rw == RW) {
#define C2(n) row_dot_rows(w, r0, RW, x, xs, y, add, (n) < MR ? (n) : MR)
            CASES(C2);
        } else
            for (int64_t r = r0; r < r0 + rw; r++) {
#define C3(n) row_dot_rows(w, r, 1, x, xs, y, add, (n) < MR ? (n) : MR)
                CASES(C3);
            }
        break;
    }
#if defined(__AVX512F__)
    case 2:
#define C4(n) tile_dot_rows16(w, t, x, xs, y, add, n, 0, 0, 0, 0)
        CASES(C4);
        break;
    case 3:
#define C5(n) tile_dot_rows16(w, t, x, xs, y, add, n, 1, 0, 0, 0)
        CASES(C5);
        break;
    case 4:
#define C9(n) tile_dot_rows16(w, t, x, xs, y, add, n, 0, 1, 0, 0)
        CASES(C9);
        break;
    case 5:
#define C10(n) tile_dot_rows16(w, t, x, xs, y, add, n, 0, 0, 0, 1)
        CASES(C10);
        break;
    case 6:
#define C11(n) tile_dot_rows16(w, t, x, xs, y, add, n, 1, 0, 0, 1)
        CASES(C11);
        break;
    case 7:
#define C15(n) tile_dot_rows16(w, t, x, xs, y, add, n, 0, 0, 1, 0)
        CASES(C15);
        break;
    case 8:
#define C16(n) tile_dot_rows16(w, t, x, xs, y, add, n, 0, 0, 1, 1)
        CASES(C16);
        break;
#endif
    default: break;
    }
}

/* Whether block_dot_q8 takes W: every AVX-512 tile where the build has VNNI, 4-bit tiles of
   the vector types; other codes keep float32 x */
static inline int q8_path(const QMat *w, int path) {
#if defined(Q8_TILES16)
    (void)w;
    return path >= 2;
#elif defined(__AVX512F__)
    (void)w, (void)path;
    return 0;
#else
    return path == 0 || (path == 1 && w->k % 32 == 0); /* (x's scales are per 32 columns) */
#endif
}

/* columns of x per 8-bit scale in W's q8 products: a super-block of a two-level plane's
   groups where VNNI walks its tiles (tile_dot_rows16_sb), else 32 */
static inline int64_t x_per(const QMat *w, int path) {
#if defined(Q8_TILES16)
    if (w->sb && (path == 2 || path == 4 || path == 5 || path == 8) && w->k % (w->group * w->sb) == 0)
        return x_per_sb(w);
#else
    (void)w, (void)path;
#endif
    return 32;
}

/* block_dot for 8-bit rows of x (q8_path), x in blocks of per = x_per(w, path) columns */
static void block_dot_q8(const QMat *w, int path, int64_t per, int64_t t, const int8_t *xq,
                         const float *dx, const float *xs, float *y, int add, int64_t mr) {
    (void)per; /* (read by VNNI builds only) */
#if defined(Q8_TILES16)
    if (per > 32) {
        switch (path) { /* (eight, five, six, g16) */
#define CSB(n, e, f, s, g) tile_dot_rows16_sb(w, t, xq, dx, xs, y, add, n, e, f, s, g)
#define CSB2(n) CSB(n, 0, 0, 0, 0)
#define CSB4(n) CSB(n, 0, 1, 0, 0)
#define CSB5(n) CSB(n, 0, 0, 0, 1)
#define CSB8(n) CSB(n, 0, 0, 1, 1)
        case 2: CASES8(CSB2); return;
        case 4: CASES8(CSB4); return;
        case 5: CASES8(CSB5); return;
        default: CASES8(CSB8); return;
        }
    }
    switch (path) {
    case 2: /* (plain16 planes: bodies of their own, per path that takes them) */
#define C6(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 0, 0, 0, 0)
#define C6P(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 0, 0, 0, 1)
        if (plain16(w))
            CASES8(C6P)
        else
            CASES8(C6);
        return;
    case 3:
#define C8(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 1, 0, 0, 0, 0)
#define C8P(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 1, 0, 0, 0, 1)
        if (plain16(w))
            CASES8(C8P)
        else
            CASES8(C8);
        return;
    case 4:
#define C12(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 1, 0, 0, 0)
#define C12P(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 1, 0, 0, 1)
        if (plain16(w))
            CASES8(C12P)
        else
            CASES8(C12);
        return;
    case 5:
#define C13(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 0, 0, 1, 0)
        CASES(C13);
        return;
    case 6:
#define C14(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 1, 0, 0, 1, 0)
        CASES(C14);
        return;
    case 7:
#define C17(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 0, 1, 0, 0)
        CASES8(C17);
        return;
    case 8:
#define C18(n) tile_dot_rows16_q8(w, t, xq, dx, xs, y, add, n, 0, 0, 1, 1, 0)
        CASES(C18);
        return;
    default: break;
    }
#endif
#if !defined(__AVX512F__) /* (q8_path: on AVX-512 builds only the tiles take 8-bit x) */
    if (path == 1) {
        const int64_t r0 = t * RW, rw = w->n - r0 < RW ? w->n - r0 : RW;
        if (rw == RW) {
#define C19(n) row_dot_rows_q8(w, r0, RW, xq, dx, xs, y, add, (n) < MR ? (n) : MR)
            CASES(C19);
        } else
            for (int64_t r = r0; r < r0 + rw; r++) {
#define C20(n) row_dot_rows_q8(w, r, 1, xq, dx, xs, y, add, (n) < MR ? (n) : MR)
                CASES(C20);
            }
    } else if (w->high) {
#define C21(n) tile_dot_rows_q8(w, t, xq, dx, xs, y, add, (n) < MR ? (n) : MR, 1)
        CASES(C21);
    } else {
#define C7(n) tile_dot_rows_q8(w, t, xq, dx, xs, y, add, (n) < MR ? (n) : MR, 0)
        CASES(C7);
    }
#else
    (void)path;
    (void)w, (void)t, (void)xq, (void)dx, (void)xs, (void)y, (void)add, (void)mr;
#endif
}

/* blocks of W (tiles or rows) */
static inline int64_t blocks_of(const QMat *w, int path) {
    return (w->n + BLOCK_ROWS[path] - 1) / BLOCK_ROWS[path];
}

/* inside a parallel region: Y = (add ? Y : 0) + X W^T for M rows of X, X_ROWS rows per unpacked
   block of W; xs: scratch of M k / group floats; xq, dx: NULL, or scratch of M k bytes and
   M k / 32 floats for 8-bit rows of X where W has a q8 path. A row's outputs are the same bits
   whatever M is and whichever rows share its blocks. */
static void gemm_in_team(const QMat *w, const float *x, int64_t M, float *xs, float *y, int add,
                         int8_t *xq, float *dx) {
    const int path = path_of(w), q8 = xq != NULL && q8_path(w, path);
    const int64_t k = w->k, G = k / w->group, T = blocks_of(w, path), per = x_per(w, path);
#if defined(Q8_TILES16)
    const int64_t R = q8 ? (per > 32 ? MRQ : XQ_ROWS[path]) : X_ROWS[path];
#else
    const int64_t R = q8 ? XQ_ROWS[path] : X_ROWS[path];
#endif
    const int64_t J = k / 32;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (q8) {
            if (per > 32) { /* the row's G floats: its int16 group sums, then its k / per
                               scales; its k / 32 of dx: the chunks' shifts (int32) */
                int16_t *sums = (int16_t *)(xs + m * G);
                int32_t *sh = (int32_t *)(dx + m * J);
                quantize_row_q8(x + m * k, k, xq + m * k, (float *)(sums + G), w->group == 16,
                                per, sh);
                q8_group_sums16(w, xq + m * k, sh, sums);
            } else {
                quantize_row_q8(x + m * k, k, xq + m * k, dx + m * J, w->group == 16 || path == 1,
                                per, NULL);
                q8_group_sums(w, xq + m * k, dx + m * J, xs + m * G);
            }
        } else
            group_sums(w, x + m * k, xs + m * G);
    }
    int64_t m1 = 0; /* rows before m1 are done */
#if AMX_BUILT
    if (q8 && amx_on && M >= 16 && per == 32) { /* (q8 on AVX-512 builds: the tile paths) */
        m1 = M / 16 * 16;
        amx_gemm_in_team(w, path, M / 16, xq, dx, xs, y, add);
    }
#endif
    const int64_t B = (M - m1 + R - 1) / R;
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < B; b++) {
            const int64_t m0 = m1 + b * R, mr = M - m0 < R ? M - m0 : R;
            if (q8)
                block_dot_q8(w, path, per, t, xq + m0 * k, dx + m0 * J, xs + m0 * G, y + m0 * ldy_of(w),
                             add, mr);
            else
                block_dot(w, path, t, x + m0 * k, xs + m0 * G, y + m0 * ldy_of(w), add, mr);
        }
}

/* y = W x for M rows of x, one row per call (xs: k / 16 floats) */
void qmat_gemv(const QMat *w, const float *x, int64_t M, float *xs, float *y, int nthreads) {
    for (int64_t m = 0; m < M; m++) {
#pragma omp parallel num_threads(nthreads)
        gemm_in_team(w, x + m * w->k, 1, xs, y + m * ldy_of(w), 0, NULL, NULL);
    }
}

/* Y (M, n) = X (M, k) W^T, all rows in one call (xs: M k / group floats; xq, dx: NULL for
   float32 X, else scratch of M k bytes and M k / 32 floats: 8-bit rows of X where W's codes
   have a q8 path) */
void qmat_gemm_f32(const QMat *w, const float *x, int64_t M, float *xs, float *y, int nthreads,
                   int8_t *xq, float *dx) {
#pragma omp parallel num_threads(nthreads)
    gemm_in_team(w, x, M, xs, y, 0, xq, dx);
}

/* whether products over W take 8-bit rows of X where asked (this build's path for W has one) */
int qmat_has_q8(const QMat *w) { return q8_path(w, path_of(w)); }

/* columns of x per 8-bit scale in those products (32, or a two-level plane's super-block) */
int64_t qmat_x_per(const QMat *w) { return x_per(w, path_of(w)); }

/* whether this build has the AMX products (qmat_amx_enable turns them on) */
int qmat_amx_built(void) { return AMX_BUILT; }

/* whether this build walks tiles with AVX-512 (paths 2 and 3): 8-bit codes in groups of a
   multiple of 32 as 16-row tiles (codes (tiles, k / 32, 8, 16, 4), scale and min (tiles, k /
   group, 16)), and 4-bit tiles with two sub-blocks' nibbles in a byte ((tiles, k / 32, 4, 16,
   4)); else 8-bit rows and 4-bit tiles of one sub-block's nibbles per two bytes */
int qmat_tiles16_built(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* B rows through every layer: x (B, hidden) in place. A row is one position of a sequence: a
   decode step's new token, or one of a prompt's (several rows of a sequence, in order). cos /
   sin: (B, rotary_dim / 2), row b's angles. kc / vc: layer 0 of the cache, layer l at l *
   layer_stride floats, slot s of KV head g at (s * KV heads + g) * head_dim. slots (lists, S):
   row b reads list i = which[b] (which NULL: i = b), its keys in the first lens[b] slots, the
   last one where its own K / V go (every row's K / V of a layer are written before any row
   attends: a prompt's later rows see its earlier ones). keep (NULL: every row): the nkeep rows,
   in increasing order, whose outputs are wanted (those that need logits): the last layer
   writes every row's K / V, then attends and runs the rest only for them, and x's first nkeep
   rows are theirs after it (llama.cpp's last layer likewise). scratch: decode_stack_scratch
   floats. Every row gets the same operations whatever B is and whichever rows are beside it
   or kept. */
/* widest input of a layer's products (their group sums and 8-bit rows are sized by it) */
static int64_t widest_input(const Dims *d) {
    const int64_t E = d->hidden, F = d->inner, HD = d->heads * d->head_dim;
    return E > F ? (E > HD ? E : HD) : (F > HD ? F : HD);
}

/* floats of the row lists at the start of decode_stack's scratch (the row blocks' B + 1 int64,
   then the kept rows' lens and lists, B each; rounded up to 64 bytes: what follows stays
   aligned as the scratch is) */
static int64_t blocks_floats(int64_t B) { return (2 * (3 * B + 1) + 15) / 16 * 16; }

/* the row blocks of attention's tasks (decode_stack): up to ATTEND_ROWS rows of one list in a
   row (a prompt's: they read its keys once), else one row; blk[nb] = B. Returns nb. */
static int64_t row_blocks(int64_t B, const int64_t *which, int kv_format, int64_t *blk) {
    int64_t nb = 0;
    for (int64_t b = 0; b < B; b++)
        if (nb == 0 || !which || kv_format == 1 || which[b] != which[b - 1] ||
            b - blk[nb - 1] == ATTEND_ROWS)
            blk[nb++] = b;
    blk[nb] = B;
    return nb;
}

/* attention tasks a thread takes in turn (decode_stack): a block's H heads where there are
   blocks enough, else an equal share of nb H (at least one) */
static int64_t task_run(int64_t nb, int64_t H, int nthreads) {
    const int64_t run = nb >= 4 * nthreads ? H : (nb * H + nthreads - 1) / nthreads;
    return run > 0 ? run : 1;
}

/* floats of scratch decode_stack needs for B rows, slot lists of S, nthreads threads: the
   row-block list; per row its normed input, q / k / v, attention output, gate and up, gated
   values and the widest product input's group sums (act_q8: and its 8-bit rows, scales and
   codes); per thread the scores of one attention task's rows */
int64_t decode_stack_scratch(const Dims *d, int64_t B, int64_t S, int nthreads) {
    const int64_t K = widest_input(d), H = d->heads, KVH = d->kv_heads, D = d->head_dim;
    int64_t row = d->hidden + (2 * H + 2 * KVH) * D + 3 * d->inner + K / 16;
    if (d->act_q8) row += K / 32 + K / 4;
    return blocks_floats(B) + B * row + (int64_t)nthreads * ATTEND_ROWS * S;
}

void decode_stack(const Layer *layers, int64_t L, const Dims *d, int64_t B, float *x,
                  const float *cos, const float *sin, uint8_t *kc, uint8_t *vc, int64_t layer_stride,
                  const int64_t *slots, const int64_t *which, int64_t S, const int64_t *lens,
                  const int64_t *keep, int64_t nkeep, float *scratch, int nthreads) {
    const int64_t H = d->heads, KVH = d->kv_heads, D = d->head_dim, F = d->inner, E = d->hidden;
    const int64_t QKV = (H + 2 * KVH) * D, R2 = d->rotary_dim / 2, NC = (F + 15) / 16;
    /* bytes of a KV head in the cache */
    const int64_t W = d->kv_format == 1 ? D / 32 * 34 : D * (d->kv_format == 2 ? 2 : 4);
    int64_t *blk = (int64_t *)scratch; /* (decode_stack_scratch's layout) */
    float *h = scratch + blocks_floats(B), *qkv = h + B * E, *att = qkv + B * QKV;
    float *gu = att + B * H * D, *act = gu + B * 2 * F, *p = act + B * F;
    float *xs = p + nthreads * ATTEND_ROWS * S;
    const int64_t K = widest_input(d);
    float *dx = d->act_q8 ? xs + B * K / 16 : NULL;
    int8_t *xq = d->act_q8 ? (int8_t *)(dx + B * K / 32) : NULL;
    /* attention tasks: a block of rows (row_blocks) with one head, dealt to the threads in
       turn: a block's heads at a time where there are blocks enough (a thread reads its
       blocks' keys alone, and a prompt's later rows, with more keys, spread over the threads),
       else an equal share of the heads each (no atomics) */
    int64_t nb = row_blocks(B, which, d->kv_format, blk);
    int64_t run = task_run(nb, H, nthreads);
    int64_t *kept_lens = blk + B + 1, *kept_which = kept_lens + B; /* (keep's rows) */
    if (keep && nkeep == B) keep = NULL; /* (every row kept: nothing to move) */
#pragma omp parallel num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        const Layer *ly = layers + l;
        uint8_t *k = kc + l * layer_stride, *v = vc + l * layer_stride; /* (layer_stride: bytes) */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            rms_norm_row(x + b * E, ly->attn_norm, E, d->eps, d->norm_offset, h + b * E);
        gemm_in_team(&ly->qkv, h, B, xs, qkv, 0, xq, dx);
        if (ly->qkv2.n) gemm_in_team(&ly->qkv2, h, B, xs, qkv + ly->qkv.n, 0, xq, dx);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * QKV;
            const int64_t w = slots[(which ? which[b] : b) * S + lens[b] - 1];
            if (ly->qkv_bias)
                for (int64_t i = 0; i < QKV; i++) row[i] += ly->qkv_bias[i];
            for (int64_t j = 0; j < H + KVH; j++)
                rope_head(row + j * D, cos + b * R2, sin + b * R2, d->rotary_dim, d->adjacent);
            if (d->kv_format == 1) {
                q8_0_row(row + H * D, KVH * D, k + w * KVH * W);
                q8_0_row(row + (H + KVH) * D, KVH * D, v + w * KVH * W);
            } else if (d->kv_format == 2) { /* (rounded to nearest even, as torch's .half()) */
                uint16_t *kh = (uint16_t *)(k + w * KVH * W), *vh = (uint16_t *)(v + w * KVH * W);
                for (int64_t i = 0; i < KVH * D; i++) {
                    kh[i] = float_to_half(row[H * D + i]);
                    vh[i] = float_to_half(row[(H + KVH) * D + i]);
                }
            } else {
                memcpy(k + w * KVH * W, row + H * D, sizeof(float) * KVH * D);
                memcpy(v + w * KVH * W, row + (H + KVH) * D, sizeof(float) * KVH * D);
            }
        }
        if (keep && l == L - 1) {
#pragma omp single
            { /* the kept rows to the front (keep increasing: a row moves only downwards, over
                 one already moved or skipped), with their lists and key counts */
                for (int64_t i = 0; i < nkeep; i++) {
                    const int64_t b = keep[i];
                    if (b != i) {
                        memcpy(x + i * E, x + b * E, sizeof(float) * E);
                        memcpy(qkv + i * QKV, qkv + b * QKV, sizeof(float) * H * D);
                    }
                    kept_lens[i] = lens[b];
                    kept_which[i] = which ? which[b] : b;
                }
                B = nkeep, lens = kept_lens, which = kept_which;
                nb = row_blocks(B, which, d->kv_format, blk);
                run = task_run(nb, H, nthreads);
            } /* (its barrier: every thread reads the new B, lists and blocks after it) */
        }
#pragma omp for collapse(2) schedule(static, run)
        for (int64_t i = 0; i < nb; i++)
            for (int64_t j = 0; j < H; j++) { /* (the last slot is a row's own token's) */
                const int64_t b = blk[i];
                float *pj = p + omp_get_thread_num() * ATTEND_ROWS * S, *out = att + (b * H + j) * D;
                const int64_t *list = slots + (which ? which[b] : b) * S;
                if (d->kv_format == 1) /* (blocks of one row) */
                    attend_head_q8_any(qkv + b * QKV + j * D, k, v, list, lens[b], KVH * W,
                                       j / (H / KVH) * W, D, d->scale, pj, out);
                else /* (stride and offset in elements) */
                    attend_rows_any(qkv + b * QKV + j * D, QKV, k, v, list, lens + b,
                                    (int)(blk[i + 1] - b), KVH * D, j / (H / KVH) * D, D,
                                    d->scale, pj, S, out, H * D, d->kv_format == 2);
            }
        gemm_in_team(&ly->o, att, B, xs, x, 1, xq, dx);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            rms_norm_row(x + b * E, ly->ffn_norm, E, d->eps, d->norm_offset, h + b * E);
        gemm_in_team(&ly->gate_up, h, B, xs, gu, 0, xq, dx);
        if (ly->gate_up2.n) gemm_in_team(&ly->gate_up2, h, B, xs, gu + ly->gate_up.n, 0, xq, dx);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < B * NC; i++) { /* (16 values of a row at a time) */
            const int64_t b = i / NC, c = i % NC * 16, n = F - c < 16 ? F - c : 16;
            silu_gate_row(gu + b * 2 * F + c, gu + b * 2 * F + F + c, n, act + b * F + c);
        }
        gemm_in_team(&ly->down, act, B, xs, x, 1, xq, dx);
    }
}

/* R rows of one sequence and query head over a float32 (or, half, float16) cache as
   decode_stack's attention tasks take them: at once (attend_rows_any), or (one_by_one) as a
   decode row alone (attend_head_any) (for tests) */
void attend_rows_f32(const float *q, int64_t qs, const void *kc, const void *vc,
                     const int64_t *sl, const int64_t *n, int64_t R, int64_t stride, int64_t off,
                     int64_t D, float scale, float *p, int64_t ps, float *out, int64_t os, int half,
                     int one_by_one) {
    if (!one_by_one) {
        attend_rows_any(q, qs, kc, vc, sl, n, (int)R, stride, off, D, scale, p, ps, out, os, half);
        return;
    }
    for (int64_t r = 0; r < R; r++)
        attend_head_any(q + r * qs, kc, vc, sl, n[r], stride, off, D, scale, p + r * ps,
                        out + r * os, half);
}

/* rows of n floats -> their Q8_0 blocks, as decode_stack writes them (for tests) */
void q8_0_rows(const float *x, int64_t rows, int64_t n, uint8_t *out) {
    for (int64_t r = 0; r < rows; r++) q8_0_row(x + r * n, n, out + r * (n / 32) * 34);
}
