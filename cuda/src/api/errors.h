// The entry points' error reporting: the thread-local detail message of the last failing call,
// and the status it returns.
#pragma once

#include <cuda_runtime.h>

#include "fp8kturbov.h"

namespace fp8kturbov {

// Clears the message (every entry point does, first).
void clear_last_error();
const char* last_error();
// Records the detail message of the failing call ("entry: ...") and returns its status.
fp8kturbov_status_t fail(fp8kturbov_status_t status, const char* entry, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
// SUCCESS, or CUDA_ERROR naming `what` and the runtime's error.
fp8kturbov_status_t report_cuda(cudaError_t err, const char* entry, const char* what);
// The status of a kernel launch.
fp8kturbov_status_t report_launch(cudaError_t err, const char* entry);

}  // namespace fp8kturbov

#define FP8KTURBOV_CHECK(expr)                                \
  do {                                                        \
    const fp8kturbov_status_t status_ = (expr);               \
    if (status_ != FP8KTURBOV_STATUS_SUCCESS) return status_; \
  } while (0)

// In an entry point with params `p` and name `entry`: NULL_POINTER naming the field.
#define FP8KTURBOV_REQUIRE_POINTER(field)                                                   \
  do {                                                                                      \
    if (p.field == nullptr)                                                                 \
      return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "%s is NULL", #field);              \
  } while (0)
