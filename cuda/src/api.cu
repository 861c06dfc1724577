// The C entry points: check the struct size, validate every scalar, dispatch, launch, report.
// Nothing here allocates, synchronises or reads the runtime's sticky error state.
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include <algorithm>
#include <type_traits>

#include "fp8kturbov.h"
#include "format.cuh"
#include "entry_points.h"
#include "kernel_args.h"

namespace fp8kturbov {
namespace {

thread_local char g_last_error[512];

// Records the detail message of the failing call and returns its status.
fp8kturbov_status_t fail(fp8kturbov_status_t status, const char* entry, const char* fmt, ...) {
  int used = std::snprintf(g_last_error, sizeof g_last_error, "%s: ", entry);
  if (used < 0) used = 0;
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error + used, sizeof g_last_error - used, fmt, args);
  va_end(args);
  return status;
}

fp8kturbov_status_t report_cuda(cudaError_t err, const char* entry, const char* what) {
  if (err == cudaSuccess) return FP8KTURBOV_STATUS_SUCCESS;
  return fail(FP8KTURBOV_STATUS_CUDA_ERROR, entry, "%s failed: %s (%s)", what,
              cudaGetErrorName(err), cudaGetErrorString(err));
}

fp8kturbov_status_t report_launch(cudaError_t err, const char* entry) {
  return report_cuda(err, entry, "kernel launch");
}

bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
bool is_aligned2(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 1u) == 0; }

// Whether bf16 rows at `rows`, `stride` elements apart, allow 16-byte accesses.
bool allows_vector_access(const void* rows, uint64_t stride) {
  return is_aligned16(rows) && stride % 8 == 0;
}

// The write and dequantize kernels access the bf16 rows element by element where they cannot
// vectorise, so an odd address would fault inside the kernel instead of failing here.
fp8kturbov_status_t check_bf16_rows_aligned(const char* entry, const void* key, const void* value) {
  if (!is_aligned2(key))
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "key = %p is not 2-byte aligned", key);
  if (!is_aligned2(value))
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "value = %p is not 2-byte aligned", value);
  return FP8KTURBOV_STATUS_SUCCESS;
}

// Returns SUCCESS or the first violated rule of the K and V page layout (FORMAT §2, §3).
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

#define FP8KTURBOV_CHECK(expr)                                \
  do {                                                        \
    const fp8kturbov_status_t status_ = (expr);               \
    if (status_ != FP8KTURBOV_STATUS_SUCCESS) return status_; \
  } while (0)

#define FP8KTURBOV_REQUIRE_POINTER(field)                                                   \
  do {                                                                                      \
    if (p.field == nullptr)                                                                 \
      return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "%s is NULL", #field);              \
  } while (0)

