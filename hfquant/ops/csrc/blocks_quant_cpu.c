/*
 * hfquant's k-quant block quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in C: the same search as the torch codecs of
 * hfquant/core/blocks/kquants.py (`_quantize_affine`, `_quantize_symmetric`), step for step in float32 with the same
 * constants and tie rules, one super-block of 256 weights at a time, super-blocks split over OpenMP threads.
 *
 * Every sum accumulates in double and rounds once to float32 here and in the torch codec (`kquants._sum`), so the
 * bytes are the torch codec's (tests/ops/test_native_blocks.py). Portable C, no intrinsics.
 */
#pragma GCC optimize("fp-contract=off") /* no fused multiply-adds: torch rounds each product */
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
