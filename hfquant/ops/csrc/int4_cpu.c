/* hfquant's int4 CPU kernels on the layout of PyTorch's _weight_int4pack_mm_for_cpu (AVX-512 "halves" blocks):
 * hfquant_int4_gemv (one activation row) and hfquant_int4_dequantize_t (weight columns for a prefill GEMM), and the
 * repacking between that layout and the stored one (hfquant_int4_to_cpu_layout / _from_cpu_layout); with the library's
 * ABI number and CPU check. The int8 GEMV is in int8_cpu.c, the integer-dot-product int4 GEMVs in int4_intdot_cpu.c.
 *
 * GEMV:
 *   y[n] = sum_g ( scale[g,n] * sum_{k in g} q[n,k] * x[k]  +  (zero[g,n] - 8 * scale[g,n]) * sum_{k in g} x[k] )
 *
 * which is x @ w.T for w[n,k] = (q[n,k] - 8) * scale[g,n] + zero[g,n], the formula of the aten kernel.
 *
 * Inputs (all contiguous, little-endian):
 *   x:      (K,) bfloat16 activations.
 *   weight: (N / 64, K, 32) uint8: for block b, input k, byte j holds q[64b + j, k] in the low nibble and
 *           q[64b + 32 + j, k] in the high nibble (hfquant.core.packing:
 *           CpuInt4Layout(block_n=64, full_blocks_halves=True)).
 *   scale_zero: (K / group, N, 2) bfloat16 [scale, zero] pairs, as hfquant.core.packing.scale_zero_for_int4 makes them.
 * Output: y (N,) bfloat16, each value accumulated in float32 and rounded once (round to nearest even).
 *
 * How: codes become the bfloat16 of 128 + q by a shuffle, a shift and a bit operation (see hfquant_int4_gemv) and two
 * inputs at a time are multiplied and summed in float32 by vdpbf16ps (AVX512-BF16), 64 outputs per block; the group's
 * scale and offset are applied once per group.
 * OpenMP threads split the blocks (the process's libgomp, which torch loaded first, so torch.set_num_threads holds).
 * Each output is computed by one thread in a fixed order: results do not depend on the thread count.
 *
 * Requires N % 64 == 0, group even, K % group == 0, K / group <= 16384; the caller checks. Returns 0 on success.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define HFQUANT_INT4_CPU_ABI 7

int hfquant_int4_cpu_abi(void) { return HFQUANT_INT4_CPU_ABI; }

/* Repacking between the stored int4 layout (N, K/2): byte i of row n holds q[n, 2i] (low nibble) and q[n, 2i + 1]
 * (high nibble), and the CPU kernel layout (N/64, K, 32): byte [b, k, j] holds q[64b + j, k] (low) and
 * q[64b + 32 + j, k] (high). One pass each way instead of unpacking every code to a byte first (torch ops: about
 * 10x the time); to the kernel layout (every load repacks) 16 stored bytes of 64 rows at a time through 16 x 16 byte
 * transposes (5x the byte loop on one thread at 8192 x 2048); to the kernel layout also in place (out == stored: no
 * second tensor, whose page faults cost a load as much as the pass). Require N % 64 == 0 and K even; return 0 on
 * success. */
#if defined(__x86_64__)
#include <emmintrin.h> /* SSE2: every x86-64 CPU */

