// The expanded context of a long prefill (plan/prefill_plan.h): each tile of positions that a
// sequence's chunk attends, dequantized once into the warp-specialised kernel's tile (fp16 K and V in
// wgmma's blocked layout, a flag per position), where each of the chunk's query tiles would otherwise
// dequantize it again. A CTA per (tile, KV head, sequence): the copy, dequantization and flags are
// the producer's (prefill/phases.cuh), the stores go to global memory instead of shared.
#pragma once

#include <cstdint>

#include "kernel_args.h"
#include "prefill/kernel_ws.cuh"

namespace fp8kturbov {

template <int BITS, int HEAD_DIM>
__global__ void __launch_bounds__(PrefillTileTraits<BITS, HEAD_DIM>::kCopyThreads)
    prefill_expand_kernel(const PrefillArgs a) {
  using T = PrefillWsTraits<BITS, HEAD_DIM, prefill_ws_step_tiles(HEAD_DIM, true)>;  // its tile
  using B = typename T::Base;
  __shared__ typename B::Stage stage;
  __shared__ PrefillLevelPairs<BITS, T::kLevelPairCopies> level_pairs;
  const int tid = int(threadIdx.x);
  PrefillWork w;
  w.seq = blockIdx.z;
  w.kv_head = int(blockIdx.y);
  if (!sequence_query_rows(a, w.seq, w.row0, w.q_len) || w.q_len <= 0) return;  // the prefill reports
  w.seq_len = clamped_seq_len(a, __ldg(a.seq_lens + w.seq));
  // The positions the chunk's rows attend: from its first row's window to its last row's end.
  w.first_flat = 0;
  w.range_begin = prefill_row(a, w, 0).begin;
  w.range_end = w.seq_len;
  const int tile0 = int(blockIdx.x) * T::kKvTile;
  if (tile0 + T::kKvTile <= w.range_begin || tile0 >= w.range_end) return;  // a tile no CTA reads
  fill_level_pairs<BITS, T::kLevelPairCopies>(level_pairs.words, tid, B::kCopyThreads);
  const PrefillTileCopy<BITS, HEAD_DIM> copier(a, w, tid);
  copier.copy(stage, tile0, copier.page(tile0));
  copy_async_wait<0>();
  __syncthreads();
  typename T::Tile& out = *reinterpret_cast<typename T::Tile*>(expanded_tile(a, w.seq, w.kv_head, blockIdx.x));
  dequantize_tile<BITS, HEAD_DIM, B::kCopyThreads>(stage, level_pairs, tid, out.k, out.v, out.position_ok);
}

}  // namespace fp8kturbov
