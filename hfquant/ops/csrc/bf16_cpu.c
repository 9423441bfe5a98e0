/* bfloat16 GEMV for the float layers hfquant keeps (the lm_head of an int4 model is often the largest weight read
 * per token): y[n] = bf16(sum_k w[n,k] * x[k] + bias[n]) for one activation row.
 *   x: (K,) bfloat16; w: (N, K) bfloat16 row-major; bias: (N,) bfloat16 or NULL; y: (N,) bfloat16.
 * How: vdpbf16ps (AVX512-BF16, Intel's instruction set reference: "Dot Product of BF16 Pairs Accumulated into Packed
 * Single Precision") multiplies 32 bfloat16 pairs and adds them into 16 float32 lanes, two accumulators per row; the
 * lanes are summed at the row's end, the bias added, and the sum rounded once to bfloat16 (nearest even). OpenMP
 * threads split the rows; each output is summed by one thread in a fixed order. Requires K % 32 == 0. Returns 0 on
 * success. */
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

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

#else

int hfquant_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    (void)x; (void)w; (void)bias; (void)y; (void)n; (void)k;
    return 1;
}

#endif
