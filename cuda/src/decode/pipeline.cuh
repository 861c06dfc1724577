// The decode's copy pipeline: each warp streams the 16-token tiles of its token stream through its
// own ring of kDecodeStages stages in shared memory, so that kDecodeStages - 1 tiles are in flight
// while one is computed and no register waits on a load. On sm_90, where the launch has tensor maps
// of the pools, a whole tile's K rows and V code rows arrive by one tensor copy each (completing on
// the stage's mbarrier); otherwise, and for the scales and partial tiles, the threads copy with
// cp.async. The page ids travel kDecodeStages - 1 tiles ahead of the data, so the block-table
// latency never stalls a copy.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>
#include <type_traits>

#include "decode/decode_args.h"
#include "decode/ptx.cuh"
#include "decode/traits.cuh"
#include "format.cuh"

namespace fp8kturbov {

// The tensor maps of a launch (encoded by the host, decode/launch.cuh).
struct DecodeTensorMaps {
  CUtensorMap k;      // K pool: [pages][block_size rows][row bytes], box: a warp's slice of 16 rows
  CUtensorMap codes;  // V code rows, the same box shape
  // V scale rows, [pages][block_size rows][row scale bytes]; box: 16 bytes of 16 rows, from the warp's
  // slice's scales on (the narrowest box a tensor copy moves)
  CUtensorMap scales;
  uint32_t enabled;         // 0: the threads copy every tile (cp.async)
  uint32_t scales_enabled;  // with enabled: the scales by the copy engine too (0: by the threads)
};

// Position -> (block, offset) by the runtime block size with a multiply and a shift
// (round-up reciprocal, exact for positions < 2^31; the host computes multiplier and shift).
__device__ __forceinline__ void split_position(const DecodeArgs& a, uint32_t pos, uint32_t& block,
                                               uint32_t& offset) {
  block = uint32_t((uint64_t(__umulhi(pos, a.block_size_multiplier)) + pos) >> a.block_size_shift);
  offset = pos - block * a.block_size;
}

// One stage of a warp's ring: its K rows, V code rows and V scale rows of one tile.
struct Stage {
  uint8_t* k;
  uint8_t* codes;
  uint8_t* scales;
};

// The shared memory a warp's stream uses besides its stages (DecodeSmem's layout).
struct StreamSmem {
  uint8_t* ring;                  // every warp's stages
  int32_t* page_ring;             // every warp's page-id slots
  uint32_t (*masked_rows)[kDecodeStages];  // checked mode: per warp and stage, rows whose page is out of range
  uint64_t (*stage_filled)[kDecodeStages];  // per warp and stage: the barrier its tensor copies complete on
};

// A warp's token stream of a CTA: the tiles first_tile + k · tile_step, k < num_tiles, of the
// positions [range_begin, range_end) of one sequence, for its d-slice of one KV head. MASK_PAGES:
// checked mode found a page out of range, whose rows the copies zero and mark.
template <int BITS, int HEAD_DIM, int CODE_COPY, bool GROUPED, bool MASK_PAGES>
struct TileStream {
  using S = DecodeShape<BITS, HEAD_DIM>;
  using L = DecodeSmem<BITS, HEAD_DIM, GROUPED>;

  const DecodeArgs& a;
  const DecodeTensorMaps& maps;
  StreamSmem smem;
  const int32_t* table;  // the sequence's block-table row
  int warp, lane;
  int first_tile, tile_step, num_tiles;
  int range_begin, range_end;
  bool tile_in_one_page;  // block_size % 16 == 0
  // This warp's slice of a token row in each pool (bytes).
  uint32_t row_elems, row_code_bytes, row_scale_bytes;
  uint64_t k_slice, code_slice, scale_slice;
  // A tensor copy's box must start at a 16-byte boundary of the scale row: the slice's scales lie
  // scale_skew bytes into each 16-byte row of the stage (the threads' copies put them there too),
  // where Stage::scales points.
  uint32_t scale_skew;
  int32_t* warp_pages;
  uint32_t stage_filled_base;
  // The 128-byte swizzle's phase of the K sections (the same in every stage): see k_chunk_offset.
  int k_swizzle_phase;
  // When a tile lies in one page, lane j holds the page id of tile 32·b + j of the stream (batch b)
  // in a register, and the next batch is loaded 32 tiles before it is needed.
  int32_t page_batch = 0, next_page_batch = 0;

