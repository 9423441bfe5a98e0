/*
 * hfquant's block quantizers in C: the same searches as the torch codecs, step for step in float32 with the same
 * constants and tie rules, blocks split over OpenMP threads:
 * - k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; hfquant/core/blocks/kquants.py `_quantize_affine`, `_quantize_symmetric`),
 *   one super-block of 256 weights at a time (`hfquant_kquant_quantize`);
 * - Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL, one block of 32 at a time, and IQ4_XS, one super-block of 256
 *   (legacy.py `fit_symmetric`, `fit_affine`; iq4.py `_fit_super_block`; `hfquant_block_quantize`).
 * - hfquant's own HQ3_0, one block of 32 at a time (hq3.py `quantize_hq3_0`; `hfquant_hq3_quantize`).
 *
 * Every sum accumulates in double and rounds once to float32 here and in the torch codecs (`kquants._sum`,
 * `legacy._sum`), so the bytes are the torch codecs' (tests/ops/test_native_blocks.py). Portable C, no intrinsics.
 */
#pragma GCC optimize("fp-contract=off") /* no fused multiply-adds: torch rounds each product */
#pragma GCC optimize("no-trapping-math") /* lets float compares become selects in vectorized loops; same values */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "hfquant_kernels.h"

#define QK_K 256

static inline float to_half(float value) {
    if (value > 65504.0f) value = 65504.0f;
    if (value < -65504.0f) value = -65504.0f;
    return (float)(_Float16)value;
}

