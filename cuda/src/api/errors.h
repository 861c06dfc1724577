// The last-error message of the calling thread and the helpers that set it: every entry point
// clears it on entry and records the first violated rule (or CUDA error) of a failing call.
#pragma once

#include <cuda_runtime.h>

#include "fp8kturbov.h"

namespace fp8kturbov {

constexpr int kLastErrorBytes = 512;
extern thread_local char g_last_error[kLastErrorBytes];

// Records the detail message of the failing call (`entry`: its public name) and returns its status.
fp8kturbov_status_t fail(fp8kturbov_status_t status, const char* entry, const char* fmt, ...);
// SUCCESS for cudaSuccess, else CUDA_ERROR with the runtime's name and text of `err`.
fp8kturbov_status_t report_cuda(cudaError_t err, const char* entry, const char* what);
fp8kturbov_status_t report_launch(cudaError_t err, const char* entry);

}  // namespace fp8kturbov

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
