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

/* The exact breakpoint sweep of a block's scale (the block stage of `iq4_block_scales_` when s->sweep_hi > 0). At one
 * grid end e (-127 or 113) the candidate scales are peak / (e f) for f in [lo, hi]: u = a f with a = x e / peak, and
 * a code changes only where u crosses a grid midpoint, at f = mid / a, outward (|u| grows with f): at most two
 * crossings per weight when hi <= 1.55 lo (neighbouring midpoints are >= 1.235x apart, every other one >= 1.56x). The
 * crossings, sorted, split [lo, hi] into segments of constant codes; the sums sqx = sum w x q, sqq = sum w q^2 move by
 * each crossing's difference, and each segment's least-squares gain sqx^2 / sqq is what any candidate scale inside it
 * reaches, so the best segment is at least as good as any scan of the same range. Keys: the crossing's position
 * (f - lo) / (hi - lo) in 2^-25 units above its row (2 i + which), so all 16 lanes sort at once by a network of
 * vertical min / max over rows and the rows' differences are gathered back in order. */

/* one end's crossings of the 32 weights of every lane: keys[r * 16 + l], dx / dq (the sums' differences, 0 where
 * no crossing), and the sums at f = lo in sqx / sqq */
IS_TARGET static void IS_NAME(iq4_sweep_crossings_)(const float *xt, const float *wt, const float *ends, float lo,
                                                    float hi, uint32_t *keys, float *dx, float *dq, float *sqx,
                                                    float *sqq) {
    const float fixed = IS_SWEEP_FIXED / (hi - lo);
#if IS_AVX512
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), vfixed = _mm512_set1_ps(fixed);
    const __m512 zero = _mm512_setzero_ps(), vends = _mm512_loadu_ps(ends), kv = _mm512_loadu_ps(iq4_values);
    const __m512 mids = _mm512_loadu_ps(iq4_mids), eighth = _mm512_set1_ps(0.125f), sixteen = _mm512_set1_ps(16.0f);
    const __m512 top = _mm512_set1_ps(31.0f);
    const __m512i base_lo = _mm512_loadu_si512(iq4_bucket_base), base_hi = _mm512_loadu_si512(iq4_bucket_base + 16);
    const __m512 mid_lo = _mm512_loadu_ps(iq4_bucket_mid), mid_hi = _mm512_loadu_ps(iq4_bucket_mid + 16);
    const __m512i one = _mm512_set1_epi32(1), fifteen = _mm512_set1_epi32(15), none = _mm512_set1_epi32(IS_SWEEP_NONE);
    __m512 vx = zero, vq = zero;
    for (int i = 0; i < 32; i++) {
        const __m512 x = _mm512_loadu_ps(xt + i * IS_LANES), a = _mm512_mul_ps(x, vends);
        const __m512 w = wt ? _mm512_loadu_ps(wt + i * IS_LANES) : _mm512_set1_ps(1.0f), u = _mm512_mul_ps(a, vlo);
        const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(u, eighth, sixteen), zero), top);
        const __m512i bucket = _mm512_cvttps_epi32(t);
        const __m512i base = _mm512_permutex2var_epi32(base_lo, bucket, base_hi);
        const __m512 mid = _mm512_permutex2var_ps(mid_lo, bucket, mid_hi);
        __m512i code = _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(u, mid, _CMP_GE_OQ), base, one);
        __m512 q = _mm512_permutexvar_ps(code, kv);
        const __m512 wq = _mm512_mul_ps(w, q);
        vx = _mm512_add_ps(vx, _mm512_mul_ps(wq, x));
        vq = _mm512_add_ps(vq, _mm512_mul_ps(wq, q));
        const __mmask16 up = _mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), down = _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ);
        const __m512 inv_a = _mm512_maskz_div_ps(up | down, _mm512_set1_ps(1.0f), a);
        __mmask16 valid = up | down;
        for (int c = 0; c < 2; c++) {
            valid &= _mm512_mask_cmp_epi32_mask(up, code, fifteen, _MM_CMPINT_LT) |
                     _mm512_mask_cmp_epi32_mask(down, code, _mm512_setzero_si512(), _MM_CMPINT_GT);
            const __m512i next = _mm512_mask_sub_epi32(_mm512_add_epi32(code, one), down, code, one);
            const __m512i mid_index = _mm512_mask_mov_epi32(code, down, next);
            const __m512 at = _mm512_mul_ps(_mm512_permutexvar_ps(mid_index, mids), inv_a);
            valid &= _mm512_cmp_ps_mask(at, vhi, _CMP_LE_OQ);
            const __m512 q2 = _mm512_permutexvar_ps(next, kv);
            const __m512 ddx = _mm512_mul_ps(_mm512_mul_ps(w, _mm512_sub_ps(q2, q)), x);
            const __m512 ddq = _mm512_mul_ps(w, _mm512_sub_ps(_mm512_mul_ps(q2, q2), _mm512_mul_ps(q, q)));
            const __m512 offset = _mm512_max_ps(_mm512_sub_ps(at, vlo), zero);
            const __m512i position =
                _mm512_slli_epi32(_mm512_cvttps_epu32(_mm512_mul_ps(offset, vfixed)), IS_SWEEP_SHIFT);
            const __m512i row = _mm512_set1_epi32(2 * i + c);
            const __m512i key = _mm512_or_si512(_mm512_mask_mov_epi32(none, valid, position), row);
            _mm512_storeu_si512(keys + (2 * i + c) * IS_LANES, key);
            _mm512_storeu_ps(dx + (2 * i + c) * IS_LANES, _mm512_maskz_mov_ps(valid, ddx));
            _mm512_storeu_ps(dq + (2 * i + c) * IS_LANES, _mm512_maskz_mov_ps(valid, ddq));
            code = _mm512_mask_mov_epi32(code, valid, next);
            q = _mm512_mask_mov_ps(q, valid, q2);
        }
    }
    _mm512_storeu_ps(sqx, vx);
    _mm512_storeu_ps(sqq, vq);
