// The attention entry points' implementations (api/entry_points.h), the decode and the prefill:
// validate every scalar and pointer once, plan, launch, report. Nothing here allocates, synchronises or reads the runtime's
// sticky error state.
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include <algorithm>
#include <type_traits>

#include "fp8kturbov.h"
#include "format.cuh"
#include "kernel_args.h"
#include "api/checks.h"
#include "api/entry_points.h"
#include "api/errors.h"
#include "plan/decode_plan.h"

namespace fp8kturbov {
namespace {

cudaError_t dispatch_decode(uint32_t bits, uint32_t head_dim, const DecodeArgs& args,
                            const DecodePlan& plan, cudaStream_t stream, bool* built) {
  *built = true;
#define FP8KTURBOV_DECODE_CASE(BITS, HEAD_DIM) \
  if (bits == BITS && head_dim == HEAD_DIM) return launch_paged_decode<BITS, HEAD_DIM>(args, plan, stream);
#include "dispatch_decode.inc"
#undef FP8KTURBOV_DECODE_CASE
  *built = false;
  return cudaSuccess;
}


// The scalar rules that the decode and the prefill share (their params name these fields alike);
// also resolves the K page stride (0 = packed).
template <typename Params>
fp8kturbov_status_t validate_attention(const char* entry, const Params& p, uint64_t* k_block_stride_bytes) {
  FP8KTURBOV_CHECK(check_width(entry, p.v_bits, p.head_dim));
  if (!is_supported_head_dim(p.head_dim))
    return fail(FP8KTURBOV_STATUS_NOT_SUPPORTED, entry,
                "head_dim = %u is not supported (64, 128, 256, 512)", p.head_dim);
  if (p.num_kv_heads == 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "num_kv_heads = 0");
  if (p.num_q_heads == 0 || p.num_q_heads % p.num_kv_heads != 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_q_heads = %u is not a positive multiple of num_kv_heads = %u",
                p.num_q_heads, p.num_kv_heads);
  if (p.num_q_heads > 65535)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "num_q_heads = %u exceeds 65535",
                p.num_q_heads);
  FP8KTURBOV_CHECK(check_v_rotation(entry, p.v_rotation, p.head_dim));
  if (p.block_size == 0) return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "block_size = 0");
  if (p.max_blocks_per_seq == 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "max_blocks_per_seq = 0");
  if (uint64_t(p.max_blocks_per_seq) * p.block_size > INT32_MAX)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "max_blocks_per_seq * block_size = %u * %u exceeds 2^31 - 1 positions",
                p.max_blocks_per_seq, p.block_size);
  if (p.block_tables_stride != 0 && p.block_tables_stride < p.max_blocks_per_seq)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "block_tables_stride = %" PRIu64 " is less than max_blocks_per_seq = %u", p.block_tables_stride,
                p.max_blocks_per_seq);
  const uint64_t row_elems = uint64_t(p.num_kv_heads) * p.head_dim;
  const uint64_t q_row_elems = uint64_t(p.num_q_heads) * p.head_dim;
  if (p.q_stride < q_row_elems)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "q_stride = %u is smaller than num_q_heads * head_dim = %" PRIu64, p.q_stride,
                q_row_elems);
  FP8KTURBOV_CHECK(check_k_scale(entry, p.k_scale));
  if (!std::isfinite(p.inv_sqrt_d))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "inv_sqrt_d = %g is not finite",
                double(p.inv_sqrt_d));
  if (!std::isfinite(p.inv_sqrt_d * p.k_scale))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "inv_sqrt_d * k_scale = %g * %g overflows float", double(p.inv_sqrt_d),
                double(p.k_scale));
  // The kernels scale scores by the product: a nonzero inv_sqrt_d must not become a zero one.
  if (p.inv_sqrt_d != 0.0f && p.inv_sqrt_d * p.k_scale == 0.0f)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "inv_sqrt_d * k_scale = %g * %g underflows float to 0", double(p.inv_sqrt_d),
                double(p.k_scale));
  if (!std::isfinite(p.soft_cap) || p.soft_cap < 0.0f)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "soft_cap = %g must be finite and >= 0",
                double(p.soft_cap));
  *k_block_stride_bytes =
      p.k_block_stride_bytes != 0 ? p.k_block_stride_bytes : k_page_bytes(p.block_size, row_elems);
  FP8KTURBOV_CHECK(check_pool_layout(entry, p.block_size, row_elems, p.v_bits, p.k_cache,
                                     *k_block_stride_bytes, p.v_block_stride_bytes,
                                     p.v_data_section_bytes));
  if (p.v_block_stride_bytes % kDecodeVAlignment != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry,
                "v_block_stride_bytes = %" PRIu64 " is not a multiple of %u",
                p.v_block_stride_bytes, kDecodeVAlignment);
  if (p.v_data_section_bytes % kDecodeVAlignment != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry,
                "v_data_section_bytes = %" PRIu64 " is not a multiple of %u",
                p.v_data_section_bytes, kDecodeVAlignment);
  if (reinterpret_cast<uintptr_t>(p.v_cache) % kDecodeVAlignment != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "v_cache = %p is not %u-byte aligned",
                p.v_cache, kDecodeVAlignment);
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The pointers that the decode and the prefill share, once there is work; sets the index check.
template <typename Params>
fp8kturbov_status_t check_attention_pointers(const char* entry, const Params& p, uint64_t k_block_stride_bytes,
                                             IndexCheck* index_check) {
  FP8KTURBOV_REQUIRE_POINTER(q);
  FP8KTURBOV_REQUIRE_POINTER(k_cache);
  FP8KTURBOV_REQUIRE_POINTER(v_cache);
  FP8KTURBOV_REQUIRE_POINTER(output);
  FP8KTURBOV_REQUIRE_POINTER(block_tables);
  FP8KTURBOV_REQUIRE_POINTER(seq_lens);
  if (p.workspace_bytes > 0) {
    FP8KTURBOV_REQUIRE_POINTER(workspace);
    if (!is_aligned16(p.workspace))
      return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "workspace = %p is not 16-byte aligned",
                  p.workspace);
  }
  FP8KTURBOV_CHECK_ALIGNED(q, 2);
  FP8KTURBOV_CHECK_ALIGNED(output, 2);
  FP8KTURBOV_CHECK_ALIGNED(block_tables, alignof(int32_t));
  FP8KTURBOV_CHECK_ALIGNED(seq_lens, alignof(int32_t));
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, index_check));
  FP8KTURBOV_CHECK(check_pool_extent(entry, "k_cache", p.k_cache, p.num_blocks, k_block_stride_bytes));
  FP8KTURBOV_CHECK(check_pool_extent(entry, "v_cache", p.v_cache, p.num_blocks, p.v_block_stride_bytes));
  FP8KTURBOV_CHECK_ALIGNED(sinks, alignof(float));
  FP8KTURBOV_CHECK_ALIGNED(query_start, alignof(int32_t));
  return FP8KTURBOV_STATUS_SUCCESS;
}