// A params struct size this library knows (`what` names it in the error): this header's, or that of
// an earlier version of the struct (`versions`, oldest first).
template <typename Params, size_t VERSIONS>
fp8kturbov_status_t check_struct_size(const char* entry, const char* what, size_t given,
                                      const size_t (&versions)[VERSIONS]) {
  bool known = given == sizeof(Params);
  char sizes[96];
  int used = 0;
  for (size_t v = 0; v < VERSIONS; ++v) {
    known = known || given == versions[v];
    used += std::snprintf(sizes + used, sizeof sizes - used, "%zu (version %zu), ", versions[v], v + 1);
  }
  if (!known)
    return fail(FP8KTURBOV_STATUS_BAD_STRUCT_SIZE, entry,
                "%s = %zu, this library knows %s%zu", what, given, sizes, sizeof(Params));
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The caller's params struct as this library's; the fields a smaller (earlier) struct lacks read
// as 0.
template <typename Params, size_t VERSIONS>
fp8kturbov_status_t read_params(const char* entry, const Params* params,
                                const size_t (&versions)[VERSIONS], Params* out) {
  if (params == nullptr) return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "params is NULL");
  FP8KTURBOV_CHECK(check_struct_size<Params>(entry, "params->struct_size", params->struct_size, versions));
  *out = Params{};
  std::memcpy(out, params, params->struct_size);
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The defaults of a params struct (every default lies in the first version of the struct, so a
// prefix of it is the defaults of that version).
void set_defaults(fp8kturbov_write_params_t* p) { p->v_bits = FP8KTURBOV_DEFAULT_V_BITS; }
void set_defaults(fp8kturbov_dequantize_params_t* p) { p->v_bits = FP8KTURBOV_DEFAULT_V_BITS; }
void set_defaults(fp8kturbov_decode_params_t* p) {
  p->v_bits = FP8KTURBOV_DEFAULT_V_BITS;
  p->sparse_v_threshold = FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD;
}

// *_params_init_sized: the defaults of the struct version of `size` bytes, written over exactly
// `size` bytes of *params.
template <typename Params, size_t VERSIONS>
fp8kturbov_status_t init_params(const char* entry, Params* params, size_t size,
                                const size_t (&versions)[VERSIONS]) {
  if (params == nullptr) return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "params is NULL");
  FP8KTURBOV_CHECK(check_struct_size<Params>(entry, "struct_size", size, versions));
  Params defaults{};
  set_defaults(&defaults);
  defaults.struct_size = size;
  std::memcpy(params, &defaults, size);
  return FP8KTURBOV_STATUS_SUCCESS;
}
constexpr size_t kWriteParamsVersions[] = {FP8KTURBOV_WRITE_PARAMS_V1_SIZE, FP8KTURBOV_WRITE_PARAMS_V2_SIZE};
constexpr size_t kDequantizeParamsVersions[] = {FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE};
constexpr size_t kDecodeParamsVersions[] = {FP8KTURBOV_DECODE_PARAMS_V1_SIZE, FP8KTURBOV_DECODE_PARAMS_V2_SIZE,
                                             FP8KTURBOV_DECODE_PARAMS_V3_SIZE};
static_assert(offsetof(fp8kturbov_write_params_t, num_blocks) == FP8KTURBOV_WRITE_PARAMS_V1_SIZE,
              "the version-1 write struct ends where the checked-mode fields begin");
static_assert(offsetof(fp8kturbov_write_params_t, v_encoder) == FP8KTURBOV_WRITE_PARAMS_V2_SIZE,
              "the version-2 write struct ends where v_encoder begins");
static_assert(offsetof(fp8kturbov_dequantize_params_t, num_blocks) == FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE,
              "the version-1 dequantize struct ends where the checked-mode fields begin");
static_assert(offsetof(fp8kturbov_decode_params_t, num_blocks) == FP8KTURBOV_DECODE_PARAMS_V1_SIZE,
              "the version-1 decode struct ends where the checked-mode fields begin");
static_assert(offsetof(fp8kturbov_decode_params_t, sinks) == FP8KTURBOV_DECODE_PARAMS_V2_SIZE,
              "the version-2 decode struct ends where sinks begins");
static_assert(offsetof(fp8kturbov_decode_params_t, block_tables_stride) == FP8KTURBOV_DECODE_PARAMS_V3_SIZE &&
                  sizeof(fp8kturbov_decode_params_t) > FP8KTURBOV_DECODE_PARAMS_V3_SIZE,
              "the version-3 decode struct ends where block_tables_stride begins");

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

}  // namespace

namespace {

// The row and pool rules shared by the write and the dequantize, whose parameter structs name
// the same fields; sets *row_elems.
template <typename Params>
fp8kturbov_status_t check_token_rows(const char* entry, const Params& p, uint64_t* row_elems) {
  if (!is_supported_v_bits(p.v_bits))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "v_bits = %u is not 2, 3 or 4", p.v_bits);
  if (p.head_dim == 0 || p.head_dim % kGroupElems != 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "head_dim = %u is not a positive multiple of 16", p.head_dim);
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

// The V rotation of a write or a decode: a known value, and FORMAT §6 defines it for this head_dim.
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

}  // namespace

