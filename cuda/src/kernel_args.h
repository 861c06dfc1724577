// Validated kernel arguments and the launcher declarations the entry points dispatch to.
// The launchers are defined in the kernel headers and instantiated in generated files, one per
// (operation, V bits[, head dim]) of the build's lists; this header holds declarations only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fp8kturbov {

// Threads per CTA of the write kernel: one thread per (token, 16-element group).
constexpr int kWriteThreads = 256;

// Arguments of one cache write, after validation. Strides are in elements unless named _bytes.
struct WriteArgs {
  const uint16_t* key;    // bf16 bits
  const uint16_t* value;  // bf16 bits
  uint8_t* k_cache;
  uint8_t* v_cache;
  const int64_t* slot_mapping;
  uint32_t num_tokens;
  uint32_t row_elems;  // num_kv_heads * head_dim
  uint32_t block_size;
  uint64_t key_stride;
  uint64_t value_stride;
  float k_inv_scale;  // 1.0f / k_scale, computed once (FORMAT §2)
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
};

// Arguments of one paged decode, after validation.
struct DecodeArgs {
  const uint16_t* q;  // bf16 bits
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  uint16_t* output;  // bf16 bits
  const int32_t* block_tables;
  const int32_t* seq_lens;
  uint32_t max_blocks_per_seq;
  uint32_t num_seqs;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t block_size;
  float score_scale;  // inv_sqrt_d * k_scale: the K dequant scale folds into the softmax scale
  uint64_t q_stride;
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint32_t sliding_window;
  float sparse_v_threshold;
};

template <int BITS>
cudaError_t launch_reshape_and_cache(const WriteArgs& args, cudaStream_t stream);

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, cudaStream_t stream);

}  // namespace fp8kturbov
