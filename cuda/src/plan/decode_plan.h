// The decode's plan: how a decode is split over CTAs, its work units, and the rules that the planner
// and the kernels share. Plain host C++ (no CUDA runtime), so that plans are tested without a GPU
// (tests/test_plan.py).
#pragma once

#include <cstdint>

#include "fp8kturbov.h"
#include "plan/host_device.h"

namespace fp8kturbov {

// Decode work units (shared by the planner and the kernel).
constexpr int kDecodeTileTokens = 16;   // positions per mma tile
constexpr int kDecodeHeadsPerCta = 8;   // query columns (query head, query token) per CTA
constexpr int kDecodeWarps = 4;         // warps per CTA
constexpr int kDecodeSliceDim = 128;    // head dimensions of a warp's d-slice at most
constexpr int kDecodeMaxQueryLen = FP8KTURBOV_MAX_QUERY_LEN;  // query tokens per sequence at most
constexpr int kDecodeCtasPerSm = 4;     // launch bounds: registers sized for 4 resident CTAs per SM
constexpr int kDecodeMinSplitTiles = 8; // no split shorter than this many tiles
constexpr int kDecodeMaxSplits = 1024;  // partials per query head at most (splits x stream partials)
// Split slots shared by length (DecodePlan::length_shares) where the plan has at least this many
// splits per sequence, of at least this many tiles: finding the shares costs each CTA about a
// microsecond before its first copies, and the merge as much, which shorter splits do not win back,
// and 2 or 3 splits per sequence leave little to share (docs/PERFORMANCE.md, logs 65 and 66).
constexpr int kDecodeLengthShareMinSplits = 4;
constexpr int kDecodeLengthShareMinSplitTiles = 64;
// Head groups (DecodePlan::stream_partials) where the plan's token streams are at least this many
// tiles long: shorter ones lose more to the merge of 4 times the partials than the reads of
// neighbouring heads gain (docs/PERFORMANCE.md, log 54).
constexpr int kDecodeHeadGroupMinStreamTiles = 64;

// Token streams of a CTA: each warp streams its own tiles, except that with head_dim > 128 the
// warps of a stream share its tiles, a d-slice each. A CTA lasts as long as its longest stream.
FP8KTURBOV_HOST_DEVICE constexpr int decode_streams_per_cta(int head_dim) {
  return kDecodeWarps / (head_dim > kDecodeSliceDim ? head_dim / kDecodeSliceDim : 1);
}

// Head groups (DecodePlan::stream_partials) have kernel instances where every warp streams tiles
// of its own (up to head_dim 128), for 2- and 3-bit V: 4-bit V, whose tiles are held by their
// shared-memory lookups, measured no faster with them (docs/PERFORMANCE.md, log 54).
FP8KTURBOV_HOST_DEVICE constexpr bool decode_head_groups_built(int bits, int head_dim) {
  return bits <= 3 && decode_streams_per_cta(head_dim) == kDecodeWarps;
}

// How a decode is split over CTAs (FORMAT §5 does not depend on it; rounding does, so a plan is
// a pure function of the shape, the device's multiprocessor count and the workspace size).
struct DecodePlan {
  uint32_t chunks_per_group;  // CTAs per KV head: ceil(max_q_len * group size / 8)
  uint32_t num_splits;        // context splits per sequence (with length_shares: on average)
  int32_t split_tokens;       // positions per split, a multiple of the 16-token tile (without length_shares)
  // The sequences share the num_seqs * num_splits split slots by length (decode/schedule.cuh), each
  // dividing its range among its own; else each takes num_splits of split_tokens positions.
  bool length_shares;
  // Partials per split and query head. 1: a CTA's warps read one KV head, and the CTA merges their
  // token streams. kDecodeWarps (head groups, where the planner allows them): a CTA's warps read
  // kDecodeWarps neighbouring KV heads, warp w head w, all over one token stream of the split, and
  // each warp writes its head's partial.
  uint32_t stream_partials;
  // When partials > 1: [num_seqs * num_splits slots][max_q_len][num_q_heads][stream_partials][head_dim + 2]
  // floats, as the shares of the slots lay them out (partial_address).
  float* workspace;
};

// Partials per (sequence, query token, query head) that the merge kernel combines; 1 = no
// workspace used, the decode kernel writes the output.
FP8KTURBOV_HOST_DEVICE inline uint32_t decode_partials(const DecodePlan& plan) {
  return plan.num_splits * plan.stream_partials;
}

// CTAs per KV head: one per chunk of up to kDecodeHeadsPerCta columns, a column being one query
// head of the GQA group for one query token of the sequence (token-major).
inline uint32_t decode_chunks_per_group(uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t max_q_len) {
  return (max_q_len * (num_q_heads / num_kv_heads) + kDecodeHeadsPerCta - 1) / kDecodeHeadsPerCta;
}

// Workspace bytes a plan needs.
inline uint64_t decode_workspace_bytes(const DecodePlan& plan, uint32_t num_seqs, uint32_t max_q_len,
                                       uint32_t num_q_heads, uint32_t head_dim) {
  if (decode_partials(plan) <= 1) return 0;
  return uint64_t(num_seqs) * max_q_len * num_q_heads * decode_partials(plan) * (head_dim + 2) * sizeof(float);
}

// Query rows per sequence the grid and the workspace are sized for: max_q_len, where 0 means 1.
inline uint32_t query_rows_per_seq(const fp8kturbov_decode_params_t& p) { return p.max_q_len > 1 ? p.max_q_len : 1u; }

constexpr uint64_t kDecodeMaxWaves = 8;  // splits add CTAs up to this many waves at most

// The device facts a plan depends on.
struct DecodeDevice {
  int multiprocessors = 0;
  int ctas_per_sm = 0;             // of the default kernel
  int head_group_ctas_per_sm = 0;  // of the head-group kernel, 0 where not built
};

// Tiles of 16 positions a sequence's query tokens attend at most (the grid is sized for them).
uint64_t tiles_per_sequence(const fp8kturbov_decode_params_t& p);

// Head groups need the default decode (one query token, unrotated V), one CTA per KV head (a
// group of at most kDecodeHeadsPerCta query heads), whole groups of KV heads, and a kernel instance
// that fits as many CTAs per multiprocessor as the default one (the plan's waves assume it).
bool head_groups_allowed(const fp8kturbov_decode_params_t& p, const DecodePlan& plan, bool same_occupancy);

// The plan of a validated decode on `device` with `workspace_bytes` of workspace (its pointer from
// p.workspace).
DecodePlan plan_decode(const fp8kturbov_decode_params_t& p, const DecodeDevice& device, uint64_t workspace_bytes);

}  // namespace fp8kturbov
