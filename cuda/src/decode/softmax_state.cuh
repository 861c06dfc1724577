// The softmax state and arithmetic in the log2 domain: the fast exp2, logit soft-capping, attention
// sinks, the lazily rescaled running maxima of the tile loop, the weights of partials being merged and
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

// Lazy rescaling. A thread's online-softmax state for its two columns (heads 2t and 2t+1) is the
// reference maximum that its weights and sums are relative to, which moves only when a score
// exceeds it by more than kRescaleSlackLog2: weights stay <= 2^kRescaleSlackLog2, well inside fp16,
// and a tile whose scores stay under the reference skips the max reduction and the rescale. It is
// held as the two values that each tile reads, set only when it moves: the reference (0 while the
// column has seen nothing, so that a masked row's weight is 2^-inf = 0) and the limit (reference +
// slack; -inf while the column has seen nothing).
constexpr float kRescaleSlackLog2 = 8.0f;

// The maximum score a column's state is relative to: -inf while it has seen nothing.
__device__ __forceinline__ float running_max(float reference, float limit) { return limit == -INFINITY ? -INFINITY : reference; }

// A tile whose (masked) scores exceed a column's limit, in some lane: the references move to the
// columns' maxima over the tile's rows (the 8 lanes sharing t), and the denominators and the
// accumulators are rescaled.
template <int M_TILES>
__device__ __forceinline__ void raise_reference_max(const float (&masked_s)[4], float (&reference)[2], float (&limit)[2],
                                                    float (&denom)[2], float (&acc)[M_TILES][4]) {
  float alpha[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    float tile_max = fmaxf(masked_s[c], masked_s[2 + c]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
    const float old_max = running_max(reference[c], limit[c]);
    const float new_max = fmaxf(old_max, tile_max);
    alpha[c] = new_max == -INFINITY ? 1.0f : exp2_fast(old_max - new_max);
    reference[c] = new_max == -INFINITY ? 0.0f : new_max;
    limit[c] = new_max + kRescaleSlackLog2;
    denom[c] *= alpha[c];
  }
#pragma unroll
  for (int i = 0; i < M_TILES; ++i) {
    acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
  }
}

// Merging partials (the streams of a CTA, the splits in the merge kernel): the weight of a partial
// whose maximum is partial_max under the merged maximum m. With m = -inf no partial has a finite
// score: its sums are 0 (no positions) or NaN, and it keeps them. (By reference: read only when used.)
__device__ __forceinline__ float partial_weight(const float& partial_max, float m) {
  return m == -INFINITY ? 1.0f : exp2f(partial_max - m);
}

}  // namespace fp8kturbov
