/* The fast IQ4_NL / IQ4_XS search of iq4_search_cpu.c, written once and compiled three times: iq4_search_cpu.c includes
 * this file with IS_TARGET (the function attribute), IS_SUFFIX (appended to each name), IS_AVX512 and IS_AVX2 (1: the
 * AVX-512 or AVX2 intrinsics of the inner loops; both 0: their portable C form) defined. All forms take the same
 * float32 steps in the same order (products, fused multiply-adds, two partial sums per lane added last), so they give
 * the same bytes; the AVX2 form runs the rest (the loops over 16 lanes) as C compiled for AVX2.
 *
 * Layout: a group of IS_LANES (16) blocks (IQ4_NL) or super-blocks (IQ4_XS), transposed so that element k of every
 * lane is one row of 16 floats (`xt[k * 16 + lane]`): each lane runs its own search, a vector lane per block. */

#define IS_CAT2(a, b) a##b
#define IS_CAT(a, b) IS_CAT2(a, b)
#define IS_NAME(name) IS_CAT(name, IS_SUFFIX)

#if IS_AVX2
/* The AVX2 body: each group's 16 lanes as two vectors of 8 (lanes 0-7, 8-15), the same float32 operations as the other
 * bodies. Without AVX-512's two-register permutes (a 32-entry table would take four permutes and three blends per
 * lookup) the nearest code is a branch-free binary search over the 15 grid midpoints instead of the bucket rule: in the
 * sums, on 16-bit keys of two rows at once (`iq4_values2_avx2`, 1.2-1.3x the float form's speed on Zen 3,
 * docs/performance.md, issue #32, twenty-fourth session); in the codes and the sweep, in float32 (below): four
 * compares u >= midpoint, each choosing the next midpoint (a blend, then two in-register permutes of 4 and 8 entries),
 * which counts the midpoints <= u, the code the bucket rule gives for every finite u (the bucket's base counts the
 * midpoints below it, the compare the one inside it; iq4_code's rounding of u / 8 + 16 can move u into a bucket
 * only across a multiple of 8, and no midpoint lies within 2^-16 below one). As in the AVX-512 body, the block scan
 * (without refine pairs) and the three level options keep their sums and choices in registers, 8 lanes at a time
 * (`iq4_sums_avx2`), instead of a store and reload per candidate (docs/performance.md, issue #32, fourteenth
 * session). */
typedef struct {
    __m256 mid7, mid3, mid11;   /* the first two levels' midpoints */
    __m256 mids4, mids8;        /* iq4_mids[4 p + 1] (p < 4), iq4_mids[2 p] (p < 8) */
    __m256 even, odd;           /* iq4_values[2 p], iq4_values[2 p + 1] */
} iq4_tables_avx2_t;

IS_TARGET static inline iq4_tables_avx2_t iq4_load_tables_avx2(void) {
    const float *m = iq4_mids, *v = iq4_values;
    iq4_tables_avx2_t t;
    t.mid7 = _mm256_set1_ps(m[7]);
    t.mid3 = _mm256_set1_ps(m[3]);
    t.mid11 = _mm256_set1_ps(m[11]);
    t.mids4 = _mm256_setr_ps(m[1], m[5], m[9], m[13], 0.0f, 0.0f, 0.0f, 0.0f);
    t.mids8 = _mm256_setr_ps(m[0], m[2], m[4], m[6], m[8], m[10], m[12], m[14]);
    t.even = _mm256_setr_ps(v[0], v[2], v[4], v[6], v[8], v[10], v[12], v[14]);
    t.odd = _mm256_setr_ps(v[1], v[3], v[5], v[7], v[9], v[11], v[13], v[15]);
    return t;
}

/* the nearest grid index of each u is 2 pair + (odd's bits set): pair = code / 2 by three compares, odd the fourth */
IS_TARGET static inline __attribute__((always_inline)) void iq4_search_avx2(const iq4_tables_avx2_t *t, __m256 u,
                                                                           __m256i *pair, __m256 *odd) {
    const __m256 ge8 = _mm256_cmp_ps(u, t->mid7, _CMP_GE_OQ);
    __m256i p = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_castps_si256(ge8));
    const __m256 ge4 = _mm256_cmp_ps(u, _mm256_blendv_ps(t->mid3, t->mid11, ge8), _CMP_GE_OQ);
    p = _mm256_sub_epi32(_mm256_add_epi32(p, p), _mm256_castps_si256(ge4));
    const __m256 ge2 = _mm256_cmp_ps(u, _mm256_permutevar8x32_ps(t->mids4, p), _CMP_GE_OQ);
    p = _mm256_sub_epi32(_mm256_add_epi32(p, p), _mm256_castps_si256(ge2));
    *odd = _mm256_cmp_ps(u, _mm256_permutevar8x32_ps(t->mids8, p), _CMP_GE_OQ);
    *pair = p;
}

/* the nearest grid index of each u (ties to the larger value, as `iq4_code`) */
IS_TARGET static inline __attribute__((always_inline)) __m256i iq4_code_avx2(const iq4_tables_avx2_t *t, __m256 u) {
    __m256i pair;
    __m256 odd;
    iq4_search_avx2(t, u, &pair, &odd);
    return _mm256_sub_epi32(_mm256_add_epi32(pair, pair), _mm256_castps_si256(odd));
}

/* iq4_values[code] of each code in [0, 15] */
IS_TARGET static inline __attribute__((always_inline)) __m256 iq4_grid_avx2(const iq4_tables_avx2_t *t, __m256i code) {
    const __m256i pair = _mm256_srli_epi32(code, 1);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t->even, pair), _mm256_permutevar8x32_ps(t->odd, pair),
                            _mm256_castsi256_ps(_mm256_slli_epi32(code, 31)));
}

/* The sums' nearest grid values in 16-bit lanes: two rows of 8 lanes (16 weights) per compare instead of 8. Each u is
 * replaced by a 16-bit key, w = floor(k / 2^16) with k = the float's bits as +-magnitude (sign_epi32 of |bits|):
 * k is monotonic in u (strictly but for +-0), and every midpoint m (and grid value) has at most 8 significant bits,
 * so its k is a multiple of 2^16, K(m) = k(m) / 2^16 exactly, and u >= m <=> k(u) >= k(m) <=> w >= K(m): the same
 * compares as the float search, ties to the larger value included. Row k's key sits in the low half of each 32-bit
 * lane, row k + 1's in the high half; the four steps of the binary search compare w > K - 1 (cmpgt), the thresholds of
 * steps three and four read by pshufb from 16-byte tables of 16-bit entries (index bytes 2 p, 2 p + 1), and the
 * value's table holds each grid value's float32 high half (its low half is 0), so a shift or a mask of the 32-bit lane
 * gives the float q itself. u is NaN only as 0 * inf (an inverse of a subnormal peak): x86's default NaN, negative,
 * whose key is below every threshold: code 0, as the float compares (all false) give. */
