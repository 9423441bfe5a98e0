/* The fast IQ4_NL / IQ4_XS search of iq4_search_cpu.c, written once and compiled twice: iq4_search_cpu.c includes this
 * file with IS_TARGET (the function attribute), IS_SUFFIX (appended to each name) and IS_AVX512 (1: the AVX-512
 * intrinsics of the two inner loops; 0: their portable C form) defined. Both forms take the same float32 steps in the
 * same order (products, fused multiply-adds, two partial sums per lane added last), so they give the same bytes.
 *
 * Layout: a group of IS_LANES (16) blocks (IQ4_NL) or super-blocks (IQ4_XS), transposed so that element k of every
 * lane is one row of 16 floats (`xt[k * 16 + lane]`): each lane runs its own search, a vector lane per block. */

#define IS_CAT2(a, b) a##b
#define IS_CAT(a, b) IS_CAT2(a, b)
#define IS_NAME(name) IS_CAT(name, IS_SUFFIX)

/* sqx[l] = sum_k w q x and sqq[l] = sum_k w q q over rows k < n (even) of lane l, q = KVALUES[code], code the nearest
 * grid index of x * inv[l] (`iq4_code`); w = 1 when wt is NULL */
IS_TARGET static void IS_NAME(iq4_sums_)(const float *xt, const float *wt, int n, const float *inv, float *sqx,
                                         float *sqq) {
#if IS_AVX512
    const __m512 vinv = _mm512_loadu_ps(inv), eighth = _mm512_set1_ps(0.125f), sixteen = _mm512_set1_ps(16.0f);
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(31.0f), kv = _mm512_loadu_ps(iq4_values);
    const __m512i base_lo = _mm512_loadu_si512(iq4_bucket_base), base_hi = _mm512_loadu_si512(iq4_bucket_base + 16);
    const __m512 mid_lo = _mm512_loadu_ps(iq4_bucket_mid), mid_hi = _mm512_loadu_ps(iq4_bucket_mid + 16);
    const __m512i one = _mm512_set1_epi32(1);
    __m512 acc_x[2] = {zero, zero}, acc_q[2] = {zero, zero};
    for (int k = 0; k < n; k += 2) {
        for (int h = 0; h < 2; h++) {
            const __m512 x = _mm512_loadu_ps(xt + (k + h) * IS_LANES), u = _mm512_mul_ps(x, vinv);
            __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(u, eighth, sixteen), zero), top);
            const __m512i bucket = _mm512_cvttps_epi32(t);
            const __m512i base = _mm512_permutex2var_epi32(base_lo, bucket, base_hi);
            const __m512 mid = _mm512_permutex2var_ps(mid_lo, bucket, mid_hi);
            const __m512i code = _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(u, mid, _CMP_GE_OQ), base, one);
            const __m512 q = _mm512_permutexvar_ps(code, kv);
            const __m512 wq = wt ? _mm512_mul_ps(_mm512_loadu_ps(wt + (k + h) * IS_LANES), q) : q;
            acc_x[h] = _mm512_fmadd_ps(wq, x, acc_x[h]);
            acc_q[h] = _mm512_fmadd_ps(wq, q, acc_q[h]);
        }
    }
    _mm512_storeu_ps(sqx, _mm512_add_ps(acc_x[0], acc_x[1]));
    _mm512_storeu_ps(sqq, _mm512_add_ps(acc_q[0], acc_q[1]));
#else
    for (int l = 0; l < IS_LANES; l++) {
        float acc_x[2] = {0.0f, 0.0f}, acc_q[2] = {0.0f, 0.0f};
        for (int k = 0; k < n; k++) {
            const float x = xt[k * IS_LANES + l], q = iq4_values[iq4_code(x * inv[l])];
            const float wq = wt ? wt[k * IS_LANES + l] * q : q;
            acc_x[k & 1] = fmaf(wq, x, acc_x[k & 1]);
            acc_q[k & 1] = fmaf(wq, q, acc_q[k & 1]);
        }
        sqx[l] = acc_x[0] + acc_x[1];
        sqq[l] = acc_q[0] + acc_q[1];
    }
