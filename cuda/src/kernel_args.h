// Validated kernel arguments and the launcher declarations the entry points dispatch to.
// The launchers are defined in the kernel headers and instantiated in generated files, one per
// (operation, V bits[, head dim]) of the build's lists; this header holds declarations only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "fp8kturbov.h"  // fp8kturbov_index_error_t
#include "plan/decode_plan.h"
#include "plan/prefill_plan.h"

namespace fp8kturbov {

// Checked mode (fp8kturbov.h): the pool capacity in pages (0 = unchecked) and the caller's device
// word that the kernels OR fp8kturbov_index_error_t bits into.
struct IndexCheck {
  uint64_t num_blocks;
  uint32_t* error_flags;

  __device__ bool enabled() const { return num_blocks != 0; }
  // A page id read from a block table (checked mode): int32, so a negative one is out of range.
  __device__ bool page_out_of_range(int32_t page) const { return page < 0 || uint64_t(page) >= num_blocks; }
  // A slot's page (slot / block_size, slot >= 0) that checked mode finds outside the pools.
  __device__ bool slot_page_out_of_range(uint64_t page) const { return enabled() && page >= num_blocks; }
  __device__ void report(fp8kturbov_index_error_t error) const { atomicOr(error_flags, uint32_t(error)); }
};

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
  bool key_vector_loads;    // key and key_stride allow 16-byte loads
  bool value_vector_loads;  // likewise for value
  float k_inv_scale;  // 1.0f / k_scale, computed once (FORMAT §2)
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  IndexCheck index_check;
  fp8kturbov_v_encoder_t v_encoder;
  uint32_t rotation_head_dim;  // FORMAT §6: V heads of this many elements rotated first; 0 = none
};

// The decode's fused append (fp8kturbov_decode_params_t::append_*): query row r's new token,
// K and V as the cache write takes them, goes to slot slot_mapping[r] (< 0: nothing) before it is
// attended. The pools are the decode's, written through (the caller's pointers are writable then).
struct AppendArgs {
  const uint16_t* key;    // bf16 bits
  const uint16_t* value;  // bf16 bits
  const int64_t* slot_mapping;  // nullptr: no append
  uint8_t* k_cache;
  uint8_t* v_cache;
  uint64_t key_stride;
  uint64_t value_stride;
  bool key_vector_loads;    // key and key_stride allow 16-byte loads
  bool value_vector_loads;  // likewise for value
  float k_inv_scale;        // 1.0f / k_scale, as the write's (FORMAT §2)
  fp8kturbov_v_encoder_t v_encoder;  // as the write's

  __host__ __device__ bool enabled() const { return slot_mapping != nullptr; }
};

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
  AppendArgs append;           // the fused append, or none (append.enabled())
};

template <int BITS>
cudaError_t launch_reshape_and_cache(const WriteArgs& args, cudaStream_t stream);

// The grid of the write and the dequantize: threads_per_group threads (a divisor of kWriteThreads)
// per (token, 16-element group) in CTAs of kWriteThreads. The validation keeps the CTA count
// below 2^31.
inline uint64_t per_token_group_ctas(uint64_t num_tokens, uint64_t row_elems, uint32_t threads_per_group) {
  const uint64_t groups_per_cta = kWriteThreads / threads_per_group;
  return (num_tokens * (row_elems / 16) + groups_per_cta - 1) / groups_per_cta;  // < 2^60 + 2^8
}

// The searching V encoders (format.cuh: MSE, encode_v_group_mse; projection,
// encode_v_group_projection) search a group's scales with a warp where the write is small enough
// that the warps fit the GPU about twice over (an H200 holds 132 x 64): its latency is then a few
// microseconds. Larger writes take a thread per group, which runs each group serially but spends
// no lanes on a warp's shared work (MSE: about a third of the work per group, as it tightens its
// bound as it goes).
constexpr uint32_t kSearchWarpLanes = 32;
constexpr uint64_t kSearchWarpMaxGroups = 16384;
inline uint32_t search_lanes_per_group(uint64_t num_tokens, uint64_t row_elems) {
  return num_tokens * (row_elems / 16) <= kSearchWarpMaxGroups ? kSearchWarpLanes : 1;
}

