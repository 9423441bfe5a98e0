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
 * Above WHOLE_ROWS columns, they are balanced in strips of at most STRIP_COLUMNS, one after the other (each tile is
 * balanced on its own, so the result is the same; at K = 8192 the column sums of a strip stay in L1). Blocks of rows
 * are split over OpenMP threads (`threads`, 0 for OpenMP's default), and every sum is made in the same order whatever
 * their number: the result does not depend on the thread count. Memory: 3 floats per row and tile of a strip, 2 per
 * column of a strip and block of rows, two rows per thread. With AVX-512F and a group that is a multiple of 16 (every
 * group hfquant allows), the pass is block_pass_avx512: rows in groups of four whose column sums are added together
 * (cs and cq read and written once per group), each row's tile sums reduced 16 (or 8) tiles at a time by a transposing
 * reduction and their square roots taken in one vector (one horizontal sum and one scalar square root per row and
 * tile cost about as much as the read: docs/performance.md), a later row's cache lines asked for along the way, and
 * NaN or Inf found from the first pass's sums (a row read again only where they are not finite). With AVX2, FMA and
 * F16C but not AVX-512 (or HFQUANT_ISA=avx2) it is block_pass_avx2: the same operations in the same order with 8-lane
 * vectors (each 16-lane accumulator kept as two), so the same float32 results; on a Zen 3 it took 0.40-0.56 of
 * block_pass's time (docs/performance.md, seventeenth session). Elsewhere (HFQUANT_ISA=generic, -DSINQ_FORCE_GENERIC)
 * block_pass, its hot loop compiled for AVX2 and the baseline, picked at load time (GCC's target_clones): its float32
 * results can differ from the others' in the last bits (its sums' order is the compiler's vectorization). After each
 * pass the per-row factors and statistics (N, tiles) are updated row by row, in their memory order.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

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
#define STRIP_COLUMNS 2048 /* hfquant_sinq_balance: the widest strip of columns balanced together ... */
#define WHOLE_ROWS 4096    /* ... where K is above this many columns */

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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HFQ_AVX512 1
#define AVX512_TARGET __attribute__((target("avx512f")))
#define ROW_GROUP 4 /* rows whose column sums are added together: cs and cq are read and written once per group */

/* lane i of the result: the sum of the 16 lanes of v[i] (a transposing reduction: 30 shuffles and 15 additions for 16
 * tiles, where one horizontal sum per tile costs 8 shuffles and 8 additions and a chain of their latencies) */
AVX512_TARGET static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], c[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i] v[2i+1] v[2i] v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: v[4i] .. v[4i + 3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

/* sum16 of v[0 .. 7] (v[8 .. 15] taken as zeros) in lanes 0 .. 7 with the same additions: the upper lanes repeat
 * them. Half of sum16's shuffles for a row of at most 8 tiles (K = 2048 at the tile of 256). */
AVX512_TARGET static inline __m512 sum8(const __m512 *v) {
    __m512 a[4], c[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d0, 0x88), _mm512_shuffle_f32x4(d0, d0, 0xDD));
}

AVX512_TARGET static inline __m512i load_bf16_bits(const uint16_t *src) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
}

AVX512_TARGET static inline __m512 widen(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }

/* 1 if a bfloat16 value of src (count,) is NaN or infinite (its exponent bits all set) */
static int bf16_not_finite(const uint16_t *src, int64_t count) {
    int bad = 0;
    for (int64_t j = 0; j < count; j++) bad |= (src[j] & 0x7F80) == 0x7F80;
    return bad;
}

/* The row statistics of one bfloat16 row `src` (K,) under ic into rs (tiles,) and its column weights into b (tiles,):
 * 16 tiles at a time, their sums reduced together and their square roots taken in one vector. `ahead` (NULL: none)
 * is a later row of `ahead_size` bytes per value, one cache line of it asked for per 32 values read, so that the
 * memory stays busy all along the row (a burst of a row's prefetches at its start stalled on the full miss queue).
 * Returns 1 if `check` and a value is not finite: a NaN or infinity makes its tile's sum (and sum of squares) NaN or
 * infinite, so only a row whose sums are not finite is read again value by value (a sum of finite squares that
 * overflows is not an error). */
