// Paged decode attention over the fp8k_turbo{2,3,4}v cache (FORMAT §5), on tensor cores.
//
// Work split. A CTA handles one (sequence, KV head, chunk of up to 8 query columns, context
// split), a column being one query head of the KV head's GQA group for one query token of the
// sequence (one token, or up to 16 in multi-token decode; token-major, so that the tokens of a
// small group share a CTA and its reads). The context split (flash-decoding) lets a few long
// sequences fill the GPU: each split writes an unnormalised partial (O, running max, denominator)
// to the caller's workspace and a merge kernel combines them in a fixed order, so results are
// deterministic for a plan.
//
// Inside a CTA, 4 warps each own a d-slice of kSliceDim (<= 128) elements and a stream of 16-token
// tiles; with head_dim > 128 several warps share one stream and sum their partial scores.
// Head groups (long streams, DecodePlan::stream_partials): the 4 CTAs of a group of 4 KV heads
// each take one stream of the split instead, and their warps the group's heads, so that a CTA
// reads the neighbouring heads' pieces of the same token rows together; each warp then writes its
// head's partial, and the merge kernel combines a split's 4.
//
// Launch. On sm_90, up to head_dim 128, in clusters of 4 CTAs placed by load balance; the merge
// kernel as a programmatic dependent launch, which starts as the decode's CTAs finish their tiles
// (launch_paged_decode).
//
// Memory. Each warp streams its slice of its tiles through its own ring of kDecodeStages stages in
// shared memory, so kDecodeStages - 1 tiles are in flight while one is computed and no register
// waits on a load. On sm_90, where the launch has tensor maps of the pools, a whole tile's K rows and
// V code rows arrive by one tensor copy each (the copy engine, completing on a per-stage mbarrier);
// otherwise, and for the scales and partial tiles, the threads copy with cp.async (16-byte K copies,
// V code copies as wide as the pool layout allows).
// The page ids travel through the same pipeline, kDecodeStages - 1 tiles ahead of the data, so the
// block-table latency never stalls a copy.
//
// Compute. Per tile a warp computes S^T = K · Q^T (mma m16n8k16, tokens × heads) from FP8 bytes
// converted to fp16, the online softmax in fp32, and O^T += V^T · P^T (d × heads) from codes
// looked up in a level table and scaled per 16-element group. Any permutation of the reduction
// index of an mma is free, so each thread reads whole 16-byte chunks of K rows and contiguous code
#pragma once

#include <cfloat>
#include <type_traits>

#include "format.cuh"
#include "kernel_args.h"
#include "decode/append.cuh"
#include "decode/ptx.cuh"
#include "decode/query.cuh"
#include "decode/ranges.cuh"
#include "decode/schedule.cuh"
#include "decode/softmax_state.cuh"
#include "decode/tile_compute.cuh"
#include "decode/traits.cuh"
#include "decode/v_codes.cuh"

