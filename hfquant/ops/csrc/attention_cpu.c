/* Scaled dot-product attention of one query row (a batch-1 decode step) over a key/value cache, grouped-query:
 *   for each head h (kv head g = h / (heads / kv_heads)):
 *     s_t = scale * sum_d q[h, d] * k[g, t, d]          float32 sums of the bfloat16 products (exact in float32)
 *     e_t = exp(s_t - max_t s_t)                         float32
 *     out[h, d] = bf16(sum_t bf16(e_t) * v[g, t, d] * (1 / sum_t e_t))   float32 sums, rounded once (nearest even)
 *   q: heads rows of dim bfloat16, row h at q + h * q_head_stride; k, v: kv_heads x tokens rows of dim bfloat16,
 *   row (g, t) at k + g * kv_head_stride + t * kv_token_stride (same strides for v); out: (heads, dim) contiguous.
 *   No mask: every cached token is attended (transformers passes none for one query row without padding).
 * Why: PyTorch's CPU flash-attention kernel costs 16 us at 16 cached tokens, 60 us at 80 and 290 us at 400 for
 * SmolLM2's 9 heads of one query (one thread, AMD Zen 5): at one query row its two products are MKL bfloat16 GEMM
 * calls (7-10 us each per head), against a few microseconds of arithmetic.
 * Accuracy: as that kernel's (PyTorch 2.13, bfloat16): float32 scores and sums, the unnormalized probabilities
 * rounded to bfloat16 for the product with V, their float32 sum dividing. Its exp and summation order are not
 * reproduced (its products are MKL's, whose order is not public), so a few outputs in a hundred differ from it by
 * one bfloat16 step; tests/nn/test_row_attention.py bounds the error against float64.
 *
 * Order of the float32 operations (the same in every body, so the bodies give the same bits; HFQUANT_ISA picks one,
 * isa_cpu.c): the dot products in 8 lanes (lane l sums d = l, l + 8, ...; the products are exact), the lanes added
 * pairwise ((l, l + 4), then (l, l + 2), (l, l + 1)); e_t by exp_lanes below; the sum of e_t in 8 lanes by t mod 8,
 * added pairwise the same way; P @ V token after token per output. Contraction is off in this file, so a multiply
 * and an add stay two roundings in every body. Bodies: the same C (GNU C vectors of 8 floats) compiled for AVX-512
 * F/BW/VL (ymm registers: 16 lanes were not faster here and made the AVX2 code spill), for AVX2 + FMA, and for the
 * x86-64 baseline or any other CPU (the portable body, also what HFQUANT_ISA=generic runs).
 * Speed (9 heads / 3 kv heads of 64, one thread, Zen 5): 5 / 9 / 28 us at 16 / 80 / 400 cached tokens, against 7 /
 * 18 / 72 for the scalar C before and 16 / 60 / 290 for the flash kernel (docs/performance.md, issue #32).
 * Returns 0, 1 for refused sizes (heads not a multiple of kv_heads, a dimension <= 0, dim > 256) or 2 when out of
 * memory. */
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic ignored "-Wpsabi" /* the vector helpers are inlined into each body: no ABI crosses */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define LANES 8
#define MAX_CHUNKS 32 /* head sizes up to 256 */
#define BLOCK 512     /* keys per softmax block, as the flash kernel's kv_split_size (a multiple of LANES) */
_Static_assert(LANES == 8, "lanes_sum and lanes_sum8 add 8 lanes");
#define INLINE static inline __attribute__((always_inline))

/* LANES float32 lanes in GNU C vectors: a ymm register in the AVX-512 and AVX2 bodies, two xmm in the portable one
 * on x86-64; the same operations in the same order in every body */
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
typedef uint32_t vuint __attribute__((vector_size(32)));
typedef uint16_t vbf16 __attribute__((vector_size(16)));
typedef float vfloat4 __attribute__((vector_size(16)));

INLINE vfloat splat(float x) { return x - (vfloat){0}; } /* x - (+0) is x, -0 included: a broadcast */

INLINE vfloat pick(vint mask, vfloat a, vfloat b) { return (vfloat)(((vint)a & mask) | ((vint)b & ~mask)); }