AVX512_TARGET static int row_stats_avx512(const State *st, const uint16_t *src, const char *ahead, int64_t ahead_size,
                                          const float *ir, float *rs, float *b, int first, int check) {
    const int64_t g = st->group, tiles = st->tiles;
    const __m512 inv_g = _mm512_set1_ps(1.0f / (float)g), inv_g1 = _mm512_set1_ps(1.0f / (float)(g > 1 ? g - 1 : 1));
    const __m512 zero = _mm512_setzero_ps(), infinity = _mm512_set1_ps(INFINITY);
    __mmask16 odd = 0;
    __m512 s[16], q[16];
    for (int64_t t0 = 0; t0 < tiles; t0 += 16) {
        const int count = tiles - t0 < 16 ? (int)(tiles - t0) : 16, width = count <= 8 ? 8 : 16;
        for (int i = 0; i < width; i++) {
            if (i >= count) {
                s[i] = q[i] = zero;
                continue;
            }
            const uint16_t *xt = src + (t0 + i) * g;
            const float *ict = st->ic + (t0 + i) * g;
            const char *pre = ahead ? ahead + (t0 + i) * g * ahead_size : NULL;
            __m512 s0 = zero, s1 = zero, q0 = zero, q1 = zero;
            int64_t j = 0;
            for (; j + 32 <= g; j += 32) {
                if (pre) {
                    _mm_prefetch(pre + j * ahead_size, _MM_HINT_T0);
                    if (ahead_size > 2) _mm_prefetch(pre + j * ahead_size + 64, _MM_HINT_T0);
                }
                const __m512 y0 = _mm512_mul_ps(widen(load_bf16_bits(xt + j)), _mm512_loadu_ps(ict + j));
                const __m512 y1 = _mm512_mul_ps(widen(load_bf16_bits(xt + j + 16)), _mm512_loadu_ps(ict + j + 16));
                s0 = _mm512_add_ps(s0, y0);
                s1 = _mm512_add_ps(s1, y1);
                q0 = _mm512_fmadd_ps(y0, y0, q0);
                q1 = _mm512_fmadd_ps(y1, y1, q1);
            }
            if (j < g) { /* g % 32 == 16 */
                if (pre) _mm_prefetch(pre + j * ahead_size, _MM_HINT_T0);
                const __m512 y0 = _mm512_mul_ps(widen(load_bf16_bits(xt + j)), _mm512_loadu_ps(ict + j));
                s0 = _mm512_add_ps(s0, y0);
                q0 = _mm512_fmadd_ps(y0, y0, q0);
            }
            s[i] = _mm512_add_ps(s0, s1);
            q[i] = _mm512_add_ps(q0, q1);
        }
        const __m512 sum = width == 8 ? sum8(s) : sum16(s), squares = width == 8 ? sum8(q) : sum16(q);
        const __mmask16 live = (__mmask16)((1u << count) - 1u);
        if (check) /* |sum| or squares not below infinity: NaN or infinite */
            odd |= _mm512_mask_cmp_ps_mask(live, _mm512_abs_ps(sum), infinity, _CMP_NLT_UQ) |
                   _mm512_mask_cmp_ps_mask(live, squares, infinity, _CMP_NLT_UQ);
        const __m512 irv = _mm512_maskz_loadu_ps(live, ir + t0);
        __m512 var = _mm512_mul_ps(_mm512_fnmadd_ps(_mm512_mul_ps(sum, sum), inv_g, squares), inv_g1);
        var = _mm512_max_ps(var, zero);
        const __m512 std = _mm512_mul_ps(_mm512_sqrt_ps(var), irv);
        _mm512_mask_storeu_ps(rs + t0, live, std);
        /* ir / std where std > 0, else 0 */
        const __mmask16 positive = _mm512_cmp_ps_mask(std, zero, _CMP_GT_OQ);
        const __m512 weight = first ? irv : _mm512_maskz_div_ps(positive, irv, std);
        _mm512_mask_storeu_ps(b + t0, live, weight);
    }
    return odd != 0 && bf16_not_finite(src, st->k);
}

