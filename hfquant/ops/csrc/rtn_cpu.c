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
 * raises). Rows are split over `threads` OpenMP threads (0: OpenMP's default); every output depends on its own row
 * only, so the bytes do not depend on the count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

/* Three bodies of one row, the same bytes (the same float32 operations per value): AVX-512 for groups of a multiple of
 * 16, AVX2 for groups of a multiple of 8, the generic loops otherwise; hfquant_isa decides which instructions the CPU
 * (or HFQUANT_ISA) allows. -DRTN_FORCE_GENERIC: the generic loops only. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(RTN_FORCE_GENERIC)
#include <immintrin.h>
#define RTN_AVX512 1
#define RTN_AVX2 1
#define RTN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define RTN_TARGET_AVX2 __attribute__((target("avx2")))
#endif

/* The group scale from its (lo, hi) as rtn_group makes it (bfloat16 bits into *scale_out, the zero point into
 * *zero_out when asymmetric); sets (shift, cmin, cmax) of the codes; returns 1 if the scale is not finite. */
static inline int group_scale(float lo, float hi, int bits, int symmetric, uint16_t *scale_out, uint8_t *zero_out,
                              float *sf_out, float *shift, float *cmin, float *cmax) {
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
    *sf_out = sf;
    if (symmetric) {
        *shift = bits == 4 ? 8.5f : 128.5f;
        *cmin = 1.0f;
        *cmax = levels;
    } else {
        float z = nearbyintf(-lo / sf);
        z = z < 0.0f ? 0.0f : (z > levels ? levels : z);
        *zero_out = (uint8_t)z;
        *shift = z + 0.5f;
        *cmin = 0.0f;
        *cmax = levels;
    }
    return 0;
}

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
    float sf, shift, cmin, cmax;
    if (group_scale(lo, hi, bits, symmetric, scale_out, zero_out, &sf, &shift, &cmin, &cmax)) return 1;
    for (int64_t i = 0; i < group; i++) {
        float q = shift + x[i] / sf;
        q = q < cmin ? cmin : (q > cmax ? cmax : q);
        codes[i] = (uint8_t)(int32_t)q;
    }
    return 0;
}

#ifdef RTN_AVX512
/* group_scale for 16 groups at once (lanes), the same float32 and integer operations lane by lane: min / max against
 * zero take the same operand as the scalar ternaries, the bfloat16 rounding is float_to_bf16's, nearbyintf is a
 * round to nearest even. Writes the bfloat16 scale bits, the zero points (asymmetric), the quotient's divisor and
 * shift per lane; returns 1 if a scale is not finite. */
RTN_TARGET_AVX512 static inline int group_scales_x16(__m512 lo, __m512 hi, int bits, int symmetric, uint16_t *scale_out,
                                   uint8_t *zero_out, float *sf_out, float *shift_out) {
    const __m512 zero = _mm512_setzero_ps(), levels = _mm512_set1_ps(bits == 4 ? 15.0f : 255.0f);
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 s;
    if (symmetric) {
        const __m512 alo = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(lo), absmask));
        const __m512 ahi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(hi), absmask));
        const __m512 m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(alo, ahi, _CMP_GT_OQ), ahi, alo);
        s = _mm512_div_ps(m, _mm512_set1_ps(bits == 4 ? 7.0f : 127.0f));
    } else {
        lo = _mm512_min_ps(lo, zero); /* lo < 0 ? lo : 0 */
        hi = _mm512_max_ps(hi, zero); /* hi > 0 ? hi : 0 */
        s = _mm512_sub_ps(_mm512_div_ps(hi, levels), _mm512_div_ps(lo, levels));
    }
    const __m512 abs_s = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(s), absmask));
    if (_mm512_cmp_ps_mask(abs_s, _mm512_set1_ps(3.402823466e38f), _CMP_LE_OQ) != 0xFFFF) return 1;
    s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f), s);
    const __m512i b = _mm512_castps_si512(s);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i stored = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __mmask16 below = _mm512_cmp_ps_mask(_mm512_castsi512_ps(_mm512_slli_epi32(stored, 16)), s, _CMP_LT_OQ);
    stored = _mm512_mask_add_epi32(stored, below, stored, _mm512_set1_epi32(1));
    const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(stored, 16));
    _mm256_storeu_si256((__m256i *)scale_out, _mm512_cvtepi32_epi16(stored));
    _mm512_storeu_ps(sf_out, sf);
    if (symmetric) {
        _mm512_storeu_ps(shift_out, _mm512_set1_ps(bits == 4 ? 8.5f : 128.5f));
    } else {
        const __m512 neg_lo = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(lo), _mm512_set1_epi32((int)0x80000000u)));
        __m512 z = _mm512_roundscale_ps(_mm512_div_ps(neg_lo, sf), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        z = _mm512_min_ps(_mm512_max_ps(z, zero), levels); /* z < 0 ? 0 : (z > L ? L : z); a -0 makes code 0 alike */
        _mm_storeu_si128((__m128i *)zero_out, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(z)));
        _mm512_storeu_ps(shift_out, _mm512_add_ps(z, _mm512_set1_ps(0.5f)));
    }
    return 0;
}