#endif
}

/* codes[k * 16 + l] = the nearest grid index of xt[k * 16 + l] * inv[l], rows k < n */
IS_TARGET static void IS_NAME(iq4_codes_)(const float *xt, int n, const float *inv, uint8_t *codes) {
#if IS_AVX512
    const __m512 vinv = _mm512_loadu_ps(inv), eighth = _mm512_set1_ps(0.125f), sixteen = _mm512_set1_ps(16.0f);
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(31.0f);
    const __m512i base_lo = _mm512_loadu_si512(iq4_bucket_base), base_hi = _mm512_loadu_si512(iq4_bucket_base + 16);
    const __m512 mid_lo = _mm512_loadu_ps(iq4_bucket_mid), mid_hi = _mm512_loadu_ps(iq4_bucket_mid + 16);
    const __m512i one = _mm512_set1_epi32(1);
    for (int k = 0; k < n; k++) {
        const __m512 u = _mm512_mul_ps(_mm512_loadu_ps(xt + k * IS_LANES), vinv);
        __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(u, eighth, sixteen), zero), top);
        const __m512i bucket = _mm512_cvttps_epi32(t);
        const __m512i base = _mm512_permutex2var_epi32(base_lo, bucket, base_hi);
        const __m512 mid = _mm512_permutex2var_ps(mid_lo, bucket, mid_hi);
        const __m512i code = _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(u, mid, _CMP_GE_OQ), base, one);
        _mm_storeu_si128((__m128i *)(codes + k * IS_LANES), _mm512_cvtepi32_epi8(code));
    }
#else
    for (int k = 0; k < n; k++)
        for (int l = 0; l < IS_LANES; l++) codes[k * IS_LANES + l] = (uint8_t)iq4_code(xt[k * IS_LANES + l] * inv[l]);
#endif
}

/* per lane the element of largest magnitude among rows k < n (the first on ties), with its sign */
IS_TARGET static void IS_NAME(iq4_lane_peaks_)(const float *xt, int n, float *peak) {
    for (int l = 0; l < IS_LANES; l++) peak[l] = xt[l];
    for (int k = 1; k < n; k++)
        for (int l = 0; l < IS_LANES; l++)
            peak[l] = fabsf(xt[k * IS_LANES + l]) > fabsf(peak[l]) ? xt[k * IS_LANES + l] : peak[l];
}

/* per lane, keep (sqx, sqq, tried) in (best_x, best_q, target) where the gain sqx^2 / sqq beats the kept one
 * (compared cross-multiplied; the kept one on ties) or when `first` */
IS_TARGET static void IS_NAME(iq4_keep_gain_)(int first, const float *sqx, const float *sqq, const float *tried,
                                              float *best_x, float *best_q, float *target) {
#if IS_AVX512
    const __m512 x = _mm512_loadu_ps(sqx), q = _mm512_loadu_ps(sqq);
    const __m512 bx = _mm512_loadu_ps(best_x), bq = _mm512_loadu_ps(best_q);
    const __mmask16 better =
        first ? (__mmask16)0xffff
              : _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_mul_ps(x, x), bq), _mm512_mul_ps(_mm512_mul_ps(bx, bx), q),
                                   _CMP_GT_OQ);
    _mm512_storeu_ps(best_x, _mm512_mask_mov_ps(bx, better, x));
    _mm512_storeu_ps(best_q, _mm512_mask_mov_ps(bq, better, q));
    _mm512_storeu_ps(target, _mm512_mask_mov_ps(_mm512_loadu_ps(target), better, _mm512_loadu_ps(tried)));
#else
    for (int l = 0; l < IS_LANES; l++) {
        const int better = first || sqx[l] * sqx[l] * best_q[l] > best_x[l] * best_x[l] * sqq[l];
        best_x[l] = better ? sqx[l] : best_x[l];
        best_q[l] = better ? sqq[l] : best_q[l];
        target[l] = better ? tried[l] : target[l];
    }
#endif
}

