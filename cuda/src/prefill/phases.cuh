// The phases that both prefill kernels run alike: the mma.sync / wgmma kernel of one warpgroup
// (prefill/kernel.cuh) and the sm_90a kernel whose warpgroups are specialised (prefill/kernel_ws.cuh).
// They differ in who runs a phase and how the threads meet between phases; what a phase does is here.
//   - the work: a CTA's query rows and the positions they read;
//   - Q: the rows as fp16, scaled by a power of two;
//   - copy: a tile's raw bytes into a staging buffer (cp.async), by a warpgroup;
//   - dequantize: a staged (position, group) into fp16 K and V words;
//   - softmax: a tile's scores into the rows' online state, P for the values' products;
//   - finish: the rows' denominators and log-denominators, their fp32 rows in shared memory,
//     rotated back where V was rotated, and the store as bf16 rows (fp32 partials with splits).
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "decode/ptx.cuh"
#include "decode/ranges.cuh"
#include "decode/softmax_state.cuh"  // exp2_fast, soft_cap_tanh
#include "decode/traits.cuh"         // kLog2e
#include "decode/v_codes.cuh"        // fill_level_pairs
#include "format.cuh"
#include "kernel_args.h"
#include "plan/prefill_plan.h"
#include "prefill/mma.cuh"     // bf16x2_bits
#include "prefill/wgmma.cuh"  // blocked_offset

