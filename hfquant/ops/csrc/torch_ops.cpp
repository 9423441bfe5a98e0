// hfquant's one-row GEMVs (csrc/int4_cpu.c, csrc/int4_intdot_cpu.c, csrc/int8_cpu.c) as PyTorch dispatcher operators:
// torch.ops.hfquant_cpu.int4_gemv, int4_gemv_avx2 (CPUs without AVX-512), int4_gemv_a8 (activations quantized to
// int8), int8_gemv, block_gemv (GGUF's block formats) and block_gemv_group (several block weights, one x), CPU kernels
// only.
//
// Why: called through ctypes, or through a Python custom op inside a torch.compile graph, each GEMV pays Python's
// call cost (about 4 us through ctypes, 14 us through torch.library.custom_op on an AMD EPYC Zen 4), as much as the
// whole product on a small layer. Registered here (PyTorch's TORCH_LIBRARY, c10 dispatcher), a call costs what an
// aten op does, in eager and in a compiled graph alike (hfquant/ops/native_build.py builds this file with the C
// sources into one library; hfquant/ops/torch_ops.py loads it and registers the fake kernels torch.compile traces
// with).
//
// Arguments as the C functions take them (hfquant_kernels.h): x (1, K) or (K,) contiguous bfloat16; int4: weight
// (N, K / 2) uint8 in the layout of _weight_int4pack_mm_for_cpu (64-row "halves" blocks; 32-row blocks for
// int4_gemv_avx2 and for int4_gemv_a8 with block_n=32), scale_zero (K / group, N, 2) contiguous bfloat16; int8:
// weight (N, K) contiguous int8, scale (N,) contiguous bfloat16. Output (1, N) bfloat16.
// A refused shape raises RuntimeError naming it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

namespace {

void check_row(const at::Tensor &x, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "hfquant GEMV: x must be a contiguous bfloat16 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.numel() == in_features, "hfquant GEMV: x must hold one row of ", in_features, " inputs, got shape ",
              x.sizes());
}

void check_operand(const at::Tensor &t, at::ScalarType dtype, const char *name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), "hfquant GEMV: ", name,
              " must be a contiguous ", dtype, " CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// kernel: callable as the C functions' first seven arguments (x, weight, scale_zero, y, n, k, group)
template <typename Int4Kernel>
at::Tensor int4_call(Int4Kernel kernel, const char *needs, const at::Tensor &x, const at::Tensor &weight,
                     const at::Tensor &scale_zero, int64_t group_size) {
  TORCH_CHECK(weight.dim() == 2, "hfquant int4 GEMV: weight must be (N, K / 2), got shape ", weight.sizes());
  const int64_t out_features = weight.size(0), in_features = weight.size(1) * 2;
  check_row(x, in_features);
  check_operand(weight, at::kByte, "weight");
  check_operand(scale_zero, at::kBFloat16, "scale_zero");
  TORCH_CHECK(group_size > 0 && in_features % group_size == 0 &&
                  scale_zero.numel() == (in_features / group_size) * out_features * 2,
              "hfquant int4 GEMV: scale_zero of shape ", scale_zero.sizes(), " does not fit N=", out_features,
              ", K=", in_features, ", group_size=", group_size);
  at::Tensor y = at::empty({1, out_features}, x.options());
  int status = kernel(static_cast<const uint16_t *>(x.const_data_ptr()),
                      static_cast<const uint8_t *>(weight.const_data_ptr()),
                      static_cast<const uint32_t *>(scale_zero.const_data_ptr()),
                      static_cast<uint16_t *>(y.mutable_data_ptr()), out_features, in_features, group_size);
  TORCH_CHECK(status == 0, "hfquant native int4 GEMV refused N=", out_features, ", K=", in_features,
              ", group_size=", group_size, " (needs ", needs, ")");
  return y;
}

at::Tensor int4_gemv(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale_zero,
                     int64_t group_size) {
  return int4_call(hfquant_int4_gemv, "N % 64 == 0, an even group size dividing K", x, weight, scale_zero,
                   group_size);
}

at::Tensor int4_gemv_avx2(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale_zero,
                          int64_t group_size) {
  return int4_call(hfquant_int4_gemv_avx2, "N % 32 == 0, a group size that is a multiple of 32 dividing K, AVX2", x,
                   weight, scale_zero, group_size);
}

at::Tensor int4_gemv_a8(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale_zero,
                        int64_t group_size, int64_t block_n) {
  auto kernel = [block_n](const uint16_t *x_, const uint8_t *w, const uint32_t *sz, uint16_t *y, int64_t n, int64_t k,
                          int64_t group) { return hfquant_int4_gemv_a8(x_, w, sz, y, n, k, group, block_n); };
  return int4_call(kernel,
                   "N % block_n == 0, a group size that is a multiple of 32 dividing K, AVX512-VNNI for block_n=64 or "
                   "AVX2 for block_n=32",
                   x, weight, scale_zero, group_size);
}

