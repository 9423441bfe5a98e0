/* One-row int4 GEMVs by integer dot products: the activation row is quantized per block of 32 inputs to integers,
 * multiplied with the 4-bit codes in integer arithmetic, and each block's sum scaled back in float32.
 * - hfquant_int4_gemv_a8 (below): int8 activations (W4A8), for one-token decode steps when the model asks for it
 *   (HfQuantConfig(decode_activations="int8")); AVX512-VNNI on the 64-row layout, AVX2 on the 32-row one.
 * - hfquant_int4_gemv_avx2 (further down): int16 activations (bfloat16 accuracy), the default one-row kernel on CPUs
 *   without AVX-512, where PyTorch packs int4 weights in 32-row blocks.
 *
 * hfquant_int4_gemv_a8: the one-row int4 GEMV of int4_cpu.c with the activations quantized to int8.
 *
 * Same inputs, layout and output as hfquant_int4_gemv (int4_cpu.c): x (K,) bfloat16; weight (N / 64, K, 32) uint8,
 * byte [b, k, j] = q[64b + j, k] (low nibble) | q[64b + 32 + j, k] (high nibble); scale_zero (K / group, N, 2)
 * bfloat16 [scale, zero]; y (N,) bfloat16, w[n, k] = (q[n, k] - 8) * scale + zero, so
 *
 *   y[n] = sum_g ( scale[g,n] * sum_{k in g} q[n,k] * x[k]  +  (zero[g,n] - 8 * scale[g,n]) * sum_{k in g} x[k] ).
 *
 * What changes: in the first term x is replaced by its int8 quantization per block of 32 inputs,
 *   x[k] ~= xs[b] * xq[k],  xs[b] = max_{k in b} |x[k]| / 127,  xq[k] = round(x[k] / xs[b])  (to nearest even),
 * the activation format of llama.cpp's Q8_0 (ggml-common.h, block_q8_0: 32 int8 values and one scale), which its
 * Q4_0 / Q4_1 dot products use. The second term sums the same quantized x (sum_b xs[b] * sum_{k in b} xq[k]), so the
 * result is exactly x_hat @ w.T for the quantized row x_hat: the error is sum_k w[n,k] * (x_hat[k] - x[k]), with
 * |x_hat[k] - x[k]| <= xs[b] / 2 = max_{k in b} |x[k]| / 254. (Keeping the exact sum of x there instead leaves the
 * codes' common mode, about 7.5 * scale * sum_k (x_hat[k] - x[k]), uncancelled: several times the error,
 * docs/performance.md.)
 *
 * How: the unsigned 4-bit codes times the signed int8 activations, four products per 32-bit lane, summed into int32
 * by vpdpbusd (Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 2: "VPDPBUSD: Multiply and Add
 * Unsigned and Signed Bytes"; 4 x 15 x 127 per instruction and lane, 8 instructions per block: far from overflow).
 * The layout stores 32 rows' codes of one input k in 32 bytes; two byte unpacks and two word unpacks of four inputs'
 * vectors gather (k, k+1, k+2, k+3) of one row into each 32-bit lane (rows in the lane order of the unpacks, put back
 * in order at the store), and a mask and a shift split the nibbles into rows j and j + 32. Per 256 codes: 4 loads,
 * 8 shuffles, 12 bitwise ops, 8 vpdpbusd. (The bfloat16-activation kernel of int4_cpu.c needs 2 shuffles, 8 bitwise
 * ops and 8 vdpbf16ps for the same 256 codes since 2026-11-25: on AMD Zen 4 both then read at the memory's speed when
 * streamed, and this one is faster only on layers that stay in cache, docs/performance.md.)
 * Each block's int32 sums become float32 once, times xs[b]; each group's float32 sum is scaled as in int4_cpu.c.
 * OpenMP threads split the 64-row blocks; each output is computed by one thread in a fixed order.
 *
 * Requires N % 64 == 0, group % 32 == 0, K % group == 0, K / group <= 16384 and AVX512-VNNI + AVX512-BF16
 * (hfquant_int4_a8_supported(64)); returns 1 for a refused shape, 2 when memory runs out, 0 on success.
 *
 * AVX2 CPUs (block_n = 32): there PyTorch's int4 layout has 32-row blocks, (N / 32, K, 16) uint8, byte [b, k, j] =
 * q[32b + j, k] | q[32b + 16 + j, k] << 4, and aten's kernel reads it at a fraction of the memory bandwidth (8 GB/s
 * for 35 GB/s on an AMD EPYC Zen 4 run with ATEN_CPU_CAPABILITY=avx2, docs/performance.md). The same computation runs
 * on AVX2 + FMA: 128-bit unpacks gather each row's four inputs, vpmaddubsw multiplies unsigned codes by signed
 * activations into int16 pairs (at most 2 x 15 x 127 each; summed over the 8 steps of a block: at most 30480, no
 * saturation) and vpmaddwd by ones widens them to int32 once per block, the way llama.cpp's AVX2 Q4 x Q8 dot
 * products do (ggml-cpu, mul_sum_i8_pairs). Requires N % 32 == 0 and the same group constraints
 * (hfquant_int4_a8_supported(32)).
 */
