// Paged decode attention over the fp8k_turbo{2,3,4}v cache (FORMAT §5).
//
// One CTA per (sequence, KV head, chunk of up to kHeadsPerCta query heads of its GQA group):
// each tile of kTilePositions cached positions is read from the pools once and serves every
// query head of the chunk. Per tile:
//   1. page ids of the tile's positions;
//   2. K rows (16-byte loads) and V codes + scales into shared memory;
//   3. scores and the online softmax, one warp per query head (lane = position);
//   4. P·V, each thread owning fixed output elements for all heads of the chunk.
// Softmax and accumulation are fp32; the output is written once, as bf16.
#pragma once

#include <cfloat>

#include "format.cuh"
#include "kernel_args.h"

namespace fp8kturbov {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kTilePositions = 32;  // one position per lane in the softmax step
constexpr int kHeadsPerCta = 8;
constexpr int kHeadsPerWarp = kHeadsPerCta / kDecodeWarps;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Dot product of 16 query values with 16 E4M3 bytes.
__device__ __forceinline__ float dot16_e4m3(const float* q, uint4 k) {
  const uint32_t words[4] = {k.x, k.y, k.z, k.w};
  float acc = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int b = 0; b < 4; ++b) acc += q[4 * w + b] * e4m3_decode((words[w] >> (8 * b)) & 0xFF);
  }
  return acc;
}