typedef struct {
    __m256i abs_bits, high_half;        /* 0x7fffffff; 0xffff0000 */
    __m256i t7, t3, t11;                /* K(mid i) - 1 in every 16-bit lane */
    __m256i t4, t8;                     /* pshufb tables: K(mids[4 p + 1]) - 1 (p < 4), K(mids[2 p]) - 1 (p < 8) */
    __m256i even, odd;                  /* pshufb tables: high halves of float iq4_values[2 p], [2 p + 1] (p < 8) */
    __m256i bit2, step0, step1;         /* 0x0404, 0x0100, 0x0302 in every 16-bit lane */
    __m256i down, up;                   /* -0x0100, 0x0102 */
} iq4_keys_avx2_t;

/* K(v): the 16-bit key of a float v whose low 16 bits are 0 (a midpoint or grid value): +-(magnitude bits >> 16) */
static inline int16_t iq4_key16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    const int32_t magnitude = (int32_t)((bits & 0x7fffffffu) >> 16);
    return (int16_t)(bits >> 31 ? -magnitude : magnitude);
}

IS_TARGET static inline iq4_keys_avx2_t iq4_load_keys_avx2(void) {
    const float *m = iq4_mids;
    int16_t t4[8] = {0}, t8[8], even[8], odd[8];
    for (int p = 0; p < 8; p++) {
        if (p < 4) t4[p] = (int16_t)(iq4_key16(m[4 * p + 1]) - 1);
        t8[p] = (int16_t)(iq4_key16(m[2 * p]) - 1);
        uint32_t e, o;
        memcpy(&e, &iq4_values[2 * p], 4);
        memcpy(&o, &iq4_values[2 * p + 1], 4);
        even[p] = (int16_t)(e >> 16);
        odd[p] = (int16_t)(o >> 16);
    }
    iq4_keys_avx2_t t;
    t.abs_bits = _mm256_set1_epi32(0x7fffffff);
    t.high_half = _mm256_set1_epi32((int)0xffff0000u);
    t.t7 = _mm256_set1_epi16((int16_t)(iq4_key16(m[7]) - 1));
    t.t3 = _mm256_set1_epi16((int16_t)(iq4_key16(m[3]) - 1));
    t.t11 = _mm256_set1_epi16((int16_t)(iq4_key16(m[11]) - 1));
    t.t4 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t4));
    t.t8 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t8));
    t.even = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)even));
    t.odd = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)odd));
    t.bit2 = _mm256_set1_epi16(0x0404);
    t.step0 = _mm256_set1_epi16(0x0100);
    t.step1 = _mm256_set1_epi16(0x0302);
    t.down = _mm256_set1_epi16(-0x0100);
    t.up = _mm256_set1_epi16(0x0102);
    return t;
}

/* the grid values nearest to ua and ub (iq4_values[iq4_code(u)], 8 lanes each) in *qa, *qb: the keys above */
IS_TARGET static inline __attribute__((always_inline)) void iq4_values2_avx2(const iq4_keys_avx2_t *t, __m256 ua,
                                                                            __m256 ub, __m256 *qa, __m256 *qb) {
    const __m256i ba = _mm256_castps_si256(ua), bb = _mm256_castps_si256(ub);
    const __m256i ka = _mm256_sign_epi32(_mm256_and_si256(ba, t->abs_bits), ba);
    const __m256i kb = _mm256_sign_epi32(_mm256_and_si256(bb, t->abs_bits), bb);
    const __m256i w = _mm256_blend_epi16(_mm256_srli_epi32(ka, 16), kb, 0xaa); /* floor(k / 2^16), low: a, high: b */
    const __m256i g1 = _mm256_cmpgt_epi16(w, t->t7);
    const __m256i g2 = _mm256_cmpgt_epi16(w, _mm256_blendv_epi8(t->t3, t->t11, g1));
    /* index bytes (2 p, 2 p + 1) of step three's p = 2 g1 + g2, then of step four's 2 p + g3: doubled, the high byte
     * is one too many, so step four adds 0x0102 (g3) or -0x0100 */
    const __m256i i3 = _mm256_or_si256(_mm256_and_si256(g1, t->bit2), _mm256_blendv_epi8(t->step0, t->step1, g2));
    const __m256i g3 = _mm256_cmpgt_epi16(w, _mm256_shuffle_epi8(t->t4, i3));
    const __m256i i4 = _mm256_add_epi16(_mm256_add_epi16(i3, i3), _mm256_blendv_epi8(t->down, t->up, g3));
    const __m256i g4 = _mm256_cmpgt_epi16(w, _mm256_shuffle_epi8(t->t8, i4));
    const __m256i v = _mm256_blendv_epi8(_mm256_shuffle_epi8(t->even, i4), _mm256_shuffle_epi8(t->odd, i4), g4);
    *qa = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *qb = _mm256_castsi256_ps(_mm256_and_si256(v, t->high_half));
}

/* `iq4_sums_`'s AVX2 form for the 8 lanes from `half` at the scales 1 / vinv, its sums returned in registers (*vx,
 * *vq); rows k and k + 1's values found together (`iq4_values2_avx2`) */
IS_TARGET static inline __attribute__((always_inline)) void iq4_sums_avx2(const iq4_keys_avx2_t *t, const float *xt,
                                                                         const float *wt, int n, int half,
                                                                         __m256 vinv, __m256 *vx, __m256 *vq) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 acc_x[2] = {zero, zero}, acc_q[2] = {zero, zero};
    for (int k = 0; k < n; k += 2) {
        const __m256 x[2] = {_mm256_loadu_ps(xt + k * IS_LANES + half),
                             _mm256_loadu_ps(xt + (k + 1) * IS_LANES + half)};
        __m256 q[2];
        iq4_values2_avx2(t, _mm256_mul_ps(x[0], vinv), _mm256_mul_ps(x[1], vinv), &q[0], &q[1]);
        for (int h = 0; h < 2; h++) {
            const __m256 wq = wt ? _mm256_mul_ps(_mm256_loadu_ps(wt + (k + h) * IS_LANES + half), q[h]) : q[h];
            acc_x[h] = _mm256_fmadd_ps(wq, x[h], acc_x[h]);
            acc_q[h] = _mm256_fmadd_ps(wq, q[h], acc_q[h]);
        }
    }
    *vx = _mm256_add_ps(acc_x[0], acc_x[1]);
    *vq = _mm256_add_ps(acc_q[0], acc_q[1]);
}