/* cs += sum_r b_r * X_r, cq += sum_r (b_r * X_r)^2 over R rows (src[r], weights b + r * tiles), each sum in row order */
AVX512_TARGET static inline __attribute__((always_inline)) void add_columns_avx512(
    const State *st, const uint16_t *const *src, const float *b, int rows, float *cs, float *cq) {
    const int64_t g = st->group, tiles = st->tiles;
    for (int64_t t = 0; t < tiles; t++) {
        __m512 a[ROW_GROUP];
        for (int r = 0; r < rows; r++) a[r] = _mm512_set1_ps(b[r * tiles + t]);
        for (int64_t j = t * g; j < (t + 1) * g; j += 16) {
            __m512 sv = _mm512_loadu_ps(cs + j), qv = _mm512_loadu_ps(cq + j);
            for (int r = 0; r < rows; r++) {
                const __m512 v = _mm512_mul_ps(widen(load_bf16_bits(src[r] + j)), a[r]);
                sv = _mm512_add_ps(sv, v);
                qv = _mm512_fmadd_ps(v, v, qv);
            }
            _mm512_storeu_ps(cs + j, sv);
            _mm512_storeu_ps(cq + j, qv);
        }
    }
}

/* Row n of the stack as bfloat16 bits for the vector passes: the row itself (bfloat16 input), else its float32 values
 * rounded into `to` (K), a non-finite one flagged in *bad on the first pass. Inlined into each pass, so compiled for
 * its instruction set. */
static inline __attribute__((always_inline)) const uint16_t *bf16_row(const State *st, int64_t n, int first,
                                                                        uint16_t *to, int *bad) {
    if (st->is_bf16) return (const uint16_t *)st->row[n];
    const float *from = (const float *)st->row[n];
    int row_bad = 0;
    for (int64_t j = 0; j < st->k; j++) {
        row_bad |= !(fabsf(from[j]) <= FLT_MAX);
        to[j] = float_to_bf16(from[j]);
    }
    if (first) *bad |= row_bad;
    return to;
}

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline __m256 widen8(const uint16_t *src) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

/* sum16 with 8-lane vectors: lane i of the result the sum of tile i's 16 lanes, lo[i] its lanes 0 .. 7 and hi[i] its
 * lanes 8 .. 15, for 8 tiles. sum16 adds, per tile, (W0 + W1) + (W2 + W3) with W_L = (x[4L] + x[4L + 2]) +
 * (x[4L + 1] + x[4L + 3]) over its 128-bit lanes L; the same additions here (W0, W1 from lo, W2, W3 from hi), so
 * every tile's sum is sum16's bits (and sum8's: the tiles' lanes do not mix). */
