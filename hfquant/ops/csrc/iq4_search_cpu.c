/*
 * hfquant's fast IQ4_NL / IQ4_XS search (`hfquant.ops.native.block_quantize`'s path for these types, with the
 * candidates `HFQUANT_IQ4_SEARCH` names, "thorough" by default; "exhaustive" takes blocks_quant_cpu.c's port of the
 * torch codec instead). Bytes: llama.cpp's `block_iq4_nl` / `block_iq4_xs` (hfquant/core/blocks/iq4.py's docstring).
 *
 * The search is llama.cpp's (`quantize_row_iq4_nl_impl`: a few candidate scales per block of 32, each with its nearest
 * codes and least-squares scale, the best by sqx^2 / sqq), with hfquant's candidates at both ends of the grid and, for
 * IQ4_XS, a scan of the float16 super-block scale with the best of three 6-bit levels per block and least-squares
 * refits of it (iq4.py `quantize_iq4_xs`'s steps with fewer candidates). What makes it fast:
 * - 16 blocks or super-blocks at once, one per vector lane (the group transposed), so sums need no horizontal adds;
 * - the nearest code without a search: u = x / scale falls in one of 32 buckets of width 8 (floor(u / 8) + 16,
 *   clamped), each holding at most one midpoint of the grid (neighbouring midpoints are >= 11.5 apart), so the code is
 *   the bucket's count of midpoints below it plus (u >= its midpoint): a table lookup (one vpermt2d: the AVX-512
 *   body packs the midpoint and the count into one entry) and a compare, ties to the larger value as `Grid.index`;
 * - errors from the sums (d^2 sqq - 2 d sqx = error - sum w x^2), no second pass over the weights.
 * With a sweep range the block stage is instead the exact breakpoint sweep of the block's scale over that range of
 * factors (iq4_search_body.h, `iq4_sweep_scales_`): every segment of constant codes, not a scan of candidates.
 * iq4_search_body.h holds the search, compiled for AVX-512 (AVX512F/BW/VL), for AVX2 (AVX2, FMA, F16C: two 8-lane
 * vectors per group, the nearest code by a binary search over the midpoints) and in portable C; hfquant_isa
 * (isa_cpu.c, so HFQUANT_ISA=avx2 runs the AVX2 body on an AVX-512 CPU) picks one; all give the same bytes
 * (tests/ops/test_iq4_search.py). One thread, a (4096, 2048) weight on Zen 5: "thorough" AVX-512 ~170 M weights/s,
 * AVX2 ~40, portable 3; "fast" AVX-512 ~450, AVX2 ~125 (docs/performance.md, issue #30, eleventh session, and issue
 * #32, twelfth session; the sixteenth's row loop: 1.07-1.19x less CPU for the fast search, the same bytes).
 */
#pragma GCC optimize("fp-contract=off") /* products and sums as written; fused multiply-adds only where spelt fmaf */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hfquant_kernels.h"

#define IS_LANES 16

static const float iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* bucket b covers u in [8 (b - 16), 8 (b - 15)): the count of grid midpoints below its lower end, and the midpoint
 * inside it (+inf: none). Midpoints: -115.5 -93.5 -74 -57 -42 -28.5 -16 -4.5 7 19 31.5 45.5 61 79 101. */
static int32_t iq4_bucket_base[32];
static float iq4_bucket_mid[32];
static float iq4_mids[16]; /* the midpoint between grid values i and i + 1 (i < 15; [15] unused) */

static void iq4_tables(void) {
    static int ready = 0;
    if (__atomic_load_n(&ready, __ATOMIC_ACQUIRE)) return;
    for (int b = 0; b < 32; b++) {
        const float low = 8.0f * (float)(b - 16);
        int below = 0;
        float inside = INFINITY;
        for (int i = 0; i < 15; i++) {
            const float mid = (iq4_values[i] + iq4_values[i + 1]) / 2.0f;
            below += mid < low;
            if (mid >= low && mid < low + 8.0f) inside = mid;
        }
        iq4_bucket_base[b] = below;
        iq4_bucket_mid[b] = inside;
    }
    for (int i = 0; i < 15; i++) iq4_mids[i] = (iq4_values[i] + iq4_values[i + 1]) / 2.0f;
    iq4_mids[15] = INFINITY;
    __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
}

