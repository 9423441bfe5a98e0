/* The block-format GEMV kernels of blocks_cpu.c, written once for two instruction sets: blocks_cpu.c includes this file
 * twice, with BK_TARGET (the function attribute), BK_SUFFIX (appended to each name) and BK_DOT(acc, u, s) (acc +=
 * per 32-bit lane the sum of four products of unsigned bytes u and signed bytes s) defined: vpdpbusd on AVX512-VNNI,
 * vpmaddubsw + vpmaddwd on AVX2. Every u below is at most 128 and every s at most 127 in magnitude, so vpmaddubsw's
 * int16 pair sums (at most 2 x 128 x 127 = 32512) never saturate and both variants give the same integers. */

#define BK_CAT2(a, b) a##b
#define BK_CAT(a, b) BK_CAT2(a, b)
#define BK_NAME(name) BK_CAT(name, BK_SUFFIX)
/* The rows' loop of one part (part_rows_): y[r] = bfloat16(row_sum) for r < n, `row_sum` an expression of r (a row
 * step called directly: inlined, no type switch per row), split over the threads of the enclosing OpenMP region */
#define BK_ROWS(n, y, row_sum) \
    _Pragma("omp for schedule(static) nowait") for (int64_t r = 0; r < (n); r++) (y)[r] = float_to_bf16(row_sum)

/* a float16 field's value: the F16C conversion (exact, as fp16_to_float) */
BK_TARGET static inline float BK_NAME(half_)(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* horizontal sum of 8 float32 lanes */
BK_TARGET static inline float BK_NAME(hsum_)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#if BK_MASKED
/* lanes 0-7 (high = 0) or 8-15 (high = 1) of a 16-lane float vector */
BK_TARGET static inline __m256 BK_NAME(half512_)(__m512 v, int high) {
    const __m512d d = _mm512_castps_pd(v);
    return _mm256_castpd_ps(high ? _mm512_extractf64x4_pd(d, 1) : _mm512_castpd512_pd256(d));
}

#endif

/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0-15) then high nibbles (elements 16-31) */
BK_TARGET static inline __m256i BK_NAME(nibbles32_)(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

/* 32 bits -> 32 bytes, byte e = 0x10 where bit e is set, else 0 */
BK_TARGET static inline __m256i BK_NAME(high_bits_)(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* the 32 bits of qh (little endian) -> high_bits_'s 32 bytes */
BK_TARGET static inline __m256i BK_NAME(high_bits32_)(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return BK_NAME(high_bits_)(bits);
}

/* Q4_K / Q5_K's 12 packed bytes of 6-bit scales and minimums (k4_scales' values) -> 16 bytes: scales 0-3, minimums
 * 0-3, scales 4-7, minimums 4-7. In 64-bit general registers (the vector ports are the GEMV's bottleneck): bytes 0-7
 * masked to 6 bits give scales and minimums 0-3; 4-7 are the nibbles of bytes 8-11 (low: scales, high: minimums)
 * with bits 6-7 of bytes 0-7 as bits 4-5. */
BK_TARGET static inline __m128i BK_NAME(k4_unpack_)(const uint8_t *s) {
    uint64_t lo;
    uint32_t hi;
    memcpy(&lo, s, 8);
    memcpy(&hi, s + 8, 4);
    const uint64_t first = lo & 0x3f3f3f3f3f3f3f3fULL;
    const uint64_t nibbles = ((uint64_t)hi | (uint64_t)(hi >> 4) << 32) & 0x0f0f0f0f0f0f0f0fULL;
    return _mm_set_epi64x((long long)(nibbles | ((lo >> 2) & 0x3030303030303030ULL)), (long long)first);
}

/* u + value (4 or 16) in every byte e whose bit e of the 32 bits at qh is set: one masked byte add where AVX512BW is
 * (BK_MASKED), else high_bits32_'s spread */
BK_TARGET static inline __m256i BK_NAME(add_high_)(__m256i u, const uint8_t *qh, int value) {
#if BK_MASKED
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return _mm256_mask_add_epi8(u, (__mmask32)bits, u, _mm256_set1_epi8((char)value));
#else
    const __m256i high = BK_NAME(high_bits32_)(qh); /* 0x10 */
    return _mm256_or_si256(u, value == 16 ? high : _mm256_srli_epi16(high, 2));
#endif
}

/* int32 lane 0 of p minus v: a block's integer offset term (codes' constant times the activation sum) */
BK_TARGET static inline __m256i BK_NAME(sub_lane0_)(__m256i p, int32_t v) {
    return _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(v)));
}

/* The weight rows stream from memory once per GEMV; the hardware prefetchers alone leave one thread at 25-28 GB/s
 * on the 1.2B's layers. stream_ahead_ asks for the cache lines of the `bytes` weight bytes BK_AHEAD bytes past p into
 * the L2 (prefetcht1), from the row loops of IQ4_NL / Q4_0, Q4_K / Q5_K, Q6_K, IQ4_XS, Q4_1 / Q5_0 / Q5_1 and Q3_K:
 * 16 KiB ahead measured 1.06-1.2x from memory, 4 KiB 1.06-1.12x, nearer (into the L1) 0.85-1.0x; Q3_K's 1.02-1.09x
 * at one thread, and bits=3.5's two-thread decode 1.14-1.15x the default's against 1.00-1.06x without it
 * (docs/performance.md, fourteenth session). A prefetch never faults, so the lines past a weight's end cost a read
 * at most. */
#ifndef BK_AHEAD
#define BK_AHEAD 16384
#endif
BK_TARGET BK_INLINE void BK_NAME(stream_ahead_)(const uint8_t *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + BK_AHEAD + i), _MM_HINT_T1);
}

/* ---- 256-weight super-blocks, activations in Q8Row256 (one float scale per 256, 16-input sums) ---- */

/* ---- Q4_K / Q5_K: eight 32-weight sub-blocks per super-block, a 6-bit scale and minimum each (w = d * scale * u -
 * dmin * minimum). Each sub-block's dot is vpmaddubsw's int16 pair sums (u <= 31, |x| <= 127: at most 2 * 31 * 127 =
 * 7874, no saturation) times its scale as int16, summed in pairs into int32 lanes (vpdpwssd on AVX512-VNNI, vpmaddwd
 * + add on AVX2): no 32-bit multiply per step. Either body leaves the same 8 int32 lanes (lane l: weights 4l..4l + 3
 * of every sub-block, each times its scale), so the same floats. The minimums' term comes off once per super-block
 * by one vpmaddwd against the activation's 16-input sums (k4_head_). ---- */

/* a super-block's header: returns its scales and minimums (packed: k4_unpack_'s 16 bytes, or k4_unpack_vec_'s, the
 * same) as 16 int16 (words 0-3 and 8-11 the scales, 4-7 and 12-15 the minimums); *msum: the minimums' integer term
 * (lane j: minimum j times its 32 inputs' activation sum, one vpmaddwd of each minimum taken twice against the
 * 16-input sums sums16); *dd: d and dmin times the activation scale in lanes 0 and 1 (both fp16 fields by one
 * conversion) */
BK_TARGET BK_INLINE __m256i BK_NAME(k4_head_)(const uint8_t *w, __m128i packed, const ActRow *a, int64_t b,
                                               __m256i *msum, __m128 *dd) {
    const __m256i words = _mm256_cvtepu8_epi16(packed);
    const __m256i twice = _mm256_unpackhi_epi16(words, words); /* minimums 0-7, each twice */
    *msum = _mm256_madd_epi16(twice, _mm256_loadu_si256((const __m256i *)(a->sums16 + b * 16)));
    int32_t fields;
    memcpy(&fields, w, 4);
    *dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(fields)), _mm_set1_ps(a->d[b]));
    return words;
}

#if BK_MASKED
/* one super-block's 8 integer lanes (lane l: weights 4l..4l + 3 of every sub-block, times its scale); five: Q5_K.
 * Per 128 weights h: its 64 code bytes in one load, low nibbles (sub-blocks 4h, 4h + 2 in the 256-bit halves) and
 * high (4h + 1, 4h + 3), so x is the activation in ActRow.qk's order (the middle 32-input quarters of every 128
 * swapped); Q5_K adds 16 where bit s of qh byte l is set (sub-block s, weight l; vptestmb, masked byte add).
 * vpmaddubsw with the 64 activations, the pair sums times each half's scale (vpdpwssd, scales picked by vpermw);
 * halves folded at the end. */
BK_TARGET BK_INLINE __m256i BK_NAME(k4_dots_)(const uint8_t *w, const int8_t *x, __m256i words, int five) {
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    const __m512i scales = _mm512_castsi256_si512(words);
    const uint8_t *qs = w + (five ? 48 : 16);
    const __m512i qh2 = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16))) : low;
    __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_loadu_si512((const void *)(qs + 64 * h));
        __m512i u[2] = {_mm512_and_si512(q, low), _mm512_and_si512(_mm512_srli_epi16(q, 4), low)};
        for (int i = 0; i < 2; i++) {
            /* sub-blocks s0 = 4h + i and s0 + 2 in the lower / upper half (K4_PICK, K4_BITS) */
            if (five) {
                const __m512i bits = _mm512_loadu_si512((const void *)K4_BITS[2 * h + i]);
                u[i] = _mm512_mask_add_epi8(u[i], _mm512_test_epi8_mask(qh2, bits), u[i], sixteen);
            }
            const __m512i pick = _mm512_loadu_si512((const void *)K4_PICK[2 * h + i]); /* s0's, s1's words */
            const __m512i p = _mm512_maddubs_epi16(u[i], _mm512_loadu_si512((const void *)(x + 128 * h + 64 * i)));
            sums[i] = _mm512_dpwssd_epi32(sums[i], p, _mm512_permutexvar_epi16(pick, scales));
        }
    }
    const __m512i sum = _mm512_add_epi32(sums[0], sums[1]);
    return _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
}
#else
/* k4_unpack_'s 16 bytes by 9 vector instructions from one load (the AVX2 row; k3_scales_vec_'s reason: on the Zen 3
 * the step's time follows the instructions it issues, and k4_unpack_'s general-register ones were about 14 of a Q4_K
 * super-block's 70). Bytes 0-7 masked to 6 bits; bytes 8-11 then their high nibbles (one word shift by 4, a dword
 * unpack), masked to 4 bits, or'd with bits 6-7 of bytes 0-7 shifted to bits 4-5 (a word shift by 2, a mask) */
BK_TARGET static inline __m128i BK_NAME(k4_unpack_vec_)(const uint8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s); /* bytes 12-15: the block's next fields, unused */
    const __m128i first = _mm_and_si128(v, _mm_set1_epi8(0x3f));
    const __m128i nibbles = _mm_and_si128(_mm_unpackhi_epi32(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(0x0F));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(v, 2), _mm_set1_epi8(0x30));
    return _mm_unpacklo_epi64(first, _mm_or_si128(nibbles, top));
}

/* sub-blocks 2j, 2j + 1 (codes u0, u1) against their activations at x + 64j: vpmaddubsw's pair sums times the scale
 * (each scale as int16 in every word: one in-lane byte shuffle of the packed scales, in both 128-bit lanes, with a
 * zero high byte, where a vpermd of the scales as words took a cross-lane one), summed in pairs (vpmaddwd), added to
 * sums[0] / sums[1] */
BK_TARGET static inline void BK_NAME(k4_pair_)(__m256i *sums, __m256i u0, __m256i u1, const int8_t *x, __m256i packed2,
                                               int j) {
    /* scale s at byte s (s < 4) or s + 4 (k4_unpack_'s order) */
    const int at0 = 2 * j < 4 ? 2 * j : 2 * j + 4, at1 = at0 + 1;
    const __m256i pick0 = _mm256_set1_epi16((short)(0x8000 | at0)), pick1 = _mm256_set1_epi16((short)(0x8000 | at1));
    const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)(x + 64 * j)));
    const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(x + 64 * j + 32)));
    sums[0] = _mm256_add_epi32(sums[0], _mm256_madd_epi16(p0, _mm256_shuffle_epi8(packed2, pick0)));
    sums[1] = _mm256_add_epi32(sums[1], _mm256_madd_epi16(p1, _mm256_shuffle_epi8(packed2, pick1)));
}

/* k4_dots_ of the AVX2 body: x in the activation's own order (ActRow.q); packed: the super-block's k4_unpack_vec_
 * bytes. Q5_K's fifth bit of sub-block s is bit s of qh byte l, moved to bit 4 by one word shift of qh (left 4 - s,
 * or right s - 4) and a mask: 3 instructions per sub-block where shifting qh down by 1 and 2 and back up took 4 */
BK_TARGET BK_INLINE __m256i BK_NAME(k4_dots_)(const uint8_t *w, const int8_t *x, __m128i packed, int five) {
    /* code byte l of pair j: low nibble sub-block 2j, high 2j + 1; Q5_K: bit 2j / 2j + 1 of qh byte l their 5th */
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const __m256i packed2 = _mm256_broadcastsi128_si256(packed);
    const uint8_t *qs = w + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : low;
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i u0 = _mm256_and_si256(q, low), u1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if (five) {
            const int s0 = 2 * j, s1 = 2 * j + 1;
            const __m256i h0 = s0 <= 4 ? _mm256_slli_epi16(qh, 4 - s0) : _mm256_srli_epi16(qh, s0 - 4);
            const __m256i h1 = s1 <= 4 ? _mm256_slli_epi16(qh, 4 - s1) : _mm256_srli_epi16(qh, s1 - 4);
            u0 = _mm256_or_si256(u0, _mm256_and_si256(h0, bit4));
            u1 = _mm256_or_si256(u1, _mm256_and_si256(h1, bit4));
        }
        BK_NAME(k4_pair_)(sums, u0, u1, x, packed2, j);
    }
    return _mm256_add_epi32(sums[0], sums[1]);
}
#endif