at::Tensor int8_gemv(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale) {
  TORCH_CHECK(weight.dim() == 2, "hfquant int8 GEMV: weight must be (N, K), got shape ", weight.sizes());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  check_row(x, in_features);
  check_operand(weight, at::kChar, "weight");
  check_operand(scale, at::kBFloat16, "scale");
  TORCH_CHECK(scale.numel() == out_features, "hfquant int8 GEMV: scale must hold N=", out_features,
              " values, got shape ", scale.sizes());
  at::Tensor y = at::empty({1, out_features}, x.options());
  int status = hfquant_int8_gemv(static_cast<const uint16_t *>(x.const_data_ptr()),
                                 static_cast<const int8_t *>(weight.const_data_ptr()),
                                 static_cast<const uint16_t *>(scale.const_data_ptr()),
                                 static_cast<uint16_t *>(y.mutable_data_ptr()), out_features, in_features);
  TORCH_CHECK(status == 0, "hfquant native int8 GEMV refused N=", out_features, ", K=", in_features,
              " (needs K % 16 == 0)");
  return y;
}

// block formats (csrc/blocks_cpu.c): weight (N, K / block * bytes) uint8 GGUF blocks of GGUF type ggml_type
at::Tensor block_gemv(const at::Tensor &x, const at::Tensor &weight, int64_t in_features, int64_t ggml_type) {
  TORCH_CHECK(weight.dim() == 2, "hfquant block GEMV: weight must be (N, row bytes), got shape ", weight.sizes());
  const int64_t out_features = weight.size(0);
  check_row(x, in_features);
  check_operand(weight, at::kByte, "weight");
  at::Tensor y = at::empty({1, out_features}, x.options());
  int status = hfquant_block_gemv(static_cast<const uint16_t *>(x.const_data_ptr()),
                                  static_cast<const uint8_t *>(weight.const_data_ptr()),
                                  static_cast<uint16_t *>(y.mutable_data_ptr()), out_features, in_features, ggml_type);
  TORCH_CHECK(status == 0, "hfquant native block GEMV refused N=", out_features, ", K=", in_features, ", GGUF type ",
              ggml_type, " (needs one of hfquant's block types, K a multiple of its block size, AVX2 or AVX512-VNNI)");
  return y;
}

// the block GEMVs of several weights reading the same x (a fused decode group: q/k/v, gate/up), in one C call: x
// quantized once, one OpenMP region; output (1, sum N_i), each weight's rows in order
// the block GEMVs of `count` weights reading the row x of k values into y, one C call (hfquant_block_gemv_group): the
// weights checked as (N_i, row bytes) contiguous uint8 CPU tensors, errors prefixed by `who`; returns sum N_i, and
// with y null checks and sizes only (block_gemv_group, decode_layer_row)
int64_t block_rows(const uint16_t *x, const at::Tensor *weights, const int64_t *types, int64_t count, int64_t k,
                   uint16_t *y, const char *who) {
  const uint8_t *pointers[8];
  int64_t rows[8], total = 0;
  for (int64_t i = 0; i < count; i++) {
    TORCH_CHECK(weights[i].dim() == 2, who, ": weight ", i, " must be (N, row bytes), got shape ", weights[i].sizes());
    check_operand(weights[i], at::kByte, "weight");
    pointers[i] = static_cast<const uint8_t *>(weights[i].const_data_ptr());
    rows[i] = weights[i].size(0);
    total += rows[i];
  }
  if (y == nullptr) return total;  // sizing only
  int status = hfquant_block_gemv_group(x, pointers, types, rows, y, count, k);
  TORCH_CHECK(status == 0, who, ": the block GEMV refused K=", k, ", GGUF types ", at::IntArrayRef(types, count),
              " (needs hfquant's block types, K a multiple of each block size, AVX2 or AVX512-VNNI)");
  return total;
}

at::Tensor block_gemv_group(const at::Tensor &x, at::TensorList weights, int64_t in_features, at::IntArrayRef types) {
  const int64_t count = static_cast<int64_t>(weights.size());
  TORCH_CHECK(count >= 1 && count <= 8 && static_cast<int64_t>(types.size()) == count,
              "hfquant block GEMV group: needs 1-8 weights and one GGUF type each, got ", count, " weights and ",
              types.size(), " types");
  check_row(x, in_features);
  const char *who = "hfquant block GEMV group";
  at::Tensor y = at::empty({1, block_rows(nullptr, weights.data(), types.data(), count, in_features, nullptr, who)},
                           x.options());
  block_rows(static_cast<const uint16_t *>(x.const_data_ptr()), weights.data(), types.data(), count, in_features,
             static_cast<uint16_t *>(y.mutable_data_ptr()), who);
  return y;
}

