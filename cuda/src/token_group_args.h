// Validated arguments of the per-token kernels (the cache write and the dequantize), the grid
// they share and the launcher declarations the entry points dispatch to. The launchers are
// defined in write/ and dequantize/ and instantiated in generated files, one per V width.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "index_check.h"

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
  bool key_vector_loads;    // key and key_stride allow 16-byte loads
  bool value_vector_loads;  // likewise for value
  float k_inv_scale;  // 1.0f / k_scale, computed once (FORMAT §2)
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  IndexCheck index_check;
  bool mse_encoder;  // FP8KTURBOV_V_ENCODER_MSE, else matched-norm
  uint32_t rotation_head_dim;  // FORMAT §6: V heads of this many elements rotated first; 0 = none
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

// The MSE V encoder (format.cuh, encode_v_group_mse) searches a group's scales with a warp where
// the write is small enough that the warps fit the GPU about twice over (an H200 holds 132 x 64):
// its latency is then a few microseconds. Larger writes take a thread per group, which does about
// a third of the work per group (it tightens its bound as it goes) but runs each group serially.
constexpr uint32_t kMseWarpLanes = 32;
constexpr uint64_t kMseWarpMaxGroups = 16384;
inline uint32_t mse_lanes_per_group(uint64_t num_tokens, uint64_t row_elems) {
  return num_tokens * (row_elems / 16) <= kMseWarpMaxGroups ? kMseWarpLanes : 1;
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

}  // namespace fp8kturbov