/* each lane's 1 / v where v != 0, else 0 (the C loops' `v != 0.0f ? 1.0f / v : 0.0f`) */
IS_TARGET static inline __attribute__((always_inline)) __m256 iq4_inverse_avx2(__m256 v) {
    return _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), v), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ));
}
#endif

/* iq4_half: the float16 value nearest to `value`, clamped to +-65504; in the vector bodies by F16C's conversion (the
 * same rounding to nearest even, without libgcc's software conversion) */
IS_TARGET static inline float IS_NAME(iq4_half_)(float value) {
#if IS_AVX512 || IS_AVX2
    const __m128 v = _mm_set_ss(iq4_clamp(value, -65504.0f, 65504.0f));
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
#else
    return iq4_half(value);
#endif
}

/* sqx[l] = sum_k w q x and sqq[l] = sum_k w q q over rows k < n (even) of lane l, q = KVALUES[code], code the nearest
 * grid index of x * inv[l] (`iq4_code`); w = 1 when wt is NULL */
#if IS_AVX512
/* The AVX-512 nearest code of u = x / scale in three operations fewer than the bucket rule's float form (iq4_code:
 * u / 8 + 16 clamped to [0, 31] and truncated): u8 = x * (inv / 8) (the same value as u / 8: scaling by a power of
 * two is exact), its magnitude clamped below 16 by one vrangeps, and floor(u8) in [-16, 15] converted with the
 * rounding in the instruction. Its low five bits index a 32-entry table with its halves swapped (bucket
 * floor(u8) + 16) whose entries hold the bucket's midpoint / 8 in their high 16 bits and its base count in the low
 * ones: every midpoint / 8 (and +inf) is a float32 whose low 16 bits are 0 (at most 8 significant bits, twice a
 * midpoint being an integer below 256), so one permute gives both, the high half as the exact midpoint to compare
 * u8 with and the low half plus that compare as the code (bits 4-15 stay 0: a bucket with a midpoint has base <= 14;
 * a permute of iq4_values reads the low four bits, a byte conversion the low eight; `iq4_lookup_avx512_t`). The
 * bucket is the exact floor(u / 8) + 16 (the float form's rounding of u / 8 + 16 may move u into the next bucket,
 * across a multiple of 8 that no midpoint is near) or, past +-128, the end bucket the clamp gives: the same code.
 * The clamp is left out (`clamp` 0) only where no |u8| can reach 16 (`iq4_sums_sets_avx512`). */
typedef struct {
    __m512i packed_lo, packed_hi; /* bucket b: (bits of iq4_bucket_mid[b] / 8) | iq4_bucket_base[b], b = 16 .. 31,
                                   * then 0 .. 15: indexed by floor(u8) mod 32 */
    __m512i mid_bits, one;        /* 0xffff0000, 1 */
    __m512 kv, below16;           /* iq4_values; the largest float below 16 */
} iq4_lookup_avx512_t;

IS_TARGET static inline __attribute__((always_inline)) iq4_lookup_avx512_t iq4_lookup_avx512(void) {
    iq4_lookup_avx512_t t;
    const __m512 eighth = _mm512_set1_ps(0.125f);
    const __m512 mid_lo = _mm512_mul_ps(_mm512_loadu_ps(iq4_bucket_mid + 16), eighth);
    const __m512 mid_hi = _mm512_mul_ps(_mm512_loadu_ps(iq4_bucket_mid), eighth);
    t.packed_lo = _mm512_or_si512(_mm512_castps_si512(mid_lo), _mm512_loadu_si512(iq4_bucket_base + 16));
    t.packed_hi = _mm512_or_si512(_mm512_castps_si512(mid_hi), _mm512_loadu_si512(iq4_bucket_base));
    t.mid_bits = _mm512_set1_epi32((int)0xffff0000u);
    t.one = _mm512_set1_epi32(1);
    t.kv = _mm512_loadu_ps(iq4_values);
    t.below16 = _mm512_set1_ps(0x1.fffffep+3f);
    return t;
}

/* the grid index nearest to u = u8 * 8 (ties to the larger value, as `iq4_code`) in the low 8 bits of each lane
 * (above them the midpoint's bits: a permute or byte conversion reads the code); `clamp` 0 only where |u8| < 16 */
IS_TARGET static inline __attribute__((always_inline)) __m512i iq4_code8_avx512(const iq4_lookup_avx512_t *t,
                                                                               __m512 u8, int clamp) {
    /* sign of u8, min(|u8|, |below16|) */
    const __m512 clamped = clamp ? _mm512_range_ps(u8, t->below16, 0x02) : u8;
    const __m512i bucket = _mm512_cvt_roundps_epi32(clamped, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i packed = _mm512_permutex2var_epi32(t->packed_lo, bucket, t->packed_hi);
    const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(packed, t->mid_bits));
    return _mm512_mask_add_epi32(packed, _mm512_cmp_ps_mask(u8, mid, _CMP_GE_OQ), packed, t->one);
}

/* the row loop of `iq4_sums_sets_avx512` (inv8: the scales' 1 / (8 scale)) */
IS_TARGET static inline __attribute__((always_inline)) void iq4_sums_rows_avx512(const float *xt, const float *wt,
                                                                                int n, int m, int clamp,
                                                                                const __m512 *inv8, __m512 *vx,
                                                                                __m512 *vq) {
    const iq4_lookup_avx512_t t = iq4_lookup_avx512();
    const __m512 zero = _mm512_setzero_ps();
    __m512 acc_x[3][2], acc_q[3][2];
    for (int c = 0; c < m; c++) acc_x[c][0] = acc_x[c][1] = acc_q[c][0] = acc_q[c][1] = zero;
    for (int k = 0; k < n; k += 2) {
        for (int h = 0; h < 2; h++) {
            const __m512 x = _mm512_loadu_ps(xt + (k + h) * IS_LANES);
            const __m512 w = wt ? _mm512_loadu_ps(wt + (k + h) * IS_LANES) : zero;
            for (int c = 0; c < m; c++) {
                const __m512 q = _mm512_permutexvar_ps(iq4_code8_avx512(&t, _mm512_mul_ps(x, inv8[c]), clamp), t.kv);
                const __m512 wq = wt ? _mm512_mul_ps(w, q) : q;
                acc_x[c][h] = _mm512_fmadd_ps(wq, x, acc_x[c][h]);
                acc_q[c][h] = _mm512_fmadd_ps(wq, q, acc_q[c][h]);
            }
        }
    }
    for (int c = 0; c < m; c++) {
        vx[c] = _mm512_add_ps(acc_x[c][0], acc_x[c][1]);
        vq[c] = _mm512_add_ps(acc_q[c][0], acc_q[c][1]);
    }
}