/* Q4_K (five 0, 144-byte blocks) / Q5_K (five 1, 176): per super-block the integer lanes times d and the activation
 * scale, the minimums' term times dmin and the activation scale apart (AVX-512: lanes 8-15 of one 512-bit
 * accumulator, the same float operations lane by lane), one subtraction at the end */
BK_TARGET BK_INLINE float BK_NAME(k4_row_)(const uint8_t *w, const ActRow *a, int64_t nb, int five) {
#if BK_MASKED
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += five ? 176 : 144) {
        __m256i msum;
        __m128 dd;
        BK_NAME(stream_ahead_)(w, five ? 176 : 144);
        const __m256i words = BK_NAME(k4_head_)(w, BK_NAME(k4_unpack_)(w + 4), a, b, &msum, &dd);
        const __m256i sumi = BK_NAME(k4_dots_)(w, a->qk + b * 256, words, five);
        const __m512 both = _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(sumi), msum, 1));
        acc = _mm512_fmadd_ps(both, _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(dd)), acc);
    }
    const __m256 mins = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return BK_NAME(hsum_)(_mm256_sub_ps(_mm512_castps512_ps256(acc), mins));
#else
    __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += five ? 176 : 144) {
        __m256i msum;
        __m128 dd;
        BK_NAME(stream_ahead_)(w, five ? 176 : 144);
        const __m128i packed = BK_NAME(k4_unpack_vec_)(w + 4);
        BK_NAME(k4_head_)(w, packed, a, b, &msum, &dd);
        const __m256 d = _mm256_broadcastss_ps(dd), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(BK_NAME(k4_dots_)(w, a->q + b * 256, packed, five)), d, acc);
        mins = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), dmin, mins);
    }
    return BK_NAME(hsum_)(_mm256_sub_ps(acc, mins));
#endif
}

BK_TARGET static float BK_NAME(row_q4_k_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(k4_row_)(w, a, nb, 0);
}

BK_TARGET static float BK_NAME(row_q5_k_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(k4_row_)(w, a, nb, 1);
}

/* ---- Q3_K / Q6_K: sixteen 16-weight sub-blocks per super-block, an int8 scale each, unsigned codes u with a
 * constant offset (w = d * scale * (u - offset)). Each sub-block's dot is 4 int32 quad sums (vpdpbusd; AVX2:
 * vpmaddubsw + vpmaddwd, u <= 63, |x| <= 127, at most 4 * 63 * 127 = 32004), packed to int16 and multiplied by its
 * scale as int16, summed in pairs into int32 lanes (vpdpwssd on AVX512-VNNI, vpmaddwd + add on AVX2; k16_quads_): no
 * 32-bit multiply per step. Either body leaves the same 8 int32 lanes, so the same floats. The offset comes off once
 * per super-block against the activation's 16-input sums (k16_offset_). ---- */

/* the codes' offset term, offset * sum over sub-blocks s of scale[s] * (sum of the 16 activations of s), as 8 int32
 * lanes (lane j: sub-blocks 2j, 2j + 1): one vpmaddwd of the scales (scale16, int16) with the activation's int16
 * 16-input sums (bs16, made once per call); log2_offset: 5 (Q6_K) or 2 (Q3_K) */
BK_TARGET static inline __m256i BK_NAME(k16_offset_)(__m256i scale16, const int16_t *bs16, int log2_offset) {
    return _mm256_slli_epi32(_mm256_madd_epi16(scale16, _mm256_loadu_si256((const __m256i *)bs16)), log2_offset);
}

/* the super-block's integer sum (8 lanes) minus its offset term, times d and the activation scale, added to acc */
BK_TARGET static inline __m256 BK_NAME(k16_finish_)(__m256 acc, __m256i sumi, __m256i offset, float d) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, offset)), _mm256_set1_ps(d), acc);
}

#if BK_MASKED
#define BK_K16 __m512i
#define BK_K16_ZERO _mm512_setzero_si512()
/* 16 int32 lanes -> the 8 of the AVX2 body (lane l + 8 onto lane l) */
BK_TARGET static inline __m256i BK_NAME(k16_sum_)(__m512i sum) {
    return _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
}
#else
#define BK_K16 __m256i
#define BK_K16_ZERO _mm256_setzero_si256()
BK_TARGET static inline __m256i BK_NAME(k16_sum_)(__m256i sum) { return sum; }
#endif

/* Q3_K and Q6_K's integer lanes (row_q3_k_, row_q3_k_gfni, row_q6_k_): per 128 codes h, groups 2h and 2h + 1
 * (sub-block 4g + k in 128-bit lane k of group g, 16 codes in order) against their 128 activations. Each group's codes
 * go through one dot of four products per 32-bit lane (vpdpbusd / BK_DOT: four quad sums per sub-block, each at most
 * 4 * 63 * 127 = 32004, so int16), the two groups' quads packed to words (vpackssdw, no saturation: 128-bit lane k
 * holds group 2h's sub-block quads 0-3, then group 2h + 1's) and those times their sub-blocks' scales, word pairs
 * summed (vpdpwssd / vpmaddwd): two scale products and two scale vectors per 128 codes where one per 64 codes took a
 * vpmaddubsw, a vpermw and a vpdpwssd. Both bodies leave the same 8 int32 lanes (lane 4k + m, k < 2: 128-bit lanes k
 * and k + 2 of the AVX-512 sum; m = 0, 1: group 2h's quads 2m, 2m + 1, m = 2, 3: group 2h + 1's). */
#if BK_MASKED
/* sum + groups 2h (u0) and 2h + 1 (u1) against x (128 inputs); scales: the super-block's 16 int16 scales */
BK_TARGET BK_INLINE __m512i BK_NAME(k16_quads_)(__m512i sum, __m512i u0, __m512i u1, const int8_t *x,
                                               __m512i scales, int first) {
    /* 128-bit lane k: words 0-3 pick scale word first + k, words 4-7 first + 4 + k (first: 8h) */
    const __m512i lanes = _mm512_setr_epi64(0, 0x0004000400040004LL, 0x0001000100010001LL, 0x0005000500050005LL,
                                            0x0002000200020002LL, 0x0006000600060006LL, 0x0003000300030003LL,
                                            0x0007000700070007LL);
    const __m512i pick = _mm512_add_epi16(lanes, _mm512_set1_epi16((short)first));
    const __m512i zero = _mm512_setzero_si512();
    const __m512i d0 = _mm512_dpbusd_epi32(zero, u0, _mm512_loadu_si512((const void *)x));
    const __m512i d1 = _mm512_dpbusd_epi32(zero, u1, _mm512_loadu_si512((const void *)(x + 64)));
    return _mm512_dpwssd_epi32(sum, _mm512_packs_epi32(d0, d1), _mm512_permutexvar_epi16(pick, scales));
}
#else
/* sum + the 128 codes h as four pairs u[j] (pair 4h + j: sub-blocks 8h + 2j, 8h + 2j + 1 in 128-bit lanes 0, 1; the
 * AVX-512 groups' halves: group 2h = pairs 0, 1, group 2h + 1 = pairs 2, 3) against x; half: scales 8h..8h + 7 as
 * int16 in both 128-bit lanes */
BK_TARGET static inline __m256i BK_NAME(k16_quads_)(__m256i sum, const __m256i *u, const int8_t *x, __m256i half) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i d[4];
    for (int j = 0; j < 4; j++) d[j] = BK_DOT(zero, u[j], _mm256_loadu_si256((const __m256i *)(x + 32 * j)));
    /* lane k: words 0-3 scale k (lo) or 2 + k (hi), words 4-7 scale 4 + k or 6 + k, of this half */
    const __m256i pick_lo = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 8, 9, 8, 9, 8, 9, 8, 9, 2, 3, 2, 3, 2, 3, 2, 3,
                                             10, 11, 10, 11, 10, 11, 10, 11);
    const __m256i pick_hi = _mm256_add_epi8(pick_lo, _mm256_set1_epi8(4));
    const __m256i lo = _mm256_madd_epi16(_mm256_packs_epi32(d[0], d[2]), _mm256_shuffle_epi8(half, pick_lo));
    const __m256i hi = _mm256_madd_epi16(_mm256_packs_epi32(d[1], d[3]), _mm256_shuffle_epi8(half, pick_hi));
    return _mm256_add_epi32(sum, _mm256_add_epi32(lo, hi));
}
#endif

BK_TARGET BK_INLINE float BK_NAME(q6_k_row_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const int8_t *xq = a->q + b * 256;
        BK_NAME(stream_ahead_)(w, 210);
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i scale16 = _mm256_cvtepi8_epi16(scales);
        BK_K16 sum = BK_K16_ZERO;
#if BK_MASKED
        /* per 128 weights: ql's 64 bytes hold codes 0-63 (low nibbles) and 64-127 (high nibbles), qh's 32 bytes
         * bits 0-1 / 2-3 / 4-5 / 6-7 their codes 0-31 / 32-63 / 64-95 / 96-127's bits 4-5 */
        const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(w + 64 * h));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            const __m512i high0 = _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45);
            /* 0xEC: (ql & low) | high */
            const __m512i u0 = _mm512_ternarylogic_epi32(ql, high0, low, 0xEC);
            const __m512i u1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), _mm512_and_si512(qh2, bits45),
                                                         low, 0xEC);
            sum = BK_NAME(k16_quads_)(sum, u0, u1, xq + 128 * h, _mm512_castsi256_si512(scale16), 8 * h);
        }
#else
        const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), bits45 = _mm256_set1_epi8(0x30);
        const __m256i halves[2] = {_mm256_broadcastsi128_si256(_mm256_castsi256_si128(scale16)),
                                   _mm256_broadcastsi128_si256(_mm256_extracti128_si256(scale16, 1))};
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m256i qh2 = _mm256_srli_epi16(qh, 2);
            const __m256i u[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_slli_epi16(_mm256_and_si256(qh2, three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_and_si256(qh2, bits45)),
            };
            sum = BK_NAME(k16_quads_)(sum, u, xq + 128 * h, halves[h]);
        }
#endif
        acc = BK_NAME(k16_finish_)(acc, BK_NAME(k16_sum_)(sum), BK_NAME(k16_offset_)(scale16, a->sums16 + b * 16, 5),
                                   BK_NAME(half_)(w + 208) * a->d[b]);
    }
    return BK_NAME(hsum_)(acc);
}

BK_TARGET static float BK_NAME(row_q6_k_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(q6_k_row_)(w, a, nb);
}

/* Q3_K's sixteen 6-bit scales minus 32 (llama.cpp's block_q3_K scales[12]: 4-bit lows in bytes 0-7, low nibbles
 * scales 0-7, high nibbles 8-15; 2-bit highs in bytes 8-11, bits 2i..2i + 1 of byte j scale 4i + j) as 16 int8. In
 * 64-bit general registers (the vector ports are the GEMV's bottleneck): each byte s <= 63, so s - 32 (mod 256) is
 * (s + 0x60) ^ 0x80 with no carry between bytes */
BK_TARGET static inline __m128i BK_NAME(k3_scales_)(const uint8_t *s) {
    const uint64_t four = 0x0f0f0f0f0f0f0f0fULL, two = 0x0303030303030303ULL;
    const uint64_t add = 0x6060606060606060ULL, flip = 0x8080808080808080ULL;
    uint64_t lo;
    uint32_t hi;
    memcpy(&lo, s, 8);
    memcpy(&hi, s + 8, 4);
    const uint64_t high01 = ((uint64_t)hi | (uint64_t)hi << 30) & two;        /* scales 0-3, 4-7: bits 0-1, 2-3 */
    const uint64_t high23 = ((uint64_t)hi >> 4 | (uint64_t)hi << 26) & two;   /* scales 8-11, 12-15: bits 4-5, 6-7 */
    const uint64_t first = ((lo & four) | high01 << 4) + add, second = (((lo >> 4) & four) | high23 << 4) + add;
    return _mm_set_epi64x((long long)(second ^ flip), (long long)(first ^ flip));
}

#if BK_MASKED
BK_TARGET BK_INLINE float BK_NAME(q3_k_row_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    /* even super-blocks' float terms in acc[0], odd ones' in acc[1] (row_q3_k_gfni's lanes 0-7 and 8-15) */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    /* group g = 2h + odd (64 codes, sub-blocks 4g..4g + 3, one per 128-bit lane): codes 128h + 32j + l with j = 2 odd
     * (bytes l) and 2 odd + 1 (bytes 32 + l); bits 0-1 are bits 2j, 2j + 1 of qs[32h + l] (qs's 32 bytes in both
     * halves, one word shift by 4 odd / 4 odd + 2), bit 2 is bit 4h + j of hmask[l] (hmask in both halves, one byte
     * test into a mask register, then a masked add of 4) */
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m512i shift[2] = {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                              _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
    __m512i bit[4];
    for (int g = 0; g < 4; g++)
        bit[g] = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 2 * g)), _mm256_set1_epi8((char)(2 << 2 * g)), 1);
    for (int64_t b = 0; b < nb; b++, w += 110) {
        BK_NAME(stream_ahead_)(w, 110);
        const int8_t *xq = a->q + b * 256;
        const __m256i scale16 = _mm256_cvtepi8_epi16(BK_NAME(k3_scales_)(w + 96));
        BK_K16 sum = BK_K16_ZERO;
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
        for (int h = 0; h < 2; h++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 32 + 32 * h)));
            __m512i u[2];
            for (int odd = 0; odd < 2; odd++) {
                const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(q, shift[odd]), three);
                u[odd] = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bit[2 * h + odd]), low, four);
            }
            sum = BK_NAME(k16_quads_)(sum, u[0], u[1], xq + 128 * h, _mm512_castsi256_si512(scale16), 8 * h);
        }
        acc[b & 1] = BK_NAME(k16_finish_)(acc[b & 1], BK_NAME(k16_sum_)(sum),
                                          BK_NAME(k16_offset_)(scale16, a->sums16 + b * 16, 2),
                                          BK_NAME(half_)(w + 108) * a->d[b]);
    }
    return BK_NAME(hsum_)(_mm256_add_ps(acc[0], acc[1]));
}
#else
/* The AVX2 Q3_K row's constants (K3_*: byte rows of K3_CONSTS), loaded from memory: as _mm256_set1_* in a loop that
 * needs more than 16 registers gcc rebuilt some per step from a general register (3 instructions, one a broadcast),
 * and the scale picks per row call (about 30 instructions) */
