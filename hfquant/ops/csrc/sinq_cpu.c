/* SINQ's Sinkhorn balancing (hfquant.core.sinq.balance) in C: one streaming read of the weight per iteration, where
 * torch's batched products read it about twenty times (plus a stacked copy, a transposed copy and the squares).
 *
 * Input: `count` matrices (rows[m], K) stacked along their rows (q/k/v or gate/up: the consumers of one input), each
 * contiguous bfloat16 (is_bf16 = 1) or float32 (rounded to bfloat16, the statistics' precision of
 * hfquant.core.sinq), with optional row factors row_scales[m] (rows[m],) float32 (NULL: none) by which its rows are
 * multiplied first. N = the sum of rows[m] >= 2. Each tile t of `group` columns is balanced on its own: with X the
 * tile (N, group) and the iterate diag(ir) X diag(ic), ir starting at the row factors and ic at 1,
 *   row_std[n] = std_j(X[n, j] * ic[j]) * ir[n]                     (sample standard deviation, from sum and squares)
 *   for step = 0 .. iterations:
 *     col_std[j] = std_n(ir[n] * X[n, j]) * ic[j]
 *     score = max(all stds) / max(min(non-zero stds), FLT_MIN); keep ic when it is the lowest score so far (step 0
 *             always); stop after step == iterations
 *     ic /= relative(col_std); row_std[n] = std_j(X[n, j] * ic[j]) * ir[n]; f = relative(row_std); ir /= f;
 *     row_std /= f
 * where relative(s) = min(s / min(non-zero s), 1e3), and 1 where s is 0 (hfquant.core.sinq's steps).
 *
 * One pass per step: the row statistics of step s and the column statistics of step s + 1 come from the same read of a
 * row. The new row factor ir[n] / f[n] = ir[n] * floor / row_std[n] needs the tile's floor (the smallest non-zero
 * row_std), known only at the end of the pass, so the columns sum ir[n] / row_std[n] * X[n, j] and are multiplied by
 * floor afterwards; the rare rows whose factor is not row_std / floor (row_std 0, or a ratio clamped at 1e3) are read
 * again and corrected. Sums are float32 over blocks of COL_BLOCK rows, then double; torch's bfloat16 products round
 * every sum to bfloat16 instead, so the scales agree with a float64 reference of the same steps more closely than
 * torch's (tests/ops/test_sinq_balance.py).
 *
 * Output: inv_col (K,) float32, the kept ic of every tile; hfquant.core.sinq.scale_from_balance makes the stored column
 * scale of it. Returns 0; 1 for bad arguments; 2 when an input value is NaN or infinite; 3 when memory runs out.
 * Blocks of rows are split over OpenMP threads, and every sum is made in the same order whatever their number: the
 * result does not depend on the thread count. Memory: 3 floats per row and tile, 2 per column and block of rows, one
 * row per thread. The hot loop is compiled for AVX-512, AVX2 and the baseline, picked at load time (GCC's
 * target_clones), whose float32 results can differ in the last bits.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define HFQ_CLONES /* GCC on x86-64 Linux: one copy of the hot loop per instruction set, picked at load time */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__clang__)
#undef HFQ_CLONES
#define HFQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

#define PREFETCH_ROWS 2 /* block_pass asks for the row this many ahead */
#define COL_BLOCK 256    /* rows whose column sums are made in float32 before the double totals take them */
#define RATIO_LIMIT 1e3f /* relative(): the largest factor */

typedef struct {
    int64_t n, k, group, tiles;
    int is_bf16;
    const char **row; /* (N,) the start of every stacked row */
    float *ir;        /* (N, tiles) row factors of the iterate */
    float *rs;        /* (N, tiles) this pass's row standard deviations, std_j(X * ic) * ir */
    float *row_std;   /* (N, tiles) the iterate's row standard deviations */
    float *part;      /* (blocks, 2, K) float32 column sums of each block of rows: values, squares */
    float *ic;        /* (K,) column factors of the iterate */
} State;

/* row n of the stack as float32 (bfloat16 values) into x; returns 1 if a value is not finite */
static inline __attribute__((always_inline)) int load_row(const State *st, int64_t n, float *x) {
    int bad = 0;
    if (st->is_bf16) {
        const uint16_t *src = (const uint16_t *)st->row[n];
#pragma omp simd reduction(| : bad)
        for (int64_t j = 0; j < st->k; j++) {
            const uint16_t v = src[j];
            bad |= (v & 0x7F80) == 0x7F80;
            x[j] = bf16_to_float(v);
        }
    } else {
        const float *src = (const float *)st->row[n];
        for (int64_t j = 0; j < st->k; j++) {
            bad |= !(fabsf(src[j]) <= FLT_MAX);
            x[j] = bf16_to_float(float_to_bf16(src[j]));
        }
    }
    return bad;
}

/* One pass over the rows [start, stop) of a block: the row statistics under ic into st->rs, and the block's column
 * sums of b * X into `part` (2, K), b = ir / rs when `first` is 0 (the floor comes later), else ir. */
