// Per-instance traits of the decode kernel: the CTA's work units, the shape of a warp's slice and of
// a pipeline stage, the shared-memory layout, the launch bounds, and the mma row order.
#pragma once

#include <cstdint>

#include "format.cuh"
#include "kernel_args.h"
#include "decode/v_codes.cuh"

namespace fp8kturbov {

constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kTileTokens = kDecodeTileTokens;    // the mma's M (scores) and K (P·V) extent
constexpr int kHeadsPerCta = kDecodeHeadsPerCta;  // the mma's N extent
constexpr float kLog2e = 1.4426950408889634f;

// The token (stage row) of mma row m of the scores, which is also the reduction index of P·V: with
// 128-byte K rows (SWIZZLED), rows 2p and 2p + 1 of each 8 hold tokens p and p + 4, whose swizzled
// chunks lie in opposite halves of the banks (a quarter-warp's fragment reads cover rows 2p and
// 2p + 1). Any order of the tokens gives the same sums. A thread's P·V rows 2t, 2t+1, 2t+8, 2t+9
// are token(2t) plus constants, so its four code and scale reads share one address register.
template <bool SWIZZLED>
struct MmaRows {
  __host__ __device__ static constexpr int token(int m) { return SWIZZLED ? (m & 8) | ((m & 7) >> 1) | ((m & 1) << 2) : m; }
  // A thread's P·V rows: mma row 2t + v_row_step(j), for j = 0..3, is token v_row_offset(j) rows
  // after token(2t).
  __host__ __device__ static constexpr int v_row_step(int j) { return (j & 1) + 8 * (j >> 1); }
  __host__ __device__ static constexpr int v_row_offset(int j) { return token(v_row_step(j)) - token(0); }
  static constexpr bool v_rows_affine() {
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 4; ++j)
        if (token(2 * t + v_row_step(j)) != token(2 * t) + v_row_offset(j)) return false;
    return true;
  }
  static_assert(v_rows_affine(), "a thread's P·V rows are token(2t) plus constants");
};

template <int BITS, int HEAD_DIM>
struct DecodeShape {
  static constexpr int kStreams = decode_streams_per_cta(HEAD_DIM);      // token streams per CTA
  static constexpr int kSlices = kDecodeWarps / kStreams;                // warps sharing a stream
  static constexpr int kSliceDim = HEAD_DIM / kSlices;                   // d handled by one warp
  static constexpr int kKChunks = kSliceDim / 64;                        // 16-byte K reads per row
  static constexpr int kKSteps = kSliceDim / 16;                         // mma k-steps of Q·K
  static constexpr int kThreadDims = kSliceDim / 8;                      // V d-values per thread
  static constexpr int kMTiles = kSliceDim / 16;                         // mma m-tiles of P·V
  static constexpr int kCodeBytes = kThreadDims * BITS / 8;              // per token per thread
  static_assert(kSliceDim % 64 == 0, "head_dim must be 64, 128, 256 or 512");

  // One pipeline stage of a warp: its d-slice of one 16-token tile, as the pages hold it.
  static constexpr int kKRowBytes = kSliceDim;
  static constexpr int kCodeRowBytes = kSliceDim * BITS / 8;
  static constexpr int kScaleRowBytes = kSliceDim / kGroupElems;
  // 4 bits: the copy engine copies the scale rows too, where their tensor map can be encoded. Their
  // stage rows are then 16 bytes apart (a box's width), the slice's scales some bytes into each
  // (scale_skew). For 2 and 3 bits, whose lookups leave the shared-memory pipe room for the threads'
  // copies, it measured slower (docs/PERFORMANCE.md, version 43 (g)).
  static constexpr bool kScalesByTensorCopy = BITS == 4;
  static constexpr int kScaleRowPitch = kScalesByTensorCopy ? 16 : kScaleRowBytes;
  static_assert(kScaleRowBytes <= kScaleRowPitch, "a slice's scales fit a scale row of the stage");
  static constexpr int kStageKBytes = kTileTokens * kKRowBytes;
  static constexpr int kStageCodeBytes = kTileTokens * kCodeRowBytes;
  static constexpr int kStageScaleBytes = kTileTokens * kScaleRowPitch;
  static constexpr int kStageBytes = kStageKBytes + kStageCodeBytes + kStageScaleBytes;
  static_assert(kStageKBytes % 16 == 0 && kStageCodeBytes % 16 == 0, "stage sections stay 16-byte aligned");
  // Widest copy of a V code row slice that the format's offsets allow (the runtime pool layout
  // may allow less: DecodeArgs::v_code_copy_bytes).
  static constexpr int kMaxCodeCopy = (HEAD_DIM * BITS / 8) % 16 == 0 ? 16 : (HEAD_DIM * BITS / 8) % 8 == 0 ? 8 : 4;
};

