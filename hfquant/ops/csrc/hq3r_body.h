/* HQ3_R's AVX-512 row, included twice by blocks_body.h's VNNI body with HQ3R_SUFFIX (appended to the names),
 * HQ3R_TARGET (the function attribute) and HQ3R_GFNI defined:
 *   0: one 64-weight block per 512-bit step, the 2-bit codes by a 64-bit shift (srlv by 0, 2, 4, 6) and `& 3`, each
 *      int32 lane 4 weights' dot times its sub-block's scale: every AVX512-VNNI CPU (Cascade Lake);
 *   1: a group of four blocks per step (hq3_r_group_: VBMI byte gathers, GFNI's vgf2p8affineqb for the 2-bit codes,
 *      BITALG's vpshufbitqmb for the third bit), each int32 lane one sub-block's whole integer dot, one cvt + fmadd
 *      per four blocks: Ice Lake, Zen 4 and later (Intel SDM: GF2P8AFFINEQB, VPERMI2B, VPSHUFBITQMB). About 9
 *      vector operations per 64 weights instead of 11-12 (docs/performance.md, issue #30, ninth session).
 * Both sum the same integers; 1 sums each sub-block's 16 products exactly before converting (0: four partial sums
 * of 4), so the float32 sums differ in order (within a float32 rounding per sub-block) and the bfloat16 outputs agree
 * on the tests' weights (tests/ops/test_isa.py). A row's last nb % 4 blocks take 0's step in both. */

#define HQ3R_NAME(name) BK_NAME(BK_CAT(name, HQ3R_SUFFIX))

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
/* acc + a group of four blocks' dots (the group at w, blocks b to b + 3 of the row), sub-block by sub-block: vector t
 * of the group's codes (Hq3rOrder: four vpermi2b from the group's 108 bytes) holds weights 4t to 4t + 3 of every
 * sub-block, sub-block s of block j in int32 lane 4s + j, so four vpdpbusd against qt (the activations in that
 * order) from bias16 leave each lane one sub-block's integer dot, and one fmadd takes the 16 lanes times their
 * scales (hq3_r_scales_, fields by one vpermi2b). Codes: GFNI as hq3_r_low_, the high bit by vpshufbitqmb from the
 * blocks' qh (Hq3rOrder.qh), plus 4 under that mask, then the grid (plus 128) by vpshufb. */
HQ3R_TARGET static inline __m512 HQ3R_NAME(hq3_r_group_)(const uint8_t *w, const ActRow *a, int64_t b, __m512 acc,
                                                        __m512i grid, __m512 levels_lo, __m512 levels_hi) {
    const __m512i z0 = _mm512_loadu_si512((const void *)w);
    const __m512i z1 = _mm512_maskz_loadu_epi8((__mmask64)0xFFFFFFFFFFFULL, w + 64); /* bytes 64-107 */
    const __m512i qh = _mm512_permutex2var_epi8(z0, _mm512_loadu_si512((const void *)HQ3R_ORDER.qh), z1);
    const int8_t *x = a->qt + 64 * b;
    __m512i dot[2] = {_mm512_load_si512((const void *)(a->bias16 + 4 * b)), _mm512_setzero_si512()};
    for (int t = 0; t < 4; t++) { /* two chains of vpdpbusd */
        const __m512i codes = _mm512_permutex2var_epi8(z0, _mm512_loadu_si512((const void *)HQ3R_ORDER.codes[t]), z1);
        const __m512i low =
            _mm512_gf2p8affine_epi64_epi8(codes, _mm512_loadu_si512((const void *)HQ3R_ORDER.pick[t]), 0);
        const __mmask64 high = _mm512_bitshuffle_epi64_mask(qh, _mm512_loadu_si512((const void *)HQ3R_ORDER.high[t]));
        const __m512i u = _mm512_mask_add_epi8(low, high, low, _mm512_set1_epi8(4));
        dot[t % 2] = _mm512_dpbusd_epi32(dot[t % 2], _mm512_shuffle_epi8(grid, u),
                                         _mm512_load_si512((const void *)(x + 64 * t)));
    }
    const __m512i f = _mm512_permutex2var_epi8(z0, _mm512_loadu_si512((const void *)HQ3R_ORDER.fields), z1);
    const __m512 scale = BK_NAME(hq3_r_scales_)(f, _mm512_loadu_ps(a->dxs + 4 * b), levels_lo, levels_hi);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[0], dot[1])), scale, acc);
}
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
#undef HQ3R_NAME