  __device__ __forceinline__ TileStream(const DecodeArgs& args, const DecodeTensorMaps& tensor_maps, StreamSmem shared,
                                        const int32_t* table_row, int warp_index, int lane_index, int first, int step,
                                        int tiles, int begin, int end, uint32_t kv_head, int slice_d0)
      : a(args), maps(tensor_maps), smem(shared), table(table_row), warp(warp_index), lane(lane_index),
        first_tile(first), tile_step(step), num_tiles(tiles), range_begin(begin), range_end(end),
        tile_in_one_page(args.block_size % kTileTokens == 0) {
    row_elems = a.num_kv_heads * HEAD_DIM;  // < 2^32, validated
    row_code_bytes = row_elems / 8 * BITS;
    row_scale_bytes = row_elems / kGroupElems;
    k_slice = uint64_t(kv_head) * HEAD_DIM + slice_d0;  // < 2^32
    code_slice = k_slice * BITS / 8;
    scale_slice = a.v_data_section_bytes + k_slice / kGroupElems;
    scale_skew = S::kScalesByTensorCopy ? uint32_t(k_slice / kGroupElems) % 16 : 0;
    warp_pages = smem.page_ring + warp * kDecodeStages * kTileTokens;
    stage_filled_base = shared_address(&smem.stage_filled[warp][0]);
    k_swizzle_phase = int(shared_address(smem.ring) >> 7) & 7;
    if (tile_in_one_page) {
      page_batch = load_page_batch(0);
      next_page_batch = load_page_batch(1);
    }
  }

  __device__ __forceinline__ bool in_range(int pos) const { return pos >= range_begin && pos < range_end; }
  __device__ __forceinline__ int tile_of(int k) const { return first_tile + k * tile_step; }

  // This warp's stage `index`.
  __device__ __forceinline__ Stage stage(int index) const {
    const int slot = warp * kDecodeStages + index;
    return Stage{smem.ring + slot * S::kStageKBytes, smem.ring + L::kRingCodesOffset + slot * S::kStageCodeBytes,
                 smem.ring + L::kRingScalesOffset + scale_skew + slot * S::kStageScaleBytes};
  }
  // The barrier of this warp's stage `slot`.
  __device__ __forceinline__ uint32_t stage_filled(int slot) const {
    return stage_filled_base + uint32_t(slot) * uint32_t(sizeof(uint64_t));
  }
  // The byte offset of 16-byte chunk `chunk` of K row `row` in a stage: rows of 128 bytes are
  // stored in the copy engine's 128-byte swizzle (the chunk index XOR bits 7-9 of the row's
  // address: (row + k_swizzle_phase) % 8), which the threads' copies follow too; with the row
  // order of MmaRows::token, the fragment reads hit all 32 banks. Rows of 64 bytes are stored as
  // they are.
  __device__ __forceinline__ int k_chunk_offset(int row, int chunk) const {
    return 16 * (S::kKRowBytes == 128 ? chunk ^ ((row + k_swizzle_phase) & 7) : chunk);
  }

  // Page ids of a batch (tiles in one page): tiles outside the range get page id 0 and are never
  // read; where checked mode masks pages, a page id out of range becomes -1, which masks its tile.
  __device__ __forceinline__ int32_t load_page_batch(int batch) const {
    const int k = batch * 32 + lane;
    const int tile = tile_of(k);
    int32_t page = 0;
    if (k < num_tiles && tile < range_end && tile + kTileTokens > range_begin) {
      uint32_t block, offset;
      split_position(a, uint32_t(tile), block, offset);
      page = __ldg(table + block);
    }
    if (MASK_PAGES && a.index_check.page_out_of_range(page)) page = -1;
    return page;
  }

