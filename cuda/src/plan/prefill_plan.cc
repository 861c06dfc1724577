// The prefill's split planner (plan/prefill_plan.h).
#include "plan/prefill_plan.h"

#include <algorithm>
#include <climits>

namespace fp8kturbov {

PrefillPlan plan_prefill(const fp8kturbov_prefill_params_t& p, int multiprocessors, int ctas_per_sm,
                         uint64_t workspace_bytes, uint32_t query_rows) {
  const uint32_t tile = prefill_kv_tile(p.head_dim);
  const uint64_t table_positions = uint64_t(p.max_blocks_per_seq) * p.block_size;
  const uint64_t table_tiles = (table_positions + tile - 1) / tile;
  // The expanded context, where the chunk's query tiles would each dequantize the same tiles.
  const bool expands = query_rows == kPrefillWsQueryRows && p.num_seqs <= 65535 &&
                       prefill_tiles_per_seq(p, query_rows) >= kPrefillMinExpandQueryTiles;
  PrefillPlan unsplit{1, uint32_t(table_tiles * tile), query_rows, expands ? uint32_t(table_tiles) : 0};
  if (prefill_workspace_bytes(unsplit, p) > workspace_bytes) unsplit.expanded_tiles = 0;
  const uint64_t base_ctas =
      std::max<uint64_t>(uint64_t(p.num_seqs) * prefill_tiles_per_seq(p, query_rows) * p.num_kv_heads, 1);
  const uint64_t slots = uint64_t(std::max(multiprocessors, 1)) * std::max(ctas_per_sm, 1);
  if (base_ctas >= slots) return unsplit;
  const uint64_t wanted = (kPrefillMaxWaves * slots) / base_ctas;
  const uint64_t splits = std::min<uint64_t>({wanted, table_tiles / kPrefillMinSplitTiles, kPrefillMaxSplits,
                                              INT32_MAX / base_ctas});
  if (splits <= 1) return unsplit;
  const uint64_t split_tiles = (table_tiles + splits - 1) / splits;
  PrefillPlan plan{uint32_t((table_tiles + split_tiles - 1) / split_tiles), uint32_t(split_tiles * tile), query_rows,
                   unsplit.expanded_tiles};
  if (prefill_workspace_bytes(plan, p) > workspace_bytes) return unsplit;
  return plan;
}

}  // namespace fp8kturbov