enum { K3_TABLE_A, K3_TABLE_B, K3_BITS01, K3_SEVEN, K3_HIGH, K3_NIBBLE, K3_TOP, K3_32, K3_NATURAL, K3_PICK };
static const _Alignas(32) uint8_t BK_NAME(K3_CONSTS)[K3_PICK + 8][32] = {
    /* byte n: bit 0 of n at bit 2, bit 2 at bit 6 (pair A), bits 1 and 3 likewise (pair B) */
    {0, 4, 0, 4, 64, 68, 64, 68, 0, 4, 0, 4, 64, 68, 64, 68, 0, 4, 0, 4, 64, 68, 64, 68, 0, 4, 0, 4, 64, 68, 64, 68},
    {0, 0, 4, 4, 0, 0, 4, 4, 64, 64, 68, 68, 64, 64, 68, 68, 0, 0, 4, 4, 0, 0, 4, 4, 64, 64, 68, 68, 64, 64, 68, 68},
#define K3_ROW(v) {v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}
    K3_ROW(0x33), K3_ROW(7), K3_ROW(0x70), K3_ROW(0x0F), K3_ROW(0xC0), K3_ROW(32),
#undef K3_ROW
    /* word n: scale n's byte into the high byte, zero (0x80) into the low one */
    {0x80, 0, 0x80, 1, 0x80, 2, 0x80, 3, 0x80, 4, 0x80, 5, 0x80, 6, 0x80, 7,
     0x80, 8, 0x80, 9, 0x80, 10, 0x80, 11, 0x80, 12, 0x80, 13, 0x80, 14, 0x80, 15},
    /* pick s = 0, 2, ..., 14: scale s in every word of 128-bit lane 0, s + 1 in lane 1 */
#define K3_PICK_ROW(s)                                                                                                \
    {0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s + 1, 0x80, s + 1, 0x80, s + 1,   \
     0x80, s + 1, 0x80, s + 1, 0x80, s + 1, 0x80, s + 1, 0x80, s + 1}
    K3_PICK_ROW(0), K3_PICK_ROW(2), K3_PICK_ROW(4), K3_PICK_ROW(6), K3_PICK_ROW(8), K3_PICK_ROW(10), K3_PICK_ROW(12),
    K3_PICK_ROW(14),
#undef K3_PICK_ROW
};
#define BK_K3(i) _mm256_load_si256((const __m256i *)BK_NAME(K3_CONSTS)[i])

/* Q3_K's sixteen scales minus 32 as int8 in both 128-bit lanes (byte n and 16 + n: scale n; k3_scales_'s values) by 8
 * vector instructions from two broadcast loads, for the AVX2 row: on a Zen 3 k3_scales_'s 30 general-register
 * instructions were a quarter of a super-block's 123 and cost about 10% of its time (nineteenth session). The lows by
 * one word shift by 4, an unpack and a mask (byte k: scale k's low nibble); the highs' 32 bits in every dword, dword i
 * shifted left by 6 - 2i (each byte's field i to bits 6-7), masked and shifted right by 2 words; or'd, minus 32. Both
 * lanes alike, so each sub-block's scale is one in-lane byte shuffle away, with no sign extension and no lane
 * broadcast per super-block. */
BK_TARGET static inline __m256i BK_NAME(k3_scales_vec_)(const uint8_t *s) {
    const __m256i lows = _mm256_castpd_si256(_mm256_broadcast_sd((const double *)s));
    const __m256i low = _mm256_and_si256(_mm256_unpacklo_epi64(lows, _mm256_srli_epi16(lows, 4)), BK_K3(K3_NIBBLE));
    const __m256i highs = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(s + 8)));
    const __m256i top = _mm256_sllv_epi32(highs, _mm256_setr_epi32(6, 4, 2, 0, 6, 4, 2, 0));
    const __m256i high = _mm256_srli_epi16(_mm256_and_si256(top, BK_K3(K3_TOP)), 2);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), BK_K3(K3_32));
}

/* Q3_K's codes on AVX2: the 128 codes h as four registers u[j] of 32 codes (code 128h + 32j + l in byte l of u[j],
 * u[2] and u[3] times 16; bits 0-1 are bits 2j, 2j + 1 of qs[32h + l], bit 2 is bit 4h + j of hmask[l]). Two
 * registers of two codes per byte first, pair A codes j = 0 (bits 0-2) and 2 (bits 4-6), pair B j = 1 and 3: qs (pair
 * B: after one word shift by 2) masked by 0x33 keeps both codes' bits 0-1 in place, and hmask's nibble h (hms: hmask
 * masked, or shifted by 4 and masked, once per super-block) picks both codes' bit 2, at bits 2 and 6, from a 16-byte
 * table by one byte shuffle per pair; then each code by one mask, codes 2 and 3 left in bits 4-6 (at most 112: their
 * vpmaddubsw pair sums at most 2 * 112 * 127 = 28448, no saturation; the 16 comes off once per super-block). 11
 * instructions per 128 codes, where shifting codes 2 and 3 down took 15. */
BK_TARGET static inline void BK_NAME(q3_k_codes_)(__m256i *u, __m256i q, __m256i hms) {
    const __m256i bits01 = BK_K3(K3_BITS01), seven = BK_K3(K3_SEVEN), high = BK_K3(K3_HIGH);
    const __m256i pair_a = _mm256_or_si256(_mm256_and_si256(q, bits01), _mm256_shuffle_epi8(BK_K3(K3_TABLE_A), hms));
    const __m256i pair_b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2), bits01),
                                           _mm256_shuffle_epi8(BK_K3(K3_TABLE_B), hms));
    u[0] = _mm256_and_si256(pair_a, seven);
    u[1] = _mm256_and_si256(pair_b, seven);
    u[2] = _mm256_and_si256(pair_a, high);
    u[3] = _mm256_and_si256(pair_b, high);
}

/* one super-block's float term added to acc: the AVX-512 body's 8 int32 lanes (k16_quads_ of the same codes minus
 * k16_offset_) and its floats (k16_finish_; d * dx by a broadcast load of the float16 d and one vcvtph2ps, the same
 * product as half_'s times dx in float32). The integer lanes another way, exact, so the same: each register u[j] of
 * 128 codes h by vpmaddubsw against its 32 inputs (int16 pair sums, 128-bit lane k: sub-block 8h + 2j + k) and
 * vpmaddwd by its sub-block's scale times 256 (one byte shuffle of k3_scales_vec_'s bytes puts each scale into the
 * high byte of its words, in place of a sign extension; int32 lane k, i: its quad i times the scale), summed over h
 * into sum_a (j = 0, 1) and sum_b (j = 2, 3: codes times 16). Lane 4k + m of k16_quads_ (m = 0, 1: quads 0-1 / 2-3
 * of j = 0, 1; m = 2, 3: of j = 2, 3) is the sum of neighbouring lanes, sum_b / 16 first; the offset term times 256
 * (the natural scales' words by one more shuffle) comes off and one arithmetic shift by 8 divides exactly. Bounds: a
 * sum_b lane at most 4 * 2 * 28448 * 32 * 256 = 1864368128 < 2^31, sum_a's 16x less; the offset term at most 4 * 2 *
 * 32 * 256 * 2032. Per super-block 8 vpmaddwd by scales, 9 byte shuffles of the scales, where k16_quads_ took 4
 * vpmaddwd by scales, 8 by ones, 4 packs, 4 shuffles and a sign extension and two lane broadcasts of the scales. */
BK_TARGET BK_INLINE __m256 BK_NAME(q3_k_step_)(const uint8_t *w, const ActRow *a, int64_t b, __m256 acc) {
    BK_NAME(stream_ahead_)(w, 110);
    const int8_t *xq = a->q + b * 256;
    const __m256i scales8 = BK_NAME(k3_scales_vec_)(w + 96);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)w), nibble = BK_K3(K3_NIBBLE);
    const __m256i hms[2] = {_mm256_and_si256(hm, nibble), _mm256_and_si256(_mm256_srli_epi16(hm, 4), nibble)};
    __m256i sum_a = _mm256_setzero_si256(), sum_b = sum_a;
    for (int h = 0; h < 2; h++) {
        __m256i u[4], p[4];
        BK_NAME(q3_k_codes_)(u, _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * h)), hms[h]);
        for (int j = 0; j < 4; j++)
            p[j] = _mm256_madd_epi16(
                _mm256_maddubs_epi16(u[j], _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * j))),
                _mm256_shuffle_epi8(scales8, BK_K3(K3_PICK + 4 * h + j)));
        sum_a = _mm256_add_epi32(sum_a, _mm256_add_epi32(p[0], p[1]));
        sum_b = _mm256_add_epi32(sum_b, _mm256_add_epi32(p[2], p[3]));
    }
    /* lane k: sum_a's int32 lanes 0 + 1, 2 + 3, then sum_b's: two in-lane shuffles and an add (vphaddd took about
     * four instructions' time on the Zen 3) */
    const __m256 fa = _mm256_castsi256_ps(sum_a), fb = _mm256_castsi256_ps(_mm256_srai_epi32(sum_b, 4));
    const __m256i sum = _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88)),
                                         _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xDD)));
    const __m256i natural = _mm256_shuffle_epi8(scales8, BK_K3(K3_NATURAL));
    const __m256i offset = BK_NAME(k16_offset_)(natural, a->sums16 + b * 16, 2);
    int16_t d16;
    memcpy(&d16, w + 108, 2);
    const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16(d16)), _mm256_broadcast_ss(a->d + b));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sub_epi32(sum, offset), 8)), d, acc);
}
#undef BK_K3

BK_TARGET BK_INLINE float BK_NAME(q3_k_row_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    /* even super-blocks' float terms in acc0, odd ones' in acc1 (the AVX-512 body's acc[0], acc[1]), in registers */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 220) {
        acc0 = BK_NAME(q3_k_step_)(w, a, b, acc0);
        acc1 = BK_NAME(q3_k_step_)(w + 110, a, b + 1, acc1);
    }
    if (b < nb) acc0 = BK_NAME(q3_k_step_)(w, a, b, acc0);
    return BK_NAME(hsum_)(_mm256_add_ps(acc0, acc1));
}
#endif

BK_TARGET static float BK_NAME(row_q3_k_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(q3_k_row_)(w, a, nb);
}

#if BK_MASKED
/* gf2p8affineqb's 8 x 8 bit matrix (one per 64-bit lane) taking input bits a, b, c to output bits 0, 1, 2, every
 * other output bit 0: output bit i is row byte 7 - i's parity with the input */
#define BK_PICK3(a, b, c) (long long)((1ULL << (a)) << 56 | (1ULL << (b)) << 48 | (1ULL << (c)) << 40)

/* row_q3_k_gfni's constants, made once per part (q3_k_gfni_rows_): the code matrices, the hmask shift counts and
 * the scale picks of its byte merges, the vpmultishiftqb controls of the scales */
typedef struct {
    __m512i code[4], up, down, pair[2];
    __m128i pick_low, pick_high;
} BK_NAME(Q3kGfni);

BK_GFNI_TARGET static inline BK_NAME(Q3kGfni) BK_NAME(q3_k_gfni_consts_)(void) {
    BK_NAME(Q3kGfni) k;
    /* merge 0 (per byte l of half h: qs bits 0-3, hmask bits 4h, 4h + 1 at 4, 5) holds codes j = 0, 1; merge 1 (qs
     * bits 4-7, hmask bits 4h + 2, 4h + 3 at 2, 3) codes j = 2, 3 */
    k.code[0] = _mm512_set1_epi64(BK_PICK3(0, 1, 4));
    k.code[1] = _mm512_set1_epi64(BK_PICK3(2, 3, 5));
    k.code[2] = _mm512_set1_epi64(BK_PICK3(4, 5, 2));
    k.code[3] = _mm512_set1_epi64(BK_PICK3(6, 7, 3));
    /* hmask's word shifts: merge 0 left by 4 in half 0 (bits 0, 1 to 4, 5), none in half 1; merge 1 none in half 0,
     * right by 4 in half 1 (bits 6, 7 to 2, 3) */
    k.up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_setzero_si256(), 1);
    k.down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    /* the scale words of packs p = 0 (codes j = 0 and 2) and p = 1 (j = 1 and 3): 128-bit lane c, words 0-3 scale
     * 8 (c / 2) + 2p + c % 2, words 4-7 that + 4 */
    k.pair[0] = _mm512_setr_epi64(0, 0x0004000400040004LL, 0x0001000100010001LL, 0x0005000500050005LL,
                                  0x0008000800080008LL, 0x000c000c000c000cLL, 0x0009000900090009LL,
                                  0x000d000d000d000dLL);
    k.pair[1] = _mm512_add_epi16(k.pair[0], _mm512_set1_epi16(2));
    /* scale s's 8-bit window: its 4-bit low at bit 8s (s < 8) or 8(s - 8) + 4 of scales[0..7]; its 2-bit high, bits
     * 2(s / 4) of byte s % 4 of scales[8..11] (the dword twice per qword), to bits 4-5 (offsets mod 64: rotated) */
    k.pick_low = _mm_setr_epi8(0, 8, 16, 24, 32, 40, 48, 56, 4, 12, 20, 28, 36, 44, 52, 60);
    k.pick_high = _mm_setr_epi8(60, 4, 12, 20, 62, 6, 14, 22, 0, 8, 16, 24, 2, 10, 18, 26);
    return k;
}

