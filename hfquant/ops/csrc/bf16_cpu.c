/* bfloat16 GEMV for the float layers hfquant keeps (the lm_head of an int4 model is often the largest weight read
 * per token): y[n] = bf16(sum_k w[n,k] * x[k] + bias[n]) for one activation row.
 *   x: (K,) bfloat16; w: (N, K) bfloat16 row-major; bias: (N,) bfloat16 or NULL; y: (N,) bfloat16.
 * Two bodies, picked by hfquant_isa (isa_cpu.c, so HFQUANT_ISA=avx2 runs the AVX2 one on an AVX-512 CPU):
 *   AVX512-BF16: vdpbf16ps (Intel's instruction set reference: "Dot Product of BF16 Pairs Accumulated into Packed
 *     Single Precision") multiplies 32 bfloat16 pairs and adds them into 16 float32 lanes, two accumulators per row.
 *   AVX2 + FMA (Haswell to Zen 3, where oneDNN has no bfloat16 path and ATen's one-row GEMV read about 9 GB/s on a
 *     Zen 3 core, this body 14-19: docs/performance.md, seventeenth session): x widened to float32 once per call,
 *     each weight widened by a shift or a mask of its 32-bit lane (a bfloat16 is the upper half of a float32), fused
 *     multiply-adds into four 8-lane float32 accumulators per row. Each product is exact in
 *     float32 (two 8-bit significands), so the two bodies differ only in their float32 summation order: an output may
 *     differ by one bfloat16 rounding step, both within float32 summation error of the exact sum before rounding.
 * In both the lanes are summed at the row's end, the bias added, and the sum rounded once to bfloat16 (nearest even);
 * OpenMP threads split the rows, each output summed by one thread in a fixed order. Requires K % 32 == 0. Returns 0
 * on success, 1 for a refused shape or a CPU with neither body, 2 when memory for the widened x runs out. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

/* y[n] = sum_k float(w[n, k]) * x[k] in float32: bfloat16 weights (N, K) row-major, float32 x (K,) and y (N,), one
 * thread, any K >= 1. For the fold pre-pass's BOS forward (hfquant.integration.bos_importance): each weight read once
 * as stored, no float32 copy of it. Sixteen partial sums per row (element k into sum k % 16, by fused multiply-adds,
 * in order of k), added in a fixed tree at the row's end, in every body (AVX-512, AVX2 + FMA and C): the same float32
 * results on every CPU (a fused multiply-add rounds once, whoever computes it). Returns 0, 1 for n < 0 or k < 1. */
#define BF16_F32_LANES 16

static inline float bf16_f32_tree(float *acc) {
    for (int width = BF16_F32_LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) acc[i] = acc[i] + acc[i + width];
    return acc[0];
}

/* the C body's row: 16 elements at a time into the 16 sums, then the tail. On x86-64 GCC it is also compiled for FMA
 * and picked at load time where the CPU has it (the library is built without -mfma, where fmaf is a call into libm
 * per element; with FMA it is one instruction, and the 16-sum loop vectorizes): the same fused multiply-adds, so the
 * same floats. It runs where neither vector body may (HFQUANT_ISA=generic, a CPU without AVX2, not x86). */
#define BF16_F32_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__clang__)
#undef BF16_F32_CLONES
#define BF16_F32_CLONES __attribute__((target_clones("fma", "default")))
#endif

BF16_F32_CLONES static void bf16_f32_row_c(const uint16_t *row, const float *x, int64_t k, float *y) {
    float acc[BF16_F32_LANES] = {0};
    int64_t i = 0;
    for (; i + BF16_F32_LANES <= k; i += BF16_F32_LANES)
        for (int l = 0; l < BF16_F32_LANES; l++) acc[l] = fmaf(bf16_to_float(row[i + l]), x[i + l], acc[l]);
    for (int l = 0; i < k; i++, l++) acc[l] = fmaf(bf16_to_float(row[i]), x[i], acc[l]);
    *y = bf16_f32_tree(acc);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* the AVX2 bodies ask for the weight's cache line this many bfloat16 (1 KiB) ahead of the one they read: on a Zen 3
 * (one thread, weights from memory) 10-20% faster than the hardware prefetcher alone, about 90% of a plain read's
 * speed (docs/performance.md, seventeenth session). Past the weight's end it is a hint that loads nothing. */
#define BF16_PREFETCH 512

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void bf16_gemv_avx512(
    const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 64 <= k; i += 64) {
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512((const void *)(row + i)),
                                    (__m512bh)_mm512_loadu_si512((const void *)(x + i)));
            acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512((const void *)(row + i + 32)),
                                    (__m512bh)_mm512_loadu_si512((const void *)(x + i + 32)));
        }
        if (i < k)
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512((const void *)(row + i)),
                                    (__m512bh)_mm512_loadu_si512((const void *)(x + i)));
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        if (bias != NULL) sum += bf16_to_float(bias[r]);
        y[r] = float_to_bf16(sum);
    }
}

