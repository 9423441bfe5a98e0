/* HQ3_R's AVX-512 row, included twice by blocks_body.h's VNNI body with HQ3R_SUFFIX (appended to the names),
 * HQ3R_TARGET (the function attribute) and HQ3R_GFNI defined:
 *   0: one 64-weight block per 512-bit step, the 2-bit codes by a 64-bit shift (srlv by 0, 2, 4, 6) and `& 3`, each
 *      int32 lane 4 weights' dot times its sub-block's scale: every AVX512-VNNI CPU (Cascade Lake);
 *   1: a group of four blocks per step (hq3_r_group_: VBMI byte gathers, GFNI's vgf2p8affineqb for the 3-bit codes
 *      and a bit transpose of the high bits), each int32 lane one sub-block's whole integer dot, one cvt + fmadd per
 *      four blocks: Ice Lake, Zen 4 and later (Intel SDM: GF2P8AFFINEQB, VPERMI2B; the CPU check also asks BITALG,
 *      which the ninth session's step used). About 8 vector operations per 64 weights and no mask-register
 *      producers (docs/performance.md, issue #30, ninth and thirteenth sessions), the next lines prefetched.
 * Both sum the same integers; 1 sums each sub-block's 16 products exactly before converting (0: four partial sums
 * of 4), so the float32 sums differ in order (within a float32 rounding per sub-block) and the bfloat16 outputs agree
 * on the tests' weights (tests/ops/test_isa.py). A row's last nb % 4 blocks take 0's step in both. */

#define HQ3R_NAME(name) BK_NAME(BK_CAT(name, HQ3R_SUFFIX))
/* the group step's four cache lines 1024 bytes past w into L1 (_mm_prefetch: a hint, never a fault past the weight's
 * end). From memory one thread read HQ3_R's 108-byte groups (64-byte loads split across two lines) at 19 GB/s without
 * it, 24-26 with it; the one-block step (8-byte loads) and the AVX2 body gain nothing (docs/performance.md, issue #30,
 * thirteenth session) */
#define HQ3R_PREFETCH(w)                                                         \
    do {                                                                         \
        for (int line = 0; line < 4; line++)                                     \
            _mm_prefetch((const char *)(w) + 1024 + 64 * line, _MM_HINT_T0);     \
    } while (0)

/* the 64 2-bit codes of a block as bytes 0-3, lane byte 8m + l holding code 8(m % 4) + l of group m / 4, from qs:
 * the group's 8 code bytes broadcast to qwords 0-3 (group 0) and 4-7 (group 1) */
HQ3R_TARGET static inline __m512i HQ3R_NAME(hq3_r_low_)(__m512i qs) {
#if HQ3R_GFNI
    /* qword m's matrix: byte 7 (result bit 0) selects bit 2p, byte 6 (result bit 1) bit 2p + 1, p = m % 4 */
    const __m512i pick = _mm512_setr_epi64(0x0102000000000000LL, 0x0408000000000000LL, 0x1020000000000000LL,
                                           0x4080000000000000LL, 0x0102000000000000LL, 0x0408000000000000LL,
                                           0x1020000000000000LL, 0x4080000000000000LL);
    return _mm512_gf2p8affine_epi64_epi8(qs, pick, 0);
#else
    return _mm512_and_si512(_mm512_srlv_epi64(qs, _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6)), _mm512_set1_epi8(3));
#endif
}

/* acc + block w's dot (block b of the row) times scale (lanes 4i to 4i + 3: its sub-block i's scale). The 2-bit
 * codes: hq3_r_low_; the third bit (qh's 64 bits as a byte mask) adds 4; the code picks its byte of the grid, HQ3_NL's
 * plus 128 (unsigned, as row_iq4_xs_'s), so vpdpbusd starts from bias4's -128 times each 4 activations' sum. */
HQ3R_TARGET static inline __m512 HQ3R_NAME(hq3_r_block_)(const uint8_t *w, const ActRow *a, int64_t b, __m512 acc,
                                                        __m512 scale, __m512i grid) {
    long long qs0, qs1;
    uint32_t qh0, qh1;
    memcpy(&qs0, w + 3, 8);
    memcpy(&qs1, w + 15, 8);
    memcpy(&qh0, w + 11, 4);
    memcpy(&qh1, w + 23, 4);
    const __m512i low = HQ3R_NAME(hq3_r_low_)(_mm512_mask_set1_epi64(_mm512_set1_epi64(qs0), 0xF0, qs1));
    const __m512i u = _mm512_mask_add_epi8(low, (__mmask64)qh0 | (__mmask64)qh1 << 32, low, _mm512_set1_epi8(4));
    const __m512i p = _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(a->bias4 + 16 * b)),
                                          _mm512_shuffle_epi8(grid, u),
                                          _mm512_loadu_si512((const void *)(a->q + 64 * b)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
}

