// The calling thread's last-error message (api/errors.h).
#include "api/errors.h"

#include <cstdarg>
#include <cstdio>

namespace fp8kturbov {

thread_local char g_last_error[kLastErrorBytes];

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

}  // namespace fp8kturbov
