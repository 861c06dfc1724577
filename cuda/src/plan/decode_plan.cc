// The split planner (plan/decode_plan.h).
//
// The CTAs of a decode run in waves of multiprocessors * ctas_per_sm, and a CTA
// lasts as long as its busiest token stream (decode_streams_per_cta): a split of 33 tiles over 4
// streams runs 9, 8, 8 and 8 tiles, as long as one of 36. So the plan takes the split count with
// the fewest tile times, waves × tiles per stream (the fewest splits of equal ones), with splits
// cut into whole tiles per stream, each at least kDecodeMinSplitTiles tiles long, and no split
// unless the workspace holds the partials. Then head groups (DecodePlan::stream_partials) where
// they are allowed and the token streams are long. A pure function of the shape, the device and
// the workspace size.
#include "plan/decode_plan.h"

#include <algorithm>
#include <climits>

namespace fp8kturbov {

uint64_t tiles_per_sequence(const fp8kturbov_decode_params_t& p) {
  const uint64_t table_positions = uint64_t(p.max_blocks_per_seq) * p.block_size;
  // The query tokens of a sequence attend windows that end at consecutive positions.
  const uint64_t window_span = uint64_t(p.sliding_window) + query_rows_per_seq(p) - 1;
  const uint64_t span = p.sliding_window > 0 && window_span < table_positions ? window_span : table_positions;
  // Tiles sit on multiples of 16 positions: an unaligned window start adds at most one tile.
  const uint64_t unaligned_start = p.sliding_window > 0 ? kDecodeTileTokens - 1 : 0;
  return (span + unaligned_start + kDecodeTileTokens - 1) / kDecodeTileTokens;
}

bool head_groups_allowed(const fp8kturbov_decode_params_t& p, const DecodePlan& plan, bool same_occupancy) {
  return decode_head_groups_built(int(p.v_bits), int(p.head_dim)) && same_occupancy && p.query_start == nullptr &&
         p.v_rotation == FP8KTURBOV_V_ROTATION_NONE && plan.chunks_per_group == 1 &&
         p.num_kv_heads % kDecodeWarps == 0;
}

DecodePlan plan_decode(const fp8kturbov_decode_params_t& p, const DecodeDevice& device, uint64_t workspace_bytes) {
  DecodePlan plan{};
  plan.chunks_per_group = decode_chunks_per_group(p.num_q_heads, p.num_kv_heads, query_rows_per_seq(p));
  plan.stream_partials = 1;
  const uint64_t tiles = tiles_per_sequence(p);
  const uint64_t base_ctas = uint64_t(p.num_seqs) * p.num_kv_heads * plan.chunks_per_group;
  const uint64_t slots = uint64_t(std::max(device.multiprocessors, 1)) * std::max(device.ctas_per_sm, 1);
  const uint64_t max_splits = std::min<uint64_t>({kDecodeMaxSplits, std::max<uint64_t>(1, tiles / kDecodeMinSplitTiles),
                                                  INT32_MAX / std::max<uint64_t>(base_ctas, 1),
                                                  (kDecodeMaxWaves * slots + base_ctas - 1) / std::max<uint64_t>(base_ctas, 1)});
  const uint64_t streams = uint64_t(decode_streams_per_cta(int(p.head_dim)));
  auto tiles_per_split = [&](uint64_t splits) {  // a multiple of the streams, as long as they are busy
    return ((tiles + splits - 1) / splits + streams - 1) / streams * streams;
  };
  auto realized = [&](uint64_t splits) { return (tiles + tiles_per_split(splits) - 1) / tiles_per_split(splits); };
  auto tile_times = [&](uint64_t splits) {
    const uint64_t waves = (base_ctas * realized(splits) + slots - 1) / slots;
    return waves * (tiles_per_split(splits) / streams);
  };
  // For w waves, the most splits that fit in them give the shortest streams: the best candidate
  // for w. (max_splits holds the CTAs to kDecodeMaxWaves waves.)
  uint64_t splits = 1;
  for (uint64_t waves = 1; waves <= kDecodeMaxWaves; ++waves) {
    const uint64_t candidate = std::min(max_splits, waves * slots / std::max<uint64_t>(base_ctas, 1));
    if (candidate > 1 && tile_times(candidate) < tile_times(splits)) splits = candidate;
  }
  plan.num_splits = uint32_t(realized(splits));
  plan.split_tokens = int32_t(std::min<uint64_t>(tiles_per_split(splits) * kDecodeTileTokens, INT32_MAX));
  plan.workspace = static_cast<float*>(p.workspace);
  if (plan.num_splits > 1 &&
      decode_workspace_bytes(plan, p.num_seqs, query_rows_per_seq(p), p.num_q_heads, p.head_dim) >
          workspace_bytes) {
    plan.num_splits = 1;
    plan.split_tokens = INT32_MAX;
  }
  // With several sequences and many long splits, the sequences share the split slots by their lengths.
  plan.length_shares = p.num_seqs > 1 && plan.num_splits >= kDecodeLengthShareMinSplits &&
                       uint64_t(plan.split_tokens) / kDecodeTileTokens >= kDecodeLengthShareMinSplitTiles;
  // Head groups keep the grid, the splits and each warp's token stream; each (KV head, split) then
  // has a partial per stream.
  DecodePlan grouped = plan;
  grouped.stream_partials = uint32_t(streams);
  const uint64_t stream_tiles =
      (std::min<uint64_t>(tiles, uint64_t(plan.split_tokens) / kDecodeTileTokens) + streams - 1) / streams;
  if (head_groups_allowed(p, plan, device.head_group_ctas_per_sm == device.ctas_per_sm) &&
      stream_tiles >= kDecodeHeadGroupMinStreamTiles && decode_partials(grouped) <= kDecodeMaxSplits &&
      decode_workspace_bytes(grouped, p.num_seqs, query_rows_per_seq(p), p.num_q_heads, p.head_dim) <=
          workspace_bytes)
    plan = grouped;
  return plan;
}

}  // namespace fp8kturbov