/* the grid index nearest to u (ties to the larger value): the bucket rule above. A NaN u (0 * inf: a zero weight
 * under the inverse of a subnormal block peak's scale) is code 0, as the vector bodies give it, never an index out
 * of the tables (the compare is written so that NaN fails it) */
static inline int iq4_code(float u) {
    float t = u * 0.125f + 16.0f;
    t = t >= 0.0f ? (t > 31.0f ? 31.0f : t) : 0.0f;
    const int bucket = (int)t;
    return iq4_bucket_base[bucket] + (u >= iq4_bucket_mid[bucket]);
}

/* round half to even (torch.round) for |value| < 2**22 */
static inline float iq4_round(float value) {
    const float magic = 12582912.0f;
    return fabsf(value) < 4194304.0f ? (value + magic) - magic : value;
}

static inline float iq4_clamp(float value, float lo, float hi) { return value < lo ? lo : (value > hi ? hi : value); }

/* the float16 value nearest to `value`, clamped to +-65504 */
static inline float iq4_half(float value) { return (float)(_Float16)iq4_clamp(value, -65504.0f, 65504.0f); }

/* the breakpoint sweep (iq4_search_body.h): two crossings per weight and grid end in a factor range <= 1.55; a key
 * is the crossing's position (f - lo) / (hi - lo) in units of 2^-25, shifted above its row (2 i + which); a row
 * with no crossing holds IS_SWEEP_NONE (after every real key) and zero differences */
#define IS_SWEEP_ROWS 64
#define IS_SWEEP_SHIFT 6
#define IS_SWEEP_FIXED 33554432.0f
#define IS_SWEEP_NONE (0x3ffffffu << IS_SWEEP_SHIFT)

typedef struct {
    const float *targets; /* block stage: the largest weight of a block lands on each of these grid values */
    int ntargets;
    int refine;        /* then `refine` pairs target * (1 +- step) around each lane's best, step halving per pair */
    float refine_step;
    const float *super_factors; /* IQ4_XS: d = peak block scale / (-32 or 31) / each factor */
    int nsuper;
    int level_options; /* IQ4_XS: 6-bit levels tried per block around scale / d: 1 or 3 */
    int rounds;        /* least-squares refits of d (IQ4_XS) or of the block scale (IQ4_NL) */
    float sweep_lo, sweep_hi; /* sweep_hi > 0: the block stage is the breakpoint sweep over these factors */
} iq4_search_t;

#define IS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define IS_SUFFIX _avx512
#define IS_AVX512 1
#define IS_AVX2 0
#include "iq4_search_body.h"
#undef IS_TARGET
#undef IS_SUFFIX
#undef IS_AVX512
#undef IS_AVX2

#define IS_TARGET __attribute__((target("avx2,fma,f16c")))
#define IS_SUFFIX _avx2
#define IS_AVX512 0
#define IS_AVX2 1
#include "iq4_search_body.h"
#undef IS_TARGET
#undef IS_SUFFIX
#undef IS_AVX512
#undef IS_AVX2

#define IS_TARGET
#define IS_SUFFIX _portable
#define IS_AVX512 0
#define IS_AVX2 0
#include "iq4_search_body.h"

/* `value` as float16 into out; a zero (or a value that rounds to zero) as +0.0: the bodies reach a block of subnormal
 * weights' zero scale with either sign, and the bytes must not depend on the body (tests/ops/test_iq4_search.py) */
static void put_half16(uint8_t *out, float value) {
    _Float16 h = (_Float16)value;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    if ((bits & 0x7FFF) == 0) bits = 0;
    memcpy(out, &bits, 2);
}