template <int BITS, int HEAD_DIM>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(const DecodeArgs a) {
  constexpr int kRowVBytes = HEAD_DIM * BITS / 8;           // codes of one position, one KV head
  constexpr int kRowScales = HEAD_DIM / kGroupElems;         // scale bytes of the same
  constexpr int kKPitch = HEAD_DIM + 16;                     // odd number of 16 B units: no bank conflicts
  constexpr int kKChunks = HEAD_DIM / 16;                    // 16-byte K chunks per row
  constexpr int kElemsPerThread = (HEAD_DIM + kDecodeThreads - 1) / kDecodeThreads;

  __shared__ float q_s[kHeadsPerCta][HEAD_DIM];
  __shared__ __align__(16) uint8_t k_s[kTilePositions][kKPitch];
  __shared__ uint8_t vcode_s[kTilePositions][kRowVBytes];
  __shared__ uint8_t vscale_s[kTilePositions][kRowScales];
  __shared__ float weight_s[kHeadsPerCta][kTilePositions];
  __shared__ float rescale_s[kHeadsPerCta];
  __shared__ float denom_s[kHeadsPerCta];
  __shared__ bool skip_s[kHeadsPerCta];
  __shared__ int32_t page_s[kTilePositions];
  __shared__ float level_s[1 << BITS];

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const uint32_t seq = blockIdx.x;
  const uint32_t group_size = a.num_q_heads / a.num_kv_heads;
  const uint32_t chunks_per_group = (group_size + kHeadsPerCta - 1) / kHeadsPerCta;
  const uint32_t kv_head = blockIdx.y / chunks_per_group;
  const uint32_t first_head = kv_head * group_size + (blockIdx.y % chunks_per_group) * kHeadsPerCta;
  const int num_heads = min(kHeadsPerCta, int(kv_head * group_size + group_size - first_head));

  // FORMAT §5: attended positions [start, seq_len). A length beyond the block table is clamped
  // to it so that no read leaves the table.
  const int table_positions = int(a.max_blocks_per_seq * a.block_size);  // < 2^31, validated
  const int seq_len = min(max(a.seq_lens[seq], 0), table_positions);
  const int start = (a.sliding_window > 0 && seq_len > int(a.sliding_window))
                        ? seq_len - int(a.sliding_window)
                        : 0;
  const uint64_t row_elems = uint64_t(a.num_kv_heads) * HEAD_DIM;

  for (int i = tid; i < kHeadsPerCta * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    q_s[h][d] = h < num_heads ? __bfloat162float(__ushort_as_bfloat16(
                                    a.q[seq * a.q_stride + uint64_t(first_head + h) * HEAD_DIM + d]))
                              : 0.0f;
  }
  if (tid < (1 << BITS)) level_s[tid] = Codebook<BITS>::levels()[tid];

  // Online-softmax state of this warp's heads (warp-uniform).
  float run_max[kHeadsPerWarp];
  float run_denom[kHeadsPerWarp];
#pragma unroll
  for (int j = 0; j < kHeadsPerWarp; ++j) {
    run_max[j] = -FLT_MAX;
    run_denom[j] = 0.0f;
  }
  float acc[kHeadsPerCta][kElemsPerThread] = {};

  for (int tile = start; tile < seq_len; tile += kTilePositions) {
    const int tile_len = min(kTilePositions, seq_len - tile);
    if (tid < kTilePositions) {
      page_s[tid] = tid < tile_len ? a.block_tables[uint64_t(seq) * a.max_blocks_per_seq +
                                                    uint32_t(tile + tid) / a.block_size]
                                   : 0;
    }
    __syncthreads();

    for (int i = tid; i < tile_len * kKChunks; i += kDecodeThreads) {
      const int r = i / kKChunks;
      const int c = i % kKChunks;
      const uint32_t offset = uint32_t(tile + r) % a.block_size;
      const uint8_t* src = a.k_cache + uint64_t(page_s[r]) * a.k_block_stride_bytes +
                           offset * row_elems + kv_head * HEAD_DIM + c * 16;
      *reinterpret_cast<uint4*>(&k_s[r][c * 16]) = __ldg(reinterpret_cast<const uint4*>(src));
    }
    const VPageLayout layout{row_elems * BITS / 8, row_elems / kGroupElems, a.v_data_section_bytes};
    for (int i = tid; i < tile_len * (kRowVBytes + kRowScales); i += kDecodeThreads) {
      const int r = i / (kRowVBytes + kRowScales);
      const int c = i % (kRowVBytes + kRowScales);
      const uint32_t offset = uint32_t(tile + r) % a.block_size;
      const uint8_t* page = a.v_cache + uint64_t(page_s[r]) * a.v_block_stride_bytes;
      if (c < kRowVBytes) {
        vcode_s[r][c] = __ldg(page + layout.data_offset(offset, kv_head * kRowScales, BITS) + c);
      } else {
        vscale_s[r][c - kRowVBytes] =
            __ldg(page + layout.scale_offset(offset, kv_head * kRowScales + c - kRowVBytes));
      }
    }
    __syncthreads();

    // Scores and online softmax: warp w handles heads w, w + kDecodeWarps, ...; lane = position.
#pragma unroll
    for (int j = 0; j < kHeadsPerWarp; ++j) {
      const int h = warp + j * kDecodeWarps;
      float score = -FLT_MAX;
      if (h < num_heads && lane < tile_len) {
        float dot = 0.0f;
#pragma unroll 4
        for (int c = 0; c < kKChunks; ++c)
          dot += dot16_e4m3(&q_s[h][c * 16], *reinterpret_cast<const uint4*>(&k_s[lane][c * 16]));
        score = dot * a.score_scale;
      }
      const float new_max = fmaxf(run_max[j], warp_max(score));
      const float weight = lane < tile_len ? __expf(score - new_max) : 0.0f;
      const float rescale = __expf(run_max[j] - new_max);
      run_denom[j] = run_denom[j] * rescale + warp_sum(weight);
      run_max[j] = new_max;
      // FORMAT §5 sparse V, at tile granularity: skip only when every row of the tile qualifies.
      const bool skip = a.sparse_v_threshold > 0.0f && __all_sync(0xffffffffu, weight <= a.sparse_v_threshold);
      weight_s[h][lane] = weight;
      if (lane == 0) {
        rescale_s[h] = rescale;
        skip_s[h] = skip || h >= num_heads;
      }
    }
    __syncthreads();

    // P·V: thread owns output elements tid, tid + kDecodeThreads, ...
#pragma unroll
    for (int e = 0; e < kElemsPerThread; ++e) {
      const int d = tid + e * kDecodeThreads;
      if (d >= HEAD_DIM) break;
#pragma unroll
      for (int h = 0; h < kHeadsPerCta; ++h) acc[h][e] *= rescale_s[h];
      for (int r = 0; r < tile_len; ++r) {
        const float v = level_s[unpack_code<BITS>(&vcode_s[r][(d / kGroupElems) * 2 * BITS],
                                                  d % kGroupElems)] *
                        e4m3_decode(vscale_s[r][d / kGroupElems]);
#pragma unroll
        for (int h = 0; h < kHeadsPerCta; ++h)
          if (!skip_s[h]) acc[h][e] += weight_s[h][r] * v;
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int j = 0; j < kHeadsPerWarp; ++j)
    if (lane == 0) denom_s[warp + j * kDecodeWarps] = run_denom[j];
  __syncthreads();

  // seq_len == 0 leaves every denominator at 0: the row is written as zeros (FORMAT §5).
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int d = tid + e * kDecodeThreads;
    if (d >= HEAD_DIM) break;
#pragma unroll
    for (int h = 0; h < kHeadsPerCta; ++h) {
      if (h >= num_heads) break;
      const float inv_denom = denom_s[h] > 0.0f ? 1.0f / denom_s[h] : 0.0f;
      a.output[(uint64_t(seq) * a.num_q_heads + first_head + h) * HEAD_DIM + d] =
          __bfloat16_as_ushort(__float2bfloat16(acc[h][e] * inv_denom));
    }
  }
}

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, cudaStream_t stream) {
  const uint32_t group_size = args.num_q_heads / args.num_kv_heads;
  const uint32_t chunks_per_group = (group_size + kHeadsPerCta - 1) / kHeadsPerCta;
  const dim3 grid(args.num_seqs, args.num_kv_heads * chunks_per_group);
  DecodeArgs kernel_args = args;
  void* params[] = {&kernel_args};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM>),
                          grid, dim3(kDecodeThreads), params, 0, stream);
}

}  // namespace fp8kturbov
