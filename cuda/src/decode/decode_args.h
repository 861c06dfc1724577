// Validated arguments of one paged decode and the launcher declarations the entry point
// dispatches to (defined in decode/launch.cuh, instantiated per (V bits, head dim) in generated
// files).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "index_check.h"
#include "plan/decode_plan.h"

namespace fp8kturbov {

// Arguments of one paged decode, after validation.
struct DecodeArgs {
  const uint16_t* q;  // bf16 bits
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  uint16_t* output;  // bf16 bits
  const int32_t* block_tables;
  const int32_t* seq_lens;
  uint32_t max_blocks_per_seq;   // pages of a row that the decode reads
  uint64_t block_tables_stride;  // entries between rows of block_tables (>= max_blocks_per_seq)
  uint32_t num_seqs;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t block_size;
  uint32_t block_size_multiplier;  // position / block_size = (umulhi(pos, mul) + pos) >> shift
  uint32_t block_size_shift;
  float score_scale;  // inv_sqrt_d * k_scale: the K dequant scale folds into the softmax scale
  uint64_t q_stride;
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint32_t sliding_window;
  float sparse_v_threshold;
  uint32_t v_code_copy_bytes;  // 16, 8 or 4: the widest V copy the pool address and strides allow
  IndexCheck index_check;
  const float* sinks;  // [num_q_heads] logits joining the denominator, or nullptr
  float soft_cap;      // > 0: scores soft-capped, 0: off
  const int32_t* query_start;  // [num_seqs + 1] query rows per sequence, or nullptr: row = sequence
  uint32_t max_q_len;          // the largest q_len; 1 without query_start
  uint32_t num_query_rows;     // rows of q and output (checked mode bounds them)
  bool rotated_v;              // FORMAT §6: the cache holds rotated V; outputs are rotated back
};

// Alignment (bytes) the decode kernel's V copies need from the V pool, its page stride and its
// data section (the scale section's offset): they copy 4 bytes at least.
constexpr uint32_t kDecodeVAlignment = 4;

// The widest V code copy (16, 8 or 4 bytes) that a pool address and its strides allow.
inline uint32_t decode_v_code_copy_bytes(uintptr_t v_cache, uint64_t v_block_stride_bytes,
                                         uint64_t row_code_bytes) {
  const uint64_t bits = uint64_t(v_cache) | v_block_stride_bytes | row_code_bytes;
  return bits % 16 == 0 ? 16 : bits % 8 == 0 ? 8 : 4;
}

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, const DecodePlan& plan,
                                cudaStream_t stream);

// Resident decode CTAs per multiprocessor of `device` (the current device), for the planner: of
// the default kernel, or with `head_groups` of the head-group kernel (0 where it is not built).
template <int BITS, int HEAD_DIM>
cudaError_t decode_ctas_per_sm(int device, bool head_groups, int* count);

}  // namespace fp8kturbov