/* one super-block's codes at w against xq (its 256 inputs in ActRow.q3k's order): the 16 int32 lanes of the other
 * steps' k16_quads_ after the fold of 128-bit lanes c and c + 2 (scales: its scale words from first). qs's 64 bytes
 * by one load (half h: the bytes of codes 128h..128h + 127) and hmask broadcast to both halves (the vector loads
 * that broadcast run where the shuffles and bit-matrix products do): two selects merge each half's qs and hmask
 * bits, and each of four products takes one code j of both halves (codes 128h + 32j + l: sub-blocks 2j, 2j + 1 in
 * 128-bit lanes 0, 1, 8 + 2j, 9 + 2j in 2, 3), dotted with its 64 inputs. The packs pair j = 0 with 2 and 1 with 3,
 * so that each 128-bit lane holds sub-blocks whose quads the other steps add into the same int32 lane: the same
 * integers, so the same bytes */
BK_GFNI_TARGET BK_INLINE __m512i BK_NAME(q3_k_gfni_codes_)(const uint8_t *w, const int8_t *xq, __m512i scales,
                                                          int first, const BK_NAME(Q3kGfni) *k) {
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
    const __m512i qs = _mm512_loadu_si512((const void *)(w + 32));
    /* 0xD8: third ? second : first (the qs bits under the nibble mask, the shifted hmask's elsewhere) */
    const __m512i m0 = _mm512_ternarylogic_epi32(_mm512_sllv_epi16(hm, k->up), qs, _mm512_set1_epi8(0x0F), 0xD8);
    const __m512i m1 =
        _mm512_ternarylogic_epi32(_mm512_srlv_epi16(hm, k->down), qs, _mm512_set1_epi8((char)0xF0), 0xD8);
    __m512i d[4];
    for (int j = 0; j < 4; j++)
        d[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_gf2p8affine_epi64_epi8(j < 2 ? m0 : m1, k->code[j], 0),
                                   _mm512_load_si512((const void *)(xq + 64 * j)));
    __m512i sum = _mm512_setzero_si512();
    for (int p = 0; p < 2; p++)
        sum = _mm512_dpwssd_epi32(sum, _mm512_packs_epi32(d[p], d[p + 2]),
                                  _mm512_permutexvar_epi16(_mm512_add_epi16(k->pair[p], _mm512_set1_epi16((short)first)),
                                                           scales));
    return sum;
}

/* one super-block of row_q3_k_gfni added to acc (dx: the activation scale of its 256 inputs) */
BK_GFNI_TARGET BK_INLINE __m256 BK_NAME(q3_k_gfni_block_)(__m256 acc, const uint8_t *w, const int8_t *xq,
                                                         const int16_t *bs16, const float *dx,
                                                         const BK_NAME(Q3kGfni) *k) {
    uint64_t lows8;
    uint32_t highs4;
    memcpy(&lows8, w + 96, 8);
    memcpy(&highs4, w + 104, 4);
    const __m128i lows = _mm_multishift_epi64_epi8(k->pick_low, _mm_set1_epi64x((long long)lows8));
    const __m128i highs =
        _mm_and_si128(_mm_multishift_epi64_epi8(k->pick_high, _mm_set1_epi32((int)highs4)), _mm_set1_epi8(0x30));
    /* 0xEC: (lows & 0x0F) | highs, the 6-bit scales; minus 32 as int16 */
    const __m128i scales = _mm_ternarylogic_epi32(lows, highs, _mm_set1_epi8(0x0F), 0xEC);
    const __m256i scale16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(scales), _mm256_set1_epi16(32));
    const __m512i sum = BK_NAME(q3_k_gfni_codes_)(w, xq, _mm512_castsi256_si512(scale16), 0, k);
    /* d times the activation scale in every lane (k16_finish_'s product, without a scalar round trip) */
    int16_t d16;
    memcpy(&d16, w + 108, 2);
    const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16(d16)), _mm256_broadcast_ss(dx));
    const __m256i sumi = _mm256_sub_epi32(BK_NAME(k16_sum_)(sum), BK_NAME(k16_offset_)(scale16, bs16, 2));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), d, acc);
}

/* super-blocks w and w + 110 (b, b + 1) of row_q3_k_gfni: lanes 0-7 of acc take b's 8 float terms, lanes 8-15 b +
 * 1's, each the same float operations as q3_k_gfni_block_'s. Per two: one scale unpack (256 bits: b's bytes, then
 * b + 1's; as 32 int16), one fold of both sums' 128-bit lanes k and k + 2 (two vshufi64x2 and an add), one offset
 * vpmaddwd against both 16-input sums, one conversion of both fp16 d */
BK_GFNI_TARGET BK_INLINE __m512 BK_NAME(q3_k_gfni_two_)(__m512 acc, const uint8_t *w, const int8_t *xq,
                                                       const int16_t *bs16, const float *dx,
                                                       const BK_NAME(Q3kGfni) *k) {
    int64_t lows[2];
    int32_t highs[2];
    uint16_t d16[2];
    for (int i = 0; i < 2; i++) {
        memcpy(&lows[i], w + 110 * i + 96, 8);
        memcpy(&highs[i], w + 110 * i + 104, 4);
        memcpy(&d16[i], w + 110 * i + 108, 2);
    }
    const __m256i pick_low = _mm256_broadcastsi128_si256(k->pick_low);
    const __m256i pick_high = _mm256_broadcastsi128_si256(k->pick_high);
    /* b's packed scales in the low 128 bits, b + 1's in the high: masked broadcast loads, no insert (a shuffle) */
    const __m256i lows2 = _mm256_mask_set1_epi64(_mm256_set1_epi64x(lows[0]), 0xC, lows[1]);
    const __m256i highs2 = _mm256_mask_set1_epi32(_mm256_set1_epi32(highs[0]), 0xF0, highs[1]);
    const __m256i bytes = _mm256_ternarylogic_epi32(
        _mm256_multishift_epi64_epi8(pick_low, lows2),
        _mm256_and_si256(_mm256_multishift_epi64_epi8(pick_high, highs2), _mm256_set1_epi8(0x30)),
        _mm256_set1_epi8(0x0F), 0xEC);
    const __m512i scales = _mm512_sub_epi16(_mm512_cvtepu8_epi16(bytes), _mm512_set1_epi16(32));
    const __m512i s0 = BK_NAME(q3_k_gfni_codes_)(w, xq, scales, 0, k);
    const __m512i s1 = BK_NAME(q3_k_gfni_codes_)(w + 110, xq + 256, scales, 16, k);
    const __m512i sums = _mm512_add_epi32(_mm512_shuffle_i64x2(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                                          _mm512_shuffle_i64x2(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i offset =
        _mm512_slli_epi32(_mm512_madd_epi16(scales, _mm512_loadu_si512((const void *)bs16)), 2);
    /* each d times its activation scale (the same float products), then each in its 8 lanes */
    const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)(d16[0] | (uint32_t)d16[1] << 16))),
                                 _mm_castpd_ps(_mm_load_sd((const double *)dx)));
    const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                           _mm512_castps128_ps512(dd));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset)), d, acc);
}

/* row_q3_k_ where the CPU has GFNI, AVX512-VBMI and BITALG (Q3_K_GFNI): the same int32 lanes and bytes. Per
 * super-block, qs by one 512-bit load and hmask by one broadcast, merged per byte by two bit selects after two
 * per-half word shifts of hmask, and the codes by four vgf2p8affineqb, one per code j of both qs halves
 * (q3_k_gfni_codes_; its inputs in ActRow.q3k's order); the thirteenth session's step took eight products, the
 * fifteenth's three broadcasts and four selects. The sixteen scales by two vpmultishiftqb (8-bit windows of the
 * packed lows and highs, two super-blocks' by masked broadcast loads) and one select instead of k3_scales_'s
 * general-register unpack (still the other bodies'). Two super-blocks per step (q3_k_gfni_two_): the even ones'
 * float terms in acc's lanes 0-7, the odd ones' in 8-15, added at the end, as the other bodies' acc[2]. On Zen 5
 * the shuffles, packs, bit-matrix products and 256-bit broadcast loads share two vector pipes, one of them with the
 * dot products (docs/performance.md, sixteenth session): fewer of those is what made this step faster. */
BK_GFNI_TARGET BK_INLINE float BK_NAME(q3_k_gfni_row_)(const uint8_t *w, const ActRow *a, int64_t nb,
                                                       const BK_NAME(Q3kGfni) *k) {
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, w += 220) {
        BK_NAME(stream_ahead_)(w, 220);
        acc = BK_NAME(q3_k_gfni_two_)(acc, w, a->q3k + b * 256, a->sums16 + b * 16, a->d + b, k);
    }
    __m256 even = BK_NAME(half512_)(acc, 0);
    if (b < nb) even = BK_NAME(q3_k_gfni_block_)(even, w, a->q3k + b * 256, a->sums16 + b * 16, a->d + b, k);
    return BK_NAME(hsum_)(_mm256_add_ps(even, BK_NAME(half512_)(acc, 1)));
}
BK_GFNI_TARGET static float BK_NAME(row_q3_k_gfni)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const BK_NAME(Q3kGfni) k = BK_NAME(q3_k_gfni_consts_)();
    return BK_NAME(q3_k_gfni_row_)(w, a, nb, &k);
}
BK_GFNI_TARGET static void BK_NAME(q3_k_gfni_rows_)(const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                                    int64_t row_bytes, int64_t nb) {
    const BK_NAME(Q3kGfni) k = BK_NAME(q3_k_gfni_consts_)();
    BK_ROWS(n, y, BK_NAME(q3_k_gfni_row_)(weight + r * row_bytes, a, nb, &k));
}
#undef BK_PICK3
#endif

BK_TARGET static float BK_NAME(row_q2_k_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 84) {
        const int8_t *xq = a->q + b * 256;
        const int32_t *bs = a->sums + b * 16;
        const __m128i packed = _mm_loadu_si128((const __m128i *)w); /* scale in the low nibble, minimum in the high */
        const __m128i lows = _mm_and_si128(packed, nibble), highs = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
        const __m256i msum = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_cvtepu8_epi32(highs), _mm256_loadu_si256((const __m256i *)bs)),
            _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(highs, 8)),
                               _mm256_loadu_si256((const __m256i *)(bs + 8))));
        const float dx = a->d[b];
        mins = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(BK_NAME(half_)(w + 82) * dx), mins);
        /* the scale goes into the codes before the dot: u * sc <= 3 * 15 = 45 per byte (one 16-bit multiply, no
         * carry between bytes), so one dot accumulates every sub-block and no 32-bit multiply per step is needed */
#if BK_MASKED
        /* both 128-weight halves per 512-bit step: 256-bit lanes h = 0 and h = 1 */
        const __m512i scale_bytes = _mm512_broadcast_i32x4(lows), q = _mm512_loadu_si512((const void *)(w + 16));
        __m512i sum2 = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i s16 = _mm512_shuffle_epi8(
                scale_bytes, _mm512_inserti64x4(
                                 _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)(0x8000 | (2 * j + 1))),
                                                                         _mm_set1_epi16((short)(0x8000 | (2 * j))))),
                                 _mm256_set_m128i(_mm_set1_epi16((short)(0x8000 | (2 * j + 9))),
                                                  _mm_set1_epi16((short)(0x8000 | (2 * j + 8)))), 1));
            const __m512i u =
                _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(q, 2 * j), _mm512_set1_epi8(3)), s16);
            const __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xq + 32 * j))),
                _mm256_loadu_si256((const __m256i *)(xq + 128 + 32 * j)), 1);
            sum2 = _mm512_dpbusd_epi32(sum2, u, x);
        }
        const __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(sum2), _mm512_extracti64x4_epi64(sum2, 1));
#else
        const __m256i three = _mm256_set1_epi8(3);
        const __m256i scale_bytes = _mm256_broadcastsi128_si256(lows);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * h));
            for (int j = 0; j < 4; j++) {
                const int k = 8 * h + 2 * j; /* sub-block k's scale in bytes 0-15's 16-bit lanes, k + 1's in 16-31 */
                const __m256i s16 = _mm256_shuffle_epi8(scale_bytes,
                                                        _mm256_set_m128i(_mm_set1_epi16((short)(0x8000 | (k + 1))),
                                                                         _mm_set1_epi16((short)(0x8000 | k))));
                const __m256i u = _mm256_mullo_epi16(_mm256_and_si256(q, three), s16);
                q = _mm256_srli_epi16(q, 2);
                sumi = BK_DOT(sumi, u, _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * j)));
            }
        }
#endif
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(BK_NAME(half_)(w + 80) * dx), acc);
    }
    return BK_NAME(hsum_)(_mm256_sub_ps(acc, mins));
}

/* ---- IQ4_XS: eight 32-weight blocks per super-block, a 6-bit scale minus 32 each (w = d * (scale - 32) * grid[u]).
 * The two bodies make the same integers (each block's dot) but round differently: the AVX-512 body converts each
 * block's int32 lanes (lane l: its weights 4l..4l + 3 and 16 + 4l..19 + 4l, the low- and high-nibble products of one
 * 4-byte group of codes, against the activation in ActRow.qn's order; at most 8 * 127 * 127, exact in float) and
 * multiplies them by the block's float scale (scale - 32) * (d * dx); the AVX2 body multiplies each block's int16
 * pair sums by its scale - 32 in integers and converts once per super-block (row_iq4_xs_ below: on AVX2 the vector
 * ports are the bottleneck, and vpdpbusd takes a block's dot in one instruction on AVX-512). Their outputs agree
 * within float32 rounding and one bfloat16 step, not bit for bit (tests/ops/test_isa.py). ---- */