fp8kturbov_status_t write_impl(const char* entry, const fp8kturbov_write_params_t& p,
                               cudaStream_t stream) {
  g_last_error[0] = '\0';
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

  const WriteArgs args{static_cast<const uint16_t*>(p.key),
                       static_cast<const uint16_t*>(p.value),
                       static_cast<uint8_t*>(p.k_cache),
                       static_cast<uint8_t*>(p.v_cache),
                       p.slot_mapping,
                       p.num_tokens,
                       uint32_t(row_elems),
                       p.block_size,
                       p.key_stride,
                       p.value_stride,
                       allows_vector_access(p.key, p.key_stride),
                       allows_vector_access(p.value, p.value_stride),
                       1.0f / p.k_scale,
                       p.k_block_stride_bytes,
                       p.v_block_stride_bytes,
                       p.v_data_section_bytes,
                       index_check,
                       p.v_encoder == FP8KTURBOV_V_ENCODER_MSE,
                       p.v_rotation == FP8KTURBOV_V_ROTATION_HADAMARD ? p.head_dim : 0u};
  return launch_for_bits(entry, p.v_bits, [&](auto bits) {
    return launch_reshape_and_cache<decltype(bits)::value>(args, stream);
  });
}

namespace {

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
  FP8KTURBOV_CHECK(check_bf16_rows_aligned(entry, p.key, p.value));
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, &index_check));

  const DequantizeArgs args{static_cast<const uint8_t*>(p.k_cache),
                            static_cast<const uint8_t*>(p.v_cache),
                            p.slot_mapping,
                            static_cast<uint16_t*>(p.key),
                            static_cast<uint16_t*>(p.value),
                            p.num_tokens,
                            uint32_t(row_elems),
                            p.block_size,
                            p.key_stride,
                            p.value_stride,
                            allows_vector_access(p.key, p.key_stride),
                            allows_vector_access(p.value, p.value_stride),
                            p.k_scale,
                            p.k_block_stride_bytes,
                            p.v_block_stride_bytes,
                            p.v_data_section_bytes,
                            index_check};
  return launch_for_bits(entry, p.v_bits, [&](auto bits) {
    return launch_dequantize<decltype(bits)::value>(args, stream);
  });
}

}  // namespace

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

// Query rows per sequence the grid and the workspace are sized for: max_q_len, where 0 means 1.
uint32_t query_rows_per_seq(const fp8kturbov_decode_params_t& p) { return std::max(p.max_q_len, 1u); }

// Every scalar rule of a decode; also resolves the K page stride (0 = packed).
fp8kturbov_status_t validate_decode(const char* entry, const fp8kturbov_decode_params_t& p,
                                    uint64_t* k_block_stride_bytes) {
  if (!is_supported_v_bits(p.v_bits))
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "v_bits = %u is not 2, 3 or 4", p.v_bits);
  if (p.head_dim == 0 || p.head_dim % kGroupElems != 0)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "head_dim = %u is not a positive multiple of 16", p.head_dim);
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
  if (p.max_q_len > kDecodeMaxQueryLen)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry, "max_q_len = %u exceeds %d", p.max_q_len,
                kDecodeMaxQueryLen);
  FP8KTURBOV_CHECK(check_v_rotation(entry, p.v_rotation, p.head_dim));
  // One CTA per (sequence, KV head, chunk of 8 query columns) at least; a grid holds < 2^31.
  const uint64_t base_ctas = uint64_t(p.num_seqs) * p.num_kv_heads *
                             decode_chunks_per_group(p.num_q_heads, p.num_kv_heads, query_rows_per_seq(p));
  if (base_ctas > INT32_MAX)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "num_seqs = %u needs %" PRIu64 " CTAs (num_seqs * num_kv_heads * "
                "ceil(max_q_len * group size / 8)), more than 2^31 - 1", p.num_seqs, base_ctas);
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
  // The kernel scales scores by the product: a nonzero inv_sqrt_d must not become a zero one.
  if (p.inv_sqrt_d != 0.0f && p.inv_sqrt_d * p.k_scale == 0.0f)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "inv_sqrt_d * k_scale = %g * %g underflows float to 0", double(p.inv_sqrt_d),
                double(p.k_scale));
  if (!std::isfinite(p.sparse_v_threshold) || p.sparse_v_threshold < 0.0f)
    return fail(FP8KTURBOV_STATUS_INVALID_VALUE, entry,
                "sparse_v_threshold = %g must be finite and >= 0", double(p.sparse_v_threshold));
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