namespace fp8kturbov {

// APPEND: the fused append (DecodeArgs::append) on, in instances of its own, so that the encoders'
// registers cost the decode alone nothing (inlined, they cost some shapes a CTA per multiprocessor).
template <int BITS, int HEAD_DIM, int CODE_COPY, bool EXTENDED, bool GROUPED, bool SHARES, bool APPEND>
__global__ void __launch_bounds__(kDecodeThreads, (decode_min_ctas_per_sm<BITS, HEAD_DIM, CODE_COPY, GROUPED, SHARES>()))
    paged_decode_kernel(const DecodeArgs a, const DecodePlan plan, const __grid_constant__ DecodeTensorMaps maps) {
  using S = DecodeShape<BITS, HEAD_DIM>;
  using L = DecodeSmem<BITS, HEAD_DIM, GROUPED>;
  static_assert(!GROUPED || (decode_head_groups_built(BITS, HEAD_DIM) && !EXTENDED), "head groups: the default decode");
  static_assert(!(SHARES && EXTENDED), "the extended instance follows DecodePlan::length_shares");
  const bool length_shares = EXTENDED ? plan.length_shares : SHARES;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const ring = smem;
  auto q_s = reinterpret_cast<__half(*)[L::kQRowElems]>(smem + L::kQOffset);  // [L::kQRows]
  auto o_s = reinterpret_cast<float(*)[kHeadsPerCta][HEAD_DIM]>(ring);  // after the loop
  int32_t* const page_ring = reinterpret_cast<int32_t*>(smem + L::kPagesOffset);
  __shared__ float max_s[S::kStreams][kHeadsPerCta];
  __shared__ float denom_s[S::kStreams][kHeadsPerCta];
  __shared__ float stream_weight_s[S::kStreams][kHeadsPerCta];  // the epilogue's merge over the streams
  __shared__ float column_max_s[kHeadsPerCta];
  __shared__ float column_denom_s[kHeadsPerCta];
  __shared__ __align__(16) float4 score_s[2][kDecodeWarps][S::kSlices > 1 ? 32 : 1];
  // The fp16 levels of every pair of codes (a | b << BITS -> low half level[a], high level[b]), in
  // LevelPairTable's copies.
  using LevelPairs = LevelPairTable<BITS, HEAD_DIM>;
  uint32_t* const level_pair_s = reinterpret_cast<uint32_t*>(smem + L::kLevelPairsOffset);
  __shared__ float q_absmax_s[kDecodeWarps];
  // Checked mode, where a page is out of range: per warp and stage, the rows (bit r) of the tile
  // whose page is out of range.
  __shared__ uint32_t masked_rows_s[kDecodeWarps][kDecodeStages];
  // Per warp and stage: the barrier on which the stage's tensor copies complete.
  __shared__ __align__(8) uint64_t stage_filled_s[kDecodeWarps][kDecodeStages];

  const int tid = threadIdx.x;
  // Warp-uniform by construction; broadcast from lane 0 so that the compiler knows it, and may keep
  // the values derived from it (stream, slice, stage and barrier addresses) in uniform registers,
  // which leaves more of the 128 per thread to the tile loop (version 34: fewer spills).
  const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
  const int lane = tid % 32;
  const int g = lane / 4;  // mma groupID
  const int t = lane % 4;  // mma threadID_in_group

  if constexpr (kArchHasTensorCopies) {
    if (maps.enabled && tid == 0) {  // the descriptors' fetch overlaps the prologue
      prefetch_tensor_map(maps.k);
      prefetch_tensor_map(maps.codes);
      if (S::kScalesByTensorCopy && maps.scales_enabled) prefetch_tensor_map(maps.scales);
    }
  }

  // CTA order: the chunks and KV heads of one (sequence, split) are neighbours, so the CTAs that
  // read the same token rows of the pools run side by side and share their DRAM pages and sectors.
  const uint32_t chunk = blockIdx.x % plan.chunks_per_group;
  const uint32_t cta_head = blockIdx.x / plan.chunks_per_group % a.num_kv_heads;
  const uint32_t slot = blockIdx.x / plan.chunks_per_group / a.num_kv_heads;  // its split slot
  // The shares are found in the query's shared memory, which the query fills only after them:
  // static shared memory of their own cost some shapes a CTA per multiprocessor (head_dim 64).
  static_assert(L::kQBytes >= kDecodeWarps * sizeof(uint32_t) + sizeof(SplitShare), "room for the shares");
  uint32_t* const share_scratch = reinterpret_cast<uint32_t*>(smem + L::kQOffset);
  SplitShare& share_s = *reinterpret_cast<SplitShare*>(smem + L::kQOffset + kDecodeWarps * sizeof(uint32_t));
  const SplitShare share = length_shares
                               ? split_share<kDecodeThreads, true>(a, plan, slot, share_scratch, share_s)
                               : SplitShare{slot / plan.num_splits, slot / plan.num_splits * plan.num_splits, plan.num_splits, 0};
  if (share.count == 0) return;  // an idle slot (CTA-uniform)
  const uint32_t seq = share.seq;
  const uint32_t split = slot - share.first;
  // Issued first: the CTA's range waits on it. The shares' search has read it already.
  const int given_seq_len = length_shares ? share.seq_len : a.seq_lens[seq];
  const bool reports = a.index_check.enabled() && tid == 0 && chunk == 0 && cta_head == 0 && split == 0;  // once per sequence
  // This warp's KV head and token stream. Head groups: the kDecodeWarps CTAs of a group (cta_head
  // over its heads) each take one token stream of the split, and their warps the group's heads,
  // so that the warps of a CTA read the neighbouring heads' pieces of the same token rows together.
  const uint32_t first_kv_head = GROUPED ? cta_head / S::kStreams * S::kStreams : cta_head;
  const uint32_t kv_head = GROUPED ? first_kv_head + uint32_t(warp) : cta_head;
  const int stream = GROUPED ? int(cta_head % S::kStreams) : warp / S::kSlices;
  const int slice = warp % S::kSlices;
  const int slice_d0 = slice * S::kSliceDim;
  uint32_t row0 = seq;
  int q_len = 1;
  if (EXTENDED && !sequence_query_rows(a, seq, row0, q_len)) {
    if (reports) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
    return;
  }
  // This CTA's columns: first_column + c for c < num_columns, each a (query token, query head).
  const uint32_t group_size = a.num_q_heads / a.num_kv_heads;
  const int first_column = int(chunk) * kHeadsPerCta;
  const int num_columns = min(kHeadsPerCta, q_len * int(group_size) - first_column);
  if (num_columns <= 0) return;  // a sequence with fewer query tokens than the grid is sized for
  // One query token: column c is query head first_column + c of the group.
  auto column_token = [&](int c) -> uint32_t { return EXTENDED ? uint32_t(first_column + c) / group_size : 0u; };
  auto column_head = [&](int c) -> uint32_t {
    return kv_head * group_size + (EXTENDED ? uint32_t(first_column + c) % group_size : uint32_t(first_column + c));
  };

  auto load_query = [&](auto q_at) {
    return load_query_chunk<HEAD_DIM, L::kKvHeads, L::kQRows, GROUPED>(q_at, q_s, q_absmax_s, num_columns, tid, lane, warp);
  };
  // One query token: the chunk's heads are consecutive in its q row (with head groups, whose KV
  // heads have one chunk each, the group's heads too), so the loads are one strided stream that
  // the compiler batches (in flight together); several tokens: per column. The query
  // is loaded before anything waits on seq_lens, so that the two loads' latencies overlap.
  float q_gain;
  if constexpr (EXTENDED) {
    q_gain = load_query([&](int i) {
      const int c = i / HEAD_DIM;
      return a.q[uint64_t(row0 + column_token(c)) * a.q_stride + uint64_t(column_head(c)) * HEAD_DIM + i % HEAD_DIM];
    });
  } else {
    const uint32_t first_q_head = GROUPED ? first_kv_head * group_size : column_head(0);
    const uint16_t* q_row = a.q + uint64_t(row0) * a.q_stride + uint64_t(first_q_head) * HEAD_DIM;
    q_gain = load_query([&](int i) { return q_row[i]; });
  }

  // FORMAT §5: a column attends positions [window_start(end), end), end = seq_len - q_len + token
  // + 1 (causal inside the query chunk; seq_len for one token). The CTA's range spans its
  // columns'; the splits of its sequence's share divide the range's tiles evenly, in whole tiles
  // per token stream.
  const int seq_len = clamped_seq_len(a, given_seq_len);
  if (reports && seq_len != given_seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SEQ_LEN);
  // (The extended instance also serves one-token decodes of rotated V: no query_start, nothing to report.)
  if (reports && EXTENDED && a.query_start != nullptr && q_len > seq_len)
    a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
  auto column_end = [&](int c) { return max(seq_len - q_len + int(column_token(c)) + 1, 0); };
  const int start = window_start(a, column_end(0));
  const int attend_end = column_end(num_columns - 1);
  // Columns of several query tokens attend different ranges: their loop masks per column.
  const bool columns_masked = column_token(0) != column_token(num_columns - 1);
  // Tiles sit on absolute multiples of 16 positions (so that with block_size % 16 == 0 a tile lies
  // in one page); rows outside [range_begin, range_end) are masked.
  const int first_position = start & ~(kTileTokens - 1);
  const int range_tiles = int((int64_t(max(attend_end - first_position, 0)) + kTileTokens - 1) / kTileTokens);
  const int64_t split_tokens =
      length_shares
          ? int64_t((range_tiles + int(share.count) - 1) / int(share.count) + S::kStreams - 1) / S::kStreams * S::kStreams *
                kTileTokens
          : plan.split_tokens;
  const int64_t split_begin = first_position + split * split_tokens;
  const int64_t split_end = split_begin + split_tokens;
  const int range_begin = int(split_begin > start ? split_begin : start);
  const int range_end = int(split_end < attend_end ? split_end : attend_end);
  const bool tile_in_one_page = a.block_size % kTileTokens == 0;

  const int32_t* table = a.block_tables + seq * a.block_tables_stride;

  // Only a CTA that finds a page out of range masks tiles in its loop; the others run the loop of
  // the unchecked kernel.
  bool pages_masked = false;
  if (a.index_check.enabled()) {  // CTA-uniform
    // Checked mode: the CTA checks the page of every position it attends, table entries
    // [check_begin, check_end), before its loop.
    uint32_t check_begin = 0, check_end = 0, offset;
    if (range_begin < range_end) {
      split_position(a, uint32_t(range_begin), check_begin, offset);
      split_position(a, uint32_t(range_end - 1), check_end, offset);
      ++check_end;
    }
    bool out_of_range = false;
    for (uint32_t block = check_begin + tid; block < check_end; block += kDecodeThreads)
      out_of_range |= a.index_check.page_out_of_range(__ldg(table + block));
    pages_masked = __syncthreads_or(out_of_range) != 0;
    if (pages_masked && tid == 0) a.index_check.report(FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE);
  }
  // The fused append (append.cuh): the new tokens inside this CTA's range, written before the
  // pipeline starts, so before any copy of the CTA reads them; the ring, not yet in use, holds the
  // codebook table and the searching encoders' groups. (Written inside the prologue, to overlap its
  // copies, the encoders' registers cost the tile loop spills.)
  if constexpr (APPEND) {
    const int first_new = seq_len - q_len;  // the position of query token 0
    const int token_begin = max(range_begin - first_new, 0);
    const int token_end = min(range_end - first_new, q_len);
    if (token_begin < token_end) {
      static_assert(sizeof(AppendScratch<BITS>) <= L::kRingBytes, "the append's scratch fits the ring");
      append_new_tokens<BITS, HEAD_DIM, EXTENDED && kRotatableHeadDim<HEAD_DIM>>(
          a, *reinterpret_cast<AppendScratch<BITS>*>(ring), row0 + uint32_t(token_begin),
          uint32_t(token_end - token_begin), first_kv_head, GROUPED ? S::kStreams : 1);
      __syncthreads();
    }
  }
  // Scores in the log2 domain: s2 = (q·k) · k_scale · inv_sqrt_d · log2(e), or with soft-capping
  // s2 = cap · tanh((q·k) · k_scale · inv_sqrt_d / cap) · log2(e).
  const float score_to_log2 = a.score_scale * kLog2e / q_gain;
  const float score_per_cap = a.soft_cap > 0.0f ? a.score_scale / q_gain / a.soft_cap : 0.0f;
  const float cap_log2 = a.soft_cap * kLog2e;

  // The tile loop and the epilogue, in instances: with tiles masked where checked mode found a
  // page out of range (and, for several tokens, per column), with positions masked per column
  // (CTAs holding columns of several tokens), and without either, which every other CTA runs (all
  // of them in an unchecked one-token decode).
  auto decode_tiles = [&](auto mask_pages, auto mask_columns) {
    constexpr bool kMaskPages = decltype(mask_pages)::value;
    constexpr bool kMaskColumns = decltype(mask_columns)::value;
    const uint32_t row_elems = a.num_kv_heads * HEAD_DIM;  // < 2^32, validated
    const uint32_t row_code_bytes = row_elems / 8 * BITS;
    const uint32_t row_scale_bytes = row_elems / kGroupElems;
    // This warp's slice of a token row in each pool (bytes).
    const uint64_t k_slice = uint64_t(kv_head) * HEAD_DIM + slice_d0;  // < 2^32
    const uint64_t code_slice = k_slice * BITS / 8;
    const uint64_t scale_slice = a.v_data_section_bytes + k_slice / kGroupElems;
    // A tensor copy's box must start at a 16-byte boundary of the scale row: the slice's scales lie
    // scale_skew bytes into each 16-byte row of the stage (the threads' copies put them there too),
    // where Stage::scales points.
    const uint32_t scale_skew = S::kScalesByTensorCopy ? uint32_t(k_slice / kGroupElems) % 16 : 0;
    const int thread_d0 = slice_d0 + g * S::kThreadDims;  // first V/O element of this thread
    const int q_row0 = GROUPED ? warp * kHeadsPerCta : 0;  // this warp's columns in q_s

    auto in_range = [&](int pos) { return pos >= range_begin && pos < range_end; };

    // ---- The copy pipeline: each warp streams its tiles through its own ring of stages ----------
    const int first_tile = int(split_begin) + stream * kTileTokens;
    const int tile_step = S::kStreams * kTileTokens;
    // With d-slices, every warp runs the same number of iterations (a stream's last one may be
    // fully masked). The d-slices of a stream meet at every score exchange; the streams, whose
    // exchanges use barriers of their own, need not, but where their counts of barrier phases
    // differed, compute-sanitizer's racecheck reported hazards across the CTA barriers after the loop.
    const int loop_end = S::kSlices > 1 ? int(split_begin) + (range_end - int(split_begin) + tile_step - 1) /
                                                                 tile_step * tile_step
                                        : range_end;
    const int num_tiles = loop_end > first_tile ? (loop_end - first_tile + tile_step - 1) / tile_step : 0;
    // This warp's stage `index`: its K rows, V code rows and V scale rows.
    struct Stage {
      uint8_t* k;
      uint8_t* codes;
      uint8_t* scales;
    };
    auto warp_stage = [&](int index) {
      const int slot = warp * kDecodeStages + index;
      return Stage{ring + slot * S::kStageKBytes, ring + L::kRingCodesOffset + slot * S::kStageCodeBytes,
                   ring + L::kRingScalesOffset + scale_skew + slot * S::kStageScaleBytes};
    };
    int32_t* const warp_pages = page_ring + warp * kDecodeStages * kTileTokens;

    // Page ids. When a tile lies in one page (block_size % 16 == 0), lane j holds the page id of
    // tile 32·b + j of this warp's stream (batch b) in a register, and the next batch is loaded 32
    // tiles before it is needed. Otherwise the page ids of tile k's rows travel through the copy
    // pipeline into page slot k % kDecodeStages (the stage's), kDecodeStages - 1 tiles ahead of the data. Rows
    // and tiles outside the range get page id 0 and are never read. Where checked mode masks pages,
    // a page id out of range becomes -1, which masks its tile.
    auto load_page_batch = [&](int batch) -> int32_t {
      const int k = batch * 32 + lane;
      const int tile = first_tile + k * tile_step;
      int32_t page = 0;
      if (k < num_tiles && tile < range_end && tile + kTileTokens > range_begin) {
        uint32_t block, offset;
        split_position(a, uint32_t(tile), block, offset);
        page = __ldg(table + block);
      }
      if (kMaskPages && a.index_check.page_out_of_range(page)) page = -1;
      return page;
    };
    int32_t page_batch = 0, next_page_batch = 0;
    if (tile_in_one_page) {
      page_batch = load_page_batch(0);
      next_page_batch = load_page_batch(1);
    }
    // The callers pass a tile's stage index (k % kDecodeStages) along with k: they count it, which is
    // cheaper than the remainder.
    auto copy_page_ids = [&](int k, int slot) {
      if (tile_in_one_page || lane >= kTileTokens) return;
      const int tile = first_tile + k * tile_step;
      const bool valid = in_range(tile + lane);
      uint32_t block, offset;
      split_position(a, uint32_t(tile + lane), block, offset);
      copy_async<4>(warp_pages + slot * kTileTokens + lane, valid ? table + block : table, valid);
    };
    // The barrier of this warp's stage `slot`.
    const uint32_t stage_filled_base = shared_address(&stage_filled_s[warp][0]);
    auto stage_filled = [&](int slot) { return stage_filled_base + uint32_t(slot) * uint32_t(sizeof(uint64_t)); };
    // K bytes, V codes and V scales of this warp's slice of tile k into stage `slot` (k % kDecodeStages).
    // The byte offset of 16-byte chunk `chunk` of K row `row` in a stage: rows of 128 bytes are
    // stored in the copy engine's 128-byte swizzle (the chunk index XOR bits 7-9 of the row's
    // address: (row + k_swizzle_phase) % 8, the phase being the same for every stage), which the
    // threads' copies follow too; with the row order of MmaRows::token, the fragment reads
    // hit all 32 banks. Rows of 64 bytes are stored as they are.
    const int k_swizzle_phase = int(shared_address(ring) >> 7) & 7;
    auto k_chunk_offset = [&](int row, int chunk) {
      return 16 * (S::kKRowBytes == 128 ? chunk ^ ((row + k_swizzle_phase) & 7) : chunk);
    };
    // ONE_PAGE (block_size % 16 == 0) is a template argument so that each case is its own straight
    // code path: the common one computes each pool's tile base once and each row with one IMAD.
    // WHOLE (a tile of one page with every row in range, not masked: all but a range's first and
    // last tiles) drops the per-row validity tests and the zero-fill selects from the copies.
    // Tiles are copied in increasing k, which the page-id batches rely on.
    auto copy_tile = [&](int k, int slot, auto one_page, auto whole) {
      constexpr bool kOnePage = decltype(one_page)::value;
      constexpr bool kWhole = decltype(whole)::value;
      const int tile = first_tile + k * tile_step;
      const int32_t* pages = warp_pages + slot * kTileTokens;
      const Stage stage = warp_stage(slot);
      uint32_t block, offset0;
      split_position(a, uint32_t(tile), block, offset0);
      uint64_t page0 = 0;
      uint32_t masked_rows = 0;  // rows (bit r) whose page is out of range (checked mode)
      if constexpr (kOnePage) {
        if (k % 32 == 0 && k > 0) {
          page_batch = next_page_batch;
          next_page_batch = load_page_batch(k / 32 + 1);
        }
        const int32_t page = __shfl_sync(0xffffffffu, page_batch, k % 32);
        page0 = uint32_t(page);
        if (kMaskPages && page < 0) masked_rows = (1u << kTileTokens) - 1;
      } else if (kMaskPages) {
        masked_rows = __ballot_sync(0xffffffffu, lane < kTileTokens && a.index_check.page_out_of_range(pages[lane]));
      }
      if (kMaskPages && lane == 0) masked_rows_s[warp][slot] = masked_rows;
      // Rows of the tile in a pool of the given page stride and row size, from byte `col` of the
      // row (row sizes are < 2^25: num_kv_heads <= 65535, head_dim <= 512).
      auto tile_rows = [&](const uint8_t* pool, uint64_t page_stride, uint32_t row_bytes, uint64_t col) {
        const uint8_t* tile_base = pool + page0 * page_stride + uint64_t(offset0) * row_bytes + col;
        return [=](int row) -> const uint8_t* {
          if constexpr (kOnePage) return tile_base + uint64_t(uint32_t(row) * row_bytes);
          uint32_t row_block, offset;
          split_position(a, uint32_t(tile + row), row_block, offset);
          return pool + uint64_t(uint32_t(pages[row])) * page_stride + uint64_t(offset) * row_bytes + col;
        };
      };
      const int valid_begin = range_begin - tile;  // valid rows: [valid_begin, valid_end), not masked
      const int valid_end = kMaskPages && kOnePage && masked_rows != 0 ? valid_begin : range_end - tile;
      auto valid_row = [&](int row) {
        return kWhole || (row >= valid_begin && row < valid_end &&
                          (!kMaskPages || kOnePage || !((masked_rows >> row) & 1)));
      };
      // K rows, V code rows and (kScalesByTensorCopy) V scale rows: a whole tile by the
      // copy engine where the launch has tensor maps, else by the threads (cp.async: rows out of range
      // zero-filled), the stage's barrier phase then completing with the arrival alone.
      const uint32_t filled = stage_filled(slot);
      bool copied = false, scales_copied = false;
      if constexpr (kArchHasTensorCopies && kWhole && CODE_COPY == 16 && S::kCodeRowBytes % 16 == 0) {
        if (maps.enabled) {  // CTA-uniform, as scales_enabled
          scales_copied = S::kScalesByTensorCopy && maps.scales_enabled;
          if (elect_one_lane()) {
            barrier_arrive_expecting(filled, S::kStageKBytes + S::kStageCodeBytes + (scales_copied ? S::kStageScaleBytes : 0));
            copy_box(shared_address(stage.k), maps.k, int(k_slice), int(offset0), int(page0), filled);
            copy_box(shared_address(stage.codes), maps.codes, int(code_slice), int(offset0), int(page0), filled);
            if (scales_copied)
              copy_box(shared_address(stage.scales - scale_skew), maps.scales, int(k_slice / kGroupElems - scale_skew), int(offset0),
                       int(page0), filled);
          }
          copied = true;
        }
      }
      if (!copied) {
        constexpr int kKRowChunks = S::kKRowBytes / 16;
        const auto k_rows = tile_rows(a.k_cache, a.k_block_stride_bytes, row_elems, k_slice + 16 * (lane % kKRowChunks));
  #pragma unroll
        for (int j = 0; j < kTileTokens * kKRowChunks / 32; ++j) {
          const int id = lane + 32 * j;
          const int row = id / kKRowChunks;
          const int chunk = id % kKRowChunks;  // = lane % kKRowChunks
          const bool valid = valid_row(row);
          const uint8_t* src = k_rows(row);
          copy_async<16>(stage.k + row * S::kKRowBytes + k_chunk_offset(row, chunk),
                         valid ? src : a.k_cache, valid);
        }
        constexpr int kCodeRowCopies = S::kCodeRowBytes / CODE_COPY;
        const auto code_rows = tile_rows(a.v_cache, a.v_block_stride_bytes, row_code_bytes, code_slice);
  #pragma unroll
        for (int j = 0; j < (kTileTokens * kCodeRowCopies + 31) / 32; ++j) {
          const int id = lane + 32 * j;
          if (id < kTileTokens * kCodeRowCopies) {
            const int row = id / kCodeRowCopies;
            const int part = id % kCodeRowCopies;
            const bool valid = valid_row(row);
            const uint8_t* src = code_rows(row) + CODE_COPY * part;
            copy_async<CODE_COPY>(stage.codes + row * S::kCodeRowBytes + CODE_COPY * part,
                                  valid ? src : a.v_cache, valid);
          }
        }
        if (kArchHasTensorCopies && lane == 0) barrier_arrive_expecting(filled, 0);
      }
      // Scales by the threads: 4 or 8 bytes per row, in 4-byte copies.
      constexpr int kScaleRowCopies = S::kScaleRowBytes / 4;
      if (!scales_copied && lane < kTileTokens * kScaleRowCopies) {
        const int row = lane / kScaleRowCopies;
        const int part = lane % kScaleRowCopies;
        const bool valid = valid_row(row);
        const uint8_t* src = tile_rows(a.v_cache, a.v_block_stride_bytes, row_scale_bytes, scale_slice)(row) + 4 * part;
        copy_async<4>(stage.scales + row * S::kScaleRowPitch + 4 * part,
                      valid ? src : a.v_cache, valid);
      }
    };

    auto copy_tile_any = [&](int k, int slot) {
      const int tile = first_tile + k * tile_step;
      if (!tile_in_one_page)
        copy_tile(k, slot, std::false_type{}, std::false_type{});
      else if (!kMaskPages && tile >= range_begin && tile + kTileTokens <= range_end)
        copy_tile(k, slot, std::true_type{}, std::true_type{});
      else
        copy_tile(k, slot, std::true_type{}, std::false_type{});
    };

    // The attended ranges of this thread's columns 2t and 2t+1, where they differ from the CTA's.
    int column_begin[2] = {0, 0}, column_stop[2] = {0, 0};
    if constexpr (kMaskColumns) {
  #pragma unroll
      for (int c = 0; c < 2; ++c) {
        column_stop[c] = column_end(2 * t + c);
        column_begin[c] = window_start(a, column_stop[c]);
      }
    }
    // Online-softmax state for heads 2t and 2t+1 (identical in the 8 lanes sharing t), lazily rescaled
    // (softmax_state.cuh).
    float run_reference[2] = {0.0f, 0.0f};
    float run_limit[2] = {-INFINITY, -INFINITY};
    auto reference_max = [&](int c) { return running_max(run_reference[c], run_limit[c]); };
    float run_denom[2] = {0.0f, 0.0f};  // this lane's tokens only; reduced at the end
    float acc[S::kMTiles][4];
  #pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    if (kArchHasTensorCopies && lane == 0) {
  #pragma unroll
      for (int st = 0; st < kDecodeStages; ++st) barrier_init(stage_filled(st));
      barrier_init_fence();
    }
    __syncwarp();

    // Prologue: the page ids of the first kDecodeStages - 1 tiles, then those tiles, each copy group
    // also fetching the page ids that the copy kDecodeStages - 1 tiles later will need.
    for (int k = 0; k < kDecodeStages - 1 && k < num_tiles; ++k) copy_page_ids(k, k);
    copy_async_commit();
    copy_async_wait<0>();
    __syncwarp();
    for (int k = 0; k < kDecodeStages - 1; ++k) {
      __syncwarp();  // every lane has read page slot k - 1 before it is refilled
      if (k + kDecodeStages - 1 < num_tiles) copy_page_ids(k + kDecodeStages - 1, (k + kDecodeStages - 1) % kDecodeStages);
      if (k < num_tiles) copy_tile_any(k, k);
      copy_async_commit();
    }
    // The level-pair table, while the first tiles are in flight: its reads (the codebook table, from
    // L2 at a CTA's start) overlap theirs; the CTA barrier makes it, and the query in q_s, visible to
    // every warp.
    fill_level_pairs<BITS, LevelPairs::kCopies>(level_pair_s, tid, kDecodeThreads);
    __syncthreads();

    using Rows = MmaRows<S::kKRowBytes == 128>;
    const int k_row_token[2] = {Rows::token(g), Rows::token(g + 8)};
    // The stage rows of this thread's P·V tokens: v_row_first + Rows::v_row_offset(j).
    const int v_row_first = Rows::token(2 * t);
    // (slot + n) % kDecodeStages for 0 <= n < kDecodeStages.
    auto slot_after = [](int slot, int n) { return slot + n >= kDecodeStages ? slot + n - kDecodeStages : slot + n; };
    int slot = 0;                 // k % kDecodeStages: tile k's stage
    uint32_t filled_parity = 0;   // (k / kDecodeStages) % 2: the phase of its barrier that tile k completes
    for (int k = 0; k < num_tiles; ++k) {
      // Tile k (and the page ids of tile k + kDecodeStages - 1) have landed; every lane is done
      // with the stage of tile k - 1, which the copy of tile k + kDecodeStages - 1 refills. (No
      // proxy fence before a tensor copy refills it: the lanes' reads of that stage have returned,
      // their values consumed by the mma of tile k - 1, and the warp barrier orders them before the
      // copy, as a consumer's barrier arrival does in a producer-consumer pipeline.)
      copy_async_wait<kDecodeStages - 2>();
      __syncwarp();
      if (k + 2 * kDecodeStages - 2 < num_tiles) copy_page_ids(k + 2 * kDecodeStages - 2, slot_after(slot, kDecodeStages - 2));
      if (k + kDecodeStages - 1 < num_tiles) copy_tile_any(k + kDecodeStages - 1, slot_after(slot, kDecodeStages - 1));
      copy_async_commit();

      const int tile = first_tile + k * tile_step;
      const Stage stage = warp_stage(slot);
      if constexpr (kArchHasTensorCopies)  // its tensor copies
        barrier_wait(stage_filled(slot), filled_parity);
      // S^T = K · Q^T over this warp's d-slice: mma rows g, g+8 (tokens k_row_token), cols = heads (2t, 2t+1).
      uint4 k_bytes[2][S::kKChunks];
  #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = k_row_token[half];
  #pragma unroll
        for (int c = 0; c < S::kKChunks; ++c)
          k_bytes[half][c] = *reinterpret_cast<const uint4*>(stage.k + row * S::kKRowBytes + k_chunk_offset(row, t + 4 * c));
      }
      // Two accumulators (even and odd k-steps) halve the dependent chain of mma instructions.
      float s_part[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  #pragma unroll
      for (int j = 0; j < S::kKSteps; ++j) {
        uint32_t a_frag[4];  // rows g (k_lo) and g + 8 (k_hi), reduction pairs 0-1 and 2-3 of the chunk
        e4m3x4_to_half2x2_bits(reinterpret_cast<const uint32_t*>(&k_bytes[0][j / 4])[j % 4], a_frag[0], a_frag[2]);
        e4m3x4_to_half2x2_bits(reinterpret_cast<const uint32_t*>(&k_bytes[1][j / 4])[j % 4], a_frag[1], a_frag[3]);
        const uint2 q_frag = *reinterpret_cast<const uint2*>(&q_s[q_row0 + g][slice_d0 + 64 * (j / 4) + 16 * t + 4 * (j % 4)]);
        mma_16x8x16(s_part[j % 2], a_frag, q_frag.x, q_frag.y);
      }
      float s[4];
  #pragma unroll
      for (int r = 0; r < 4; ++r) s[r] = s_part[0][r] + s_part[1][r];
      if constexpr (S::kSlices > 1) {  // sum the slices' partial scores, in slice order
        score_s[k & 1][warp][lane] = make_float4(s[0], s[1], s[2], s[3]);
        stream_barrier<S::kSlices>(stream);
        float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  #pragma unroll
        for (int w = 0; w < S::kSlices; ++w) {
          const float4 p = score_s[k & 1][stream * S::kSlices + w][lane];
          total.x += p.x; total.y += p.y; total.z += p.z; total.w += p.w;
        }
        s[0] = total.x; s[1] = total.y; s[2] = total.z; s[3] = total.w;
      }

      // Online softmax per head column; masked tokens get weight 0. A NaN score is not a maximum
      // (fmaxf) but its weight exp2(NaN - m) is NaN, so it reaches the head's output as NaN.
      bool row_valid[2] = {in_range(tile + k_row_token[0]), in_range(tile + k_row_token[1])};
      if (kMaskPages) {  // rows of out-of-range pages take no part (copied as zeros)
        const uint32_t masked = masked_rows_s[warp][slot];
        row_valid[0] = row_valid[0] && !((masked >> k_row_token[0]) & 1);
        row_valid[1] = row_valid[1] && !((masked >> k_row_token[1]) & 1);
      }
      if (a.soft_cap > 0.0f) {  // a branch the whole CTA takes or not
  #pragma unroll
        for (int r = 0; r < 4; ++r) s[r] = cap_log2 * soft_cap_tanh(s[r] * score_per_cap);
      } else {
  #pragma unroll
        for (int r = 0; r < 4; ++r) s[r] *= score_to_log2;
      }
      float masked_s[4];  // s with the rows outside the column's range at -inf
  #pragma unroll
      for (int c = 0; c < 2; ++c) {
        bool valid[2] = {row_valid[0], row_valid[1]};
        if constexpr (kMaskColumns) {
  #pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int pos = tile + k_row_token[half];
            valid[half] = valid[half] && pos >= column_begin[c] && pos < column_stop[c];
          }
        }
        masked_s[c] = valid[0] ? s[c] : -INFINITY;
        masked_s[2 + c] = valid[1] ? s[2 + c] : -INFINITY;
      }
      // The reference maxima move (warp-uniform) only when some score exceeds its column's by more
      // than the slack; then to the columns' running maxima, and the sums are rescaled.
      bool exceeds = false;
  #pragma unroll
      for (int r = 0; r < 4; ++r) exceeds = exceeds || masked_s[r] > run_limit[r % 2];
      if (__any_sync(0xffffffffu, exceeds)) raise_reference_max(masked_s, run_reference, run_limit, run_denom, acc);
      // Weights relative to the reference maxima; a masked row (-inf) gets 2^-inf = 0, also while a
      // column has seen nothing.
      float p[4];
  #pragma unroll
      for (int c = 0; c < 2; ++c) {
        p[c] = exp2_fast(masked_s[c] - run_reference[c]);
        p[2 + c] = exp2_fast(masked_s[2 + c] - run_reference[c]);
      }
      const uint32_t p_lo = half2_bits(p[0], p[1]);  // mma row g, heads 2t, 2t+1
      const uint32_t p_hi = half2_bits(p[2], p[3]);  // mma row g+8
      {
        const __half2 lo = *reinterpret_cast<const __half2*>(&p_lo);
        const __half2 hi = *reinterpret_cast<const __half2*>(&p_hi);
        // The denominator sums the same fp16-rounded weights that multiply V.
        run_denom[0] += __low2float(lo) + __low2float(hi);
        run_denom[1] += __high2float(lo) + __high2float(hi);
      }
      // FORMAT §5 sparse V at tile granularity: only heads of this CTA vote. The reference is a
      // maximum over positions already seen, so a skipped row qualifies under the per-row rule. The
      // vote's comparisons sit behind the (kernel-uniform) threshold test, off the default path.
      bool skip = false;
      if (a.sparse_v_threshold > 0.0f) {
        bool all_small = true;
  #pragma unroll
        for (int c = 0; c < 2; ++c)
          if (2 * t + c < num_columns) all_small = all_small && p[c] <= a.sparse_v_threshold && p[2 + c] <= a.sparse_v_threshold;
        skip = __all_sync(0xffffffffu, all_small);
      }
      if (!skip) accumulate_values<BITS, HEAD_DIM>(acc, stage.codes, stage.scales, level_pair_s, v_row_first, lane, p_lo, p_hi);
      slot = slot_after(slot, 1);
      if (slot == 0) filled_parity ^= 1;
    }
    // The copies still in flight are of tiles past the end: drain them before the ring is reused.
    copy_async_wait<0>();
    allow_dependent_launch();
    // The denominators reduced over the 8 lanes sharing t.
  #pragma unroll
    for (int c = 0; c < 2; ++c) {
  #pragma unroll
      for (int o = 4; o < 32; o <<= 1) run_denom[c] += __shfl_xor_sync(0xffffffffu, run_denom[c], o);
    }
    if constexpr (GROUPED) {
      // Head groups: this warp's stream is a partial of its own KV head, written from its registers;
      // the merge kernel combines them.
      const uint32_t partial = split * S::kStreams + uint32_t(stream);
  #pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int column = 2 * t + c;
        if (column >= num_columns) continue;
        float* part = partial_address(plan, share, a.num_q_heads, column_head(column), partial, HEAD_DIM);
  #pragma unroll
        for (int i = 0; i < S::kMTiles; ++i)
          *reinterpret_cast<float2*>(part + thread_d0 + 2 * i) = make_float2(acc[i][c], acc[i][2 + c]);
        if (g == 0) {
          part[HEAD_DIM] = reference_max(c);
          part[HEAD_DIM + 1] = run_denom[c];
        }
      }
      return;
    }
    __syncthreads();

    // Per stream: publish O, max, denominator.
    if (slice == 0 && g == 0) {
  #pragma unroll
      for (int c = 0; c < 2; ++c) {
        max_s[stream][2 * t + c] = reference_max(c);
        denom_s[stream][2 * t + c] = run_denom[c];
      }
    }
  #pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) {
      const int d = thread_d0 + 2 * i;
      o_s[stream][2 * t][d] = acc[i][0];
      o_s[stream][2 * t + 1][d] = acc[i][1];
      o_s[stream][2 * t][d + 1] = acc[i][2];
      o_s[stream][2 * t + 1][d + 1] = acc[i][3];
    }
    __syncthreads();

    // Per column h: its maximum over the streams, each stream's weight under it and the merged
    // denominator, computed once (by lane h of warp 0) instead of for every output element.
    if (warp == 0 && lane < kHeadsPerCta) {
      const int h = lane;
      float m = -INFINITY;
  #pragma unroll
      for (int st = 0; st < S::kStreams; ++st) m = fmaxf(m, max_s[st][h]);
      float l = 0.0f;
  #pragma unroll
      for (int st = 0; st < S::kStreams; ++st) {
        const float w = partial_weight(max_s[st][h], m);
        stream_weight_s[st][h] = w;
        l += w * denom_s[st][h];
      }
      column_max_s[h] = m;
      column_denom_s[h] = l;
    }
    __syncthreads();
    // Column h's output element d merged over the streams (fixed order).
    auto merge_streams = [&](int h, int d) {
      float o = 0.0f;
  #pragma unroll
      for (int st = 0; st < S::kStreams; ++st) o += stream_weight_s[st][h] * o_s[st][h][d];
      return o;
    };
    // Rotated V (FORMAT §6) without splits: the merged rows are rotated back before they are
    // normalised, in the first stream's rows, a warp per column. (Split partials stay rotated:
    // the merge kernel rotates their sum back.)
    bool rotate_back = false;
    if constexpr (EXTENDED && kRotatableHeadDim<HEAD_DIM>) {
      rotate_back = a.rotated_v && plan.num_splits == 1;  // CTA-uniform
      if (rotate_back) {
        for (int i = tid; i < num_columns * HEAD_DIM; i += kDecodeThreads)
          o_s[0][i / HEAD_DIM][i % HEAD_DIM] = merge_streams(i / HEAD_DIM, i % HEAD_DIM);
        __syncthreads();
        for (int h = warp; h < num_columns; h += kDecodeWarps) unrotate_row<HEAD_DIM>(o_s[0][h], lane);
        __syncthreads();
      }
    }

    // Write the output or this split's partial.
    for (int i = tid; i < num_columns * HEAD_DIM; i += kDecodeThreads) {
      const int h = i / HEAD_DIM;
      const int d = i % HEAD_DIM;
      const float m = column_max_s[h];
      const float l = column_denom_s[h];
      // With rotate_back, the merged row is in o_s[0], rotated back.
      const float o = rotate_back ? o_s[0][h][d] : merge_streams(h, d);
      const uint32_t token = column_token(h);
      const uint32_t head = column_head(h);
      if (plan.num_splits == 1) {
        const float out = normalize(o, l, m, sink_log2(a, head));
        const uint64_t row = uint64_t(row0 + token) * a.num_q_heads + head;
        a.output[row * HEAD_DIM + d] = __bfloat16_as_ushort(__float2bfloat16(out));
      } else {
        const uint32_t rows_per_seq = (EXTENDED ? a.max_q_len : 1u) * a.num_q_heads;
        float* part = partial_address(plan, share, rows_per_seq, token * a.num_q_heads + head, split, HEAD_DIM);
        part[d] = o;
        if (d == 0) {
          part[HEAD_DIM] = m;
          part[HEAD_DIM + 1] = l;
        }
      }
    }
  };
  if (pages_masked)
    decode_tiles(std::true_type{}, std::bool_constant<EXTENDED>{});
  else if (columns_masked)  // never with one token
    decode_tiles(std::false_type{}, std::bool_constant<EXTENDED>{});
  else
    decode_tiles(std::false_type{}, std::false_type{});
}

}  // namespace fp8kturbov
