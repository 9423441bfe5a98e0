/* The elementwise work of a batch-1 decode step around its GEMVs, one call each instead of several torch ops:
 *
 * hfquant_rotary_row: the rotary position embedding of one token's query and key rows (Su et al. 2021, "RoFormer";
 *   transformers' apply_rotary_pos_emb with rotate_half, the Llama / Mistral / Qwen2 convention: the two halves of a
 *   head rotated together), in transformers' bfloat16 arithmetic, each torch op rounded once:
 *     out[h, d] = bf16(bf16(x[h, d] * cos[d]) + bf16(rot[h, d] * sin[d])),
 *     rot[h, d] = -x[h, d + dim / 2] for d < dim / 2, x[h, d - dim / 2] after
 *   q: (heads, dim) and k: (kv_heads, dim) contiguous bfloat16 rows (a q/k/v GEMV's outputs), cos, sin: (dim,)
 *   bfloat16 (the model's rotary table row for the token's position); q_out, k_out: (heads, dim), (kv_heads, dim).
 *   The products of two bfloat16 values are exact in float32 and torch adds two bfloat16 values in float32 before
 *   rounding, so the outputs equal transformers' bit for bit. Returns 1 for an odd or non-positive dim or heads.
 *
 * hfquant_silu_mul_row: the SwiGLU product of an MLP (Shazeer 2020, "GLU Variants Improve Transformer"; transformers'
 *   LlamaMLP: act_fn(gate_proj(x)) * up_proj(x) with act_fn SiLU), in torch's bfloat16 arithmetic:
 *     out[i] = bf16(bf16(g / (1 + exp(-g))) * u[i]),   g = gate[i] widened, float32
 *   as ATen's CPU silu kernel computes a bfloat16 SiLU (x / (1 + exp(-x)) in float32, rounded once), then the
 *   product (exact in float32, rounded once). exp is exp_lanes below, not ATen's (Sleef's exp_u10): both are within
 *   a few float32 units of exp, so an output differs from torch's only where g / (1 + exp(-g)) falls within a few
 *   float32 units of a bfloat16 rounding midpoint (about one output in 10^4, by one bfloat16 step);
 *   tests/nn/test_row_decode.py bounds the error against float64. gate, up, out: (n,) bfloat16. Returns 1 for n <= 0.
 *
 * hfquant_add_rms_norm_row: a decoder layer's residual add followed by the next RMSNorm (transformers'
 *   `hidden = residual + h; norm(hidden)`): sum[i] = bf16(residual[i] + h[i]) (torch's bfloat16 add, one rounding),
 *   then y = hfquant_rms_norm_row(sum, w) (csrc/norm_cpu.c, LlamaRMSNorm's arithmetic bit for bit). Returns 1 for
 *   n <= 0.
 *
 * Why: in an eager decode step these are 14 tensor ops for the rotary embedding, 2 for the SwiGLU product and 2 calls
 * for the add and norm, each paying a dispatch and an allocation, per layer; most of a small model's step
 * (docs/performance.md, issue #32, thirteenth session). Bodies: the SwiGLU product is written on GNU C vectors
 * (csrc/swiglu_body.h), 16 floats in the AVX-512 F/BW/VL body, 8 in the AVX2 one and the x86-64 baseline's, each
 * lane's operations the same and contraction off in this file: the same bits in every body; the other two are
 * scalar loops (a few thousand values).
 */
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic ignored "-Wpsabi" /* the vector helpers are inlined into each body: no ABI crosses */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define INLINE static inline __attribute__((always_inline))

/* the SwiGLU body in 16 lanes (zmm registers, the AVX-512 body) and in 8 (AVX2, portable): each lane's operations
 * are the same whatever the width, so every body gives the same bits */
#define SW_LANES 16
#include "swiglu_body.h"
#undef SW_LANES
#define SW_LANES 8
#include "swiglu_body.h"

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))) static void silu_mul_avx512(
    const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    silu_mul_body16(gate, up, out, n);
}

__attribute__((target("avx2,fma,f16c"))) static void silu_mul_avx2(const uint16_t *gate, const uint16_t *up,
                                                                    uint16_t *out, int64_t n) {
    silu_mul_body8(gate, up, out, n);
}

static void silu_mul_portable(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    silu_mul_body8(gate, up, out, n);
}

int hfquant_silu_mul_row(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    if (n <= 0) return 1;
    if (HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX2))
        silu_mul_avx512(gate, up, out, n);
    else if (HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2))
        silu_mul_avx2(gate, up, out, n);
    else
        silu_mul_portable(gate, up, out, n);
    return 0;
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* one head's rotation; half = dim / 2 */
static void rotate_head(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *out, int64_t half) {
    for (int64_t d = 0; d < half; d++) {
        const float low = bf16_to_float(x[d]), high = bf16_to_float(x[d + half]);
        const float c_low = bf16_to_float(cos[d]), s_low = bf16_to_float(sin[d]);
        const float c_high = bf16_to_float(cos[d + half]), s_high = bf16_to_float(sin[d + half]);
        out[d] = float_to_bf16(round_bf16(low * c_low) + round_bf16(-high * s_low));
        out[d + half] = float_to_bf16(round_bf16(high * c_high) + round_bf16(low * s_high));
    }
}

int hfquant_rotary_row(const uint16_t *q, const uint16_t *k, const uint16_t *cos, const uint16_t *sin,
                       uint16_t *q_out, uint16_t *k_out, int64_t heads, int64_t kv_heads, int64_t dim) {
    if (heads <= 0 || kv_heads <= 0 || dim <= 0 || dim % 2) return 1;
    for (int64_t h = 0; h < heads; h++) rotate_head(q + h * dim, cos, sin, q_out + h * dim, dim / 2);
    for (int64_t h = 0; h < kv_heads; h++) rotate_head(k + h * dim, cos, sin, k_out + h * dim, dim / 2);
    return 0;
}

int hfquant_add_rms_norm_row(const uint16_t *residual, const uint16_t *h, const uint16_t *w, uint16_t *sum,
                             uint16_t *y, int64_t n, float eps) {
    if (n <= 0) return 1;
    for (int64_t i = 0; i < n; i++) sum[i] = float_to_bf16(bf16_to_float(residual[i]) + bf16_to_float(h[i]));
    return hfquant_rms_norm_row(sum, w, y, n, eps);
}
