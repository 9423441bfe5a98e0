/* RMSNorm of one bfloat16 row with transformers' LlamaRMSNorm arithmetic, bit for bit (Zhang & Sennrich 2019, "Root
 * Mean Square Layer Normalization"; the forward of LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, ... in transformers):
 *   h = bf16(x * (1 / sqrt(sum(x * x) / n + eps)))   in float32
 *   y = bf16(w * h)                                  (w, h bfloat16: the product is exact in float32, rounded once)
 *   x, w, y: (n,) bfloat16; eps: the norm's epsilon as float32 (torch adds a Python float to a float32 tensor as a
 *   float32). Returns 0 (1 for n <= 0).
 * Why: in eager decode the norm is seven small torch ops per call (a cast, pow, mean, add, rsqrt, mul, cast, mul), 61
 * calls per SmolLM2 step; this is one call.
 * The sum of squares must be summed in the order ATen's CPU sum uses (aten/src/ATen/native/cpu/SumKernel.cpp,
 * `vectorized_inner_sum` with 8 float lanes: `row_sum` over 8-lane vectors, 4 accumulators, `multi_row_sum`'s
 * cascade of 4 levels, then the leftover vectors, the 4 accumulators, the scalar tail and the 8 lanes in order), or a
 * variance may differ from torch's by one float32 step and an output by one bfloat16 step. x * x is exact in float32
 * for a bfloat16 x, so no fused multiply-add can change a result. hfquant.nn.row_norm checks the result against the
 * module's own forward before installing it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define LANES 8
#define ILP 4
#define LEVELS 4

static inline uint16_t to_bf16_nan(float f) {
    if (isnan(f)) return 0x7FC0u;
    return float_to_bf16(f);
}

/* the 8 lanes of vector v (8 consecutive inputs from x + v * 8) squared, added into acc */
static inline void add_squares(float *acc, const uint16_t *x, int64_t v) {
    for (int l = 0; l < LANES; l++) {
        const float value = bf16_to_float(x[v * LANES + l]);
        acc[l] += value * value;
    }
}

static inline void add_lanes(float *acc, const float *other) {
    for (int l = 0; l < LANES; l++) acc[l] += other[l];
}

/* torch's row_sum over `vectors` 8-lane vectors: multi_row_sum of the (vectors / 4, 4) array, then the rest */
static void lanes_sum(const uint16_t *x, int64_t vectors, float *out) {
    const int64_t rows = vectors / ILP;
    int64_t ceil_log2 = 1;
    while (rows > 2 && ((int64_t)1 << ceil_log2) < rows) ceil_log2++;
    const int64_t power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][LANES];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++) add_squares(acc[0][k], x, i * ILP + k);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++) {
                add_lanes(acc[j][k], acc[j - 1][k]);
                memset(acc[j - 1][k], 0, sizeof acc[j - 1][k]);
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < ILP; k++) add_squares(acc[0][k], x, i * ILP + k);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) add_lanes(acc[0][k], acc[j][k]);
    for (int64_t v = rows * ILP; v < vectors; v++) add_squares(acc[0][0], x, v);
    for (int k = 1; k < ILP; k++) add_lanes(acc[0][0], acc[0][k]);
    memcpy(out, acc[0][0], sizeof acc[0][0]);
}

int hfquant_rms_norm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, float eps) {
    if (n <= 0) return 1;
    const int64_t vectors = n / LANES;
    float lanes[LANES];
    lanes_sum(x, vectors, lanes);
    float sum = 0.0f;
    for (int64_t i = vectors * LANES; i < n; i++) {
        const float value = bf16_to_float(x[i]);
        sum += value * value;
    }
    for (int l = 0; l < LANES; l++) sum += lanes[l];
    const float variance = sum / (float)n;
    const float inverse = 1.0f / sqrtf(variance + eps);
    for (int64_t i = 0; i < n; i++) {
        const uint16_t h = to_bf16_nan(bf16_to_float(x[i]) * inverse);
        y[i] = to_bf16_nan(bf16_to_float(w[i]) * bf16_to_float(h));
    }
    return 0;
}