// RMSNorm of one row (csrc/norm_cpu.c): x (..., n) holding one row, weight (n,), both contiguous bfloat16; output
// x's shape, bfloat16, equal to transformers' LlamaRMSNorm forward bit for bit
at::Tensor rms_norm_row(const at::Tensor &x, const at::Tensor &weight, double eps) {
  TORCH_CHECK(weight.dim() == 1, "hfquant RMSNorm: weight must be (n,), got shape ", weight.sizes());
  const int64_t n = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n && x.numel() == n, "hfquant RMSNorm: x must hold one row of ", n,
              " values, got shape ", x.sizes());
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "hfquant RMSNorm: x must be a contiguous bfloat16 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "hfquant RMSNorm: weight must be a contiguous bfloat16 CPU tensor, got ", weight.scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options());
  int status = hfquant_rms_norm_row(static_cast<const uint16_t *>(x.const_data_ptr()),
                                    static_cast<const uint16_t *>(weight.const_data_ptr()),
                                    static_cast<uint16_t *>(y.mutable_data_ptr()), n, static_cast<float>(eps));
  TORCH_CHECK(status == 0, "hfquant RMSNorm refused n=", n);
  return y;
}

// attention of one query row (csrc/attention_cpu.c): query (1, heads, 1, dim), key and value (1, kv_heads, tokens,
// dim), bfloat16 CPU, the last dimension contiguous; output (1, 1, heads, dim) bfloat16 (transformers' attention
// functions' layout)
at::Tensor attention_row(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes() && query.size(0) == 1 &&
                  query.size(2) == 1 && key.size(0) == 1 && query.size(3) == key.size(3),
              "hfquant attention: needs query (1, heads, 1, dim) and key, value (1, kv_heads, tokens, dim), got ",
              query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  for (const at::Tensor *t : {&query, &key, &value})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->stride(3) == 1,
                "hfquant attention: tensors must be bfloat16 on CPU with a contiguous last dimension");
  TORCH_CHECK(value.stride(1) == key.stride(1) && value.stride(2) == key.stride(2),
              "hfquant attention: key and value must have the same strides");
  const int64_t heads = query.size(1), dim = query.size(3);
  at::Tensor out = at::empty({1, 1, heads, dim}, query.options());
  int status = hfquant_attention_row(
      static_cast<const uint16_t *>(query.const_data_ptr()), query.stride(1),
      static_cast<const uint16_t *>(key.const_data_ptr()), static_cast<const uint16_t *>(value.const_data_ptr()),
      key.stride(1), key.stride(2), static_cast<uint16_t *>(out.mutable_data_ptr()), heads, key.size(1), key.size(2),
      dim, static_cast<float>(scale));
  TORCH_CHECK(status == 0, "hfquant attention refused heads=", heads, ", kv_heads=", key.size(1), ", tokens=",
              key.size(2), " (status ", status, ")");
  return out;
}

// the number of leading true entries of a (1, 1, 1, tokens) bool mask when every later entry is false (the mask of a
// batch-1 decode step over a static cache: the positions written so far); -1 for any other pattern
int64_t prefix_length(const at::Tensor &mask) {
  const bool *m = mask.const_data_ptr<bool>();
  const int64_t tokens = mask.size(3), stride = mask.stride(3);
  int64_t n = 0;
  while (n < tokens && m[n * stride]) n++;
  for (int64_t t = n; t < tokens; t++)
    if (m[t * stride]) return -1;
  return n;
}

// attention_row over the keys a bool mask (1, 1, 1, tokens) allows: where they are a prefix (a static cache's
// written positions), the kernel reads only that prefix, so a step costs the tokens so far, not the cache's length;
// any other mask (padding, none allowed) goes to PyTorch's scaled_dot_product_attention with the mask
at::Tensor attention_row_masked(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, double scale,
                                const at::Tensor &mask) {
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kBool && mask.device().is_cpu() && mask.size(0) == 1 &&
                  mask.size(1) == 1 && mask.size(2) == 1 && key.dim() == 4 && mask.size(3) == key.size(2),
              "hfquant attention: needs a bool CPU mask (1, 1, 1, tokens) for key ", key.sizes(), ", got ",
              mask.scalar_type(), " ", mask.sizes());
  const int64_t n = prefix_length(mask);
  if (n > 0) {
    return attention_row(query, key.narrow(2, 0, n), value.narrow(2, 0, n), scale);
  }
  at::Tensor out = at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scale,
                                                    query.size(1) != key.size(1));
  return out.transpose(1, 2).contiguous();
}

void check_bf16_row(const at::Tensor &t, const char *what, const char *name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), "hfquant ", what, ": ",
              name, " must be a contiguous bfloat16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// rotary embedding of one token's query and key rows (csrc/decode_rows_cpu.c): query (..., heads * head_dim) and
