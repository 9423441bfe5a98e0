/* The functions hfquant's kernel library exports, one prototype each: the C files that define them include this
 * header (so a definition that drifts from its prototype does not compile), and so does torch_ops.cpp, which calls
 * them. hfquant/ops/native.py declares the same signatures to ctypes (argtypes), by hand: a change here goes there too,
 * with a new HFQUANT_INT4_CPU_ABI (int4_cpu.c) when an existing signature changes.
 *
 * Conventions: bfloat16 tensors travel as uint16_t bit patterns, [scale, zero] bfloat16 pairs as one uint32_t;
 * every pointer is to contiguous, little-endian memory; n = output features (N), k = input features (K),
 * group = inputs per scale. The kernels return 0 on success, 1 for a refused shape or a CPU without the instructions
 * they need, 2 when memory runs out (the GEMVs) or the weight holds a NaN or an infinity (RTN); the *_supported
 * functions return 1 where the kernels run. Shapes and layouts: the comment at each definition. */
#ifndef HFQUANT_KERNELS_H
#define HFQUANT_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* isa_cpu.c: the instruction sets the kernels may use here, as bits: what the CPU has, lowered by the environment
 * variable HFQUANT_ISA (native / avx512vnni / avx512 / avx2 / generic) when the library loads; HFQUANT_ISA_REFUSED alone for a
 * value not understood. Every kernel with several bodies picks one by HFQUANT_ISA_HAS. */
#define HFQUANT_ISA_AVX2 1         /* AVX2, FMA and F16C */
#define HFQUANT_ISA_AVX512 2       /* AVX512-F, BW and VL */
#define HFQUANT_ISA_AVX512_BF16 4  /* AVX512-BF16 */
#define HFQUANT_ISA_AVX512_VNNI 8  /* AVX512-VNNI */
#define HFQUANT_ISA_AVX512_VBMI_GFNI 16 /* AVX512-VBMI, AVX512-BITALG and GFNI (Ice Lake, Zen 4): HQ3_R's GFNI step */
#define HFQUANT_ISA_REFUSED (1 << 30)
#define HFQUANT_ISA_HAS(bits) ((hfquant_isa() & (bits)) == (bits))
int hfquant_isa(void);

/* int4_cpu.c: int4 on the 64-row "halves" layout of PyTorch's _weight_int4pack_mm_for_cpu (AVX512-BF16) */
int hfquant_int4_cpu_abi(void);
int hfquant_int4_cpu_supported(void);
int hfquant_int4_to_cpu_layout(const uint8_t *stored, uint8_t *out, int64_t n, int64_t k);
int hfquant_int4_from_cpu_layout(const uint8_t *layout, uint8_t *stored, int64_t n, int64_t k);
int hfquant_int4_gemv(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y, int64_t n,
                      int64_t k, int64_t group);
int hfquant_int4_dequantize_t(const uint8_t *weight, const uint32_t *scale_zero, uint16_t *out, int64_t n, int64_t k,
                              int64_t group, int64_t start, int64_t stop);

/* int4_intdot_cpu.c: int4 GEMVs by integer dot products (W4A8 on AVX512-VNNI or AVX2; int16 activations on AVX2) */
int hfquant_int4_a8_supported(int64_t block_n);
int hfquant_int4_gemv_a8(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                         int64_t n, int64_t k, int64_t group, int64_t block_n);
int hfquant_int4_gemv_avx2(const uint16_t *x, const uint8_t *weight, const uint32_t *scale_zero, uint16_t *y,
                           int64_t n, int64_t k, int64_t group);

/* blocks_cpu.c: llama.cpp's block formats (GGUF types by number), one activation row quantized to int8 blocks */
int hfquant_block_gemv_supported(int64_t type);
int hfquant_block_gemv(const uint16_t *x, const uint8_t *weight, uint16_t *y, int64_t n, int64_t k, int64_t type);
/* the GEMVs of `count` (1-8) weights against one x (block sizes may differ), outputs concatenated in y */
int hfquant_block_gemv_group(const uint16_t *x, const uint8_t *const *weights, const int64_t *types, const int64_t *ns,
                             uint16_t *y, int64_t count, int64_t k);
