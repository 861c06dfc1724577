// The query of a CTA in shared memory: its columns' bf16 elements as fp16, scaled by a power of two.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "decode/traits.cuh"

namespace fp8kturbov {

// The CTA's query chunk into shared memory (q_s, rows of HEAD_DIM + 4 halves), by all threads, as fp16
// scaled by a power of two so that its largest finite magnitude fits
// fp16's range; the factor is undone in the score scale (exact). Non-finite elements do not
// take part, so an Inf or NaN stays in its own head (RELIABILITY.md §4.3).
// q_at(i): element i = c·HEAD_DIM + d of the chunk, column c, dimension d; with head groups
// element (k·num_columns + c)·HEAD_DIM + d is column c of the group's k-th KV head, held in q_s
// row k·kHeadsPerCta + c. Returns the gain.
// KV_HEADS: the KV heads whose columns the CTA holds (head groups: the group's, else 1); Q_ROWS:
// the rows of q_s. `q_absmax_s`: one float per warp.
template <int HEAD_DIM, int KV_HEADS, int Q_ROWS, bool GROUPED, typename QAt>
__device__ __forceinline__ float load_query_chunk(QAt q_at, __half (*q_s)[HEAD_DIM + 4], float* q_absmax_s, int num_columns,
                                              int tid, int lane, int warp) {
  float q_absmax = 0.0f;
  for (int i = tid; i < KV_HEADS * num_columns * HEAD_DIM; i += kDecodeThreads) {
    const float magnitude = fabsf(__bfloat162float(__ushort_as_bfloat16(q_at(i))));
    if (magnitude <= FLT_MAX) q_absmax = fmaxf(q_absmax, magnitude);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) q_absmax = fmaxf(q_absmax, __shfl_xor_sync(0xffffffffu, q_absmax, o));
  if (lane == 0) q_absmax_s[warp] = q_absmax;
  __syncthreads();
  q_absmax = fmaxf(fmaxf(q_absmax_s[0], q_absmax_s[1]), fmaxf(q_absmax_s[2], q_absmax_s[3]));
  int q_exp = 0;
  if (q_absmax > 0.0f) frexpf(q_absmax, &q_exp);  // q_absmax < 2^q_exp
  q_exp = max(q_exp, 15 - 127);  // the gain stays a finite float even for subnormal queries
  const float gain = ldexpf(1.0f, 15 - q_exp);
  for (int i = tid; i < Q_ROWS * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int column = GROUPED ? h % kHeadsPerCta : h;
    const int element = GROUPED ? (h / kHeadsPerCta * num_columns + column) * HEAD_DIM + i % HEAD_DIM : i;
    const float v = column < num_columns ? __bfloat162float(__ushort_as_bfloat16(q_at(element))) : 0.0f;
    q_s[h][i % HEAD_DIM] = __float2half_rn(v * gain);
  }
  return gain;
}

}  // namespace fp8kturbov
