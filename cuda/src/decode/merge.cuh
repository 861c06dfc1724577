// The merge kernel: a split decode's partials combined into the output, per (sequence, query token,
// query head), in a fixed order.
#pragma once

#include <cstdint>

#include "format.cuh"
#include "kernel_args.h"
#include "decode/ptx.cuh"
#include "decode/ranges.cuh"
#include "decode/schedule.cuh"
#include "decode/softmax_state.cuh"

namespace fp8kturbov {

// Block-wide reductions of the merge kernel (THREADS a multiple of 32, <= 1024); every thread gets
// the result. The order is fixed, so results are deterministic.
template <int THREADS, typename Op>
__device__ __forceinline__ float block_reduce(float x, Op op, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();  // scratch may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) x = op(x, scratch[w]);
  return x;
}

// Splits whose partial elements a merge thread loads at once: one round of L2 latency per this many.
constexpr int kMergeLoadBatch = 32;

// Combines the splits' partials of one (sequence, query token, query head): the splits' weights
// are computed once, in parallel, then every thread sums its element over the splits in order,
// its loads kMergeLoadBatch at a time (predicated, so a short last batch costs no serial tail);
// the first batch is requested before the weights, so its latency overlaps theirs. EXTENDED as for
// the decode kernel: the default decode gets an instance without the multi-token indexing and the
// rotation.
template <int HEAD_DIM, bool EXTENDED, bool SHARES>
__global__ void __launch_bounds__(HEAD_DIM) merge_splits_kernel(const DecodeArgs a, const DecodePlan plan) {
  __shared__ float weight_s[kDecodeMaxSplits];  // per partial
  __shared__ float scratch[HEAD_DIM / 32];
  __shared__ float row_s[HEAD_DIM];  // rotated V: the merged row, rotated back by the first warp
  const uint32_t row = blockIdx.x;  // (sequence * max_q_len + token) * num_q_heads + head (< 2^31)
  // The output's (query row, head) index: row itself with one token per sequence.
  uint64_t out_row = row;
  if constexpr (EXTENDED) {
    const uint32_t seq_token = row / a.num_q_heads;
    const uint32_t token = seq_token % a.max_q_len;
    uint32_t row0;
    int q_len;
    if (!sequence_query_rows(a, seq_token / a.max_q_len, row0, q_len) || int(token) >= q_len)
      return;  // no partials: the decode kernel skipped the sequence, or it has fewer tokens
    out_row = uint64_t(row0 + token) * a.num_q_heads + row % a.num_q_heads;
  }
  const int tid = threadIdx.x;
  // The shares read seq_lens only, so they are found while the decode grid still runs.
  const uint32_t rows_per_seq = (EXTENDED ? a.max_q_len : 1u) * a.num_q_heads;
  const uint32_t seq = row / rows_per_seq;
  __shared__ SplitShare share_s;
  __shared__ uint32_t share_scratch[HEAD_DIM / 32];
  const bool length_shares = EXTENDED ? plan.length_shares : SHARES;  // as in the decode kernel
  const SplitShare share = length_shares ? split_share<HEAD_DIM, false>(a, plan, seq, share_scratch, share_s)
                                              : SplitShare{seq, seq * plan.num_splits, plan.num_splits, 0};
  const int num_partials = int(share.count * plan.stream_partials);
  const float* parts = partial_address(plan, share, rows_per_seq, row % rows_per_seq, 0, HEAD_DIM);
  wait_for_prerequisite_grid();
  float batch[kMergeLoadBatch];  // this thread's elements of splits s0 ... s0 + kMergeLoadBatch - 1
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int k = 0; k < kMergeLoadBatch; ++k)
      batch[k] = s0 + k < num_partials ? parts[(s0 + k) * (HEAD_DIM + 2) + tid] : 0.0f;
  };
  load_batch(0);
  float m = -INFINITY;
  for (int s = tid; s < num_partials; s += HEAD_DIM) m = fmaxf(m, parts[s * (HEAD_DIM + 2) + HEAD_DIM]);
  m = block_reduce<HEAD_DIM>(m, [](float x, float y) { return fmaxf(x, y); }, scratch);
  float l = 0.0f;
  for (int s = tid; s < num_partials; s += HEAD_DIM) {
    const float* part = parts + s * (HEAD_DIM + 2);
    const float w = partial_weight(part[HEAD_DIM], m);
    weight_s[s] = w;
    l += w * part[HEAD_DIM + 1];
  }
  l = block_reduce<HEAD_DIM>(l, [](float x, float y) { return x + y; }, scratch);  // also publishes weight_s
  float o = 0.0f;
  for (int s0 = 0; s0 < num_partials; s0 += kMergeLoadBatch) {
    if (s0 > 0) load_batch(s0);
#pragma unroll
    for (int k = 0; k < kMergeLoadBatch; ++k)
      if (s0 + k < num_partials) o += weight_s[s0 + k] * batch[k];
  }
  if constexpr (EXTENDED && kRotatableHeadDim<HEAD_DIM>) {
    if (a.rotated_v) {  // FORMAT §6: the partials are of rotated V
      row_s[tid] = o;
      __syncthreads();
      if (tid < 32) unrotate_row<HEAD_DIM>(row_s, tid);
      __syncthreads();
      o = row_s[tid];
    }
  }
  const float out = normalize(o, l, m, sink_log2(a, row % a.num_q_heads));
  a.output[out_row * HEAD_DIM + tid] = __bfloat16_as_ushort(__float2bfloat16(out));
}

}  // namespace fp8kturbov
