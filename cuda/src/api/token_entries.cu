// The write's and the dequantize's implementations (api/entry_points.h): validate every scalar
// and pointer once, launch, report. Nothing here allocates, synchronises or reads the runtime's
// sticky error state.
#include <cinttypes>
#include <type_traits>

#include "fp8kturbov.h"
#include "format.cuh"
#include "kernel_args.h"
#include "api/checks.h"
#include "api/entry_points.h"
#include "api/errors.h"

namespace fp8kturbov {
namespace {

// The row and pool rules shared by the write and the dequantize, whose parameter structs name
// the same fields; sets *row_elems.
template <typename Params>
fp8kturbov_status_t check_token_rows(const char* entry, const Params& p, uint64_t* row_elems) {
  FP8KTURBOV_CHECK(check_width(entry, p.v_bits, p.head_dim));
  if (p.num_kv_heads == 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "num_kv_heads = 0");
  if (p.block_size == 0) return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "block_size = 0");
  *row_elems = uint64_t(p.num_kv_heads) * p.head_dim;
  if (*row_elems > UINT32_MAX)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_kv_heads * head_dim = %" PRIu64 " exceeds 2^32 - 1", *row_elems);
  if (p.key_stride < *row_elems)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "key_stride = %u is smaller than a row (%" PRIu64 " elements)", p.key_stride,
                *row_elems);
  if (p.value_stride < *row_elems)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "value_stride = %u is smaller than a row (%" PRIu64 " elements)", p.value_stride,
                *row_elems);
  FP8KTURBOV_CHECK(check_k_scale(entry, p.k_scale));
  FP8KTURBOV_CHECK(check_pool_layout(entry, p.block_size, *row_elems, p.v_bits, p.k_cache,
                                     p.k_block_stride_bytes, p.v_block_stride_bytes,
                                     p.v_data_section_bytes));
  if (per_token_group_ctas(p.num_tokens, *row_elems, 1) > INT32_MAX)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_tokens = %u is too large for one launch at this row size", p.num_tokens);
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The alignment of the write's and the dequantize's arrays, and checked mode's pool extents.
template <typename Params>
fp8kturbov_status_t check_token_pointers(const char* entry, const Params& p) {
  FP8KTURBOV_CHECK_ALIGNED(key, 2);
  FP8KTURBOV_CHECK_ALIGNED(value, 2);
  FP8KTURBOV_CHECK_ALIGNED(slot_mapping, alignof(int64_t));
  FP8KTURBOV_CHECK(check_pool_extent(entry, "k_cache", p.k_cache, p.num_blocks, p.k_block_stride_bytes));
  return check_pool_extent(entry, "v_cache", p.v_cache, p.num_blocks, p.v_block_stride_bytes);
}

// Calls launch(std::integral_constant<int, BITS>) for the built width `bits` and reports it.
template <typename Launch>
fp8kturbov_status_t launch_for_bits(const char* entry, uint32_t bits, Launch launch) {
  switch (bits) {
#define FP8KTURBOV_BITS_CASE(BITS) \
  case BITS:                       \
    return report_launch(launch(std::integral_constant<int, BITS>{}), entry);
#include "dispatch_bits.inc"
#undef FP8KTURBOV_BITS_CASE
    default:
      return fail(FP8KTURBOV_STATUS_NOT_SUPPORTED, entry,
                  "v_bits = %u was not built (CMake option FP8KTURBOV_V_BITS)", bits);
  }
}

// The fields that the write's and the dequantize's Args share, from their params (validated).
template <typename Args, typename Params>
void fill_token_rows(Args* args, const Params& p, uint64_t row_elems, const IndexCheck& index_check) {
  args->k_cache = static_cast<decltype(args->k_cache)>(p.k_cache);
  args->v_cache = static_cast<decltype(args->v_cache)>(p.v_cache);
  args->slot_mapping = p.slot_mapping;
  args->num_tokens = p.num_tokens;
  args->row_elems = uint32_t(row_elems);
  args->block_size = p.block_size;
  args->key_stride = p.key_stride;
  args->value_stride = p.value_stride;
  args->k_block_stride_bytes = p.k_block_stride_bytes;
  args->v_block_stride_bytes = p.v_block_stride_bytes;
  args->v_data_section_bytes = p.v_data_section_bytes;
  args->index_check = index_check;
}

}  // namespace

