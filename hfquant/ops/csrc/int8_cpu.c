/* hfquant's int8 GEMV, on the row-major layout hfquant stores and _weight_int8pack_mm reads:
 * hfquant_int8_gemv, y[n] = bf16(scale[n] * sum_k q[n,k] * x[k]) for one activation row.
 *   x:      (K,) bfloat16.
 *   weight: (N, K) int8, row-major (per-channel symmetric codes, as stored).
 *   scale:  (N,) bfloat16.
 *   y:      (N,) bfloat16, each value summed in float32 and rounded once (round to nearest even).
 * Two ways, the same result within the activation rounding described below:
 * - K % 64 == 0 on a CPU with AVX512-VNNI, or with AVX2 and no AVX-512 (the AVX2 body: the same bits): x is split
 *   into blocks of 64 and each block is scaled to int16, xq = round(x * 32767 / max|x_block|) (W8A16: the rounding
 *   error, at most max|x_block| / 65534 per element, is about 1/128 of the bfloat16 rounding of the block's largest
 *   activation, so the output keeps bfloat16 accuracy).
 *   Per block, 64 codes are sign-extended to int16 (vpmovsxbw) and multiplied with xq in pairs into int32 lanes
 *   (vpdpwssd, Intel's instruction set reference: "Multiply and Add Signed Word Integers"; 4 products per lane per
 *   block, far from int32 overflow), then converted to float32 and scaled by the block's scale (one FMA). This is
 *   two instructions per 32 codes where the float path below needs six (on AMD Zen 4, whose 512-bit units are
 *   double-pumped, the float path was instruction-bound at 23-30 GB/s; this one reads 31-34 GB/s, docs/performance.md).
 *   The AVX2 body makes the same int32 sums with vpmovsxbw + vpmaddwd + vpaddd, 8 lanes at a time (see its comment).
 * - otherwise: x is widened to float32 once; each step reads 16 codes, sign-extends them to int32, converts them to
 *   float32 (exact) and multiply-adds them with the 16 activations (vfmadd231ps); on AVX2, 8 codes a step.
 * Long rows (K > INT8_ROWS4_MIN_K; in the AVX2 W8A16 body K >= INT8_AVX2_ROWS4_MIN_K) go 4 rows at a time, each
 * activation block loaded once for the 4 (the same bits as one row at a time). OpenMP threads split the rows, in one
 * parallel region per call (the 4-row loop and the rest); each output is summed by one thread in a fixed order (no
 * dependence on the thread count).
 * Requires K % 16 == 0 (and K <= 2^20) and AVX512-F/BW/VL + BF16 or AVX2 + FMA + F16C (hfquant_int8_gemv_supported;
 * hfquant_isa picks the body: HFQUANT_ISA=avx2 runs the AVX2 bodies on an AVX-512 CPU). Returns 0 on success, 1 for
 * a refused shape or CPU, 2 when memory runs out. */
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
#ifndef INT8_ROWS4_MIN_K /* -D for measuring the 4-row loop on other K */
#define INT8_ROWS4_MIN_K 8192
#endif
/* the AVX2 W8A16 body's 4-row loop from this K (AMD Zen 3, one thread, rows from DRAM: 4-row time over one-row time
 * 1.21-1.34x at K = 2048, 0.82-1.02x at 4096, 0.70-0.76x at 8192, 0.65x at 16384; docs/performance.md, seventeenth
 * session). Short rows lose there, probably (not verified) because 4 streams of 2 KB each restart the prefetchers
 * where one row after another is a single sequential stream. */
#ifndef INT8_AVX2_ROWS4_MIN_K
#define INT8_AVX2_ROWS4_MIN_K 4096
#endif

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

/* the AVX2 body of the W8A16 dot (CPUs without AVX-512: Haswell to Zen 3). vpmaddwd multiplies 16 int16 pairs into
 * 8 int32 lanes as vpdpwssd does into 16, so the VNNI body's 16-lane int32 block sums are built as two halves: its lane
 * i (i < 8) sums words 2i and 2i+1 of both 32-code halves of the block, that is codes 0-15 and 32-47 here, and lane
 * 8 + i codes 16-31 and 48-63. The integers are exact (at most 4 * 128 * 32767 per lane), the float32 steps after
 * them (convert, one FMA by the block's scale per lane, int8_reduce16) are the VNNI body's in the same order, so both
 * bodies give the same bits (tests/ops/test_isa.py compares them where AVX-512 exists). */
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* the int32 sums of one 64-code block for lanes 0-7 (lo) and 8-15 (hi), as vpdpwssd's 16 lanes */
AVX2_TARGET static inline void int8_block_dot_avx2(const int8_t *w, const int16_t *x, __m256i *lo, __m256i *hi) {
    const __m256i a = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)),
                                        _mm256_load_si256((const __m256i *)x));
    const __m256i b = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16))),
                                        _mm256_load_si256((const __m256i *)(x + 16)));
    const __m256i c = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 32))),
                                        _mm256_load_si256((const __m256i *)(x + 32)));
    const __m256i d = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 48))),
                                        _mm256_load_si256((const __m256i *)(x + 48)));
    *lo = _mm256_add_epi32(a, c);
    *hi = _mm256_add_epi32(b, d);
}