static inline uint16_t half_bits(float value) {
    _Float16 h = (_Float16)value;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

static inline float safe(float value) { return value == 0.0f ? 1.0f : value; }

static inline float clampf(float value, float lo, float hi) { return value < lo ? lo : (value > hi ? hi : value); }

/* round half to even, as torch.round (and nearbyintf in the default rounding mode) without a libm call: adding and
 * subtracting 1.5 * 2**23 rounds any |value| < 2**22 to an integer in float32; larger values are integers already */
static inline float rnd(float value) {
    const float magic = 12582912.0f;
    return fabsf(value) < 4194304.0f ? (value + magic) - magic : value;
}

/* Sums of float32 terms accumulate in double over LANES independent chains (block lengths are multiples of LANES),
 * then round once to float32: exact in all but freak cases, so independent of the order, as the torch codec's
 * float64 sums (`kquants._sum`), which makes the two take the same decisions. */
#define LANES 8
static inline double lanes_sum(const double *acc) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* the float32 sum of n (a multiple of LANES) terms, accumulated in double */
static inline float sum_terms(const float *terms, int n) {
    double acc[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += terms[i + l];
    return (float)lanes_sum(acc);
}

/* clampf(rnd(value), lo, hi) for integers lo, hi with |lo|, |hi| < 2**21, branch free: clamping first to [lo - 1,
 * hi + 1] gives the same result and keeps the value where the 1.5 * 2**23 trick rounds */
static inline float round_clamped(float value, float lo, float hi) {
    const float magic = 12582912.0f;
    value = value < lo - 1.0f ? lo - 1.0f : value;
    value = value > hi + 1.0f ? hi + 1.0f : value;
    value = (value + magic) - magic;
    value = value < lo ? lo : value;
    return value > hi ? hi : value;
}

/* index of the first element of largest magnitude */
static int extreme_index(const float *x, int n) {
    int best = 0;
    float amax = fabsf(x[0]);
    for (int i = 1; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            best = i;
        }
    }
    return best;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* affine blocks: x ~ s * q - o, q in [0, nmax] */

static float codes_affine(const float *x, const float *w, int n, float scale, float offset, int nmax, float *codes) {
    float terms[32], inv = safe(scale), top = (float)nmax;
    if (scale == 0.0f) {
        for (int i = 0; i < n; i++) codes[i] = 0.0f;
    } else {
        for (int i = 0; i < n; i++) codes[i] = round_clamped((x[i] + offset) / inv, 0.0f, top);
    }
    for (int i = 0; i < n; i++) {
        float diff = scale * codes[i] - offset - x[i];
        terms[i] = w[i] * diff * diff;
    }
    return sum_terms(terms, n);
}

static void lstsq_affine(const float *x, const float *w, const float *codes, int n, float *scale_out,
                         float *offset_out) {
    double sw_[LANES] = {0}, sl_[LANES] = {0}, sl2_[LANES] = {0}, sx_[LANES] = {0}, slx_[LANES] = {0};
    for (int i = 0; i < n; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            float wl = w[i + l] * codes[i + l];
            sw_[l] += w[i + l];
            sl_[l] += wl;
            sl2_[l] += wl * codes[i + l];
            sx_[l] += w[i + l] * x[i + l];
            slx_[l] += wl * x[i + l];
        }
    }
    float sw = (float)lanes_sum(sw_), sl = (float)lanes_sum(sl_), sl2 = (float)lanes_sum(sl2_);
    float sx = (float)lanes_sum(sx_), slx = (float)lanes_sum(slx_);
    float det = sw * sl2 - sl * sl;
    float scale = (sw * slx - sx * sl) / safe(det);
    float offset = -(sl2 * sx - sl * slx) / safe(det);
    int clipped = offset < 0 || det <= 0;
    if (clipped) {
        scale = slx / safe(sl2);
        offset = 0.0f;
    }
    if (scale < 0) scale = 0.0f;
    if (sl2 == 0) {
        offset = -sx / safe(sw);
        if (offset < 0) offset = 0.0f;
        scale = 0.0f;
    }
    *scale_out = scale;
    *offset_out = offset;
}

static void fit_affine(const float *x, const float *w, int n, int nmax, const float *factors, int nfactors,
                       float *scale_out, float *offset_out) {
    float codes[32];
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    if (lo > 0) lo = 0.0f;
    float inv_span = 1.0f / safe(hi - lo);
    float best_s = 0, best_o = 0, best_err = 0;
    for (int f = 0; f < nfactors; f++) {
        float step = inv_span * factors[f];
        for (int i = 0; i < n; i++) codes[i] = clampf(rnd((x[i] - lo) * step), 0.0f, (float)nmax);
        float s = 0, o = 0, err = 0;
        for (int it = 0; it < 2; it++) {
            lstsq_affine(x, w, codes, n, &s, &o);
            err = codes_affine(x, w, n, s, o, nmax, codes);
        }
        if (f == 0 || err < best_err) {
            best_s = s;
            best_o = o;
            best_err = err;
        }
    }
    *scale_out = best_s;
    *offset_out = best_o;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* symmetric blocks: x ~ s * q, q in [qmin, qmax], s signed */

static float codes_symmetric(const float *x, const float *w, int n, float scale, int qmin, int qmax, float *codes) {
    float terms[16], inv = safe(scale), lo = (float)qmin, hi = (float)qmax;
    if (scale == 0.0f) {
        for (int i = 0; i < n; i++) codes[i] = 0.0f;
    } else {
        for (int i = 0; i < n; i++) codes[i] = round_clamped(x[i] / inv, lo, hi);
    }
    for (int i = 0; i < n; i++) {
        float diff = scale * codes[i] - x[i];
        terms[i] = w[i] * diff * diff;
    }
    return sum_terms(terms, n);
}

static float lstsq_symmetric(const float *x, const float *w, const float *codes, int n) {
    double slx[LANES] = {0}, sl2[LANES] = {0};
    for (int i = 0; i < n; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            float wl = w[i + l] * codes[i + l];
            slx[l] += wl * x[i + l];
            sl2[l] += wl * codes[i + l];
        }
    }
    return (float)lanes_sum(slx) / safe((float)lanes_sum(sl2));
}

static float fit_symmetric(const float *x, const float *w, int n, int qmin, int qmax, const double *factors,
                           int nfactors) {
    float codes[16];
    float inv_extreme = 1.0f / safe(x[extreme_index(x, n)]);
    float best_s = 0, best_err = 0;
    int first = 1;
    for (int f = 0; f < nfactors; f++) {
        for (int e = 0; e < 2; e++) {
            int end = e == 0 ? qmin : qmax;
            float step = inv_extreme * (float)(end * factors[f]);
            for (int i = 0; i < n; i++) codes[i] = clampf(rnd(x[i] * step), (float)qmin, (float)qmax);
            float s = 0, err = 0;
            for (int it = 0; it < 2; it++) {
                s = lstsq_symmetric(x, w, codes, n);
                err = codes_symmetric(x, w, n, s, qmin, qmax, codes);
            }
            if (first || err < best_err) {
                best_s = s;
                best_err = err;
                first = 0;
            }
        }
    }
    return best_s;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* step 2: float16 super-block scale and integer block scales */

static float round_scales(const float *values, const float *sensitivity, int nsub, int top, int lowest,
                          const double *tries, int ntries, float *q_out) {
    float q[16];
    int index = extreme_index(values, nsub);
    float extreme = values[index], amax = fabsf(extreme);
    float best_d = 0, best_err = 0;
    int first = 1;
    int nends = lowest == 0 ? 1 : 2;
    for (int e = 0; e < nends; e++) {
        int end = e == 0 ? top : lowest;
        for (int t = 0; t < ntries; t++) {
            float d = to_half(extreme / (float)(end + (end > 0 ? tries[t] : -tries[t])));
            float inv = safe(d);
            double err_ = 0;
            for (int j = 0; j < nsub; j++) {
                q[j] = clampf(rnd(values[j] / inv), (float)lowest, (float)top);
                float diff = values[j] - d * q[j];
                err_ += sensitivity[j] * (diff * diff);
            }
            float err = (float)err_;
            if (first || err < best_err) {
                best_d = d;
                best_err = err;
                memcpy(q_out, q, sizeof(float) * nsub);
                first = 0;
            }
        }
    }
    if (amax == 0) {
        best_d = 0;
        for (int j = 0; j < nsub; j++) q_out[j] = 0;
    }
    return best_d;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* one super-block, steps 1-3 */

typedef struct {
    int sub, nmax, top, lowest, qmin, qmax, symmetric;
} kparams;

static void quantize_affine(const float *x, const float *w, const kparams *p, const float *factors, int nfactors,
                            const double *tries, int ntries, int rounds, float *codes, float *sc, float *m, float *d_out,
                            float *dmin_out) {
    int sub = p->sub, nsub = QK_K / sub, nmax = p->nmax, top = p->top;
    float scale[16], offset[16], sens[16], wsum[16], err[16], new_codes[QK_K], new_err[16];
    for (int j = 0; j < nsub; j++) {
        const float *xb = x + j * sub, *wb = w + j * sub;
        fit_affine(xb, wb, sub, nmax, factors, nfactors, &scale[j], &offset[j]);
        codes_affine(xb, wb, sub, scale[j], offset[j], nmax, codes + j * sub);
        double s = 0, sw = 0;
        for (int i = 0; i < sub; i++) {
            s += wb[i] * codes[j * sub + i] * codes[j * sub + i];
            sw += wb[i];
        }
        sens[j] = (float)s;
        wsum[j] = (float)sw;
    }
    float d = round_scales(scale, sens, nsub, top, 0, tries, ntries, sc);
    float dmin = round_scales(offset, wsum, nsub, top, 0, tries, ntries, m);
    double total = 0;
    for (int j = 0; j < nsub; j++) {
        err[j] = codes_affine(x + j * sub, w + j * sub, sub, d * sc[j], dmin * m[j], nmax, codes + j * sub);
        total += err[j];
    }
    for (int r = 0; r < rounds; r++) {
        double saa_ = 0, sab_ = 0, sbb_ = 0, sax_ = 0, sbx_ = 0;
        for (int j = 0; j < nsub; j++) {
            for (int i = 0; i < sub; i++) {
                int k = j * sub + i;
                float a = sc[j] * codes[k], b = m[j], wa = w[k] * a, wb = w[k] * b;
                saa_ += wa * a;
                sab_ += wa * b;
                sbb_ += wb * b;
                sax_ += wa * x[k];
                sbx_ += wb * x[k];
            }
        }
        float saa = (float)saa_, sab = (float)sab_, sbb = (float)sbb_, sax = (float)sax_, sbx = (float)sbx_;
        float det = saa * sbb - sab * sab;
        float new_d = to_half((sax * sbb - sab * sbx) / safe(det));
        float new_dmin = to_half((sab * sax - saa * sbx) / safe(det));
        if (!(det > 0 && new_d >= 0 && new_dmin >= 0)) {
            new_d = d;
            new_dmin = dmin;
        }
        double new_total = 0;
        for (int j = 0; j < nsub; j++) {
            new_err[j] = codes_affine(x + j * sub, w + j * sub, sub, new_d * sc[j], new_dmin * m[j], nmax,
                                      new_codes + j * sub);
            new_total += new_err[j];
        }
        if ((float)new_total < (float)total) {
            d = new_d;
            dmin = new_dmin;
            memcpy(codes, new_codes, sizeof(float) * QK_K);
            memcpy(err, new_err, sizeof(float) * nsub);
        }
        for (int j = 0; j < nsub; j++) {
            const float *xb = x + j * sub, *wb = w + j * sub;
            float s, o, trial[32];
            lstsq_affine(xb, wb, codes + j * sub, sub, &s, &o);
            float base_sc = rnd(s / safe(d)), base_m = rnd(o / safe(dmin));
            for (int dsc = -1; dsc <= 1; dsc++) {
                for (int dm = -1; dm <= 1; dm++) {
                    float try_sc = clampf(base_sc + dsc, 0.0f, (float)top), try_m = clampf(base_m + dm, 0.0f, (float)top);
                    float e = codes_affine(xb, wb, sub, d * try_sc, dmin * try_m, nmax, trial);
                    if (e < err[j]) {
                        sc[j] = try_sc;
                        m[j] = try_m;
                        err[j] = e;
                        memcpy(codes + j * sub, trial, sizeof(float) * sub);
                    }
                }
            }
        }
        total = 0;
        for (int j = 0; j < nsub; j++) total += err[j];
    }
    *d_out = d;
    *dmin_out = dmin;
}

static void quantize_symmetric(const float *x, const float *w, const kparams *p, const double *factors, int nfactors,
                               const double *tries, int ntries, int rounds, float *codes, float *sc, float *d_out) {
    int qmin = p->qmin, qmax = p->qmax, lowest = p->lowest, top = p->top;
    float scale[16], sens[16], err[16], new_codes[QK_K], new_err[16];
    for (int j = 0; j < 16; j++) {
        const float *xb = x + j * 16, *wb = w + j * 16;
        scale[j] = fit_symmetric(xb, wb, 16, qmin, qmax, factors, nfactors);
        codes_symmetric(xb, wb, 16, scale[j], qmin, qmax, codes + j * 16);
        double s = 0;
        for (int i = 0; i < 16; i++) s += wb[i] * codes[j * 16 + i] * codes[j * 16 + i];
        sens[j] = (float)s;
    }
    float d = round_scales(scale, sens, 16, top, lowest, tries, ntries, sc);
    double total = 0;
    for (int j = 0; j < 16; j++) {
        err[j] = codes_symmetric(x + j * 16, w + j * 16, 16, d * sc[j], qmin, qmax, codes + j * 16);
        total += err[j];
    }
    for (int r = 0; r < rounds; r++) {
        double sax = 0, saa = 0;
        for (int k = 0; k < QK_K; k++) {
            float a = sc[k / 16] * codes[k], wa = w[k] * a;
            sax += wa * x[k];
            saa += wa * a;
        }
        float new_d = to_half((float)sax / safe((float)saa));
        double new_total = 0;
        for (int j = 0; j < 16; j++) {
            new_err[j] = codes_symmetric(x + j * 16, w + j * 16, 16, new_d * sc[j], qmin, qmax, new_codes + j * 16);
            new_total += new_err[j];
        }
        if ((float)new_total < (float)total) {
            d = new_d;
            memcpy(codes, new_codes, sizeof(float) * QK_K);
            memcpy(err, new_err, sizeof(float) * 16);
        }
        for (int j = 0; j < 16; j++) {
            const float *xb = x + j * 16, *wb = w + j * 16;
            float trial[16];
            float base = rnd(lstsq_symmetric(xb, wb, codes + j * 16, 16) / safe(d));
            for (int step = -1; step <= 1; step++) {
                float try_sc = clampf(base + step, (float)lowest, (float)top);
                float e = codes_symmetric(xb, wb, 16, d * try_sc, qmin, qmax, trial);
                if (e < err[j]) {
                    sc[j] = try_sc;
                    err[j] = e;
                    memcpy(codes + j * 16, trial, sizeof(float) * 16);
                }
            }
        }
        total = 0;
        for (int j = 0; j < 16; j++) total += err[j];
    }
    *d_out = d;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* byte layouts (kquants.py's module docstring) */

static void put_half(uint8_t *out, float value) {
    uint16_t bits = half_bits(value);
    out[0] = bits & 255;
    out[1] = bits >> 8;
}

/* code plane: `groups` groups, 8 / bits codes per byte; bits s*bits of byte j of group h: code h*per*w + s*w + j */
static void pack_plane(const uint8_t *codes, int ncodes, int groups, int bits, uint8_t *out) {
    int per = 8 / bits, nbytes = ncodes * bits / 8, width = nbytes / groups;
    for (int h = 0; h < groups; h++) {
        for (int j = 0; j < width; j++) {
            uint8_t byte = 0;
            for (int s = 0; s < per; s++) byte |= (uint8_t)(codes[h * per * width + s * width + j] << (s * bits));
            out[h * width + j] = byte;
        }
    }
}

static void pack_scales_k4(const float *sc, const float *m, uint8_t *out) {
    for (int i = 0; i < 4; i++) {
        uint8_t s_lo = (uint8_t)sc[i], s_hi = (uint8_t)sc[4 + i], m_lo = (uint8_t)m[i], m_hi = (uint8_t)m[4 + i];
        out[i] = s_lo | (uint8_t)((s_hi >> 4) << 6);
        out[4 + i] = m_lo | (uint8_t)((m_hi >> 4) << 6);
        out[8 + i] = (s_hi & 15) | (uint8_t)((m_hi & 15) << 4);
    }
}

static void write_block(int type, const float *codes, const float *sc, const float *m, float d, float dmin,
                        uint8_t *out) {
    uint8_t c[QK_K], part[QK_K];
    switch (type) {
    case 10: /* q2_k */
        for (int k = 0; k < QK_K; k++) c[k] = (uint8_t)codes[k];
        for (int j = 0; j < 16; j++) out[j] = (uint8_t)sc[j] | (uint8_t)((uint8_t)m[j] << 4);
        pack_plane(c, QK_K, 2, 2, out + 16);
        put_half(out + 80, d);
        put_half(out + 82, dmin);
        break;
    case 11: /* q3_k */
        for (int k = 0; k < QK_K; k++) c[k] = (uint8_t)(codes[k] + 4);
        for (int k = 0; k < QK_K; k++) part[k] = c[k] >> 2;
        pack_plane(part, QK_K, 1, 1, out);
        for (int k = 0; k < QK_K; k++) part[k] = c[k] & 3;
        pack_plane(part, QK_K, 2, 2, out + 32);
        {
            uint8_t stored[16];
            for (int j = 0; j < 16; j++) stored[j] = (uint8_t)(sc[j] + 32);
            for (int i = 0; i < 8; i++) out[96 + i] = (stored[i] & 15) | (uint8_t)((stored[8 + i] & 15) << 4);
            for (int k = 0; k < 4; k++) {
                uint8_t byte = 0;
                for (int i = 0; i < 4; i++) byte |= (uint8_t)((stored[4 * i + k] >> 4) << (2 * i));
                out[104 + k] = byte;
            }
        }
        put_half(out + 108, d);
        break;
    case 12: /* q4_k */
        for (int k = 0; k < QK_K; k++) c[k] = (uint8_t)codes[k];
        put_half(out, d);
        put_half(out + 2, dmin);
        pack_scales_k4(sc, m, out + 4);
        pack_plane(c, QK_K, 4, 4, out + 16);
        break;
    case 13: /* q5_k */
        for (int k = 0; k < QK_K; k++) c[k] = (uint8_t)codes[k];
        put_half(out, d);
        put_half(out + 2, dmin);
        pack_scales_k4(sc, m, out + 4);
        for (int k = 0; k < QK_K; k++) part[k] = c[k] >> 4;
        pack_plane(part, QK_K, 1, 1, out + 16);
        for (int k = 0; k < QK_K; k++) part[k] = c[k] & 15;
        pack_plane(part, QK_K, 4, 4, out + 48);
        break;
    case 14: /* q6_k */
        for (int k = 0; k < QK_K; k++) c[k] = (uint8_t)(codes[k] + 32);
        for (int k = 0; k < QK_K; k++) part[k] = c[k] & 15;
        pack_plane(part, QK_K, 2, 4, out);
        for (int k = 0; k < QK_K; k++) part[k] = c[k] >> 4;
        pack_plane(part, QK_K, 2, 2, out + 128);
        for (int j = 0; j < 16; j++) out[192 + j] = (uint8_t)(int8_t)sc[j];
        put_half(out + 208, d);
        break;
    }
}

/* kquants.py's constants: _TRIES, _ROUNDS, _affine_factors(nmax), _SYMMETRIC_FACTORS */
static int type_params(int type, kparams *p, int *type_size) {
    switch (type) {
    case 10: *p = (kparams){16, 3, 15, 0, 0, 0, 0}; *type_size = 84; return 0;
    case 11: *p = (kparams){16, 0, 31, -32, -4, 3, 1}; *type_size = 110; return 0;
    case 12: *p = (kparams){32, 15, 63, 0, 0, 0, 0}; *type_size = 144; return 0;
    case 13: *p = (kparams){32, 31, 63, 0, 0, 0, 0}; *type_size = 176; return 0;
    case 14: *p = (kparams){16, 0, 127, -128, -32, 31, 1}; *type_size = 210; return 0;
    default: return 1;
    }
}

/*
 * Quantize `nblocks` super-blocks of 256 float32 weights `x` (with `w` each element's weight in the squared error,
 * NULL for all 1; `w_period` > 0: w repeats every w_period super-blocks, a (K,) importance over rows of K weights) into
 * ggml type `type` (10..14: Q2_K..Q6_K), `out` nblocks * type_size bytes. Returns 0, or 1 for an unknown type.
 */
int hfquant_kquant_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, int type,
                            uint8_t *out) {
    kparams p;
    int type_size;
    if (type_params(type, &p, &type_size)) return 1;
    double tries[9];
    for (int i = 0; i < 9; i++) tries[i] = (i - 4) / 4.0;
    double sym_factors[11];
    for (int i = 0; i < 11; i++) sym_factors[i] = 0.8 + 0.04 * i;
    float affine_factors[16];
    for (int i = 0; i < 16; i++) affine_factors[i] = (float)(p.nmax - 2 + 0.2 * i);
#pragma omp parallel for schedule(dynamic, 16)
    for (int64_t b = 0; b < nblocks; b++) {
        float ones[QK_K], codes[QK_K], sc[16], m[16] = {0}, d = 0, dmin = 0;
        const float *xb = x + b * QK_K;
        const float *wb;
        if (w == NULL) {
            for (int k = 0; k < QK_K; k++) ones[k] = 1.0f;
            wb = ones;
        } else {
            wb = w + (w_period > 0 ? b % w_period : b) * QK_K;
        }
        if (p.symmetric)
            quantize_symmetric(xb, wb, &p, sym_factors, 11, tries, 9, 2, codes, sc, &d);
        else
            quantize_affine(xb, wb, &p, affine_factors, 16, tries, 9, 2, codes, sc, m, &d, &dmin);
        write_block(type, codes, sc, m, d, dmin, out + b * type_size);
    }
    return 0;
}

/* ================================================================================================================ */
/* The 32-weight block types (legacy.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; iq4.py: IQ4_NL, and IQ4_XS's super-blocks of
 * eight such blocks): the same search as the torch codecs (`legacy.fit_symmetric`, `legacy.fit_affine`,
 * `iq4._fit_super_block`), step for step in float32, sums accumulated in double and rounded once (`legacy._sum`). */

#define QK 32

/* the values a code stands for, sorted: a uniform integer range, or IQ4_NL's 16-value table */
typedef struct {
    int n, uniform;
    float low, high;
    float values[256];
    float mids[16], steps[16]; /* non-uniform grids: midpoints and differences of neighbouring values */
} grid_t;

static const float kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void grid_uniform(grid_t *g, int low, int count) {
    g->n = count;
    g->uniform = 1;
    g->low = (float)low;
    g->high = (float)(low + count - 1);
    for (int i = 0; i < count; i++) g->values[i] = (float)(low + i);
}

/* hfquant's HQ3_NL grid (hq3.py `NL_VALUES`): 8 values with an exact zero */
static const float kvalues_hq3nl[8] = {-127, -87, -56, -29, 0, 29, 58, 94};

/* a non-uniform grid of n (<= 16) sorted values */
static void grid_table(grid_t *g, const float *values, int n) {
    g->n = n;
    g->uniform = 0;
    g->low = values[0];
    g->high = values[n - 1];
    for (int i = 0; i < n; i++) g->values[i] = values[i];
    for (int i = 0; i < n - 1; i++) {
        g->mids[i] = (values[i + 1] + values[i]) / 2;
        g->steps[i] = values[i + 1] - values[i];
    }
}

static void grid_iq4(grid_t *g) { grid_table(g, kvalues_iq4nl, 16); }

/* floor(value) for |value| < 2**22 in the default rounding mode, without a libm call and vectorizable */
static inline float floor_small(float value) {
    const float magic = 12582912.0f;
    float r = (value + magic) - magic;
    return r > value ? r - 1.0f : r;
}

/* q[i] = `Grid.nearest(x[i] * inv)`, the grid value nearest to x[i] * inv (ties to the larger value), computed without
 * a table lookup so that the loops vectorize: a uniform grid rounds and clamps (the clamp to [low - 1, high + 1] first
 * gives the same floor(u + 0.5) and keeps u where `floor_small` is exact); the IQ4 grid adds the step to the next value
 * for every midpoint not above u (torch.bucketize(right=True)), exact in float32 (small integers) */
static inline __attribute__((always_inline)) void nearest_values(const grid_t *g, const float *x, float inv, float *q) {
    if (g->uniform) {
        const float lo = g->low, hi = g->high;
        for (int i = 0; i < QK; i++) {
            float u = x[i] * inv;
            u = u < lo - 1.0f ? lo - 1.0f : u;
            u = u > hi + 1.0f ? hi + 1.0f : u;
            float t = floor_small(u + 0.5f);
            t = t < lo ? lo : t;
            q[i] = t > hi ? hi : t;
        }
    } else if (g->n == 16) { /* IQ4_NL: a constant trip count */
        float u[QK];
        for (int i = 0; i < QK; i++) {
            u[i] = x[i] * inv;
            q[i] = kvalues_iq4nl[0];
        }
        for (int k = 0; k < 15; k++) {
            const float mid = g->mids[k], step = g->steps[k];
            for (int i = 0; i < QK; i++) q[i] += u[i] >= mid ? step : 0.0f;
        }
    } else {
        float u[QK];
        for (int i = 0; i < QK; i++) {
            u[i] = x[i] * inv;
            q[i] = g->low;
        }
        for (int k = 0; k < g->n - 1; k++) {
            const float mid = g->mids[k], step = g->steps[k];
            for (int i = 0; i < QK; i++) q[i] += u[i] >= mid ? step : 0.0f;
        }
    }
}

/* the index of grid value v (for the bytes) */
static inline int grid_index_of(const grid_t *g, float v) {
    if (g->uniform) return (int)(v - g->low);
    int k = 0;
    while (k < g->n - 1 && g->values[k] != v) k++;
    return k;
}

static inline float fp16_round(float value) { return (float)(_Float16)value; } /* `_fp16`: inf past 65504 */

static inline float inverse_or_zero(float value) { return value != 0.0f ? 1.0f / value : 0.0f; }

/* the float32 sum of 32 terms accumulated in double */
static inline float sum32(const float *terms) { return sum_terms(terms, QK); }

/* grid values q nearest to x / d and their weighted squared error sum w (x - d q)^2 */
static float nearest_codes(const float *x, const float *w, const grid_t *g, float d, float *q) {
    float terms[QK];
    nearest_values(g, x, inverse_or_zero(d), q);
    for (int i = 0; i < QK; i++) {
        float diff = x[i] - d * q[i];
        terms[i] = w[i] * (diff * diff);
    }
    return sum32(terms);
}

/* `legacy.fit_symmetric` for one block (rounds: float16 rounding / code choice / refit rounds); best_q the grid values */
static float fit_block_symmetric(const float *x, const float *w, const grid_t *g, const float *targets, int ntargets,
                                 float seed, int rounds, float *best_q) {
    float peak = x[extreme_index(x, QK)];
    float best_gain = 0.0f, best_scale = 0.0f, q[QK], a[QK], b[QK];
    for (int c = 0; c < ntargets; c++) {
        float scale = peak / targets[c];
        nearest_values(g, x, inverse_or_zero(scale), q);
        for (int i = 0; i < QK; i++) {
            float wq = w[i] * q[i];
            a[i] = wq * x[i];
            b[i] = wq * q[i];
        }
        float sqx = sum32(a), sqq = sum32(b);
        float gain = sqq != 0.0f ? (sqx * sqx) / sqq : 0.0f;
        if (c == 0 || gain > best_gain) {
            best_gain = gain;
            best_scale = sqq != 0.0f ? sqx / sqq : 0.0f;
        }
    }
    float best_d = fp16_round(seed);
    float best_err = nearest_codes(x, w, g, best_d, best_q);
    float d = fp16_round(best_scale);
    for (int r = 0; r < rounds; r++) {
        float err = nearest_codes(x, w, g, d, q);
        if (err < best_err) {
            best_err = err;
            best_d = d;
            memcpy(best_q, q, sizeof(q));
        }
        if (r == rounds - 1) break; /* the torch codec's last refit is never used */
        for (int i = 0; i < QK; i++) {
            float wq = w[i] * q[i];
            b[i] = wq * q[i];
            a[i] = wq * x[i];
        }
        float sqx = sum32(a), sqq = sum32(b);
        d = fp16_round(sqq > 0.0f ? sqx / sqq : d);
    }
    return best_d;
}

/* `legacy._affine_least_squares`: (d, m) minimizing sum w (d q + m - x)^2 */
static void affine_least_squares(const float *x, const float *w, const float *q, float *d_out, float *m_out) {
    float t1[QK], t2[QK], t3[QK], t4[QK];
    for (int i = 0; i < QK; i++) {
        float wq = w[i] * q[i];
        t1[i] = wq;
        t2[i] = wq * q[i];
        t3[i] = w[i] * x[i];
        t4[i] = wq * x[i];
    }
    float s0 = sum32(w), s1 = sum32(t1), s2 = sum32(t2), tx = sum32(t3), tqx = sum32(t4);
    float det = s0 * s2 - s1 * s1;
    int flat = det <= 1e-12f * s0 * s2;
    *d_out = flat ? 0.0f : (det != 0.0f ? (s0 * tqx - s1 * tx) / det : 0.0f);
    *m_out = flat ? (s0 != 0.0f ? tx / s0 : 0.0f) : (det != 0.0f ? (s2 * tx - s1 * tqx) / det : 0.0f);
}

/* `fit_affine`'s codes: floor((x - m) / d + 0.5) in [0, nmax], and the weighted error of d q + m */
static float affine_codes(const float *x, const float *w, float d, float m, int nmax, float *q) {
    float inv = inverse_or_zero(d), top = (float)nmax, terms[QK];
    for (int i = 0; i < QK; i++) {
        float u = (x[i] - m) * inv + 0.5f;
        u = u < -1.0f ? -1.0f : u;
        u = u > top + 1.0f ? top + 1.0f : u;
        float c = floor_small(u);
        c = c < 0.0f ? 0.0f : c;
        c = c > top ? top : c;
        float diff = x[i] - (d * c + m);
        q[i] = c;
        terms[i] = w[i] * (diff * diff);
    }
    return sum32(terms);
}

static float affine_error(const float *x, const float *w, float d, float m, const float *q) {
    float terms[QK];
    for (int i = 0; i < QK; i++) {
        float diff = x[i] - (d * q[i] + m);
        terms[i] = w[i] * (diff * diff);
    }
    return sum32(terms);
}

/* `legacy.fit_affine` for one block: shrink (S) cuts, S * S candidate ranges, then `rounds` rounds */
static void fit_block_affine(const float *x, const float *w, int nmax, const float *shrink, int nshrink, int rounds,
                             float *d_out, float *m_out, float *best_q) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < QK; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    float span = hi - lo, q[QK];
    float d = 0.0f, m = 0.0f, best_cand_err = 0.0f;
    for (int a = 0; a < nshrink; a++) {
        for (int b = 0; b < nshrink; b++) {
            float c_lo = lo + shrink[a] * span;
            float c_d = (span - (shrink[a] + shrink[b]) * span) / (float)nmax;
            float cd, cm;
            affine_codes(x, w, c_d, c_lo, nmax, q);
            affine_least_squares(x, w, q, &cd, &cm);
            float err = affine_error(x, w, cd, cm, q);
            if ((a == 0 && b == 0) || err < best_cand_err) {
                best_cand_err = err;
                d = cd;
                m = cm;
            }
        }
    }
    float best_d = fp16_round((hi - lo) / (float)nmax), best_m = fp16_round(lo);
    float best_err = affine_codes(x, w, best_d, best_m, nmax, best_q);
    for (int r = 0; r < rounds; r++) {
        d = fp16_round(d);
        m = fp16_round(m);
        float err = affine_codes(x, w, d, m, nmax, q);
        if (err < best_err) {
            best_err = err;
            best_d = d;
            best_m = m;
            memcpy(best_q, q, sizeof(q));
        }
        if (r == rounds - 1) break;
        affine_least_squares(x, w, q, &d, &m);
    }
    *d_out = best_d;
    *m_out = best_m;
}

/* --- IQ4_XS: `iq4._best_levels` and `iq4._fit_super_block` --- */

/* for super-block scale d, each block's best of the three 6-bit levels around scales / d: levels (8), codes (256),
 * returns the super-block's weighted error */
static float best_levels(const float *x, const float *w, const grid_t *g, float d, const float *scales, float *levels,
                         float *values) {
    float inv_d = inverse_or_zero(d), errs[LANES];
    for (int j = 0; j < 8; j++) {
        float base = rnd(scales[j] * inv_d), best = 0.0f, q[QK];
        for (int o = -1; o <= 1; o++) {
            float level = clampf(base + (float)o, -32.0f, 31.0f);
            float err = nearest_codes(x + j * QK, w + j * QK, g, d * level, q);
            if (o == -1 || err < best) {
                best = err;
                levels[j] = level;
                memcpy(values + j * QK, q, sizeof(q));
            }
        }
        errs[j] = best;
    }
    return sum_terms(errs, 8);
}

/* `iq4._fit_super_block`: d, levels (8) and the grid values (256) of one super-block */
static void fit_super_block(const float *x, const float *w, const grid_t *g, const float *targets, int ntargets,
                            const float *super_factors, int nsuper, int rounds, float *d_out, float *levels_out,
                            float *values_out) {
    float scales[8], levels[8], values[QK_K], a[QK_K], b[QK_K];
    for (int j = 0; j < 8; j++) {
        const float *xb = x + j * QK;
        float seed = xb[extreme_index(xb, QK)] / g->low;
        scales[j] = fit_block_symmetric(xb, w + j * QK, g, targets, ntargets, seed, 3, values);
    }
    float peak = scales[extreme_index(scales, 8)];
    float best_d = 0.0f, best_err = 0.0f;
    for (int e = 0; e < 2; e++) {
        for (int c = 0; c < nsuper; c++) {
            float d = fp16_round((e == 0 ? peak / -32.0f : peak / 31.0f) / super_factors[c]);
            float err = best_levels(x, w, g, d, scales, levels, values);
            if ((e == 0 && c == 0) || err < best_err) {
                best_err = err;
                best_d = d;
                memcpy(levels_out, levels, sizeof(levels));
                memcpy(values_out, values, sizeof(values));
            }
        }
    }
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < QK_K; k++) {
            float q = levels_out[k / QK] * values_out[k], wq = w[k] * q;
            a[k] = wq * q;
            b[k] = wq * x[k];
        }
        float sqq = sum_terms(a, QK_K), sqx = sum_terms(b, QK_K);
        float d = fp16_round(sqq > 0.0f ? sqx / sqq : best_d);
        float err = best_levels(x, w, g, d, scales, levels, values);
        if (err < best_err) {
            best_err = err;
            best_d = d;
            memcpy(levels_out, levels, sizeof(levels));
            memcpy(values_out, values, sizeof(values));
        }
    }
    *d_out = best_d;
}

/* --- bytes (legacy.py's and iq4.py's module docstrings) --- */

static void put_nibbles(const uint8_t *codes, uint8_t *out) {
    for (int j = 0; j < 16; j++) out[j] = (uint8_t)((codes[j] & 15) | ((codes[j + 16] & 15) << 4));
}

static void put_high_bits(const uint8_t *codes, uint8_t *out) {
    uint32_t qh = 0;
    for (int j = 0; j < QK; j++) qh |= (uint32_t)((codes[j] >> 4) & 1) << j;
    for (int b = 0; b < 4; b++) out[b] = (uint8_t)(qh >> (8 * b));
}

static int block_type_size(int type) {
    switch (type) {
    case 2: return 18;   /* q4_0 */
    case 3: return 20;   /* q4_1 */
    case 6: return 22;   /* q5_0 */
    case 7: return 24;   /* q5_1 */
    case 8: return 34;   /* q8_0 */
    case 20: return 18;  /* iq4_nl */
    case 23: return 136; /* iq4_xs */
    default: return 0;
    }
}

/*
 * Quantize `nblocks` blocks of float32 weights `x` (32 per block; 256 for IQ4_XS) into ggml type `type` (2, 3, 6, 7,
 * 8: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; 20: IQ4_NL; 23: IQ4_XS), `out` nblocks * type_size bytes. `w`: each element's
 * weight in the squared error, NULL for all 1; `w_period` > 0: w repeats every w_period blocks (a (K,) importance).
 * `params`: the symmetric types' candidate targets (legacy.py: grid ends times the factors, both ends), the affine
 * types' shrink fractions; `params2`: IQ4_XS's super-block factors. Returns 0, or 1 for an unknown type.
 */
int hfquant_block_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, int type,
                           const float *params, int64_t nparams, const float *params2, int64_t nparams2,
                           uint8_t *out) {
    int type_size = block_type_size(type);
    if (!type_size) return 1;
    int affine = type == 3 || type == 7, nmax = type == 3 ? 15 : 31, size = type == 23 ? QK_K : QK;
    grid_t grid;
    if (type == 20 || type == 23)
        grid_iq4(&grid);
    else if (type == 8)
        grid_uniform(&grid, -128, 256);
    else
        grid_uniform(&grid, type == 2 ? -8 : -16, type == 2 ? 16 : 32);
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t b = 0; b < nblocks; b++) {
        float ones[QK_K], q[QK_K];
        uint8_t idx[QK_K];
        const float *xb = x + b * size;
        const float *wb;
        uint8_t *o = out + b * type_size;
        if (w == NULL) {
            for (int k = 0; k < size; k++) ones[k] = 1.0f;
            wb = ones;
        } else {
            wb = w + (w_period > 0 ? b % w_period : b) * size;
        }
        if (affine) {
            float d, m;
            fit_block_affine(xb, wb, nmax, params, (int)nparams, 3, &d, &m, q);
            for (int k = 0; k < QK; k++) idx[k] = (uint8_t)q[k];
            put_half(o, d);
            put_half(o + 2, m);
            if (type == 7) put_high_bits(idx, o + 4);
            put_nibbles(idx, o + (type == 7 ? 8 : 4));
        } else if (type == 23) {
            float d, levels[8];
            fit_super_block(xb, wb, &grid, params, (int)nparams, params2, (int)nparams2, 2, &d, levels, q);
            for (int k = 0; k < QK_K; k++) idx[k] = (uint8_t)grid_index_of(&grid, q[k]);
            uint16_t high = 0;
            uint8_t ls[8];
            for (int j = 0; j < 8; j++) {
                ls[j] = (uint8_t)(levels[j] + 32.0f);
                high |= (uint16_t)(((ls[j] >> 4) & 3) << (2 * j));
            }
            put_half(o, d);
            o[2] = (uint8_t)(high & 255);
            o[3] = (uint8_t)(high >> 8);
            for (int j = 0; j < 4; j++) o[4 + j] = (uint8_t)((ls[2 * j] & 15) | ((ls[2 * j + 1] & 15) << 4));
            for (int j = 0; j < 8; j++) put_nibbles(idx + j * QK, o + 8 + 16 * j);
        } else {
            float seed = type == 8 ? fabsf(xb[extreme_index(xb, QK)]) / 127.0f : xb[extreme_index(xb, QK)] / grid.low;
            float d = fit_block_symmetric(xb, wb, &grid, params, (int)nparams, seed, 3, q);
            for (int k = 0; k < QK; k++) idx[k] = (uint8_t)grid_index_of(&grid, q[k]);
            put_half(o, d);
            if (type == 8)
                for (int k = 0; k < QK; k++) o[2 + k] = (uint8_t)(int8_t)(idx[k] - 128);
            else if (type == 6) {
                put_high_bits(idx, o + 2);
                put_nibbles(idx, o + 6);
            } else
                put_nibbles(idx, o + 2);
        }
    }
    return 0;
}

