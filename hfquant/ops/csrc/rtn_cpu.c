/* hfquant's round-to-nearest (RTN) quantizer in one pass: the same codes, scales and zero points as
 * hfquant.core.rtn.quantize_weight (clipping "minmax") followed by hfquant.core.packing.pack_int4, bit for bit, without
 * the float32 copy and the five torch passes per chunk (min, max, scale, addcdiv, cast, then packing).
 *
 * For each row n and group g of `group` consecutive inputs, with x the float32 values (bfloat16 widened exactly):
 *   lo = min(x), hi = max(x)
 *   symmetric:  s = max(|lo|, |hi|) / qmax                          (qmax = 7 at 4 bits, 127 at 8)
 *   asymmetric: lo = min(lo, 0), hi = max(hi, 0), s = hi / L - lo / L   (L = 2^bits - 1)
 *   s = s > 0 ? s : 1, rounded to bfloat16 to nearest even, then one bfloat16 step up if that made it smaller
 *   asymmetric: z = clamp(round_half_even(-lo / s), 0, L)
 *   code = trunc(clamp(shift + x / s, cmin, cmax)), shift = z + 0.5 (asymmetric), 8.5 (4-bit symmetric: codes
 *          1..15), 128.5 (8-bit symmetric: codes 1..255, stored as code - 128 in int8)
 * which is rtn.py's math in the same float32 operations and order (x / s is a division, not a product by 1 / s).
 *
 * Inputs: w (N, K) contiguous, bfloat16 (w_is_bf16 = 1) or float32; group divides K; bits 4 (K even) or 8.
 * Outputs (contiguous): codes (N, K / 2) uint8 at 4 bits, even input in the low nibble; (N, K) int8 or uint8 at 8;
 *   scale (N, K / group) bfloat16; zero_point (N, K / group) uint8 when asymmetric (else not written, may be NULL).
 * Returns 0; 1 for bad arguments; 2 when w holds a NaN or an infinity (nothing meaningful to write: the caller
 * raises). Rows are split over OpenMP threads; every output depends on its own row only.
 */
#if defined(__x86_64__) && defined(__GNUC__)
/* the loops below vectorize to 16 floats per instruction; hfquant loads this library only on CPUs with AVX512-BF16 */
#pragma GCC target("avx512f,avx512bw,avx512vl")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

/* quantize one group of `group` float32 values into codes (one byte each); returns 1 if a value is not finite */
static int rtn_group(const float *x, int64_t group, int bits, int symmetric, uint8_t *codes, uint16_t *scale_out,
                     uint8_t *zero_out) {
    float lo = x[0], hi = x[0];
    int finite = 1;
    /* min and max in any order: only the sign of a zero could differ, and it changes neither s nor z below; NaN and
     * infinities are caught by `finite` */
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(& : finite)
    for (int64_t i = 0; i < group; i++) {
        const float v = x[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        finite &= fabsf(v) <= 3.402823466e38f;
    }
    if (!finite) return 1;
    const float levels = bits == 4 ? 15.0f : 255.0f;
    float s;
    if (symmetric) {
        const float m = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi);
        s = m / (bits == 4 ? 7.0f : 127.0f);
    } else {
        lo = lo < 0.0f ? lo : 0.0f;
        hi = hi > 0.0f ? hi : 0.0f;
        s = hi / levels - lo / levels;
    }
    if (!(fabsf(s) <= 3.402823466e38f)) return 1;
    s = s > 0.0f ? s : 1.0f;
    uint16_t stored = float_to_bf16(s);
    if (bf16_to_float(stored) < s) stored += 1; /* the next bfloat16 up (positive, finite) */
    const float sf = bf16_to_float(stored);
    *scale_out = stored;
    float shift, cmin, cmax;
    if (symmetric) {
        shift = bits == 4 ? 8.5f : 128.5f;
        cmin = 1.0f;
        cmax = levels;
    } else {
        float z = nearbyintf(-lo / sf);
        z = z < 0.0f ? 0.0f : (z > levels ? levels : z);
        *zero_out = (uint8_t)z;
        shift = z + 0.5f;
        cmin = 0.0f;
        cmax = levels;
    }
    for (int64_t i = 0; i < group; i++) {
        float q = shift + x[i] / sf;
        q = q < cmin ? cmin : (q > cmax ? cmax : q);
        codes[i] = (uint8_t)(int32_t)q;
    }
    return 0;
}

static int rtn_quantize(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits, int symmetric,
                        const float *row_scale, const float *col_scale, uint8_t *codes, uint16_t *scale,
                        uint8_t *zero_point) {
    if (n <= 0 || k <= 0 || group <= 0 || k % group || (bits != 4 && bits != 8) || (bits == 4 && k % 2) ||
        group > 65536 || (!symmetric && zero_point == NULL))
        return 1;
    const int64_t groups = k / group;
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float xf[group];
        uint8_t row_codes[bits == 4 ? k : 1];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (bad) continue;
            uint8_t *out = bits == 4 ? row_codes : codes + r * k;
            for (int64_t g = 0; g < groups && !bad; g++) {
                const int64_t start = r * k + g * group;
                if (w_is_bf16) {
                    const uint16_t *src = (const uint16_t *)w + start;
                    for (int64_t i = 0; i < group; i++) xf[i] = bf16_to_float(src[i]);
                } else {
                    memcpy(xf, (const float *)w + start, (size_t)group * sizeof(float));
                }
                if (row_scale) { /* a fold's factors: the float32 product, then the quotient, as torch computes them */
                    const float a = row_scale[r];
                    for (int64_t i = 0; i < group; i++) xf[i] = xf[i] * a;
                }
                if (col_scale) {
                    const float *c = col_scale + g * group;
                    for (int64_t i = 0; i < group; i++) xf[i] = xf[i] / c[i];
                }
                bad |= rtn_group(xf, group, bits, symmetric, out + g * group, scale + r * groups + g,
                                 symmetric ? NULL : zero_point + r * groups + g);
            }
            if (bits == 4) {
                uint8_t *packed = codes + r * (k / 2);
#pragma omp simd
                for (int64_t i = 0; i < k / 2; i++) packed[i] = (uint8_t)(row_codes[2 * i] | (row_codes[2 * i + 1] << 4));
            } else if (symmetric) {
                for (int64_t i = 0; i < k; i++) out[i] ^= 0x80; /* code - 128 as int8 */
            }
        }
    }
    return bad ? 2 : 0;
}

int hfquant_rtn_quantize(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits, int symmetric,
                         uint8_t *codes, uint16_t *scale, uint8_t *zero_point) {
    return rtn_quantize(w, w_is_bf16, n, k, group, bits, symmetric, NULL, NULL, codes, scale, zero_point);
}

/* The same with a fold's factors (hfquant.core.folding.Transform) applied to each value first: x * row_scale[n] when
 * row_scale is not NULL ((N,) float32), then x / col_scale[k] when col_scale is not NULL ((K,) float32), each rounded
 * to float32 as torch's `chunk.float() * row_scale[:, None] / col_scale` rounds them: the same bytes as quantizing that
 * float32 chunk, without making it. */
int hfquant_rtn_quantize_scaled(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits,
                                int symmetric, const float *row_scale, const float *col_scale, uint8_t *codes,
                                uint16_t *scale, uint8_t *zero_point) {
    return rtn_quantize(w, w_is_bf16, n, k, group, bits, symmetric, row_scale, col_scale, codes, scale, zero_point);
}