AVX2_TARGET static inline __m256 sum16_avx2(const __m256 *lo, const __m256 *hi) {
    __m256 a[4], c[2][2];
    for (int h = 0; h < 2; h++) {
        const __m256 *v = h ? hi : lo;
        for (int i = 0; i < 4; i++) { /* per 128-bit lane: v[2i] v[2i+1] v[2i] v[2i+1] */
            const __m256 x = v[2 * i], y = v[2 * i + 1];
            a[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
        }
        for (int i = 0; i < 2; i++) { /* per 128-bit lane: W_L of tiles 4i .. 4i + 3 */
            const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
            c[h][i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                                    _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
        }
    }
    /* W0 + W1 (lo) and W2 + W3 (hi) of tiles 0 .. 3 | 4 .. 7, then their sum */
    const __m256 d0 = _mm256_add_ps(_mm256_permute2f128_ps(c[0][0], c[0][1], 0x20),
                                    _mm256_permute2f128_ps(c[0][0], c[0][1], 0x31));
    const __m256 d1 = _mm256_add_ps(_mm256_permute2f128_ps(c[1][0], c[1][1], 0x20),
                                    _mm256_permute2f128_ps(c[1][0], c[1][1], 0x31));
    return _mm256_add_ps(d0, d1);
}

/* row_stats_avx512 with 8-lane vectors, 8 tiles at a time: each 16-lane accumulator of it kept as two (lanes 0 .. 7
 * and 8 .. 15), so every lane adds the same products in the same order, and sum16_avx2 reduces them as sum16 does:
 * the same rs and b bits. */
AVX2_TARGET static int row_stats_avx2(const State *st, const uint16_t *src, const char *ahead, int64_t ahead_size,
                                      const float *ir, float *rs, float *b, int first, int check) {
    const int64_t g = st->group, tiles = st->tiles;
    const __m256 inv_g = _mm256_set1_ps(1.0f / (float)g), inv_g1 = _mm256_set1_ps(1.0f / (float)(g > 1 ? g - 1 : 1));
    const __m256 zero = _mm256_setzero_ps(), infinity = _mm256_set1_ps(INFINITY);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int odd = 0;
    __m256 s_lo[8], s_hi[8], q_lo[8], q_hi[8];
    for (int64_t t0 = 0; t0 < tiles; t0 += 8) {
        const int count = tiles - t0 < 8 ? (int)(tiles - t0) : 8;
        for (int i = 0; i < 8; i++) {
            if (i >= count) {
                s_lo[i] = s_hi[i] = q_lo[i] = q_hi[i] = zero;
                continue;
            }
            const uint16_t *xt = src + (t0 + i) * g;
            const float *ict = st->ic + (t0 + i) * g;
            const char *pre = ahead ? ahead + (t0 + i) * g * ahead_size : NULL;
            /* s0 and s1 of row_stats_avx512, each as lanes 0 .. 7 (a) and 8 .. 15 (b) */
            __m256 s0a = zero, s0b = zero, s1a = zero, s1b = zero, q0a = zero, q0b = zero, q1a = zero, q1b = zero;
            int64_t j = 0;
            for (; j + 32 <= g; j += 32) {
                if (pre) {
                    _mm_prefetch(pre + j * ahead_size, _MM_HINT_T0);
                    if (ahead_size > 2) _mm_prefetch(pre + j * ahead_size + 64, _MM_HINT_T0);
                }
                const __m256 y0a = _mm256_mul_ps(widen8(xt + j), _mm256_loadu_ps(ict + j));
                const __m256 y0b = _mm256_mul_ps(widen8(xt + j + 8), _mm256_loadu_ps(ict + j + 8));
                const __m256 y1a = _mm256_mul_ps(widen8(xt + j + 16), _mm256_loadu_ps(ict + j + 16));
                const __m256 y1b = _mm256_mul_ps(widen8(xt + j + 24), _mm256_loadu_ps(ict + j + 24));
                s0a = _mm256_add_ps(s0a, y0a);
                s0b = _mm256_add_ps(s0b, y0b);
                s1a = _mm256_add_ps(s1a, y1a);
                s1b = _mm256_add_ps(s1b, y1b);
                q0a = _mm256_fmadd_ps(y0a, y0a, q0a);
                q0b = _mm256_fmadd_ps(y0b, y0b, q0b);
                q1a = _mm256_fmadd_ps(y1a, y1a, q1a);
                q1b = _mm256_fmadd_ps(y1b, y1b, q1b);
            }
            if (j < g) { /* g % 32 == 16 */
                if (pre) _mm_prefetch(pre + j * ahead_size, _MM_HINT_T0);
                const __m256 y0a = _mm256_mul_ps(widen8(xt + j), _mm256_loadu_ps(ict + j));
                const __m256 y0b = _mm256_mul_ps(widen8(xt + j + 8), _mm256_loadu_ps(ict + j + 8));
                s0a = _mm256_add_ps(s0a, y0a);
                s0b = _mm256_add_ps(s0b, y0b);
                q0a = _mm256_fmadd_ps(y0a, y0a, q0a);
                q0b = _mm256_fmadd_ps(y0b, y0b, q0b);
            }
            s_lo[i] = _mm256_add_ps(s0a, s1a);
            s_hi[i] = _mm256_add_ps(s0b, s1b);
            q_lo[i] = _mm256_add_ps(q0a, q1a);
            q_hi[i] = _mm256_add_ps(q0b, q1b);
        }
        const __m256 sum = sum16_avx2(s_lo, s_hi), squares = sum16_avx2(q_lo, q_hi);
        const int live = (1 << count) - 1;
        if (check) /* |sum| or squares not below infinity: NaN or infinite */
            odd |= live & _mm256_movemask_ps(_mm256_or_ps(
                              _mm256_cmp_ps(_mm256_and_ps(sum, magnitude), infinity, _CMP_NLT_UQ),
                              _mm256_cmp_ps(squares, infinity, _CMP_NLT_UQ)));
        float irs[8] = {0}, out[8];
        memcpy(irs, ir + t0, (size_t)count * sizeof(float));
        const __m256 irv = _mm256_loadu_ps(irs);
        __m256 var = _mm256_mul_ps(_mm256_fnmadd_ps(_mm256_mul_ps(sum, sum), inv_g, squares), inv_g1);
        var = _mm256_max_ps(var, zero);
        const __m256 std = _mm256_mul_ps(_mm256_sqrt_ps(var), irv);
        _mm256_storeu_ps(out, std);
        memcpy(rs + t0, out, (size_t)count * sizeof(float));
        /* ir / std where std > 0, else 0 */
        const __m256 positive = _mm256_cmp_ps(std, zero, _CMP_GT_OQ);
        const __m256 weight = first ? irv : _mm256_and_ps(_mm256_div_ps(irv, std), positive);
        _mm256_storeu_ps(out, weight);
        memcpy(b + t0, out, (size_t)count * sizeof(float));
    }
    return odd != 0 && bf16_not_finite(src, st->k);
}

/* add_columns_avx512 with 8-lane vectors: the same sums lane by lane */
AVX2_TARGET static inline __attribute__((always_inline)) void add_columns_avx2(const State *st,
                                                                              const uint16_t *const *src,
                                                                              const float *b, int rows, float *cs,
                                                                              float *cq) {
    const int64_t g = st->group, tiles = st->tiles;
    for (int64_t t = 0; t < tiles; t++) {
        __m256 a[ROW_GROUP];
        for (int r = 0; r < rows; r++) a[r] = _mm256_set1_ps(b[r * tiles + t]);
        for (int64_t j = t * g; j < (t + 1) * g; j += 8) {
            __m256 sv = _mm256_loadu_ps(cs + j), qv = _mm256_loadu_ps(cq + j);
            for (int r = 0; r < rows; r++) {
                const __m256 v = _mm256_mul_ps(widen8(src[r] + j), a[r]);
                sv = _mm256_add_ps(sv, v);
                qv = _mm256_fmadd_ps(v, v, qv);
            }
            _mm256_storeu_ps(cs + j, sv);
            _mm256_storeu_ps(cq + j, qv);
        }
    }
}

/* block_pass for a group size that is a multiple of 16, rows in groups of ROW_GROUP, float32 rows rounded to bfloat16
 * into `conv` (ROW_GROUP * K) first: one text for both vector bodies, `block_pass_avx512` (AVX-512F) and
 * `block_pass_avx2` (AVX2 and FMA: 8-lane vectors for a CPU without AVX-512, or HFQUANT_ISA=avx2), each calling its
 * own row statistics and column sums; the same operations in the same order, so the same float32 results. A row is
 * often a page: the hardware prefetchers stop at its end, so the row statistics ask for the row ROW_GROUP ahead. */
#define BLOCK_PASS_VECTOR(TARGET, ISA)                                                                                 \
    TARGET static int block_pass_##ISA(const State *st, int64_t start, int64_t stop, int first, float *part,           \
                                       uint16_t *conv, float *b) {                                                     \
        const int64_t k = st->k, tiles = st->tiles;                                                                    \
        float *cs = part, *cq = part + k;                                                                              \
        int bad = 0;                                                                                                   \
        memset(part, 0, (size_t)(2 * k) * sizeof(float));                                                             \
        for (int64_t n0 = start; n0 < stop; n0 += ROW_GROUP) {                                                         \
            const int rows = stop - n0 < ROW_GROUP ? (int)(stop - n0) : ROW_GROUP;                                     \
            const uint16_t *src[ROW_GROUP];                                                                            \
            for (int r = 0; r < rows; r++) {                                                                           \
                const int64_t n = n0 + r;                                                                              \
                const char *ahead = n + ROW_GROUP < st->n ? st->row[n + ROW_GROUP] : NULL;                             \
                src[r] = bf16_row(st, n, first, conv + r * k, &bad);                                                   \
                bad |= row_stats_##ISA(st, src[r], ahead, st->is_bf16 ? 2 : 4, st->ir + n * tiles,                     \
                                       st->rs + n * tiles, b + r * tiles, first, first && st->is_bf16);                \
            }                                                                                                          \
            if (rows == ROW_GROUP) add_columns_##ISA(st, src, b, ROW_GROUP, cs, cq);                                   \
            else                                                                                                       \
                for (int r = 0; r < rows; r++) add_columns_##ISA(st, src + r, b + r * tiles, 1, cs, cq);               \
        }                                                                                                              \
        return bad;                                                                                                    \
    }