/* --- HQ3_0, hfquant's own 3-bit blocks (hq3.py's module docstring): d f16, qs[8] (bits 0-1 of code j at bits
 * 2 (j / 8), 2 (j / 8) + 1 of qs[j % 8]), qh[4] (bit 2 of code j at bit j of the little-endian uint32) --- */

static void put_hq3_codes(const uint8_t *codes, uint8_t *out) {
    uint32_t qh = 0;
    for (int l = 0; l < 8; l++) {
        uint8_t byte = 0;
        for (int i = 0; i < 4; i++) byte |= (uint8_t)((codes[8 * i + l] & 3) << (2 * i));
        out[l] = byte;
    }
    for (int j = 0; j < QK; j++) qh |= (uint32_t)((codes[j] >> 2) & 1) << j;
    for (int b = 0; b < 4; b++) out[8 + b] = (uint8_t)(qh >> (8 * b));
}

/*
 * Quantize `nblocks` blocks of 32 float32 weights `x` into HQ3_0 (`out`: nblocks * 14 bytes), the search of
 * `hq3.quantize_hq3_0` (`legacy.fit_symmetric` on the grid -4..3, seed: the largest-magnitude weight at -4). `w`: each
 * element's weight in the squared error, NULL for all 1; `w_period` > 0: w repeats every w_period blocks. `targets`:
 * the candidate targets (both grid ends times hq3's factors). Returns 0.
 */