/* rtn_quantize's work on one row of k inputs in groups of a multiple of 16, 16 lanes at a time, from the stored row
 * itself: widening (or float32 loads), the fold's product (a = 1: none) and quotient, each group's min / max, the
 * scales of 16 groups at once (group_scales_x16), then the codes, written packed at 4 bits (even input in the low
 * nibble) or as bytes at 8 bits (minus 128 as int8 when symmetric). The same float32 operations per value as the
 * loops of rtn_quantize + rtn_group (IEEE products and quotients, the clamp of non-NaN values, truncation): the same
 * bytes. Work space: xf (k floats), and 5 arrays of `groups` rounded up to 16 floats. Returns 1 on a non-finite
 * value or scale. */
RTN_TARGET_AVX512 static int rtn_row_avx512(const void *src, int is_bf16, float a, const float *c, int64_t k, int64_t group, int bits,
                          int symmetric, float *xf, float *work, uint8_t *out, uint16_t *scale_out,
                          uint8_t *zero_out) {
    const int64_t groups = k / group, padded = (groups + 15) / 16 * 16;
    float *lo = work, *hi = lo + padded, *sf = hi + padded, *shift = sf + padded;
    uint16_t *scales = (uint16_t *)(shift + padded);
    uint8_t *zeros = (uint8_t *)(scales + padded);
    const __m512 va = _mm512_set1_ps(a), big = _mm512_set1_ps(3.402823466e38f);
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __mmask16 finite = 0xFFFF;
    for (int64_t g = 0; g < groups; g++) {
        __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_set1_ps(-INFINITY);
        for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
            __m512 x;
            if (is_bf16) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
                x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            } else {
                x = _mm512_loadu_ps((const float *)src + i);
            }
            if (a != 1.0f) x = _mm512_mul_ps(x, va); /* a product by 1 is exact: 1 stands for no row factors */
            if (c) x = _mm512_div_ps(x, _mm512_loadu_ps(c + i));
            _mm512_storeu_ps(xf + i, x);
            vlo = _mm512_min_ps(vlo, x);
            vhi = _mm512_max_ps(vhi, x);
            finite &= _mm512_cmp_ps_mask(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absmask)), big,
                                         _CMP_LE_OQ);
        }
        /* min and max in any order: only the sign of a zero could differ, which changes neither s nor z */
        lo[g] = _mm512_reduce_min_ps(vlo);
        hi[g] = _mm512_reduce_max_ps(vhi);
    }
    if (finite != 0xFFFF) return 1;
    for (int64_t g = groups; g < padded; g++) lo[g] = hi[g] = 0.0f; /* padding lanes: a finite scale of 1 */
    for (int64_t g = 0; g < padded; g += 16)
        if (group_scales_x16(_mm512_loadu_ps(lo + g), _mm512_loadu_ps(hi + g), bits, symmetric, scales + g,
                             zeros + g, sf + g, shift + g))
            return 1;
    memcpy(scale_out, scales, (size_t)groups * sizeof(uint16_t));
    if (!symmetric) memcpy(zero_out, zeros, (size_t)groups);
    const __m512 vmin = _mm512_set1_ps(symmetric ? 1.0f : 0.0f), vmax = _mm512_set1_ps(bits == 4 ? 15.0f : 255.0f);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 vsf = _mm512_set1_ps(sf[g]), vshift = _mm512_set1_ps(shift[g]);
        for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
            __m512 q = _mm512_add_ps(vshift, _mm512_div_ps(_mm512_loadu_ps(xf + i), vsf));
            q = _mm512_min_ps(_mm512_max_ps(q, vmin), vmax);
            const __m512i codes = _mm512_cvttps_epi32(q);
            if (bits == 4) { /* the odd code of each pair into the high nibble of the even one's 64-bit lane */
                const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi64(codes, 28));
                _mm_storel_epi64((__m128i *)(out + i / 2), _mm512_cvtepi64_epi8(pairs));
            } else {
                __m128i bytes = _mm512_cvtepi32_epi8(codes);
                if (symmetric) bytes = _mm_xor_si128(bytes, _mm_set1_epi8((char)0x80));
                _mm_storeu_si128((__m128i *)(out + i), bytes);
            }
        }
    }
    return 0;
}
#endif