/* each lane's block scale: the least-squares scale sqx / sqq of the candidate (peak / target) with the largest gain
 * sqx^2 / sqq (llama.cpp's `quantize_row_iq4_nl_impl` scan, with hfquant's targets at both ends of the grid; gains
 * compared cross-multiplied, the first kept on ties) */
IS_TARGET static void IS_NAME(iq4_block_scales_)(const float *xt, const float *wt, const iq4_search_t *s,
                                                 float *scale) {
    float peak[IS_LANES], inv[IS_LANES], sqx[IS_LANES], sqq[IS_LANES], best_x[IS_LANES], best_q[IS_LANES];
    float target[IS_LANES], centre[IS_LANES], tried[IS_LANES];
    IS_NAME(iq4_lane_peaks_)(xt, 32, peak);
    for (int l = 0; l < IS_LANES; l++) peak[l] = peak[l] != 0.0f ? 1.0f / peak[l] : 0.0f; /* now 1 / peak */
    float step = s->refine_step;
    for (int c = 0; c < s->ntargets + 2 * s->refine; c++) {
        if (c >= s->ntargets && (c - s->ntargets) % 2 == 0) {
            for (int l = 0; l < IS_LANES; l++) centre[l] = target[l];
            if (c > s->ntargets) step *= 0.5f;
        }
        const float up = ((c - s->ntargets) & 1) ? 1.0f - step : 1.0f + step;
#if IS_AVX512
        const __m512 vt = c < s->ntargets ? _mm512_set1_ps(s->targets[c])
                                          : _mm512_mul_ps(_mm512_loadu_ps(centre), _mm512_set1_ps(up));
        _mm512_storeu_ps(tried, vt);
        _mm512_storeu_ps(inv, _mm512_mul_ps(vt, _mm512_loadu_ps(peak)));
#else
        for (int l = 0; l < IS_LANES; l++) {
            tried[l] = c < s->ntargets ? s->targets[c] : centre[l] * up;
            inv[l] = tried[l] * peak[l];
        }
#endif
        IS_NAME(iq4_sums_)(xt, wt, 32, inv, sqx, sqq);
        IS_NAME(iq4_keep_gain_)(c == 0, sqx, sqq, tried, best_x, best_q, target);
    }
    for (int l = 0; l < IS_LANES; l++) scale[l] = best_q[l] > 0.0f ? best_x[l] / best_q[l] : 0.0f;
}

/* one level option of one block for each lane: level = clamp(base + o, -32, 31), its codes' sums at scale d level
 * and error (d l)^2 sqq - 2 d l sqx, kept in best, level, sx, sq where lower than best (or when `first`) */
IS_TARGET static void IS_NAME(iq4_xs_level_option_)(const float *xb, const float *wb, const float *d,
                                                    const float *base, float o, int first, float *best, float *level,
                                                    float *sx, float *sq) {
    float inv[IS_LANES], sqx[IS_LANES], sqq[IS_LANES];
#if IS_AVX512
    const __m512 zero = _mm512_setzero_ps();
    const __m512 vl = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_loadu_ps(base), _mm512_set1_ps(o)),
                                                  _mm512_set1_ps(-32.0f)),
                                    _mm512_set1_ps(31.0f));
    const __m512 vdl = _mm512_mul_ps(_mm512_loadu_ps(d), vl);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(vdl, zero, _CMP_NEQ_OQ);
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), vdl));
    IS_NAME(iq4_sums_)(xb, wb, 32, inv, sqx, sqq);
    const __m512 x = _mm512_loadu_ps(sqx), q = _mm512_loadu_ps(sqq), vbest = _mm512_loadu_ps(best);
    const __m512 e = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(vdl, vdl), q),
                                   _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), vdl), x));
    const __mmask16 keep = first ? (__mmask16)0xffff : _mm512_cmp_ps_mask(e, vbest, _CMP_LT_OQ);
    _mm512_storeu_ps(best, _mm512_mask_mov_ps(vbest, keep, e));
    _mm512_storeu_ps(level, _mm512_mask_mov_ps(_mm512_loadu_ps(level), keep, vl));
    _mm512_storeu_ps(sx, _mm512_mask_mov_ps(_mm512_loadu_ps(sx), keep, x));
    _mm512_storeu_ps(sq, _mm512_mask_mov_ps(_mm512_loadu_ps(sq), keep, q));