/* `iq4_sums_`'s AVX-512 form for `m` (1 to 3, a constant where inlined) sets of scales 1 / vinv[c] at once, their
 * sums returned in registers (vx[c], vq[c]): each set's float32 steps as `iq4_sums_` takes them (the same two partial
 * sums per lane), the sets interleaved row by row so that their 4 m accumulator chains overlap and each row's
 * weights and importance are loaded once. `absmax`: each lane's largest |x| over the rows (NULL: unknown); where
 * every lane's |absmax| / (8 scale) rounds below 16 no |u8| does (rounding is monotonic), so the clamp is left out
 * (docs/performance.md, issue #32, sixteenth session) */
IS_TARGET static inline __attribute__((always_inline)) void iq4_sums_sets_avx512(const float *xt, const float *wt,
                                                                                int n, int m, const __m512 *vinv,
                                                                                const float *absmax, __m512 *vx,
                                                                                __m512 *vq) {
    __m512 inv8[3];
    __mmask16 unclamped = absmax ? (__mmask16)0xffff : 0;
    for (int c = 0; c < m; c++) {
        inv8[c] = _mm512_mul_ps(vinv[c], _mm512_set1_ps(0.125f));
        if (absmax)
            unclamped &= _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_loadu_ps(absmax), _mm512_abs_ps(inv8[c])),
                                            _mm512_set1_ps(16.0f), _CMP_LT_OQ);
    }
    if (unclamped == 0xffff)
        iq4_sums_rows_avx512(xt, wt, n, m, 0, inv8, vx, vq);
    else
        iq4_sums_rows_avx512(xt, wt, n, m, 1, inv8, vx, vq);
}

/* `iq4_sums_`'s AVX-512 form for the scales 1 / vinv, its sums returned in registers (*vx, *vq) */
IS_TARGET static inline __attribute__((always_inline)) void iq4_sums_avx512(const float *xt, const float *wt, int n,
                                                                           __m512 vinv, __m512 *vx, __m512 *vq) {
    iq4_sums_sets_avx512(xt, wt, n, 1, &vinv, NULL, vx, vq);
}
#endif

IS_TARGET static void IS_NAME(iq4_sums_)(const float *xt, const float *wt, int n, const float *inv, float *sqx,
                                         float *sqq) {
#if IS_AVX512
    __m512 vx, vq;
    iq4_sums_avx512(xt, wt, n, _mm512_loadu_ps(inv), &vx, &vq);
    _mm512_storeu_ps(sqx, vx);
    _mm512_storeu_ps(sqq, vq);
#elif IS_AVX2
    const iq4_keys_avx2_t t = iq4_load_keys_avx2();
    for (int half = 0; half < IS_LANES; half += 8) {
        __m256 vx, vq;
        iq4_sums_avx2(&t, xt, wt, n, half, _mm256_loadu_ps(inv + half), &vx, &vq);
        _mm256_storeu_ps(sqx + half, vx);
        _mm256_storeu_ps(sqq + half, vq);
    }
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
    const iq4_lookup_avx512_t t = iq4_lookup_avx512();
    const __m512 inv8 = _mm512_mul_ps(_mm512_loadu_ps(inv), _mm512_set1_ps(0.125f));
    for (int k = 0; k < n; k++) {
        const __m512i code = iq4_code8_avx512(&t, _mm512_mul_ps(_mm512_loadu_ps(xt + k * IS_LANES), inv8), 1);
        _mm_storeu_si128((__m128i *)(codes + k * IS_LANES), _mm512_cvtepi32_epi8(code));
    }
#elif IS_AVX2
    const iq4_tables_avx2_t t = iq4_load_tables_avx2();
    const __m256 inv_lo = _mm256_loadu_ps(inv), inv_hi = _mm256_loadu_ps(inv + 8);
    for (int k = 0; k < n; k++) {
        const __m256i lo = iq4_code_avx2(&t, _mm256_mul_ps(_mm256_loadu_ps(xt + k * IS_LANES), inv_lo));
        const __m256i hi = iq4_code_avx2(&t, _mm256_mul_ps(_mm256_loadu_ps(xt + k * IS_LANES + 8), inv_hi));
        const __m128i lo16 = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        const __m128i hi16 = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128((__m128i *)(codes + k * IS_LANES), _mm_packus_epi16(lo16, hi16));
    }
#else
    for (int k = 0; k < n; k++)
        for (int l = 0; l < IS_LANES; l++) codes[k * IS_LANES + l] = (uint8_t)iq4_code(xt[k * IS_LANES + l] * inv[l]);
#endif
}

/* per lane the element of largest magnitude among rows k < n (the first on ties), with its sign */
IS_TARGET static void IS_NAME(iq4_lane_peaks_)(const float *xt, int n, float *peak) {
#if IS_AVX512
    if (n % 4 == 0) { /* four chains over consecutive quarters, merged in order: the earlier one kept on ties; the
                       * first starts at row 0 as the loop below (kept even if NaN), the others at |x| = -1 (no row:
                       * a NaN is never taken, as below) */
        const int quarter = n / 4;
        __m512 p[4], a[4];
        p[0] = _mm512_loadu_ps(xt);
        a[0] = _mm512_abs_ps(p[0]);
#pragma GCC unroll 4
        for (int c = 1; c < 4; c++) {
            p[c] = p[0];
            a[c] = _mm512_set1_ps(-1.0f);
        }
        for (int k = 0; k < quarter; k++) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                if (k == 0 && c == 0) continue;
                const __m512 v = _mm512_loadu_ps(xt + (c * quarter + k) * IS_LANES), av = _mm512_abs_ps(v);
                const __mmask16 larger = _mm512_cmp_ps_mask(av, a[c], _CMP_GT_OQ);
                p[c] = _mm512_mask_mov_ps(p[c], larger, v);
                a[c] = _mm512_mask_mov_ps(a[c], larger, av);
            }
        }
#pragma GCC unroll 2
        for (int c = 0; c < 4; c += 2) {
            const __mmask16 larger = _mm512_cmp_ps_mask(a[c + 1], a[c], _CMP_GT_OQ);
            p[c] = _mm512_mask_mov_ps(p[c], larger, p[c + 1]);
            a[c] = _mm512_mask_mov_ps(a[c], larger, a[c + 1]);
        }
        _mm512_storeu_ps(peak, _mm512_mask_mov_ps(p[0], _mm512_cmp_ps_mask(a[2], a[0], _CMP_GT_OQ), p[2]));
        return;
    }