// key (..., kv_heads * head_dim) holding one row each, cos and sin holding head_dim values, all contiguous bfloat16;
// outputs (1, heads, 1, head_dim) and (1, kv_heads, 1, head_dim), transformers' apply_rotary_pos_emb bit for bit
std::tuple<at::Tensor, at::Tensor> rotary_row(const at::Tensor &query, const at::Tensor &key, const at::Tensor &cos,
                                              const at::Tensor &sin, int64_t head_dim) {
  for (const at::Tensor *t : {&query, &key, &cos, &sin}) check_bf16_row(*t, "rotary", "query, key, cos and sin");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && query.numel() % head_dim == 0 && key.numel() % head_dim == 0 &&
                  query.numel() > 0 && key.numel() > 0 && cos.numel() == head_dim && sin.numel() == head_dim,
              "hfquant rotary: needs rows of whole heads of an even head_dim=", head_dim, " and cos, sin of head_dim ",
              "values, got query ", query.sizes(), ", key ", key.sizes(), ", cos ", cos.sizes(), ", sin ",
              sin.sizes());
  const int64_t heads = query.numel() / head_dim, kv_heads = key.numel() / head_dim;
  at::Tensor q_out = at::empty({1, heads, 1, head_dim}, query.options());
  at::Tensor k_out = at::empty({1, kv_heads, 1, head_dim}, key.options());
  int status = hfquant_rotary_row(
      static_cast<const uint16_t *>(query.const_data_ptr()), static_cast<const uint16_t *>(key.const_data_ptr()),
      static_cast<const uint16_t *>(cos.const_data_ptr()), static_cast<const uint16_t *>(sin.const_data_ptr()),
      static_cast<uint16_t *>(q_out.mutable_data_ptr()), static_cast<uint16_t *>(k_out.mutable_data_ptr()), heads,
      kv_heads, head_dim);
  TORCH_CHECK(status == 0, "hfquant rotary refused heads=", heads, ", kv_heads=", kv_heads, ", dim=", head_dim);
  return {q_out, k_out};
}

// one decode step's attention (decode_attention_row below, decode_layer_row, decode_layer_static): the rotary
// embedding of the query and key rows of qkv (heads, kv_heads, kv_heads rows of dim values, one after the other), the
// rotated key and the value written into the caches at `position`, then attention_row over positions 0..position into
// out (heads * dim values); the caches already checked by the caller. With a mask (a static cache's bool
// (1, 1, 1, capacity) mask, checked by the caller), the keys read are attention_row_masked's: the mask's true prefix
// (positions 0..position at batch 1 without padding), or, for any other pattern, PyTorch's SDPA with the mask
void decode_attention_into(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, at::Tensor &key_cache,
                           at::Tensor &value_cache, int64_t position, double scale, int64_t heads, uint16_t *out,
                           const at::Tensor *mask = nullptr) {
  const int64_t kv_heads = key_cache.size(1), dim = key_cache.size(3);
  const int64_t head_stride = key_cache.stride(1), token_stride = key_cache.stride(2);
  // the rotated query and key go to this thread's scratch row (no tensor allocated), the key then into the cache
  thread_local std::vector<uint16_t> rotated;
  rotated.resize(static_cast<size_t>((heads + kv_heads) * dim));
  uint16_t *q_rot = rotated.data(), *k_rot = rotated.data() + heads * dim;
  const uint16_t *k = qkv + heads * dim, *v = k + kv_heads * dim;
  int status = hfquant_rotary_row(qkv, k, cos, sin, q_rot, k_rot, heads, kv_heads, dim);
  TORCH_CHECK(status == 0, "hfquant decode attention: rotary refused heads=", heads, ", dim=", dim);
  uint16_t *keys = static_cast<uint16_t *>(key_cache.mutable_data_ptr());
  uint16_t *values = static_cast<uint16_t *>(value_cache.mutable_data_ptr());
  for (int64_t h = 0; h < kv_heads; h++) {
    std::memcpy(keys + h * head_stride + position * token_stride, k_rot + h * dim, dim * sizeof(uint16_t));
    std::memcpy(values + h * head_stride + position * token_stride, v + h * dim, dim * sizeof(uint16_t));
  }
  const int64_t tokens = mask == nullptr ? position + 1 : prefix_length(*mask);
  if (tokens <= 0) {  // padding or nothing allowed: attention_row_masked's fallback, SDPA over the whole cache
    at::Tensor query = at::empty({1, heads, 1, dim}, key_cache.options());
    std::memcpy(query.mutable_data_ptr(), q_rot, heads * dim * sizeof(uint16_t));
    at::Tensor sdpa = at::scaled_dot_product_attention(query, key_cache, value_cache, *mask, 0.0, false, scale,
                                                       heads != kv_heads);
    std::memcpy(out, sdpa.transpose(1, 2).contiguous().const_data_ptr(), heads * dim * sizeof(uint16_t));
    return;
  }
  status = hfquant_attention_row(q_rot, dim, keys, values, head_stride, token_stride, out, heads, kv_heads, tokens,
                                 dim, static_cast<float>(scale));
  TORCH_CHECK(status == 0, "hfquant decode attention refused heads=", heads, ", kv_heads=", kv_heads, ", tokens=",
              tokens, " (status ", status, ")");
}