// The split plan. The CTAs of a decode run in waves of multiprocessors * ctas_per_sm, and a CTA
// lasts as long as its busiest token stream (decode_streams_per_cta): a split of 33 tiles over 4
// streams runs 9, 8, 8 and 8 tiles, as long as one of 36. So the plan takes the split count with
// the fewest tile times, waves × tiles per stream (the fewest splits of equal ones), with splits
// cut into whole tiles per stream, each at least kDecodeMinSplitTiles tiles long, and no split
// unless the workspace holds the partials. Then head groups (DecodePlan::stream_partials) where
// they are allowed and the token streams are long. A pure function of the shape, the device and
// the workspace size.
constexpr uint64_t kDecodeMaxWaves = 8;  // splits add CTAs up to this many waves at most

uint64_t tiles_per_sequence(const fp8kturbov_decode_params_t& p) {
  const uint64_t table_positions = uint64_t(p.max_blocks_per_seq) * p.block_size;
  // The query tokens of a sequence attend windows that end at consecutive positions.
  const uint64_t window_span = uint64_t(p.sliding_window) + query_rows_per_seq(p) - 1;
  const uint64_t span = p.sliding_window > 0 && window_span < table_positions ? window_span : table_positions;
  // Tiles sit on multiples of 16 positions: an unaligned window start adds at most one tile.
  const uint64_t unaligned_start = p.sliding_window > 0 ? kDecodeTileTokens - 1 : 0;
  return (span + unaligned_start + kDecodeTileTokens - 1) / kDecodeTileTokens;
}

// The device facts a plan depends on.
struct DecodeDevice {
  int multiprocessors = 0;
  int ctas_per_sm = 0;             // of the default kernel
  int head_group_ctas_per_sm = 0;  // of the head-group kernel, 0 where not built
};

// Head groups need the default decode (one query token, unrotated V), one CTA per KV head (a
// group of at most kDecodeHeadsPerCta query heads), whole groups of KV heads, and a kernel instance
// that fits as many CTAs per multiprocessor as the default one (the plan's waves assume it).
bool head_groups_allowed(const fp8kturbov_decode_params_t& p, const DecodePlan& plan, bool same_occupancy) {
  return decode_head_groups_built(int(p.v_bits), int(p.head_dim)) && same_occupancy && p.query_start == nullptr &&
         p.v_rotation == FP8KTURBOV_V_ROTATION_NONE && plan.chunks_per_group == 1 &&
         p.num_kv_heads % kDecodeWarps == 0;
}