// Every scalar rule of a decode; also resolves the K page stride (0 = packed).
fp8kturbov_status_t validate_decode(const char* entry, const fp8kturbov_decode_params_t& p,
                                    uint64_t* k_block_stride_bytes) {
  FP8KTURBOV_CHECK(validate_attention(entry, p, k_block_stride_bytes));
  if (p.max_q_len > kDecodeMaxQueryLen)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "max_q_len = %u exceeds %d", p.max_q_len,
                kDecodeMaxQueryLen);
  FP8KTURBOV_CHECK(check_v_encoder(entry, p.v_encoder));
  // One CTA per (sequence, KV head, chunk of 8 query columns) at least; a grid holds < 2^31.
  const uint64_t base_ctas = uint64_t(p.num_seqs) * p.num_kv_heads *
                             decode_chunks_per_group(p.num_q_heads, p.num_kv_heads, query_rows_per_seq(p));
  if (base_ctas > INT32_MAX)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_seqs = %u needs %" PRIu64 " CTAs (num_seqs * num_kv_heads * "
                "ceil(max_q_len * group size / 8)), more than 2^31 - 1", p.num_seqs, base_ctas);
  if (!std::isfinite(p.sparse_v_threshold) || p.sparse_v_threshold < 0.0f)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "sparse_v_threshold = %g must be finite and >= 0", double(p.sparse_v_threshold));
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The fused append's fields (off with a NULL append_slot_mapping): its rows as the write's.
fp8kturbov_status_t check_append(const char* entry, const fp8kturbov_decode_params_t& p) {
  if (p.append_slot_mapping == nullptr) return FP8KTURBOV_STATUS_SUCCESS;
  FP8KTURBOV_REQUIRE_POINTER(append_key);
  FP8KTURBOV_REQUIRE_POINTER(append_value);
  FP8KTURBOV_CHECK_ALIGNED(append_key, 2);
  FP8KTURBOV_CHECK_ALIGNED(append_value, 2);
  FP8KTURBOV_CHECK_ALIGNED(append_slot_mapping, alignof(int64_t));
  const uint64_t row_elems = uint64_t(p.num_kv_heads) * p.head_dim;
  if (p.append_key_stride < row_elems)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "append_key_stride = %u is smaller than a row (%" PRIu64 " elements)", p.append_key_stride, row_elems);
  if (p.append_value_stride < row_elems)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "append_value_stride = %u is smaller than a row (%" PRIu64 " elements)", p.append_value_stride,
                row_elems);
  return check_k_inv_scale(entry, p.k_scale);
}