// the caches of a decode step's attention and the query heads of a qkv row of `values` values: checks that the
// caches are (1, kv_heads, capacity > position, head_dim) bfloat16 CPU tensors of one shape and strides with a
// contiguous last dimension and the row whole heads (a multiple of kv_heads, then 2 * kv_heads); returns the heads
int64_t check_caches(const at::Tensor &key_cache, const at::Tensor &value_cache, int64_t position, int64_t values,
                     const at::Tensor &cos, const at::Tensor &sin) {
  for (const at::Tensor *t : {&key_cache, &value_cache})
    TORCH_CHECK(t->dim() == 4 && t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->stride(3) == 1,
                "hfquant decode attention: caches must be (1, kv_heads, capacity, head_dim) bfloat16 CPU tensors with",
                " a contiguous last dimension, got ", t->sizes());
  const int64_t kv_heads = key_cache.size(1), dim = key_cache.size(3);
  const int64_t heads = dim > 0 ? values / dim - 2 * kv_heads : 0;
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides() &&
                  key_cache.size(0) == 1 && position >= 0 && position < key_cache.size(2) && dim % 2 == 0 &&
                  heads > 0 && heads % kv_heads == 0 && values == (heads + 2 * kv_heads) * dim &&
                  cos.numel() == dim && sin.numel() == dim,
              "hfquant decode attention: needs caches of one shape and strides with room at position ", position,
              " and a qkv row of whole heads (a multiple of kv_heads, then 2 * kv_heads), got caches ",
              key_cache.sizes(), ", a qkv row of ", values, " values, cos ", cos.sizes());
  return heads;
}

// one decode step's attention over a cache hfquant owns (hfquant/nn/decode_cache.py): the rotary embedding of query
// and key (rotary_row's arithmetic), the rotated key and the value written into key_cache and value_cache at
// `position` (in place: no new cache tensor), then attention_row over positions 0..position. qkv holds the step's
// query, key and value rows one after the other ((heads + 2 * kv_heads) * head_dim contiguous bfloat16 values: a
// fused q/k/v GEMV's output row, not split), cos and sin head_dim values; key_cache and value_cache (1, kv_heads,
// capacity > position, head_dim) bfloat16 CPU with the same strides and a contiguous last dimension. Output
// (1, 1, heads * head_dim): attention_row's values, in o_proj's input shape.
at::Tensor decode_attention_row(const at::Tensor &qkv, const at::Tensor &cos, const at::Tensor &sin,
                                at::Tensor &key_cache, at::Tensor &value_cache, int64_t position, double scale) {
  for (const at::Tensor *t : {&qkv, &cos, &sin}) check_bf16_row(*t, "decode attention", "qkv, cos and sin");
  const int64_t heads = check_caches(key_cache, value_cache, position, qkv.numel(), cos, sin);
  at::Tensor out = at::empty({1, 1, heads * key_cache.size(3)}, qkv.options());
  decode_attention_into(static_cast<const uint16_t *>(qkv.const_data_ptr()),
                        static_cast<const uint16_t *>(cos.const_data_ptr()),
                        static_cast<const uint16_t *>(sin.const_data_ptr()), key_cache, value_cache, position, scale,
                        heads, static_cast<uint16_t *>(out.mutable_data_ptr()));
  return out;
}

// SwiGLU product of one row (csrc/decode_rows_cpu.c): bf16(silu(gate)) * up for gate and up of one shape, each with
// a contiguous last dimension holding all its values (a fused gate/up GEMV's split views); output gate's shape,
// contiguous bfloat16
at::Tensor silu_mul_row(const at::Tensor &gate, const at::Tensor &up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.dim() >= 1 && gate.numel() == gate.size(-1),
              "hfquant SwiGLU: needs gate and up of one shape holding one row, got ", gate.sizes(), ", ", up.sizes());
  for (const at::Tensor *t : {&gate, &up})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->stride(-1) == 1,
                "hfquant SwiGLU: gate and up must be bfloat16 CPU rows with a contiguous last dimension");
  at::Tensor out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  int status = hfquant_silu_mul_row(static_cast<const uint16_t *>(gate.const_data_ptr()),
                                    static_cast<const uint16_t *>(up.const_data_ptr()),
                                    static_cast<uint16_t *>(out.mutable_data_ptr()), gate.numel());
  TORCH_CHECK(status == 0, "hfquant SwiGLU refused n=", gate.numel());
  return out;
}

// silu_mul_row of a fused gate/up GEMV's one output row, unsplit: gate_up holds the gate's n values then the up's n
// (2n contiguous bfloat16); output (1, 1, n), down_proj's input of a decode step
at::Tensor silu_mul_halves_row(const at::Tensor &gate_up) {
  check_bf16_row(gate_up, "SwiGLU", "gate_up");
  TORCH_CHECK(gate_up.numel() > 0 && gate_up.numel() % 2 == 0 && gate_up.numel() == gate_up.size(-1),
              "hfquant SwiGLU: needs one row of an even number of values, got ", gate_up.sizes());
  const int64_t n = gate_up.numel() / 2;
  at::Tensor out = at::empty({1, 1, n}, gate_up.options());
  const uint16_t *gate = static_cast<const uint16_t *>(gate_up.const_data_ptr());
  int status = hfquant_silu_mul_row(gate, gate + n, static_cast<uint16_t *>(out.mutable_data_ptr()), n);
  TORCH_CHECK(status == 0, "hfquant SwiGLU refused n=", n);
  return out;
}