#else
    float lv[IS_LANES], dl[IS_LANES];
    for (int l = 0; l < IS_LANES; l++) {
        lv[l] = iq4_clamp(base[l] + o, -32.0f, 31.0f);
        dl[l] = d[l] * lv[l];
        inv[l] = dl[l] != 0.0f ? 1.0f / dl[l] : 0.0f;
    }
    IS_NAME(iq4_sums_)(xb, wb, 32, inv, sqx, sqq);
    for (int l = 0; l < IS_LANES; l++) {
        const float e = dl[l] * dl[l] * sqq[l] - 2.0f * dl[l] * sqx[l];
        if (first || e < best[l]) {
            best[l] = e;
            level[l] = lv[l];
            sx[l] = sqx[l];
            sq[l] = sqq[l];
        }
    }
#endif
}

/* for super-block scales d (per lane), each block's best of the `s->level_options` 6-bit levels nearest to
 * scale / d: levels, sums (sqx, sqq of the chosen codes) and the super-block's error less sum w x^2 (err) */
IS_TARGET static void IS_NAME(iq4_xs_levels_)(const float *xt, const float *wt, const iq4_search_t *s,
                                              const float *scales, const float *d, float *levels, float *lsx,
                                              float *lsq, float *err) {
    float base[8][IS_LANES], best[8][IS_LANES];
    for (int l = 0; l < IS_LANES; l++) err[l] = 0.0f;
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < IS_LANES; l++) base[j][l] = d[l] != 0.0f ? iq4_round(scales[j * IS_LANES + l] / d[l]) : 0;
    const int first = -(s->level_options / 2), last = s->level_options / 2;
    for (int j = 0; j < 8; j++) {
        const float *xb = xt + j * 32 * IS_LANES, *wb = wt ? wt + j * 32 * IS_LANES : NULL;
        for (int o = first; o <= last; o++)
            IS_NAME(iq4_xs_level_option_)(xb, wb, d, base[j], (float)o, o == first, best[j], levels + j * IS_LANES,
                                          lsx + j * IS_LANES, lsq + j * IS_LANES);
    }
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < IS_LANES; l++) err[l] += best[j][l];
}

/* the super-block scale of each lane: candidate `c` of the scan (d = fp16(peak / e / f) for e in {-32, 31} and the
 * super factors f), or past them a least-squares refit d = sum_j l_j sqx_j / sum_j l_j^2 sqq_j of the levels and sums
 * kept so far (d_kept where that is 0 / 0) */
IS_TARGET static void IS_NAME(iq4_xs_candidate_)(const iq4_search_t *s, int c, const float *peak, const float *levels,
                                                 const float *sx, const float *sq, const float *d_kept, float *d) {
    if (c < 2 * s->nsuper) {
        const float end = c < s->nsuper ? -32.0f : 31.0f, f = s->super_factors[c % s->nsuper];
        for (int l = 0; l < IS_LANES; l++) d[l] = iq4_half(peak[l] / end / f);
        return;
    }
    for (int l = 0; l < IS_LANES; l++) {
        float num = 0.0f, den = 0.0f;
        for (int j = 0; j < 8; j++) {
            const float level = levels[j * IS_LANES + l];
            num += level * sx[j * IS_LANES + l];
            den += level * level * sq[j * IS_LANES + l];
        }
        d[l] = den > 0.0f ? iq4_half(num / den) : d_kept[l];
    }
}

/* per lane, where err is below best (or when `first`): best = err, d_out = d and the lane's 8 levels and sums */
IS_TARGET static void IS_NAME(iq4_xs_keep_)(int first, const float *d, const float *err, const float *levels,
                                            const float *lsx, const float *lsq, float *best, float *d_out,
                                            float *levels_out, float *best_sx, float *best_sq) {
    for (int l = 0; l < IS_LANES; l++) {
        if (!first && !(err[l] < best[l])) continue;
        best[l] = err[l];
        d_out[l] = d[l];
        for (int j = 0; j < 8; j++) {
            levels_out[j * IS_LANES + l] = levels[j * IS_LANES + l];
            best_sx[j * IS_LANES + l] = lsx[j * IS_LANES + l];
            best_sq[j * IS_LANES + l] = lsq[j * IS_LANES + l];
        }
    }
}

