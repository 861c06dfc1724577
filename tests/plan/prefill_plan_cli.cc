// The prefill planner (cuda/src/plan/prefill_plan.cc) as a filter, for tests/test_prefill_plan.py: one
// prefill per input line,
//   head_dim num_seqs num_q_heads num_kv_heads max_blocks_per_seq block_size max_q_len num_query_rows
//   multiprocessors ctas_per_sm workspace_bytes query_rows
// one plan per output line,
//   num_splits split_positions workspace_bytes tiles_per_seq expanded_tiles
// (workspace_bytes: what the plan needs; query_rows: the kernel's rows per CTA). Built from the planner's source with a plain C++ compiler.
#include <cinttypes>
#include <cstdio>

#include "plan/prefill_plan.h"

int main() {
  using namespace fp8kturbov;
  unsigned head_dim, num_seqs, num_q_heads, num_kv_heads, max_blocks, block_size, max_q_len, num_query_rows;
  int multiprocessors, ctas_per_sm;
  uint64_t workspace_bytes;
  unsigned query_rows;
  while (std::scanf("%u %u %u %u %u %u %u %u %d %d %" SCNu64 " %u", &head_dim, &num_seqs, &num_q_heads, &num_kv_heads,
                    &max_blocks, &block_size, &max_q_len, &num_query_rows, &multiprocessors, &ctas_per_sm,
                    &workspace_bytes, &query_rows) == 12) {
    fp8kturbov_prefill_params_t p{};
    p.head_dim = head_dim;
    p.num_seqs = num_seqs;
    p.num_q_heads = num_q_heads;
    p.num_kv_heads = num_kv_heads;
    p.max_blocks_per_seq = max_blocks;
    p.block_size = block_size;
    p.max_q_len = max_q_len;
    p.num_query_rows = num_query_rows;
    const PrefillPlan plan = plan_prefill(p, multiprocessors, ctas_per_sm, workspace_bytes, query_rows);
    std::printf("%u %u %" PRIu64 " %" PRIu64 " %u\n", plan.num_splits, plan.split_positions,
                prefill_workspace_bytes(plan, p), prefill_tiles_per_seq(p, plan.query_rows), plan.expanded_tiles);
  }
  return 0;
}