/* d * dx of super-block b at w (float16 d times the activation scale) */
BK_TARGET static inline float BK_NAME(iq4_xs_dd_)(const uint8_t *w, const ActRow *a, int64_t b) {
    return BK_NAME(half_)(w) * a->d[b];
}

#if BK_MASKED
/* IQ4_XS's eight 6-bit block scales minus 32 of the super-blocks at w0 (int32 lanes 0-7) and w1 (lanes 8-15) */
BK_TARGET static inline __m512i BK_NAME(iq4_xs_scales2_)(const uint8_t *w0, const uint8_t *w1) {
    const __m512i shift_l = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i shift_h = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    uint16_t high0, high1;
    uint32_t lows0, lows1;
    memcpy(&high0, w0 + 2, 2);
    memcpy(&lows0, w0 + 4, 4);
    memcpy(&high1, w1 + 2, 2);
    memcpy(&lows1, w1 + 4, 4);
    const __m512i lows = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)lows0), 0xFF00, (int)lows1);
    const __m512i high = _mm512_mask_set1_epi32(_mm512_set1_epi32(high0), 0xFF00, high1);
    const __m512i low4 = _mm512_and_si512(_mm512_srlv_epi32(lows, shift_l), _mm512_set1_epi32(15));
    const __m512i high2 = _mm512_and_si512(_mm512_srlv_epi32(high, shift_h), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(low4, _mm512_slli_epi32(high2, 4)), _mm512_set1_epi32(32));
}

/* super-block b at w into acc[0] (blocks 0-3) and acc[1] (4-7): per four blocks (one per 128-bit lane) their 64
 * bytes of codes (at 8 + 136 b, never 64-byte aligned: as two 32-byte loads, with this step 1.15-1.2x the speed of
 * one 512-bit load across two lines from memory), their low and high nibbles on the unsigned grid gu (grid + 128)
 * dotted with the activation in qn's order by two vpdpbusd into one register started from startxs (-128 times the
 * inputs' sums per lane: the signed dot), converted and times the blocks' scales (scales: 16 floats, this
 * super-block's at lanes at..at + 7) */
BK_TARGET BK_INLINE void BK_NAME(iq4_xs_super_)(const uint8_t *w, const ActRow *a, int64_t b, __m512 scales, int at,
                                                 __m512i gu, __m512 *acc) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int g = 0; g < 2; g++) {
        const uint8_t *codes = w + 8 + 64 * g; /* two 32-byte loads: one 64-byte load here always spans two lines */
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)codes)),
                                             _mm256_loadu_si256((const __m256i *)(codes + 32)), 1);
        const __m512i lo = _mm512_shuffle_epi8(gu, _mm512_and_si512(v, low));
        const __m512i hi = _mm512_shuffle_epi8(gu, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        const int8_t *xn = a->qn + b * 256 + 128 * g;
        __m512i p = _mm512_load_si512((const void *)(a->startxs + b * 32 + 16 * g));
        p = _mm512_dpbusd_epi32(p, lo, _mm512_load_si512((const void *)xn));
        p = _mm512_dpbusd_epi32(p, hi, _mm512_load_si512((const void *)(xn + 64)));
        const __m512 s = _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(at + 4 * g)), scales);
        acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[g]);
    }
}

/* IQ4_XS on AVX-512: two super-blocks' scales per step (float lanes 0-7: super-block b's, 8-15: b + 1's) */
BK_TARGET static float BK_NAME(row_iq4_xs_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m512i gu = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_GRID)),
                                        _mm512_set1_epi8((char)0x80));
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 272) {
        BK_NAME(stream_ahead_)(w, 272);
        const __m512 dd = _mm512_mask_broadcastss_ps(_mm512_set1_ps(BK_NAME(iq4_xs_dd_)(w, a, b)), 0xFF00,
                                                     _mm_set1_ps(BK_NAME(iq4_xs_dd_)(w + 136, a, b + 1)));
        const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(BK_NAME(iq4_xs_scales2_)(w, w + 136)), dd);
        BK_NAME(iq4_xs_super_)(w, a, b, scales, 0, gu, acc);
        BK_NAME(iq4_xs_super_)(w + 136, a, b + 1, scales, 8, gu, acc);
    }
    if (b < nb) { /* an odd last super-block */
        const __m512 dd = _mm512_set1_ps(BK_NAME(iq4_xs_dd_)(w, a, b));
        const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(BK_NAME(iq4_xs_scales2_)(w, w)), dd);
        BK_NAME(iq4_xs_super_)(w, a, b, scales, 0, gu, acc);
    }
    const __m512 sum = _mm512_add_ps(acc[0], acc[1]);
    return BK_NAME(hsum_)(_mm256_add_ps(BK_NAME(half512_)(sum, 0), BK_NAME(half512_)(sum, 1)));
}

/* IQ4_XS in the R16 layout (blocks_cpu.c, after r8_offset): one group of 16 rows (w: its first R16 block of 2176
 * bytes) -> the 16 rows' float sums, int32 / float lane r row r's. Per 32-weight sub-block s: four 64-byte chunks of
 * codes (4 code bytes of each of the 16 rows), their low and high nibbles on the unsigned grid gu (grid + 128) dotted
 * with one broadcast of 4 activations each by vpdpbusd, the lanes started from -128 times the sub-block's activation
 * sum (ActRow.sums32: the signed dot, as row_iq4_xs_'s startxs); at most 32 * 127 * 127 in magnitude, exact in float;
 * converted and times the 16 rows' scale - 32 (one vector per sub-block, from the rows' scales_l and scales_h) into
 * the super-block's float sums, which are times the rows' d * dx (one vcvtph2ps) into the total. Against the row
 * kernel: the same integers per sub-block, another float order (within float32 summation and one bfloat16 step).
 * Why: the row kernel spends per 64 bytes of codes a lane permute of the block scales, a 2-line load and an insert;
 * here the scales are lanes and the activations broadcasts (memory operands), about 0.7 of its vector instructions:
 * 1.5x its GB/s in the L2, 1.13-1.16x from memory on the 1.2B's layer shapes at one and two threads (an AVX-512
 * Xeon, docs/performance.md, issue #32, twenty-sixth session). The stream is asked for one line per 64-byte chunk,
 * R16_AHEAD bytes ahead, into the L2 (prefetcht1): asking for a super-block's 34 lines at once at its start measured
 * 0.73-0.92x the row kernel there, whatever the distance or hint. */
#ifndef R16_HINT
#define R16_HINT _MM_HINT_T1
#endif
#ifndef R16_AHEAD
#define R16_AHEAD 4096
#endif
BK_TARGET BK_INLINE __m512 BK_NAME(r16_iq4_xs_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m512i gu = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_GRID)),
                                        _mm512_set1_epi8((char)0x80));
    const __m512i low = _mm512_set1_epi8(0x0F), nibble = _mm512_set1_epi32(0x0F), two_bits = _mm512_set1_epi32(0x30);
    const __m512i thirty_two = _mm512_set1_epi32(32);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 2176) {
        _mm_prefetch((const char *)(w + R16_AHEAD), R16_HINT);
        _mm_prefetch((const char *)(w + R16_AHEAD + 64), R16_HINT);
        const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w)),
                                        _mm512_set1_ps(a->d[b]));
        const __m512i lows = _mm512_loadu_si512((const void *)(w + 64));
        const __m256i high16 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m512i highs = _mm512_slli_epi32(_mm512_cvtepu16_epi32(high16), 4);
        const int8_t *q = a->q + 256 * b;
        __m512 sums = _mm512_setzero_ps();
        for (int s = 0; s < 8; s++) {
            const __m512i six = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lows, 4 * s), nibble),
                                                _mm512_and_si512(_mm512_srli_epi32(highs, 2 * s), two_bits));
            const __m512 scale = _mm512_cvtepi32_ps(_mm512_sub_epi32(six, thirty_two));
            __m512i p = _mm512_set1_epi32(-128 * a->sums32[8 * b + s]);
            const uint8_t *c = w + 128 + 256 * s;
            for (int j = 0; j < 4; j++) {
                _mm_prefetch((const char *)(c + 64 * j + R16_AHEAD), R16_HINT);
                const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * j));
                const __m512i lo = _mm512_shuffle_epi8(gu, _mm512_and_si512(v, low));
                const __m512i hi = _mm512_shuffle_epi8(gu, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                int32_t x_lo, x_hi;
                memcpy(&x_lo, q + 32 * s + 4 * j, 4);
                memcpy(&x_hi, q + 32 * s + 16 + 4 * j, 4);
                p = _mm512_dpbusd_epi32(p, lo, _mm512_set1_epi32(x_lo));
                p = _mm512_dpbusd_epi32(p, hi, _mm512_set1_epi32(x_hi));
            }
            sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, sums);
        }
        acc = _mm512_fmadd_ps(sums, dd, acc);
    }
    return acc;
}

/* the 16 floats of v rounded to bfloat16 at y (float_to_bf16 lane by lane) */
BK_TARGET static inline void BK_NAME(store16_bf16_)(__m512 v, uint16_t *y) {
    float f[16];
    _mm512_storeu_ps(f, v);
    for (int i = 0; i < 16; i++) y[i] = float_to_bf16(f[i]);
}

/* one R16 part's rows: the groups of 16 split over the threads of the enclosing OpenMP region (part_rows_'s loop) */
BK_TARGET static void BK_NAME(r16_rows_)(const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                         int64_t row_bytes, int64_t nb) {
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < n / 16; g++)
        BK_NAME(store16_bf16_)(BK_NAME(r16_iq4_xs_)(weight + g * 16 * row_bytes, a, nb), y + 16 * g);
}
#else
/* IQ4_XS's eight 6-bit block scales minus 32 of the super-block at w as 8 int16 (word j: block j's): the 4-bit lows
 * (bytes 4-7) interleaved with their 16-bit shift by 4 and masked (byte j: nibble j % 2 of byte j / 2), the 2-bit
 * highs (bytes 2-3) by one 16-bit multiply per word by 2^(14 - 2j) (field j to bits 14-15) and two shifts: 11 vector
 * instructions, where a spread in general registers took about 30 and was no faster */
BK_TARGET static inline __m128i BK_NAME(iq4_xs_scales16_)(const uint8_t *w) {
    uint16_t high;
    uint32_t lows;
    memcpy(&high, w + 2, 2);
    memcpy(&lows, w + 4, 4);
    const __m128i l = _mm_cvtsi32_si128((int)lows);
    const __m128i nibbles = _mm_and_si128(_mm_unpacklo_epi8(l, _mm_srli_epi16(l, 4)), _mm_set1_epi8(0x0F));
    const __m128i powers = _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1);
    const __m128i fields = _mm_mullo_epi16(_mm_set1_epi16((short)high), powers);
    const __m128i highs = _mm_slli_epi16(_mm_srli_epi16(fields, 14), 4);
    return _mm_sub_epi16(_mm_or_si128(_mm_cvtepu8_epi16(nibbles), highs), _mm_set1_epi16(32));
}

/* one IQ4_XS super-block's int32 lanes on AVX2 (w: its 136 bytes, xn: its 256 inputs in ActRow.qn's order; grid:
 * IQ4_GRID in both 128-bit lanes): two blocks per step (one per 128-bit lane), their signed grid values' magnitudes
 * against the activation with their signs (vpmaddubsw: int16 pair sums at most 2 * 127 * 127 = 32258, no
 * saturation), each pair sum times its block's scale - 32 as int16 (vpmaddwd, in place of BK_DOT's by ones; the
 * scales as 8 int16 in both 128-bit lanes, each step's two picked by an in-lane byte shuffle), summed in int32. An
 * int32 lane takes 8 vpmaddwd (4 steps, low and high nibbles) of at most 2 * 32258 * 32 = 2064512 in magnitude each:
 * at most 16516096 < 2^24, so no overflow, and the conversion to float is exact. */
BK_TARGET BK_INLINE __m256i BK_NAME(iq4_xs_sum_)(const uint8_t *w, const int8_t *xn, __m256i grid) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i both = _mm256_broadcastsi128_si256(BK_NAME(iq4_xs_scales16_)(w));
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 8 + 32 * j));
        const __m256i lo = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, low));
        const __m256i hi = _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        const int8_t *x = xn + 128 * (j / 2) + 32 * (j % 2);
        const __m256i x_lo = _mm256_load_si256((const __m256i *)x);
        const __m256i x_hi = _mm256_load_si256((const __m256i *)(x + 64));
        /* words 2j (lower lane) and 2j + 1 (upper lane) in every word of their lane */
        const __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))),
                                              _mm_set1_epi16((short)((4 * j + 1) << 8 | 4 * j)));
        const __m256i s = _mm256_shuffle_epi8(both, pick);
        const __m256i p_lo = _mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(x_lo, lo));
        const __m256i p_hi = _mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(x_hi, hi));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(p_lo, s), _mm256_madd_epi16(p_hi, s)));
    }
    return sumi;
}

/* IQ4_XS on AVX2: per super-block one conversion of its int32 lanes and one fmadd by d * dx, where one float per
 * block took a conversion, a scale pick and an fmadd per two blocks: 1.07-1.22x on a Zen 3 (docs/performance.md,
 * eighteenth session; measured there too: the scale pick by vpermd instead of the in-lane shuffle 0.90-0.98x, two
 * rows per step sharing the activation loads 0.90-0.96x, the magnitudes by a second lookup instead of vpabsb
 * 0.99-1.09x) */
BK_TARGET static float BK_NAME(row_iq4_xs_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 136) {
        BK_NAME(stream_ahead_)(w, 136);
        const __m256i sumi = BK_NAME(iq4_xs_sum_)(w, a->qn + b * 256, grid);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(BK_NAME(iq4_xs_dd_)(w, a, b)), acc);
    }
    return BK_NAME(hsum_)(acc);
}
#endif