/* one group of 16 IQ4_XS super-blocks (xt: 256 rows): d (per lane, float16-exact), levels[j * 16 + l] in [-32, 31]
 * and codes[k * 16 + l]. Block scales by `iq4_block_scales_`; super-block scales d = fp16(peak / e / f) for e in
 * {-32, 31} and the super factors f, each with its best levels (`iq4_xs_levels_`); then `rounds` least-squares refits
 * of d for the chosen levels and codes, kept where they lower the error. */
IS_TARGET static void IS_NAME(iq4_xs_group_)(const float *xt, const float *wt, const iq4_search_t *s, float *d_out,
                                             float *levels_out, uint8_t *codes) {
    float scales[8 * IS_LANES], levels[8 * IS_LANES], lsx[8 * IS_LANES], lsq[8 * IS_LANES];
    float best_sx[8 * IS_LANES], best_sq[8 * IS_LANES], peak[IS_LANES], d[IS_LANES], err[IS_LANES], best[IS_LANES];
    for (int j = 0; j < 8; j++)
        IS_NAME(iq4_block_scales_)(xt + j * 32 * IS_LANES, wt ? wt + j * 32 * IS_LANES : NULL, s,
                                   scales + j * IS_LANES);
    IS_NAME(iq4_lane_peaks_)(scales, 8, peak);
    for (int c = 0; c < 2 * s->nsuper + s->rounds; c++) {
        IS_NAME(iq4_xs_candidate_)(s, c, peak, levels_out, best_sx, best_sq, d_out, d);
        IS_NAME(iq4_xs_levels_)(xt, wt, s, scales, d, levels, lsx, lsq, err);
        IS_NAME(iq4_xs_keep_)(c == 0, d, err, levels, lsx, lsq, best, d_out, levels_out, best_sx, best_sq);
    }
    for (int j = 0; j < 8; j++) {
        float inv[IS_LANES];
        for (int l = 0; l < IS_LANES; l++) {
            const float dl = d_out[l] * levels_out[j * IS_LANES + l];
            inv[l] = dl != 0.0f ? 1.0f / dl : 0.0f;
        }
        IS_NAME(iq4_codes_)(xt + j * 32 * IS_LANES, 32, inv, codes + j * 32 * IS_LANES);
    }
}

/* one group of 16 IQ4_NL blocks (xt: 32 rows): d (per lane, float16-exact) and codes[k * 16 + l]. The block scale
 * by `iq4_block_scales_`, then `rounds` float16 roundings / least-squares refits, the first seeded by
 * peak / -127 (llama.cpp's first candidate), keeping the lowest error. */
IS_TARGET static void IS_NAME(iq4_nl_group_)(const float *xt, const float *wt, const iq4_search_t *s, float *d_out,
                                             uint8_t *codes) {
    float scale[IS_LANES], peak[IS_LANES], inv[IS_LANES], sqx[IS_LANES], sqq[IS_LANES], best[IS_LANES];
    IS_NAME(iq4_block_scales_)(xt, wt, s, scale);
    IS_NAME(iq4_lane_peaks_)(xt, 32, peak);
    for (int c = -1; c <= s->rounds; c++) {
        float d[IS_LANES];
        for (int l = 0; l < IS_LANES; l++) {
            d[l] = iq4_half(c < 0 ? peak[l] / -127.0f : scale[l]);
            inv[l] = d[l] != 0.0f ? 1.0f / d[l] : 0.0f;
        }
        IS_NAME(iq4_sums_)(xt, wt, 32, inv, sqx, sqq);
        for (int l = 0; l < IS_LANES; l++) {
            const float e = d[l] * d[l] * sqq[l] - 2.0f * d[l] * sqx[l];
            if (c < 0 || e < best[l]) {
                best[l] = e;
                d_out[l] = d[l];
            }
            if (c >= 0) scale[l] = sqq[l] > 0.0f ? sqx[l] / sqq[l] : d[l];
        }
    }
    for (int l = 0; l < IS_LANES; l++) inv[l] = d_out[l] != 0.0f ? 1.0f / d_out[l] : 0.0f;
    IS_NAME(iq4_codes_)(xt, 32, inv, codes);
}

