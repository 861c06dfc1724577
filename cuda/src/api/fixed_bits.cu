// The original engine's six launchers, argument for argument: each fills a parameter struct
// (packed K pages, sparse-V threshold 1e-3 from the defaults) and runs the generic entry point.
#include "api/entry_points.h"

using fp8kturbov::decode_impl;
using fp8kturbov::write_impl;

extern "C" {

#define FP8KTURBOV_DEFINE_FIXED_BITS(BITS)                                                       \
  fp8kturbov_status_t fp8kturbov_reshape_and_cache_fp8k_turbo##BITS##v(                         \
      const void* key, const void* value, void* k_cache, void* v_cache,                         \
      const int64_t* slot_mapping, uint32_t num_tokens, uint32_t num_kv_heads,                  \
      uint32_t head_dim, uint32_t block_size, uint32_t key_stride, uint32_t value_stride,       \
      float k_scale, uint64_t k_block_stride_bytes, uint64_t v_block_stride_bytes,              \
      uint64_t v_data_section_bytes, fp8kturbov_stream_t stream) {                              \
    fp8kturbov_write_params_t p;                                                                \
    fp8kturbov_write_params_init(&p);                                                           \
    p.key = key;                                                                                \
    p.value = value;                                                                            \
    p.k_cache = k_cache;                                                                        \
    p.v_cache = v_cache;                                                                        \
    p.slot_mapping = slot_mapping;                                                              \
    p.num_tokens = num_tokens;                                                                  \
    p.num_kv_heads = num_kv_heads;                                                              \
    p.head_dim = head_dim;                                                                      \
    p.block_size = block_size;                                                                  \
    p.key_stride = key_stride;                                                                  \
    p.value_stride = value_stride;                                                              \
    p.k_scale = k_scale;                                                                        \
    p.v_bits = BITS;                                                                            \
    p.k_block_stride_bytes = k_block_stride_bytes;                                              \
    p.v_block_stride_bytes = v_block_stride_bytes;                                              \
    p.v_data_section_bytes = v_data_section_bytes;                                              \
    return write_impl("fp8kturbov_reshape_and_cache_fp8k_turbo" #BITS "v", p,                   \
                      reinterpret_cast<cudaStream_t>(stream));                                  \
  }                                                                                             \
  fp8kturbov_status_t fp8kturbov_paged_decode_attn_fp8k_turbo##BITS##v(                         \
      const void* q, const void* k_cache, const void* v_cache, void* output,                    \
      const int32_t* block_tables, const int32_t* seq_lens, uint32_t max_blocks_per_seq,        \
      uint32_t num_seqs, uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,        \
      uint32_t block_size, float inv_sqrt_d, float k_scale, uint32_t q_stride,                  \
      uint64_t v_block_stride_bytes, uint64_t v_data_section_bytes, uint32_t sliding_window,    \
      fp8kturbov_stream_t stream) {                                                             \
    fp8kturbov_decode_params_t p;                                                               \
    fp8kturbov_decode_params_init(&p);                                                          \
    p.q = q;                                                                                    \
    p.k_cache = k_cache;                                                                        \
    p.v_cache = v_cache;                                                                        \
    p.output = output;                                                                          \
    p.block_tables = block_tables;                                                              \
    p.seq_lens = seq_lens;                                                                      \
    p.max_blocks_per_seq = max_blocks_per_seq;                                                  \
    p.num_seqs = num_seqs;                                                                      \
    p.num_q_heads = num_q_heads;                                                                \
    p.num_kv_heads = num_kv_heads;                                                              \
    p.head_dim = head_dim;                                                                      \
    p.block_size = block_size;                                                                  \
    p.inv_sqrt_d = inv_sqrt_d;                                                                  \
    p.k_scale = k_scale;                                                                        \
    p.q_stride = q_stride;                                                                      \
    p.v_bits = BITS;                                                                            \
    p.v_block_stride_bytes = v_block_stride_bytes;                                              \
    p.v_data_section_bytes = v_data_section_bytes;                                              \
    p.sliding_window = sliding_window;                                                          \
    return decode_impl("fp8kturbov_paged_decode_attn_fp8k_turbo" #BITS "v", p,                 \
                       reinterpret_cast<cudaStream_t>(stream));                                 \
  }

FP8KTURBOV_DEFINE_FIXED_BITS(2)
FP8KTURBOV_DEFINE_FIXED_BITS(3)
FP8KTURBOV_DEFINE_FIXED_BITS(4)

}  // extern "C"