#include <stdint.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define A8_BLOCK 32

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* which kernels run: hfquant_isa (isa_cpu.c) decides (HFQUANT_ISA=avx2 refuses the AVX-512 one on any CPU) */
static int avx512_vnni(void) {
    return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16 | HFQUANT_ISA_AVX512_VNNI);
}

static int avx2_fma(void) { return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2); }

/* whether the W4A8 GEMV for PyTorch's int4 layout with blocks of block_n rows (64: AVX-512, 32: AVX2) runs here */
int hfquant_int4_a8_supported(int64_t block_n) {
    return block_n == 64 ? avx512_vnni() : block_n == 32 ? avx2_fma() : 0;
}

/* The quantized row of one call: codes (K values of code_bytes each), xs (a float32 scale per block of 32) and xsum
 * (each group's sum of the quantized row, float32). */
typedef struct {
    void *codes;
    float *xs, *xsum;
} QuantizedRow;

static int quantized_row_alloc(QuantizedRow *row, int64_t k, int64_t group, size_t code_bytes) {
    row->codes = _mm_malloc((size_t)k * code_bytes, 64);
    row->xs = (float *)_mm_malloc((size_t)(k / A8_BLOCK) * sizeof(float), 64);
    row->xsum = (float *)_mm_malloc((size_t)(k / group) * sizeof(float), 64);
    return row->codes != NULL && row->xs != NULL && row->xsum != NULL;
}

static void quantized_row_free(QuantizedRow *row) {
    _mm_free(row->codes);
    _mm_free(row->xs);
    _mm_free(row->xsum);
}

#define A8_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

/* x -> xq (int8, K), xs (float32 per block of 32) and xsum (each group's sum of the quantized x, in float32) */
A8_TARGET static void quantize_row(const uint16_t *x, int64_t k, int64_t group, int8_t *xq, float *xs, float *xsum) {
    const int64_t per_group = group / A8_BLOCK;
    for (int64_t b = 0; b < k / A8_BLOCK; b++) {
        __m512 v[2];
        __m512 largest = _mm512_setzero_ps();
        for (int j = 0; j < 2; j++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(x + b * A8_BLOCK + 16 * j));
            v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            largest = _mm512_max_ps(largest, _mm512_abs_ps(v[j]));
        }
        const float top = _mm512_reduce_max_ps(largest);
        const __m512 to_int = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        xs[b] = top / 127.0f;
        __m512i codes_sum = _mm512_setzero_si512();
        for (int j = 0; j < 2; j++) {  /* |x| * 127 / top <= 127: the saturating narrowing never clips */
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], to_int));
            codes_sum = _mm512_add_epi32(codes_sum, q);
            _mm_storeu_si128((__m128i *)(xq + b * A8_BLOCK + 16 * j), _mm512_cvtsepi32_epi8(q));
        }
        if (b % per_group == 0) xsum[b / per_group] = 0.0f;
        xsum[b / per_group] += xs[b] * (float)_mm512_reduce_add_epi32(codes_sum);
    }
}

/* Register i of a block holds, lane by lane, rows ROW_BASE(i) + {0, 1, 2, 3, 16, 17, 18, 19}. */
#define ROW_BASE(i) (((i) & 3) * 4 + ((i) >> 2) * 32)