BLOCK_PASS_VECTOR(AVX512_TARGET, avx512)
BLOCK_PASS_VECTOR(AVX2_TARGET, avx2)
#endif

static float std_of(double total, double squares, int64_t count) {
    double var = squares - total * total / (double)count;
    var = var > 0.0 ? var : 0.0;
    return (float)sqrt(var / (double)(count > 1 ? count - 1 : 1));
}

/* One row's new factors of every tile: ir /= f and row_std = rs / f, f = relative(rs) against the tiles' floors
 * (1 where rs is 0), the factors before into old (tiles,); returns whether a tile's f is not rs / floor (rs 0, or the
 * ratio clamped), the rows finish_rows reads again. Divisions and selections only: every instruction set's copy gives
 * the same floats. */
static inline __attribute__((always_inline)) int row_factors(const float *restrict rs, const float *restrict floor,
                                                             int64_t tiles, float *restrict ir, float *restrict row_std,
                                                             float *restrict old) {
    int odd = 0;
#pragma omp simd reduction(| : odd)
    for (int64_t t = 0; t < tiles; t++) { /* branch-free: vectorized */
        const float s = rs[t], ratio = s / floor[t];
        const float factor = s > 0.0f ? (ratio > RATIO_LIMIT ? RATIO_LIMIT : ratio) : 1.0f;
        old[t] = ir[t];
        ir[t] = ir[t] / factor;
        row_std[t] = s / factor;
        odd |= !(s > 0.0f) | (ratio > RATIO_LIMIT);
    }
    return odd;
}