DecodePlan plan_decode(const fp8kturbov_decode_params_t& p, const DecodeDevice& device, uint64_t workspace_bytes) {
  DecodePlan plan{};
  plan.chunks_per_group = decode_chunks_per_group(p.num_q_heads, p.num_kv_heads, query_rows_per_seq(p));
  plan.stream_partials = 1;
  const uint64_t tiles = tiles_per_sequence(p);
  const uint64_t base_ctas = uint64_t(p.num_seqs) * p.num_kv_heads * plan.chunks_per_group;
  const uint64_t slots = uint64_t(std::max(device.multiprocessors, 1)) * std::max(device.ctas_per_sm, 1);
  const uint64_t max_splits = std::min<uint64_t>({kDecodeMaxSplits, std::max<uint64_t>(1, tiles / kDecodeMinSplitTiles),
                                                  INT32_MAX / std::max<uint64_t>(base_ctas, 1),
                                                  (kDecodeMaxWaves * slots + base_ctas - 1) / std::max<uint64_t>(base_ctas, 1)});
  const uint64_t streams = uint64_t(decode_streams_per_cta(int(p.head_dim)));
  auto tiles_per_split = [&](uint64_t splits) {  // a multiple of the streams, as long as they are busy
    return ((tiles + splits - 1) / splits + streams - 1) / streams * streams;
  };
  auto realized = [&](uint64_t splits) { return (tiles + tiles_per_split(splits) - 1) / tiles_per_split(splits); };
  auto tile_times = [&](uint64_t splits) {
    const uint64_t waves = (base_ctas * realized(splits) + slots - 1) / slots;
    return waves * (tiles_per_split(splits) / streams);
  };
  // For w waves, the most splits that fit in them give the shortest streams: the best candidate
  // for w. (max_splits holds the CTAs to kDecodeMaxWaves waves.)
  uint64_t splits = 1;
  for (uint64_t waves = 1; waves <= kDecodeMaxWaves; ++waves) {
    const uint64_t candidate = std::min(max_splits, waves * slots / std::max<uint64_t>(base_ctas, 1));
    if (candidate > 1 && tile_times(candidate) < tile_times(splits)) splits = candidate;
  }
  plan.num_splits = uint32_t(realized(splits));
  plan.split_tokens = int32_t(std::min<uint64_t>(tiles_per_split(splits) * kDecodeTileTokens, INT32_MAX));
  plan.workspace = static_cast<float*>(p.workspace);
  if (plan.num_splits > 1 &&
      decode_workspace_bytes(plan, p.num_seqs, query_rows_per_seq(p), p.num_q_heads, p.head_dim) >
          workspace_bytes) {
    plan.num_splits = 1;
    plan.split_tokens = INT32_MAX;
  }
  // With several sequences and many long splits, the sequences share the split slots by their lengths.
  plan.length_shares = p.num_seqs > 1 && plan.num_splits >= kDecodeLengthShareMinSplits &&
                       uint64_t(plan.split_tokens) / kDecodeTileTokens >= kDecodeLengthShareMinSplitTiles;
  // Head groups keep the grid, the splits and each warp's token stream; each (KV head, split) then
  // has a partial per stream.
  DecodePlan grouped = plan;
  grouped.stream_partials = uint32_t(streams);
  const uint64_t stream_tiles =
      (std::min<uint64_t>(tiles, uint64_t(plan.split_tokens) / kDecodeTileTokens) + streams - 1) / streams;
  if (head_groups_allowed(p, plan, device.head_group_ctas_per_sm == device.ctas_per_sm) &&
      stream_tiles >= kDecodeHeadGroupMinStreamTiles && decode_partials(grouped) <= kDecodeMaxSplits &&
      decode_workspace_bytes(grouped, p.num_seqs, query_rows_per_seq(p), p.num_q_heads, p.head_dim) <=
          workspace_bytes)
    plan = grouped;
  return plan;
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

// Multiprocessors of the current device: a cached attribute read, no synchronisation.
cudaError_t current_multiprocessors(int* count) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

cudaError_t dispatch_decode_ctas_per_sm(uint32_t bits, uint32_t head_dim, bool head_groups, int* count) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
#define FP8KTURBOV_DECODE_CASE(BITS, HEAD_DIM) \
  if (bits == BITS && head_dim == HEAD_DIM) return decode_ctas_per_sm<BITS, HEAD_DIM>(device, head_groups, count);
#include "dispatch_decode.inc"
#undef FP8KTURBOV_DECODE_CASE
  *count = 1;  // not built: the launch reports it
  return cudaSuccess;
}