// Tiles in flight per warp: kDecodeStages - 1 are being copied while one is computed. Three
// stages keep every instance's CTA small enough for kDecodeCtasPerSm CTAs per SM (with four, the
// 4-bit head_dim-256 CTA needs 62 KB and only 3 fit), and measured faster than four at every width
// (docs/PERFORMANCE.md, version 25).
constexpr int kDecodeStages = 3;

// Dynamic shared memory of one CTA (bytes): the ring of every warp's stages (reused for the
// per-stream outputs once the loop is done), then the fp16 query chunk, then the warps' page-id
// rings, then the level-pair table (there, its lookups address it from the ring's base register
// plus a constant; as a static array its address was rebuilt in every tile). The ring comes
// first, at the start of the dynamic shared memory (aligned to 128 bytes, where the copy engine
// writes; the toolchain places it at 1 KB in practice): it holds all K sections first, each a
// multiple of 1024 bytes so that the 128-byte swizzle (a function of address bits 4-9) has the
// same phase in each, then the code sections, then the scales.
template <int BITS, int HEAD_DIM, bool GROUPED = false>
struct DecodeSmem {
  using S = DecodeShape<BITS, HEAD_DIM>;
  // KV heads whose query columns the CTA holds: its warps' heads with head groups, else one.
  static constexpr int kKvHeads = GROUPED ? S::kStreams : 1;
  static constexpr int kQRows = kKvHeads * kHeadsPerCta;
  static constexpr int kSlots = kDecodeWarps * kDecodeStages;  // stages of all warps
  static constexpr int kRingCodesOffset = kSlots * S::kStageKBytes;
  static constexpr int kRingScalesOffset = kRingCodesOffset + kSlots * S::kStageCodeBytes;
  static constexpr int kRingBytes = kSlots * S::kStageBytes;
  static constexpr int kOutBytes = S::kStreams * kHeadsPerCta * HEAD_DIM * 4;
  static constexpr int kQRowElems = HEAD_DIM + 4;  // +4 halves: no bank conflicts
  static constexpr int kQOffset = kRingBytes > kOutBytes ? kRingBytes : kOutBytes;
  static constexpr int kQBytes = kQRows * kQRowElems * 2;
  static constexpr int kPagesOffset = kQOffset + kQBytes;
  static constexpr int kPagesBytes = kDecodeWarps * kDecodeStages * kTileTokens * 4;
  static constexpr int kLevelPairsOffset = kPagesOffset + kPagesBytes;
  static constexpr int kBytes = kLevelPairsOffset + LevelPairTable<BITS, HEAD_DIM>::kWords * 4;
  static_assert(kQOffset % 16 == 0 && kQBytes % 16 == 0 && kLevelPairsOffset % 16 == 0 && S::kStageKBytes % 1024 == 0 && S::kStageCodeBytes % 128 == 0 &&
                    (!S::kScalesByTensorCopy || S::kStageScaleBytes % 128 == 0),
                "the tensor copies' destinations stay 128-byte aligned, the K sections in one swizzle phase");
};

// CODE_COPY: bytes per V code copy, DecodeShape::kMaxCodeCopy where the pool layout allows it
// (DecodeArgs::v_code_copy_bytes), else 4. EXTENDED: the instance for decodes beyond the default
// of one query token per sequence and unrotated V, i.e. with query_start (several query tokens per
// sequence) or rotated V (FORMAT §6). The default decode gets a kernel of its own, in which neither
// the multi-token indexing nor the rotation epilogue exists and whose registers are allocated for
// its own code alone. GROUPED: head groups (DecodePlan::stream_partials), in an instance of their
// own, for the default decode up to head_dim 128 (a warp per token stream); the other instances
// compile as if the option did not exist.
// SHARES: split slots shared by length (DecodePlan::length_shares), for the default decode and head
// groups in instances of their own, so that a plan without shares runs the code it ran before the
// option existed (in one instance, the shares' prologue cost the plans without them up to 4 %: log
// 66); the EXTENDED instance follows the plan's flag.
// The launch bounds' resident CTAs per SM: kDecodeCtasPerSm, except for the SHARES twin of the
// default instance at head_dim 64 with 2-bit V. Like that instance, it fits 5: left to itself, ptxas
// gave it 107 registers (4 CTAs per SM) where the plan, made for the default instance, counts 5 (93
// registers when asked for 5, without spills).
template <int BITS, int HEAD_DIM, int CODE_COPY, bool GROUPED, bool SHARES>
constexpr int decode_min_ctas_per_sm() {
  const bool wide_copy = CODE_COPY == DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy;
  return BITS == 2 && HEAD_DIM == 64 && wide_copy && SHARES && !GROUPED ? 5 : kDecodeCtasPerSm;
}

}  // namespace fp8kturbov