/* lane l of a group: d f16, scales_h, scales_l[4] (iq4.py's module docstring; qs by `iq4_xs_put_codes_`) */
static void write_xs_scales(const float *d, const float *levels, int l, uint8_t *o) {
    uint16_t high = 0;
    uint8_t ls[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = (uint8_t)(levels[j * IS_LANES + l] + 32.0f);
        high |= (uint16_t)(((ls[j] >> 4) & 3) << (2 * j));
    }
    put_half16(o, d[l]);
    o[2] = (uint8_t)(high & 255);
    o[3] = (uint8_t)(high >> 8);
    for (int j = 0; j < 4; j++) o[4 + j] = (uint8_t)((ls[2 * j] & 15) | ((ls[2 * j + 1] & 15) << 4));
}

static void write_nl(const float *d, const uint8_t *codes, int l, uint8_t *o) {
    put_half16(o, d[l]);
    for (int i = 0; i < 16; i++) o[2 + i] = (uint8_t)(codes[i * IS_LANES + l] | (codes[(i + 16) * IS_LANES + l] << 4));
}

/* rows k < size of lanes l < count: xt[k * 16 + l] = src[l * size + k]; lanes past count are zeros */
static void transpose_in(const float *src, int64_t stride, int count, int size, float *xt) {
    for (int l = 0; l < IS_LANES; l++)
        for (int k = 0; k < size; k++) xt[k * IS_LANES + l] = l < count ? src[l * stride + k] : 0.0f;
}

/* one body's functions (iq4_search_body.h) */
typedef struct {
    void (*transpose_in)(const float *src, int size, float *xt);
    void (*xs_group)(const float *xt, const float *wt, const iq4_search_t *s, float *d_out, float *levels_out,
                     uint8_t *codes);
    void (*xs_put_codes)(const uint8_t *codes, int count, uint8_t *out);
    void (*nl_group)(const float *xt, const float *wt, const iq4_search_t *s, float *d_out, uint8_t *codes);
} iq4_body_t;

#define IS_BODY(suffix)                                                                                              \
    {IS_CAT(iq4_transpose_in_, suffix), IS_CAT(iq4_xs_group_, suffix), IS_CAT(iq4_xs_put_codes_, suffix),            \
     IS_CAT(iq4_nl_group_, suffix)}
static const iq4_body_t iq4_bodies[3] = {IS_BODY(_portable), IS_BODY(_avx2), IS_BODY(_avx512)};

/* the body to run: hfquant_isa (isa_cpu.c, lowered by HFQUANT_ISA) decides; `portable` forces the portable one */
static const iq4_body_t *iq4_body(int64_t portable) {
    if (portable) return &iq4_bodies[0];
    /* AVX2: its F16C; AVX512-DQ: vrangeps (every CPU with AVX512-BW has it) */
    if (HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX2) && __builtin_cpu_supports("avx512dq"))
        return &iq4_bodies[2];
    return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2) ? &iq4_bodies[1] : &iq4_bodies[0];
}

/* the body `hfquant_iq4_quantize` runs without `portable`: 0 portable C, 1 AVX2, 2 AVX-512 */
int hfquant_iq4_search_body(void) { return (int)(iq4_body(0) - iq4_bodies); }

/* where the search reads its weights: float32 rows `x`, or (x NULL) a bfloat16 / float32 weight (rows, k) `w` that
 * each thread folds into float32 itself, a group at a time (`hfquant_fold_span`: rows times row_scale, columns
 * divided by col_scale, NULL: none) */
typedef struct {
    const float *x;
    const void *w;
    int64_t bf16, k;
    const float *row_scale, *col_scale;
} iq4_source_t;

/* lane l of group g's weights, transposed into xt; with a weight to fold, through the thread's buffer xs (16 of the
 * type's blocks); returns whether a folded value is NaN or infinite */
static int iq4_group_in(const iq4_source_t *src, const iq4_body_t *body, int64_t first, int count, int size,
                        float *xs, float *xt) {
    int bad = 0;
    const float *from = src->x != NULL ? src->x + first * size : xs;
    if (src->x == NULL)
        bad = hfquant_fold_span(src->w, src->bf16, src->k, first * size, (int64_t)count * size, src->row_scale,
                                src->col_scale, xs);
    if (count < IS_LANES)
        transpose_in(from, size, count, size, xt);
    else
        body->transpose_in(from, size, xt);
    return bad;
}

