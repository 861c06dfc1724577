// The argument rules that several entry points share (api/checks.h).
#include "api/checks.h"

#include <cinttypes>
#include <cmath>

#include "format.cuh"

namespace fp8kturbov {

bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

fp8kturbov_status_t check_alignment(const char* entry, const char* name, const void* p, unsigned alignment) {
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "%s = %p is not %u-byte aligned", name, p, alignment);
  return FP8KTURBOV_STATUS_SUCCESS;
}

bool allows_vector_access(const void* rows, uint64_t stride) {
  return is_aligned16(rows) && stride % 8 == 0;
}

fp8kturbov_status_t check_pool_layout(const char* entry, uint32_t block_size, uint64_t row_elems,
                                      uint32_t bits, const void* k_cache,
                                      uint64_t k_block_stride_bytes, uint64_t v_block_stride_bytes,
                                      uint64_t v_data_section_bytes) {
  const uint64_t k_page = k_page_bytes(block_size, row_elems);
  const uint64_t v_data = fp8kturbov::v_data_section_bytes(block_size, row_elems, bits);
  const uint64_t v_scales = v_scale_section_bytes(block_size, row_elems);
  if (k_block_stride_bytes < k_page)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "k_block_stride_bytes = %" PRIu64 " is smaller than a K page (%" PRIu64 " bytes)",
                k_block_stride_bytes, k_page);
  if (k_block_stride_bytes % 16 != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry,
                "k_block_stride_bytes = %" PRIu64 " is not a multiple of 16", k_block_stride_bytes);
  if (!is_aligned16(k_cache))
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "k_cache = %p is not 16-byte aligned",
                k_cache);
  if (v_data_section_bytes < v_data)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "v_data_section_bytes = %" PRIu64 " is smaller than the packed codes of a page "
                "(%" PRIu64 " bytes)",
                v_data_section_bytes, v_data);
  if (v_data_section_bytes > v_block_stride_bytes ||
      v_block_stride_bytes - v_data_section_bytes < v_scales)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "v_block_stride_bytes = %" PRIu64 " is smaller than v_data_section_bytes + the "
                "scale section (%" PRIu64 " + %" PRIu64 " bytes)",
                v_block_stride_bytes, v_data_section_bytes, v_scales);
  return FP8KTURBOV_STATUS_SUCCESS;
}

fp8kturbov_status_t check_k_scale(const char* entry, float k_scale) {
  if (!std::isfinite(k_scale) || !(k_scale > 0.0f))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "k_scale = %g must be finite and positive", double(k_scale));
  return FP8KTURBOV_STATUS_SUCCESS;
}

fp8kturbov_status_t check_k_inv_scale(const char* entry, float k_scale) {
  if (!std::isfinite(1.0f / k_scale))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "k_scale = %g is too small: 1/k_scale overflows float", double(k_scale));
  return FP8KTURBOV_STATUS_SUCCESS;
}

fp8kturbov_status_t check_pool_extent(const char* entry, const char* pool, const void* base, uint64_t num_blocks,
                                      uint64_t page_bytes) {
  const uint64_t room = UINT64_MAX - uint64_t(reinterpret_cast<uintptr_t>(base));
  if (num_blocks != 0 && page_bytes > room / num_blocks)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_blocks = %" PRIu64 " pages of %" PRIu64 " bytes from %s = %p pass the end of the address space",
                num_blocks, page_bytes, pool, base);
  return FP8KTURBOV_STATUS_SUCCESS;
}

fp8kturbov_status_t check_width(const char* entry, uint32_t v_bits, uint32_t head_dim) {
  if (!is_supported_v_bits(v_bits))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "v_bits = %u is not 2, 3 or 4", v_bits);
  if (head_dim == 0 || head_dim % kGroupElems != 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "head_dim = %u is not a positive multiple of 16", head_dim);
  return FP8KTURBOV_STATUS_SUCCESS;
}

fp8kturbov_status_t check_v_encoder(const char* entry, uint32_t v_encoder) {
  if (v_encoder != FP8KTURBOV_V_ENCODER_MATCHED_NORM && v_encoder != FP8KTURBOV_V_ENCODER_MSE &&
      v_encoder != FP8KTURBOV_V_ENCODER_PROJECTION)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "v_encoder = %u is not FP8KTURBOV_V_ENCODER_MATCHED_NORM (0), _MSE (1) or _PROJECTION (2)",
                v_encoder);
  return FP8KTURBOV_STATUS_SUCCESS;
}

fp8kturbov_status_t check_v_rotation(const char* entry, uint32_t v_rotation, uint32_t head_dim) {
  if (v_rotation != FP8KTURBOV_V_ROTATION_NONE && v_rotation != FP8KTURBOV_V_ROTATION_HADAMARD)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "v_rotation = %u is not FP8KTURBOV_V_ROTATION_NONE (0) or _HADAMARD (1)", v_rotation);
  if (v_rotation == FP8KTURBOV_V_ROTATION_HADAMARD && !rotatable_head_dim(head_dim))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "v_rotation = 1 (HADAMARD) needs head_dim 128, 256 or 512 (the format's sign tables), "
                "not head_dim = %u", head_dim);
  return FP8KTURBOV_STATUS_SUCCESS;
}

}  // namespace fp8kturbov