/* ---- 32-weight blocks, activations in Q8Row32 (one float scale and one sum per 32) ----
 * Each type's step adds one block's float contribution to an accumulator; BK_ROW32 runs it over the row with four
 * accumulators in turn (one fmadd per block: a single accumulator would wait on its latency every block). */

#define BK_ROW32(step, bytes, ...)                                                                         \
    do {                                                                                                   \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;                          \
        int64_t b = 0;                                                                                     \
        for (; b + 4 <= nb; b += 4, w += 4 * (bytes)) {                                                    \
            acc0 = step(w, a, b, acc0, __VA_ARGS__);                                                       \
            acc1 = step(w + (bytes), a, b + 1, acc1, __VA_ARGS__);                                         \
            acc2 = step(w + 2 * (bytes), a, b + 2, acc2, __VA_ARGS__);                                     \
            acc3 = step(w + 3 * (bytes), a, b + 3, acc3, __VA_ARGS__);                                     \
        }                                                                                                  \
        for (; b < nb; b++, w += (bytes)) acc0 = step(w, a, b, acc0, __VA_ARGS__);                         \
        return BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));         \
    } while (0)

#if BK_MASKED
/* BK_ROW32 with AVX-512 steps of two blocks (`pair`, 16 float lanes: block b in lanes 0-7, b + 1 in lanes 8-15): the
 * same integers, products and float additions into the same four accumulators (accA's halves are acc0 and acc1,
 * accB's acc2 and acc3), so the same result bit for bit, with one conversion, scale and fmadd per two blocks. */
#define BK_ROW32_PAIRS(pair, step, bytes, ...)                                                             \
    do {                                                                                                   \
        __m512 accA = _mm512_setzero_ps(), accB = accA;                                                    \
        int64_t b = 0;                                                                                     \
        for (; b + 4 <= nb; b += 4, w += 4 * (bytes)) {                                                    \
            accA = pair(w, a, b, accA, (bytes), __VA_ARGS__);                                              \
            accB = pair(w + 2 * (bytes), a, b + 2, accB, (bytes), __VA_ARGS__);                            \
        }                                                                                                  \
        __m256 acc0 = BK_NAME(half512_)(accA, 0), acc1 = BK_NAME(half512_)(accA, 1);                       \
        __m256 acc2 = BK_NAME(half512_)(accB, 0), acc3 = BK_NAME(half512_)(accB, 1);                       \
        for (; b < nb; b++, w += (bytes)) acc0 = step(w, a, b, acc0, __VA_ARGS__);                         \
        return BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));         \
    } while (0)

/* The float16 fields at p and p + 2 of two blocks (at p and p + bytes) as floats [f0, f0', f1, f1'] times the blocks'
 * activation scales [dx0, dx0, dx1, dx1]: the products the one-block steps make, in float32 */
BK_TARGET static inline __m128 BK_NAME(halves_dx_)(const uint8_t *p, int64_t bytes, const ActRow *a, int64_t b) {
    uint32_t h0, h1;
    memcpy(&h0, p, 4);
    memcpy(&h1, p + bytes, 4);
    const __m128 f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)h0), (int)h1, 1));
    const __m128 dx = _mm_castpd_ps(_mm_load_sd((const double *)(a->d + b)));
    return _mm_mul_ps(f, _mm_unpacklo_ps(dx, dx));
}

/* acc + v[0] in lanes 0-7 and v[2] in lanes 8-15 times the converted integer dots p: the fmadd of two blocks */
BK_TARGET static inline __m512 BK_NAME(scale_pair_)(__m512i p, __m128 v, __m512 acc) {
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(v)), acc);
}

/* signed_step_ of two blocks: acc + d * (the dot of signed codes with the activations), the sign moved onto x where
 * q < 0 (Q8_0: its codes + 128 against x, vpdpbusd started from bias4's -128 times each 4 activations' sum, were 0.95x
 * as fast, one more 64-byte load per two blocks) */
BK_TARGET static inline __m512 BK_NAME(signed_pair_)(__m512i q, const uint8_t *w, int64_t bytes, const ActRow *a,
                                                     int64_t b, __m512 acc) {
    const __m512i x = _mm512_loadu_si512((const void *)(a->q + 32 * b));
    const __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), sx);
    return BK_NAME(scale_pair_)(p, BK_NAME(halves_dx_)(w, bytes, a, b), acc);
}

BK_TARGET static inline __m512 BK_NAME(q8_0_pair_)(const uint8_t *w, const ActRow *a, int64_t b, __m512 acc,
                                                   int64_t bytes, int unused) {
    (void)unused;
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                         _mm256_loadu_si256((const __m256i *)(w + bytes + 2)), 1);
    return BK_NAME(signed_pair_)(q, w, bytes, a, b, acc);
}

#define BK_ROW32_FAST(pair, step, bytes, ...) BK_ROW32_PAIRS(pair, step, bytes, __VA_ARGS__)
#else
#define BK_ROW32_FAST(pair, step, bytes, ...) BK_ROW32(step, bytes, __VA_ARGS__)
#endif

/* acc + d * (the dot of signed codes q with the activation block b) */
BK_TARGET static inline __m256 BK_NAME(signed_step_)(__m256i q, const ActRow *a, int64_t b, __m256 acc, float d) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
    const __m256i p = BK_DOT(_mm256_setzero_si256(), _mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a->d[b]), acc);
}

BK_TARGET static inline __m256 BK_NAME(q8_0_step_)(const uint8_t *w, const ActRow *a, int64_t b, __m256 acc, int unused) {
    (void)unused;
    return BK_NAME(signed_step_)(_mm256_loadu_si256((const __m256i *)(w + 2)), a, b, acc, BK_NAME(half_)(w));
}

BK_TARGET static float BK_NAME(row_q8_0_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    BK_ROW32_FAST(BK_NAME(q8_0_pair_), BK_NAME(q8_0_step_), 34, 0);
}

BK_TARGET static inline __m256 BK_NAME(iq4_nl_step_)(const uint8_t *w, const ActRow *a, int64_t b, __m256 acc,
                                                     __m256i grid) {
    const __m256i g = _mm256_shuffle_epi8(grid, BK_NAME(nibbles32_)(w + 2));
    return BK_NAME(signed_step_)(g, a, b, acc, BK_NAME(half_)(w));
}


/* HQ3_0 (w = d * (u - 4)): bits 0-1 of code 8i + l are bits 2i, 2i + 1 of qs[l] (one 64-bit shift per 8 codes),
 * bit 2 is bit e of qh; the -4 multiplies the activation sum (an integer term of the block's dot) */
BK_TARGET static inline __m256 BK_NAME(hq3_0_step_)(const uint8_t *w, const ActRow *a, int64_t b, __m256 acc,
                                                    int unused) {
    (void)unused;
    const __m256i three = _mm256_set1_epi8(3), shifts = _mm256_set_epi64x(6, 4, 2, 0);
    long long qs;
    memcpy(&qs, w + 2, 8);
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(qs), shifts), three);
    const __m256i u = BK_NAME(add_high_)(low, w + 10, 4);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
    const __m256i p = BK_NAME(sub_lane0_)(BK_DOT(_mm256_setzero_si256(), u, x), 4 * a->sums[b]);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(BK_NAME(half_)(w) * a->d[b]), acc);
}

BK_TARGET static float BK_NAME(row_hq3_0_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    BK_ROW32(BK_NAME(hq3_0_step_), 14, 0);
}

/* HQ3_NL: HQ3_0's 3-bit codes u looked up in the int8 grid (a byte shuffle, as IQ4_NL's), then a signed dot */
BK_TARGET static inline __m256 BK_NAME(hq3_nl_step_)(const uint8_t *w, const ActRow *a, int64_t b, __m256 acc,
                                                     __m256i grid) {
    const __m256i three = _mm256_set1_epi8(3), shifts = _mm256_set_epi64x(6, 4, 2, 0);
    long long qs;
    memcpy(&qs, w + 2, 8);
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(qs), shifts), three);
    const __m256i u = BK_NAME(add_high_)(low, w + 10, 4);
    return BK_NAME(signed_step_)(_mm256_shuffle_epi8(grid, u), a, b, acc, BK_NAME(half_)(w));
}

BK_TARGET static float BK_NAME(row_hq3_nl_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)HQ3_NL_GRID));
    BK_ROW32(BK_NAME(hq3_nl_step_), 14, grid);
}

#if BK_MASKED
/* HQ3_R (AVX-512): one 64-weight block per 512-bit step, int32 lane l holding weights 4l to 4l + 3, so lanes 4i to
 * 4i + 3 are sub-block i. The signed scales of the blocks of a group of four (block j at w + 27 j) times their
 * activation scales, as 16 float lanes in the order of dxs (lane 4i + j: block j's sub-block i, so one in-lane
 * vpermilps gives block j's lanes): block j's 24 field bits broadcast to lanes j, 4 + j, 8 + j, 12 + j, shifted right
 * by 6 i (the level table reads bits 0-4: e), bit 5 (s) shifted to bit 31 and xored on, times dxs (the group's 16
 * floats). f: the fields (lane 4i + j: block j's bytes 0-3). */
BK_TARGET static inline __m512 BK_NAME(hq3_r_scales_)(__m512i f, __m512 dxs, __m512 levels_lo, __m512 levels_hi) {
    const __m512i sub = _mm512_setr_epi32(0, 0, 0, 0, 6, 6, 6, 6, 12, 12, 12, 12, 18, 18, 18, 18);
    const __m512 level = _mm512_permutex2var_ps(levels_lo, _mm512_srlv_epi32(f, sub), levels_hi);
    const __m512i sign = _mm512_sllv_epi32(f, _mm512_sub_epi32(_mm512_set1_epi32(26), sub));
    /* level ^ (sign & 0x80000000): ternary-logic truth table 0x78 = a ^ (b & c) */
    const __m512 scale = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(level), sign,
                                                                       _mm512_set1_epi32(INT32_MIN), 0x78));
    return _mm512_mul_ps(scale, dxs);
}

/* hq3_r_scales_ of blocks first to first + count - 1 of the group at w (fields by masked broadcasts) */
BK_TARGET static inline __m512 BK_NAME(hq3_r_scales4_)(const uint8_t *w, const float *dxs, int first, int count,
                                                      __m512 levels_lo, __m512 levels_hi) {
    __m512i f = _mm512_setzero_si512();
    for (int j = first; j < first + count; j++) { /* bytes 0-3: byte 3 (a code byte) lands in bits 24-31, unread */
        int32_t fields;
        memcpy(&fields, w + 27 * j, 4);
        f = _mm512_mask_set1_epi32(f, (__mmask16)(0x1111 << j), fields);
    }
    const __mmask16 lanes = (__mmask16)(0x1111 * ((1u << count) - 1) << first);
    return BK_NAME(hq3_r_scales_)(f, _mm512_maskz_loadu_ps(lanes, dxs), levels_lo, levels_hi);
}

/* the row_hq3_r_ of the VNNI body, and (BK_GFNI_TARGET) the same with GFNI's code extraction: hq3r_body.h */
#define HQ3R_SUFFIX shift
#define HQ3R_TARGET BK_TARGET
#define HQ3R_GFNI 0
#include "hq3r_body.h"
#undef HQ3R_SUFFIX
#undef HQ3R_TARGET
#undef HQ3R_GFNI
#define HQ3R_SUFFIX gfni
#define HQ3R_TARGET BK_GFNI_TARGET
#define HQ3R_GFNI 1
#include "hq3r_body.h"
#undef HQ3R_SUFFIX
#undef HQ3R_TARGET
#undef HQ3R_GFNI
#else
/* HQ3_R: a row is D (float16), then blocks of 64 weights: 3 bytes of four 6-bit sub-block scale fields, then two
 * groups of 32 codes in HQ3_0's packing. Per group: the codes looked up in HQ3_NL's grid (a byte shuffle), a signed
 * dot with the activation block (int32 lanes 0-3 hold the first 16 weights' sums, 4-7 the next 16), each half times
 * its sub-block's scale relative to D and the activation scale; D multiplies the row's sum once. */
BK_TARGET static inline __m256 BK_NAME(hq3_r_group_)(const uint8_t *g, const ActRow *a, int64_t b, __m256 acc,
                                                     __m256i grid, float s0, float s1) {
    const __m256i three = _mm256_set1_epi8(3), shifts = _mm256_set_epi64x(6, 4, 2, 0);
    long long qs;
    memcpy(&qs, g, 8);
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(qs), shifts), three);
    const __m256i q = _mm256_shuffle_epi8(grid, BK_NAME(add_high_)(low, g + 8, 4));
    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
    const __m256i p = BK_DOT(_mm256_setzero_si256(), _mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
    const float dx = a->d[b];
    const __m256 scale = _mm256_set_m128(_mm_set1_ps(s1 * dx), _mm_set1_ps(s0 * dx));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
}

