/* hfquant's int8 GEMV, on the row-major layout hfquant stores and _weight_int8pack_mm reads:
 * hfquant_int8_gemv, y[n] = bf16(scale[n] * sum_k q[n,k] * x[k]) for one activation row.
 *   x:      (K,) bfloat16.
 *   weight: (N, K) int8, row-major (per-channel symmetric codes, as stored).
 *   scale:  (N,) bfloat16.
 *   y:      (N,) bfloat16, each value summed in float32 and rounded once (round to nearest even).
 * Two ways, the same result within the activation rounding described below:
 * - K % 64 == 0 on a CPU with AVX512-VNNI: x is split into blocks of 64 and each block is scaled to int16,
 *   xq = round(x * 32767 / max|x_block|) (W8A16: the rounding error, at most max|x_block| / 65534 per element, is
 *   about 1/128 of the bfloat16 rounding of the block's largest activation, so the output keeps bfloat16 accuracy).
 *   Per block, 64 codes are sign-extended to int16 (vpmovsxbw) and multiplied with xq in pairs into int32 lanes
 *   (vpdpwssd, Intel's instruction set reference: "Multiply and Add Signed Word Integers"; 4 products per lane per
 *   block, far from int32 overflow), then converted to float32 and scaled by the block's scale (one FMA). This is
 *   two instructions per 32 codes where the float path below needs six (on AMD Zen 4, whose 512-bit units are
 *   double-pumped, the float path was instruction-bound at 23-30 GB/s; this one reads 31-34 GB/s, docs/performance.md).
 * - otherwise: x is widened to float32 once; each step reads 16 codes, sign-extends them to int32, converts them to
 *   float32 (exact) and multiply-adds them with the 16 activations (vfmadd231ps).
 * Long rows (K > INT8_ROWS4_MIN_K) go 4 rows at a time, each activation block loaded once for the 4. OpenMP threads
 * split the rows, in one parallel region per call (the 4-row loop and the rest); each output is summed by one thread
 * in a fixed order (no dependence on the thread count).
 * Requires K % 16 == 0 (and K <= 2^20) and AVX512-F/BW/VL + BF16. Returns 0 on success, 1 for a refused shape or
 * CPU, 2 when memory runs out. */
#include <stdint.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static float int8_row_dot(const int8_t *row, const float *xf, int64_t k) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i + 16))));
        acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + i), acc0);
        acc1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + i + 16), acc1);
    }
    for (; i < k; i += 16) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
        acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* rows this long go 4 at a time: their activations outgrow L1 and reloading them per row costs more than four
 * interleaved weight streams (AMD Zen 4, W8A16 path: 4096 x 14336 0.81x the one-row time, 2048 x 8192 1.09x) */
#define INT8_ROWS4_MIN_K 8192

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void int8_rows4_dot(const int8_t *rows, const float *xf, int64_t k, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < k; i += 16) {
        const __m512 xv = _mm512_loadu_ps(xf + i);
        for (int r = 0; r < 4; r++) {
            const __m128i codes = _mm_loadu_si128((const __m128i *)(rows + r * k + i));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), xv, acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#define INT8_BLOCK 64

/* the W8A16 dot of one row: blocks of 64 codes against the int16 activations xq, scaled per block by xs */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static float int8_row_dot_w8a16(const int8_t *row, const int16_t *xq, const float *xs, int64_t blocks) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *w = row + b * INT8_BLOCK;
        __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                          _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)),
                                          _mm512_load_si512((const void *)(xq + b * INT8_BLOCK)));
        dot = _mm512_dpwssd_epi32(dot, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32))),
                                  _mm512_load_si512((const void *)(xq + b * INT8_BLOCK + 32)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[b]), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void int8_rows4_dot_w8a16(const int8_t *rows, int64_t k, const int16_t *xq, const float *xs, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < k / INT8_BLOCK; b++) {
        const __m512i x0 = _mm512_load_si512((const void *)(xq + b * INT8_BLOCK));
        const __m512i x1 = _mm512_load_si512((const void *)(xq + b * INT8_BLOCK + 32));
        const __m512 s = _mm512_set1_ps(xs[b]);
        for (int r = 0; r < 4; r++) {
            const int8_t *w = rows + r * k + b * INT8_BLOCK;
            __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                              _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)), x0);
            dot = _mm512_dpwssd_epi32(dot, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32))), x1);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* which body runs: hfquant_isa (isa_cpu.c) decides, so HFQUANT_ISA=avx512 picks the float body on a VNNI CPU */