// residual + hidden, then the RMSNorm of the sum (csrc/decode_rows_cpu.c): residual and hidden of one shape holding
// one row of n values, weight (n,), all contiguous bfloat16; outputs (the sum, its norm), residual's shape, equal to
// transformers' `residual + hidden` and LlamaRMSNorm of it bit for bit
std::tuple<at::Tensor, at::Tensor> add_rms_norm_row(const at::Tensor &residual, const at::Tensor &hidden,
                                                    const at::Tensor &weight, double eps) {
  for (const at::Tensor *t : {&residual, &hidden, &weight})
    check_bf16_row(*t, "add + RMSNorm", "residual, hidden and weight");
  TORCH_CHECK(weight.dim() == 1 && residual.sizes() == hidden.sizes() && residual.dim() >= 1 &&
                  residual.size(-1) == weight.size(0) && residual.numel() == weight.size(0),
              "hfquant add + RMSNorm: needs residual and hidden holding one row of weight's ", weight.size(0),
              " values, got ", residual.sizes(), ", ", hidden.sizes());
  at::Tensor sum = at::empty(residual.sizes(), residual.options());
  at::Tensor y = at::empty(residual.sizes(), residual.options());
  int status = hfquant_add_rms_norm_row(
      static_cast<const uint16_t *>(residual.const_data_ptr()), static_cast<const uint16_t *>(hidden.const_data_ptr()),
      static_cast<const uint16_t *>(weight.const_data_ptr()), static_cast<uint16_t *>(sum.mutable_data_ptr()),
      static_cast<uint16_t *>(y.mutable_data_ptr()), weight.size(0), static_cast<float>(eps));
  TORCH_CHECK(status == 0, "hfquant add + RMSNorm refused n=", weight.size(0));
  return {sum, y};
}