// Division of positions (< 2^31) by a runtime divisor with a multiply and a shift: the round-up
// reciprocal method (Granlund and Montgomery).
struct FastDivider {
  uint32_t multiplier;
  uint32_t shift;
};
FastDivider fast_divider(uint32_t divisor) {
  uint32_t shift = 0;
  while ((uint64_t(1) << shift) < divisor) ++shift;
  const uint64_t multiplier = ((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor)) / divisor + 1;
  return {uint32_t(multiplier), shift};
}

// The kernel arguments that the decode and the prefill share (DecodeArgs and PrefillArgs name them
// alike), from validated params.
template <typename Params, typename Args>
void fill_attention_args(const Params& p, uint64_t k_block_stride_bytes, const IndexCheck& index_check, Args& args) {
  const FastDivider divider = fast_divider(p.block_size);
  args.q = static_cast<const uint16_t*>(p.q);
  args.k_cache = static_cast<const uint8_t*>(p.k_cache);
  args.v_cache = static_cast<const uint8_t*>(p.v_cache);
  args.output = static_cast<uint16_t*>(p.output);
  args.block_tables = p.block_tables;
  args.seq_lens = p.seq_lens;
  args.query_start = p.query_start;
  args.max_blocks_per_seq = p.max_blocks_per_seq;
  args.block_tables_stride = p.block_tables_stride != 0 ? p.block_tables_stride : p.max_blocks_per_seq;
  args.num_seqs = p.num_seqs;
  args.num_q_heads = p.num_q_heads;
  args.num_kv_heads = p.num_kv_heads;
  args.block_size = p.block_size;
  args.block_size_multiplier = divider.multiplier;
  args.block_size_shift = divider.shift;
  args.score_scale = p.inv_sqrt_d * p.k_scale;
  args.q_stride = p.q_stride;
  args.k_block_stride_bytes = k_block_stride_bytes;
  args.v_block_stride_bytes = p.v_block_stride_bytes;
  args.v_data_section_bytes = p.v_data_section_bytes;
  args.sliding_window = p.sliding_window;
  args.sinks = p.sinks;
  args.soft_cap = p.soft_cap;
  args.rotated_v = p.v_rotation == FP8KTURBOV_V_ROTATION_HADAMARD;
  args.index_check = index_check;
}

// The launch of an attention instance as its entry reports it: NOT_SUPPORTED where the (v_bits,
// head_dim) instance was not built, else the launch's own error.
template <typename Params>
fp8kturbov_status_t report_attention_launch(const char* entry, const Params& p, bool built, cudaError_t err) {
  if (!built)
    return fail(FP8KTURBOV_STATUS_NOT_SUPPORTED, entry,
                "v_bits = %u with head_dim = %u was not built (CMake options FP8KTURBOV_V_BITS, "
                "FP8KTURBOV_HEAD_DIMS)",
                p.v_bits, p.head_dim);
  return report_launch(err, entry);
}

// The params without their pools: a workspace query validates the scalars alone, pointers not
// being part of the question.
template <typename Params>
Params without_pools(const Params& p) {
  Params scalars = p;
  scalars.k_cache = nullptr;
  scalars.v_cache = nullptr;
  return scalars;
}

