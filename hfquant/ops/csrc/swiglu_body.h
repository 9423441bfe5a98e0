/* The SwiGLU product's body (csrc/decode_rows_cpu.c's hfquant_silu_mul_row) on GNU C vectors of SW_LANES float32
 * lanes, included once per width (16: zmm registers in the AVX-512 body; 8: AVX2 and portable), defining
 * silu_mul_body<SW_LANES>(gate, up, out, n):
 *   out[i] = bf16(bf16(g / (1 + exp(-g))) * up[i]),   g = gate[i] widened, float32
 * Every operation is lane by lane, so each width gives the same bits (decode_rows_cpu.c turns contraction off).
 *
 * exp(x) lane by lane: x = n ln2 + r (n nearest, |r| <= ln2 / 2; ln2 in two parts, the first times n exact), e^r by
 * its Taylor polynomial of degree 7 (truncation below 2^-26 relative; Horner in float32, a few units in the last
 * place in all), times 2^n through the exponent bits: 2^n as one float for n in [-126, 127], so x is clamped to
 * [-87, 88] (e^-87 > 2^-126; e^88 < 2^127), larger x give +infinity and smaller ones 0: SiLU's g / (1 + e) is then
 * -0 for g < -88 (torch's: -0 below -88.7, down to -6e-37 between) and g for g > 87 (as torch's). UNROLL vectors go
 * through each step together (one vector's chain of dependent operations alone leaves the core waiting). */
#define SW_CAT2(a, b) a##b
#define SW_CAT(a, b) SW_CAT2(a, b)
#define SW(name) SW_CAT(name, SW_LANES)
#define SW_UNROLL 4
#define SW_EACH for (int u = 0; u < SW_UNROLL; u++)

typedef float SW(vfloat) __attribute__((vector_size(4 * SW_LANES)));
typedef int32_t SW(vint) __attribute__((vector_size(4 * SW_LANES)));
typedef uint32_t SW(vuint) __attribute__((vector_size(4 * SW_LANES)));
typedef uint16_t SW(vbf16) __attribute__((vector_size(2 * SW_LANES)));

INLINE SW(vfloat) SW(splat)(float x) { return x - (SW(vfloat)){0}; } /* x - (+0) is x, -0 included: a broadcast */

INLINE SW(vfloat) SW(pick)(SW(vint) mask, SW(vfloat) a, SW(vfloat) b) {
    return (SW(vfloat))(((SW(vint))a & mask) | ((SW(vint))b & ~mask));
}

INLINE SW(vfloat) SW(widen)(SW(vbf16) h) { return (SW(vfloat))(__builtin_convertvector(h, SW(vuint)) << 16); }

/* float32 lanes rounded to bfloat16 (nearest even, as float_to_bf16; a NaN stays a quiet NaN) */
INLINE SW(vbf16) SW(narrow)(SW(vfloat) f) {
    const SW(vuint) bits = (SW(vuint))f;
    const SW(vuint) rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const SW(vint) nan = f != f;
    return __builtin_convertvector((SW(vuint))(((SW(vint))rounded & ~nan) | (nan & 0x7FC0)), SW(vbf16));
}

INLINE void SW(exp_lanes)(SW(vfloat) *x) {
    static const float taylor[8] = {1.98412698e-4f, 1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f,
                                    1.66666667e-1f, 0.5f,           1.0f,           1.0f};
    SW(vint) small[SW_UNROLL], large[SW_UNROLL];
    SW(vfloat) n[SW_UNROLL], r[SW_UNROLL], p[SW_UNROLL];
    SW_EACH {
        small[u] = x[u] < SW(splat)(-87.0f);
        large[u] = x[u] > SW(splat)(88.0f);
        x[u] = SW(pick)(small[u], SW(splat)(-87.0f), SW(pick)(large[u], SW(splat)(88.0f), x[u]));
    }
    SW_EACH n[u] = (x[u] * SW(splat)(1.44269504f) + SW(splat)(12582912.0f)) - SW(splat)(12582912.0f); /* 1.5 * 2^23 */
    SW_EACH r[u] = (x[u] - n[u] * SW(splat)(0.693359375f)) + n[u] * SW(splat)(2.12194440e-4f);
    SW_EACH p[u] = SW(splat)(taylor[0]);
    for (int i = 1; i < 8; i++) SW_EACH p[u] = p[u] * r[u] + SW(splat)(taylor[i]);
    SW_EACH {
        const SW(vfloat) two_n = (SW(vfloat))((__builtin_convertvector(n[u], SW(vint)) + 127) << 23);
        const SW(vfloat) e = SW(pick)(large[u], SW(splat)(INFINITY), p[u] * two_n);
        x[u] = (SW(vfloat))((SW(vint))e & ~small[u]);
    }
}

/* SW_UNROLL * SW_LANES outputs */
INLINE void SW(silu_mul_lanes)(const SW(vbf16) *gate, const SW(vbf16) *up, SW(vbf16) *out) {
    SW(vfloat) g[SW_UNROLL], e[SW_UNROLL];
    SW_EACH g[u] = SW(widen)(gate[u]);
    SW_EACH e[u] = -g[u];
    SW(exp_lanes)(e);
    SW_EACH e[u] = SW(widen)(SW(narrow)(g[u] / (SW(splat)(1.0f) + e[u])));
    SW_EACH out[u] = SW(narrow)(e[u] * SW(widen)(up[u]));
}

INLINE void SW(silu_mul_body)(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    const int64_t step = SW_UNROLL * SW_LANES;
    SW(vbf16) g[SW_UNROLL], u[SW_UNROLL], y[SW_UNROLL];
    int64_t i = 0;
    for (; i + step <= n; i += step) {
        memcpy(g, gate + i, sizeof g);
        memcpy(u, up + i, sizeof u);
        SW(silu_mul_lanes)(g, u, y);
        memcpy(out + i, y, sizeof y);
    }
    if (i < n) { /* the tail, zero-padded */
        memset(g, 0, sizeof g);
        memset(u, 0, sizeof u);
        memcpy(g, gate + i, (size_t)(n - i) * sizeof(uint16_t));
        memcpy(u, up + i, (size_t)(n - i) * sizeof(uint16_t));
        SW(silu_mul_lanes)(g, u, y);
        memcpy(out + i, y, (size_t)(n - i) * sizeof(uint16_t));
    }
}

#undef SW_EACH
#undef SW_UNROLL
#undef SW
#undef SW_CAT
#undef SW_CAT2