static void hq3_quantize(const grid_t *g, const float *x, const float *w, int64_t w_period, int64_t nblocks,
                         const float *targets, int64_t ntargets, uint8_t *out) {
    const grid_t grid = *g;
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t b = 0; b < nblocks; b++) {
        float ones[QK], q[QK];
        uint8_t idx[QK];
        const float *xb = x + b * QK;
        const float *wb = ones;
        if (w == NULL)
            for (int k = 0; k < QK; k++) ones[k] = 1.0f;
        else
            wb = w + (w_period > 0 ? b % w_period : b) * QK;
        float seed = xb[extreme_index(xb, QK)] / grid.low;
        float d = fit_block_symmetric(xb, wb, &grid, targets, (int)ntargets, seed, 3, q);
        for (int k = 0; k < QK; k++) idx[k] = (uint8_t)grid_index_of(&grid, q[k]);
        uint8_t *o = out + b * 14;
        put_half(o, d);
        put_hq3_codes(idx, o + 2);
    }
}

int hfquant_hq3_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, const float *targets,
                         int64_t ntargets, uint8_t *out) {
    grid_t grid;
    grid_uniform(&grid, -4, 8);
    hq3_quantize(&grid, x, w, w_period, nblocks, targets, ntargets, out);
    return 0;
}