/* 16 x 16 bytes: byte j of out[i] = byte i of in[j], by four rounds of interleaving (8-, 16-, 32-, 64-bit units) */
static inline void transpose16(const __m128i *in, __m128i *out) {
    __m128i a[16], b[16], c[16];
    for (int p = 0; p < 8; p++) { /* rows 2p, 2p + 1: a[p] columns 0-7, a[8 + p] columns 8-15 */
        a[p] = _mm_unpacklo_epi8(in[2 * p], in[2 * p + 1]);
        a[8 + p] = _mm_unpackhi_epi8(in[2 * p], in[2 * p + 1]);
    }
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 4; q++) { /* rows 4q..4q + 3: b[4m + q] columns 4m..4m + 3 */
            b[8 * h + q] = _mm_unpacklo_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
            b[8 * h + 4 + q] = _mm_unpackhi_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
        }
    for (int m = 0; m < 4; m++)
        for (int o = 0; o < 2; o++) { /* rows 8o..8o + 7: c[2d + o] columns 2d, 2d + 1 */
            c[4 * m + o] = _mm_unpacklo_epi32(b[4 * m + 2 * o], b[4 * m + 2 * o + 1]);
            c[4 * m + 2 + o] = _mm_unpackhi_epi32(b[4 * m + 2 * o], b[4 * m + 2 * o + 1]);
        }
    for (int d = 0; d < 8; d++) {
        out[2 * d] = _mm_unpacklo_epi64(c[2 * d], c[2 * d + 1]);
        out[2 * d + 1] = _mm_unpackhi_epi64(c[2 * d], c[2 * d + 1]);
    }
}
#endif

/* One block of 64 stored rows (`rows`, 64 x k / 2 bytes) into its k x 32 bytes of the kernel layout at `dst`; `whole`:
 * the stored bytes of a row done 16 at a time by the tile transposes (x86), the rest one at a time. */
static void block_to_cpu_layout(const uint8_t *rows, uint8_t *dst, int64_t k, int64_t whole) {
    const int64_t half = k / 2;
#if defined(__x86_64__)
    const __m128i low = _mm_set1_epi8(0x0F), high = _mm_set1_epi8((char)0xF0);
    for (int64_t i0 = 0; i0 < whole; i0 += 16) {
        __m128i in[16], t[4][16]; /* t[s][i]: byte i0 + i of the block's rows 16s..16s + 15 */
        for (int s = 0; s < 4; s++) {
            for (int j = 0; j < 16; j++) in[j] = _mm_loadu_si128((const __m128i *)(rows + (16 * s + j) * half + i0));
            transpose16(in, t[s]);
        }
        for (int i = 0; i < 16; i++) { /* inputs 2(i0 + i) and 2(i0 + i) + 1: rows j (low nibble), 32 + j (high) */
            uint8_t *even = dst + 2 * (i0 + i) * 32, *odd = even + 32;
            for (int part = 0; part < 2; part++) {
                const __m128i l = t[part][i], h = t[2 + part][i];
                _mm_storeu_si128((__m128i *)(even + 16 * part),
                                 _mm_or_si128(_mm_and_si128(l, low), _mm_and_si128(_mm_slli_epi16(h, 4), high)));
                _mm_storeu_si128((__m128i *)(odd + 16 * part),
                                 _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l, 4), low), _mm_and_si128(h, high)));
            }
        }
    }
#endif
    for (int64_t j = 0; j < 32; j++) {
        const uint8_t *lo = rows + j * half, *hi = rows + (32 + j) * half;
        for (int64_t i = whole; i < half; i++) {
            const uint8_t l = lo[i], h = hi[i];
            dst[(2 * i) * 32 + j] = (uint8_t)((l & 0x0F) | (h << 4));
            dst[(2 * i + 1) * 32 + j] = (uint8_t)((l >> 4) | (h & 0xF0));
        }
    }
}

/* out == stored repacks in place: a block's 64 stored rows and its kernel-layout bytes are the same k x 32 bytes, so
 * each block is first copied to a buffer of the thread's (k x 32 bytes, in L2), then written back repacked. Returns
 * 2 when that buffer cannot be allocated (nothing written then). */
