// The softmax arithmetic in the log2 domain: the fast exp2, logit soft-capping, attention sinks and
// the normalisation of a merged partial.
#pragma once

#include <cstdint>

#include "kernel_args.h"
#include "decode/traits.cuh"

namespace fp8kturbov {

// The output o / l of a head whose maximum score is m (log2 domain), with l = 0 (no attended
// position) giving 0 (FORMAT §5) and a NaN l staying NaN. An attention sink (logit sink2, log2
// domain; -inf = none) joins the denominator: o·2^(m−M) / (l·2^(m−M) + 2^(sink2−M)), M = max(m, sink2).
__device__ __forceinline__ float normalize(float o, float l, float m, float sink2) {
  if (sink2 == -INFINITY) return l == 0.0f ? 0.0f : o / l;
  const float top = fmaxf(m, sink2);
  const float scale = exp2f(m - top);  // 0 where nothing was attended (m = -inf)
  return o * scale / (l * scale + exp2f(sink2 - top));
}

// The sink logit of query head `head` in the log2 domain, or -inf without sinks.
__device__ __forceinline__ float sink_log2(const DecodeArgs& a, uint64_t head) {
  return a.sinks == nullptr ? -INFINITY : a.sinks[head] * kLog2e;
}

// 2^x on the special function unit (ex2.approx.ftz: relative error ~2^-22, results below 2^-126
// flushed to 0, 2^-inf = 0, NaN stays NaN). exp2f adds a range fix-up of four instructions for
// subnormal results, which softmax weights that are rounded to fp16 next do not need.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) for logit soft-capping: 1 − 2 / (e^(2x) + 1), exact to a few float ulps in absolute
// terms (which is what a score needs) and ±1 for large |x|.
__device__ __forceinline__ float soft_cap_tanh(float x) {
  return 1.0f - __fdividef(2.0f, exp2f(x * (2.0f * kLog2e)) + 1.0f);
}

}  // namespace fp8kturbov