/* lane l reads (super-)block first + l of the importance, or with a period that one modulo it: the same transposed
 * rows again whenever first % w_period repeats (every group for a 2048-wide weight's period of 8), so they are
 * gathered again only when it changes (*wt_phase: the phase of the rows in wt, -1: none or not a full group's); a
 * full group whose 16 rows are consecutive (no period, or the phase 16 or more before the period's end: an
 * 8192-wide weight's period of 32 alternates between phases 0 and 16) is transposed by the body's tiles */
static void iq4_importance_in(const float *w, int64_t w_period, int64_t first, int count, int size,
                              const iq4_body_t *body, float *wt, int64_t *wt_phase) {
    const int64_t phase = w_period > 0 ? first % w_period : -1;
    if (phase >= 0 && phase == *wt_phase && count == IS_LANES) return;
    *wt_phase = count < IS_LANES ? -1 : phase;
    if (count == IS_LANES && (w_period <= 0 || phase + IS_LANES <= w_period)) {
        body->transpose_in(w + (w_period > 0 ? phase : first) * size, size, wt);
        return;
    }
    for (int l = 0; l < IS_LANES; l++) {
        const int64_t b = first + (l < count ? l : 0);
        const float *src = w + (w_period > 0 ? b % w_period : b) * size;
        for (int k = 0; k < size; k++) wt[k * IS_LANES + l] = src[k];
    }
}

/* the search of `nblocks` blocks from `src` (hfquant_iq4_quantize's arguments); 0, 2 (no work buffer) or 3 (a folded
 * weight is not finite) */
static int iq4_run(const iq4_source_t *src, const float *w, int64_t w_period, int64_t nblocks, int type,
                   const iq4_search_t *s, int64_t threads, const iq4_body_t *body, uint8_t *out) {
    const int size = type == 23 ? 256 : 32, type_size = type == 23 ? 136 : 18;
    const int64_t groups = (nblocks + IS_LANES - 1) / IS_LANES;
    int failed = 0, bad = 0;
#pragma omp parallel num_threads(threads > 0 ? (int)threads : omp_get_max_threads()) reduction(| : bad)
    {
        /* xt, wt: a group transposed, its importance; xs: its folded weights (a source to fold) */
        float *xt = aligned_alloc(64, 3 * 256 * IS_LANES * sizeof(float));
        float *wt = xt ? xt + 256 * IS_LANES : NULL, *xs = xt ? xt + 2 * 256 * IS_LANES : NULL;
        if (!xt) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t wt_phase = -1;
        uint8_t codes[256 * IS_LANES];
        float d[IS_LANES], levels[8 * IS_LANES];
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < groups; g++) {
            if (!xt) continue; /* out of memory: reported below */
            const int64_t first = g * IS_LANES;
            const int count = (int)(nblocks - first < IS_LANES ? nblocks - first : IS_LANES);
            bad |= iq4_group_in(src, body, first, count, size, xs, xt);
            if (w != NULL) iq4_importance_in(w, w_period, first, count, size, body, wt, &wt_phase);
            const float *wg = w != NULL ? wt : NULL;
            if (type == 23) {
                body->xs_group(xt, wg, s, d, levels, codes);
                for (int l = 0; l < count; l++) write_xs_scales(d, levels, l, out + (first + l) * type_size);
                body->xs_put_codes(codes, count, out + first * type_size);
            } else {
                body->nl_group(xt, wg, s, d, codes);
                for (int l = 0; l < count; l++) write_nl(d, codes, l, out + (first + l) * type_size);
            }
        }
        free(xt);
    }
    return failed ? 2 : (bad ? 3 : 0);
}

/* the search's constants checked (0) or 1 */
static int iq4_bad_search(int type, int64_t ntargets, int64_t refine, int64_t nsuper, int64_t rounds,
                          int64_t level_options, float sweep_lo, float sweep_hi) {
    return (type != 20 && type != 23) || ntargets < 1 || refine < 0 || (type == 23 && nsuper < 1) || rounds < 0 ||
           (level_options != 1 && level_options != 3) ||
           (sweep_hi > 0.0f && !(sweep_lo > 0.0f && sweep_hi <= 1.55f * sweep_lo));
}