/* The AVX2 body. A 256-bit load of a row holds 16 bfloat16 as 8 pairs, element 2j in the low half of 32-bit lane j,
 * element 2j + 1 in the high half: lane << 16 is element 2j as a float32, lane & 0xFFFF0000 element 2j + 1 (two
 * integer operations per 16 weights, where widening 8 at a time by vpmovzxwd takes two per 8). xs holds x in the same
 * order, per 16 inputs the 8 even ones then the 8 odd ones, widened once per call instead of once per row. Four
 * accumulators (32 inputs per step) keep two FMA units busy while the row streams from memory. */
__attribute__((target("avx2,fma"))) static int bf16_gemv_avx2(const uint16_t *x, const uint16_t *w,
                                                              const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    float *xs = (float *)_mm_malloc((size_t)k * sizeof(float), 32);
    if (xs == NULL) return 2;
    for (int64_t i = 0; i < k; i += 16)
        for (int j = 0; j < 8; j++) {
            xs[i + j] = bf16_to_float(x[i + 2 * j]);
            xs[i + 8 + j] = bf16_to_float(x[i + 2 * j + 1]);
        }
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
            _mm_prefetch((const char *)(row + i + BF16_PREFETCH), _MM_HINT_T0);
            const __m256i a = _mm256_loadu_si256((const __m256i *)(row + i));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(row + i + 16));
            acc0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_load_ps(xs + i), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, odd)), _mm256_load_ps(xs + i + 8), acc1);
            acc2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), _mm256_load_ps(xs + i + 16), acc2);
            acc3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b, odd)), _mm256_load_ps(xs + i + 24), acc3);
        }
        const __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        float sum = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        if (bias != NULL) sum += bf16_to_float(bias[r]);
        y[r] = float_to_bf16(sum);
    }
    _mm_free(xs);
    return 0;
}

int hfquant_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    if (k % 32 || k <= 0 || n <= 0) return 1;
    if (HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16)) {
        bf16_gemv_avx512(x, w, bias, y, n, k);
        return 0;
    }
    if (HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2)) return bf16_gemv_avx2(x, w, bias, y, n, k);
    return 1;
}

__attribute__((target("avx512f"))) static void bf16_f32_row_avx512(const uint16_t *row, const float *x, int64_t k,
                                                                    float *y) {
    __m512 sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + BF16_F32_LANES <= k; i += BF16_F32_LANES) {
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + i)));
        sum = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), _mm512_loadu_ps(x + i), sum);
    }
    float acc[BF16_F32_LANES];
    _mm512_storeu_ps(acc, sum);
    for (int l = 0; i < k; i++, l++) acc[l] = fmaf(bf16_to_float(row[i]), x[i], acc[l]);
    *y = bf16_f32_tree(acc);
}

/* the AVX-512 body's sums in two 8-lane halves: lo holds sums 0-7, hi sums 8-15, each fed in order of k, so the same
 * fused multiply-adds in the same order (fmaf in the tail is one instruction under target("fma")) */
__attribute__((target("avx2,fma"))) static void bf16_f32_row_avx2(const uint16_t *row, const float *x, int64_t k,
                                                                  float *y) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + BF16_F32_LANES <= k; i += BF16_F32_LANES) {
        if (i % 32 == 0) _mm_prefetch((const char *)(row + i + BF16_PREFETCH), _MM_HINT_T0);
        const __m256i bits_lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + i)));
        const __m256i bits_hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + i + 8)));
        lo = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(bits_lo, 16)), _mm256_loadu_ps(x + i), lo);
        hi = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(bits_hi, 16)), _mm256_loadu_ps(x + i + 8), hi);
    }
    float acc[BF16_F32_LANES];
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
    for (int l = 0; i < k; i++, l++) acc[l] = fmaf(bf16_to_float(row[i]), x[i], acc[l]);
    *y = bf16_f32_tree(acc);
}

int hfquant_bf16_f32_gemv(const uint16_t *w, const float *x, float *y, int64_t n, int64_t k) {
    if (n < 0 || k < 1) return 1;
    void (*body)(const uint16_t *, const float *, int64_t, float *) =
        HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512) ? bf16_f32_row_avx512
        : HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2) ? bf16_f32_row_avx2
                                            : bf16_f32_row_c;
    for (int64_t r = 0; r < n; r++) body(w + r * k, x, k, y + r);
    return 0;
}

#else

int hfquant_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    (void)x; (void)w; (void)bias; (void)y; (void)n; (void)k;
    return 1;
}

int hfquant_bf16_f32_gemv(const uint16_t *w, const float *x, float *y, int64_t n, int64_t k) {
    if (n < 0 || k < 1) return 1;
    for (int64_t r = 0; r < n; r++) bf16_f32_row_c(w + r * k, x, k, y + r);
    return 0;
}

#endif
