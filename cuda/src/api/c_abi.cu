// The C ABI's functions: each reads the caller's params struct, then runs its implementation
// (api/entry_points.h); the version, status, message and size functions.
#include <cstdint>

#include "fp8kturbov.h"
#include "format.cuh"
#include "api/entry_points.h"
#include "api/errors.h"
#include "api/params.h"

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
