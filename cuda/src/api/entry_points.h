// Internal: the validated implementations behind every public entry point. `entry` is the
// public name reported in the last-error message.
#pragma once

#include <cuda_runtime.h>

#include "fp8kturbov.h"

namespace fp8kturbov {

fp8kturbov_status_t write_impl(const char* entry, const fp8kturbov_write_params_t& params,
                               cudaStream_t stream);
fp8kturbov_status_t dequantize_impl(const char* entry, const fp8kturbov_dequantize_params_t& params,
                                    cudaStream_t stream);
fp8kturbov_status_t decode_impl(const char* entry, const fp8kturbov_decode_params_t& params,
                                cudaStream_t stream);
fp8kturbov_status_t decode_workspace_impl(const char* entry,
                                          const fp8kturbov_decode_params_t& params,
                                          uint64_t* workspace_bytes);
fp8kturbov_status_t prefill_impl(const char* entry, const fp8kturbov_prefill_params_t& params,
                                 cudaStream_t stream);
fp8kturbov_status_t prefill_workspace_impl(const char* entry, const fp8kturbov_prefill_params_t& params,
                                           uint64_t* workspace_bytes);

}  // namespace fp8kturbov