#ifdef RTN_AVX2
/* rtn_row_avx512's work for groups of a multiple of 8 on AVX2 (Haswell to Zen 3), 8 lanes at a time: the same float32
 * operations per value (widening, the fold's product and quotient, min / max, the quotient by the scale, its shift,
 * clamp and truncation), each group's scale by the scalar group_scale. The codes go out as one byte each into out8
 * (the caller packs them at 4 bits and flips the sign bit at 8 bits symmetric, as after the generic loops). Work
 * space: xf (k floats). Returns 1 on a non-finite value or scale. */
RTN_TARGET_AVX2 static int rtn_row_avx2(const void *src, int is_bf16, float a, const float *c, int64_t k, int64_t group,
                                        int bits, int symmetric, float *xf, uint8_t *out8, uint16_t *scale_out,
                                        uint8_t *zero_out) {
    const __m256 va = _mm256_set1_ps(a), big = _mm256_set1_ps(3.402823466e38f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    /* byte 0 of each 32-bit lane to the front of its 128-bit half, then the halves' four bytes side by side */
    const __m256i first_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                                 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i halves = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    for (int64_t g = 0; g < k / group; g++) {
        const int64_t start = g * group, end = start + group;
        __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY);
        __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (int64_t i = start; i < end; i += 8) {
            __m256 x;
            if (is_bf16) {
                const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
                x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                x = _mm256_loadu_ps((const float *)src + i);
            }
            if (a != 1.0f) x = _mm256_mul_ps(x, va); /* a product by 1 is exact: 1 stands for no row factors */
            if (c) x = _mm256_div_ps(x, _mm256_loadu_ps(c + i));
            _mm256_storeu_ps(xf + i, x);
            vlo = _mm256_min_ps(vlo, x);
            vhi = _mm256_max_ps(vhi, x);
            finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_and_ps(x, absmask), big, _CMP_LE_OQ));
        }
        if (_mm256_movemask_ps(finite) != 0xFF) return 1;
        float lanes_lo[8], lanes_hi[8], lo = INFINITY, hi = -INFINITY;
        _mm256_storeu_ps(lanes_lo, vlo);
        _mm256_storeu_ps(lanes_hi, vhi);
        for (int j = 0; j < 8; j++) { /* in any order: only the sign of a zero could differ (see rtn_group) */
            lo = lanes_lo[j] < lo ? lanes_lo[j] : lo;
            hi = lanes_hi[j] > hi ? lanes_hi[j] : hi;
        }
        float sf, shift, cmin, cmax;
        if (group_scale(lo, hi, bits, symmetric, scale_out + g, symmetric ? NULL : zero_out + g, &sf, &shift, &cmin,
                        &cmax))
            return 1;
        const __m256 vsf = _mm256_set1_ps(sf), vshift = _mm256_set1_ps(shift);
        const __m256 vmin = _mm256_set1_ps(cmin), vmax = _mm256_set1_ps(cmax);
        for (int64_t i = start; i < end; i += 8) {
            __m256 q = _mm256_add_ps(vshift, _mm256_div_ps(_mm256_loadu_ps(xf + i), vsf));
            q = _mm256_min_ps(_mm256_max_ps(q, vmin), vmax); /* q is never NaN here: the ternaries' clamp */
            const __m256i codes = _mm256_cvttps_epi32(q);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(codes, first_bytes), halves);
            _mm_storel_epi64((__m128i *)(out8 + i), _mm256_castsi256_si128(bytes));
        }
    }
    return 0;
}
#endif