/* HQ3_NL (`hq3.quantize_hq3_nl`): HQ3_0's bytes and search, codes on the grid `kvalues_hq3nl` (seed: the
 * largest-magnitude weight at -127). Arguments as `hfquant_hq3_quantize`'s. Returns 0. */
int hfquant_hq3_nl_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, const float *targets,
                            int64_t ntargets, uint8_t *out) {
    grid_t grid;
    grid_table(&grid, kvalues_hq3nl, 8);
    hq3_quantize(&grid, x, w, w_period, nblocks, targets, ntargets, out);
    return 0;
}

/* --- HQ3_R, hfquant's own 3-bit rows (hq3r.py's module docstring): D f16, then per 64 weights sc[3] (four 6-bit
 * fields e | s << 5) and two HQ3_0 code groups; weight = (-1)^s (D * levels[e]) * NL_VALUES[q] --- */

#define QR 16

/* the grid values q nearest to x * inv (ties to the larger value: `torch.bucketize(right=True)`), their indices, and
 * the weighted squared error sum w (x - d q)^2 of one 16-weight sub-block */
static inline __attribute__((always_inline)) float hq3r_error(const grid_t *g, const float *x, const float *w, float d,
                                                              float *q, uint8_t *idx) {
    const float inv = inverse_or_zero(d);
    float u[QR], terms[QR];
    int32_t k[QR];
    for (int i = 0; i < QR; i++) {
        u[i] = x[i] * inv;
        q[i] = g->low;
        k[i] = 0;
    }
    for (int m = 0; m < 7; m++) { /* HQ3_NL's 8 values: 7 midpoints, a constant trip count that vectorizes */
        const float mid = g->mids[m], step = g->steps[m];
        for (int i = 0; i < QR; i++) {
            const int up = u[i] >= mid;
            q[i] += up ? step : 0.0f;
            k[i] += up;
        }
    }
    for (int i = 0; i < QR; i++) {
        const float diff = x[i] - d * q[i];
        terms[i] = w[i] * (diff * diff);
        if (idx) idx[i] = (uint8_t)k[i];
    }
    return sum_terms(terms, QR);
}