cudaError_t dispatch_decode_ctas_per_sm(int device, uint32_t bits, uint32_t head_dim, bool head_groups, int* count) {
#define FP8KTURBOV_DECODE_CASE(BITS, HEAD_DIM) \
  if (bits == BITS && head_dim == HEAD_DIM) return decode_ctas_per_sm<BITS, HEAD_DIM>(device, head_groups, count);
#include "dispatch_decode.inc"
#undef FP8KTURBOV_DECODE_CASE
  *count = 1;  // not built: the launch reports it
  return cudaSuccess;
}

// The plan of a validated decode on the current device with `workspace_bytes` of workspace: cached
// attribute and occupancy queries, no synchronisation.
fp8kturbov_status_t plan_decode_on_device(const char* entry, const fp8kturbov_decode_params_t& p,
                                          uint64_t workspace_bytes, DecodePlan* plan) {
  DecodeDevice device;
  int ordinal = 0;
  cudaError_t err = cudaGetDevice(&ordinal);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&device.multiprocessors, cudaDevAttrMultiProcessorCount, ordinal);
  if (err != cudaSuccess) return report_cuda(err, entry, "device query");
  err = dispatch_decode_ctas_per_sm(ordinal, p.v_bits, p.head_dim, false, &device.ctas_per_sm);
  if (err == cudaSuccess) err = dispatch_decode_ctas_per_sm(ordinal, p.v_bits, p.head_dim, true, &device.head_group_ctas_per_sm);
  if (err != cudaSuccess) return report_cuda(err, entry, "occupancy query");
  *plan = plan_decode(p, device, workspace_bytes);
  return FP8KTURBOV_STATUS_SUCCESS;
}

}  // namespace

fp8kturbov_status_t decode_impl(const char* entry, const fp8kturbov_decode_params_t& p,
                                cudaStream_t stream) {
  g_last_error[0] = '\0';
  uint64_t k_block_stride_bytes = 0;
  FP8KTURBOV_CHECK(validate_decode(entry, p, &k_block_stride_bytes));
  if (p.num_seqs == 0) return FP8KTURBOV_STATUS_SUCCESS;
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(check_attention_pointers(entry, p, k_block_stride_bytes, &index_check));
  if (p.max_q_len > 1 && p.query_start == nullptr)
    return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry,
                "query_start is NULL but max_q_len = %u (more than one query row per sequence)",
                p.max_q_len);
  FP8KTURBOV_CHECK(check_append(entry, p));
  DecodePlan plan{};
  FP8KTURBOV_CHECK(plan_decode_on_device(entry, p, p.workspace_bytes, &plan));
  const uint64_t row_elems = uint64_t(p.num_kv_heads) * p.head_dim;

  DecodeArgs args{};  // filled by field name
  fill_attention_args(p, k_block_stride_bytes, index_check, args);
  args.sparse_v_threshold = p.sparse_v_threshold;
  args.v_code_copy_bytes = decode_v_code_copy_bytes(reinterpret_cast<uintptr_t>(p.v_cache), p.v_block_stride_bytes,
                                                    v_data_section_bytes(1, row_elems, p.v_bits));
  args.max_q_len = p.query_start != nullptr ? query_rows_per_seq(p) : 1u;
  args.num_query_rows = p.query_start != nullptr ? p.num_query_rows : p.num_seqs;
  if (p.append_slot_mapping != nullptr) {
    AppendArgs& append = args.append;
    append.key = static_cast<const uint16_t*>(p.append_key);
    append.value = static_cast<const uint16_t*>(p.append_value);
    append.slot_mapping = p.append_slot_mapping;
    // The fused append writes the pools the decode reads (fp8kturbov.h: writable then).
    append.k_cache = static_cast<uint8_t*>(const_cast<void*>(p.k_cache));
    append.v_cache = static_cast<uint8_t*>(const_cast<void*>(p.v_cache));
    append.key_stride = p.append_key_stride;
    append.value_stride = p.append_value_stride;
    append.key_vector_loads = allows_vector_access(p.append_key, p.append_key_stride);
    append.value_vector_loads = allows_vector_access(p.append_value, p.append_value_stride);
    append.k_inv_scale = 1.0f / p.k_scale;
    append.v_encoder = fp8kturbov_v_encoder_t(p.v_encoder);
  }
  bool built = false;
  const cudaError_t err = dispatch_decode(p.v_bits, p.head_dim, args, plan, stream, &built);
  return report_attention_launch(entry, p, built, err);
}