int hfquant_block_dequantize_t(const uint8_t *weight, void *out, int64_t n, int64_t k, int64_t type, int64_t start,
                               int64_t stop, int64_t out_float32);
/* The 8-row interleaved compute layout ("R8") of IQ4_NL and IQ4_XS weights: type code t | BLOCK_ROWS8 for a GGUF type
 * t, accepted by the GEMVs (AVX2 CPUs without AVX512-VNNI, N a multiple of 8) and by hfquant_block_dequantize_t (any
 * CPU). hfquant_block_interleave permutes the bytes of an (N, row bytes) GGUF weight into it (inverse = 0) or back
 * (1); returns 1 for N % 8 != 0, a type without an R8 layout or K not whole blocks. */
#define BLOCK_ROWS8 (1 << 16)
/* The 16-row interleaved compute layout ("R16") of IQ4_XS weights: type code GGML_IQ4_XS | BLOCK_ROWS16, accepted by
 * the GEMVs (AVX512-VNNI CPUs, N a multiple of 16) and by hfquant_block_dequantize_t (any CPU).
 * hfquant_block_interleave takes it as its type to permute into (or back from) R16 instead of R8 (N a multiple of
 * 16). */
#define BLOCK_ROWS16 (1 << 17)
int hfquant_block_interleave(const uint8_t *src, uint8_t *dst, int64_t n, int64_t k, int64_t type, int64_t inverse);

/* blocks_quant_cpu.c: hfquant's k-quant search (Q2_K..Q6_K, types 10..14), GGUF's bytes out */
int hfquant_kquant_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, int type,
                            uint8_t *out);

/* blocks_quant_cpu.c: hfquant's search for the 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and IQ4_XS
 * (types 2, 3, 6, 7, 8, 20, 23), GGUF's bytes out */
int hfquant_block_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, int type,
                           const float *params, int64_t nparams, const float *params2, int64_t nparams2,
                           uint8_t *out);

/* iq4_search_cpu.c: the fast IQ4_NL / IQ4_XS search (types 20, 23), GGUF's bytes out */
int hfquant_iq4_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, int type,
                         const float *targets, int64_t ntargets, const float *super_factors, int64_t nsuper,
                         int64_t refine, float refine_step, int64_t level_options, int64_t rounds, float sweep_lo,
                         float sweep_hi, int64_t threads, int64_t portable, uint8_t *out);
/* iq4_search_cpu.c: the same search of a bfloat16 / float32 weight (rows, k) folded as hfquant_fold_chunk folds it, by
 * each thread as it searches; 3 when a folded value is not finite */
int hfquant_iq4_quantize_fold(const void *wsrc, int64_t bf16, int64_t rows, int64_t k, const float *row_scale,
                              const float *col_scale, const float *w, int64_t w_period, int type,
                              const float *targets, int64_t ntargets, const float *super_factors, int64_t nsuper,
                              int64_t refine, float refine_step, int64_t level_options, int64_t rounds,
                              float sweep_lo, float sweep_hi, int64_t threads, int64_t portable, uint8_t *out);
/* iq4_search_cpu.c: the body hfquant_iq4_quantize runs (hfquant_isa decides): 0 portable C, 1 AVX2, 2 AVX-512 */
int hfquant_iq4_search_body(void);

/* blocks_quant_cpu.c: hfquant's search for its own HQ3_0 (3-bit codes, 32-weight blocks), hq3.py's bytes out */
int hfquant_hq3_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, const float *targets,
                         int64_t ntargets, uint8_t *out);
/* blocks_quant_cpu.c: the same for HQ3_NL (HQ3_0's bytes, codes on hq3.py's NL_VALUES grid) */
int hfquant_hq3_nl_quantize(const float *x, const float *w, int64_t w_period, int64_t nblocks, const float *targets,
                            int64_t ntargets, uint8_t *out);