// One eager decode step of a Llama-family decoder layer whose projections are all block formats, in one call: what
// hfquant/nn/row_decode.py's layer, attention and MLP forwards call one operator at a time, the same C functions in
// the same order on the same bytes, so the output is theirs bit for bit:
//   h = rms_norm_row(hidden, input_norm)                      (rms_norm_row)
//   qkv = block GEMV group of h over the q/k/v weights         (block_gemv_group: x quantized to int8 blocks once)
//   a = attention of qkv over the cache, key and value written (decode_attention_row)
//   o = block GEMV of a over o_proj                            (block_gemv)
//   s = hidden + o; m = rms_norm_row(s, post_norm)             (add_rms_norm_row)
//   gu = block GEMV group of m over the gate/up weights        (block_gemv_group)
//   d = block GEMV of silu(gate) * up over down_proj           (silu_mul_halves_row, block_gemv)
//   out = s + d                                                (torch's bfloat16 add: float sum rounded once)
// Why: each operator call from Python costs 2-7 us of dispatch and argument parsing on the Zen 3 of
// docs/performance.md's nineteenth session, about ten per layer with the Python around them (issue #32); here the
// intermediates live in this thread's scratch rows and only the output is allocated.
// Arguments: hidden (1, 1, H) contiguous bfloat16; cos, sin, key_cache, value_cache, position, as
// decode_attention_row; weights [input norm (H,), post-attention norm (H,), o_proj (H, row bytes), down_proj
// (H, row bytes), the q/k/v group's weights (qkv_count), the gate/up group's (gate_up_count)]; ints [qkv_count,
// gate_up_count, o_proj's GGUF type, down_proj's, the q/k/v weights' types, the gate/up weights' types]; floats
// [input norm eps, post-attention norm eps, attention scale]. The gate/up rows: the gate's I then the up's I.
// Output (1, 1, H) bfloat16, the layer's output row; key_cache and value_cache written at `position`.
// decode_layer_row's and decode_layer_static's body; mask as decode_attention_into's (null: positions 0..position)
at::Tensor layer_step(const at::Tensor &hidden, const at::Tensor &cos, const at::Tensor &sin, at::Tensor &key_cache,
                      at::Tensor &value_cache, int64_t position, const at::Tensor *mask, at::TensorList weights,
                      at::IntArrayRef ints, at::ArrayRef<double> floats) {
  TORCH_CHECK(ints.size() >= 4 && floats.size() == 3, "hfquant decode layer: needs 4 + the groups' ints and 3 floats");
  const int64_t qkv_count = ints[0], gate_up_count = ints[1];
  TORCH_CHECK(qkv_count >= 1 && qkv_count <= 8 && gate_up_count >= 1 && gate_up_count <= 8 &&
                  static_cast<int64_t>(weights.size()) == 4 + qkv_count + gate_up_count &&
                  static_cast<int64_t>(ints.size()) == 4 + qkv_count + gate_up_count,
              "hfquant decode layer: needs 4 + the groups' weights and types, got ", weights.size(), " weights and ",
              ints.size(), " ints");
  for (const at::Tensor *t : {&hidden, &cos, &sin, &weights[0], &weights[1]})
    check_bf16_row(*t, "decode layer", "hidden, cos, sin and the norm weights");
  const int64_t n = hidden.numel();
  TORCH_CHECK(hidden.dim() == 3 && n > 0 && weights[0].dim() == 1 && weights[0].numel() == n &&
                  weights[1].dim() == 1 && weights[1].numel() == n,
              "hfquant decode layer: needs hidden (1, 1, H) and norm weights (H,), got ", hidden.sizes(), ", ",
              weights[0].sizes(), ", ", weights[1].sizes());
  const at::Tensor *qkv_w = weights.data() + 4, *gate_up_w = qkv_w + qkv_count;
  const int64_t *qkv_types = ints.data() + 4, *gate_up_types = qkv_types + qkv_count;
  const char *qkv_who = "hfquant decode layer (q/k/v)", *gate_up_who = "hfquant decode layer (gate/up)";
  const int64_t qkv_n = block_rows(nullptr, qkv_w, qkv_types, qkv_count, n, nullptr, qkv_who);
  const int64_t gate_up_n = block_rows(nullptr, gate_up_w, gate_up_types, gate_up_count, n, nullptr, gate_up_who);
  const int64_t heads = check_caches(key_cache, value_cache, position, qkv_n, cos, sin);
  const int64_t attn_n = heads * key_cache.size(3), inter = gate_up_n / 2;
  TORCH_CHECK(gate_up_n % 2 == 0 && weights[2].dim() == 2 && weights[2].size(0) == n && weights[3].dim() == 2 &&
                  weights[3].size(0) == n,
              "hfquant decode layer: needs an even gate/up row and o_proj, down_proj of H=", n, " rows, got ",
              gate_up_n, ", ", weights[2].sizes(), ", ", weights[3].sizes());
  // scratch rows, each 64-byte aligned: h, qkv, a, o, s, m, gu, the SwiGLU product, d
  const int64_t sizes[9] = {n, qkv_n, attn_n, n, n, n, gate_up_n, inter, n};
  int64_t offsets[9], total = 0;
  for (int i = 0; i < 9; i++) {
    offsets[i] = total;
    total += (sizes[i] + 31) / 32 * 32;
  }
  thread_local std::vector<uint16_t> scratch_rows;
  scratch_rows.resize(static_cast<size_t>(total + 32));
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(scratch_rows.data()) + 63) & ~uintptr_t(63);
  uint16_t *base = reinterpret_cast<uint16_t *>(aligned);
  uint16_t *h = base + offsets[0], *qkv = base + offsets[1], *a = base + offsets[2], *o = base + offsets[3];
  uint16_t *s = base + offsets[4], *m = base + offsets[5], *gu = base + offsets[6], *act = base + offsets[7];
  uint16_t *d = base + offsets[8];
  const uint16_t *x = static_cast<const uint16_t *>(hidden.const_data_ptr());
  const uint16_t *input_norm = static_cast<const uint16_t *>(weights[0].const_data_ptr());
  const uint16_t *post_norm = static_cast<const uint16_t *>(weights[1].const_data_ptr());
  TORCH_CHECK(hfquant_rms_norm_row(x, input_norm, h, n, static_cast<float>(floats[0])) == 0,
              "hfquant decode layer: RMSNorm refused n=", n);
  block_rows(h, qkv_w, qkv_types, qkv_count, n, qkv, qkv_who);
  decode_attention_into(qkv, static_cast<const uint16_t *>(cos.const_data_ptr()),
                        static_cast<const uint16_t *>(sin.const_data_ptr()), key_cache, value_cache, position,
                        floats[2], heads, a, mask);
  block_rows(a, &weights[2], &ints[2], 1, attn_n, o, "hfquant decode layer (o_proj)");
  TORCH_CHECK(hfquant_add_rms_norm_row(x, o, post_norm, s, m, n, static_cast<float>(floats[1])) == 0,
              "hfquant decode layer: add + RMSNorm refused n=", n);
  block_rows(m, gate_up_w, gate_up_types, gate_up_count, n, gu, gate_up_who);
  TORCH_CHECK(hfquant_silu_mul_row(gu, gu + inter, act, inter) == 0, "hfquant decode layer: SwiGLU refused n=", inter);
  block_rows(act, &weights[3], &ints[3], 1, inter, d, "hfquant decode layer (down_proj)");
  at::Tensor out = at::empty(hidden.sizes(), hidden.options());
  uint16_t *y = static_cast<uint16_t *>(out.mutable_data_ptr());
  for (int64_t i = 0; i < n; i++) y[i] = float_to_bf16(bf16_to_float(s[i]) + bf16_to_float(d[i]));
  return out;
}

