// Split slots: which sequence and split a CTA (or a merge row) works on, with the slots shared by
// length (DecodePlan::length_shares), and where a partial lies in the workspace.
#pragma once

#include <cstdint>

#include "kernel_args.h"
#include "decode/ranges.cuh"
#include "decode/traits.cuh"

namespace fp8kturbov {

// ---- Split slots ---------------------------------------------------------------------------------
// With splits the grid holds num_splits CTAs per sequence (for each KV head and query chunk): the
// split slots. Each sequence takes num_splits of them, of split_tokens positions each, except with
// DecodePlan::length_shares: a batch of mixed lengths would then leave the short sequences' CTAs
// idle and give the long ones few, so the slots are shared by length: every sequence gets one, and
// the others go to the sequences in proportion to the tiles that their last query token attends,
// a sequence taking at most one split per kDecodeMinSplitTiles tiles and kDecodeMaxSplits
// partials per query head; the splits of a share divide its range evenly. The decode CTAs and the
// merge kernel all compute the shares from seq_lens in the same order, so they agree and a result
// is deterministic for given inputs. Slots after the last share stay idle.
struct SplitShare {
  uint32_t seq;
  uint32_t first;  // the sequence's slots first ... first + count - 1 hold its splits 0 ... count - 1
  uint32_t count;  // 0: an idle slot
  int seq_len;     // seq_lens[seq] as given, read once by the search (unset for an idle slot)
};

// The weight of a sequence's share, given its seq_len: the tiles that its last query token attends.
// (Capped at `cap`, which keeps the weights' sum under 2^31.)
__device__ __forceinline__ uint32_t share_weight(const DecodeArgs& a, int given_seq_len, uint32_t cap) {
  const int end = clamped_seq_len(a, given_seq_len);
  return min(uint32_t(end / kTileTokens + (end % kTileTokens != 0) - window_start(a, end) / kTileTokens), cap);
}

// Exclusive prefix sum of x over the THREADS threads of the CTA (in thread order), and their total;
// scratch holds THREADS / 32 values.
template <int THREADS>
__device__ uint32_t block_exclusive_sum(uint32_t x, uint32_t& total, uint32_t* scratch) {
  const int lane = threadIdx.x % 32;
  uint32_t inclusive = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t below = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += below;
  }
  __syncthreads();  // scratch may still be read by an earlier sum
  if (lane == 31) scratch[threadIdx.x / 32] = inclusive;
  __syncthreads();
  uint32_t before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    before += w < int(threadIdx.x / 32) ? scratch[w] : 0;
    total += scratch[w];
  }
  return before + inclusive - x;
}

// The share of sequence `key` (BY_SLOT false), or the share that holds split slot `key` (BY_SLOT
// true; count 0 where the slot is idle), also left in found_s. Called by all THREADS threads of
// the CTA, with length_shares; found_s and scratch (THREADS / 32 values) in shared memory.
template <int THREADS, bool BY_SLOT>
__device__ SplitShare split_share(const DecodeArgs& a, const DecodePlan& plan, uint32_t key, uint32_t* scratch,
                                  SplitShare& found_s) {
  const uint32_t num_seqs = a.num_seqs;
  const uint32_t extra_slots = num_seqs * (plan.num_splits - 1);  // the grid's size < 2^31
  const uint32_t most_splits = kDecodeMaxSplits / plan.stream_partials;
  const uint32_t weight_cap = 0x7fffffffu / num_seqs;
  // The sequences go THREADS at a time, a thread each; a batch of THREADS or fewer (the usual one)
  // needs one pass, whose weights and sums the placement then takes as they are.
  const bool one_pass = num_seqs <= THREADS;
  const uint32_t own_seq = threadIdx.x;
  const int own_seq_len = one_pass && own_seq < num_seqs ? a.seq_lens[own_seq] : 0;
  const uint32_t own_weight = share_weight(a, own_seq_len, weight_cap);
  uint32_t total_weight = 0, own_before = 0;
  if (one_pass) {
    own_before = block_exclusive_sum<THREADS>(own_weight, total_weight, scratch);
  } else {
    for (uint32_t first_seq = 0; first_seq < num_seqs; first_seq += THREADS) {
      const uint32_t seq = first_seq + threadIdx.x;
      uint32_t weight;
      block_exclusive_sum<THREADS>(seq < num_seqs ? share_weight(a, a.seq_lens[seq], weight_cap) : 0, weight, scratch);
      total_weight += weight;
    }
  }
  // The slots past one per sequence that go to the sequences whose weights precede `weight`: any
  // nondecreasing function from 0 at 0 to all of them at the total makes the shares sum to the
  // slots, so single precision does (and needs no division routine, whose call spilled registers
  // of the tile loop).
  const float extra_per_weight = total_weight == 0 ? 0.0f : __fdividef(float(extra_slots), float(total_weight));
  auto extra_before = [&](uint32_t weight) {
    return weight >= total_weight ? extra_slots : min(extra_slots, uint32_t(float(weight) * extra_per_weight));
  };
  if (threadIdx.x == 0) found_s = SplitShare{0, 0, 0, 0};
  uint32_t weight_before = 0, slots_before = 0;
  for (uint32_t first_seq = 0; first_seq < num_seqs; first_seq += THREADS) {
    const uint32_t seq = first_seq + threadIdx.x;
    uint32_t chunk_weight = total_weight, chunk_slots;
    const int seq_len = one_pass ? own_seq_len : seq < num_seqs ? a.seq_lens[seq] : 0;
    const uint32_t weight = one_pass ? own_weight : share_weight(a, seq_len, weight_cap);
    const uint32_t before =
        one_pass ? own_before : weight_before + block_exclusive_sum<THREADS>(weight, chunk_weight, scratch);
    uint32_t count = 0;
    if (seq < num_seqs) {
      count = 1 + extra_before(before + weight) - extra_before(before);
      count = min(count, max(weight / kDecodeMinSplitTiles, 1u));
      count = min(count, most_splits);
    }
    const uint32_t first = slots_before + block_exclusive_sum<THREADS>(count, chunk_slots, scratch);
    if (count > 0 && (BY_SLOT ? key >= first && key < first + count : key == seq))
      found_s = SplitShare{seq, uint32_t(first), uint32_t(count), seq_len};
    weight_before += chunk_weight;
    slots_before += chunk_slots;
  }
  __syncthreads();
  return found_s;
}

// Where the partial `partial` (split · stream_partials + stream) of a sequence's query row
// `row_in_seq` (token · num_q_heads + head) lies in the workspace: a share's partials follow
// each other per row, the rows of a sequence each other, and the sequences in slot order.
__device__ __forceinline__ float* partial_address(const DecodePlan& plan, const SplitShare& share, uint32_t rows_per_seq,
                                                  uint32_t row_in_seq, uint32_t partial, int head_dim) {
  const uint64_t slot_row = uint64_t(share.first) * rows_per_seq + uint64_t(row_in_seq) * share.count;
  return plan.workspace + (slot_row * plan.stream_partials + partial) * uint64_t(head_dim + 2);
}

}  // namespace fp8kturbov