/* blocks_quant_cpu.c: hfquant's search for its own HQ3_R (16-weight sub-blocks, 6-bit scales, a float16 per row) */
int hfquant_hq3_r_quantize(const float *x, const float *w, int64_t w_stride, int64_t rows, int64_t k,
                           const float *targets, int64_t ntargets, const float *levels, uint8_t *out);

/* int8_cpu.c: int8 per-channel codes, row-major as stored; _supported: 1 where a body runs (AVX-512 F/BW/VL + BF16, or
 * AVX2 + FMA + F16C) */
int hfquant_int8_gemv_supported(void);
int hfquant_int8_gemv(const uint16_t *x, const int8_t *weight, const uint16_t *scale, uint16_t *y, int64_t n,
                      int64_t k);

/* bf16_cpu.c: bfloat16 weights (the float layers hfquant keeps) */
int hfquant_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k);
/* fold_chunk_cpu.c: out = float32(w) * row_scale[:, None] / col_scale in one pass; 3 when a result is not finite */
int hfquant_fold_chunk(const void *w, int64_t bf16, int64_t rows, int64_t k, const float *row_scale,
                       const float *col_scale, float *out);
/* fold_chunk_cpu.c: elements start .. start + count - 1 (row-major, rows may be crossed) of the same; whether one is
 * not finite */
int hfquant_fold_span(const void *w, int64_t bf16, int64_t k, int64_t start, int64_t count, const float *row_scale,
                      const float *col_scale, float *out);
/* y = w @ x in float32 for bfloat16 w (N, K) and float32 x (K,), one thread (the fold pre-pass's BOS forward) */
int hfquant_bf16_f32_gemv(const uint16_t *w, const float *x, float *y, int64_t n, int64_t k);

/* norm_cpu.c: RMSNorm of one bfloat16 row, transformers' LlamaRMSNorm arithmetic bit for bit */
int hfquant_rms_norm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, float eps);

/* attention_cpu.c: scaled dot-product attention of one query row over a key/value cache (grouped-query) */
int hfquant_attention_row(const uint16_t *q, int64_t q_head_stride, const uint16_t *k, const uint16_t *v,
                          int64_t kv_head_stride, int64_t kv_token_stride, uint16_t *out, int64_t heads,
                          int64_t kv_heads, int64_t tokens, int64_t dim, float scale);

/* decode_rows_cpu.c: a decode step's elementwise work, one call each (rotary embedding of q and k, SwiGLU product,
 * residual add then RMSNorm), in transformers' bfloat16 arithmetic */
int hfquant_rotary_row(const uint16_t *q, const uint16_t *k, const uint16_t *cos, const uint16_t *sin,
                       uint16_t *q_out, uint16_t *k_out, int64_t heads, int64_t kv_heads, int64_t dim);
int hfquant_silu_mul_row(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n);
int hfquant_add_rms_norm_row(const uint16_t *residual, const uint16_t *h, const uint16_t *w, uint16_t *sum,
                             uint16_t *y, int64_t n, float eps);

/* rtn_cpu.c: round-to-nearest quantization in one pass */
int hfquant_rtn_quantize(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits, int symmetric,
                         uint8_t *codes, uint16_t *scale, uint8_t *zero_point, int64_t threads);
int hfquant_rtn_quantize_scaled(const void *w, int w_is_bf16, int64_t n, int64_t k, int64_t group, int bits,
                                int symmetric, const float *row_scale, const float *col_scale, uint8_t *codes,
                                uint16_t *scale, uint8_t *zero_point, int64_t threads);

/* sinq_cpu.c: SINQ's Sinkhorn balancing of stacked matrices, tile by tile in cache */
int hfquant_sinq_balance(const void *const *mats, const int64_t *rows, const float *const *row_scales, int64_t count,
                         int is_bf16, int64_t k, int64_t group, int64_t iterations, int64_t threads, float *inv_col);

#ifdef __cplusplus
}
#endif

#endif