#endif
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
#elif IS_AVX2
    const iq4_tables_avx2_t t = iq4_load_tables_avx2();
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), vfixed = _mm256_set1_ps(fixed);
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 mids_lo = _mm256_loadu_ps(iq4_mids), mids_hi = _mm256_loadu_ps(iq4_mids + 8);
    const __m256i onei = _mm256_set1_epi32(1), fifteen = _mm256_set1_epi32(15), zeroi = _mm256_setzero_si256();
    const __m256i none = _mm256_set1_epi32(IS_SWEEP_NONE);
    for (int half = 0; half < IS_LANES; half += 8) {
        const __m256 vends = _mm256_loadu_ps(ends + half);
        __m256 vx = zero, vq = zero;
        for (int i = 0; i < 32; i++) {
            const __m256 x = _mm256_loadu_ps(xt + i * IS_LANES + half), a = _mm256_mul_ps(x, vends);
            const __m256 w = wt ? _mm256_loadu_ps(wt + i * IS_LANES + half) : one;
            __m256i code = iq4_code_avx2(&t, _mm256_mul_ps(a, vlo));
            __m256 q = iq4_grid_avx2(&t, code);
            const __m256 wq = _mm256_mul_ps(w, q);
            vx = _mm256_add_ps(vx, _mm256_mul_ps(wq, x));
            vq = _mm256_add_ps(vq, _mm256_mul_ps(wq, q));
            const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(a, zero, _CMP_GT_OQ));
            const __m256i down = _mm256_castps_si256(_mm256_cmp_ps(a, zero, _CMP_LT_OQ));
            __m256i valid = _mm256_or_si256(up, down);
            const __m256 inv_a = _mm256_and_ps(_mm256_div_ps(one, a), _mm256_castsi256_ps(valid));
            for (int c = 0; c < 2; c++) {
                const __m256i inward = _mm256_or_si256(_mm256_and_si256(up, _mm256_cmpgt_epi32(fifteen, code)),
                                                       _mm256_and_si256(down, _mm256_cmpgt_epi32(code, zeroi)));
                valid = _mm256_and_si256(valid, inward);
                const __m256i next =
                    _mm256_blendv_epi8(_mm256_add_epi32(code, onei), _mm256_sub_epi32(code, onei), down);
                const __m256i mid_index = _mm256_blendv_epi8(code, next, down);
                const __m256 mid = _mm256_blendv_ps(_mm256_permutevar8x32_ps(mids_lo, mid_index),
                                                    _mm256_permutevar8x32_ps(mids_hi, mid_index),
                                                    _mm256_castsi256_ps(_mm256_slli_epi32(mid_index, 28)));
                const __m256 at = _mm256_mul_ps(mid, inv_a);
                valid = _mm256_and_si256(valid, _mm256_castps_si256(_mm256_cmp_ps(at, vhi, _CMP_LE_OQ)));
                const __m256 q2 = iq4_grid_avx2(&t, next), mask = _mm256_castsi256_ps(valid);
                const __m256 ddx = _mm256_mul_ps(_mm256_mul_ps(w, _mm256_sub_ps(q2, q)), x);
                const __m256 ddq = _mm256_mul_ps(w, _mm256_sub_ps(_mm256_mul_ps(q2, q2), _mm256_mul_ps(q, q)));
                const __m256 offset = _mm256_max_ps(_mm256_sub_ps(at, vlo), zero);
                const __m256i position =
                    _mm256_slli_epi32(_mm256_cvttps_epi32(_mm256_mul_ps(offset, vfixed)), IS_SWEEP_SHIFT);
                const __m256i key = _mm256_or_si256(_mm256_blendv_epi8(none, position, valid),
                                                    _mm256_set1_epi32(2 * i + c));
                const int r = (2 * i + c) * IS_LANES + half;
                _mm256_storeu_si256((__m256i *)(keys + r), key);
                _mm256_storeu_ps(dx + r, _mm256_and_ps(mask, ddx));
                _mm256_storeu_ps(dq + r, _mm256_and_ps(mask, ddq));
                code = _mm256_blendv_epi8(code, next, valid);
                q = _mm256_blendv_ps(q, q2, mask);
            }
        }
        _mm256_storeu_ps(sqx + half, vx);
        _mm256_storeu_ps(sqq + half, vq);
    }
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
#elif IS_AVX2
                    for (int h = 0; h < IS_LANES; h += 8) {
                        const __m256i a = _mm256_load_si256((const __m256i *)(lo_row + h));
                        const __m256i c = _mm256_load_si256((const __m256i *)(hi_row + h));
                        _mm256_store_si256((__m256i *)(lo_row + h), _mm256_min_epu32(a, c));
                        _mm256_store_si256((__m256i *)(hi_row + h), _mm256_max_epu32(a, c));
                    }
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
#elif IS_AVX2 /* as the AVX-512 form, 8 lanes at a time: the gathered differences of lanes past their last key are 0 */
    const __m256i row_mask = _mm256_set1_epi32((1 << IS_SWEEP_SHIFT) - 1), none = _mm256_set1_epi32(IS_SWEEP_NONE);
    for (int half = 0; half < IS_LANES; half += 8) {
        const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32(half), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 x = _mm256_loadu_ps(sqx + half), q = _mm256_loadu_ps(sqq + half);
        __m256 bx = _mm256_loadu_ps(best_x + half), bq = _mm256_loadu_ps(best_q + half);
        __m256 better = first ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                              : _mm256_cmp_ps(_mm256_mul_ps(_mm256_mul_ps(x, x), bq),
                                              _mm256_mul_ps(_mm256_mul_ps(bx, bx), q), _CMP_GT_OQ);
        bx = _mm256_blendv_ps(bx, x, better);
        bq = _mm256_blendv_ps(bq, q, better);
        __m256i key = _mm256_loadu_si256((const __m256i *)(keys + half));
        for (int r = 0; r < IS_SWEEP_ROWS; r++) {
            if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(key, none), key)) == -1) break;
            const __m256i index = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(key, row_mask), 4), lanes);
            x = _mm256_add_ps(x, _mm256_i32gather_ps(dx, index, 4));
            q = _mm256_add_ps(q, _mm256_i32gather_ps(dq, index, 4));
            __m256 last = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            if (r + 1 < IS_SWEEP_ROWS) {
                const __m256i next = _mm256_loadu_si256((const __m256i *)(keys + (r + 1) * IS_LANES + half));
                const __m256i same = _mm256_cmpeq_epi32(_mm256_srli_epi32(next, IS_SWEEP_SHIFT),
                                                        _mm256_srli_epi32(key, IS_SWEEP_SHIFT));
                last = _mm256_xor_ps(last, _mm256_castsi256_ps(same)); /* the last key of its position */
                key = next;
            }
            better = _mm256_and_ps(last, _mm256_cmp_ps(_mm256_mul_ps(_mm256_mul_ps(x, x), bq),
                                                       _mm256_mul_ps(_mm256_mul_ps(bx, bx), q), _CMP_GT_OQ));
            bx = _mm256_blendv_ps(bx, x, better);
            bq = _mm256_blendv_ps(bq, q, better);
        }
        _mm256_storeu_ps(best_x + half, bx);
        _mm256_storeu_ps(best_q + half, bq);
    }
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
 * compared cross-multiplied, the first kept on ties); absmax: each lane's largest |x| (the block's |peak|) */
