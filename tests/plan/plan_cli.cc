// The decode planner (cuda/src/plan/) as a filter, for tests/test_plan.py: one decode per input line,
//   v_bits head_dim num_seqs num_q_heads num_kv_heads max_blocks_per_seq block_size sliding_window
//   max_q_len query_start rotation multiprocessors ctas_per_sm head_group_ctas_per_sm workspace_bytes
// (query_start and rotation 0 or 1), one plan per output line,
//   chunks_per_group num_splits split_tokens length_shares stream_partials workspace_bytes tiles
// (workspace_bytes: what the plan needs). Built from the planner's source with a plain C++ compiler.
#include <cinttypes>
#include <cstdio>

#include "plan/decode_plan.h"

int main() {
  using namespace fp8kturbov;
  unsigned v_bits, head_dim, num_seqs, num_q_heads, num_kv_heads, max_blocks, block_size, window, max_q_len;
  unsigned query_start, rotation;
  int multiprocessors, ctas_per_sm, head_group_ctas_per_sm;
  uint64_t workspace_bytes;
  while (std::scanf("%u %u %u %u %u %u %u %u %u %u %u %d %d %d %" SCNu64, &v_bits, &head_dim, &num_seqs, &num_q_heads,
                    &num_kv_heads, &max_blocks, &block_size, &window, &max_q_len, &query_start, &rotation,
                    &multiprocessors, &ctas_per_sm, &head_group_ctas_per_sm, &workspace_bytes) == 15) {
    static int32_t query_start_row;  // any non-null pointer: the planner reads none of it
    fp8kturbov_decode_params_t p{};
    p.v_bits = v_bits;
    p.head_dim = head_dim;
    p.num_seqs = num_seqs;
    p.num_q_heads = num_q_heads;
    p.num_kv_heads = num_kv_heads;
    p.max_blocks_per_seq = max_blocks;
    p.block_size = block_size;
    p.sliding_window = window;
    p.max_q_len = max_q_len;
    p.query_start = query_start ? &query_start_row : nullptr;
    p.v_rotation = rotation ? FP8KTURBOV_V_ROTATION_HADAMARD : FP8KTURBOV_V_ROTATION_NONE;
    const DecodeDevice device{multiprocessors, ctas_per_sm, head_group_ctas_per_sm};
    const DecodePlan plan = plan_decode(p, device, workspace_bytes);
    std::printf("%u %u %d %d %u %" PRIu64 " %" PRIu64 "\n", plan.chunks_per_group, plan.num_splits, plan.split_tokens,
                int(plan.length_shares), plan.stream_partials,
                decode_workspace_bytes(plan, num_seqs, query_rows_per_seq(p), num_q_heads, head_dim),
                tiles_per_sequence(p));
  }
  return 0;
}