#if HQ3R_GFNI
/* GF2P8AFFINEQB's matrix (Intel SDM) whose result bits 0, 1, 2 are bits b0, b1, b2 of each byte (the others 0) */
#define HQ3R_PICK(b0, b1, b2) ((long long)((1ULL << (b0)) << 56 | (1ULL << (b1)) << 48 | (1ULL << (b2)) << 40))

/* acc + a group of four blocks' dots (the group at w, blocks b to b + 3 of the row). The codes as they lie, qword
 * m = 2j + g holding group g of block j's 8 qs bytes (one vpermi2b, Hq3rOrder.codes), and the group's 4 qh bytes
 * twice (one vpermi2b) bit-transposed by one vgf2p8affineqb against the bytes 1 << l, so byte l of `high` holds in
 * bits 7 - p and 3 - p the third bit of code 8p + l; two bit selects (vpternlogq) put beside each qs byte's codes
 * p = 0, 1 (bits 0-3) their third bits (bits 7, 6: `lo`), beside codes 2, 3 (bits 4-7) theirs (bits 1, 0: `hi`), and
 * one vgf2p8affineqb per p takes each code's three bits to bits 0-2, no mask registers. Vector p then holds in int32
 * lane 2m + h codes 8p + 4h .. 8p + 4h + 3 of that group: one vpshufb into HQ3_NL's grid plus 128 and one vpdpbusd
 * against qt (the activations in that order) each; lanes 2m, 2m + 1 of the p = 0, 1 dots are the two halves of
 * sub-block 2g, of the p = 2, 3 dots those of 2g + 1, so two vpermt2d (Hq3rOrder.pair0 / pair1) and an add leave each
 * sub-block's whole integer dot in lane 4s + j, started from -128 times its activation sum (bias16, half in each
 * chain). Then one convert and one fmadd with the 16 scales (hq3_r_scales_, fields by one vpermi2b). */
HQ3R_TARGET static inline __m512 HQ3R_NAME(hq3_r_group_)(const uint8_t *w, const ActRow *a, int64_t b, __m512 acc,
                                                        __m512i grid, __m512 levels_lo, __m512 levels_hi) {
    const __m512i z0 = _mm512_loadu_si512((const void *)w);
    const __m512i z1 = _mm512_maskz_loadu_epi8((__mmask64)0xFFFFFFFFFFFULL, w + 64); /* bytes 64-107 */
    const __m512i qs = _mm512_permutex2var_epi8(z0, _mm512_loadu_si512((const void *)HQ3R_ORDER.codes), z1);
    const __m512i qh = _mm512_permutex2var_epi8(z0, _mm512_loadu_si512((const void *)HQ3R_ORDER.qh), z1);
    const __m512i high = _mm512_gf2p8affine_epi64_epi8(_mm512_set1_epi64(0x8040201008040201LL), qh, 0);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_ternarylogic_epi64(nibble, qs, high, 0xCA); /* nibble ? qs : high, bit by bit */
    const __m512i hi = _mm512_ternarylogic_epi64(nibble, high, qs, 0xCA);
    const __m512i u0 = _mm512_gf2p8affine_epi64_epi8(lo, _mm512_set1_epi64(HQ3R_PICK(0, 1, 7)), 0);
    const __m512i u1 = _mm512_gf2p8affine_epi64_epi8(lo, _mm512_set1_epi64(HQ3R_PICK(2, 3, 6)), 0);
    const __m512i u2 = _mm512_gf2p8affine_epi64_epi8(hi, _mm512_set1_epi64(HQ3R_PICK(4, 5, 1)), 0);
    const __m512i u3 = _mm512_gf2p8affine_epi64_epi8(hi, _mm512_set1_epi64(HQ3R_PICK(6, 7, 0)), 0);
    const int8_t *x = a->qt + 64 * b;
    const __m512i start = _mm512_load_si512((const void *)(a->bias16 + 4 * b));
    __m512i d01 = _mm512_dpbusd_epi32(_mm512_maskz_mov_epi32(0x5555, start), _mm512_shuffle_epi8(grid, u0),
                                      _mm512_load_si512((const void *)x));
    __m512i d23 = _mm512_dpbusd_epi32(_mm512_maskz_mov_epi32(0xAAAA, start), _mm512_shuffle_epi8(grid, u2),
                                      _mm512_load_si512((const void *)(x + 128)));
    d01 = _mm512_dpbusd_epi32(d01, _mm512_shuffle_epi8(grid, u1), _mm512_load_si512((const void *)(x + 64)));
    d23 = _mm512_dpbusd_epi32(d23, _mm512_shuffle_epi8(grid, u3), _mm512_load_si512((const void *)(x + 192)));
    const __m512i dot =
        _mm512_add_epi32(_mm512_permutex2var_epi32(d01, _mm512_loadu_si512((const void *)HQ3R_ORDER.pair0), d23),
                         _mm512_permutex2var_epi32(d01, _mm512_loadu_si512((const void *)HQ3R_ORDER.pair1), d23));
    const __m512i f = _mm512_permutex2var_epi8(z0, _mm512_loadu_si512((const void *)HQ3R_ORDER.fields), z1);
    const __m512 scale = BK_NAME(hq3_r_scales_)(f, _mm512_loadu_ps(a->dxs + 4 * b), levels_lo, levels_hi);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}