/* the generic loops of one row (any group dividing k): each group widened into xf (group floats), the fold's factors
 * applied, then rtn_group; codes one byte each into out8. Returns 1 on a non-finite value or scale. */
static int rtn_row_generic(const void *w, int w_is_bf16, int64_t r, int64_t k, int64_t group, int bits, int symmetric,
                           const float *row_scale, const float *col_scale, float *xf, uint8_t *out8,
                           uint16_t *scale_out, uint8_t *zero_out) {
    for (int64_t g = 0; g < k / group; g++) {
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
        if (rtn_group(xf, group, bits, symmetric, out8 + g * group, scale_out + g, symmetric ? NULL : zero_out + g))
            return 1;
    }
    return 0;
}

/* the row body hfquant_isa allows for this group size: 2 AVX-512, 1 AVX2, 0 the generic loops */
static int rtn_body(int64_t group) {
#ifdef RTN_AVX512
    if (group % 16 == 0 && HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512)) return 2;
    if (group % 8 == 0 && HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2)) return 1;
#endif
    (void)group;
    return 0;
}

static int rtn_quantize(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits, int symmetric,
                        const float *row_scale, const float *col_scale, uint8_t *codes, uint16_t *scale,
                        uint8_t *zero_point, int64_t threads) {
    if (n <= 0 || k <= 0 || group <= 0 || k % group || (bits != 4 && bits != 8) || (bits == 4 && k % 2) ||
        group > 65536 || (!symmetric && zero_point == NULL) || threads < 0)
        return 1;
    const int64_t groups = k / group;
    const int team = threads > 0 ? (int)threads : omp_get_max_threads();
    const int body = rtn_body(group);
    int bad = 0;
#pragma omp parallel num_threads(team) reduction(| : bad)
    {
        float xf[body ? 1 : group];
        uint8_t row_codes[bits == 4 ? k : 1];
        /* the vector bodies' row of scaled values; AVX-512's per-group scalars (4 float arrays, scale bits, zeros) */
        float xrow[body ? k : 1];
        float work[body == 2 ? ((groups + 15) / 16 * 16) * 5 + 16 : 1];
        (void)work;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (bad) continue;
            const void *src = (const char *)w + (size_t)(r * k) * (w_is_bf16 ? 2 : 4);
            const float a = row_scale ? row_scale[r] : 1.0f;
            uint16_t *row_scales = scale + r * groups;
            uint8_t *row_zeros = symmetric ? NULL : zero_point + r * groups;
#ifdef RTN_AVX512
            if (body == 2) {
                bad |= rtn_row_avx512(src, w_is_bf16, a, col_scale, k, group, bits, symmetric, xrow, work,
                                      codes + r * (bits == 4 ? k / 2 : k), row_scales, row_zeros);
                continue;
            }
#endif
            uint8_t *out = bits == 4 ? row_codes : codes + r * k;
#ifdef RTN_AVX2
            if (body == 1)
                bad |= rtn_row_avx2(src, w_is_bf16, a, col_scale, k, group, bits, symmetric, xrow, out, row_scales,
                                    row_zeros);
            else
#endif
                bad |= rtn_row_generic(w, w_is_bf16, r, k, group, bits, symmetric, row_scale, col_scale, xf, out,
                                       row_scales, row_zeros);
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
                         uint8_t *codes, uint16_t *scale, uint8_t *zero_point, int64_t threads) {
    return rtn_quantize(w, w_is_bf16, n, k, group, bits, symmetric, NULL, NULL, codes, scale, zero_point, threads);
}

/* The same with a fold's factors (hfquant.core.folding.Transform) applied to each value first: x * row_scale[n] when
 * row_scale is not NULL ((N,) float32), then x / col_scale[k] when col_scale is not NULL ((K,) float32), each rounded
 * to float32 as torch's `chunk.float() * row_scale[:, None] / col_scale` rounds them: the same bytes as quantizing that
 * float32 chunk, without making it. */
int hfquant_rtn_quantize_scaled(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits,
                                int symmetric, const float *row_scale, const float *col_scale, uint8_t *codes,
                                uint16_t *scale, uint8_t *zero_point, int64_t threads) {
    return rtn_quantize(w, w_is_bf16, n, k, group, bits, symmetric, row_scale, col_scale, codes, scale, zero_point,
                        threads);
}