A8_TARGET static int gemv_a8_avx512(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                                    int64_t n, int64_t k, int64_t group) {
    const int64_t blocks = n / 64, groups = k / group, per_group = group / A8_BLOCK;
    QuantizedRow row;
    if (!quantized_row_alloc(&row, k, group, 1)) {
        quantized_row_free(&row);
        return 2;
    }
    const float *xs = row.xs, *xsum = row.xsum;
    quantize_row(x, k, group, (int8_t *)row.codes, row.xs, row.xsum);
    const int32_t *xquads = (const int32_t *)row.codes; /* (xq[4t], ..., xq[4t + 3]) */

#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i zero_bits = _mm256_set1_epi32((int)0xFFFF0000u);
        const uint8_t *block = weight + b * k * 32;
        __m256 out[8];
        for (int i = 0; i < 8; i++) out[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 group_acc[8];
            for (int i = 0; i < 8; i++) group_acc[i] = _mm256_setzero_ps();
            for (int64_t xb = g * per_group; xb < (g + 1) * per_group; xb++) {
                __m256i acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
                for (int64_t t = xb * (A8_BLOCK / 4); t < (xb + 1) * (A8_BLOCK / 4); t++) {
                    const uint8_t *p = block + t * 4 * 32;
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)p);
                    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
                    const __m256i v2 = _mm256_loadu_si256((const __m256i *)(p + 64));
                    const __m256i v3 = _mm256_loadu_si256((const __m256i *)(p + 96));
                    /* per 128-bit half: byte pairs (k, k+1) then (k+2, k+3) of rows 0-7 | 16-23 and 8-15 | 24-31 */
                    const __m256i lo01 = _mm256_unpacklo_epi8(v0, v1), hi01 = _mm256_unpackhi_epi8(v0, v1);
                    const __m256i lo23 = _mm256_unpacklo_epi8(v2, v3), hi23 = _mm256_unpackhi_epi8(v2, v3);
                    const __m256i quads[4] = {_mm256_unpacklo_epi16(lo01, lo23), _mm256_unpackhi_epi16(lo01, lo23),
                                              _mm256_unpacklo_epi16(hi01, hi23), _mm256_unpackhi_epi16(hi01, hi23)};
                    const __m256i xv = _mm256_set1_epi32(xquads[t]);
                    for (int i = 0; i < 4; i++) {
                        acc[i] = _mm256_dpbusd_epi32(acc[i], _mm256_and_si256(quads[i], nibble), xv);
                        acc[4 + i] = _mm256_dpbusd_epi32(
                            acc[4 + i], _mm256_and_si256(_mm256_srli_epi16(quads[i], 4), nibble), xv);
                    }
                }
                const __m256 block_scale = _mm256_set1_ps(xs[xb]);
                for (int i = 0; i < 8; i++)
                    group_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), block_scale, group_acc[i]);
            }
            const __m256 group_sum = _mm256_set1_ps(xsum[g]);
            const uint32_t *pairs = scale_zero + g * n + b * 64;
            for (int i = 0; i < 8; i++) {
                const __m256i p = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pairs + ROW_BASE(i)))),
                    _mm_loadu_si128((const __m128i *)(pairs + ROW_BASE(i) + 16)), 1);
                const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
                const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(p, zero_bits));
                const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
                out[i] = _mm256_fmadd_ps(scale, group_acc[i], out[i]);
                out[i] = _mm256_fmadd_ps(offset, group_sum, out[i]);
            }
        }
        for (int i = 0; i < 8; i++) {
            uint16_t lanes[8];
            _mm_storeu_si128((__m128i *)lanes, (__m128i)_mm256_cvtneps_pbh(out[i]));
            for (int j = 0; j < 4; j++) {
                y[b * 64 + ROW_BASE(i) + j] = lanes[j];
                y[b * 64 + ROW_BASE(i) + 16 + j] = lanes[4 + j];
            }
        }
    }
    quantized_row_free(&row);
    return 0;
}

#define AVX2_TARGET __attribute__((target("avx2,fma")))

/* x -> codes per block of 32 (int8 codes when max_code is 127, int16 when 32767: round(x * max_code / max|x_block|),
 * to nearest even), the block scales and the groups' sums of the quantized row; AVX2 only, the values of
 * quantize_row for int8 (the multiply and the rounding are IEEE operations) */
AVX2_TARGET static void quantize_row_avx2(const uint16_t *x, int64_t k, int64_t group, int max_code,
                                          QuantizedRow *row) {
    const int64_t per_group = group / A8_BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / A8_BLOCK; b++) {
        __m256 v[4];
        __m256 largest = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(x + b * A8_BLOCK + 8 * j));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[j]));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, largest);
        float top = lanes[0];
        for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
        const __m256 to_int = _mm256_set1_ps(top > 0.0f ? (float)max_code / top : 0.0f);
        row->xs[b] = top / (float)max_code;
        int32_t q[A8_BLOCK];
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(q + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(v[j], to_int)));
        int32_t codes_sum = 0;
        for (int j = 0; j < A8_BLOCK; j++) {  /* |q| <= max_code */
            if (max_code == 127)
                ((int8_t *)row->codes)[b * A8_BLOCK + j] = (int8_t)q[j];
            else
                ((int16_t *)row->codes)[b * A8_BLOCK + j] = (int16_t)q[j];
            codes_sum += q[j];
        }
        if (b % per_group == 0) row->xsum[b / per_group] = 0.0f;
        row->xsum[b / per_group] += row->xs[b] * (float)codes_sum;
    }
}