fp8kturbov_status_t write_impl(const char* entry, const fp8kturbov_write_params_t& p,
                               cudaStream_t stream) {
  g_last_error[0] = '\0';
  uint64_t row_elems = 0;
  FP8KTURBOV_CHECK(check_token_rows(entry, p, &row_elems));
  FP8KTURBOV_CHECK(check_k_inv_scale(entry, p.k_scale));
  FP8KTURBOV_CHECK(check_v_encoder(entry, p.v_encoder));
  FP8KTURBOV_CHECK(check_v_rotation(entry, p.v_rotation, p.head_dim));
  if (p.num_tokens == 0) return FP8KTURBOV_STATUS_SUCCESS;
  FP8KTURBOV_REQUIRE_POINTER(key);
  FP8KTURBOV_REQUIRE_POINTER(value);
  FP8KTURBOV_REQUIRE_POINTER(k_cache);
  FP8KTURBOV_REQUIRE_POINTER(v_cache);
  FP8KTURBOV_REQUIRE_POINTER(slot_mapping);
  FP8KTURBOV_CHECK(check_token_pointers(entry, p));
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, &index_check));

  WriteArgs args{};  // filled by field name
  fill_token_rows(&args, p, row_elems, index_check);
  args.key = static_cast<const uint16_t*>(p.key);
  args.value = static_cast<const uint16_t*>(p.value);
  args.key_vector_loads = allows_vector_access(p.key, p.key_stride);
  args.value_vector_loads = allows_vector_access(p.value, p.value_stride);
  args.k_inv_scale = 1.0f / p.k_scale;
  args.v_encoder = fp8kturbov_v_encoder_t(p.v_encoder);
  args.rotation_head_dim = p.v_rotation == FP8KTURBOV_V_ROTATION_HADAMARD ? p.head_dim : 0u;
  return launch_for_bits(entry, p.v_bits, [&](auto bits) {
    return launch_reshape_and_cache<decltype(bits)::value>(args, stream);
  });
}

fp8kturbov_status_t dequantize_impl(const char* entry, const fp8kturbov_dequantize_params_t& p,
                                    cudaStream_t stream) {
  g_last_error[0] = '\0';
  uint64_t row_elems = 0;
  FP8KTURBOV_CHECK(check_token_rows(entry, p, &row_elems));
  if (p.num_tokens == 0) return FP8KTURBOV_STATUS_SUCCESS;
  FP8KTURBOV_REQUIRE_POINTER(k_cache);
  FP8KTURBOV_REQUIRE_POINTER(v_cache);
  FP8KTURBOV_REQUIRE_POINTER(slot_mapping);
  FP8KTURBOV_REQUIRE_POINTER(key);
  FP8KTURBOV_REQUIRE_POINTER(value);
  FP8KTURBOV_CHECK(check_token_pointers(entry, p));
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, &index_check));

  DequantizeArgs args{};  // filled by field name
  fill_token_rows(&args, p, row_elems, index_check);
  args.key = static_cast<uint16_t*>(p.key);
  args.value = static_cast<uint16_t*>(p.value);
  args.key_vector_stores = allows_vector_access(p.key, p.key_stride);
  args.value_vector_stores = allows_vector_access(p.value, p.value_stride);
  args.k_scale = p.k_scale;
  return launch_for_bits(entry, p.v_bits, [&](auto bits) {
    return launch_dequantize<decltype(bits)::value>(args, stream);
  });
}

}  // namespace fp8kturbov