int hfquant_int4_to_cpu_layout(const uint8_t *stored, uint8_t *out, int64_t n, int64_t k) {
    if (n % 64 || k % 2 || n <= 0 || k <= 0) return 1;
    const int64_t half = k / 2, blocks = n / 64;
    const int in_place = stored == out;
    int64_t whole = 0; /* stored bytes done 16 at a time, by transposing 16 x 16 byte tiles (x86) */
#if defined(__x86_64__)
    whole = half / 16 * 16;
#endif
    int oom = 0;
#pragma omp parallel
    {
        uint8_t *copy = in_place ? malloc((size_t)k * 32) : NULL;
        if (in_place && copy == NULL) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp barrier
        int stop; /* the same value in every thread after the barrier: all or none reach the loop */
#pragma omp atomic read
        stop = oom;
        if (!stop) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *rows = stored + 64 * b * half;
                if (in_place) {
                    memcpy(copy, rows, (size_t)k * 32);
                    rows = copy;
                }
                block_to_cpu_layout(rows, out + b * k * 32, k, whole);
            }
        }
        free(copy);
    }
    return oom ? 2 : 0;
}

int hfquant_int4_from_cpu_layout(const uint8_t *layout, uint8_t *stored, int64_t n, int64_t k) {
    if (n % 64 || k % 2 || n <= 0 || k <= 0) return 1;
    const int64_t half = k / 2, blocks = n / 64;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *src = layout + b * k * 32;
        for (int64_t j = 0; j < 32; j++) {
            uint8_t *lo = stored + (64 * b + j) * half, *hi = stored + (64 * b + 32 + j) * half;
            for (int64_t i = 0; i < half; i++) {
                const uint8_t even = src[(2 * i) * 32 + j], odd = src[(2 * i + 1) * 32 + j];
                lo[i] = (uint8_t)((even & 0x0F) | (odd << 4));
                hi[i] = (uint8_t)((even >> 4) | (odd & 0xF0));
            }
        }
    }
    return 0;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* AVX512-F/BW/VL and BF16 as hfquant_isa (isa_cpu.c) allows: HFQUANT_ISA=avx2 makes this CPU look like an AVX2 one */
int hfquant_int4_cpu_supported(void) { return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16); }

/* sum of n bfloat16 values in float32: 16 lanes, then the lanes (a fixed order for a given n); scalar tail */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static float bf16_sum(const uint16_t *x, int64_t n) {
    __m512 lanes = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        lanes = _mm512_add_ps(lanes, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16)));
    float s = _mm512_reduce_add_ps(lanes);
    for (; i < n; i++) s += bf16_to_float(x[i]);
    return s;
}

/* The GEMV's steps, per block of 64 output channels and pair of inputs (i, i + 1), whose 64 bytes are contiguous:
 * byte j of input i holds rows j (low nibble) and j + 32 (high nibble).
 * 1. One vpermw (AVX512BW) puts the two inputs' 16-bit words m side by side: 32-bit lane m holds bytes 2m and 2m + 1
 *    of input i, then the same bytes of input i + 1 (PAIR_WORDS).
 * 2. Shifting lane m right by 0, 4, 8 or 12 bits brings the nibble of row 2m, 2m + 32, 2m + 1 or 2m + 33 of input i
 *    to bits 0-3 and that of input i + 1 to bits 16-19; one vpternlogd keeps them and ORs 0x4300 into each half:
 *    0x4300 | q is the bfloat16 of 128 + q, exactly (bfloat16 holds integers up to 256).
 * 3. vdpbf16ps multiplies the bfloat16 pair (128 + q[r, i], 128 + q[r, i + 1]) with (x[i], x[i + 1]) and adds both
 *    products to a float32 lane: per pair of inputs one shuffle, three shifts, four vpternlogd, four vdpbf16ps for
 *    128 codes (a code table and byte unpacks cost four times the shuffles, which bound it on AMD Zen 4).
 * The four accumulators hold rows (0, 2, ..., 30), (32, ..., 62), (1, ..., 31), (33, ..., 63): the scale and zero
 * pairs are loaded in that order (EVEN_ROWS / ODD_ROWS) and the outputs put back in row order once per block.
 * Per group the float32 sum is scale * sum (128 + q) x + (zero - 136 scale) * sum x. */