// The device facts a plan depends on: cached attribute and occupancy queries, no synchronisation.
cudaError_t query_decode_device(const fp8kturbov_decode_params_t& p, DecodeDevice* device) {
  cudaError_t err = current_multiprocessors(&device->multiprocessors);
  if (err == cudaSuccess) err = dispatch_decode_ctas_per_sm(p.v_bits, p.head_dim, false, &device->ctas_per_sm);
  if (err == cudaSuccess)
    err = dispatch_decode_ctas_per_sm(p.v_bits, p.head_dim, true, &device->head_group_ctas_per_sm);
  return err;
}

}  // namespace

fp8kturbov_status_t decode_impl(const char* entry, const fp8kturbov_decode_params_t& p,
                                cudaStream_t stream) {
  g_last_error[0] = '\0';
  uint64_t k_block_stride_bytes = 0;
  FP8KTURBOV_CHECK(validate_decode(entry, p, &k_block_stride_bytes));
  if (p.num_seqs == 0) return FP8KTURBOV_STATUS_SUCCESS;
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
  IndexCheck index_check{};
  FP8KTURBOV_CHECK(resolve_index_check(entry, p, &index_check));
  if (reinterpret_cast<uintptr_t>(p.sinks) % alignof(float) != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "sinks = %p is not 4-byte aligned",
                static_cast<const void*>(p.sinks));
  if (p.max_q_len > 1 && p.query_start == nullptr)
    return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry,
                "query_start is NULL but max_q_len = %u (more than one query row per sequence)",
                p.max_q_len);
  if (reinterpret_cast<uintptr_t>(p.query_start) % alignof(int32_t) != 0)
    return fail(FP8KTURBOV_STATUS_MISALIGNED, entry, "query_start = %p is not 4-byte aligned",
                static_cast<const void*>(p.query_start));
  DecodeDevice device;
  const cudaError_t query = query_decode_device(p, &device);
  if (query != cudaSuccess) return report_cuda(query, entry, "device query");
  const DecodePlan plan = plan_decode(p, device, p.workspace_bytes);
  const FastDivider divider = fast_divider(p.block_size);
  const uint64_t row_elems = uint64_t(p.num_kv_heads) * p.head_dim;

  const DecodeArgs args{static_cast<const uint16_t*>(p.q),
                        static_cast<const uint8_t*>(p.k_cache),
                        static_cast<const uint8_t*>(p.v_cache),
                        static_cast<uint16_t*>(p.output),
                        p.block_tables,
                        p.seq_lens,
                        p.max_blocks_per_seq,
                        p.block_tables_stride != 0 ? p.block_tables_stride : p.max_blocks_per_seq,
                        p.num_seqs,
                        p.num_q_heads,
                        p.num_kv_heads,
                        p.block_size,
                        divider.multiplier,
                        divider.shift,
                        p.inv_sqrt_d * p.k_scale,
                        p.q_stride,
                        k_block_stride_bytes,
                        p.v_block_stride_bytes,
                        p.v_data_section_bytes,
                        p.sliding_window,
                        p.sparse_v_threshold,
                        decode_v_code_copy_bytes(reinterpret_cast<uintptr_t>(p.v_cache),
                                                 p.v_block_stride_bytes,
                                                 v_data_section_bytes(1, row_elems, p.v_bits)),
                        index_check,
                        p.sinks,
                        p.soft_cap,
                        p.query_start,
                        p.query_start != nullptr ? query_rows_per_seq(p) : 1u,
                        p.query_start != nullptr ? p.num_query_rows : p.num_seqs,
                        p.v_rotation == FP8KTURBOV_V_ROTATION_HADAMARD};
  bool built = false;
  const cudaError_t err = dispatch_decode(p.v_bits, p.head_dim, args, plan, stream, &built);
  if (!built)
    return fail(FP8KTURBOV_STATUS_NOT_SUPPORTED, entry,
                "v_bits = %u with head_dim = %u was not built (CMake options FP8KTURBOV_V_BITS, "
                "FP8KTURBOV_HEAD_DIMS)",
                p.v_bits, p.head_dim);
  return report_launch(err, entry);
}

