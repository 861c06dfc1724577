// The P·V work of one tile in a warp's d-slice: the products of V codes and weights into the output
// accumulators.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "format.cuh"
#include "decode/ptx.cuh"
#include "decode/traits.cuh"
#include "decode/v_codes.cuh"

namespace fp8kturbov {

// O^T += V^T · P^T over one tile of a warp's d-slice (mma m16n8k16, d × heads): the weights p_lo,
// p_hi (fp16 pairs of mma rows g and g + 8, heads 2t and 2t + 1) against the V codes of the stage,
// looked up in the level-pair table and scaled per 16-element group. `v_row_first`: the stage row of
// this thread's first P·V token (MmaRows::token(2t)).
template <int BITS, int HEAD_DIM>
__device__ __forceinline__ void accumulate_values(float (&acc)[DecodeShape<BITS, HEAD_DIM>::kMTiles][4], const uint8_t* stage_codes,
                                                  const uint8_t* stage_scales, const uint32_t* level_pair_s, int v_row_first,
                                                  int lane, uint32_t p_lo, uint32_t p_hi) {
  using S = DecodeShape<BITS, HEAD_DIM>;
  using Rows = MmaRows<S::kKRowBytes == 128>;
  using LevelPairs = LevelPairTable<BITS, HEAD_DIM>;
  const int g = lane / 4;  // mma groupID
  // P^T as the B operand: mma rows (2t, 2t+1) and (2t+8, 2t+9) of head g.
  const uint32_t pb0 = transpose_8x8(p_lo);
  const uint32_t pb1 = transpose_8x8(p_hi);
  // This thread's codes and scales of the tokens of mma rows 2t, 2t+1, 2t+8, 2t+9;
  // scales as fp16 pairs of rows (2t, 2t+1) and (2t+8, 2t+9).
  uint32_t codes[4][CodeChunk<S::kCodeBytes>::kWords];
  uint32_t scale_bytes[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = v_row_first + Rows::v_row_offset(j);
    read_code_bytes<S::kCodeBytes>(stage_codes + row * S::kCodeRowBytes, g * S::kCodeBytes, codes[j]);
    scale_bytes[j] = stage_scales[row * S::kScaleRowPitch + g * S::kThreadDims / kGroupElems];
  }
  const uint32_t scale_pair[2] = {e4m3x2_to_half2_bits(scale_bytes[0] | (scale_bytes[1] << 8)),
                                  e4m3x2_to_half2_bits(scale_bytes[2] | (scale_bytes[3] << 8))};
  // Pair-index words of mma rows (2t, 2t+1) and (2t+8, 2t+9): [pair][chunk][even/odd].
  using P = CodePairs<BITS>;
  constexpr int kChunks = (S::kThreadDims + P::kCodesPerChunk - 1) / P::kCodesPerChunk;
  uint32_t pairs[2][kChunks][2];
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      pair_words<BITS>(code_chunk<BITS>(codes[2 * pair], c), code_chunk<BITS>(codes[2 * pair + 1], c), pairs[pair][c]);
  }
  const uint8_t* level_pairs = reinterpret_cast<const uint8_t*>(level_pair_s);
  const uint32_t lane_copy = 4 * (lane % LevelPairs::kCopies);  // byte offset of this lane's copy
#pragma unroll
  for (int i = 0; i < S::kMTiles; ++i) {
    uint32_t a_frag[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // (d 2i, tokens 2t..), (d 2i+1, ..), (d 2i, 2t+8..), (d 2i+1, ..)
      const int e = 2 * i + (r & 1);
      const int pair = r >> 1;
      const int local = e % P::kCodesPerChunk;
      const uint32_t offset = pair_offset<BITS, HEAD_DIM>(pairs[pair][e / P::kCodesPerChunk][local % 2], local / 2) | lane_copy;
      const __half2 levels = *reinterpret_cast<const __half2*>(level_pairs + offset);
      const __half2 v = __hmul2(levels, *reinterpret_cast<const __half2*>(&scale_pair[pair]));
      a_frag[r] = *reinterpret_cast<const uint32_t*>(&v);
    }
    mma_16x8x16(acc[i], a_frag, pb0, pb1);
  }
}

}  // namespace fp8kturbov