#else
    for (int l = 0; l < IS_LANES; l++) {
        float vx = 0.0f, vq = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float x = xt[i * IS_LANES + l], a = x * ends[l], w = wt ? wt[i * IS_LANES + l] : 1.0f;
            int code = iq4_code(a * lo);
            float q = iq4_values[code];
            const float wq = w * q;
            vx = vx + wq * x;
            vq = vq + wq * q;
            int valid = a > 0.0f || a < 0.0f;
            const float inv_a = valid ? 1.0f / a : 0.0f;
            for (int c = 0; c < 2; c++) {
                valid = valid && (a > 0.0f ? code < 15 : code > 0);
                const int next = a > 0.0f ? code + 1 : code - 1;
                const float at = valid ? iq4_mids[a > 0.0f ? code : next] * inv_a : 0.0f;
                valid = valid && at <= hi;
                const float q2 = valid ? iq4_values[next] : 0.0f;
                const float offset = at - lo > 0.0f ? at - lo : 0.0f;
                const int r = (2 * i + c) * IS_LANES + l;
                const uint32_t position = valid ? (uint32_t)(offset * fixed) << IS_SWEEP_SHIFT : IS_SWEEP_NONE;
                keys[r] = position | (uint32_t)(2 * i + c);
                dx[r] = valid ? w * (q2 - q) * x : 0.0f;
                dq[r] = valid ? w * (q2 * q2 - q * q) : 0.0f;
                if (valid) {
                    code = next;
                    q = q2;
                }
            }
        }
        sqx[l] = vx;
        sqq[l] = vq;
    }
#endif
}

/* each lane's 64 keys (rows of keys[r * 16 + l]) ascending: a bitonic network of vertical min / max */
IS_TARGET static void IS_NAME(iq4_sweep_sort_)(uint32_t *keys) {
    for (int k = 2; k <= IS_SWEEP_ROWS; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1)
            for (int b = 0; b < IS_SWEEP_ROWS; b += 2 * j)
                for (int i = b; i < b + j; i++) { /* rows i < i + j: ascending where i & k is 0 */
                    uint32_t *lo_row = keys + ((i & k) ? i + j : i) * IS_LANES;
                    uint32_t *hi_row = keys + ((i & k) ? i : i + j) * IS_LANES;
#if IS_AVX512
                    const __m512i a = _mm512_load_si512(lo_row), c = _mm512_load_si512(hi_row);
                    _mm512_store_si512(lo_row, _mm512_min_epu32(a, c));
                    _mm512_store_si512(hi_row, _mm512_max_epu32(a, c));
#else
                    for (int l = 0; l < IS_LANES; l++) {
                        const uint32_t a = lo_row[l], c = hi_row[l];
                        lo_row[l] = a < c ? a : c;
                        hi_row[l] = a < c ? c : a;
                    }
#endif
                }
}

/* the sweep of one end: from the sums at f = lo, each crossing's differences in key order, the gain sqx^2 / sqq
 * compared after the last crossing of each position (and at the start) with the kept one (best_x, best_q;
 * cross-multiplied, the kept one on ties; `first`: the start is kept) */