/* LANES bfloat16 values widened (exact); fewer left: the rest are zeros */
INLINE vfloat load_bf16(const uint16_t *from, int64_t count) {
    vbf16 h = {0};
    if (count >= LANES)
        memcpy(&h, from, sizeof h);
    else
        memcpy(&h, from, (size_t)count * sizeof(uint16_t));
    return (vfloat)(__builtin_convertvector(h, vuint) << 16);
}

/* the 8 lanes added pairwise: (l, l + 4), then (l, l + 2), (l, l + 1) */
INLINE float lanes_sum(vfloat a) {
    const vfloat4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* exp(x) lane by lane for x <= 0 (or -infinity): x = n ln2 + r (n nearest, |r| <= ln2 / 2; ln2 in two parts, the
 * first times n exact), e^r by its Taylor polynomial of degree 7 (truncation below 2^-26 relative; Horner in
 * float32, a few units in the last place in all), times 2^n through the exponent bits; 0 below -87 (e^-87 <
 * 2^-125, far below a bfloat16 step of the largest term, which is 1). */
INLINE vfloat exp_lanes(vfloat x) {
    const vint kept = x >= splat(-87.0f);
    x = pick(kept, x, splat(-87.0f));
    const vfloat n = (x * splat(1.44269504f) + splat(12582912.0f)) - splat(12582912.0f); /* nearest: 1.5 * 2^23 */
    const vfloat r = (x - n * splat(0.693359375f)) + n * splat(2.12194440e-4f);
    vfloat p = splat(1.98412698e-4f);
    p = p * r + splat(1.38888889e-3f);
    p = p * r + splat(8.33333333e-3f);
    p = p * r + splat(4.16666667e-2f);
    p = p * r + splat(1.66666667e-1f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const vfloat two_n = (vfloat)((__builtin_convertvector(n, vint) + 127) << 23);
    return (vfloat)((vint)(p * two_n) & kept);
}

/* float32 lanes rounded to bfloat16 and widened back (nearest even, as float_to_bf16) */
INLINE vfloat round_bf16(vfloat f) {
    const vuint bits = (vuint)f;
    return (vfloat)((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
}

typedef struct {
    const uint16_t *q, *k, *v; /* the group's first query row; the kv head's first key and value rows */
    int64_t q_head_stride, kv_token_stride, group, tokens, dim, padded; /* padded: tokens rounded up to LANES */
    uint16_t *out;                                                      /* the group's first output row */
    float scale;
    float *scores;      /* group x padded floats */
    float *factors;     /* group x blocks floats: softmax_row's rescaling factors */
    int64_t blocks;     /* blocks of BLOCK keys */
    vfloat *qf, *acc; /* group x MAX_CHUNKS vectors each */
} Group;

/* a row of `chunks` vectors of bfloat16 widened; `whole`: dim is chunks * LANES (a constant where it matters) */
INLINE void load_row(const uint16_t *from, vfloat *to, int64_t chunks, int whole, int64_t dim) {
    for (int64_t c = 0; c < chunks; c++) to[c] = load_bf16(from + c * LANES, whole ? LANES : dim - c * LANES);
}

/* q . k in LANES lanes (lane l sums d = l, l + LANES, ...; the products are exact) */
INLINE vfloat dot_lanes(const vfloat *q, const vfloat *k, int64_t chunks) {
    vfloat lanes = q[0] * k[0];
    for (int64_t c = 1; c < chunks; c++) lanes += q[c] * k[c];
    return lanes;
}

/* lanes_sum of 8 vectors at once, lane i of the result from a[i]: the same additions, transposed */
INLINE vfloat lanes_sum8(const vfloat *a) {
    vfloat x[4], y[2];
    for (int i = 0; i < 4; i++) /* (l, l + 4): a[2i] in lanes 0-3, a[2i + 1] in 4-7 */
        x[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* (l, l + 2): lanes a[4i] a[4i] a[4i+2] a[4i+2] a[4i+1] a[4i+1] a[4i+3] a[4i+3] */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    /* (l, l + 1), the lanes put back in order a[0] ... a[7] */
    return __builtin_shufflevector(y[0], y[1], 0, 4, 2, 6, 8, 12, 10, 14) +
           __builtin_shufflevector(y[0], y[1], 1, 5, 3, 7, 9, 13, 11, 15);
}

/* scores[h][t] = scale * q_h . k_t for the group's heads (-infinity after the tokens): each key row widened once,
 * 8 tokens at a time */
INLINE void group_scores(const Group *j, int64_t chunks, int whole) {
    vfloat keys[LANES][MAX_CHUNKS], lanes[LANES];
    int64_t t = 0;
    for (; t + LANES <= j->tokens; t += LANES) {
        for (int i = 0; i < LANES; i++) load_row(j->k + (t + i) * j->kv_token_stride, keys[i], chunks, whole, j->dim);
        for (int64_t h = 0; h < j->group; h++) {
            for (int i = 0; i < LANES; i++) lanes[i] = dot_lanes(j->qf + h * MAX_CHUNKS, keys[i], chunks);
            const vfloat scores = lanes_sum8(lanes) * splat(j->scale);
            memcpy(j->scores + h * j->padded + t, &scores, sizeof scores);
        }
    }
    for (; t < j->tokens; t++) {
        load_row(j->k + t * j->kv_token_stride, keys[0], chunks, whole, j->dim);
        for (int64_t h = 0; h < j->group; h++)
            j->scores[h * j->padded + t] = lanes_sum(dot_lanes(j->qf + h * MAX_CHUNKS, keys[0], chunks)) * j->scale;
    }
    for (int64_t h = 0; h < j->group; h++)
        for (t = j->tokens; t < j->padded; t++) j->scores[h * j->padded + t] = -INFINITY;
}

/* the largest of LANES lanes */
INLINE float lanes_max(vfloat top) {
    float most = top[0];
    for (int l = 1; l < LANES; l++) most = top[l] > most ? top[l] : most;
    return most;
}

/* scores -> bf16(exp(s - max)) in place (padded with -infinity, which gives 0), block after block of BLOCK keys as
 * the flash kernel does: the max is the running max up to the block, each block's sum (LANES lanes by t mod LANES,
 * added pairwise) is added to the sum before it times factors[b] = exp(old max - new max), by which P @ V rescales
 * its sums at the block's start. Returns 1 / the sum of the unrounded exponentials. */
INLINE float softmax_row(float *s, int64_t padded, float *factors) {
    float most = -INFINITY, total = 0.0f;
    for (int64_t start = 0, b = 0; start < padded; start += BLOCK, b++) {
        const int64_t end = start + BLOCK < padded ? start + BLOCK : padded;
        vfloat top = splat(-INFINITY), sums = splat(0.0f), x;
        for (int64_t t = start; t < end; t += LANES) {
            memcpy(&x, s + t, sizeof x);
            top = pick(x > top, x, top);
        }
        const float block_most = lanes_max(top), previous = most;
        most = block_most > most ? block_most : most;
        for (int64_t t = start; t < end; t += LANES) {
            memcpy(&x, s + t, sizeof x);
            const vfloat e = exp_lanes(x - splat(most));
            sums += e;
            x = round_bf16(e); /* as the flash kernel's bfloat16 P @ V */
            memcpy(s + t, &x, sizeof x);
        }
        factors[b] = b ? exp_lanes(splat(previous - most))[0] : 0.0f;
        total = b ? lanes_sum(sums) + factors[b] * total : lanes_sum(sums);
    }
    return 1.0f / total;
}

/* out[h] = bf16((sum_t p_t v_t) * inverse[h]) for the group's heads, token after token, each value row widened once */
INLINE void group_values(const Group *j, const float *inverse, int64_t chunks, int whole) {
    vfloat row[MAX_CHUNKS];
    for (int64_t i = 0; i < j->group * MAX_CHUNKS; i++) j->acc[i] = splat(0.0f);
    for (int64_t t = 0; t < j->tokens; t++) {
        load_row(j->v + t * j->kv_token_stride, row, chunks, whole, j->dim);
        if (t % BLOCK == 0 && t > 0) /* a new block of keys: the sums rescaled to its max */
            for (int64_t h = 0; h < j->group; h++)
                for (int64_t c = 0; c < chunks; c++)
                    j->acc[h * MAX_CHUNKS + c] *= splat(j->factors[h * j->blocks + t / BLOCK]);
        for (int64_t h = 0; h < j->group; h++) {
            const vfloat p = splat(j->scores[h * j->padded + t]);
            vfloat *acc = j->acc + h * MAX_CHUNKS;
            for (int64_t c = 0; c < chunks; c++) acc[c] += p * row[c];
        }
    }
    for (int64_t h = 0; h < j->group; h++) {
        const float *sums = (const float *)(j->acc + h * MAX_CHUNKS);
        for (int64_t d = 0; d < j->dim; d++) j->out[h * j->dim + d] = float_to_bf16(sums[d] * inverse[h]);
    }
}

/* the group's heads: scores, softmax, P @ V */
INLINE void attend_group(const Group *j, int64_t chunks, int whole) {
    for (int64_t h = 0; h < j->group; h++)
        load_row(j->q + h * j->q_head_stride, j->qf + h * MAX_CHUNKS, chunks, whole, j->dim);
    group_scores(j, chunks, whole);
    float inverse[j->group];
    for (int64_t h = 0; h < j->group; h++)
        inverse[h] = softmax_row(j->scores + h * j->padded, j->padded, j->factors + h * j->blocks);
    group_values(j, inverse, chunks, whole);
}

/* constant chunk counts for the common head sizes (64, 128): the loops over a row unroll */
INLINE void attend_sizes(const Group *j) {
    if (j->dim == 8 * LANES)
        attend_group(j, 8, 1);
    else if (j->dim == 16 * LANES)
        attend_group(j, 16, 1);
    else
        attend_group(j, (j->dim + LANES - 1) / LANES, 0);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))) static void attend_avx512(const Group *j) {
    attend_sizes(j);
}

__attribute__((target("avx2,fma,f16c"))) static void attend_avx2(const Group *j) { attend_sizes(j); }

static void attend_portable(const Group *j) { attend_sizes(j); }

int hfquant_attention_row(const uint16_t *q, int64_t q_head_stride, const uint16_t *k, const uint16_t *v,
                          int64_t kv_head_stride, int64_t kv_token_stride, uint16_t *out, int64_t heads,
                          int64_t kv_heads, int64_t tokens, int64_t dim, float scale) {
    if (heads <= 0 || kv_heads <= 0 || tokens <= 0 || dim <= 0 || dim > MAX_CHUNKS * LANES || heads % kv_heads)
        return 1;
    const int64_t group = heads / kv_heads, padded = (tokens + LANES - 1) / LANES * LANES;
    const int64_t blocks = (tokens + BLOCK - 1) / BLOCK;
    const int64_t per_group = 2 * group * MAX_CHUNKS + group * (padded + blocks + LANES - 1) / LANES; /* vectors */
    vfloat *scratch = aligned_alloc(sizeof(vfloat), (size_t)(kv_heads * per_group) * sizeof(vfloat));
    if (scratch == NULL) return 2;
    void (*body)(const Group *) = HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX2) ? attend_avx512
                                  : HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2)                    ? attend_avx2
                                                                                         : attend_portable;
#pragma omp parallel for schedule(static) if (heads * tokens * dim >= (1 << 20))
    for (int64_t g = 0; g < kv_heads; g++) {
        vfloat *own = scratch + g * per_group;
        const Group j = {.q = q + g * group * q_head_stride,
                         .k = k + g * kv_head_stride,
                         .v = v + g * kv_head_stride,
                         .q_head_stride = q_head_stride,
                         .kv_token_stride = kv_token_stride,
                         .group = group,
                         .tokens = tokens,
                         .dim = dim,
                         .padded = padded,
                         .out = out + g * group * dim,
                         .scale = scale,
                         .scores = (float *)(own + 2 * group * MAX_CHUNKS),
                         .factors = (float *)(own + 2 * group * MAX_CHUNKS) + group * padded,
                         .blocks = blocks,
                         .qf = own,
                         .acc = own + group * MAX_CHUNKS};
        body(&j);
    }
    free(scratch);
    return 0;
}