/* `hq3r._continuous` for one sub-block: per target the least-squares scale of the nearest codes, the one of largest
 * gain (sum w q x)^2 / sum w q^2 kept (the first on ties) */
static inline __attribute__((always_inline)) float hq3r_continuous(const grid_t *g, const float *x, const float *w,
                                                                   const float *targets, int ntargets) {
    const float peak = x[extreme_index(x, QR)];
    float q[QR], a[QR], b[QR], best_d = 0.0f, best_gain = 0.0f;
    for (int c = 0; c < ntargets; c++) {
        const float d = peak / targets[c];
        hq3r_error(g, x, w, d, q, NULL);
        for (int i = 0; i < QR; i++) {
            const float wq = w[i] * q[i];
            a[i] = wq * x[i];
            b[i] = wq * q[i];
        }
        const float sqx = sum_terms(a, QR), sqq = sum_terms(b, QR);
        const float gain = sqq != 0.0f ? (sqx * sqx) / sqq : 0.0f;
        if (c == 0 || gain > best_gain) {
            best_gain = gain;
            best_d = sqq != 0.0f ? sqx / sqq : 0.0f;
        }
    }
    return best_d;
}

/*
 * Quantize `rows` rows of K (a multiple of 64) float32 weights `x` into HQ3_R (`out`: rows * (2 + K / 64 * 27)
 * bytes), the search of `hq3r.quantize_hq3_r`. `w`: each element's weight in the squared error, NULL for all 1;
 * `w_stride`: 0 when w is one (K,) row for every row, K when it is (rows, K). `targets` (hq3r.search_targets) and
 * `levels` (hq3r.LEVELS, 32 values) as the torch codec's. Rows split over OpenMP threads. Returns 0, 1 for a bad K.
 */
