// The argument rules that several entry points share: alignment, the page layout, the K scale,
// checked mode, the V encoder and rotation. Each returns SUCCESS or the first violated rule, which
// it records as the calling thread's last error (api/errors.h).
#pragma once

#include <cstdint>

#include "fp8kturbov.h"
#include "kernel_args.h"  // IndexCheck
#include "api/errors.h"

namespace fp8kturbov {

bool is_aligned16(const void* p);

// The kernels load every array at its element's width: a misaligned pointer would fault inside
// the kernel instead of failing here.
fp8kturbov_status_t check_alignment(const char* entry, const char* name, const void* p, unsigned alignment);
#define FP8KTURBOV_CHECK_ALIGNED(field, alignment) \
  FP8KTURBOV_CHECK(check_alignment(entry, #field, static_cast<const void*>(p.field), alignment))

// Whether bf16 rows at `rows`, `stride` elements apart, allow 16-byte accesses.
bool allows_vector_access(const void* rows, uint64_t stride);

// The cache width of any entry: V bits 2, 3 or 4 and a head_dim of whole 16-element groups.
fp8kturbov_status_t check_width(const char* entry, uint32_t v_bits, uint32_t head_dim);

// The K and V page layout (FORMAT §2, §3).
fp8kturbov_status_t check_pool_layout(const char* entry, uint32_t block_size, uint64_t row_elems, uint32_t bits,
                                      const void* k_cache, uint64_t k_block_stride_bytes,
                                      uint64_t v_block_stride_bytes, uint64_t v_data_section_bytes);

fp8kturbov_status_t check_k_scale(const char* entry, float k_scale);

// A K scale to write with: FORMAT §2 multiplies by 1/k_scale, which below ~2^-128 is inf (a zero
// key would become NaN).
fp8kturbov_status_t check_k_inv_scale(const char* entry, float k_scale);

// Checked mode: the pages a pool holds (num_blocks of `page_bytes`) must have addresses, or the
// kernels' page offsets would wrap past 2^64 and reach memory below the pool.
fp8kturbov_status_t check_pool_extent(const char* entry, const char* pool, const void* base, uint64_t num_blocks,
                                      uint64_t page_bytes);

// The V encoder of a write or a decode's append: a known value.
fp8kturbov_status_t check_v_encoder(const char* entry, uint32_t v_encoder);

// The V rotation of a write or a decode: a known value, and FORMAT §6 defines it for this head_dim.
fp8kturbov_status_t check_v_rotation(const char* entry, uint32_t v_rotation, uint32_t head_dim);

// The kernels' IndexCheck from the checked-mode fields. Checked mode (num_blocks > 0) needs the
// device word it reports to; called where the entry's other pointers are checked.
template <typename Params>
fp8kturbov_status_t resolve_index_check(const char* entry, const Params& p, IndexCheck* check) {
  *check = IndexCheck{p.num_blocks, p.num_blocks != 0 ? p.error_flags : nullptr};
  if (p.num_blocks == 0) return FP8KTURBOV_STATUS_SUCCESS;
  if (p.error_flags == nullptr)
    return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "error_flags is NULL");
  FP8KTURBOV_CHECK_ALIGNED(error_flags, alignof(uint32_t));
  return FP8KTURBOV_STATUS_SUCCESS;
}

}  // namespace fp8kturbov
