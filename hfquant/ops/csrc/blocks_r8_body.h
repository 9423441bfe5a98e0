/* The GEMVs of IQ4_NL and IQ4_XS weights in the R8 layout (blocks_cpu.c's comment before r8_offset: 8 rows
 * interleaved block by block), AVX2 body only; included by blocks_cpu.c after the AVX2 body of blocks_body.h.
 *
 * Why: on an AVX2-only CPU the row kernels are bound by vector instructions, and per block of one row they pay the
 * code unpacking, the scale gather and a float product, and per row a horizontal sum. Here each 256-bit register of
 * codes holds 4 code bytes of each of 8 rows (int32 lane r: row r), so one broadcast of 4 activations serves the 8
 * rows, each int32 lane sums its row's products with no horizontal step, and the 8 rows' float16 block scales are one
 * load and one vcvtph2ps (issue #32; llama.cpp's repack.cpp does the same for IQ4_NL with 8-byte groups).
 *
 * Per chunk of 32 code bytes (4 per row): the low and high nibbles looked up on the signed grid (vpshufb), their
 * signs moved onto the activation's (vpsignb of the grid values by q: grid * sign(q)), multiplied by |q| (ActRow.qa,
 * unsigned) by vpmaddubsw: int16 pair sums of at most 2 * 127 * 127 = 32258, no saturation; then vpmaddwd into int32
 * lanes, by ones (IQ4_NL) or by the sub-block's scale - 32 as int16 (IQ4_XS, |scale - 32| <= 32).
 *   IQ4_NL: a block's int32 lane (32 products, at most 32 * 127 * 127 = 516128) is exact in float; y += that times
 *     d * dx by one fmadd per block.
 *   IQ4_XS: a super-block's int32 lane (256 products times scales: at most 256 * 127 * 127 * 32 = 132128768 <
 *     2^31, no overflow) converted once (one float32 rounding past 2^24) and times d * dx by one fmadd.
 * Every row's output is its lane of one group's computation, the same instructions whatever the group's other rows
 * or the threads' split (OpenMP splits the groups of 8 rows), rounded once to bfloat16. Against the row kernels: the
 * same integers per block (IQ4_NL) or super-block (IQ4_XS) up to that conversion, another float order: within
 * float32 summation and one bfloat16 step (tests/ops/test_block_rows8.py). */

/* How far ahead of the weight stream the R8 loops prefetch into the L2 (stream_ahead_'s role; R8_AHEAD 0: none) */
#ifndef R8_AHEAD
#define R8_AHEAD 16384
#endif
AVX2_ONLY_TARGET BK_INLINE void r8_ahead_(const uint8_t *p, int bytes) {
    if (R8_AHEAD)
        for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + R8_AHEAD + i), _MM_HINT_T1);
}

/* 4 activation bytes at p in every int32 lane (one vpbroadcastd from memory) */
AVX2_ONLY_TARGET static inline __m256i r8_bcast4_(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* the int32 lanes of one 32-byte chunk of 8 rows' codes (w) against inputs x..x + 3 (low nibbles) and x + 16..x + 19
 * (high nibbles) of the quantized row (q: signed, qa: magnitudes), each vpmaddubsw pair sum times `scale` (int16) */
AVX2_ONLY_TARGET BK_INLINE __m256i r8_chunk_(const uint8_t *w, const int8_t *q, const int8_t *qa, __m256i grid,
                                             __m256i scale) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    const __m256i lo = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, low));
    const __m256i hi = _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    const __m256i p_lo = _mm256_maddubs_epi16(r8_bcast4_(qa), _mm256_sign_epi8(lo, r8_bcast4_(q)));
    const __m256i p_hi = _mm256_maddubs_epi16(r8_bcast4_(qa + 16), _mm256_sign_epi8(hi, r8_bcast4_(q + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(p_lo, scale), _mm256_madd_epi16(p_hi, scale));
}

/* the 8 rows' float16 d at w times the activation scale dx */
AVX2_ONLY_TARGET static inline __m256 r8_dd_(const uint8_t *w, float dx) {
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w)), _mm256_set1_ps(dx));
}