static const uint16_t PAIR_WORDS[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31,
};
static const uint32_t EVEN_ROWS[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const uint32_t ODD_ROWS[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
static const uint32_t INTERLEAVE_LOW[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const uint32_t INTERLEAVE_HIGH[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* vpternlogd truth table of (a & b) | c */
#define AND_OR 0xEA

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
int hfquant_int4_gemv(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                      int64_t n, int64_t k, int64_t group) {
    if (n % 64 || group % 2 || group <= 0 || k % group || k / group > 16384) return 1;
    const int64_t blocks = n / 64, groups = k / group;
    float xsum[groups];
    for (int64_t g = 0; g < groups; g++) xsum[g] = bf16_sum(x + g * group, group);
    const uint32_t *x_pairs = (const uint32_t *)x; /* (x[2i], x[2i + 1]) */

#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const __m512i pair_words = _mm512_loadu_si512(PAIR_WORDS);
        const __m512i even = _mm512_loadu_si512(EVEN_ROWS), odd = _mm512_loadu_si512(ODD_ROWS);
        const __m512i nibbles = _mm512_set1_epi32(0x000F000F), bf16_128 = _mm512_set1_epi32(0x43004300);
        const __m512i zero_bits = _mm512_set1_epi32((int)0xFFFF0000u);
        const __m512 bias = _mm512_set1_ps(136.0f); /* 128 of the bfloat16 codes + 8 of the stored format */
        const uint8_t *block = weight + b * k * 32;
        __m512 out[4];
        for (int r = 0; r < 4; r++) out[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512 acc[4];
            for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t i = g * group; i < (g + 1) * group; i += 2) {
                const __m512i words = _mm512_permutexvar_epi16(pair_words, _mm512_loadu_si512(block + i * 32));
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x_pairs[i / 2]);
                for (int r = 0; r < 4; r++) {
                    const __m512i shifted = r == 0 ? words : _mm512_srli_epi32(words, 4 * r);
                    const __m512i codes = _mm512_ternarylogic_epi32(shifted, nibbles, bf16_128, AND_OR);
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)codes, xv);
                }
            }
            const __m512 group_sum = _mm512_set1_ps(xsum[g]);
            const uint32_t *pairs = scale_zero + g * n + b * 64;
            const __m512i p0 = _mm512_loadu_si512(pairs), p1 = _mm512_loadu_si512(pairs + 16);
            const __m512i p2 = _mm512_loadu_si512(pairs + 32), p3 = _mm512_loadu_si512(pairs + 48);
            const __m512i p[4] = {
                _mm512_permutex2var_epi32(p0, even, p1), /* rows 0, 2, ..., 30: acc[0] (shift 0) */
                _mm512_permutex2var_epi32(p2, even, p3), /* rows 32, ..., 62: acc[1] (shift 4) */
                _mm512_permutex2var_epi32(p0, odd, p1),  /* rows 1, ..., 31: acc[2] (shift 8) */
                _mm512_permutex2var_epi32(p2, odd, p3),  /* rows 33, ..., 63: acc[3] (shift 12) */
            };
            for (int r = 0; r < 4; r++) {
                const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(p[r], 16));
                const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(p[r], zero_bits));
                const __m512 offset = _mm512_fnmadd_ps(bias, scale, zero);
                out[r] = _mm512_fmadd_ps(scale, acc[r], out[r]);
                out[r] = _mm512_fmadd_ps(offset, group_sum, out[r]);
            }
        }
        const __m512i low = _mm512_loadu_si512(INTERLEAVE_LOW), high = _mm512_loadu_si512(INTERLEAVE_HIGH);
        const __m512 rows[4] = {
            _mm512_permutex2var_ps(out[0], low, out[2]),  /* rows 0-15 */
            _mm512_permutex2var_ps(out[0], high, out[2]), /* rows 16-31 */
            _mm512_permutex2var_ps(out[1], low, out[3]),  /* rows 32-47 */
            _mm512_permutex2var_ps(out[1], high, out[3]), /* rows 48-63 */
        };
        for (int r = 0; r < 4; r++)
            _mm256_storeu_si256((__m256i *)(y + b * 64 + 16 * r), (__m256i)_mm512_cvtneps_pbh(rows[r]));
    }
    return 0;
}

