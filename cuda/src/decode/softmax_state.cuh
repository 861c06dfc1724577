// The softmax state of the decode, written once: the partial state (o, m, l) that a token stream,
// a head group's warp or a context split leaves, the rule by which partials merge and a merged one
// is normalised (with an attention sink), and the online state of a thread's two head columns in
// the tile loop. Maxima are in the log2 domain.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "decode/ptx.cuh"

namespace fp8kturbov {

// The weight of a partial whose maximum is `partial_max` in a merge whose maximum is `merged_max`:
// its sums scale by 2^(partial_max − merged_max). With merged_max = -inf no partial has a finite
// score: its sums are 0 (no positions) or NaN, and pass unscaled.
__device__ __forceinline__ float partial_weight(float partial_max, float merged_max) {
  return merged_max == -INFINITY ? 1.0f : exp2f(partial_max - merged_max);
}

// The output o / l of a head whose maximum score is m, with l = 0 (no attended position) giving 0
// (FORMAT §5) and a NaN l staying NaN. An attention sink (logit sink2; -inf = none) joins the
// denominator: o·2^(m−M) / (l·2^(m−M) + 2^(sink2−M)), M = max(m, sink2).
__device__ __forceinline__ float normalize(float o, float l, float m, float sink2) {
  if (sink2 == -INFINITY) return l == 0.0f ? 0.0f : o / l;
  const float top = fmaxf(m, sink2);
  const float scale = exp2f(m - top);  // 0 where nothing was attended (m = -inf)
  return o * scale / (l * scale + exp2f(sink2 - top));
}

// The online softmax of a thread's head columns 2t and 2t+1 (identical in the 8 lanes sharing t).
// The reference maximum that the weights and sums are relative to is the maximum of the scores seen
// when it last moved, which it does only when a score exceeds it by more than kRescaleSlackLog2
// (lazy rescaling). Weights stay <= 2^kRescaleSlackLog2, well inside fp16, and a tile whose scores
// stay under the reference skips the max reduction and the rescale. It is held as the two values
// that each tile reads, set only when it moves: reference (0 while the column has seen nothing, so
// that a masked row's weight is 2^-inf = 0) and limit (reference + slack; -inf while the column has
// seen nothing).
struct OnlineSoftmax {
  static constexpr float kRescaleSlackLog2 = 8.0f;
  float reference[2] = {0.0f, 0.0f};
  float limit[2] = {-INFINITY, -INFINITY};
  float denom[2] = {0.0f, 0.0f};  // this lane's tokens only until reduce_denominators

  // The partial's maximum of column c (-inf while it has seen nothing).
  __device__ __forceinline__ float max_of(int c) const { return limit[c] == -INFINITY ? -INFINITY : reference[c]; }

  // Takes a tile's masked scores s[c], s[2 + c] of column c (rows g and g + 8). The reference
  // maxima move (warp-uniform) only when some score exceeds its column's by more than the slack;
  // then to the columns' running maxima, and the sums in denom and acc are rescaled.
  template <int M_TILES>
  __device__ __forceinline__ void observe(const float (&s)[4], float (&acc)[M_TILES][4]) {
    bool exceeds = false;
#pragma unroll
    for (int r = 0; r < 4; ++r) exceeds = exceeds || s[r] > limit[r % 2];
    if (!__any_sync(0xffffffffu, exceeds)) return;
    float alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float tile_max = fmaxf(s[c], s[2 + c]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      const float old_max = max_of(c);
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

  // The weights of the masked scores relative to the reference maxima (a masked row, -inf, gets
  // 2^-inf = 0, also while a column has seen nothing), rounded to fp16 pairs of the heads (2t,
  // 2t+1): p_lo of row g, p_hi of row g + 8. The denominator sums the same rounded weights that
  // multiply V. p[] keeps them in fp32 for the sparse-V vote.
  __device__ __forceinline__ void weigh(const float (&s)[4], float (&p)[4], uint32_t& p_lo, uint32_t& p_hi) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      p[c] = exp2_fast(s[c] - reference[c]);
      p[2 + c] = exp2_fast(s[2 + c] - reference[c]);
    }
    p_lo = half2_bits(p[0], p[1]);
    p_hi = half2_bits(p[2], p[3]);
    const __half2 lo = *reinterpret_cast<const __half2*>(&p_lo);
    const __half2 hi = *reinterpret_cast<const __half2*>(&p_hi);
    denom[0] += __low2float(lo) + __low2float(hi);
    denom[1] += __high2float(lo) + __high2float(hi);
  }

  // The denominators summed over the 8 lanes sharing t.
  __device__ __forceinline__ void reduce_denominators() {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) denom[c] += __shfl_xor_sync(0xffffffffu, denom[c], o);
    }
  }
};

}  // namespace fp8kturbov