/* out[i] (rows 8i..8i+7 of a 32-row block) += scale * group_acc[i] + (zero - 8 * scale) * group_sum, from the group's
 * (scale, zero) pairs of these 32 rows */
AVX2_TARGET static inline void apply_group_avx2(__m256 out[4], const __m256 group_acc[4], const uint32_t *pairs,
                                                float group_sum) {
    const __m256i zero_bits = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256 sums = _mm256_set1_ps(group_sum);
    for (int i = 0; i < 4; i++) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(pairs + 8 * i));
        const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
        const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(p, zero_bits));
        const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
        out[i] = _mm256_fmadd_ps(scale, group_acc[i], out[i]);
        out[i] = _mm256_fmadd_ps(offset, sums, out[i]);
    }
}

/* the 32 outputs of a block, each rounded once to bfloat16 */
AVX2_TARGET static inline void store_rows_avx2(uint16_t *y, const __m256 out[4]) {
    for (int i = 0; i < 4; i++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, out[i]);
        for (int j = 0; j < 8; j++) y[8 * i + j] = float_to_bf16(lanes[j]);
    }
}

AVX2_TARGET static int gemv_a8_avx2(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                                    int64_t n, int64_t k, int64_t group) {
    const int64_t blocks = n / 32, groups = k / group, per_group = group / A8_BLOCK;
    QuantizedRow row;
    if (!quantized_row_alloc(&row, k, group, 1)) {
        quantized_row_free(&row);
        return 2;
    }
    quantize_row_avx2(x, k, group, 127, &row);
    const int32_t *xquads = (const int32_t *)row.codes;

#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i ones = _mm256_set1_epi16(1);
        const uint8_t *block = weight + b * k * 16;
        __m256 out[4]; /* rows 0-7, 8-15, 16-23, 24-31 */
        for (int i = 0; i < 4; i++) out[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 group_acc[4];
            for (int i = 0; i < 4; i++) group_acc[i] = _mm256_setzero_ps();
            for (int64_t xb = g * per_group; xb < (g + 1) * per_group; xb++) {
                __m256i acc[4];
                for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_si256();
                for (int64_t t = xb * (A8_BLOCK / 4); t < (xb + 1) * (A8_BLOCK / 4); t++) {
                    const uint8_t *p = block + t * 4 * 16;
                    const __m128i k0 = _mm_loadu_si128((const __m128i *)p);
                    const __m128i k1 = _mm_loadu_si128((const __m128i *)(p + 16));
                    const __m128i k2 = _mm_loadu_si128((const __m128i *)(p + 32));
                    const __m128i k3 = _mm_loadu_si128((const __m128i *)(p + 48));
                    const __m128i lo01 = _mm_unpacklo_epi8(k0, k1), hi01 = _mm_unpackhi_epi8(k0, k1);
                    const __m128i lo23 = _mm_unpacklo_epi8(k2, k3), hi23 = _mm_unpackhi_epi8(k2, k3);
                    /* (k, k+1, k+2, k+3) of rows 0-7 and of rows 8-15, one row per 32-bit lane, in row order */
                    const __m256i quads[2] = {
                        _mm256_set_m128i(_mm_unpackhi_epi16(lo01, lo23), _mm_unpacklo_epi16(lo01, lo23)),
                        _mm256_set_m128i(_mm_unpackhi_epi16(hi01, hi23), _mm_unpacklo_epi16(hi01, hi23)),
                    };
                    const __m256i xv = _mm256_set1_epi32(xquads[t]);
                    for (int i = 0; i < 2; i++) {
                        acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(_mm256_and_si256(quads[i], nibble), xv));
                        acc[2 + i] = _mm256_add_epi16(
                            acc[2 + i],
                            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(quads[i], 4), nibble), xv));
                    }
                }
                const __m256 block_scale = _mm256_set1_ps(row.xs[xb]);
                for (int i = 0; i < 4; i++)
                    group_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i], ones)), block_scale,
                                                   group_acc[i]);
            }
            apply_group_avx2(out, group_acc, scale_zero + g * n + b * 32, row.xsum[g]);
        }
        store_rows_avx2(y + b * 32, out);
    }
    quantized_row_free(&row);
    return 0;
}