/* Dequantize: out (K, stop - start) bfloat16, row-major, out[k, c] = bf16(q[start + c, k] * scale + zero - 8 * scale)
 * for output channels start <= n < stop (multiples of 64), i.e. the transposed weight columns torch.mm reads. Each
 * value is computed in float32 and rounded once. Same inputs and requirements as the GEMV. Returns 0 on success. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
int hfquant_int4_dequantize_t(const uint8_t *weight, const uint32_t *scale_zero, uint16_t *out, int64_t n, int64_t k,
                              int64_t group, int64_t start, int64_t stop) {
    if (n % 64 || start % 64 || stop % 64 || start < 0 || stop > n || start >= stop || group <= 0 || k % group)
        return 1;
    const int64_t width = stop - start, groups = k / group;

#pragma omp parallel for schedule(static)
    for (int64_t b = start / 64; b < stop / 64; b++) {
        const __m128i low_nibble = _mm_set1_epi8(0x0F);
        const __m512i zero_bits = _mm512_set1_epi32((int)0xFFFF0000u);
        const __m512 eight = _mm512_set1_ps(8.0f);
        const uint8_t *block = weight + b * k * 32;
        uint16_t *columns = out + (b * 64 - start);
        for (int64_t g = 0; g < groups; g++) {
            __m512 scale[4], offset[4];
            const uint32_t *pairs = scale_zero + g * n + b * 64;
            for (int r = 0; r < 4; r++) {
                const __m512i p = _mm512_loadu_si512(pairs + 16 * r);
                scale[r] = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
                offset[r] = _mm512_fnmadd_ps(eight, scale[r], _mm512_castsi512_ps(_mm512_and_si512(p, zero_bits)));
            }
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                const __m128i lo_half = _mm_loadu_si128((const __m128i *)(block + i * 32));
                const __m128i hi_half = _mm_loadu_si128((const __m128i *)(block + i * 32 + 16));
                const __m128i codes[4] = {
                    _mm_and_si128(lo_half, low_nibble),                     /* rows 0-15 */
                    _mm_and_si128(hi_half, low_nibble),                     /* rows 16-31 */
                    _mm_and_si128(_mm_srli_epi16(lo_half, 4), low_nibble),  /* rows 32-47 */
                    _mm_and_si128(_mm_srli_epi16(hi_half, 4), low_nibble),  /* rows 48-63 */
                };
                uint16_t *row = columns + i * width;
                for (int r = 0; r < 4; r++) {
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes[r]));
                    const __m256bh w = _mm512_cvtneps_pbh(_mm512_fmadd_ps(q, scale[r], offset[r]));
                    _mm256_storeu_si256((__m256i *)(row + 16 * r), (__m256i)w);
                }
            }
        }
    }
    return 0;
}

#else

int hfquant_int4_cpu_supported(void) { return 0; }

int hfquant_int4_gemv(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                      int64_t n, int64_t k, int64_t group) {
    (void)x; (void)weight; (void)scale_zero; (void)y; (void)n; (void)k; (void)group;
    return 1;
}

int hfquant_int4_dequantize_t(const uint8_t *weight, const uint32_t *scale_zero, uint16_t *out, int64_t n, int64_t k,
                              int64_t group, int64_t start, int64_t stop) {
    (void)weight; (void)scale_zero; (void)out; (void)n; (void)k; (void)group; (void)start; (void)stop;
    return 1;
}

#endif