fp8kturbov_status_t decode_workspace_impl(const char* entry, const fp8kturbov_decode_params_t& p,
                                          uint64_t* workspace_bytes) {
  g_last_error[0] = '\0';
  if (workspace_bytes == nullptr)
    return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "workspace_bytes is NULL");
  uint64_t k_block_stride_bytes = 0;
  FP8KTURBOV_CHECK(validate_decode(entry, without_pools(p), &k_block_stride_bytes));
  *workspace_bytes = 0;
  if (p.num_seqs == 0) return FP8KTURBOV_STATUS_SUCCESS;
  DecodePlan plan{};
  FP8KTURBOV_CHECK(plan_decode_on_device(entry, p, UINT64_MAX, &plan));
  *workspace_bytes = decode_workspace_bytes(plan, p.num_seqs, query_rows_per_seq(p), p.num_q_heads, p.head_dim);
  return FP8KTURBOV_STATUS_SUCCESS;
}

namespace {

cudaError_t dispatch_prefill(uint32_t bits, uint32_t head_dim, const PrefillArgs& args, cudaStream_t stream,
                             bool* built) {
  *built = true;
#define FP8KTURBOV_PREFILL_CASE(BITS, HEAD_DIM) \
  if (bits == BITS && head_dim == HEAD_DIM) return launch_paged_prefill<BITS, HEAD_DIM>(args, stream);
#include "dispatch_prefill.inc"
#undef FP8KTURBOV_PREFILL_CASE
  *built = false;
  return cudaSuccess;
}

// Every scalar rule of a prefill; also resolves the K page stride (0 = packed).
fp8kturbov_status_t validate_prefill(const char* entry, const fp8kturbov_prefill_params_t& p,
                                     uint64_t* k_block_stride_bytes) {
  FP8KTURBOV_CHECK(validate_attention(entry, p, k_block_stride_bytes));
  if (p.head_dim > kPrefillMaxHeadDim)
    return fail(FP8KTURBOV_STATUS_NOT_SUPPORTED, entry, "head_dim = %u is not supported by the prefill (64, 128, 256)",
                p.head_dim);
  if (p.num_kv_heads > 65535)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "num_kv_heads = %u exceeds 65535", p.num_kv_heads);
  if (uint64_t(p.max_q_len) > uint64_t(p.max_blocks_per_seq) * p.block_size)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "max_q_len = %u exceeds the positions of a block-table row (max_blocks_per_seq * block_size = %u * %u)",
                p.max_q_len, p.max_blocks_per_seq, p.block_size);
  // The kernel counts a chunk's (token, query head) rows in 32 bits.
  const uint64_t chunk_rows = uint64_t(p.max_q_len) * (p.num_q_heads / p.num_kv_heads);
  if (chunk_rows > INT32_MAX - kPrefillQueryRows)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "max_q_len * group size = %u * %u exceeds 2^31 - %u rows", p.max_q_len,
                p.num_q_heads / p.num_kv_heads, kPrefillQueryRows + 1);
  const uint64_t ctas = uint64_t(p.num_seqs) * prefill_tiles_per_seq(p);
  if (ctas > INT32_MAX)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_seqs = %u needs %" PRIu64 " CTAs per KV head (num_seqs * ceil(max_q_len * group size / %u)), "
                "more than 2^31 - 1", p.num_seqs, ctas, kPrefillQueryRows);
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The plan of a validated prefill on the current device with `workspace_bytes` of workspace: cached
// attribute and occupancy queries, no synchronisation. The prefill's tensor-core instructions need
// the device to be sm_80 or newer.
fp8kturbov_status_t plan_prefill_on_device(const char* entry, const fp8kturbov_prefill_params_t& p,
                                           uint64_t workspace_bytes, PrefillPlan* plan) {
  int device = 0, multiprocessors = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return report_cuda(err, entry, "device query");
  if (major < 8)
    return fail(FP8KTURBOV_STATUS_NOT_SUPPORTED, entry,
                "the prefill needs compute capability 8.0 or newer (device %d is %d.x)", device, major);
  // The warp-specialised kernel runs where this library holds sm_90a code (FP8KTURBOV_PREFILL_WS,
  // from the architecture list) and the device is 9.0, the only one that code runs on, and only for
  // chunks of more than one 64-row tile: a chunk that fills one (16 tokens of 4 query heads) would
  // leave half of its 128 rows empty and took 25-41 % longer there than the 64-row kernel.
  const bool warp_specialized = FP8KTURBOV_PREFILL_WS && major == 9 && minor == 0 && prefill_tiles_per_seq(p) > 1;
  int ctas_per_sm = 1;
#define FP8KTURBOV_PREFILL_CASE(BITS, HEAD_DIM) \
  if (p.v_bits == BITS && p.head_dim == HEAD_DIM) \
    err = prefill_ctas_per_sm<BITS, HEAD_DIM>(device, warp_specialized, &ctas_per_sm);
#include "dispatch_prefill.inc"
#undef FP8KTURBOV_PREFILL_CASE
  if (err != cudaSuccess) return report_cuda(err, entry, "occupancy query");
  *plan = plan_prefill(p, multiprocessors, ctas_per_sm, workspace_bytes,
                       warp_specialized ? kPrefillWsQueryRows : kPrefillQueryRows);
  return FP8KTURBOV_STATUS_SUCCESS;
}

}  // namespace