/* the sum of 16 float32 lanes (lo: 0-7, hi: 8-15) in _mm512_reduce_add_ps's order (GCC's and LLVM's: the upper half
 * added to the lower, 16 -> 8 -> 4 -> 2 -> 1) */
AVX2_TARGET static inline float int8_reduce16(__m256 lo, __m256 hi) {
    const __m256 eight = _mm256_add_ps(hi, lo);
    const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    const __m128 two = _mm_add_ps(_mm_movehl_ps(four, four), four);
    return _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(two), two));
}

AVX2_TARGET static float int8_row_dot_w8a16_avx2(const int8_t *row, const int16_t *xq, const float *xs,
                                                 int64_t blocks) {
    __m256 acc_lo = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i lo, hi;
        int8_block_dot_avx2(row + b * INT8_BLOCK, xq + b * INT8_BLOCK, &lo, &hi);
        const __m256 s = _mm256_set1_ps(xs[b]);
        acc_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s, acc_lo);
        acc_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s, acc_hi);
    }
    return int8_reduce16(acc_lo, acc_hi);
}

AVX2_TARGET static void int8_rows4_dot_w8a16_avx2(const int8_t *rows, int64_t k, const int16_t *xq, const float *xs,
                                                  float *out) {
    __m256 acc_lo[4], acc_hi[4];
    for (int r = 0; r < 4; r++) acc_lo[r] = acc_hi[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / INT8_BLOCK; b++) {
        const __m256 s = _mm256_set1_ps(xs[b]);
        for (int r = 0; r < 4; r++) {
            __m256i lo, hi;
            int8_block_dot_avx2(rows + r * k + b * INT8_BLOCK, xq + b * INT8_BLOCK, &lo, &hi);
            acc_lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s, acc_lo[r]);
            acc_hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s, acc_hi[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = int8_reduce16(acc_lo[r], acc_hi[r]);
}

/* the float dot of one row on AVX2 (K % 64 != 0; K % 16 == 0): 8 codes a step, two accumulators. Not the AVX-512
 * float body's bits (8 lanes, not 16): within float32 summation of it. No 4-row form: such K are rare and untimed. */
AVX2_TARGET static float int8_row_dot_avx2(const int8_t *row, const float *xf, int64_t k) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i + 8))));
        acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + i), acc0);
        acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + i + 8), acc1);
    }
    return int8_reduce16(acc0, acc1);
}

/* x's blocks of 64 scaled to int16 for the W8A16 bodies (both run this, so their xq and xs are the same):
 * xq = round(x * (32767 / max|x_block|)) to nearest even (the MXCSR default, as lrintf), clamped to +-32767;
 * xs[b] = max|x_block| / 32767. An all-zero block gives zeros and scale 0. */
AVX2_TARGET static void int8_quantize_x(const uint16_t *x, int64_t blocks, int16_t *xq, float *xs) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[INT8_BLOCK / 8];
        __m256 largest = _mm256_setzero_ps();
        for (int j = 0; j < INT8_BLOCK / 8; j++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(x + b * INT8_BLOCK + 8 * j));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            largest = _mm256_max_ps(largest, _mm256_and_ps(v[j], magnitude));
        }
        __m128 top4 = _mm_max_ps(_mm256_extractf128_ps(largest, 1), _mm256_castps256_ps128(largest));
        top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
        const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
        const __m256 to_int = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
        xs[b] = top / 32767.0f;
        for (int j = 0; j < INT8_BLOCK / 8; j += 2) {
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], to_int));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], to_int));
            q0 = _mm256_max_epi32(_mm256_min_epi32(q0, _mm256_set1_epi32(32767)), _mm256_set1_epi32(-32767));
            q1 = _mm256_max_epi32(_mm256_min_epi32(q1, _mm256_set1_epi32(32767)), _mm256_set1_epi32(-32767));
            /* packs works per 128-bit lane (q0 0-3, q1 0-3, q0 4-7, q1 4-7): the permute puts the 16 in order */
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
            _mm256_store_si256((__m256i *)(xq + b * INT8_BLOCK + 8 * j), packed);
        }
    }
}

/* which body runs: hfquant_isa (isa_cpu.c) decides, so HFQUANT_ISA=avx512 picks the AVX-512 float body on a VNNI CPU
 * and HFQUANT_ISA=avx2 the AVX2 bodies on any AVX-512 CPU */
enum int8_body { INT8_FLOAT_AVX512, INT8_FLOAT_AVX2, INT8_W8A16_VNNI, INT8_W8A16_AVX2 };

/* the activations as the bodies read them: xf (K,) float32 for the float bodies; xq (K,) int16, 64-byte aligned, and
 * xs (K / 64,) float32 for the W8A16 ones */