#undef HQ3R_PICK
#endif

/* block j's scales of a group's (hq3_r_scales4_: lane 4i + j) in its sub-blocks' lanes 4i to 4i + 3 */
#define HQ3R_SCALE(scales4, j) _mm512_permute_ps((scales4), 0x55 * (j))

HQ3R_TARGET static float HQ3R_NAME(row_hq3_r_)(const uint8_t *w, const ActRow *a, int64_t nb) {
    const __m512i grid = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)HQ3_NL_GRID)),
                                          _mm512_set1_epi8((char)0x80));
    const __m512 lo = _mm512_loadu_ps(HQ3R_LEVELS), hi = _mm512_loadu_ps(HQ3R_LEVELS + 16);
    const float d_row = BK_NAME(half_)(w);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    w += 2;
    int64_t b = 0;
#if HQ3R_GFNI
    for (; b + 8 <= nb; b += 8, w += 8 * 27) { /* two groups a step, two accumulators */
        HQ3R_PREFETCH(w);
        acc0 = HQ3R_NAME(hq3_r_group_)(w, a, b, acc0, grid, lo, hi);
        acc1 = HQ3R_NAME(hq3_r_group_)(w + 4 * 27, a, b + 4, acc1, grid, lo, hi);
    }
    for (; b + 4 <= nb; b += 4, w += 4 * 27) acc0 = HQ3R_NAME(hq3_r_group_)(w, a, b, acc0, grid, lo, hi);
#endif
    for (; b + 4 <= nb; b += 4, w += 4 * 27) { /* four independent accumulators: an fmadd's latency per block else */
        const __m512 scales4 = BK_NAME(hq3_r_scales4_)(w, a->dxs + 4 * b, 0, 4, lo, hi);
        acc0 = HQ3R_NAME(hq3_r_block_)(w, a, b, acc0, HQ3R_SCALE(scales4, 0), grid);
        acc1 = HQ3R_NAME(hq3_r_block_)(w + 27, a, b + 1, acc1, HQ3R_SCALE(scales4, 1), grid);
        acc2 = HQ3R_NAME(hq3_r_block_)(w + 54, a, b + 2, acc2, HQ3R_SCALE(scales4, 2), grid);
        acc3 = HQ3R_NAME(hq3_r_block_)(w + 81, a, b + 3, acc3, HQ3R_SCALE(scales4, 3), grid);
    }
    for (; b < nb; b++, w += 27) { /* the last group's blocks one at a time (lanes 4i + b % 4 of its dxs) */
        const int j = (int)(b % 4);
        const __m512 scales4 = BK_NAME(hq3_r_scales4_)(w - 27 * j, a->dxs + 4 * (b - j), j, 1, lo, hi);
        const __m512 scale = j == 0   ? HQ3R_SCALE(scales4, 0)
                             : j == 1 ? HQ3R_SCALE(scales4, 1)
                             : j == 2 ? HQ3R_SCALE(scales4, 2)
                                      : HQ3R_SCALE(scales4, 3);
        acc0 = HQ3R_NAME(hq3_r_block_)(w, a, b, acc0, scale, grid);
    }
    return d_row * _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

#undef HQ3R_SCALE
#undef HQ3R_PREFETCH
#undef HQ3R_NAME
