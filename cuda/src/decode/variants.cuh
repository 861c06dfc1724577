// The decode's variants and score hooks. A kernel instance is a DecodeVariant: the features that
// change the code's shape (multi-token queries, V rotation, head groups, split slots shared by
// length) are compile-time flags of it, each its own; the features that are runtime arguments
// (the sliding window, logit soft-capping, attention sinks) enter through the hooks below, which
// the kernel calls at fixed points. The instances built are the table in decode/instances.cuh.
#pragma once

#include <cstdint>

#include "decode/decode_args.h"

namespace fp8kturbov {

constexpr float kLog2e = 1.4426950408889634f;

// Whether a variant's CTAs find their split slots by sequence length (DecodePlan::length_shares).
enum class LengthShares {
  kNever,   // equal splits: each sequence takes num_splits slots
  kAlways,  // plans with length_shares only
  kByPlan,  // as the plan says (a run-time branch)
};

template <bool MULTI_TOKEN, bool ROTATION, bool HEAD_GROUPS, LengthShares SHARES>
struct DecodeVariant {
  // Several query tokens per sequence (DecodeArgs::query_start): columns are (token, head) pairs,
  // each attending its own causal range.
  static constexpr bool kMultiToken = MULTI_TOKEN;
  // Rotated V (FORMAT §6): outputs are rotated back before they are normalised.
  static constexpr bool kRotation = ROTATION;
  // Head groups (DecodePlan::stream_partials > 1): a CTA's warps read neighbouring KV heads.
  static constexpr bool kHeadGroups = HEAD_GROUPS;
  static constexpr LengthShares kShares = SHARES;
  // The variant whose merge kernel combines this one's partials (head groups change only how
  // many partials there are).
  using Merge = DecodeVariant<MULTI_TOKEN, ROTATION, false, SHARES>;

  // Whether the kernel instance exists for this shape.
  static constexpr bool built(int bits, int head_dim) {
    return !HEAD_GROUPS || (decode_head_groups_built(bits, head_dim) && !MULTI_TOKEN && !ROTATION);
  }
  // Whether it runs a launch of these features: it has each the launch needs, and the plan's head
  // groups and (unless it follows the plan) its split shares.
  static constexpr bool serves(bool multi_token, bool rotation, bool head_groups, bool length_shares) {
    return (!multi_token || MULTI_TOKEN) && (!rotation || ROTATION) && head_groups == HEAD_GROUPS &&
           (SHARES == LengthShares::kByPlan || length_shares == (SHARES == LengthShares::kAlways));
  }
  __device__ static bool length_shares(const DecodePlan& plan) {
    return SHARES == LengthShares::kByPlan ? plan.length_shares : SHARES == LengthShares::kAlways;
  }
  // Query rows of a sequence: max_q_len with several tokens, else 1.
  __device__ static uint32_t rows_per_seq(const DecodeArgs& a) { return MULTI_TOKEN ? a.max_q_len : 1u; }
};

// ---- Query rows (multi-token decode) ---------------------------------------------------------------

// The query rows [row0, row0 + q_len) of sequence `seq` (DecodeArgs::query_start), or its one row
// without query_start. False where query_start is inconsistent (negative, decreasing, q_len >
// max_q_len, or past num_query_rows in checked mode): the sequence is skipped.
__device__ __forceinline__ bool sequence_query_rows(const DecodeArgs& a, uint32_t seq, uint32_t& row0, int& q_len) {
  if (a.query_start == nullptr) {
    row0 = seq;
    q_len = 1;
    return true;
  }
  const int32_t first = a.query_start[seq];
  const int32_t end = a.query_start[seq + 1];
  row0 = uint32_t(first);
  q_len = int(int64_t(end) - first);
  return first >= 0 && end >= first && q_len <= int(a.max_q_len) &&
         (!a.index_check.enabled() || uint32_t(end) <= a.num_query_rows);
}

// ---- Attended positions --------------------------------------------------------------------------

// FORMAT §5: a seq_len beyond the block table is clamped to it, so that no read leaves the table.
__device__ __forceinline__ int clamped_seq_len(const DecodeArgs& a, int given_seq_len) {
  const int table_positions = int(a.max_blocks_per_seq * a.block_size);  // < 2^31, validated
  return min(max(given_seq_len, 0), table_positions);
}

// The sliding window: the first position a query token attends that attends the positions before `end`.
__device__ __forceinline__ int window_start(const DecodeArgs& a, int end) {
  return (a.sliding_window > 0 && end > int(a.sliding_window)) ? end - int(a.sliding_window) : 0;
}

// ---- Scores ----------------------------------------------------------------------------------------

// tanh(x) for logit soft-capping: 1 − 2 / (e^(2x) + 1), exact to a few float ulps in absolute
// terms (which is what a score needs) and ±1 for large |x|.
__device__ __forceinline__ float soft_cap_tanh(float x) {
  return 1.0f - __fdividef(2.0f, exp2f(x * (2.0f * kLog2e)) + 1.0f);
}

// Raw scores q·k (of the query scaled by q_gain) to the log2 domain: s2 = (q·k) · k_scale ·
// inv_sqrt_d · log2(e), or with soft-capping s2 = cap · tanh((q·k) · k_scale · inv_sqrt_d / cap) ·
// log2(e).
struct ScoreTransform {
  float to_log2;  // without soft-capping
  float per_cap;  // with it: the tanh's argument per raw score
  float cap_log2;
  bool soft_capped;  // uniform over the launch

  __device__ static ScoreTransform make(const DecodeArgs& a, float q_gain) {
    return {a.score_scale * kLog2e / q_gain, a.soft_cap > 0.0f ? a.score_scale / q_gain / a.soft_cap : 0.0f,
            a.soft_cap * kLog2e, a.soft_cap > 0.0f};
  }
  __device__ __forceinline__ void apply(float (&s)[4]) const {
    if (soft_capped) {
#pragma unroll
      for (int r = 0; r < 4; ++r) s[r] = cap_log2 * soft_cap_tanh(s[r] * per_cap);
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r) s[r] *= to_log2;
    }
  }
};

// Attention sinks: the sink logit of query head `head` in the log2 domain, or -inf without sinks.
__device__ __forceinline__ float sink_log2(const DecodeArgs& a, uint64_t head) {
  return a.sinks == nullptr ? -INFINITY : a.sinks[head] * kLog2e;
}

}  // namespace fp8kturbov