  // Tiles across pages: the page ids of tile k's rows into page slot `slot` (the stage's); rows
  // outside the range get page id 0. The callers pass a tile's stage index (k % kDecodeStages)
  // along with k: they count it, which is cheaper than the remainder.
  __device__ __forceinline__ void copy_page_ids(int k, int slot) const {
    if (tile_in_one_page || lane >= kTileTokens) return;
    const int tile = tile_of(k);
    const bool valid = in_range(tile + lane);
    uint32_t block, offset;
    split_position(a, uint32_t(tile + lane), block, offset);
    copy_async<4>(warp_pages + slot * kTileTokens + lane, valid ? table + block : table, valid);
  }

  // K bytes, V codes and V scales of this warp's slice of tile k into stage `slot`. ONE_PAGE
  // (block_size % 16 == 0) is a template argument so that each case is its own straight code path:
  // the common one computes each pool's tile base once and each row with one IMAD. WHOLE (a tile of
  // one page with every row in range, not masked: all but a range's first and last tiles) drops the
  // per-row validity tests and the zero-fill selects from the copies. Tiles are copied in
  // increasing k, which the page-id batches rely on.
  template <bool ONE_PAGE, bool WHOLE>
  __device__ __forceinline__ void copy_tile(int k, int slot) {
    const int tile = tile_of(k);
    const int32_t* pages = warp_pages + slot * kTileTokens;
    const Stage st = stage(slot);
    uint32_t block, offset0;
    split_position(a, uint32_t(tile), block, offset0);
    uint64_t page0 = 0;
    uint32_t masked_rows = 0;  // rows (bit r) whose page is out of range (checked mode)
    if constexpr (ONE_PAGE) {
      if (k % 32 == 0 && k > 0) {
        page_batch = next_page_batch;
        next_page_batch = load_page_batch(k / 32 + 1);
      }
      const int32_t page = __shfl_sync(0xffffffffu, page_batch, k % 32);
      page0 = uint32_t(page);
      if (MASK_PAGES && page < 0) masked_rows = (1u << kTileTokens) - 1;
    } else if (MASK_PAGES) {
      masked_rows = __ballot_sync(0xffffffffu, lane < kTileTokens && a.index_check.page_out_of_range(pages[lane]));
    }
    if (MASK_PAGES && lane == 0) smem.masked_rows[warp][slot] = masked_rows;
    // Rows of the tile in a pool of the given page stride and row size, from byte `col` of the
    // row (row sizes are < 2^25: num_kv_heads <= 65535, head_dim <= 512).
    auto tile_rows = [&](const uint8_t* pool, uint64_t page_stride, uint32_t row_bytes, uint64_t col) {
      const uint8_t* tile_base = pool + page0 * page_stride + uint64_t(offset0) * row_bytes + col;
      return [=](int row) -> const uint8_t* {
        if constexpr (ONE_PAGE) return tile_base + uint64_t(uint32_t(row) * row_bytes);
        uint32_t row_block, offset;
        split_position(a, uint32_t(tile + row), row_block, offset);
        return pool + uint64_t(uint32_t(pages[row])) * page_stride + uint64_t(offset) * row_bytes + col;
      };
    };
    const int valid_begin = range_begin - tile;  // valid rows: [valid_begin, valid_end), not masked
    const int valid_end = MASK_PAGES && ONE_PAGE && masked_rows != 0 ? valid_begin : range_end - tile;
    auto valid_row = [&](int row) {
      return WHOLE || (row >= valid_begin && row < valid_end && (!MASK_PAGES || ONE_PAGE || !((masked_rows >> row) & 1)));
    };
    // K rows, V code rows and (kScalesByTensorCopy) V scale rows: a whole tile by the copy engine
    // where the launch has tensor maps, else by the threads (cp.async: rows out of range
    // zero-filled), the stage's barrier phase then completing with the arrival alone.
    const uint32_t filled = stage_filled(slot);
    bool copied = false, scales_copied = false;
    if constexpr (kArchHasTensorCopies && WHOLE && CODE_COPY == 16 && S::kCodeRowBytes % 16 == 0) {
      if (maps.enabled) {  // CTA-uniform, as scales_enabled
        scales_copied = S::kScalesByTensorCopy && maps.scales_enabled;
        if (elect_one_lane()) {
          barrier_arrive_expecting(filled, S::kStageKBytes + S::kStageCodeBytes + (scales_copied ? S::kStageScaleBytes : 0));
          copy_box(shared_address(st.k), maps.k, int(k_slice), int(offset0), int(page0), filled);
          copy_box(shared_address(st.codes), maps.codes, int(code_slice), int(offset0), int(page0), filled);
          if (scales_copied)
            copy_box(shared_address(st.scales - scale_skew), maps.scales, int(k_slice / kGroupElems - scale_skew),
                     int(offset0), int(page0), filled);
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
        copy_async<16>(st.k + row * S::kKRowBytes + k_chunk_offset(row, chunk), valid ? src : a.k_cache, valid);
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
          copy_async<CODE_COPY>(st.codes + row * S::kCodeRowBytes + CODE_COPY * part, valid ? src : a.v_cache, valid);
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
      copy_async<4>(st.scales + row * S::kScaleRowPitch + 4 * part, valid ? src : a.v_cache, valid);
    }
  }

  // Tile k into stage `slot`, by the copy path its position takes.
  __device__ __forceinline__ void copy_any_tile(int k, int slot) {
    const int tile = tile_of(k);
    if (!tile_in_one_page)
      copy_tile<false, false>(k, slot);
    else if (!MASK_PAGES && tile >= range_begin && tile + kTileTokens <= range_end)
      copy_tile<true, true>(k, slot);
    else
      copy_tile<true, false>(k, slot);
  }

  // (slot + n) % kDecodeStages for 0 <= n < kDecodeStages.
  __device__ __forceinline__ static int slot_after(int slot, int n) {
    return slot + n >= kDecodeStages ? slot + n - kDecodeStages : slot + n;
  }

  // The barriers, then the page ids of the first kDecodeStages - 1 tiles, then those tiles, each
  // copy group also fetching the page ids that the copy kDecodeStages - 1 tiles later will need.
  __device__ __forceinline__ void start() {
    if (kArchHasTensorCopies && lane == 0) {
#pragma unroll
      for (int st = 0; st < kDecodeStages; ++st) barrier_init(stage_filled(st));
      barrier_init_fence();
    }
    __syncwarp();
    for (int k = 0; k < kDecodeStages - 1 && k < num_tiles; ++k) copy_page_ids(k, k);
    copy_async_commit();
    copy_async_wait<0>();
    __syncwarp();
    for (int k = 0; k < kDecodeStages - 1; ++k) {
      __syncwarp();  // every lane has read page slot k - 1 before it is refilled
      if (k + kDecodeStages - 1 < num_tiles) copy_page_ids(k + kDecodeStages - 1, (k + kDecodeStages - 1) % kDecodeStages);
      if (k < num_tiles) copy_any_tile(k, k);
      copy_async_commit();
    }
  }

  // Waits for tile k in stage `slot` (filled_parity: the phase of its barrier that tile k
  // completes) and refills the stage of tile k - 1 with tile k + kDecodeStages - 1 (and the page ids
  // of tile k + 2·kDecodeStages - 2). Every lane is done with the stage of tile k - 1: no proxy
  // fence is needed before a tensor copy refills it, since the lanes' reads of that stage have
  // returned, their values consumed by the mma of tile k - 1, and the warp barrier orders them
  // before the copy, as a consumer's barrier arrival does in a producer-consumer pipeline.
  __device__ __forceinline__ Stage next_tile(int k, int slot, uint32_t filled_parity) {
    copy_async_wait<kDecodeStages - 2>();
    __syncwarp();
    if (k + 2 * kDecodeStages - 2 < num_tiles) copy_page_ids(k + 2 * kDecodeStages - 2, slot_after(slot, kDecodeStages - 2));
    if (k + kDecodeStages - 1 < num_tiles) copy_any_tile(k + kDecodeStages - 1, slot_after(slot, kDecodeStages - 1));
    copy_async_commit();
    if constexpr (kArchHasTensorCopies) barrier_wait(stage_filled(slot), filled_parity);
    return stage(slot);
  }

  // The copies still in flight are of tiles past the end: drained before the ring is reused.
  __device__ __forceinline__ void drain() const { copy_async_wait<0>(); }
};

}  // namespace fp8kturbov
