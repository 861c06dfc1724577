// FP8KTURBOV_HOST_DEVICE: functions that the planner (host code, also built by a plain C++ compiler
// in the plan test) and the kernels share.
#pragma once

#if defined(__CUDACC__)
#define FP8KTURBOV_HOST_DEVICE __host__ __device__
#else
#define FP8KTURBOV_HOST_DEVICE
#endif