IS_TARGET static void IS_NAME(iq4_sweep_gains_)(const uint32_t *keys, const float *dx, const float *dq, float *sqx,
                                                float *sqq, int first, float *best_x, float *best_q) {
#if IS_AVX512
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i row_mask = _mm512_set1_epi32((1 << IS_SWEEP_SHIFT) - 1);
    __m512 x = _mm512_loadu_ps(sqx), q = _mm512_loadu_ps(sqq);
    __m512 bx = _mm512_loadu_ps(best_x), bq = _mm512_loadu_ps(best_q);
    __mmask16 better = first ? (__mmask16)0xffff
                             : _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_mul_ps(x, x), bq),
                                                  _mm512_mul_ps(_mm512_mul_ps(bx, bx), q), _CMP_GT_OQ);
    bx = _mm512_mask_mov_ps(bx, better, x);
    bq = _mm512_mask_mov_ps(bq, better, q);
    __m512i key = _mm512_loadu_si512(keys);
    for (int r = 0; r < IS_SWEEP_ROWS; r++) {
        if (_mm512_cmpge_epu32_mask(key, _mm512_set1_epi32(IS_SWEEP_NONE)) == 0xffff) break; /* zeros from here */
        const __m512i index = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(key, row_mask), 4), lanes);
        x = _mm512_add_ps(x, _mm512_i32gather_ps(index, dx, 4));
        q = _mm512_add_ps(q, _mm512_i32gather_ps(index, dq, 4));
        __mmask16 last = 0xffff;
        if (r + 1 < IS_SWEEP_ROWS) {
            const __m512i next = _mm512_loadu_si512(keys + (r + 1) * IS_LANES);
            last = _mm512_cmpneq_epi32_mask(_mm512_srli_epi32(next, IS_SWEEP_SHIFT),
                                            _mm512_srli_epi32(key, IS_SWEEP_SHIFT));
            key = next;
        }
        better = _mm512_mask_cmp_ps_mask(last, _mm512_mul_ps(_mm512_mul_ps(x, x), bq),
                                         _mm512_mul_ps(_mm512_mul_ps(bx, bx), q), _CMP_GT_OQ);
        bx = _mm512_mask_mov_ps(bx, better, x);
        bq = _mm512_mask_mov_ps(bq, better, q);
    }
    _mm512_storeu_ps(best_x, bx);
    _mm512_storeu_ps(best_q, bq);
#else
    for (int l = 0; l < IS_LANES; l++) {
        float x = sqx[l], q = sqq[l], bx = best_x[l], bq = best_q[l];
        if (first || x * x * bq > bx * bx * q) {
            bx = x;
            bq = q;
        }
        for (int r = 0; r < IS_SWEEP_ROWS; r++) {
            const uint32_t key = keys[r * IS_LANES + l];
            if (key >= IS_SWEEP_NONE) break; /* zeros from here: the last crossing's gain was compared */
            const int row = (int)(key & ((1u << IS_SWEEP_SHIFT) - 1));
            x = x + dx[row * IS_LANES + l];
            q = q + dq[row * IS_LANES + l];
            if (r + 1 < IS_SWEEP_ROWS && keys[(r + 1) * IS_LANES + l] >> IS_SWEEP_SHIFT == key >> IS_SWEEP_SHIFT)
                continue;
            if (x * x * bq > bx * bx * q) {
                bx = x;
                bq = q;
            }
        }
        best_x[l] = bx;
        best_q[l] = bq;
    }
#endif
}

/* each lane's block scale by the sweep at both grid ends (-127 first) over factors [lo, hi]: the least-squares scale
 * sqx / sqq of the best segment, 0 for an all-zero block */
IS_TARGET static void IS_NAME(iq4_sweep_scales_)(const float *xt, const float *wt, const float *peak, float lo,
                                                 float hi, float *scale) {
    uint32_t keys[IS_SWEEP_ROWS * IS_LANES] __attribute__((aligned(64)));
    float dx[IS_SWEEP_ROWS * IS_LANES] __attribute__((aligned(64)));
    float dq[IS_SWEEP_ROWS * IS_LANES] __attribute__((aligned(64)));
    float ends[IS_LANES], sqx[IS_LANES], sqq[IS_LANES], best_x[IS_LANES], best_q[IS_LANES];
    for (int e = 0; e < 2; e++) {
        for (int l = 0; l < IS_LANES; l++) ends[l] = peak[l] != 0.0f ? iq4_values[e ? 15 : 0] / peak[l] : 0.0f;
        IS_NAME(iq4_sweep_crossings_)(xt, wt, ends, lo, hi, keys, dx, dq, sqx, sqq);
        IS_NAME(iq4_sweep_sort_)(keys);
        IS_NAME(iq4_sweep_gains_)(keys, dx, dq, sqx, sqq, e == 0, best_x, best_q);
    }
    for (int l = 0; l < IS_LANES; l++) scale[l] = best_q[l] > 0.0f ? best_x[l] / best_q[l] : 0.0f;
}

/* each lane's block scale: the least-squares scale sqx / sqq of the candidate (peak / target) with the largest gain
 * sqx^2 / sqq (llama.cpp's `quantize_row_iq4_nl_impl` scan, with hfquant's targets at both ends of the grid; gains
 * compared cross-multiplied, the first kept on ties) */
IS_TARGET static void IS_NAME(iq4_block_scales_)(const float *xt, const float *wt, const iq4_search_t *s,
                                                 float *scale) {
    float peak[IS_LANES], inv[IS_LANES], sqx[IS_LANES], sqq[IS_LANES], best_x[IS_LANES], best_q[IS_LANES];
    float target[IS_LANES], centre[IS_LANES], tried[IS_LANES];
    IS_NAME(iq4_lane_peaks_)(xt, 32, peak);
    if (s->sweep_hi > 0.0f) {
        IS_NAME(iq4_sweep_scales_)(xt, wt, peak, s->sweep_lo, s->sweep_hi, scale);
        return;
    }
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
