/* bfloat16 <-> float32 on bit patterns, shared by hfquant's C kernels (every .c file in this folder).
 * bfloat16 is the upper half of a float32: widening appends 16 zero bits (exact); narrowing rounds to nearest even,
 * as torch's .to(torch.bfloat16) does; a NaN stays a quiet NaN of its sign (adding the rounding bias to a NaN whose
 * low mantissa bits are all ones would carry into the sign and give -0), an infinity stays infinite. */
#ifndef HFQUANT_BF16_BITS_H
#define HFQUANT_BF16_BITS_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#endif