IS_TARGET static void IS_NAME(iq4_block_scales_)(const float *xt, const float *wt, const iq4_search_t *s,
                                                 float *scale, float *absmax) {
    float peak[IS_LANES], inv[IS_LANES], sqx[IS_LANES], sqq[IS_LANES], best_x[IS_LANES], best_q[IS_LANES];
    float target[IS_LANES], centre[IS_LANES], tried[IS_LANES];
    IS_NAME(iq4_lane_peaks_)(xt, 32, peak);
    for (int l = 0; l < IS_LANES; l++) absmax[l] = fabsf(peak[l]);
    if (s->sweep_hi > 0.0f) {
        IS_NAME(iq4_sweep_scales_)(xt, wt, peak, s->sweep_lo, s->sweep_hi, scale);
        return;
    }
#if IS_AVX512
    if (s->refine == 0) { /* the scan alone, in registers: the same float32 steps as below */
        const __m512 vpeak = _mm512_loadu_ps(peak), zero = _mm512_setzero_ps();
        const __m512 inv_peak =
            _mm512_maskz_div_ps(_mm512_cmp_ps_mask(vpeak, zero, _CMP_NEQ_OQ), _mm512_set1_ps(1.0f), vpeak);
        __m512 bx = zero, bq = zero;
        for (int c = 0; c < s->ntargets; c += 2) { /* two targets' sums at once, then kept in order */
            __m512 vinv[2], x[2], q[2];
            for (int i = 0; i < 2 && c + i < s->ntargets; i++)
                vinv[i] = _mm512_mul_ps(_mm512_set1_ps(s->targets[c + i]), inv_peak);
            if (c + 1 < s->ntargets)
                iq4_sums_sets_avx512(xt, wt, 32, 2, vinv, absmax, x, q);
            else
                iq4_sums_sets_avx512(xt, wt, 32, 1, vinv, absmax, x, q);
            for (int i = 0; i < 2 && c + i < s->ntargets; i++) {
                const __mmask16 better =
                    c + i == 0 ? (__mmask16)0xffff
                               : _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_mul_ps(x[i], x[i]), bq),
                                                    _mm512_mul_ps(_mm512_mul_ps(bx, bx), q[i]), _CMP_GT_OQ);
                bx = _mm512_mask_mov_ps(bx, better, x[i]);
                bq = _mm512_mask_mov_ps(bq, better, q[i]);
            }
        }
        _mm512_storeu_ps(scale, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(bq, zero, _CMP_GT_OQ), bx, bq));
        return;
    }
#elif IS_AVX2
    if (s->refine == 0) { /* the same scan in registers, 8 lanes at a time */
        const iq4_keys_avx2_t t = iq4_load_keys_avx2();
        const __m256 zero = _mm256_setzero_ps();
        for (int half = 0; half < IS_LANES; half += 8) {
            const __m256 inv_peak = iq4_inverse_avx2(_mm256_loadu_ps(peak + half));
            __m256 bx = zero, bq = zero;
            for (int c = 0; c < s->ntargets; c++) {
                __m256 x, q;
                iq4_sums_avx2(&t, xt, wt, 32, half, _mm256_mul_ps(_mm256_set1_ps(s->targets[c]), inv_peak), &x, &q);
                const __m256 better =
                    c == 0 ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                           : _mm256_cmp_ps(_mm256_mul_ps(_mm256_mul_ps(x, x), bq),
                                           _mm256_mul_ps(_mm256_mul_ps(bx, bx), q), _CMP_GT_OQ);
                bx = _mm256_blendv_ps(bx, x, better);
                bq = _mm256_blendv_ps(bq, q, better);
            }
            _mm256_storeu_ps(scale + half,
                             _mm256_and_ps(_mm256_div_ps(bx, bq), _mm256_cmp_ps(bq, zero, _CMP_GT_OQ)));
        }
        return;
    }
#endif
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

#if IS_AVX512
/* `iq4_xs_level_option_` for o = -1, 0, 1 in that order (the first kept outright), in registers: the same float32
 * steps, so the same choices, without a store and reload of every option's sums and choice */