/* xt[k * 16 + l] = src[l * size + k] for rows k < size of all 16 lanes (a full group) */
IS_TARGET static void IS_NAME(iq4_transpose_in_)(const float *src, int size, float *xt) {
#if IS_AVX512 /* 16 x 16 tiles transposed in registers: unpacks of 32- and 64-bit pairs, then two 128-bit shuffles */
    for (int k0 = 0; k0 < size; k0 += 16) {
        __m512 r[16], t[16];
        for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_ps(src + (int64_t)l * size + k0);
        for (int l = 0; l < 16; l += 2) {
            t[l] = _mm512_unpacklo_ps(r[l], r[l + 1]);
            t[l + 1] = _mm512_unpackhi_ps(r[l], r[l + 1]);
        }
        for (int l = 0; l < 16; l += 4)
            for (int h = 0; h < 2; h++) {
                const __m512d a = _mm512_castps_pd(t[l + h]), b = _mm512_castps_pd(t[l + 2 + h]);
                r[l + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
                r[l + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
            }
        /* r[4 g + i] now holds, in each 128-bit part p, rows 4 g .. 4 g + 3 at column 4 p + i */
        for (int g = 0; g < 4; g += 2)
            for (int i = 0; i < 4; i++) {
                t[4 * g + i] = _mm512_shuffle_f32x4(r[4 * g + i], r[4 * g + 4 + i], 0x88);
                t[4 * g + 4 + i] = _mm512_shuffle_f32x4(r[4 * g + i], r[4 * g + 4 + i], 0xdd);
            }
        /* t[4 g + i] (g = 0, 2): parts rows 4g (cols i, 8+i), rows 4g+4 (cols i, 8+i); g+1: cols 4+i, 12+i */
        for (int i = 0; i < 4; i++)
            for (int h = 0; h < 2; h++) {
                const __m512 a = t[4 * h + i], b = t[8 + 4 * h + i];
                _mm512_storeu_ps(xt + (k0 + 4 * h + i) * IS_LANES, _mm512_shuffle_f32x4(a, b, 0x88));
                _mm512_storeu_ps(xt + (k0 + 8 + 4 * h + i) * IS_LANES, _mm512_shuffle_f32x4(a, b, 0xdd));
            }
    }
#else
    for (int l = 0; l < IS_LANES; l++)
        for (int k = 0; k < size; k++) xt[k * IS_LANES + l] = src[l * size + k];
#endif
}

/* the qs[128] field of each of the first `count` lanes' IQ4_XS super-blocks at out + lane * 136 + 8 from codes
 * [256][16] (code k of block j at nibble k % 16 < ... as iq4.py's docstring: low nibble rows 0-15, high 16-31) */
IS_TARGET static void IS_NAME(iq4_xs_put_codes_)(const uint8_t *codes, int count, uint8_t *out) {
#if IS_AVX512
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(136));
    const __mmask16 lanes = (__mmask16)((1u << count) - 1u);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 16; i += 4) {
            __m512i word = _mm512_setzero_si512();
            for (int b = 0; b < 4; b++) {
                const uint8_t *row = codes + (j * 32 + i + b) * IS_LANES;
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)row));
                const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * IS_LANES)));
                word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), 8 * b));
            }
            _mm512_mask_i32scatter_epi32(out + 8 + 16 * j + i, lanes, offsets, word, 1);
        }
#else
    for (int l = 0; l < count; l++)
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 16; i++) {
                const uint8_t *c = codes + (j * 32 + i) * IS_LANES + l;
                out[l * 136 + 8 + 16 * j + i] = (uint8_t)(c[0] | (c[16 * IS_LANES] << 4));
            }
#endif
}
