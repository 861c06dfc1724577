// The entry points of the per-token operations: the cache write and the dequantize. Each reads
// its params, validates them once, fills the kernel's arguments by field name and launches.
#include <cmath>
#include <type_traits>

#include "api/entry_points.h"
#include "api/errors.h"
#include "api/validate.h"
#include "token_group_args.h"

namespace fp8kturbov {
namespace {

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

}  // namespace

fp8kturbov_status_t write_impl(const char* entry, const fp8kturbov_write_params_t& p, cudaStream_t stream) {
  clear_last_error();
  uint64_t row_elems = 0;
  FP8KTURBOV_CHECK(check_token_rows(entry, p, &row_elems));
  // FORMAT §2 multiplies by 1/k_scale: below ~2^-128 that is inf and a zero key would become NaN.
  if (!std::isfinite(1.0f / p.k_scale))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "k_scale = %g is too small: 1/k_scale overflows float", double(p.k_scale));
  if (p.v_encoder != FP8KTURBOV_V_ENCODER_MATCHED_NORM && p.v_encoder != FP8KTURBOV_V_ENCODER_MSE)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "v_encoder = %u is not FP8KTURBOV_V_ENCODER_MATCHED_NORM (0) or _MSE (1)", p.v_encoder);
  FP8KTURBOV_CHECK(check_v_rotation(entry, p.v_rotation, p.head_dim));
  if (p.num_tokens == 0) return FP8KTURBOV_STATUS_SUCCESS;
  FP8KTURBOV_REQUIRE_POINTER(key);
  FP8KTURBOV_REQUIRE_POINTER(value);
  FP8KTURBOV_REQUIRE_POINTER(k_cache);
  FP8KTURBOV_REQUIRE_POINTER(v_cache);
  FP8KTURBOV_REQUIRE_POINTER(slot_mapping);
  FP8KTURBOV_CHECK(check_bf16_rows_aligned(entry, p.key, p.value));
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, &index_check));

  WriteArgs args{};
  args.key = static_cast<const uint16_t*>(p.key);
  args.value = static_cast<const uint16_t*>(p.value);
  args.k_cache = static_cast<uint8_t*>(p.k_cache);
  args.v_cache = static_cast<uint8_t*>(p.v_cache);
  args.slot_mapping = p.slot_mapping;
  args.num_tokens = p.num_tokens;
  args.row_elems = uint32_t(row_elems);
  args.block_size = p.block_size;
  args.key_stride = p.key_stride;
  args.value_stride = p.value_stride;
  args.key_vector_loads = allows_vector_access(p.key, p.key_stride);
  args.value_vector_loads = allows_vector_access(p.value, p.value_stride);
  args.k_inv_scale = 1.0f / p.k_scale;
  args.k_block_stride_bytes = p.k_block_stride_bytes;
  args.v_block_stride_bytes = p.v_block_stride_bytes;
  args.v_data_section_bytes = p.v_data_section_bytes;
  args.index_check = index_check;
  args.mse_encoder = p.v_encoder == FP8KTURBOV_V_ENCODER_MSE;
  args.rotation_head_dim = p.v_rotation == FP8KTURBOV_V_ROTATION_HADAMARD ? p.head_dim : 0u;
  return launch_for_bits(entry, p.v_bits, [&](auto bits) {
    return launch_reshape_and_cache<decltype(bits)::value>(args, stream);
  });
}

fp8kturbov_status_t dequantize_impl(const char* entry, const fp8kturbov_dequantize_params_t& p,
                                    cudaStream_t stream) {
  clear_last_error();
  uint64_t row_elems = 0;
  FP8KTURBOV_CHECK(check_token_rows(entry, p, &row_elems));
  if (p.num_tokens == 0) return FP8KTURBOV_STATUS_SUCCESS;
  FP8KTURBOV_REQUIRE_POINTER(k_cache);
  FP8KTURBOV_REQUIRE_POINTER(v_cache);
  FP8KTURBOV_REQUIRE_POINTER(slot_mapping);
  FP8KTURBOV_REQUIRE_POINTER(key);
  FP8KTURBOV_REQUIRE_POINTER(value);
  FP8KTURBOV_CHECK(check_bf16_rows_aligned(entry, p.key, p.value));
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, &index_check));


  DequantizeArgs args{};
  args.k_cache = static_cast<const uint8_t*>(p.k_cache);
  args.v_cache = static_cast<const uint8_t*>(p.v_cache);
  args.slot_mapping = p.slot_mapping;
  args.key = static_cast<uint16_t*>(p.key);
  args.value = static_cast<uint16_t*>(p.value);
  args.num_tokens = p.num_tokens;
  args.row_elems = uint32_t(row_elems);
  args.block_size = p.block_size;
  args.key_stride = p.key_stride;
  args.value_stride = p.value_stride;
  args.key_vector_stores = allows_vector_access(p.key, p.key_stride);
  args.value_vector_stores = allows_vector_access(p.value, p.value_stride);
  args.k_scale = p.k_scale;
  args.k_block_stride_bytes = p.k_block_stride_bytes;
  args.v_block_stride_bytes = p.v_block_stride_bytes;
  args.v_data_section_bytes = p.v_data_section_bytes;
  args.index_check = index_check;
  return launch_for_bits(entry, p.v_bits, [&](auto bits) {
    return launch_dequantize<decltype(bits)::value>(args, stream);
  });
}

}  // namespace fp8kturbov