static void correct_row(const State *st, int64_t r, const float *floor, const float *old, double *cs, double *cq,
                        float *x);

/* row_factors of every row, in their order, and correct_row for the odd ones (`old`: tiles floats), in one call: the
 * instruction set is picked once per pass, not per row */
HFQ_CLONES static void all_row_factors(State *st, const float *floor, double *cs, double *cq, float *x, float *old) {
    const int64_t tiles = st->tiles;
    for (int64_t r = 0; r < st->n; r++) {
        const int64_t at = r * tiles;
        if (row_factors(st->rs + at, floor, tiles, st->ir + at, st->row_std + at, old))
            correct_row(st, r, floor, old, cs, cq, x); /* else the pass summed every tile as it should */
    }
}

/* floor (tiles,) = the smallest non-zero rs[r, t] of each tile over the rows r < n (kept where none is smaller) */
HFQ_CLONES static void tile_floor(const float *restrict rs, int64_t n, int64_t tiles, float *restrict floor) {
    for (int64_t r = 0; r < n; r++) { /* branch-free: vectorized over tiles */
        const float *row = rs + r * tiles;
        for (int64_t t = 0; t < tiles; t++) {
            const float s = row[t] > 0.0f ? row[t] : INFINITY;
            floor[t] = s < floor[t] ? s : floor[t];
        }
    }
}

/* hi, lo (tiles,) = the largest and the smallest non-zero row_std[r, t] of each tile over the rows r < n */
HFQ_CLONES static void tile_range(const float *restrict row_std, int64_t n, int64_t tiles, float *restrict hi,
                                  float *restrict lo) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = row_std + r * tiles;
        for (int64_t t = 0; t < tiles; t++) {
            const float s = row[t], positive = s > 0.0f ? s : INFINITY;
            hi[t] = s > hi[t] ? s : hi[t];
            lo[t] = positive < lo[t] ? positive : lo[t];
        }
    }
}

/* The column sums (cs, cq) of row r made those of its new factors ir (old: the factors of the pass) in the tiles
 * row_factors did not divide by rs / floor, the row read again into x (K,) */
static void correct_row(const State *st, int64_t r, const float *floor, const float *old, double *cs, double *cq,
                        float *x) {
    const int64_t tiles = st->tiles, g = st->group;
    const float *ir = st->ir + r * tiles, *rs = st->rs + r * tiles;
    load_row(st, r, x);
    for (int64_t t = 0; t < tiles; t++) {
        const float s = rs[t];
        if (s > 0.0f && !(s / floor[t] > RATIO_LIMIT)) continue;
        const double a = (double)ir[t], a_used = (isinf(floor[t]) ? 0.0 : (double)floor[t]) *
                                                 (double)(s > 0.0f ? old[t] / s : 0.0f); /* the pass's b */
        for (int64_t j = t * g; j < (t + 1) * g; j++) {
            const double v = (double)x[j];
            cs[j] += (a - a_used) * v;
            cq[j] += (a * v) * (a * v) - (a_used * v) * (a_used * v);
        }
    }
}

/* After a pass: the new row factors and standard deviations of every tile, row by row (the (N, tiles) arrays are read
 * in their order), and each tile's largest and smallest non-zero row standard deviation into hi and lo (tiles,). Not
 * the first pass: each tile's floor (the smallest non-zero rs) into `floor`, and the column sums (cs, cq: K doubles,
 * holding the sums of b * X) turned into those of the new iterate, the exceptional rows read again into x (K,), with
 * `old` (tiles,) holding a row's factors of the pass. */