/* IQ4_NL: one group of 8 rows (w: its first R8 block of 144 bytes) -> the 8 rows' float sums */
AVX2_ONLY_TARGET BK_INLINE __m256 r8_iq4_nl_(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID));
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 144) {
        r8_ahead_(w, 144);
        const int8_t *q = a->q + 32 * b, *qa = a->qa + 32 * b;
        __m256i sum = r8_chunk_(w + 16, q, qa, grid, ones);
        for (int j = 1; j < 4; j++)
            sum = _mm256_add_epi32(sum, r8_chunk_(w + 16 + 32 * j, q + 4 * j, qa + 4 * j, grid, ones));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), r8_dd_(w, a->d[b]), acc);
    }
    return acc;
}

/* IQ4_XS: one group of 8 rows (w: its first R8 super-block of 1088 bytes) -> the 8 rows' float sums. Sub-block s's
 * scale of row r: bits 4s..4s + 3 of its scales_l (lane r of the load at 32) and bits 2s, 2s + 1 of its scales_h
 * (lane r of the widened load at 16) as bits 4-5, minus 32, copied into both int16 halves of lane r (vpmaddwd's
 * pair). */
AVX2_ONLY_TARGET BK_INLINE __m256 r8_iq4_xs_(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID));
    const __m256i nibble = _mm256_set1_epi32(0x0F), two_bits = _mm256_set1_epi32(0x30);
    /* byte 0 of each int32 lane into its bytes 0 and 2, bytes 1 and 3 zero (0x80): the lane's two int16 */
    const __m256i both = _mm256_setr_epi32((int)0x80008000u, (int)0x80048004u, (int)0x80088008u, (int)0x800C800Cu,
                                           (int)0x80008000u, (int)0x80048004u, (int)0x80088008u, (int)0x800C800Cu);
    const __m256i thirty_two = _mm256_set1_epi16(32);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 1088) {
        r8_ahead_(w, 1088);
        const __m256i lows = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i highs = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 16))), 4);
        const int8_t *q = a->q + 256 * b, *qa = a->qa + 256 * b;
        __m256i sum = _mm256_setzero_si256();
        /* two sub-blocks per iteration: the 8-fold unrolled loop spilled ymm registers to the stack every chunk and
         * was 0.9x as fast (unrolled once or twice: the same speed, on a Zen 3) */
#pragma GCC unroll 2
        for (int s = 0; s < 8; s++) {
            const __m256i six = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lows, 4 * s), nibble),
                                                _mm256_and_si256(_mm256_srli_epi32(highs, 2 * s), two_bits));
            const __m256i scale = _mm256_sub_epi16(_mm256_shuffle_epi8(six, both), thirty_two);
            const uint8_t *c = w + 64 + 128 * s;
            for (int j = 0; j < 4; j++)
                sum = _mm256_add_epi32(sum, r8_chunk_(c + 32 * j, q + 32 * s + 4 * j, qa + 32 * s + 4 * j, grid, scale));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), r8_dd_(w, a->d[b]), acc);
    }
    return acc;
}

/* the 8 floats of v rounded to bfloat16 at y: float_to_bf16 lane by lane (nearest even; a NaN stays a quiet NaN of
 * its sign), where its scalar calls took about a tenth of a small group's time */
AVX2_ONLY_TARGET static inline void r8_store_bf16_(__m256 v, uint16_t *y) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000)); /* signed compare: both sides positive */
    const __m256i out = _mm256_blendv_epi8(rounded, quiet, nan);
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1)));
}

/* one R8 part's rows: the groups of 8 split over the threads of the enclosing OpenMP region (part_rows_'s loop) */
AVX2_ONLY_TARGET static void r8_rows_avx2(int type, const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                          int64_t row_bytes, int64_t nb) {
    if ((type & ~BLOCK_ROWS8) == GGML_Q3_K) { /* blocks_r8k_body.h */
        r8k_rows_avx2(type, weight, a, y, n, row_bytes, nb);
        return;
    }
    const int xs = (type & ~BLOCK_ROWS8) == GGML_IQ4_XS;
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < n / 8; g++) {
        const uint8_t *w = weight + g * 8 * row_bytes;
        r8_store_bf16_(xs ? r8_iq4_xs_(w, a, nb) : r8_iq4_nl_(w, a, nb), y + 8 * g);
    }
}
