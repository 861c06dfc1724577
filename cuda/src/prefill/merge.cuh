// The prefill's merge: the splits' partial rows of each (query row, head) combined by their
// log-denominators, sinks joining the denominator, rotated back where V was rotated (FORMAT §6),
// stored as bf16 with the row's log-denominator. Its grid is the prefill's (query tiles of a
// sequence by KV heads) with query_tile_rows / kPrefillWarps CTAs per tile, a warp per row, so that
// it merges exactly the rows the prefill computed.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode/ranges.cuh"
#include "format.cuh"
#include "kernel_args.h"
#include "prefill/kernel.cuh"  // kPrefillWarps, kPrefillThreads, bf16x2_bits

namespace fp8kturbov {

template <int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_merge_kernel(const PrefillArgs a) {
  constexpr int kElems = HEAD_DIM / 32;  // a lane's elements of a row: ELEMS·lane + e
  constexpr int kBatch = 8;              // splits whose partial rows a lane loads before it adds them
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t seq = blockIdx.x / a.tiles_per_seq;
  const uint32_t tile = blockIdx.x % a.tiles_per_seq;
  uint32_t row0;
  int q_len;
  if (!sequence_query_rows(a, seq, row0, q_len)) return;  // skipped by the prefill too (it reports)
  const int group = int(a.group_size);
  const int flat = int(tile) * int(a.query_tile_rows) + int(blockIdx.z) * kPrefillWarps + int(warp);
  const int token = flat / group;
  if (token >= q_len) return;  // a row the prefill did not compute
  const uint32_t head = blockIdx.y * uint32_t(group) + uint32_t(flat % group);
  const uint64_t row = uint64_t(row0 + uint32_t(token)) * a.num_q_heads + head;
  const uint64_t split_rows = uint64_t(a.num_query_rows) * a.num_q_heads;  // partials per split
  const uint32_t num_splits = a.num_splits;
  // The largest log-denominator (the sink's too); each split's weight against it. Every split wrote
  // every row of its CTA (an empty split: zeros and -inf), so every partial read below is defined.
  // A split whose lse is NaN met a NaN score: the row is NaN, as the float64 softmax's (fmaxf
  // alone would drop that split, RELIABILITY §4.4).
  float top = -INFINITY;
  bool nan_split = false;
  for (uint32_t s = lane; s < num_splits; s += 32) {
    const float lse = a.partial_lse[s * split_rows + row];
    nan_split = nan_split || isnan(lse);
    top = fmaxf(top, lse);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  nan_split = __any_sync(0xffffffffu, nan_split);
  const bool attended = top > -INFINITY;  // some split saw a position (else zeros, lse -inf)
  const float sink = attended && a.sinks != nullptr ? __ldg(a.sinks + head) : -INFINITY;
  top = fmaxf(top, sink);
  float x[kElems] = {};
  float total = 0.0f;  // the lane's share of the splits' weights
  for (uint32_t base = 0; attended && base < num_splits; base += 32) {
    const uint32_t count = min(num_splits - base, 32u);
    const float weight = lane < count ? expf(a.partial_lse[(base + lane) * split_rows + row] - top) : 0.0f;
    total += weight;
    for (uint32_t j0 = 0; j0 < count; j0 += kBatch) {
      float part[kBatch][kElems];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint32_t s = base + min(j0 + uint32_t(j), count - 1);  // past the last: re-read it, weight 0
        const float* src = a.partial_o + (s * split_rows + row) * HEAD_DIM + kElems * lane;
#pragma unroll
        for (int e = 0; e < kElems; ++e) part[j][e] = src[e];
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w = __shfl_sync(0xffffffffu, weight, (j0 + uint32_t(j)) % 32);
        const float wj = j0 + uint32_t(j) < count ? w : 0.0f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) x[e] += wj * part[j][e];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (attended && a.sinks != nullptr) total += expf(sink - top);
  const float inv_total = nan_split ? NAN : attended ? 1.0f / total : 0.0f;
#pragma unroll
  for (int e = 0; e < kElems; ++e) x[e] *= inv_total;
  if constexpr (kRotatableHeadDim<HEAD_DIM>) {
    using Signs = RotationSigns<HEAD_DIM>;
    if (a.rotated_v) hadamard_rotate<HEAD_DIM, kElems>(x, lane, 0xffffffffu, Signs::kS2, Signs::kS1);
  }
  uint16_t* dst = a.output + row * HEAD_DIM + kElems * lane;
#pragma unroll
  for (int e = 0; e < kElems; e += 2) {
    const uint32_t pair = bf16x2_bits(x[e], x[e + 1]);
    dst[e] = uint16_t(pair);
    dst[e + 1] = uint16_t(pair >> 16);
  }
  if (a.lse != nullptr && lane == 0) a.lse[row] = nan_split ? NAN : attended ? top + logf(total) : -INFINITY;
}

}  // namespace fp8kturbov
