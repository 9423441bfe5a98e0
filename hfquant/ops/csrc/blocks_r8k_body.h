/* The GEMV of Q3_K weights in the R8 layout (blocks_cpu.c's comment before r8_offset: 8 rows interleaved super-block
 * by super-block, 880 bytes each), AVX2 body only; included by blocks_cpu.c after blocks_r8_body.h, whose helpers
 * (r8_ahead_, r8_bcast4_, r8_dd_, r8_store_bf16_) it uses. Issue #30: HfQuantConfig(bits=3.5) is mostly Q3_K, whose
 * AVX2 row kernel (blocks_body.h q3_k_step_) costs about what IQ4_XS's does per super-block on a Zen 3.
 *
 * As blocks_r8_body.h: int32 lane r of every 256-bit register is row r's, so one broadcast of 4 activations serves 8
 * rows, and the 8 rows' sums need no horizontal step. Per t = 0..7 one hmask and two qs registers hold codes 4t..4t +
 * 3 of each of the super-block's eight 32-weight quarters (h = 0, 1 the qs half, j = 0..3 the 2-bit field): per half
 * h, pair A = (qs & 0x33) | TABLE_A[hmask nibble h] puts code j = 0 in bits 0-2 and j = 2 in bits 4-6 (the hmask bits
 * by one byte shuffle: the row kernel's pairs), pair B the same for j = 1, 3 from qs >> 2; each code then by one mask
 * (and a word shift for bits 4-6): unsigned u = q3 + 4 with the -4 offset left for later.
 *
 * Codes 4t..4t + 3 of quarter (h, j) are in sub-block 8h + 2j + t / 4, so per (h, t / 4) four int16 accumulators
 * (j = 0..3) take four vpmaddubsw each (t % 4 = 0..3; pair sums at most 2 * 7 * 127 = 1778), started at -2 S in both
 * int16 halves of every lane, S the sub-block's activation sum (ActRow.sums16, tabled per call by r8k_offsets_: one
 * broadcast load in place of a subtraction): a lane's two halves then sum to u . x - 4 S = q3 . x, the row kernel's
 * sub-block dot, each half at most 4 * 1778 + 2 * 2032 = 11176, no saturation. One vpmaddwd per sub-block by its
 * scale (sc - 32) times 256 in both halves (the int8 scale shuffled into the words' high bytes: no sign extension),
 * at most 256 * 32 * 16 * 4 * 127 = 66584576 per sub-block, 16 of them 1065353216 < 2^31; an arithmetic shift by 8
 * divides exactly. The super-block's int32 is the row kernel's (q3_k_step_'s before its conversion), converted and
 * times d * dx by one fmadd; only the float order of super-blocks differs (the row kernel sums even and odd
 * super-blocks apart). The scales: four registers Q_i (lane r byte k: row r's scale 4i + k minus 32) from the three
 * scale loads by 21 instructions per super-block. */

/* byte n (a nibble of hmask bits: bit j of code j's quarter): bit 0 at bit 2, bit 2 at bit 6 (pair A, codes j = 0
 * and 2); bits 1 and 3 likewise (pair B); both 128-bit lanes alike */
static const _Alignas(32) uint8_t R8K_TABLES[2][32] = {
    {0, 4, 0, 4, 64, 68, 64, 68, 0, 4, 0, 4, 64, 68, 64, 68, 0, 4, 0, 4, 64, 68, 64, 68, 0, 4, 0, 4, 64, 68, 64, 68},
    {0, 0, 4, 4, 0, 0, 4, 4, 64, 64, 68, 68, 64, 64, 68, 68, 0, 0, 4, 4, 0, 0, 4, 4, 64, 64, 68, 68, 64, 64, 68, 68},
};

/* pick k = 0..3: byte k of every int32 lane into the high bytes of both its words, the low bytes zero (0x80) */
#define R8K_PICK_LANE(k, m) 0x80, 4 * (m) + (k), 0x80, 4 * (m) + (k)
#define R8K_PICK(k)                                                                                                   \
    {R8K_PICK_LANE(k, 0), R8K_PICK_LANE(k, 1), R8K_PICK_LANE(k, 2), R8K_PICK_LANE(k, 3),                            \
     R8K_PICK_LANE(k, 0), R8K_PICK_LANE(k, 1), R8K_PICK_LANE(k, 2), R8K_PICK_LANE(k, 3)}
static const _Alignas(32) uint8_t R8K_PICKS[4][32] = {R8K_PICK(0), R8K_PICK(1), R8K_PICK(2), R8K_PICK(3)};
#undef R8K_PICK
#undef R8K_PICK_LANE

/* the 8 rows' 16 scales minus 32: Q[i] lane r byte k = row r's scale 4i + k (k3_scales' values), from the R8 block's
 * scale bytes 0-3 (A, at 16), 4-7 (B, at 48) and 8-11 (C, at 80): scale 4i + k's low 4 bits are byte k of A (i = 0:
 * low nibble, 2: high) or B (1, 3), its high 2 bits bits 2i, 2i + 1 of byte k of C (shifted to bits 4-5; 32-bit shifts
 * whose bits crossing into the next byte the masks drop) */