HFQ_CLONES static int block_pass(const State *st, int64_t start, int64_t stop, int first, float *part, float *x,
                                 float *b) {
    const int64_t k = st->k, g = st->group, tiles = st->tiles;
    const float inv_g = 1.0f / (float)g, inv_g1 = 1.0f / (float)(g > 1 ? g - 1 : 1);
    float *cs = part, *cq = part + k;
    int bad = 0;
    memset(part, 0, (size_t)(2 * k) * sizeof(float));
    const int64_t row_bytes = k * (st->is_bf16 ? 2 : 4);
    for (int64_t n = start; n < stop; n++) {
        if (n + PREFETCH_ROWS < st->n) { /* a row is often a page: the hardware prefetchers stop at its end */
            const char *ahead = st->row[n + PREFETCH_ROWS];
            for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + byte);
        }
        if (first) bad |= load_row(st, n, x);
        else load_row(st, n, x);
        const float *ir = st->ir + n * tiles;
        float *rs = st->rs + n * tiles;
        for (int64_t t = 0; t < tiles; t++) {
            const float *xt = x + t * g, *ict = st->ic + t * g;
            float s = 0.0f, q = 0.0f;
#pragma omp simd reduction(+ : s, q)
            for (int64_t j = 0; j < g; j++) {
                const float v = xt[j] * ict[j];
                s += v;
                q += v * v;
            }
            float var = (q - s * s * inv_g) * inv_g1;
            const float std = sqrtf(var > 0.0f ? var : 0.0f) * ir[t];
            rs[t] = std;
            b[t] = first ? ir[t] : (std > 0.0f ? ir[t] / std : 0.0f);
        }
        for (int64_t t = 0; t < tiles; t++) {
            const float a = b[t];
            const float *xt = x + t * g;
            float *cst = cs + t * g, *cqt = cq + t * g;
#pragma omp simd
            for (int64_t j = 0; j < g; j++) {
                const float v = xt[j] * a;
                cst[j] += v;
                cqt[j] += v * v;
            }
        }
    }
    return bad;
}

static float std_of(double total, double squares, int64_t count) {
    double var = squares - total * total / (double)count;
    var = var > 0.0 ? var : 0.0;
    return (float)sqrt(var / (double)(count > 1 ? count - 1 : 1));
}

/* largest over smallest non-zero standard deviation of tile t's columns and rows */
static float imbalance(const State *st, const float *col_std, int64_t t) {
    float hi = 0.0f, lo = INFINITY;
    for (int64_t j = 0; j < st->group; j++) {
        const float s = col_std[t * st->group + j];
        hi = s > hi ? s : hi;
        if (s > 0.0f && s < lo) lo = s;
    }
    for (int64_t n = 0; n < st->n; n++) {
        const float s = st->row_std[n * st->tiles + t];
        hi = s > hi ? s : hi;
        if (s > 0.0f && s < lo) lo = s;
    }
    return hi / (lo > FLT_MIN ? lo : FLT_MIN);
}

/* After a pass (not the first): tile t's floor, the new row factors and standard deviations, and the column sums
 * (cs, cq: the tile's `group` doubles, holding the sums of b * X) turned into those of the new iterate, the
 * exceptional rows read again into x. */
static void finish_rows(State *st, int64_t t, double *cs, double *cq, float *x) {
    const int64_t tiles = st->tiles, g = st->group;
    float floor = INFINITY;
    for (int64_t n = 0; n < st->n; n++) {
        const float s = st->rs[n * tiles + t];
        if (s > 0.0f && s < floor) floor = s;
    }
    const double mult = isinf(floor) ? 0.0 : (double)floor;
    for (int64_t j = 0; j < g; j++) {
        cs[j] *= mult;
        cq[j] *= mult * mult;
    }
    for (int64_t n = 0; n < st->n; n++) {
        const int64_t at = n * tiles + t;
        const float s = st->rs[at], ir = st->ir[at];
        float factor = 1.0f;
        if (s > 0.0f) {
            const float ratio = s / floor;
            factor = ratio > RATIO_LIMIT ? RATIO_LIMIT : ratio;
        }
        const float used = s > 0.0f ? ir / s : 0.0f; /* the b of the pass */
        st->ir[at] = ir / factor;
        st->row_std[at] = s / factor;
        const double a = (double)st->ir[at], a_used = mult * (double)used;
        if (s > 0.0f && !(s / floor > RATIO_LIMIT)) continue; /* the pass summed this row as it should */
        load_row(st, n, x);
        for (int64_t j = 0; j < g; j++) {
            const double v = (double)x[t * g + j];
            cs[j] += (a - a_used) * v;
            cq[j] += (a * v) * (a * v) - (a_used * v) * (a_used * v);
        }
    }
}