/* hfquant_int4_gemv_avx2: the bfloat16-activation GEMV for AVX2 CPUs (PyTorch's 32-row layout), the default path
 * there (chosen per shape against aten's kernel by measurement, hfquant.ops.choice). The activations become int16 per
 * block of 32 inputs, xq = round(x * 32767 / max|x_block|): the rounding error, at most max|x_block| / 65534, is
 * about 1/128 of the bfloat16 rounding of the block's largest input (the argument of the W8A16 int8 GEMV in
 * int8_cpu.c), so the result keeps bfloat16 accuracy. Codes are widened to int16 (vpmovzxbw) and multiplied with
 * pairs of activations by vpmaddwd (two products per int32 lane; over a block at most 16 x 2 x 15 x 32767, far from
 * overflow); the zero-point term sums the same int16 activations. Same inputs as the W4A8 GEMV; N % 32 == 0,
 * group % 32 == 0. Returns 1 for a refused shape or a CPU without AVX2 + FMA, 2 when memory runs out. */
AVX2_TARGET int hfquant_int4_gemv_avx2(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero,
                                       uint16_t *y, int64_t n, int64_t k, int64_t group) {
    if (!avx2_fma()) return 1;
    if (n % 32 || group <= 0 || group % A8_BLOCK || k % group || k / group > 16384) return 1;
    const int64_t blocks = n / 32, groups = k / group, per_group = group / A8_BLOCK;
    QuantizedRow row;
    if (!quantized_row_alloc(&row, k, group, 2)) {
        quantized_row_free(&row);
        return 2;
    }
    quantize_row_avx2(x, k, group, 32767, &row);
    const int32_t *xpairs = (const int32_t *)row.codes; /* (xq[2i], xq[2i + 1]) */

#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i nibble = _mm256_set1_epi16(0x0F);
        const uint8_t *block = weight + b * k * 16;
        __m256 out[4]; /* rows 0-7, 8-15, 16-23, 24-31 */
        for (int i = 0; i < 4; i++) out[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 group_acc[4];
            for (int i = 0; i < 4; i++) group_acc[i] = _mm256_setzero_ps();
            for (int64_t xb = g * per_group; xb < (g + 1) * per_group; xb++) {
                __m256i acc[4];
                for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_si256();
                for (int64_t t = xb * (A8_BLOCK / 2); t < (xb + 1) * (A8_BLOCK / 2); t++) {
                    const uint8_t *p = block + t * 2 * 16;
                    const __m128i k0 = _mm_loadu_si128((const __m128i *)p);
                    const __m128i k1 = _mm_loadu_si128((const __m128i *)(p + 16));
                    /* (k, k+1) byte pairs of rows 0-7 and 8-15, widened: one row per 32-bit lane, in row order */
                    const __m256i pairs[2] = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(k0, k1)),
                                              _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(k0, k1))};
                    const __m256i xv = _mm256_set1_epi32(xpairs[t]);
                    for (int i = 0; i < 2; i++) {
                        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_and_si256(pairs[i], nibble), xv));
                        acc[2 + i] = _mm256_add_epi32(acc[2 + i], _mm256_madd_epi16(_mm256_srli_epi16(pairs[i], 4), xv));
                    }
                }
                const __m256 block_scale = _mm256_set1_ps(row.xs[xb]);
                for (int i = 0; i < 4; i++)
                    group_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), block_scale, group_acc[i]);
            }
            apply_group_avx2(out, group_acc, scale_zero + g * n + b * 32, row.xsum[g]);
        }
        store_rows_avx2(y + b * 32, out);
    }
    quantized_row_free(&row);
    return 0;
}

int hfquant_int4_gemv_a8(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                         int64_t n, int64_t k, int64_t group, int64_t block_n) {
    if (!hfquant_int4_a8_supported(block_n)) return 1;
    if (n % block_n || group <= 0 || group % A8_BLOCK || k % group || k / group > 16384) return 1;
    return block_n == 64 ? gemv_a8_avx512(x, weight, scale_zero, y, n, k, group)
                         : gemv_a8_avx2(x, weight, scale_zero, y, n, k, group);
}

#else

int hfquant_int4_gemv_avx2(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                           int64_t n, int64_t k, int64_t group) {
    (void)x; (void)weight; (void)scale_zero; (void)y; (void)n; (void)k; (void)group;
    return 1;
}

int hfquant_int4_a8_supported(int64_t block_n) {
    (void)block_n;
    return 0;
}

int hfquant_int4_gemv_a8(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                         int64_t n, int64_t k, int64_t group, int64_t block_n) {
    (void)x; (void)weight; (void)scale_zero; (void)y; (void)n; (void)k; (void)group; (void)block_n;
    return 1;
}

#endif
