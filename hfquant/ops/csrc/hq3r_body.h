/* HQ3_R's AVX-512 row (one 64-weight block per 512-bit step), included twice by blocks_body.h's VNNI body with
 * HQ3R_SUFFIX (appended to the names), HQ3R_TARGET (the function attribute) and HQ3R_GFNI defined:
 *   0: the 2-bit codes by a 64-bit shift (srlv by 0, 2, 4, 6) and `& 3`, for every AVX512-VNNI CPU;
 *   1: the 2-bit codes by one GFNI affine transform (vgf2p8affineqb: per qword an 8 x 8 bit matrix picking bits 2p and
 *      2p + 1 of each byte into bits 0 and 1, the other bits zero), for CPUs with GFNI (Ice Lake, Zen 4 and later;
 *      not Cascade Lake): one vector operation instead of two per block (Intel SDM, GF2P8AFFINEQB).
 * Both give the same bytes (the same codes, then the same integer dots and float operations in the same order). */

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