namespace fp8kturbov {

// The tile shapes of both kernels and a tile's staged bytes.
template <int BITS, int HEAD_DIM>
struct PrefillTileTraits {
  static constexpr int kKvTile = int(prefill_kv_tile(HEAD_DIM));  // positions per tile (the planner's)
  static constexpr int kScoreTiles = kKvTile / 8;                 // n-tiles of a warp's scores
  static constexpr int kOutputTiles = HEAD_DIM / 8;               // n-tiles of a warp's output rows
  static constexpr int kGroups = HEAD_DIM / kGroupElems;
  // A position's staged bytes, copied in 16-byte (K) and 4-byte (V codes, V scales) pieces: the
  // pools' validated alignment (FORMAT §3: a head's codes and scales start at multiples of 4).
  static constexpr int kCodeBytes = HEAD_DIM * BITS / 8;
  static constexpr int kScaleBytes = HEAD_DIM / kGroupElems;
  static constexpr int kPieces = HEAD_DIM / 16 + kCodeBytes / 4 + kScaleBytes / 4;
  static constexpr int kCopyThreads = 128;  // a warpgroup copies and dequantizes
  static_assert(kCopyThreads % kKvTile == 0, "whole threads per position");
  static_assert(kKvTile * kGroups % kCopyThreads == 0, "whole groups per thread");
  struct Stage {
    alignas(16) uint8_t k[kKvTile][HEAD_DIM];
    alignas(16) uint8_t codes[kKvTile][kCodeBytes];
    alignas(16) uint8_t scales[kKvTile][kScaleBytes];
    bool position_ok[kKvTile];
  };
};

// ---- The work ---------------------------------------------------------------------------------------

// A row of a CTA's query tile: where its query token lies and which positions it attends.
struct PrefillRow {
  int token;  // in the chunk; >= q_len: no row (padding of the last tile)
  int head;   // query head
  int begin;  // attends positions [begin, end)
  int end;
};

// A CTA's work: the query tile blockIdx.x % tiles_per_seq of sequence blockIdx.x / tiles_per_seq's
// chunk and KV head blockIdx.y, its rows (token, query head of the group) pairs, token-major, so that
// the heads of a group share every tile of K and V; split blockIdx.z of their positions.
struct PrefillWork {
  uint32_t seq;
  uint32_t row0;  // the chunk's first row of q and of the output
  int q_len;      // the chunk's tokens
  int seq_len;
  int first_flat;  // the tile's first (token, head) pair
  int kv_head;
  int range_begin;  // the positions the CTA reads: its rows' ranges within its split's
  int range_end;
  int first_tile0;  // the first tile's first position
  int num_tiles;
};

// Row r of the CTA's tile.
__device__ __forceinline__ PrefillRow prefill_row(const PrefillArgs& a, const PrefillWork& w, int r) {
  PrefillRow row;
  const int flat = w.first_flat + r;
  const int group = int(a.group_size);
  row.token = flat / group;
  row.head = w.kv_head * group + flat % group;
  row.end = row.token < w.q_len ? max(w.seq_len - w.q_len + row.token + 1, 0) : 0;
  row.begin = window_start(a, row.end);
  return row;
}

// Tile `tile` (of positions [tile · kv_tile, ...)) of (sequence, KV head)'s expanded context
// (PrefillArgs::expanded_kv).
__device__ __forceinline__ uint8_t* expanded_tile(const PrefillArgs& a, uint32_t seq, int kv_head, uint64_t tile) {
  return a.expanded_kv + ((uint64_t(seq) * a.num_kv_heads + uint32_t(kv_head)) * a.expanded_tiles + tile) *
                             a.expanded_tile_bytes;
}

// The CTA's work with query tiles of QUERY_ROWS rows; false (CTA-uniform) where it has none: a
// chunk that ends before its tile, or a query_start that checked mode reports. `reporter`: the one
// thread of the grid that reports what checked mode finds here.
template <int QUERY_ROWS, int KV_TILE>
__device__ __forceinline__ bool prefill_work(const PrefillArgs& a, bool reporter, PrefillWork& w) {
  w.seq = blockIdx.x / a.tiles_per_seq;
  const uint32_t tile = blockIdx.x % a.tiles_per_seq;
  w.kv_head = int(blockIdx.y);
  const bool reports = reporter && a.index_check.enabled() && tile == 0 && blockIdx.y == 0;
  if (!sequence_query_rows(a, w.seq, w.row0, w.q_len)) {
    if (reports) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
    return false;
  }
  w.first_flat = int(tile) * QUERY_ROWS;
  if (w.first_flat >= w.q_len * int(a.group_size)) return false;
  const int given_seq_len = __ldg(a.seq_lens + w.seq);
  w.seq_len = clamped_seq_len(a, given_seq_len);
  if (reports && w.seq_len != given_seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SEQ_LEN);
  if (reports && w.q_len > w.seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
  const int last_r = min(QUERY_ROWS, w.q_len * int(a.group_size) - w.first_flat) - 1;
  // The rows' ranges grow with the token: the first row begins first, the last ends last.
  const int64_t split_begin = int64_t(blockIdx.z) * a.split_positions;
  w.range_begin = int(max(int64_t(prefill_row(a, w, 0).begin), split_begin));
  w.range_end = int(min(int64_t(prefill_row(a, w, last_r).end), split_begin + a.split_positions));
  w.first_tile0 = w.range_begin & ~(KV_TILE - 1);
  w.num_tiles = w.first_tile0 < w.range_end ? (w.range_end - w.first_tile0 + KV_TILE - 1) / KV_TILE : 0;
  return true;
}

// ---- Q ----------------------------------------------------------------------------------------------

// Chunk c (8 elements) of row r's query as floats; zeros for a padding row.
template <int HEAD_DIM>
__device__ __forceinline__ void query_chunk(const PrefillArgs& a, const PrefillWork& w, int r, int c, float (&x)[8]) {
  const PrefillRow row = prefill_row(a, w, r);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = 0.0f;
  if (row.token >= w.q_len) return;
  const uint16_t* src = a.q + uint64_t(w.row0 + uint32_t(row.token)) * a.q_stride + uint64_t(row.head) * HEAD_DIM + c * 8;
  uint16_t e[8];
  if (a.q_vector_loads) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = uint16_t(words[j / 2] >> (16 * (j % 2)));
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = __ldg(src + j);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = __bfloat162float(__ushort_as_bfloat16(e[j]));
}

// The largest finite magnitude of rows [first_row, first_row + rows)'s queries that this thread of
// THREADS reads, reduced over its warp. Non-finite elements do not take part in the gain: an Inf or
// NaN stays in its own row.
template <int HEAD_DIM, int THREADS>
__device__ __forceinline__ float query_warp_absmax(const PrefillArgs& a, const PrefillWork& w, int first_row, int rows,
                                                   int thread) {
  constexpr int kChunks = HEAD_DIM / 8;
  float absmax = 0.0f;
  for (int i = thread; i < rows * kChunks; i += THREADS) {
    float x[8];
    query_chunk<HEAD_DIM>(a, w, first_row + i / kChunks, i % kChunks, x);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (fabsf(x[j]) <= FLT_MAX) absmax = fmaxf(absmax, fabsf(x[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, o));
  return absmax;
}

// The power of two that scales the query into fp16, its largest magnitude below 2^15, so that K's
// E4M3 bytes convert exactly with the hardware's pair conversion; the score scale undoes it.
__device__ __forceinline__ float query_gain(float absmax) {
  int q_exp = 0;
  if (absmax > 0.0f) frexpf(absmax, &q_exp);  // absmax < 2^q_exp
  q_exp = max(q_exp, 15 - 127);               // the gain stays a finite float even for subnormal queries
  return ldexpf(1.0f, 15 - q_exp);
}

// Rows [first_row, first_row + rows) of the query, scaled by `gain`, as fp16: store(r, c, chunk)
// puts chunk c (8 elements) of tile row r where the products read it.
template <int HEAD_DIM, int THREADS, typename Store>
__device__ __forceinline__ void stage_query(const PrefillArgs& a, const PrefillWork& w, int first_row, int rows,
                                            int thread, float gain, Store&& store) {
  constexpr int kChunks = HEAD_DIM / 8;
  for (int i = thread; i < rows * kChunks; i += THREADS) {
    float x[8];
    const int r = first_row + i / kChunks, c = i % kChunks;
    query_chunk<HEAD_DIM>(a, w, r, c, x);
    store(r, c, make_uint4(half2_bits(x[0] * gain, x[1] * gain), half2_bits(x[2] * gain, x[3] * gain),
                           half2_bits(x[4] * gain, x[5] * gain), half2_bits(x[6] * gain, x[7] * gain)));
  }
}

// ---- Copy -------------------------------------------------------------------------------------------

// A warpgroup's copies of tiles into staging buffers: the kCopyThreads / kKvTile threads of a
// position copy its pieces. Positions outside [range_begin, range_end), or on pages that checked
// mode finds outside the pools, are zeros and not ok. A tile's page ids are loaded a tile earlier
// (page()), so that the copies do not wait for the table.
template <int BITS, int HEAD_DIM>
struct PrefillTileCopy {
  using T = PrefillTileTraits<BITS, HEAD_DIM>;
  static constexpr int kThreadsPerPosition = T::kCopyThreads / T::kKvTile;
  const PrefillArgs& a;
  const PrefillWork& w;
  const int32_t* table;
  int position;  // the thread's position in a tile
  int part;      // and its share of that position's pieces

  __device__ __forceinline__ PrefillTileCopy(const PrefillArgs& args, const PrefillWork& work, int thread)
      : a(args),
        w(work),
        table(args.block_tables + uint64_t(work.seq) * args.block_tables_stride),
        position(thread / kThreadsPerPosition),
        part(thread % kThreadsPerPosition) {}

  // The page id of the thread's position of the tile at `tile0` (0 where it is not read).
  __device__ __forceinline__ int32_t page(int tile0) const {
    const int pos = tile0 + position;
    if (pos < w.range_begin || pos >= w.range_end) return 0;
    uint32_t block = 0, offset = 0;
    split_position(a, uint32_t(pos), block, offset);
    return __ldg(table + block);
  }

  // Copies the tile at `tile0` into `stage` (asynchronously; one commit group per call).
  __device__ __forceinline__ void copy(typename T::Stage& stage, int tile0, int32_t page_id) const {
    const int p = position, pos = tile0 + p;
    bool ok = pos >= w.range_begin && pos < w.range_end;
    uint32_t block = 0, offset = 0;
    if (ok) {
      split_position(a, uint32_t(pos), block, offset);
      if (a.index_check.enabled() && a.index_check.page_out_of_range(page_id)) {
        ok = false;
        if (part == 0) a.index_check.report(FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE);
      }
    }
    if (!ok) page_id = 0;
    if (part == 0) stage.position_ok[p] = ok;
    const uint64_t row_code_bytes = uint64_t(a.num_kv_heads) * T::kCodeBytes;
    const uint64_t row_scale_bytes = uint64_t(a.num_kv_heads) * T::kScaleBytes;
    const uint8_t* k_row = a.k_cache + uint64_t(page_id) * a.k_block_stride_bytes +
                           (uint64_t(offset) * a.num_kv_heads + uint32_t(w.kv_head)) * HEAD_DIM;
    const uint8_t* v_page = a.v_cache + uint64_t(page_id) * a.v_block_stride_bytes;
    const uint8_t* code_row = v_page + offset * row_code_bytes + uint32_t(w.kv_head) * T::kCodeBytes;
    const uint8_t* scale_row =
        v_page + a.v_data_section_bytes + offset * row_scale_bytes + uint32_t(w.kv_head) * T::kScaleBytes;
#pragma unroll
    for (int piece = part; piece < T::kPieces; piece += kThreadsPerPosition) {
      if (piece < HEAD_DIM / 16) {
        copy_async<16>(&stage.k[p][piece * 16], ok ? k_row + piece * 16 : a.k_cache, ok);
      } else if (piece < HEAD_DIM / 16 + T::kCodeBytes / 4) {
        const int c = 4 * (piece - HEAD_DIM / 16);
        copy_async<4>(&stage.codes[p][c], ok ? code_row + c : a.v_cache, ok);
      } else {
        const int c = 4 * (piece - HEAD_DIM / 16 - T::kCodeBytes / 4);
        copy_async<4>(&stage.scales[p][c], ok ? scale_row + c : a.v_cache, ok);
      }
    }
    copy_async_commit();
  }
};

// ---- Dequantize -------------------------------------------------------------------------------------

// Item i of a tile's kKvTile · kGroups (position, group) items for the blocked layout: the 8 lanes of
// a quarter-warp take 8 positions of one 8-position block (their blocked stores fill one 128-byte
// core-matrix row set) and 8 rotated groups (their staged reads fall in 8 different bank groups).
template <int GROUPS>
__device__ __forceinline__ void blocked_item(int i, int& p, int& g) {
  const int quarter = i / 8, q = i % 8;
  p = quarter / GROUPS * 8 + q;
  g = (q + quarter % GROUPS) % GROUPS;
}

// V's levels for the dequantization as fp16 pairs, in the decode's level-pair table
// (decode/v_codes.cuh: fill_level_pairs): one load gives two neighbouring elements, whose codes'
// 2·BITS bits are the entry. COPIES copies side by side, a thread reading copy lane % COPIES.
template <int BITS, int COPIES>
struct PrefillLevelPairs {
  static constexpr int kCopies = COPIES;
  uint32_t words[(1 << (2 * BITS)) * COPIES];
};

// Position p's group g from the staged bytes as fp16 pairs: K's E4M3 bytes (exact), and V's
// level[code]·scale, a level pair times the scale (E4M3, exact in fp16) in one fp16 product (every
// V value lies in fp16's normal range). `copy`: the thread's copy of the level pairs (lane % COPIES).
template <int BITS, int HEAD_DIM, int COPIES>
__device__ __forceinline__ void dequantize_group(const typename PrefillTileTraits<BITS, HEAD_DIM>::Stage& st,
                                                 const PrefillLevelPairs<BITS, COPIES>& level_pairs, uint32_t copy,
                                                 int p, int g, uint32_t (&k_words)[8], uint32_t (&v_words)[8]) {
  const uint4 kb = *reinterpret_cast<const uint4*>(&st.k[p][g * kGroupElems]);
  e4m3x4_to_half2x2_bits(kb.x, k_words[0], k_words[1]);
  e4m3x4_to_half2x2_bits(kb.y, k_words[2], k_words[3]);
  e4m3x4_to_half2x2_bits(kb.z, k_words[4], k_words[5]);
  e4m3x4_to_half2x2_bits(kb.w, k_words[6], k_words[7]);
  // The group's codes, code e at bits [BITS·e, BITS·e + BITS) (FORMAT §3.3: also the 3-bit
  // triplets), from 2-byte aligned halves.
  uint64_t codes = 0;
  const uint16_t* halves = reinterpret_cast<const uint16_t*>(&st.codes[p][g * 2 * BITS]);
#pragma unroll
  for (int j = 0; j < BITS; ++j) codes |= uint64_t(halves[j]) << (16 * j);
  const uint32_t scale_byte = st.scales[p][g];
  const uint32_t scales = e4m3x2_to_half2_bits(scale_byte | (scale_byte << 8));
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t e = uint32_t(codes >> (2 * BITS * j)) & ((1u << (2 * BITS)) - 1);
    const uint32_t levels = level_pairs.words[e * COPIES + copy];
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&levels), *reinterpret_cast<const __half2*>(&scales));
    v_words[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Position p's group g (8 + 8 fp16 words) into a tile in the blocked layout.
template <int HEAD_DIM>
__device__ __forceinline__ void store_blocked_group(uint8_t* tile, int p, int g, const uint32_t (&words)[8]) {
  *reinterpret_cast<uint4*>(tile + blocked_offset<HEAD_DIM>(p, g * kGroupElems)) =
      make_uint4(words[0], words[1], words[2], words[3]);
  *reinterpret_cast<uint4*>(tile + blocked_offset<HEAD_DIM>(p, g * kGroupElems + 8)) =
      make_uint4(words[4], words[5], words[6], words[7]);
}

// A staged tile dequantized by THREADS threads (this one `thread`, reading level-pair copy
// lane % COPIES): fp16 K and V tiles in the blocked layout, and the positions' flags.
template <int BITS, int HEAD_DIM, int THREADS, int COPIES>
__device__ __forceinline__ void dequantize_tile(const typename PrefillTileTraits<BITS, HEAD_DIM>::Stage& st,
                                                const PrefillLevelPairs<BITS, COPIES>& level_pairs, int thread,
                                                uint8_t* k, uint8_t* v, bool* position_ok) {
  using T = PrefillTileTraits<BITS, HEAD_DIM>;
#pragma unroll
  for (int i = thread; i < T::kKvTile * T::kGroups; i += THREADS) {
    int p, g;
    blocked_item<T::kGroups>(i, p, g);
    if (g == 0) position_ok[p] = st.position_ok[p];
    uint32_t k_words[8], v_words[8];
    dequantize_group<BITS, HEAD_DIM>(st, level_pairs, uint32_t(thread % 32 % COPIES), p, g, k_words, v_words);
    store_blocked_group<HEAD_DIM>(k, p, g, k_words);
    store_blocked_group<HEAD_DIM>(v, p, g, v_words);
  }
}

// ---- Softmax ----------------------------------------------------------------------------------------

// A product's score in log2 units: s·outer, or outer·tanh(s·inner) under a soft cap; `q_gain`, the
// query's power of two, is undone here.
struct PrefillScoreMap {
  float outer;
  float inner;
  bool capped;
  __device__ __forceinline__ PrefillScoreMap(const PrefillArgs& a, float q_gain) {
    const float score_scale = a.score_scale / q_gain;  // a power of two apart: exact
    capped = a.soft_cap > 0.0f;
    outer = (capped ? a.soft_cap : score_scale) * kLog2e;
    inner = capped ? score_scale / a.soft_cap : 1.0f;
  }
  template <bool CAPPED>
  __device__ __forceinline__ float apply(float s) const {
    if constexpr (CAPPED) return outer * soft_cap_tanh(s * inner);
    return s * outer;
  }
};

// Whether every position of a tile is on a page inside the pools, from its `position_ok` in shared
// memory (a warp's vote: each lane reads every 32nd).
template <int KV_TILE>
__device__ __forceinline__ bool tile_positions_ok(const bool* position_ok, uint32_t lane) {
  bool ok = true;
#pragma unroll
  for (int p = int(lane); p < KV_TILE; p += 32) ok = ok && position_ok[p];
  return __all_sync(0xffffffffu, ok);
}

// Whether a warp must mask the tile at `tile0` of KV_TILE positions: unless every position is on a
// page inside the pools (`tile_ok`) and its threads' rows all attend the whole tile.
template <int KV_TILE>
__device__ __forceinline__ bool tile_needs_mask(bool tile_ok, const PrefillRow (&rows)[2], int tile0) {
  return !tile_ok || !__all_sync(0xffffffffu, rows[0].begin <= tile0 && rows[1].begin <= tile0 &&
                                                  rows[0].end >= tile0 + KV_TILE && rows[1].end >= tile0 + KV_TILE);
}

// The online softmax of a tile's scores for the thread's two rows (lane / 4 and lane / 4 + 8 of its
// warp's 16, in the accumulators' layout), in two parts so that the output rows may still be in a
// product's hands during the first. softmax_weights: scores to log2 units, masked (where `masked`: a
// position outside the row's range or not ok), the running maxima m and denominators l (the
// thread's share) updated, s replaced by the weights in [0, 1], and the factor by which each row's
// output is to shrink left in `correction`; rescale_rows applies it.
template <int SCORE_TILES, typename PositionOk>
__device__ __forceinline__ void softmax_weights(float (&s)[SCORE_TILES][4], float (&m)[2], float (&l)[2],
                                                float (&correction)[2], const PrefillScoreMap& map, bool masked,
                                                const PositionOk& position_ok, const PrefillRow (&rows)[2],
                                                int tile0, uint32_t lane) {
  float tile_max[2] = {-INFINITY, -INFINITY};
  // The mask and the soft cap are the warp's choices for the whole tile: one loop each, so that a
  // tile which needs neither runs without their instructions.
  const auto map_scores = [&](auto masked_c, auto capped_c) {
#pragma unroll
    for (int j = 0; j < SCORE_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = map.template apply<decltype(capped_c)::value>(s[j][e]);
        if constexpr (decltype(masked_c)::value) {
          const int col = j * 8 + 2 * int(lane % 4) + (e & 1);
          const PrefillRow& row = rows[e / 2];
          const int pos = tile0 + col;
          if (!(position_ok(col) && pos >= row.begin && pos < row.end)) x = -INFINITY;
        }
        s[j][e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
  };
  using yes = std::true_type;
  using no = std::false_type;
  if (masked)
    map.capped ? map_scores(yes{}, yes{}) : map_scores(yes{}, no{});
  else
    map.capped ? map_scores(no{}, yes{}) : map_scores(no{}, no{});
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    const float m_new = fmaxf(m[h], tile_max[h]);
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // no position yet: every weight is 0
    correction[h] = exp2_fast(m[h] - base);
    m[h] = m_new;
    l[h] *= correction[h];
#pragma unroll
    for (int j = 0; j < SCORE_TILES; ++j) {
      s[j][2 * h] = exp2_fast(s[j][2 * h] - base);  // in [0, 1]: rounded to fp16 next
      s[j][2 * h + 1] = exp2_fast(s[j][2 * h + 1] - base);
      l[h] += s[j][2 * h] + s[j][2 * h + 1];
    }
  }
}

template <int OUTPUT_TILES>
__device__ __forceinline__ void rescale_rows(float (&o)[OUTPUT_TILES][4], const float (&correction)[2]) {
#pragma unroll
  for (int j = 0; j < OUTPUT_TILES; ++j) {
    o[j][0] *= correction[0];
    o[j][1] *= correction[0];
    o[j][2] *= correction[1];
    o[j][3] *= correction[1];
  }
}

// Both parts at once.
template <int SCORE_TILES, int OUTPUT_TILES>
__device__ __forceinline__ void prefill_softmax(float (&s)[SCORE_TILES][4], float (&o)[OUTPUT_TILES][4], float (&m)[2],
                                                float (&l)[2], const PrefillScoreMap& map, bool masked,
                                                const bool* position_ok, const PrefillRow (&rows)[2], int tile0,
                                                uint32_t lane) {
  float correction[2];
  softmax_weights(s, m, l, correction, map, masked, [&](int col) { return position_ok[col]; }, rows, tile0, lane);
  rescale_rows(o, correction);
}

// The weights of positions [16·kk, 16·kk + 16) as the A fragments of P·V: the score accumulators'
// fragments are the A fragments of 16 positions.
template <int SCORE_TILES>
__device__ __forceinline__ void weight_fragments(const float (&s)[SCORE_TILES][4], int kk, uint32_t (&p)[4]) {
  p[0] = half2_bits(s[2 * kk][0], s[2 * kk][1]);
  p[1] = half2_bits(s[2 * kk][2], s[2 * kk][3]);
  p[2] = half2_bits(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  p[3] = half2_bits(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
// All of a tile's.
template <int SCORE_TILES>
__device__ __forceinline__ void weight_fragments(const float (&s)[SCORE_TILES][4], uint32_t (&p)[SCORE_TILES / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < SCORE_TILES / 2; ++kk) weight_fragments(s, kk, p[kk]);
}

// O += P·V of a warpgroup's 64 rows on wgmma, issued and committed but not waited for: P the
// weights' fragments (weight_fragments), V MN-major in the blocked layout (head_dim contiguous,
// positions the reduced dimension; blocks of 8 positions, HEAD_DIM · 16 bytes). V, p and o stay
// the products' until the warpgroup's next wgmma_wait.
template <int HEAD_DIM, int STEPS>
__device__ __forceinline__ void issue_wgmma_values(float (&o)[HEAD_DIM / 8][4], const uint32_t (&p)[STEPS][4],
                                                   uint32_t v_address) {
  constexpr uint32_t kRowBlockBytes = HEAD_DIM * 16;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < STEPS; ++kk)
    wgmma_rs_mn<HEAD_DIM>(o, p[kk], matrix_descriptor(v_address + kk * 2 * kRowBlockBytes, kRowBlockBytes, 128));
  wgmma_commit();
}

// The same from the weights, waited for.
template <int HEAD_DIM, int SCORE_TILES>
__device__ __forceinline__ void wgmma_values(float (&o)[HEAD_DIM / 8][4], const float (&s)[SCORE_TILES][4],
                                             uint32_t v_address) {
  uint32_t p[SCORE_TILES / 2][4];
  weight_fragments(s, p);
  issue_wgmma_values<HEAD_DIM>(o, p, v_address);
  wgmma_wait<0>();
}

// ---- Finish -----------------------------------------------------------------------------------------

// The thread's two rows: denominators summed over their 4 threads (sinks join them, unless the
// merge adds them), normalised into o_rows (fp32 rows of PITCH floats, its warp's 16 from
// warp_row0), their log-denominators stored, and rotated back where V was rotated (FORMAT §6:
// attention is linear in V; partials stay rotated, the merge rotates their combination back).
// Called by whole warps after the tiles' space is free; o_rows holds the rows when the caller's
// threads meet next.
template <int HEAD_DIM, int PITCH, int OUTPUT_TILES>
__device__ __forceinline__ void finish_rows(const PrefillArgs& a, const PrefillWork& w, const float (&o)[OUTPUT_TILES][4],
                                            float (&m)[2], float (&l)[2], const PrefillRow (&rows)[2],
                                            float (*o_rows)[PITCH], int warp_row0, uint32_t lane) {
  const bool split = a.num_splits > 1;  // the partials go to the workspace, for the merge kernel
  float row_scale[2], lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    float weight = 1.0f;  // of the rows' positions, after a sink
    if (l[h] > 0.0f && a.sinks != nullptr && !split) {
      const float sink = __ldg(a.sinks + rows[h].head) * kLog2e;
      const float m_final = fmaxf(m[h], sink);
      weight = exp2f(m[h] - m_final);
      l[h] = l[h] * weight + exp2f(sink - m_final);
      m[h] = m_final;
    }
    // l == 0: no position (zeros, lse -inf). A NaN l (a NaN score) stays NaN in the row and in
    // its lse, so that the merge cannot take the part for an empty one (RELIABILITY §4.4).
    row_scale[h] = l[h] == 0.0f ? 0.0f : weight / l[h];
    lse[h] = l[h] == 0.0f ? -INFINITY : (m[h] + log2f(l[h])) * 0.6931471805599453f;
  }
#pragma unroll
  for (int j = 0; j < OUTPUT_TILES; ++j) {
    const int col = j * 8 + 2 * int(lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* dst = &o_rows[warp_row0 + int(lane) / 4 + 8 * h][col];
      dst[0] = o[j][2 * h] * row_scale[h];
      dst[1] = o[j][2 * h + 1] * row_scale[h];
    }
  }
  float* const lse_out = split ? a.partial_lse + uint64_t(blockIdx.z) * a.num_query_rows * a.num_q_heads : a.lse;
  if (lse_out != nullptr && lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (rows[h].token < w.q_len)
        lse_out[uint64_t(w.row0 + uint32_t(rows[h].token)) * a.num_q_heads + uint32_t(rows[h].head)] = lse[h];
  }
  if constexpr (kRotatableHeadDim<HEAD_DIM>) {
    if (a.rotated_v && !split) {
      __syncwarp();
      for (int r = warp_row0; r < warp_row0 + 16; ++r) unrotate_row<HEAD_DIM>(o_rows[r], lane);
    }
  }
}

// The store of rows [first_row, first_row + rows) from o_rows by THREADS threads, 8 elements per
// thread and step: bf16 rows of the output, or with splits fp32 rows of this split's partials.
template <int HEAD_DIM, int PITCH, int THREADS>
__device__ __forceinline__ void store_rows(const PrefillArgs& a, const PrefillWork& w, const float (*o_rows)[PITCH],
                                           int first_row, int rows, int thread) {
  constexpr int kChunks = HEAD_DIM / 8;
  const bool split = a.num_splits > 1;
  const uint64_t split_rows = uint64_t(blockIdx.z) * a.num_query_rows * a.num_q_heads;
  for (int i = thread; i < rows * kChunks; i += THREADS) {
    const int r = first_row + i / kChunks, c = i % kChunks;
    const PrefillRow row = prefill_row(a, w, r);
    if (row.token >= w.q_len) continue;
    const uint64_t output_row = uint64_t(w.row0 + uint32_t(row.token)) * a.num_q_heads + uint32_t(row.head);
    const float* src = &o_rows[r][c * 8];
    if (split) {
      float4* dst = reinterpret_cast<float4*>(a.partial_o + (split_rows + output_row) * HEAD_DIM + c * 8);
      dst[0] = make_float4(src[0], src[1], src[2], src[3]);
      dst[1] = make_float4(src[4], src[5], src[6], src[7]);
      continue;
    }
    const uint4 chunk = make_uint4(bf16x2_bits(src[0], src[1]), bf16x2_bits(src[2], src[3]), bf16x2_bits(src[4], src[5]),
                                   bf16x2_bits(src[6], src[7]));
    uint16_t* dst = a.output + output_row * HEAD_DIM + c * 8;
    if (a.output_vector_stores) {
      *reinterpret_cast<uint4*>(dst) = chunk;
    } else {
      const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = uint16_t(words[j / 2] >> (16 * (j % 2)));
    }
  }
}

}  // namespace fp8kturbov