BK_TARGET static float BK_NAME(row_hq3_r_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)HQ3_NL_GRID));
    const float d_row = BK_NAME(half_)(w);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    w += 2;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 54) { /* two blocks a step: four independent accumulators */
        const uint32_t f = (uint32_t)w[0] | ((uint32_t)w[1] << 8) | ((uint32_t)w[2] << 16);
        const uint32_t g = (uint32_t)w[27] | ((uint32_t)w[28] << 8) | ((uint32_t)w[29] << 16);
        acc0 = BK_NAME(hq3_r_group_)(w + 3, a, 2 * b, acc0, grid, HQ3R_SIGNED[f & 63], HQ3R_SIGNED[(f >> 6) & 63]);
        acc1 = BK_NAME(hq3_r_group_)(w + 15, a, 2 * b + 1, acc1, grid, HQ3R_SIGNED[(f >> 12) & 63], HQ3R_SIGNED[f >> 18]);
        acc2 = BK_NAME(hq3_r_group_)(w + 30, a, 2 * b + 2, acc2, grid, HQ3R_SIGNED[g & 63], HQ3R_SIGNED[(g >> 6) & 63]);
        acc3 = BK_NAME(hq3_r_group_)(w + 42, a, 2 * b + 3, acc3, grid, HQ3R_SIGNED[(g >> 12) & 63], HQ3R_SIGNED[g >> 18]);
    }
    for (; b < nb; b++, w += 27) {
        const uint32_t fields = (uint32_t)w[0] | ((uint32_t)w[1] << 8) | ((uint32_t)w[2] << 16);
        const float s0 = HQ3R_SIGNED[fields & 63], s1 = HQ3R_SIGNED[(fields >> 6) & 63];
        const float s2 = HQ3R_SIGNED[(fields >> 12) & 63], s3 = HQ3R_SIGNED[fields >> 18];
        acc0 = BK_NAME(hq3_r_group_)(w + 3, a, 2 * b, acc0, grid, s0, s1);
        acc1 = BK_NAME(hq3_r_group_)(w + 15, a, 2 * b + 1, acc1, grid, s2, s3);
    }
    return d_row * BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
}
#endif

/* Q4_0 / Q5_0 (w = d * (u - offset): the offset times the activation sum, an integer term of the block's dot) and
 * Q4_1 / Q5_1 (w = d * u + m: m times the activation sum, in lane 0 of the float contribution); u the 4- or 5-bit
 * code. kind: bit 0 five-bit, bit 1 affine; offset 8 or 16 */
BK_TARGET static inline __m256 BK_NAME(legacy_step_)(const uint8_t *w, const ActRow *a, int64_t b, __m256 acc,
                                                     int kind, int32_t offset) {
    const int five = kind & 1, affine = kind >> 1, codes_at = 2 + 2 * affine + 4 * five;
    __m256i u = BK_NAME(nibbles32_)(w + codes_at);
    if (five) u = BK_NAME(add_high_)(u, w + 2 + 2 * affine, 16);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
    __m256i p = BK_DOT(_mm256_setzero_si256(), u, x);
    if (!affine) p = BK_NAME(sub_lane0_)(p, offset * a->sums[b]);
    const float dx = a->d[b];
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(BK_NAME(half_)(w) * dx), acc);
    if (affine)
        acc = _mm256_add_ps(acc, _mm256_setr_ps(BK_NAME(half_)(w + 2) * dx * (float)a->sums[b], 0, 0, 0, 0, 0, 0, 0));
    return acc;
}

#if BK_MASKED
/* acc_lo / acc_hi of a four-block step -> BK_ROW32's accumulators 0-3 (acc c = [acc_lo lanes 4c..4c + 3, acc_hi
 * lanes 4c..4c + 3]) */
BK_TARGET static inline void BK_NAME(split4_)(__m512 acc_lo, __m512 acc_hi, __m256 *acc) {
    const __m512 acc01 = _mm512_permutex2var_ps(
        acc_lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), acc_hi);
    const __m512 acc23 = _mm512_permutex2var_ps(
        acc_lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), acc_hi);
    acc[0] = BK_NAME(half512_)(acc01, 0);
    acc[1] = BK_NAME(half512_)(acc01, 1);
    acc[2] = BK_NAME(half512_)(acc23, 0);
    acc[3] = BK_NAME(half512_)(acc23, 1);
}

/* Q4_0 and IQ4_NL (18-byte blocks: float16 d, 16 bytes of codes) on AVX-512, four blocks per step, block c in 128-bit
 * lane c: their low nibbles (weights 0-15) and high nibbles (16-31) dotted with the activation in that order
 * (ActRow.qn), int32 lane l of block c holding the products of weights 4l..4l + 3 (lo) or 16 + 4l.. (hi), the lanes
 * l and l + 4 of the one-block step; Q4_0's dots start from off8n (its offset 8 times the block sum, in lane
 * 0), IQ4_NL's (grid + 128) from biasn, as the one-block and two-block steps subtract them: the same integers.
 * Each lane's float fmadd goes into the lane of the same accumulator (acc_lo lane 4c + l: BK_ROW32's acc c lane l;
 * acc_hi: l + 4) in the same order of blocks, and the tail and the final sums are BK_ROW32_PAIRS's: the same
 * bytes. */
BK_TARGET static inline float BK_NAME(row32_nibbles_)(const uint8_t *w, const ActRow *a, int64_t nb, int iq4,
                                                      __m256i grid) {
    const __m512i grid_u = _mm512_xor_si512(_mm512_broadcast_i64x4(grid), _mm512_set1_epi8((char)0x80));
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    /* d of block c: word 9c of the four blocks' 72 bytes */
    const __m512i d_words = _mm512_zextsi128_si512(_mm_setr_epi16(0, 9, 18, 27, 0, 0, 0, 0));
    __m512 acc_lo = _mm512_setzero_ps(), acc_hi = acc_lo;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4, w += 72) {
        BK_NAME(stream_ahead_)(w, 72);
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w + 2)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 20)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 38)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 56)), 3);
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const int8_t *xn = a->qn + 32 * b;
        __m512i start_lo = _mm512_load_si512((const void *)(a->off8n + 4 * b)), start_hi = _mm512_setzero_si512();
        if (iq4) {
            lo = _mm512_shuffle_epi8(grid_u, lo);
            hi = _mm512_shuffle_epi8(grid_u, hi);
            start_lo = _mm512_load_si512((const void *)(a->biasn + 8 * b));
            start_hi = _mm512_load_si512((const void *)(a->biasn + 8 * b + 16));
        }
        const __m512i p_lo = _mm512_dpbusd_epi32(start_lo, lo, _mm512_load_si512((const void *)xn));
        const __m512i p_hi = _mm512_dpbusd_epi32(start_hi, hi, _mm512_load_si512((const void *)(xn + 64)));
        /* d of the four blocks (float16) times their activation scales, as halves_dx_'s float32 products */
        const __m128 d = _mm_cvtph_ps(_mm512_castsi512_si128(
            _mm512_permutexvar_epi16(d_words, _mm512_loadu_si512((const void *)w))));
        const __m512 s = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_mul_ps(d, _mm_loadu_ps(a->d + b))));
        acc_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_lo), s, acc_lo);
        acc_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_hi), s, acc_hi);
    }
    __m256 acc[4];
    BK_NAME(split4_)(acc_lo, acc_hi, acc);
    for (; b < nb; b++, w += 18)
        acc[0] = iq4 ? BK_NAME(iq4_nl_step_)(w, a, b, acc[0], grid) : BK_NAME(legacy_step_)(w, a, b, acc[0], 0, 8);
    return BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* Q4_1 (kind 2, 20-byte blocks), Q5_0 (kind 1, 22) and Q5_1 (kind 3, 24) on AVX-512, four blocks per step as Q4_0's
 * above: block c in 128-bit lane c, its low nibbles (weights 0-15) and high nibbles (16-31) against ActRow.qn; the
 * five-bit types add 16 where their qh bit is set (bits 0-15 of block c's qh on the low register's lane c, 16-31 on
 * the high one's), Q5_0's dots start from 2 off8n (its offset 16 times the block sum, in lane 0). legacy4_fields_
 * gathers the four blocks' float16 d (and m) and qh halves as words by one vpermt2w of the group's first and last 64
 * bytes. The floats are legacy_step_'s lane by lane: fmadd of the converted dots times d dx, then (Q4_1, Q5_1) m dx
 * times the block's activation sum added to the block's lane 0 (a masked add: the other lanes, never -0.0, add
 * nothing), so the same bytes as before. */

/* word of byte `at` of a group of four blocks in legacy4_fields_'s two loads (words 0-31: the group's first 64 bytes,
 * 32-63: its last 64) */
BK_TARGET static inline short BK_NAME(legacy4_word_)(int64_t bytes, int64_t at) {
    return (short)(at + 2 <= 64 ? at / 2 : 32 + (at - (4 * bytes - 64)) / 2);
}

/* the four blocks at w: *s = d dx per block in its four lanes (quad), *m = m dx sum(x) (affine), *high_lo / *high_hi
 * the qh bits of the low / high nibbles' bytes (five) */
BK_TARGET static inline void BK_NAME(legacy4_fields_)(const uint8_t *w, const ActRow *a, int64_t b, int64_t bytes,
                                                      int kind, __m512 *s, __m512 *m, __mmask64 *high_lo,
                                                      __mmask64 *high_hi) {
    const int five = kind & 1, affine = kind >> 1, qh_at = 2 + 2 * affine;
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t m0 = affine ? 2 : 0, q0 = five ? qh_at : 0, q1 = five ? qh_at + 2 : 0;
#define BK_W(at) BK_NAME(legacy4_word_)(bytes, at)
    const __m256i idx = _mm256_setr_epi16(BK_W(0), BK_W(bytes), BK_W(2 * bytes), BK_W(3 * bytes), BK_W(m0),
                                          BK_W(bytes + m0), BK_W(2 * bytes + m0), BK_W(3 * bytes + m0), BK_W(q0),
                                          BK_W(bytes + q0), BK_W(2 * bytes + q0), BK_W(3 * bytes + q0), BK_W(q1),
                                          BK_W(bytes + q1), BK_W(2 * bytes + q1), BK_W(3 * bytes + q1));
#undef BK_W
    const __m512i first = _mm512_loadu_si512((const void *)w);
    const __m512i f = !five && 3 * bytes + m0 + 2 <= 64 /* Q4_1: every field in the first 64 bytes */
                          ? _mm512_permutexvar_epi16(_mm512_zextsi256_si512(idx), first)
                          : _mm512_permutex2var_epi16(first, _mm512_zextsi256_si512(idx),
                                                      _mm512_loadu_si512((const void *)(w + 4 * bytes - 64)));
    const __m128 dx = _mm_loadu_ps(a->d + b);
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(f)), _mm256_set_m128(dx, dx));
    *s = _mm512_permutexvar_ps(quad, _mm512_castps256_ps512(v));
    if (affine) {
        const __m128 sums = _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)(a->sums + b)));
        *m = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_mul_ps(_mm256_extractf128_ps(v, 1), sums)));
    }
    if (five) {
        const __m128i qh = _mm512_extracti32x4_epi32(f, 1);
        *high_lo = _cvtu64_mask64((uint64_t)_mm_cvtsi128_si64(qh));
        *high_hi = _cvtu64_mask64((uint64_t)_mm_extract_epi64(qh, 1));
    }
}

BK_TARGET static inline float BK_NAME(row32_legacy4_)(const uint8_t *w, const ActRow *a, int64_t nb, int64_t bytes,
                                                      int kind, int32_t offset) {
    const int five = kind & 1, affine = kind >> 1, codes_at = 2 + 2 * affine + 4 * five;
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    __m512 acc_lo = _mm512_setzero_ps(), acc_hi = acc_lo;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4, w += 4 * bytes) {
        BK_NAME(stream_ahead_)(w, 4 * (int)bytes);
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w + codes_at)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + bytes + codes_at)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 2 * bytes + codes_at)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 3 * bytes + codes_at)), 3);
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        __m512 s, m = _mm512_setzero_ps();
        __mmask64 high_lo = 0, high_hi = 0;
        BK_NAME(legacy4_fields_)(w, a, b, bytes, kind, &s, &m, &high_lo, &high_hi);
        if (five) {
            lo = _mm512_mask_add_epi8(lo, high_lo, lo, sixteen);
            hi = _mm512_mask_add_epi8(hi, high_hi, hi, sixteen);
        }
        const int8_t *xn = a->qn + 32 * b;
        __m512i start = _mm512_setzero_si512();
        if (!affine) start = _mm512_slli_epi32(_mm512_load_si512((const void *)(a->off8n + 4 * b)), five);
        const __m512i p_lo = _mm512_dpbusd_epi32(start, lo, _mm512_load_si512((const void *)xn));
        const __m512i zero = _mm512_setzero_si512();
        const __m512i p_hi = _mm512_dpbusd_epi32(zero, hi, _mm512_load_si512((const void *)(xn + 64)));
        acc_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_lo), s, acc_lo);
        acc_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_hi), s, acc_hi);
        if (affine) acc_lo = _mm512_mask_add_ps(acc_lo, 0x1111, acc_lo, m);
    }
    __m256 acc[4];
    BK_NAME(split4_)(acc_lo, acc_hi, acc);
    for (; b < nb; b++, w += bytes) acc[0] = BK_NAME(legacy_step_)(w, a, b, acc[0], kind, offset);
    return BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}
#else
/* Q4_0 on AVX2 (IQ4_NL has its own AVX2 row, row_iq4_nl_ below; iq4 and grid are the AVX-512 body's): four blocks
 * per step as two pairs, a pair's blocks in the 128-bit lanes of one register of low nibbles and one of high nibbles
 * against ActRow.qn (as the AVX-512 step above: int32 lane l of a block's lane the one-block step's lane l or l + 4);
 * the offset term comes off lane 0 of each block (the one-block step's integers). acc_lo / acc_hi of pair h hold
 * BK_ROW32's accumulators 2h and 2h + 1 (lanes 0-3 and 4-7 of each): the same float additions in the same order, the
 * same bytes. */