fp8kturbov_status_t decode_workspace_impl(const char* entry, const fp8kturbov_decode_params_t& p,
                                          uint64_t* workspace_bytes) {
  g_last_error[0] = '\0';
  if (workspace_bytes == nullptr)
    return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "workspace_bytes is NULL");
  // Pointers are not part of the question: validate the scalars alone.
  fp8kturbov_decode_params_t scalars = p;
  scalars.k_cache = nullptr;
  scalars.v_cache = nullptr;
  uint64_t k_block_stride_bytes = 0;
  FP8KTURBOV_CHECK(validate_decode(entry, scalars, &k_block_stride_bytes));
  *workspace_bytes = 0;
  if (p.num_seqs == 0) return FP8KTURBOV_STATUS_SUCCESS;
  DecodeDevice device;
  const cudaError_t query = query_decode_device(p, &device);
  if (query != cudaSuccess) return report_cuda(query, entry, "device query");
  const DecodePlan plan = plan_decode(p, device, UINT64_MAX);
  *workspace_bytes = decode_workspace_bytes(plan, p.num_seqs, query_rows_per_seq(p), p.num_q_heads, p.head_dim);
  return FP8KTURBOV_STATUS_SUCCESS;
}

}  // namespace fp8kturbov

using namespace fp8kturbov;