static void finish_rows(State *st, int first, double *cs, double *cq, float *x, float *floor, float *hi, float *lo,
                        float *old) {
    const int64_t n = st->n, tiles = st->tiles, g = st->group;
    for (int64_t t = 0; t < tiles; t++) {
        floor[t] = lo[t] = INFINITY;
        hi[t] = 0.0f;
    }
    if (first) {
        memcpy(st->row_std, st->rs, (size_t)(n * tiles) * sizeof(float));
    } else {
        tile_floor(st->rs, n, tiles, floor);
        for (int64_t t = 0; t < tiles; t++) {
            const double mult = isinf(floor[t]) ? 0.0 : (double)floor[t];
            for (int64_t j = t * g; j < (t + 1) * g; j++) {
                cs[j] *= mult;
                cq[j] *= mult * mult;
            }
        }
        all_row_factors(st, floor, cs, cq, x, old);
    }
    tile_range(st->row_std, n, tiles, hi, lo);
}

static int run(State *st, int64_t iterations, int threads, float *best_ic, float *best, double *cs, double *cq,
               float *col_std) {
    const int64_t n = st->n, k = st->k, g = st->group, tiles = st->tiles;
    const int64_t blocks = (n + COL_BLOCK - 1) / COL_BLOCK;
    int bad = 0, oom = 0;
    float *again = malloc((size_t)(k + 4 * tiles) * sizeof(float)); /* finish_rows: a row read again; per tile stats */
    if (!again) return 3;
    float *floor = again + k, *hi = floor + tiles, *lo = hi + tiles, *old = lo + tiles;
    int wide = 0; /* set below, not in an else branch: a C file's first else directive starts its other-machine stubs */
#if defined(HFQ_AVX512) && !defined(SINQ_FORCE_GENERIC) /* build with -DSINQ_FORCE_GENERIC to check block_pass */
    /* isa_cpu.c: 2 block_pass_avx512, 1 block_pass_avx2 (no AVX-512, or HFQUANT_ISA=avx2), 0 block_pass */
    if (g % 16 == 0) wide = HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512) ? 2 : HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2) ? 1 : 0;
#endif
    for (int64_t step = 0; step <= iterations; step++) {
        const int first = step == 0;
#pragma omp parallel num_threads(threads) reduction(| : bad, oom)
        {
            /* block_pass: a float32 row and the tiles' weights; the others: ROW_GROUP bfloat16 rows and weights */
            float *x = malloc((size_t)(wide ? (k + 1) / 2 * ROW_GROUP + tiles * ROW_GROUP : k + tiles) * sizeof(float));
            if (!x) oom = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t blk = 0; blk < blocks; blk++) {
                if (!x) continue;
                const int64_t start = blk * COL_BLOCK, stop = start + COL_BLOCK < n ? start + COL_BLOCK : n;
                float *part = st->part + blk * 2 * k;
#ifdef HFQ_AVX512
                if (wide == 2) {
                    bad |= block_pass_avx512(st, start, stop, first, part, (uint16_t *)x,
                                             x + (k + 1) / 2 * ROW_GROUP);
                    continue;
                }
                if (wide == 1) {
                    bad |= block_pass_avx2(st, start, stop, first, part, (uint16_t *)x, x + (k + 1) / 2 * ROW_GROUP);
                    continue;
                }
#endif
                bad |= block_pass(st, start, stop, first, part, x, x + k);
            }
            free(x);
        }
        if (oom || bad) {
            free(again);
            return oom ? 3 : 2;
        }
        /* the column totals, block by block in order */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t j0 = 0; j0 < k; j0 += 256) {
            const int64_t j1 = j0 + 256 < k ? j0 + 256 : k;
            for (int64_t j = j0; j < j1; j++) cs[j] = cq[j] = 0.0;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const float *ps = st->part + blk * 2 * k, *pq = ps + k;
                for (int64_t j = j0; j < j1; j++) {
                    cs[j] += ps[j];
                    cq[j] += pq[j];
                }
            }
        }
        finish_rows(st, first, cs, cq, again, floor, hi, lo, old);
        for (int64_t t = 0; t < tiles; t++) {
            /* the score: largest over smallest non-zero standard deviation of the tile's columns and rows */
            float top = hi[t], bottom = lo[t];
            for (int64_t j = t * g; j < (t + 1) * g; j++) {
                col_std[j] = std_of(cs[j], cq[j], n) * st->ic[j];
                top = col_std[j] > top ? col_std[j] : top;
                if (col_std[j] > 0.0f && col_std[j] < bottom) bottom = col_std[j];
            }
            const float score = top / (bottom > FLT_MIN ? bottom : FLT_MIN);
            if (first || score < best[t]) {
                best[t] = score;
                memcpy(best_ic + t * g, st->ic + t * g, (size_t)g * sizeof(float));
            }
            if (step == iterations) continue;
            /* ic /= relative(col_std) */
            float least = INFINITY;
            for (int64_t j = t * g; j < (t + 1) * g; j++)
                if (col_std[j] > 0.0f && col_std[j] < least) least = col_std[j];
            for (int64_t j = t * g; j < (t + 1) * g; j++) {
                if (col_std[j] > 0.0f) {
                    const float ratio = col_std[j] / least;
                    st->ic[j] /= ratio > RATIO_LIMIT ? RATIO_LIMIT : ratio;
                }
            }
        }
    }
    free(again);
    return 0;
}

