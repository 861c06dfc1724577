// The prefill's plan: how many context splits each (query tile, KV head) takes, and the workspace
// their partials need. Plain host C++ (no CUDA runtime), so that plans are tested without a GPU.
#pragma once

#include <cstdint>

#include "fp8kturbov.h"
#include "plan/host_device.h"

#ifndef FP8KTURBOV_PREFILL_WS  // 1 where the architecture list holds sm_90a code (CMakeLists.txt)
#define FP8KTURBOV_PREFILL_WS 0
#endif

namespace fp8kturbov {

// Query rows ((token, query head) pairs of one KV head) per prefill CTA, the grid's tiles: 64 for the
// mma.sync kernel, 128 for the warp-specialised wgmma kernel (two consumer warpgroups).
constexpr uint32_t kPrefillQueryRows = 64;
constexpr uint32_t kPrefillWsQueryRows = 128;
// The largest head_dim the prefill is built for (its CTA's tiles in shared memory).
constexpr uint32_t kPrefillMaxHeadDim = 256;
constexpr uint32_t kPrefillMinSplitTiles = 4;  // no split shorter than this many tiles of positions
constexpr uint32_t kPrefillMaxSplits = 256;    // partials per (query row, head) at most
constexpr uint64_t kPrefillMaxWaves = 2;       // splits add CTAs up to this many waves at most
// A chunk of at least this many warp-specialised query tiles per KV head reads an expanded context
// (its tiles dequantized once, not once per query tile) where the workspace holds it. Below it,
// writing and rereading the fp16 tiles costs more than the dequantizations it saves (measured in
// docs/PERFORMANCE.md, Prefill).
constexpr uint64_t kPrefillMinExpandQueryTiles = 8;

// Positions per tile of a prefill CTA's loop (its K and V tiles in shared memory).
FP8KTURBOV_HOST_DEVICE constexpr uint32_t prefill_kv_tile(uint32_t head_dim) { return head_dim <= 128 ? 64 : 32; }

// Bytes of a dequantized tile of the expanded context (the warp-specialised kernel's tile: fp16 K
// and V in wgmma's blocked layout, then a flag per position, padded to 128 bytes).
FP8KTURBOV_HOST_DEVICE constexpr uint32_t prefill_expanded_tile_bytes(uint32_t head_dim) {
  return 4 * prefill_kv_tile(head_dim) * head_dim + 128;
}

// Query tiles of the longest chunk, of `tile_rows` rows: the prefill grid's tiles per sequence.
inline uint64_t prefill_tiles_per_seq(const fp8kturbov_prefill_params_t& p, uint32_t tile_rows = kPrefillQueryRows) {
  const uint64_t rows = uint64_t(p.max_q_len) * (p.num_q_heads / p.num_kv_heads);
  return (rows + tile_rows - 1) / tile_rows;
}

// How a prefill is split over CTAs: each (query tile, KV head) takes num_splits CTAs, split s
// attending only the positions [s·split_positions, (s + 1)·split_positions) of its rows' ranges; a
// merge kernel then combines the splits' partials by their log-denominators. One split: no
// workspace, the prefill kernel writes the output.
struct PrefillPlan {
  uint32_t num_splits;
  uint32_t split_positions;  // a multiple of the tile (prefill_kv_tile)
  uint32_t query_rows;       // per CTA: kPrefillQueryRows, or kPrefillWsQueryRows (warp-specialised)
  uint32_t expanded_tiles;   // tiles of each (sequence, KV head)'s expanded context; 0: none
};

// Workspace bytes of a plan's partials: [num_splits][num_query_rows][num_q_heads] rows of head_dim
// floats (the normalised partial outputs), then as many floats of log-denominators.
inline uint64_t prefill_partials_bytes(const PrefillPlan& plan, uint32_t num_query_rows, uint32_t num_q_heads,
                                       uint32_t head_dim) {
  if (plan.num_splits <= 1) return 0;
  return uint64_t(plan.num_splits) * num_query_rows * num_q_heads * (uint64_t(head_dim) + 1) * sizeof(float);
}

// Where the expanded context starts in the workspace: after the partials, 128-byte aligned.
inline uint64_t prefill_expanded_offset(const PrefillPlan& plan, uint32_t num_query_rows, uint32_t num_q_heads,
                                        uint32_t head_dim) {
  return (prefill_partials_bytes(plan, num_query_rows, num_q_heads, head_dim) + 127) / 128 * 128;
}

// Workspace bytes of a plan: the partials, then the expanded context
// ([num_seqs][num_kv_heads][expanded_tiles] tiles).
inline uint64_t prefill_workspace_bytes(const PrefillPlan& plan, const fp8kturbov_prefill_params_t& p) {
  const uint64_t partials = prefill_partials_bytes(plan, p.num_query_rows, p.num_q_heads, p.head_dim);
  if (plan.expanded_tiles == 0) return partials;
  return prefill_expanded_offset(plan, p.num_query_rows, p.num_q_heads, p.head_dim) +
         uint64_t(p.num_seqs) * p.num_kv_heads * plan.expanded_tiles * prefill_expanded_tile_bytes(p.head_dim);
}

// The plan of a validated prefill on a device of `multiprocessors` with `ctas_per_sm` resident CTAs
// each, with `workspace_bytes` of workspace, for CTAs of `query_rows` rows: splits where the
// unsplit grid leaves the device short of a wave, as many as fill it (up to kPrefillMaxWaves
// waves), each at least kPrefillMinSplitTiles tiles long, and none unless the workspace holds the
// partials. A pure function of its arguments.
PrefillPlan plan_prefill(const fp8kturbov_prefill_params_t& p, int multiprocessors, int ctas_per_sm,
                         uint64_t workspace_bytes, uint32_t query_rows);

}  // namespace fp8kturbov
