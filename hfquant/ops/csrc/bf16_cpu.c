/* bfloat16 GEMV for the float layers hfquant keeps (the lm_head of an int4 model is often the largest weight read
 * per token): y[n] = bf16(sum_k w[n,k] * x[k] + bias[n]) for one activation row.
 *   x: (K,) bfloat16; w: (N, K) bfloat16 row-major; bias: (N,) bfloat16 or NULL; y: (N,) bfloat16.
 * How: vdpbf16ps (AVX512-BF16, Intel's instruction set reference: "Dot Product of BF16 Pairs Accumulated into Packed
 * Single Precision") multiplies 32 bfloat16 pairs and adds them into 16 float32 lanes, two accumulators per row; the
 * lanes are summed at the row's end, the bias added, and the sum rounded once to bfloat16 (nearest even). OpenMP
 * threads split the rows; each output is summed by one thread in a fixed order. Requires K % 32 == 0. Returns 0 on
 * success. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

/* y[n] = sum_k float(w[n, k]) * x[k] in float32: bfloat16 weights (N, K) row-major, float32 x (K,) and y (N,), one
 * thread, any K >= 1. For the fold pre-pass's BOS forward (hfquant.integration.bos_importance): each weight read once
 * as stored, no float32 copy of it. Sixteen partial sums per row (element k into sum k % 16, by fused multiply-adds,
 * in order of k), added in a fixed tree at the row's end, in both bodies (AVX-512 and C): the same float32 results.
 * Returns 0, 1 for n < 0 or k < 1. */
#define BF16_F32_LANES 16

static inline float bf16_f32_tree(float *acc) {
    for (int width = BF16_F32_LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) acc[i] = acc[i] + acc[i + width];
    return acc[0];
}

static void bf16_f32_row_c(const uint16_t *row, const float *x, int64_t k, float *y) {
    float acc[BF16_F32_LANES] = {0};
    for (int64_t i = 0; i < k; i++)
        acc[i % BF16_F32_LANES] = fmaf(bf16_to_float(row[i]), x[i], acc[i % BF16_F32_LANES]);
    *y = bf16_f32_tree(acc);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
int hfquant_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    if (k % 32 || k <= 0 || n <= 0) return 1;
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
    return 0;
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

int hfquant_bf16_f32_gemv(const uint16_t *w, const float *x, float *y, int64_t n, int64_t k) {
    if (n < 0 || k < 1) return 1;
    const int wide = HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512);
    for (int64_t r = 0; r < n; r++) {
        if (wide)
            bf16_f32_row_avx512(w + r * k, x, k, y + r);
        else
            bf16_f32_row_c(w + r * k, x, k, y + r);
    }
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