/*
 * Quantize `nblocks` blocks (type 20, IQ4_NL: 32 weights) or super-blocks (type 23, IQ4_XS: 256) of float32 weights
 * `x` into `out` (18 or 136 bytes each) by the fast search. `w`: each element's weight in the squared error, NULL
 * for all 1; `w_period` > 0: w repeats every w_period (super-)blocks (a (K,) importance). `targets` (ntargets):
 * the block stage's grid values for the block's largest weight, then `refine` pairs around each block's best (target
 * times 1 +- refine_step, the step halving after each pair); `super_factors` (nsuper, IQ4_XS); `level_options`
 * 1 or 3; `rounds` the refits; `sweep_hi` > 0: the block stage is the exact breakpoint sweep over factors
 * [sweep_lo, sweep_hi] (sweep_hi <= 1.55 sweep_lo) instead of the targets' scan; `threads` > 0 OpenMP threads (else
 * OpenMP's default); `portable` != 0 forces the portable C body. Returns 0, 1 for bad arguments, 2 when a thread's
 * 48 KiB work buffer could not be allocated.
 */
int hfquant_iq4_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, int type,
                         const float *targets, int64_t ntargets, const float *super_factors, int64_t nsuper,
                         int64_t refine, float refine_step, int64_t level_options, int64_t rounds, float sweep_lo,
                         float sweep_hi, int64_t threads, int64_t portable, uint8_t *out) {
    if (iq4_bad_search(type, ntargets, refine, nsuper, rounds, level_options, sweep_lo, sweep_hi)) return 1;
    iq4_tables();
    const iq4_search_t s = {targets,        (int)ntargets,      (int)refine, refine_step, super_factors,
                            (int)nsuper,    (int)level_options, (int)rounds, sweep_lo,    sweep_hi};
    const iq4_source_t src = {x, NULL, 0, 0, NULL, NULL};
    return iq4_run(&src, w, w_period, nblocks, type, &s, threads, iq4_body(portable), out);
}

/*
 * hfquant_iq4_quantize of the float32 weights that `hfquant_fold_chunk` would make of `wsrc` (rows, k), bfloat16 when
 * `bf16` else float32: rows times `row_scale` (rows,), columns divided by `col_scale` (k,) (NULL: none), folded by
 * each thread a group of 16 (super-)blocks at a time into a buffer of its own, so that the copy, the scales and the
 * search of a whole weight are one parallel pass (on load: no float32 copy of the weight, no thread idle while
 * another converts a chunk; docs/performance.md, issue #32, thirteenth session). The same bytes as
 * hfquant_fold_chunk then hfquant_iq4_quantize. Returns those codes, and 3 when a folded value is NaN or infinite
 * (the bytes are then unspecified).
 */
int hfquant_iq4_quantize_fold(const void *wsrc, int64_t bf16, int64_t rows, int64_t k, const float *row_scale,
                              const float *col_scale, const float *w, int64_t w_period, int type,
                              const float *targets, int64_t ntargets, const float *super_factors, int64_t nsuper,
                              int64_t refine, float refine_step, int64_t level_options, int64_t rounds,
                              float sweep_lo, float sweep_hi, int64_t threads, int64_t portable, uint8_t *out) {
    const int size = type == 23 ? 256 : 32;
    if (iq4_bad_search(type, ntargets, refine, nsuper, rounds, level_options, sweep_lo, sweep_hi) || rows < 0 ||
        k <= 0 || k % size)
        return 1;
    iq4_tables();
    const iq4_search_t s = {targets,        (int)ntargets,      (int)refine, refine_step, super_factors,
                            (int)nsuper,    (int)level_options, (int)rounds, sweep_lo,    sweep_hi};
    const iq4_source_t src = {NULL, wsrc, bf16 != 0, k, row_scale, col_scale};
    return iq4_run(&src, w, w_period, rows * (k / size), type, &s, threads, iq4_body(portable), out);
}