template <typename Args>
cudaError_t launch_per_token_group(const void* kernel, const Args& args, cudaStream_t stream,
                                   uint32_t threads_per_group = 1) {
  const dim3 grid(unsigned(per_token_group_ctas(args.num_tokens, args.row_elems, threads_per_group)));
  Args kernel_args = args;
  void* params[] = {&kernel_args};
  return cudaLaunchKernel(kernel, grid, dim3(kWriteThreads), params, 0, stream);
}

// Arguments of one dequantize, after validation (the write's row and pool rules).
struct DequantizeArgs {
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  const int64_t* slot_mapping;
  uint16_t* key;    // bf16 bits
  uint16_t* value;  // bf16 bits
  uint32_t num_tokens;
  uint32_t row_elems;  // num_kv_heads * head_dim
  uint32_t block_size;
  uint64_t key_stride;
  uint64_t value_stride;
  bool key_vector_stores;    // key and key_stride allow 16-byte stores
  bool value_vector_stores;  // likewise for value
  float k_scale;
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  IndexCheck index_check;
};

template <int BITS>
cudaError_t launch_dequantize(const DequantizeArgs& args, cudaStream_t stream);

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

// Arguments of one paged prefill, after validation (the decode's pool and table rules; the range
// helpers of decode/ranges.cuh read the fields they share with DecodeArgs).
struct PrefillArgs {
  const uint16_t* q;  // bf16 bits
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  uint16_t* output;  // bf16 bits, [num_query_rows][num_q_heads][head_dim]
  float* lse;        // [num_query_rows][num_q_heads] natural-log denominators, or nullptr
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;  // [num_seqs + 1]
  uint32_t max_blocks_per_seq;
  uint64_t block_tables_stride;
  uint32_t num_seqs;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t group_size;  // num_q_heads / num_kv_heads
  uint32_t block_size;
  uint32_t block_size_multiplier;  // as DecodeArgs'
  uint32_t block_size_shift;
  float score_scale;  // inv_sqrt_d * k_scale
  uint64_t q_stride;
  bool q_vector_loads;        // q and q_stride allow 16-byte loads
  bool output_vector_stores;  // output allows 16-byte stores
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint32_t sliding_window;
  float soft_cap;
  const float* sinks;
  bool rotated_v;
  uint32_t max_q_len;
  uint32_t num_query_rows;
  uint32_t tiles_per_seq;  // query tiles of the longest chunk: the grid's x is num_seqs of them
  uint32_t query_tile_rows;  // kPrefillQueryRows, or kPrefillWsQueryRows: the sm_90a kernel (prefill/kernel_ws.cuh)
  IndexCheck index_check;
  // The split plan (plan/prefill_plan.h): with num_splits > 1 the CTAs of split s attend positions
  // [s·split_positions, (s + 1)·split_positions) and write their normalised rows to partial_o
  // ([num_splits][num_query_rows][num_q_heads][head_dim]) and their log-denominators to partial_lse
  // ([num_splits][num_query_rows][num_q_heads]), which the merge kernel combines.
  uint32_t num_splits;
  uint32_t split_positions;
  float* partial_o;
  float* partial_lse;
  // The expanded context (plan/prefill_plan.h): with expanded_kv, a first kernel writes each
  // (sequence, KV head)'s tiles dequantized, as the warp-specialised kernel's producer would
  // ([num_seqs][num_kv_heads][expanded_tiles] tiles of expanded_tile_bytes), and that producer
  // then copies each tile whole.
  uint8_t* expanded_kv;
  uint32_t expanded_tiles;
  uint32_t expanded_tile_bytes;
};

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_prefill(const PrefillArgs& args, cudaStream_t stream);

// Resident prefill CTAs per multiprocessor of `device` (the current device), for the planner.
template <int BITS, int HEAD_DIM>
cudaError_t prefill_ctas_per_sm(int device, bool warp_specialized, int* count);

// Resident decode CTAs per multiprocessor of `device` (the current device), for the planner: of
// the default kernel, or with `head_groups` of the head-group kernel (0 where it is not built).
template <int BITS, int HEAD_DIM>
cudaError_t decode_ctas_per_sm(int device, bool head_groups, int* count);

}  // namespace fp8kturbov