struct int8_x {
    const float *xf;
    const int16_t *xq;
    const float *xs;
};

static float int8_dot(enum int8_body body, const int8_t *row, const struct int8_x *x, int64_t k) {
    switch (body) {
    case INT8_W8A16_VNNI: return int8_row_dot_w8a16(row, x->xq, x->xs, k / INT8_BLOCK);
    case INT8_W8A16_AVX2: return int8_row_dot_w8a16_avx2(row, x->xq, x->xs, k / INT8_BLOCK);
    case INT8_FLOAT_AVX512: return int8_row_dot(row, x->xf, k);
    default: return int8_row_dot_avx2(row, x->xf, k);
    }
}

/* the 4-row dots (every body but INT8_FLOAT_AVX2, which int8_quads gives no quads) */
static void int8_dot4(enum int8_body body, const int8_t *rows, const struct int8_x *x, int64_t k, float *out) {
    switch (body) {
    case INT8_W8A16_VNNI: int8_rows4_dot_w8a16(rows, k, x->xq, x->xs, out); break;
    case INT8_W8A16_AVX2: int8_rows4_dot_w8a16_avx2(rows, k, x->xq, x->xs, out); break;
    default: int8_rows4_dot(rows, x->xf, k, out); break;
    }
}

/* how many leading groups of 4 rows go 4 at a time */
static int64_t int8_quads(enum int8_body body, int64_t n, int64_t k) {
    switch (body) {
    case INT8_W8A16_VNNI: return k > INT8_ROWS4_MIN_K ? n / 4 : 0;
    case INT8_W8A16_AVX2: return k >= INT8_AVX2_ROWS4_MIN_K ? n / 4 : 0;
    case INT8_FLOAT_AVX512: return k >= INT8_ROWS4_MIN_K ? n / 4 : 0;
    default: return 0;
    }
}

static void int8_rows(enum int8_body body, const struct int8_x *x, const int8_t *weight, const uint16_t *scale,
                      uint16_t *y, int64_t n, int64_t k) {
    const int64_t quads = int8_quads(body, n, k);
#pragma omp parallel /* one team for both loops: a decode step calls this GEMV 16 times (SmolLM2), each fork counts */
    {
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; q++) {
            float dots[4];
            int8_dot4(body, weight + 4 * q * k, x, k, dots);
            for (int r = 0; r < 4; r++) y[4 * q + r] = float_to_bf16(bf16_to_float(scale[4 * q + r]) * dots[r]);
        }
#pragma omp for schedule(static) nowait
        for (int64_t r = 4 * quads; r < n; r++)
            y[r] = float_to_bf16(bf16_to_float(scale[r]) * int8_dot(body, weight + r * k, x, k));
    }
}

static enum int8_body int8_choose(int64_t k) {
    const int avx512 = HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16);
    if (k % INT8_BLOCK == 0) {
        if (avx512 && HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512_VNNI)) return INT8_W8A16_VNNI;
        if (!avx512) return INT8_W8A16_AVX2;
    }
    return avx512 ? INT8_FLOAT_AVX512 : INT8_FLOAT_AVX2;
}

int hfquant_int8_gemv_supported(void) {
    return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16) || HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2);
}

int hfquant_int8_gemv(const uint16_t *x, const int8_t *weight, const uint16_t *scale, uint16_t *y, int64_t n,
                      int64_t k) {
    if (k % 16 || k <= 0 || n <= 0 || k > (1 << 20)) return 1;
    if (!hfquant_int8_gemv_supported()) return 1;
    const enum int8_body body = int8_choose(k);
    /* one buffer: xf (K floats), or xq (K int16s) then xs (K / 64 floats; 2K bytes is a multiple of 128: aligned) */
    void *buffer = _mm_malloc((size_t)k * sizeof(float) + (size_t)(k / INT8_BLOCK) * sizeof(float), 64);
    if (buffer == NULL) return 2;
    struct int8_x prepared = {NULL, NULL, NULL};
    if (body == INT8_W8A16_VNNI || body == INT8_W8A16_AVX2) {
        int16_t *xq = (int16_t *)buffer;
        float *xs = (float *)(xq + k);
        int8_quantize_x(x, k / INT8_BLOCK, xq, xs);
        prepared.xq = xq;
        prepared.xs = xs;
    } else {
        float *xf = (float *)buffer;
        for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_float(x[i]);
        prepared.xf = xf;
    }
    int8_rows(body, &prepared, weight, scale, y, n, k);
    _mm_free(buffer);
    return 0;
}

#else

int hfquant_int8_gemv_supported(void) { return 0; }

int hfquant_int8_gemv(const uint16_t *x, const int8_t *weight, const uint16_t *scale, uint16_t *y, int64_t n,
                      int64_t k) {
    (void)x; (void)weight; (void)scale; (void)y; (void)n; (void)k;
    return 1;
}

#endif