int hfquant_sinq_balance(const void *const *mats, const int64_t *rows, const float *const *row_scales, int64_t count,
                         int is_bf16, int64_t k, int64_t group, int64_t iterations, int64_t threads, float *inv_col) {
    if (!mats || !rows || !inv_col || count <= 0 || k <= 0 || group <= 0 || k % group || iterations < 0 || threads < 0)
        return 1;
    int team = 1;
#ifdef _OPENMP
    team = threads > 0 ? (int)threads : omp_get_max_threads();
#endif
    int64_t n = 0;
    for (int64_t m = 0; m < count; m++) {
        if (rows[m] < 0 || (rows[m] > 0 && !mats[m])) return 1;
        n += rows[m];
    }
    if (n < 2) return 1;
    /* above WHOLE_ROWS columns, strips of at most STRIP_COLUMNS balanced one after the other: every tile is balanced on
     * its own, so the result is the same, and a strip's passes read rows a quarter as wide at K = 8192 (the column sums
     * stay in L1). At K = 4096 whole rows were faster: the 7.4B's gate/up (28672 x 4096, read from memory) 65 ms per
     * balance at one thread against 79 in strips of 2048 (docs/performance.md, issue #32, sixteenth session) */
    const int64_t strip = k <= WHOLE_ROWS ? k : (STRIP_COLUMNS >= group ? STRIP_COLUMNS / group * group : group);
    State st = {.n = n, .k = strip, .group = group, .tiles = strip / group, .is_bf16 = is_bf16};
    const int64_t tiles = st.tiles, blocks = (n + COL_BLOCK - 1) / COL_BLOCK;
    st.row = malloc((size_t)n * sizeof(*st.row));
    st.ir = malloc((size_t)(3 * n * tiles) * sizeof(float));
    st.part = malloc((size_t)(blocks * 2 * strip) * sizeof(float));
    st.ic = malloc((size_t)(3 * strip + tiles) * sizeof(float));
    double *sums = malloc((size_t)(2 * strip) * sizeof(double));
    int status = 3;
    if (st.row && st.ir && st.part && st.ic && sums) {
        st.rs = st.ir + n * tiles;
        st.row_std = st.rs + n * tiles;
        float *col_std = st.ic + strip, *best = col_std + strip;
        const size_t size = is_bf16 ? sizeof(uint16_t) : sizeof(float);
        status = 0;
        for (int64_t col0 = 0; col0 < k && status == 0; col0 += strip) {
            st.k = k - col0 < strip ? k - col0 : strip;
            st.tiles = st.k / group;
            int64_t r = 0;
            for (int64_t m = 0; m < count; m++) {
                for (int64_t i = 0; i < rows[m]; i++, r++) {
                    st.row[r] = (const char *)mats[m] + (size_t)(i * k + col0) * size;
                    const float factor = row_scales && row_scales[m] ? row_scales[m][i] : 1.0f;
                    for (int64_t t = 0; t < st.tiles; t++) st.ir[r * st.tiles + t] = factor;
                }
            }
            for (int64_t j = 0; j < st.k; j++) st.ic[j] = 1.0f;
            status = run(&st, iterations, team, inv_col + col0, best, sums, sums + st.k, col_std);
        }
    }
    free(st.row);
    free(st.ir);
    free(st.part);
    free(st.ic);
    free(sums);
    return status;
}