AVX2_ONLY_TARGET static inline void r8k_scales_(const uint8_t *w, __m256i *q) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(w + 16)), b = _mm256_loadu_si256((const __m256i *)(w + 48));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(w + 80));
    const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30), thirty_two = _mm256_set1_epi8(32);
    q[0] = _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi32(c, 4), two));
    q[1] = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_slli_epi32(c, 2), two));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a, 4), nibble), _mm256_and_si256(c, two));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(b, 4), nibble),
                           _mm256_and_si256(_mm256_srli_epi32(c, 2), two));
    for (int i = 0; i < 4; i++) q[i] = _mm256_sub_epi8(q[i], thirty_two);
}

/* 4 activation bytes at p in every int32 lane by vbroadcastss (a load alone; vpbroadcastd from memory may take a
 * shuffle too: no difference measured in blocks_r8_body.h's IQ4_XS loop) */
#ifndef R8K_BCAST4
#define R8K_BCAST4(p) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(p)))
#endif

/* the prefetch of the weight stream (blocks_r8_body.h's r8_ahead_; none, -DR8K_AHEAD(w)=: 0.95-0.98x) */
#ifndef R8K_AHEAD
#define R8K_AHEAD(w) r8_ahead_((w), 880)
#endif

/* one group of 8 rows (w: its first R8 super-block) -> the 8 rows' float sums; off: r8k_offsets_'s table */
AVX2_ONLY_TARGET BK_INLINE __m256 r8_q3_k_(const uint8_t *w, const ActRow *a, const int32_t *off, int64_t nb) {
    const __m256i table_a = _mm256_load_si256((const __m256i *)R8K_TABLES[0]);
    const __m256i table_b = _mm256_load_si256((const __m256i *)R8K_TABLES[1]);
    const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x33), seven = _mm256_set1_epi8(7);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 880) {
        R8K_AHEAD(w);
        __m256i scales[4];
        r8k_scales_(w, scales);
        const int8_t *q = a->q + 256 * b;
        const int32_t *o = off + 16 * b;
        __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                __m256i part[4]; /* quarter j's sub-block 8h + 2j + half, int16 */
                for (int j = 0; j < 4; j++) part[j] = _mm256_set1_epi32(o[8 * h + 2 * j + half]);
                /* not unrolled: unrolled (with h and half) gcc spilled the accumulators, 0.8-0.9x on a Zen 3 (unrolled
                 * twice: the same speed) */
#pragma GCC unroll 1
                for (int t = 4 * half; t < 4 * half + 4; t++) {
                    const uint8_t *c = w + 112 + 96 * t;
                    const __m256i m = _mm256_loadu_si256((const __m256i *)c);
                    const __m256i hms = _mm256_and_si256(h ? _mm256_srli_epi16(m, 4) : m, nibble);
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 + 32 * h));
                    const __m256i pa = _mm256_or_si256(_mm256_and_si256(v, pair), _mm256_shuffle_epi8(table_a, hms));
                    const __m256i pb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2), pair),
                                                       _mm256_shuffle_epi8(table_b, hms));
                    const int8_t *x = q + 128 * h + 4 * t;
                    const __m256i u[4] = {_mm256_and_si256(pa, seven), _mm256_and_si256(pb, seven),
                                          _mm256_and_si256(_mm256_srli_epi16(pa, 4), seven),
                                          _mm256_and_si256(_mm256_srli_epi16(pb, 4), seven)};
                    for (int j = 0; j < 4; j++)
                        part[j] = _mm256_add_epi16(part[j], _mm256_maddubs_epi16(u[j], R8K_BCAST4(x + 32 * j)));
                }
                for (int j = 0; j < 4; j++) {
                    const int s = 8 * h + 2 * j + half;
                    const __m256i scale = _mm256_shuffle_epi8(scales[s / 4],
                                                              _mm256_load_si256((const __m256i *)R8K_PICKS[s % 4]));
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(part[j], scale));
                }
            }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(sum, 8)), r8_dd_(w, a->d[b]), acc);
    }
    return acc;
}

/* the activation's -2 S per sub-block (S: ActRow.sums16) in both int16 halves of an int32, for nb super-blocks */
static void r8k_offsets_(const ActRow *a, int64_t nb, int32_t *off) {
    for (int64_t i = 0; i < 16 * nb; i++) {
        const uint16_t half = (uint16_t)(-2 * a->sums16[i]);
        off[i] = (int32_t)((uint32_t)half | (uint32_t)half << 16);
    }
}

/* one R8 Q3_K part's rows: the groups of 8 split over the threads of the enclosing OpenMP region; each thread tables
 * the offsets once (on its stack up to K = 32768, else one allocation) */
AVX2_ONLY_TARGET static void r8k_rows_avx2(int type, const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                           int64_t row_bytes, int64_t nb) {
    (void)type;
    enum { R8K_STACK = 16 * 128 };
    int32_t local[R8K_STACK];
    int32_t *off = 16 * nb <= R8K_STACK ? local : (int32_t *)_mm_malloc((size_t)(16 * nb) * sizeof(int32_t), 64);
    if (off != NULL) r8k_offsets_(a, nb, off);
    /* every thread runs the loop (an orphaned work-sharing loop needs all of them); a failed allocation (NaN rows)
     * cannot happen below K = 32768 */
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < n / 8; g++) {
        const uint8_t *w = weight + g * 8 * row_bytes;
        r8_store_bf16_(off != NULL ? r8_q3_k_(w, a, off, nb) : _mm256_set1_ps(__builtin_nanf("")), y + 8 * g);
    }
    if (off != local) _mm_free(off);
}