IS_TARGET static void IS_NAME(iq4_xs_level_options3_)(const float *xb, const float *wb, const float *absmax,
                                                      const float *d, const float *base, float *best, float *level,
                                                      float *sx, float *sq) {
    const __m512 zero = _mm512_setzero_ps(), vd = _mm512_loadu_ps(d), vbase = _mm512_loadu_ps(base);
    __m512 vl[3], vdl[3], vinv[3];
    for (int o = 0; o < 3; o++) {
        vl[o] = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(vbase, _mm512_set1_ps((float)(o - 1))),
                                            _mm512_set1_ps(-32.0f)),
                              _mm512_set1_ps(31.0f));
        vdl[o] = _mm512_mul_ps(vd, vl[o]);
        const __mmask16 nonzero = _mm512_cmp_ps_mask(vdl[o], zero, _CMP_NEQ_OQ);
        vinv[o] = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), vdl[o]);
    }
    __m512 vbest = zero, vlevel = zero, vsx = zero, vsq = zero, vx[3], vq[3];
    iq4_sums_sets_avx512(xb, wb, 32, 3, vinv, absmax, vx, vq);
    for (int o = 0; o < 3; o++) {
        const __m512 x = vx[o], q = vq[o];
        const __m512 e = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(vdl[o], vdl[o]), q),
                                       _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), vdl[o]), x));
        const __mmask16 keep = o == 0 ? (__mmask16)0xffff : _mm512_cmp_ps_mask(e, vbest, _CMP_LT_OQ);
        vbest = _mm512_mask_mov_ps(vbest, keep, e);
        vlevel = _mm512_mask_mov_ps(vlevel, keep, vl[o]);
        vsx = _mm512_mask_mov_ps(vsx, keep, x);
        vsq = _mm512_mask_mov_ps(vsq, keep, q);
    }
    _mm512_storeu_ps(best, vbest);
    _mm512_storeu_ps(level, vlevel);
    _mm512_storeu_ps(sx, vsx);
    _mm512_storeu_ps(sq, vsq);
}
#elif IS_AVX2
/* the AVX2 form of the AVX-512 body's `iq4_xs_level_options3_`: the same float32 steps, 8 lanes at a time */
IS_TARGET static void IS_NAME(iq4_xs_level_options3_)(const float *xb, const float *wb, const float *absmax,
                                                      const float *d, const float *base, float *best, float *level,
                                                      float *sx, float *sq) {
    const iq4_keys_avx2_t t = iq4_load_keys_avx2();
    const __m256 lo = _mm256_set1_ps(-32.0f), hi = _mm256_set1_ps(31.0f), two = _mm256_set1_ps(2.0f);
    for (int half = 0; half < IS_LANES; half += 8) {
        const __m256 vd = _mm256_loadu_ps(d + half), vbase = _mm256_loadu_ps(base + half);
        __m256 vbest = _mm256_setzero_ps(), vlevel = vbest, vsx = vbest, vsq = vbest;
        for (int o = 0; o < 3; o++) {
            const __m256 shifted = _mm256_add_ps(vbase, _mm256_set1_ps((float)(o - 1)));
            const __m256 vl = _mm256_min_ps(_mm256_max_ps(shifted, lo), hi);
            const __m256 vdl = _mm256_mul_ps(vd, vl);
            __m256 x, q;
            iq4_sums_avx2(&t, xb, wb, 32, half, iq4_inverse_avx2(vdl), &x, &q);
            const __m256 e = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(vdl, vdl), q),
                                           _mm256_mul_ps(_mm256_mul_ps(two, vdl), x));
            const __m256 keep =
                o == 0 ? _mm256_castsi256_ps(_mm256_set1_epi32(-1)) : _mm256_cmp_ps(e, vbest, _CMP_LT_OQ);
            vbest = _mm256_blendv_ps(vbest, e, keep);
            vlevel = _mm256_blendv_ps(vlevel, vl, keep);
            vsx = _mm256_blendv_ps(vsx, x, keep);
            vsq = _mm256_blendv_ps(vsq, q, keep);
        }
        _mm256_storeu_ps(best + half, vbest);
        _mm256_storeu_ps(level + half, vlevel);
        _mm256_storeu_ps(sx + half, vsx);
        _mm256_storeu_ps(sq + half, vsq);
    }
}
#endif

/* for super-block scales d (per lane), each block's best of the `s->level_options` 6-bit levels nearest to
 * scale / d: levels, sums (sqx, sqq of the chosen codes) and the super-block's error less sum w x^2 (err) */
IS_TARGET static void IS_NAME(iq4_xs_levels_)(const float *xt, const float *wt, const iq4_search_t *s,
                                              const float *scales, const float *absmax, const float *d,
                                              float *levels, float *lsx, float *lsq, float *err) {
    float base[8][IS_LANES], best[8][IS_LANES];
    for (int l = 0; l < IS_LANES; l++) err[l] = 0.0f;
#if IS_AVX512 /* iq4_round's steps on 16 lanes */
    const __m512 vd = _mm512_loadu_ps(d), magic = _mm512_set1_ps(12582912.0f);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(vd, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    for (int j = 0; j < 8; j++) {
        const __m512 v = _mm512_maskz_div_ps(nonzero, _mm512_loadu_ps(scales + j * IS_LANES), vd);
        const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(4194304.0f), _CMP_LT_OQ);
        _mm512_storeu_ps(base[j], _mm512_mask_mov_ps(v, small, _mm512_sub_ps(_mm512_add_ps(v, magic), magic)));
    }
#else
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < IS_LANES; l++) base[j][l] = d[l] != 0.0f ? iq4_round(scales[j * IS_LANES + l] / d[l]) : 0;
#endif
    const int first = -(s->level_options / 2), last = s->level_options / 2;
    for (int j = 0; j < 8; j++) {
        const float *xb = xt + j * 32 * IS_LANES, *wb = wt ? wt + j * 32 * IS_LANES : NULL;
#if IS_AVX512 || IS_AVX2
        if (s->level_options == 3) {
            IS_NAME(iq4_xs_level_options3_)(xb, wb, absmax + j * IS_LANES, d, base[j], best[j], levels + j * IS_LANES,
                                            lsx + j * IS_LANES, lsq + j * IS_LANES);
            continue;
        }
#endif
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
#if IS_AVX512 /* iq4_half_'s and the refit's float32 steps on 16 lanes */
    const __m512 lo = _mm512_set1_ps(-65504.0f), hi = _mm512_set1_ps(65504.0f);
    __m512 v;
    __mmask16 fit = 0xffff;
    if (c < 2 * s->nsuper) {
        const float end = c < s->nsuper ? -32.0f : 31.0f, f = s->super_factors[c % s->nsuper];
        v = _mm512_div_ps(_mm512_div_ps(_mm512_loadu_ps(peak), _mm512_set1_ps(end)), _mm512_set1_ps(f));
    } else {
        __m512 num = _mm512_setzero_ps(), den = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++) {
            const __m512 level = _mm512_loadu_ps(levels + j * IS_LANES);
            num = _mm512_add_ps(num, _mm512_mul_ps(level, _mm512_loadu_ps(sx + j * IS_LANES)));
            den = _mm512_add_ps(den, _mm512_mul_ps(_mm512_mul_ps(level, level), _mm512_loadu_ps(sq + j * IS_LANES)));
        }
        fit = _mm512_cmp_ps_mask(den, _mm512_setzero_ps(), _CMP_GT_OQ);
        v = _mm512_div_ps(num, den);
    }
    const __m512 half =
        _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_min_ps(_mm512_max_ps(v, lo), hi), _MM_FROUND_TO_NEAREST_INT));
    _mm512_storeu_ps(d, fit == 0xffff ? half : _mm512_mask_mov_ps(_mm512_loadu_ps(d_kept), fit, half));
    return;
#endif
    if (c < 2 * s->nsuper) {
        const float end = c < s->nsuper ? -32.0f : 31.0f, f = s->super_factors[c % s->nsuper];
        for (int l = 0; l < IS_LANES; l++) d[l] = IS_NAME(iq4_half_)(peak[l] / end / f);
        return;
    }
    for (int l = 0; l < IS_LANES; l++) {
        float num = 0.0f, den = 0.0f;
        for (int j = 0; j < 8; j++) {
            const float level = levels[j * IS_LANES + l];
            num += level * sx[j * IS_LANES + l];
            den += level * level * sq[j * IS_LANES + l];
        }
        d[l] = den > 0.0f ? IS_NAME(iq4_half_)(num / den) : d_kept[l];
    }
}