BK_TARGET static inline float BK_NAME(row32_nibbles_)(const uint8_t *w, const ActRow *a, int64_t nb, int iq4,
                                                      __m256i grid) {
    (void)iq4;
    (void)grid;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc_lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc_hi[2] = {acc_lo[0], acc_lo[0]};
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4, w += 72) {
        BK_NAME(stream_ahead_)(w, 72);
        for (int h = 0; h < 2; h++) {
            const uint8_t *p = w + 36 * h;
            const int64_t c = b + 2 * h; /* the pair's first block */
            const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + 20)),
                                               _mm_loadu_si128((const __m128i *)(p + 2)));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const int8_t *xn = a->qn + 32 * b + 32 * h;
            const __m256i x_lo = _mm256_load_si256((const __m256i *)xn);
            const __m256i x_hi = _mm256_load_si256((const __m256i *)(xn + 64));
            const __m256i offsets = _mm256_setr_epi32(8 * a->sums[c], 0, 0, 0, 8 * a->sums[c + 1], 0, 0, 0);
            const __m256i p_lo = _mm256_sub_epi32(BK_DOT(_mm256_setzero_si256(), lo, x_lo), offsets);
            const __m256i p_hi = BK_DOT(_mm256_setzero_si256(), hi, x_hi);
            const __m256 s = _mm256_set_m128(_mm_set1_ps(BK_NAME(half_)(p + 18) * a->d[c + 1]),
                                             _mm_set1_ps(BK_NAME(half_)(p) * a->d[c]));
            acc_lo[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_lo), s, acc_lo[h]);
            acc_hi[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_hi), s, acc_hi[h]);
        }
    }
    __m256 acc0 = _mm256_permute2f128_ps(acc_lo[0], acc_hi[0], 0x20);
    __m256 acc1 = _mm256_permute2f128_ps(acc_lo[0], acc_hi[0], 0x31);
    __m256 acc2 = _mm256_permute2f128_ps(acc_lo[1], acc_hi[1], 0x20);
    __m256 acc3 = _mm256_permute2f128_ps(acc_lo[1], acc_hi[1], 0x31);
    for (; b < nb; b++, w += 18) acc0 = BK_NAME(legacy_step_)(w, a, b, acc0, 0, 8);
    return BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
}

/* Q4_1 / Q5_0 / Q5_1 on AVX2: four blocks per step as two pairs, as Q4_0's above (a pair's blocks in the 128-bit
 * lanes of one register of low nibbles and one of high nibbles against ActRow.qn); the five-bit types' qh bits by
 * high_bits_'s spread of bits 0-15 of both blocks' qh (low nibbles) and bits 16-31 (high), Q5_0's offset term off
 * lane 0 of each block, Q4_1 / Q5_1's m dx sum(x) added to lane 0 of each block after the fmadd: the one-block
 * step's integers and float operations, lane by lane, so the same bytes. */
BK_TARGET static inline float BK_NAME(row32_legacy4_)(const uint8_t *w, const ActRow *a, int64_t nb, int64_t bytes,
                                                      int kind, int32_t offset) {
    const int five = kind & 1, affine = kind >> 1, codes_at = 2 + 2 * affine + 4 * five, qh_at = 2 + 2 * affine;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc_lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc_hi[2] = {acc_lo[0], acc_lo[0]};
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4, w += 4 * bytes) {
        BK_NAME(stream_ahead_)(w, 4 * (int)bytes);
        for (int h = 0; h < 2; h++) {
            const uint8_t *p = w + 2 * bytes * h;
            const int64_t c = b + 2 * h; /* the pair's first block */
            const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + bytes + codes_at)),
                                               _mm_loadu_si128((const __m128i *)(p + codes_at)));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five) {
                uint32_t h0, h1;
                memcpy(&h0, p + qh_at, 4);
                memcpy(&h1, p + bytes + qh_at, 4);
                lo = _mm256_or_si256(lo, BK_NAME(high_bits_)((h0 & 0xFFFFu) | (h1 << 16)));
                hi = _mm256_or_si256(hi, BK_NAME(high_bits_)((h0 >> 16) | (h1 & 0xFFFF0000u)));
            }
            const int8_t *xn = a->qn + 32 * b + 32 * h;
            __m256i p_lo = BK_DOT(_mm256_setzero_si256(), lo, _mm256_load_si256((const __m256i *)xn));
            const __m256i p_hi = BK_DOT(_mm256_setzero_si256(), hi, _mm256_load_si256((const __m256i *)(xn + 64)));
            if (!affine)
                p_lo = _mm256_sub_epi32(
                    p_lo, _mm256_setr_epi32(offset * a->sums[c], 0, 0, 0, offset * a->sums[c + 1], 0, 0, 0));
            const float dx0 = a->d[c], dx1 = a->d[c + 1];
            const __m256 s = _mm256_set_m128(_mm_set1_ps(BK_NAME(half_)(p + bytes) * dx1),
                                             _mm_set1_ps(BK_NAME(half_)(p) * dx0));
            acc_lo[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_lo), s, acc_lo[h]);
            acc_hi[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_hi), s, acc_hi[h]);
            if (affine)
                acc_lo[h] = _mm256_add_ps(acc_lo[h], _mm256_setr_ps(BK_NAME(half_)(p + 2) * dx0 * (float)a->sums[c], 0,
                                                                    0, 0, BK_NAME(half_)(p + bytes + 2) * dx1 *
                                                                              (float)a->sums[c + 1], 0, 0, 0));
        }
    }
    __m256 acc0 = _mm256_permute2f128_ps(acc_lo[0], acc_hi[0], 0x20);
    __m256 acc1 = _mm256_permute2f128_ps(acc_lo[0], acc_hi[0], 0x31);
    __m256 acc2 = _mm256_permute2f128_ps(acc_lo[1], acc_hi[1], 0x20);
    __m256 acc3 = _mm256_permute2f128_ps(acc_lo[1], acc_hi[1], 0x31);
    for (; b < nb; b++, w += bytes) acc0 = BK_NAME(legacy_step_)(w, a, b, acc0, kind, offset);
    return BK_NAME(hsum_)(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
}
#endif

#if BK_MASKED
BK_TARGET static float BK_NAME(row_iq4_nl_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID));
    return BK_NAME(row32_nibbles_)(w, a, nb, 1, grid);
}
#else
/* IQ4_NL on AVX2: four blocks per step as two pairs (a pair's blocks in the 128-bit lanes of one register of low
 * nibbles and one of high nibbles against ActRow.qn, as Q4_0's above), each block's low- and high-nibble dots added
 * in int32 before one conversion and one fmadd per pair (lane l: at most 8 * 127 * 127 = 129032, exact in float);
 * the four blocks' float16 d gathered in a general register, converted by one vcvtph2ps and multiplied by their
 * activation scales at once, each pair's picked in-lane: 1.07-1.22x the former step (Q4_0's row32_nibbles_, one
 * float product per nibble half, as the AVX-512 body's) on a Zen 3 (docs/performance.md, eighteenth session). So
 * another float order than the AVX-512 body's: the two agree within float32 rounding and one bfloat16 step, not bit
 * for bit (tests/ops/test_isa.py). */
BK_TARGET static float BK_NAME(row_iq4_nl_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID));
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i pick[2] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)};
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4, w += 72) {
        BK_NAME(stream_ahead_)(w, 72);
        uint64_t halves = 0;
        for (int c = 0; c < 4; c++) {
            uint16_t h;
            memcpy(&h, w + 18 * c, 2);
            halves |= (uint64_t)h << 16 * c;
        }
        const __m128 d = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)halves)), _mm_loadu_ps(a->d + b));
        const __m256 d2 = _mm256_set_m128(d, d); /* in both 128-bit lanes: each pair's scales by one in-lane pick */
        for (int h = 0; h < 2; h++) {
            const uint8_t *p = w + 36 * h;
            const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + 20)),
                                               _mm_loadu_si128((const __m128i *)(p + 2)));
            const __m256i lo = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, low));
            const __m256i hi = _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            const int8_t *xn = a->qn + 32 * b + 32 * h;
            const __m256i x_lo = _mm256_load_si256((const __m256i *)xn);
            const __m256i x_hi = _mm256_load_si256((const __m256i *)(xn + 64));
            const __m256i p_lo = _mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(x_lo, lo));
            const __m256i p_hi = _mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(x_hi, hi));
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(p_lo, ones), _mm256_madd_epi16(p_hi, ones));
            const __m256 s = _mm256_permutevar_ps(d2, pick[h]);
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[h]);
        }
    }
    for (; b < nb; b++, w += 18) acc[0] = BK_NAME(iq4_nl_step_)(w, a, b, acc[0], grid);
    return BK_NAME(hsum_)(_mm256_add_ps(acc[0], acc[1]));
}
#endif

BK_TARGET static float BK_NAME(row_q4_0_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(row32_nibbles_)(w, a, nb, 0, _mm256_setzero_si256());
}
BK_TARGET static float BK_NAME(row_q4_1_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(row32_legacy4_)(w, a, nb, 20, 2, 0);
}
BK_TARGET static float BK_NAME(row_q5_0_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(row32_legacy4_)(w, a, nb, 22, 1, 16);
}
BK_TARGET static float BK_NAME(row_q5_1_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    return BK_NAME(row32_legacy4_)(w, a, nb, 24, 3, 0);
}

BK_TARGET static float BK_NAME(row_block_)(int type, const uint8_t *w, const ActRow *a, int64_t nb) {
    switch (type) {
        case GGML_Q4_0: return BK_NAME(row_q4_0_)(w, a, nb);
        case GGML_Q4_1: return BK_NAME(row_q4_1_)(w, a, nb);
        case GGML_Q5_0: return BK_NAME(row_q5_0_)(w, a, nb);
        case GGML_Q5_1: return BK_NAME(row_q5_1_)(w, a, nb);
        case GGML_Q8_0: return BK_NAME(row_q8_0_)(w, a, nb);
        case GGML_Q2_K: return BK_NAME(row_q2_k_)(w, a, nb);
#if BK_MASKED
        case GGML_Q3_K: return BK_NAME(row_q3_k_)(w, a, nb);
        case Q3_K_GFNI: return BK_NAME(row_q3_k_gfni)(w, a, nb);
#else
        case GGML_Q3_K: case Q3_K_GFNI: return BK_NAME(row_q3_k_)(w, a, nb);
#endif
        case GGML_Q4_K: return BK_NAME(row_q4_k_)(w, a, nb);
        case GGML_Q5_K: return BK_NAME(row_q5_k_)(w, a, nb);
        case GGML_Q6_K: return BK_NAME(row_q6_k_)(w, a, nb);
        case GGML_IQ4_NL: return BK_NAME(row_iq4_nl_)(w, a, nb);
        case GGML_IQ4_XS: return BK_NAME(row_iq4_xs_)(w, a, nb);
        case HQ3_0: return BK_NAME(row_hq3_0_)(w, a, nb);
        case HQ3_NL: return BK_NAME(row_hq3_nl_)(w, a, nb);
#if BK_MASKED
        case HQ3_R: return BK_NAME(row_hq3_r_shift)(w, a, nb);
        case HQ3_R_GFNI: return BK_NAME(row_hq3_r_gfni)(w, a, nb);
#else
        case HQ3_R: case HQ3_R_GFNI: return BK_NAME(row_hq3_r_)(w, a, nb);
#endif
        default: return 0.0f;
    }
}

/* The GEMV of one activation row x against `count` weights (parts: one layer, or the members of a fused group) in
 * one OpenMP region: the threads quantize the activation blocks (quantize_block), then split each part's rows; each
 * output is one row's sum in one thread, rounded once to bfloat16, so neither the split nor the grouping changes a
 * byte. */
/* One part's rows, split over the threads of the enclosing OpenMP region (an orphaned work-sharing loop: the loop of
 * the former one-weight GEMV, its type a parameter) */
BK_TARGET static void BK_NAME(part_rows_)(int type, const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                          int64_t row_bytes, int64_t nb) {
#if !BK_MASKED
    if (type & BLOCK_ROWS8) { /* groups of 8 interleaved rows (blocks_r8_body.h) */
        r8_rows_avx2(type, weight, a, y, n, row_bytes, nb);
        return;
    }
#endif
#if BK_MASKED
    if (type > 0 && (type & BLOCK_ROWS16)) { /* groups of 16 interleaved IQ4_XS rows (the GFNI codes are < 0) */
        BK_NAME(r16_rows_)(weight, a, y, n, row_bytes, nb);
        return;
    }
    if (type == Q3_K_GFNI) {
        BK_NAME(q3_k_gfni_rows_)(weight, a, y, n, row_bytes, nb);
        return;
    }
#endif
    if (type == GGML_Q6_K) {
        BK_ROWS(n, y, BK_NAME(q6_k_row_)(weight + r * row_bytes, a, nb));
        return;
    }
    if (type == GGML_Q3_K || type == Q3_K_GFNI) { /* Q3_K_GFNI here: the AVX2 body */
        BK_ROWS(n, y, BK_NAME(q3_k_row_)(weight + r * row_bytes, a, nb));
        return;
    }
    BK_ROWS(n, y, BK_NAME(row_block_)(type, weight + r * row_bytes, a, nb));
}

BK_TARGET static void BK_NAME(gemv_parts_)(const uint16_t *x, const ActRow *rows, const int64_t *act_blocks,
                                           const BlockPart *parts, int64_t count) {
#pragma omp parallel
    {
        for (int r = 0; r < 2; r++) /* activation blocks of 32 (row 0) and of 256 (row 1) */
            if (act_blocks[r]) {
#pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < act_blocks[r]; b++) quantize_block(x, b, r ? 256 : 32, r ? 16 : 32, rows + r);
            }
#pragma omp barrier
        for (int64_t p = 0; p < count; p++) /* every thread meets the same work-sharing loops in the same order */
            BK_NAME(part_rows_)((int)parts[p].type, parts[p].weight, rows + parts[p].row, parts[p].y, parts[p].n,
                                parts[p].row_bytes, parts[p].nb);
    }
}

#undef BK_K16
#undef BK_K16_ZERO
#undef BK_ROW32
#undef BK_ROW32_PAIRS
#undef BK_ROW32_FAST
#undef BK_NAME
#undef BK_CAT
#undef BK_CAT2
