// The validation rules the entry points share: alignment, the pool layout (FORMAT §2, §3), the
// K scale, the V rotation, checked mode, and the token rows of the write and the dequantize.
// Each rule is written once; an entry point validates its call once, before it plans.
#pragma once

#include <cinttypes>
#include <cstdint>

#include "api/errors.h"
#include "fp8kturbov.h"
#include "index_check.h"
#include "token_group_args.h"  // per_token_group_ctas

namespace fp8kturbov {

inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool is_aligned2(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 1u) == 0; }

// Whether bf16 rows at `rows`, `stride` elements apart, allow 16-byte accesses.
inline bool allows_vector_access(const void* rows, uint64_t stride) { return is_aligned16(rows) && stride % 8 == 0; }

// The write and dequantize kernels access the bf16 rows element by element where they cannot
// vectorise, so an odd address would fault inside the kernel instead of failing here.
fp8kturbov_status_t check_bf16_rows_aligned(const char* entry, const void* key, const void* value);

// The V width, a head_dim of whole 16-element groups, and at least one KV head.
fp8kturbov_status_t check_row_format(const char* entry, uint32_t v_bits, uint32_t head_dim, uint32_t num_kv_heads);

// SUCCESS or the first violated rule of the K and V page layout (FORMAT §2, §3).
fp8kturbov_status_t check_pool_layout(const char* entry, uint32_t block_size, uint64_t row_elems, uint32_t bits,
                                      const void* k_cache, uint64_t k_block_stride_bytes,
                                      uint64_t v_block_stride_bytes, uint64_t v_data_section_bytes);

fp8kturbov_status_t check_k_scale(const char* entry, float k_scale);

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
  if (reinterpret_cast<uintptr_t>(p.error_flags) % alignof(uint32_t) != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "error_flags = %p is not 4-byte aligned",
                static_cast<const void*>(p.error_flags));
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The row and pool rules shared by the write and the dequantize, whose parameter structs name
// the same fields; sets *row_elems.
template <typename Params>
fp8kturbov_status_t check_token_rows(const char* entry, const Params& p, uint64_t* row_elems) {
  FP8KTURBOV_CHECK(check_row_format(entry, p.v_bits, p.head_dim, p.num_kv_heads));
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

}  // namespace fp8kturbov