#if defined(__x86_64__) && defined(__GNUC__)
/* AVX-512 and AVX2 clones where the CPU has them: 16- and 8-float vectors for the 16-weight loops (IEEE operations,
 * no contraction into fused multiply-adds, which AVX-512 would allow: the same bytes as the baseline clone and the
 * torch codec) */
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=off")))
#endif
int hfquant_hq3_r_quantize(const float *x, const float *w, int64_t w_stride, int64_t rows, int64_t k,
                           const float *targets, int64_t ntargets, const float *levels, uint8_t *out) {
    if (k <= 0 || k % 64) return 1;
    grid_t grid;
    grid_table(&grid, kvalues_hq3nl, 8);
    const int64_t nsub = k / QR, row_bytes = 2 + k / 64 * 27;
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        float ones[QR], q[QR], top = 0.0f;
        for (int i = 0; i < QR; i++) ones[i] = 1.0f;
        float dall[nsub]; /* each sub-block's searched |scale| (K / 16 floats on the stack: 7 KiB at K = 28672) */
        for (int64_t s = 0; s < nsub; s++) {
            const float *wb = w == NULL ? ones : w + r * w_stride + s * QR;
            dall[s] = fabsf(hq3r_continuous(&grid, xr + s * QR, wb, targets, (int)ntargets));
            top = dall[s] > top ? dall[s] : top;
        }
        top = to_half(top);
        uint8_t *o = out + r * row_bytes;
        put_half(o, top);
        uint8_t codes[64], idx[QR];
        for (int64_t b = 0; b < k / 64; b++) {
            uint32_t fields = 0;
            for (int j = 0; j < 4; j++) {
                const int64_t s = b * 4 + j;
                const float *xb = xr + s * QR, *wb = w == NULL ? ones : w + r * w_stride + s * QR;
                int e0 = 0; /* the first level at most |d| (levels decrease) */
                while (e0 < 32 && top * levels[e0] > dall[s]) e0++;
                const int lo = e0 - 3 < 0 ? 0 : e0 - 3, hi = e0 + 2 > 31 ? 31 : e0 + 2;
                float best_err = 0.0f;
                int best = -1;
                for (int sign = 0; sign < 2; sign++)
                    for (int e = lo; e <= hi; e++) {
                        const float magnitude = top * levels[e];
                        const float err = hq3r_error(&grid, xb, wb, sign ? -magnitude : magnitude, q, NULL);
                        if (best < 0 || err < best_err) {
                            best_err = err;
                            best = e | (sign << 5);
                        }
                    }
                const float magnitude = top * levels[best & 31];
                hq3r_error(&grid, xb, wb, best < 32 ? magnitude : -magnitude, q, idx);
                memcpy(codes + 16 * j, idx, QR);
                fields |= (uint32_t)best << (6 * j);
            }
            uint8_t *blk = o + 2 + b * 27;
            blk[0] = (uint8_t)(fields & 255);
            blk[1] = (uint8_t)((fields >> 8) & 255);
            blk[2] = (uint8_t)(fields >> 16);
            put_hq3_codes(codes, blk + 3);
            put_hq3_codes(codes + 32, blk + 15);
        }
    }
    return 0;
}