fp8kturbov_status_t prefill_impl(const char* entry, const fp8kturbov_prefill_params_t& p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  uint64_t k_block_stride_bytes = 0;
  FP8KTURBOV_CHECK(validate_prefill(entry, p, &k_block_stride_bytes));
  if (p.num_seqs == 0 || p.max_q_len == 0) return FP8KTURBOV_STATUS_SUCCESS;
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(check_attention_pointers(entry, p, k_block_stride_bytes, &index_check));
  FP8KTURBOV_REQUIRE_POINTER(query_start);
  FP8KTURBOV_CHECK_ALIGNED(lse, alignof(float));
  PrefillPlan plan{};
  FP8KTURBOV_CHECK(plan_prefill_on_device(entry, p, p.workspace_bytes, &plan));

  PrefillArgs args{};  // filled by field name
  fill_attention_args(p, k_block_stride_bytes, index_check, args);
  args.lse = p.lse;
  args.group_size = p.num_q_heads / p.num_kv_heads;
  args.q_vector_loads = allows_vector_access(p.q, p.q_stride);
  args.output_vector_stores = is_aligned16(p.output);  // rows of num_q_heads * head_dim: multiples of 8
  args.max_q_len = p.max_q_len;
  args.num_query_rows = p.num_query_rows;
  args.tiles_per_seq = uint32_t(prefill_tiles_per_seq(p, plan.query_rows));
  args.query_tile_rows = plan.query_rows;
  args.num_splits = plan.num_splits;
  args.split_positions = plan.split_positions;
  if (plan.num_splits > 1) {  // [partial rows][head_dim] floats, then a float per partial row
    args.partial_o = static_cast<float*>(p.workspace);
    args.partial_lse = args.partial_o + uint64_t(plan.num_splits) * p.num_query_rows * p.num_q_heads * p.head_dim;
  }
  if (plan.expanded_tiles > 0) {
    args.expanded_kv = static_cast<uint8_t*>(p.workspace) +
                       prefill_expanded_offset(plan, p.num_query_rows, p.num_q_heads, p.head_dim);
    args.expanded_tiles = plan.expanded_tiles;
    args.expanded_tile_bytes = prefill_expanded_tile_bytes(p.head_dim);
  }
  bool built = false;
  const cudaError_t err = dispatch_prefill(p.v_bits, p.head_dim, args, stream, &built);
  return report_attention_launch(entry, p, built, err);
}

fp8kturbov_status_t prefill_workspace_impl(const char* entry, const fp8kturbov_prefill_params_t& p,
                                           uint64_t* workspace_bytes) {
  g_last_error[0] = '\0';
  if (workspace_bytes == nullptr)
    return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "workspace_bytes is NULL");
  uint64_t k_block_stride_bytes = 0;
  FP8KTURBOV_CHECK(validate_prefill(entry, without_pools(p), &k_block_stride_bytes));
  *workspace_bytes = 0;
  if (p.num_seqs == 0 || p.max_q_len == 0) return FP8KTURBOV_STATUS_SUCCESS;
  PrefillPlan plan{};
  FP8KTURBOV_CHECK(plan_prefill_on_device(entry, p, UINT64_MAX, &plan));
  *workspace_bytes = prefill_workspace_bytes(plan, p);
  return FP8KTURBOV_STATUS_SUCCESS;
}

}  // namespace fp8kturbov
