// Which positions a query row attends and where they lie: position -> (page, offset), the query
// rows of a sequence (multi-token decode), the seq_len clamp and the sliding window. Args: the
// decode's DecodeArgs or the prefill's PrefillArgs, which name these fields alike.
#pragma once

#include <cstdint>

#include "kernel_args.h"

namespace fp8kturbov {

// Position -> (block, offset) by the runtime block size with a multiply and a shift
// (round-up reciprocal, exact for positions < 2^31; the host computes multiplier and shift).
template <typename Args>
__device__ __forceinline__ void split_position(const Args& a, uint32_t pos, uint32_t& block,
                                               uint32_t& offset) {
  block = uint32_t((uint64_t(__umulhi(pos, a.block_size_multiplier)) + pos) >> a.block_size_shift);
  offset = pos - block * a.block_size;
}

// Multi-token decode (DecodeArgs::query_start): the query rows [row0, row0 + q_len) of sequence
// `seq`, or its one row without query_start. False where query_start is inconsistent (negative,
// decreasing, q_len > max_q_len, or past num_query_rows in checked mode): the sequence is skipped.
template <typename Args>
__device__ __forceinline__ bool sequence_query_rows(const Args& a, uint32_t seq, uint32_t& row0, int& q_len) {
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

// FORMAT §5: a seq_len beyond the block table is clamped to it, so that no read leaves the table.
template <typename Args>
__device__ __forceinline__ int clamped_seq_len(const Args& a, int given_seq_len) {
  const int table_positions = int(a.max_blocks_per_seq * a.block_size);  // < 2^31, validated
  return min(max(given_seq_len, 0), table_positions);
}

// The first position of the sliding window of a query token that attends the positions before `end`.
template <typename Args>
__device__ __forceinline__ int window_start(const Args& a, int end) {
  return (a.sliding_window > 0 && end > int(a.sliding_window)) ? end - int(a.sliding_window) : 0;
}

}  // namespace fp8kturbov