/* per lane, where err is below best (or when `first`): best = err, d_out = d and the lane's 8 levels and sums */
IS_TARGET static void IS_NAME(iq4_xs_keep_)(int first, const float *d, const float *err, const float *levels,
                                            const float *lsx, const float *lsq, float *best, float *d_out,
                                            float *levels_out, float *best_sx, float *best_sq) {
#if IS_AVX512
    const __m512 e = _mm512_loadu_ps(err); /* best is read only after the first candidate wrote it */
    const __mmask16 keep = first ? (__mmask16)0xffff : _mm512_cmp_ps_mask(e, _mm512_loadu_ps(best), _CMP_LT_OQ);
    _mm512_mask_storeu_ps(best, keep, e);
    _mm512_mask_storeu_ps(d_out, keep, _mm512_loadu_ps(d));
    for (int j = 0; j < 8; j++) {
        const int r = j * IS_LANES;
        _mm512_mask_storeu_ps(levels_out + r, keep, _mm512_loadu_ps(levels + r));
        _mm512_mask_storeu_ps(best_sx + r, keep, _mm512_loadu_ps(lsx + r));
        _mm512_mask_storeu_ps(best_sq + r, keep, _mm512_loadu_ps(lsq + r));
    }
    return;
#endif
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
    float scales[8 * IS_LANES], absmax[8 * IS_LANES], levels[8 * IS_LANES], lsx[8 * IS_LANES], lsq[8 * IS_LANES];
    float best_sx[8 * IS_LANES], best_sq[8 * IS_LANES], peak[IS_LANES], d[IS_LANES], err[IS_LANES], best[IS_LANES];
    for (int j = 0; j < 8; j++)
        IS_NAME(iq4_block_scales_)(xt + j * 32 * IS_LANES, wt ? wt + j * 32 * IS_LANES : NULL, s,
                                   scales + j * IS_LANES, absmax + j * IS_LANES);
    IS_NAME(iq4_lane_peaks_)(scales, 8, peak);
    for (int c = 0; c < 2 * s->nsuper + s->rounds; c++) {
        IS_NAME(iq4_xs_candidate_)(s, c, peak, levels_out, best_sx, best_sq, d_out, d);
        IS_NAME(iq4_xs_levels_)(xt, wt, s, scales, absmax, d, levels, lsx, lsq, err);
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
    float absmax[IS_LANES];
    IS_NAME(iq4_block_scales_)(xt, wt, s, scale, absmax);
    IS_NAME(iq4_lane_peaks_)(xt, 32, peak);
    for (int c = -1; c <= s->rounds; c++) {
        float d[IS_LANES];
        for (int l = 0; l < IS_LANES; l++) {
            d[l] = IS_NAME(iq4_half_)(c < 0 ? peak[l] / -127.0f : scale[l]);
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
#elif IS_AVX2 /* 8 x 8 tiles: unpacks of 32-bit pairs, shuffles of 64-bit pairs, then the 128-bit halves */
    for (int k0 = 0; k0 < size; k0 += 8)
        for (int l0 = 0; l0 < IS_LANES; l0 += 8) {
            __m256 r[8], t[8];
            for (int l = 0; l < 8; l++) r[l] = _mm256_loadu_ps(src + (int64_t)(l0 + l) * size + k0);
            for (int l = 0; l < 8; l += 2) {
                t[l] = _mm256_unpacklo_ps(r[l], r[l + 1]); /* per half: rows l, l + 1 at columns 0, 1 (4, 5) */
                t[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]); /* columns 2, 3 (6, 7) */
            }
            for (int g = 0; g < 8; g += 4) /* r[g + c]: rows g .. g + 3 at column c (low half), c + 4 (high) */
                for (int h = 0; h < 2; h++) {
                    r[g + 2 * h] = _mm256_shuffle_ps(t[g + h], t[g + 2 + h], 0x44);
                    r[g + 2 * h + 1] = _mm256_shuffle_ps(t[g + h], t[g + 2 + h], 0xee);
                }
            for (int c = 0; c < 4; c++) {
                _mm256_storeu_ps(xt + (k0 + c) * IS_LANES + l0, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
                _mm256_storeu_ps(xt + (k0 + 4 + c) * IS_LANES + l0, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
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
#if IS_AVX512 /* per block j, the 16 x 16 bytes (row i: qs byte 16 j + i of every lane) transposed in registers */
    /* Q_d (d < 4): dword i = row i's bytes of lanes 4 d .. 4 d + 3, from P_m (rows 4 m .. 4 m + 3, one per 128 bits);
     * then per 128 bits byte 4 b + r = byte 4 r + b, and dword 4 b + t = dword 4 t + b: part b = lane 4 d + b's rows */
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    for (int j = 0; j < 8; j++) {
        __m512i rows[4];
        for (int m = 0; m < 4; m++) {
            const __m512i lo = _mm512_loadu_si512(codes + (j * 32 + 4 * m) * IS_LANES);
            const __m512i hi = _mm512_loadu_si512(codes + (j * 32 + 16 + 4 * m) * IS_LANES);
            rows[m] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)); /* codes < 16: no bit crosses a byte */
        }
        for (int d = 0; d < 4 && 4 * d < count; d++) {
            const __m512i index = _mm512_add_epi32(pick, _mm512_set1_epi32(d));
            const __m512i q = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(rows[0], index, rows[1]),
                                                      _mm512_permutex2var_epi32(rows[2], index, rows[3]));
            const __m512i lanes = _mm512_permutexvar_epi32(dwords, _mm512_shuffle_epi8(q, bytes));
            uint8_t *at = out + (int64_t)4 * d * 136 + 8 + 16 * j;
            if (4 * d + 0 < count) _mm_storeu_si128((__m128i *)at, _mm512_castsi512_si128(lanes));
            if (4 * d + 1 < count) _mm_storeu_si128((__m128i *)(at + 136), _mm512_extracti32x4_epi32(lanes, 1));
            if (4 * d + 2 < count) _mm_storeu_si128((__m128i *)(at + 272), _mm512_extracti32x4_epi32(lanes, 2));
            if (4 * d + 3 < count) _mm_storeu_si128((__m128i *)(at + 408), _mm512_extracti32x4_epi32(lanes, 3));
        }
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