at::Tensor decode_layer_row(const at::Tensor &hidden, const at::Tensor &cos, const at::Tensor &sin,
                            at::Tensor &key_cache, at::Tensor &value_cache, int64_t position, at::TensorList weights,
                            at::IntArrayRef ints, at::ArrayRef<double> floats) {
  return layer_step(hidden, cos, sin, key_cache, value_cache, position, nullptr, weights, ints, floats);
}

// decode_layer_row over a static cache's layer (transformers' StaticLayer, hfquant/nn/decode_cache.py), for
// torch.compile graphs (hfquant.compile_decoding): the position is the layer's `length`, a one-element int64 tensor
// read here at run time (an int argument would be a constant of the graph, or a graph break) and advanced by one
// after the step, as StaticLayer.update advances its cumulative_length; key_cache and value_cache are the layer's
// (1, kv_heads, capacity, head_dim) buffers. mask: None, or the step's bool (1, 1, 1, capacity) mask, whose true
// prefix gives the keys read (positions 0..position at batch 1 without padding: then the same bytes as
// decode_layer_row's output, which reads 0..position) and any other pattern SDPA with the mask
// (attention_row_masked's rule, what the graph's attention call did before).
at::Tensor decode_layer_static(const at::Tensor &hidden, const at::Tensor &cos, const at::Tensor &sin,
                               at::Tensor &key_cache, at::Tensor &value_cache, at::Tensor &length,
                               const std::optional<at::Tensor> &mask, at::TensorList weights, at::IntArrayRef ints,
                               at::ArrayRef<double> floats) {
  TORCH_CHECK(length.device().is_cpu() && length.scalar_type() == at::kLong && length.numel() == 1,
              "hfquant decode layer: length must be one int64 CPU value, got ", length.scalar_type(), " ",
              length.sizes());
  if (mask.has_value())
    TORCH_CHECK(mask->dim() == 4 && mask->scalar_type() == at::kBool && mask->device().is_cpu() &&
                    mask->size(0) == 1 && mask->size(1) == 1 && mask->size(2) == 1 && key_cache.dim() == 4 &&
                    mask->size(3) == key_cache.size(2),
                "hfquant decode layer: needs a bool CPU mask (1, 1, 1, capacity) for the cache ", key_cache.sizes(),
                ", got ", mask->scalar_type(), " ", mask->sizes());
  int64_t *position = length.mutable_data_ptr<int64_t>();
  at::Tensor out = layer_step(hidden, cos, sin, key_cache, value_cache, *position,
                              mask.has_value() ? &*mask : nullptr, weights, ints, floats);
  *position += 1;
  return out;
}

}  // namespace

TORCH_LIBRARY(hfquant_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor weight, Tensor scale_zero, int group_size) -> Tensor");
  m.def("int4_gemv_a8(Tensor x, Tensor weight, Tensor scale_zero, int group_size, int block_n) -> Tensor");
  m.def("int4_gemv_avx2(Tensor x, Tensor weight, Tensor scale_zero, int group_size) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("block_gemv(Tensor x, Tensor weight, int in_features, int ggml_type) -> Tensor");
  m.def("block_gemv_group(Tensor x, Tensor[] weights, int in_features, int[] ggml_types) -> Tensor");
  m.def("rms_norm_row(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention_row(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
  m.def("attention_row_masked(Tensor query, Tensor key, Tensor value, float scale, Tensor mask) -> Tensor");
  m.def("rotary_row(Tensor query, Tensor key, Tensor cos, Tensor sin, int head_dim) -> (Tensor, Tensor)");
  m.def(
      "decode_attention_row(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "int position, float scale) -> Tensor");
  m.def("silu_mul_row(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_halves_row(Tensor gate_up) -> Tensor");
  m.def("add_rms_norm_row(Tensor residual, Tensor hidden, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "decode_layer_row(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "int position, Tensor[] weights, int[] ints, float[] floats) -> Tensor");
  m.def(
      "decode_layer_static(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor(c!) length, Tensor? mask, Tensor[] weights, int[] ints, float[] floats) -> Tensor");
}

TORCH_LIBRARY_IMPL(hfquant_cpu, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemv_a8", &int4_gemv_a8);
  m.impl("int4_gemv_avx2", &int4_gemv_avx2);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("block_gemv", &block_gemv);
  m.impl("block_gemv_group", &block_gemv_group);
  m.impl("rms_norm_row", &rms_norm_row);
  m.impl("attention_row", &attention_row);
  m.impl("attention_row_masked", &attention_row_masked);
  m.impl("rotary_row", &rotary_row);
  m.impl("decode_attention_row", &decode_attention_row);
  m.impl("silu_mul_row", &silu_mul_row);
  m.impl("silu_mul_halves_row", &silu_mul_halves_row);
  m.impl("add_rms_norm_row", &add_rms_norm_row);
  m.impl("decode_layer_row", &decode_layer_row);
  m.impl("decode_layer_static", &decode_layer_static);
}