extern "C" {

int fp8kturbov_version(void) { return FP8KTURBOV_VERSION; }
int fp8kturbov_abi_version(void) { return FP8KTURBOV_ABI_VERSION; }

const char* fp8kturbov_status_string(fp8kturbov_status_t status) {
  switch (status) {
    case FP8KTURBOV_STATUS_SUCCESS: return "FP8KTURBOV_STATUS_SUCCESS";
    case FP8KTURBOV_STATUS_INVALID_VALUE: return "FP8KTURBOV_STATUS_INVALID_VALUE";
    case FP8KTURBOV_STATUS_NULL_POINTER: return "FP8KTURBOV_STATUS_NULL_POINTER";
    case FP8KTURBOV_STATUS_MISALIGNED: return "FP8KTURBOV_STATUS_MISALIGNED";
    case FP8KTURBOV_STATUS_NOT_SUPPORTED: return "FP8KTURBOV_STATUS_NOT_SUPPORTED";
    case FP8KTURBOV_STATUS_BAD_STRUCT_SIZE: return "FP8KTURBOV_STATUS_BAD_STRUCT_SIZE";
    case FP8KTURBOV_STATUS_CUDA_ERROR: return "FP8KTURBOV_STATUS_CUDA_ERROR";
  }
  return "FP8KTURBOV_STATUS_UNKNOWN";
}

const char* fp8kturbov_last_error_message(void) { return g_last_error; }

fp8kturbov_status_t fp8kturbov_paged_decode_workspace_bytes(const fp8kturbov_decode_params_t* params,
                                                            uint64_t* workspace_bytes) {
  const char* entry = "fp8kturbov_paged_decode_workspace_bytes";
  g_last_error[0] = '\0';
  fp8kturbov_decode_params_t p;
  FP8KTURBOV_CHECK(read_params(entry, params, kDecodeParamsVersions, &p));
  return decode_workspace_impl(entry, p, workspace_bytes);
}

uint64_t fp8kturbov_k_page_bytes(uint32_t block_size, uint32_t num_kv_heads, uint32_t head_dim) {
  // A row of more than 2^32 - 1 elements is refused by every entry point; refusing it here also
  // keeps every page size below 2^64.
  if (block_size == 0 || num_kv_heads == 0 || head_dim == 0 || head_dim % kGroupElems != 0 ||
      uint64_t(num_kv_heads) * head_dim > UINT32_MAX)
    return 0;
  return k_page_bytes(block_size, uint64_t(num_kv_heads) * head_dim);
}

uint64_t fp8kturbov_v_data_section_bytes(uint32_t block_size, uint32_t num_kv_heads,
                                         uint32_t head_dim, uint32_t bits) {
  if (!is_supported_v_bits(bits) || fp8kturbov_k_page_bytes(block_size, num_kv_heads, head_dim) == 0)
    return 0;
  return v_data_section_bytes(block_size, uint64_t(num_kv_heads) * head_dim, bits);
}

uint64_t fp8kturbov_v_page_bytes(uint32_t block_size, uint32_t num_kv_heads, uint32_t head_dim,
                                 uint32_t bits) {
  if (fp8kturbov_v_data_section_bytes(block_size, num_kv_heads, head_dim, bits) == 0) return 0;
  return v_page_bytes(block_size, uint64_t(num_kv_heads) * head_dim, bits);
}

void fp8kturbov_write_params_init(fp8kturbov_write_params_t* params) {
  if (params != nullptr)
    init_params("fp8kturbov_write_params_init", params, sizeof *params, kWriteParamsVersions);
}

void fp8kturbov_dequantize_params_init(fp8kturbov_dequantize_params_t* params) {
  if (params != nullptr)
    init_params("fp8kturbov_dequantize_params_init", params, sizeof *params, kDequantizeParamsVersions);
}

void fp8kturbov_decode_params_init(fp8kturbov_decode_params_t* params) {
  if (params != nullptr)
    init_params("fp8kturbov_decode_params_init", params, sizeof *params, kDecodeParamsVersions);
}

// Unlike the other entry points, the *_init_sized functions leave the last-error message alone when
// they succeed: filling a struct is not an operation whose outcome a later look at the message
// should report (the Python layer fills one before it range-checks a call's arguments).
fp8kturbov_status_t fp8kturbov_write_params_init_sized(fp8kturbov_write_params_t* params, size_t struct_size) {
  return init_params("fp8kturbov_write_params_init_sized", params, struct_size, kWriteParamsVersions);
}

fp8kturbov_status_t fp8kturbov_dequantize_params_init_sized(fp8kturbov_dequantize_params_t* params,
                                                            size_t struct_size) {
  return init_params("fp8kturbov_dequantize_params_init_sized", params, struct_size, kDequantizeParamsVersions);
}

fp8kturbov_status_t fp8kturbov_decode_params_init_sized(fp8kturbov_decode_params_t* params, size_t struct_size) {
  return init_params("fp8kturbov_decode_params_init_sized", params, struct_size, kDecodeParamsVersions);
}

fp8kturbov_status_t fp8kturbov_reshape_and_cache(const fp8kturbov_write_params_t* params,
                                                 fp8kturbov_stream_t stream) {
  const char* entry = "fp8kturbov_reshape_and_cache";
  g_last_error[0] = '\0';
  fp8kturbov_write_params_t p;
  FP8KTURBOV_CHECK(read_params(entry, params, kWriteParamsVersions, &p));
  return write_impl(entry, p, reinterpret_cast<cudaStream_t>(stream));
}

fp8kturbov_status_t fp8kturbov_dequantize(const fp8kturbov_dequantize_params_t* params,
                                          fp8kturbov_stream_t stream) {
  const char* entry = "fp8kturbov_dequantize";
  g_last_error[0] = '\0';
  fp8kturbov_dequantize_params_t p;
  FP8KTURBOV_CHECK(read_params(entry, params, kDequantizeParamsVersions, &p));
  return dequantize_impl(entry, p, reinterpret_cast<cudaStream_t>(stream));
}

fp8kturbov_status_t fp8kturbov_paged_decode_attn(const fp8kturbov_decode_params_t* params,
                                                 fp8kturbov_stream_t stream) {
  const char* entry = "fp8kturbov_paged_decode_attn";
  g_last_error[0] = '\0';
  fp8kturbov_decode_params_t p;
  FP8KTURBOV_CHECK(read_params(entry, params, kDecodeParamsVersions, &p));
  return decode_impl(entry, p, reinterpret_cast<cudaStream_t>(stream));
}

}  // extern "C"