static int int8_has_vnni(void) { return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512_VNNI); }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))
static int int8_gemv_w8a16(const uint16_t *x, const int8_t *weight, const uint16_t *scale, uint16_t *y, int64_t n,
                           int64_t k) {
    const int64_t blocks = k / INT8_BLOCK;
    int16_t *xq = (int16_t *)_mm_malloc((size_t)k * sizeof(int16_t), 64);
    float *xs = (float *)_mm_malloc((size_t)blocks * sizeof(float), 64);
    if (xq == NULL || xs == NULL) {
        _mm_free(xq);
        _mm_free(xs);
        return 2;
    }
    /* per block of 64: scale to int16 by 32767 / max|x|, rounding to nearest even (the MXCSR default, as lrintf) */
    for (int64_t b = 0; b < blocks; b++) {
        __m512 v[INT8_BLOCK / 16];
        __m512 largest = _mm512_setzero_ps();
        for (int j = 0; j < INT8_BLOCK / 16; j++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(x + b * INT8_BLOCK + 16 * j));
            v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            largest = _mm512_max_ps(largest, _mm512_abs_ps(v[j]));
        }
        const float top = _mm512_reduce_max_ps(largest);
        const __m512 to_int = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
        xs[b] = top / 32767.0f;
        for (int j = 0; j < INT8_BLOCK / 16; j++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], to_int));
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32767));
            _mm256_store_si256((__m256i *)(xq + b * INT8_BLOCK + 16 * j), _mm512_cvtepi32_epi16(q));
        }
    }
    const int64_t quads = k > INT8_ROWS4_MIN_K ? n / 4 : 0;
#pragma omp parallel /* one team for both loops: a decode step calls this GEMV 16 times (SmolLM2), each fork counts */
    {
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; q++) {
            float dots[4];
            int8_rows4_dot_w8a16(weight + 4 * q * k, k, xq, xs, dots);
            for (int r = 0; r < 4; r++) y[4 * q + r] = float_to_bf16(bf16_to_float(scale[4 * q + r]) * dots[r]);
        }
#pragma omp for schedule(static) nowait
        for (int64_t r = 4 * quads; r < n; r++)
            y[r] = float_to_bf16(bf16_to_float(scale[r]) * int8_row_dot_w8a16(weight + r * k, xq, xs, blocks));
    }
    _mm_free(xq);
    _mm_free(xs);
    return 0;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
int hfquant_int8_gemv(const uint16_t *x, const int8_t *weight, const uint16_t *scale, uint16_t *y, int64_t n,
                      int64_t k) {
    if (k % 16 || k <= 0 || n <= 0 || k > (1 << 20)) return 1;
    if (!HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16)) return 1;
    if (k % INT8_BLOCK == 0 && int8_has_vnni()) return int8_gemv_w8a16(x, weight, scale, y, n, k);
    float *xf = (float *)_mm_malloc((size_t)k * sizeof(float), 64);
    if (xf == NULL) return 2;
    for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_float(x[i]);

    const int64_t quads = k >= INT8_ROWS4_MIN_K ? n / 4 : 0;
#pragma omp parallel
    {
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; q++) {
            float dots[4];
            int8_rows4_dot(weight + 4 * q * k, xf, k, dots);
            for (int r = 0; r < 4; r++) y[4 * q + r] = float_to_bf16(bf16_to_float(scale[4 * q + r]) * dots[r]);
        }
#pragma omp for schedule(static) nowait
        for (int64_t r = 4 * quads; r < n; r++)
            y[r] = float_to_bf16(bf16_to_float(scale[r]) * int8_row_dot(weight + r * k, xf, k));
    }
    _mm_free(xf);
    return 0;
}

#else

int hfquant_int8_gemv(const uint16_t *x, const int8_t *weight, const uint16_t *scale, uint16_t *y, int64_t n,
                      int64_t k) {
    (void)x; (void)weight; (void)scale; (void)y; (void)n; (void)k;
    return 1;
}

#endif
