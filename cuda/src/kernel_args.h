// Validated kernel arguments and the launcher declarations the entry points dispatch to.
// The launchers are defined in the kernel headers and instantiated in generated files, one per
// (operation, V bits[, head dim]) of the build's lists; this header holds declarations only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "fp8kturbov.h"  // fp8kturbov_index_error_t

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
  bool mse_encoder;  // FP8KTURBOV_V_ENCODER_MSE, else matched-norm
  uint32_t rotation_head_dim;  // FORMAT §6: V heads of this many elements rotated first; 0 = none
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

// Decode work units (shared by the planner and the kernel).
constexpr int kDecodeTileTokens = 16;   // positions per mma tile
constexpr int kDecodeHeadsPerCta = 8;   // query columns (query head, query token) per CTA
constexpr int kDecodeWarps = 4;         // warps per CTA
constexpr int kDecodeSliceDim = 128;    // head dimensions of a warp's d-slice at most
constexpr int kDecodeMaxQueryLen = FP8KTURBOV_MAX_QUERY_LEN;  // query tokens per sequence at most
constexpr int kDecodeCtasPerSm = 4;     // launch bounds: registers sized for 4 resident CTAs per SM
constexpr int kDecodeMinSplitTiles = 8; // no split shorter than this many tiles
constexpr int kDecodeMaxSplits = 1024;  // partials per query head at most (splits x stream partials)
// Split slots shared by length (DecodePlan::length_shares) where the plan has at least this many
// splits per sequence, of at least this many tiles: finding the shares costs each CTA about a
// microsecond before its first copies, and the merge as much, which shorter splits do not win back,
// and 2 or 3 splits per sequence leave little to share (docs/PERFORMANCE.md, logs 65 and 66).
constexpr int kDecodeLengthShareMinSplits = 4;
constexpr int kDecodeLengthShareMinSplitTiles = 64;
// Head groups (DecodePlan::stream_partials) where the plan's token streams are at least this many
// tiles long: shorter ones lose more to the merge of 4 times the partials than the reads of
// neighbouring heads gain (docs/PERFORMANCE.md, log 54).
constexpr int kDecodeHeadGroupMinStreamTiles = 64;
constexpr int kDecodeMaxCachedDevices = 64;  // devices whose decode facts (occupancy, code version) are cached

// Token streams of a CTA: each warp streams its own tiles, except that with head_dim > 128 the
// warps of a stream share its tiles, a d-slice each. A CTA lasts as long as its longest stream.
__host__ __device__ constexpr int decode_streams_per_cta(int head_dim) {
  return kDecodeWarps / (head_dim > kDecodeSliceDim ? head_dim / kDecodeSliceDim : 1);
}

// Head groups (DecodePlan::stream_partials) have kernel instances where every warp streams tiles
// of its own (up to head_dim 128), for 2- and 3-bit V: 4-bit V, whose tiles are held by their
// shared-memory lookups, measured no faster with them (docs/PERFORMANCE.md, log 54).
__host__ __device__ constexpr bool decode_head_groups_built(int bits, int head_dim) {
  return bits <= 3 && decode_streams_per_cta(head_dim) == kDecodeWarps;
}

// How a decode is split over CTAs (FORMAT §5 does not depend on it; rounding does, so a plan is
// a pure function of the shape, the device's multiprocessor count and the workspace size).
struct DecodePlan {
  uint32_t chunks_per_group;  // CTAs per KV head: ceil(max_q_len * group size / 8)
  uint32_t num_splits;        // context splits per sequence (with length_shares: on average)
  int32_t split_tokens;       // positions per split, a multiple of the 16-token tile (without length_shares)
  // The sequences share the num_seqs * num_splits split slots by length (decode/schedule.cuh), each
  // dividing its range among its own; else each takes num_splits of split_tokens positions.
  bool length_shares;
  // Partials per split and query head. 1: a CTA's warps read one KV head, and the CTA merges their
  // token streams. kDecodeWarps (head groups, where the planner allows them): a CTA's warps read
  // kDecodeWarps neighbouring KV heads, warp w head w, all over one token stream of the split, and
  // each warp writes its head's partial.
  uint32_t stream_partials;
  // When partials > 1: [num_seqs * num_splits slots][max_q_len][num_q_heads][stream_partials][head_dim + 2]
  // floats, as the shares of the slots lay them out (partial_address).
  float* workspace;
};

// Partials per (sequence, query token, query head) that the merge kernel combines; 1 = no
// workspace used, the decode kernel writes the output.
__host__ __device__ inline uint32_t decode_partials(const DecodePlan& plan) {
  return plan.num_splits * plan.stream_partials;
}

// CTAs per KV head: one per chunk of up to kDecodeHeadsPerCta columns, a column being one query
// head of the GQA group for one query token of the sequence (token-major).
inline uint32_t decode_chunks_per_group(uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t max_q_len) {
  return (max_q_len * (num_q_heads / num_kv_heads) + kDecodeHeadsPerCta - 1) / kDecodeHeadsPerCta;
}

// Workspace bytes a plan needs.
inline uint64_t decode_workspace_bytes(const DecodePlan& plan, uint32_t num_seqs, uint32_t max_q_len,
                                       uint32_t num_q_heads, uint32_t head_dim) {
  if (decode_partials(plan) <= 1) return 0;
  return uint64_t(num_seqs) * max_q_len * num_q_heads * decode_partials(plan) * (head_dim + 2) * sizeof(float);
}

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