static int run(State *st, int64_t iterations, float *best_ic, float *best, double *cs, double *cq, float *col_std) {
    const int64_t n = st->n, k = st->k, g = st->group, tiles = st->tiles;
    const int64_t blocks = (n + COL_BLOCK - 1) / COL_BLOCK;
    int bad = 0, oom = 0;
    for (int64_t step = 0; step <= iterations; step++) {
        const int first = step == 0;
#pragma omp parallel reduction(| : bad, oom)
        {
            float *x = malloc((size_t)(k + tiles) * sizeof(float));
            if (!x) oom = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t blk = 0; blk < blocks; blk++) {
                if (!x) continue;
                const int64_t start = blk * COL_BLOCK, stop = start + COL_BLOCK < n ? start + COL_BLOCK : n;
                bad |= block_pass(st, start, stop, first, st->part + blk * 2 * k, x, x + k);
            }
            free(x);
        }
        if (oom) return 3;
        if (bad) return 2;
        /* the column totals, block by block in order */
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < k; j++) {
            double s = 0.0, q = 0.0;
            for (int64_t blk = 0; blk < blocks; blk++) {
                s += st->part[blk * 2 * k + j];
                q += st->part[blk * 2 * k + k + j];
            }
            cs[j] = s;
            cq[j] = q;
        }
#pragma omp parallel reduction(| : oom)
        {
            float *x = first ? NULL : malloc((size_t)k * sizeof(float));
            if (!first && !x) oom = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tiles; t++) {
                if (first) {
                    for (int64_t r = 0; r < n; r++) st->row_std[r * tiles + t] = st->rs[r * tiles + t];
                } else if (x) {
                    finish_rows(st, t, cs + t * g, cq + t * g, x);
                } else {
                    continue;
                }
                for (int64_t j = t * g; j < (t + 1) * g; j++) col_std[j] = std_of(cs[j], cq[j], n) * st->ic[j];
                const float score = imbalance(st, col_std, t);
                if (first || score < best[t]) {
                    best[t] = score;
                    memcpy(best_ic + t * g, st->ic + t * g, (size_t)g * sizeof(float));
                }
                if (step == iterations) continue;
                /* ic /= relative(col_std) */
                float floor = INFINITY;
                for (int64_t j = t * g; j < (t + 1) * g; j++)
                    if (col_std[j] > 0.0f && col_std[j] < floor) floor = col_std[j];
                for (int64_t j = t * g; j < (t + 1) * g; j++) {
                    if (col_std[j] > 0.0f) {
                        const float ratio = col_std[j] / floor;
                        st->ic[j] /= ratio > RATIO_LIMIT ? RATIO_LIMIT : ratio;
                    }
                }
            }
            free(x);
        }
        if (oom) return 3;
    }
    return 0;
}

int hfquant_sinq_balance(const void *const *mats, const int64_t *rows, const float *const *row_scales, int64_t count,
                         int is_bf16, int64_t k, int64_t group, int64_t iterations, float *inv_col) {
    if (!mats || !rows || !inv_col || count <= 0 || k <= 0 || group <= 0 || k % group || iterations < 0) return 1;
    int64_t n = 0;
    for (int64_t m = 0; m < count; m++) {
        if (rows[m] < 0 || (rows[m] > 0 && !mats[m])) return 1;
        n += rows[m];
    }
    if (n < 2) return 1;
    State st = {.n = n, .k = k, .group = group, .tiles = k / group, .is_bf16 = is_bf16};
    const int64_t tiles = st.tiles, blocks = (n + COL_BLOCK - 1) / COL_BLOCK;
    st.row = malloc((size_t)n * sizeof(*st.row));
    st.ir = malloc((size_t)(3 * n * tiles) * sizeof(float));
    st.part = malloc((size_t)(blocks * 2 * k) * sizeof(float));
    st.ic = malloc((size_t)(3 * k + tiles) * sizeof(float));
    double *sums = malloc((size_t)(2 * k) * sizeof(double));
    int status = 3;
    if (st.row && st.ir && st.part && st.ic && sums) {
        st.rs = st.ir + n * tiles;
        st.row_std = st.rs + n * tiles;
        float *col_std = st.ic + k, *best = col_std + k;
        const size_t size = is_bf16 ? sizeof(uint16_t) : sizeof(float);
        int64_t r = 0;
        for (int64_t m = 0; m < count; m++) {
            for (int64_t i = 0; i < rows[m]; i++, r++) {
                st.row[r] = (const char *)mats[m] + (size_t)(i * k) * size;
                const float factor = row_scales && row_scales[m] ? row_scales[m][i] : 1.0f;
                for (int64_t t = 0; t < tiles; t++) st.ir[r * tiles + t] = factor;
            }
        }
        for (int64_t j = 0; j < k; j++) st.ic[j] = 1.0f;
        status = run(&st, iterations, inv_col, best, sums, sums + k, col_std);
    }
    free(st.row);
    free(st.ir);
    free(st.part);
    free(st.ic);
    free(sums);
    return status;
}
