// The paged prefill kernel: chunks of query tokens attend their cached prefix and themselves
// (causal), on tensor cores, with K and V dequantized in shared memory as each tile of positions
// arrives.
//
// A CTA takes kQueryRows query rows of one sequence's chunk and one KV head (prefill/phases.cuh:
// the work, and each phase below); each of its warps holds 16 rows. Per tile of kKvTile positions:
//   1. copy: the next tile's raw bytes (K, V codes, V scales) into the other of two staging
//      buffers (cp.async), in flight while this tile is worked on;
//   2. dequantize: this tile's staged bytes into fp16 K and V rows (V = level[code]·scale);
//   3. scores: S = Q·Kᵀ (fp16 products, fp32 accumulators), scaled, soft-capped, masked;
//   4. softmax: the online softmax state of each row (running max in log2 units, denominator);
//   5. values: O += P·V (P in [0, 1] and every V value lie in fp16's normal range).
// The products are the warpgroup's wgmma where the target has it (sm_90a: Q, K and V tiles in the
// blocked layout of prefill/wgmma.cuh, P from registers), else each warp's mma.sync (the tiles in
// padded rows, fragments by ldmatrix); the accumulators have the same layout in both.
// Then the rows are normalised (sinks joining the denominator), written to shared memory as fp32,
// rotated back where V was rotated (FORMAT §6), and stored as bf16 with their log-denominators.
#pragma once

#include <cstdint>

#include "prefill/mma.cuh"
#include "prefill/phases.cuh"
#include "prefill/wgmma.cuh"

namespace fp8kturbov {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = 32 * kPrefillWarps;

template <int BITS, int HEAD_DIM>
struct PrefillTraits : PrefillTileTraits<BITS, HEAD_DIM> {
  using Tiles = PrefillTileTraits<BITS, HEAD_DIM>;
  static constexpr int kQueryRows = int(kPrefillQueryRows);
  static_assert(kQueryRows == 16 * kPrefillWarps, "16 rows per warp");
  static_assert(kPrefillThreads == Tiles::kCopyThreads, "the CTA copies and dequantizes");
  // Shared-memory rows of fp16 elements, padded by 16 bytes: the 8 rows of an ldmatrix matrix then
  // start in 8 different 16-byte bank groups.
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kOutputPitch = HEAD_DIM + 4;
  struct Shared {
    union {
      struct {
        alignas(16) __half q[kQueryRows][kPitch];
        alignas(16) __half k[Tiles::kKvTile][kPitch];
        alignas(16) __half v[Tiles::kKvTile][kPitch];
      } tiles;
      struct {  // the same tiles in wgmma's blocked layout (blocked_offset), where it runs
        alignas(128) uint8_t q[kQueryRows * HEAD_DIM * 2];
        alignas(128) uint8_t k[Tiles::kKvTile * HEAD_DIM * 2];
        alignas(128) uint8_t v[Tiles::kKvTile * HEAD_DIM * 2];
      } blocked;
      alignas(16) float o[kQueryRows][kOutputPitch];  // the epilogue's normalised rows
    };
    typename Tiles::Stage stages[2];
    PrefillLevelPairs<BITS, 1> level_pairs;  // one copy: three CTAs per SM leave no room for more
    float q_absmax[kPrefillWarps];
  };
};

template <int BITS, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(const PrefillArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using T = PrefillTraits<BITS, HEAD_DIM>;
  extern __shared__ __align__(16) uint8_t prefill_smem[];
  typename T::Shared& sh = *reinterpret_cast<typename T::Shared*>(prefill_smem);
  const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  PrefillWork w;
  if (!prefill_work<T::kQueryRows, T::kKvTile>(a, tid == 0, w)) return;  // CTA-uniform
  // The thread's two rows in the mma fragments: lane / 4 and lane / 4 + 8 of its warp's 16.
  const PrefillRow rows[2] = {prefill_row(a, w, int(warp) * 16 + int(lane) / 4),
                              prefill_row(a, w, int(warp) * 16 + int(lane) / 4 + 8)};

  // 1. copy: the first tile's bytes in flight while Q is loaded.
  const PrefillTileCopy<BITS, HEAD_DIM> copier(a, w, int(tid));
  if (w.num_tiles > 0) copier.copy(sh.stages[0], w.first_tile0, copier.page(w.first_tile0));
  int32_t next_page = copier.page(w.first_tile0 + T::kKvTile);  // the second tile's

  // ---- Q: the tile's rows into shared memory as fp16, scaled by a power of two ----------------------
  float q_absmax = query_warp_absmax<HEAD_DIM, kPrefillThreads>(a, w, 0, T::kQueryRows, int(tid));
  if (lane == 0) sh.q_absmax[warp] = q_absmax;
  fill_level_pairs<BITS, decltype(sh.level_pairs)::kCopies>(sh.level_pairs.words, int(tid), kPrefillThreads);
  __syncthreads();  // the warps' maxima and the level pairs are in
#pragma unroll
  for (int i = 0; i < kPrefillWarps; ++i) q_absmax = fmaxf(q_absmax, sh.q_absmax[i]);
  const float q_gain = query_gain(q_absmax);
  stage_query<HEAD_DIM, kPrefillThreads>(a, w, 0, T::kQueryRows, int(tid), q_gain, [&](int r, int c, uint4 chunk) {
    if constexpr (kPrefillWgmma)
      *reinterpret_cast<uint4*>(sh.blocked.q + blocked_offset<HEAD_DIM>(r, c * 8)) = chunk;
    else
      *reinterpret_cast<uint4*>(&sh.tiles.q[r][c * 8]) = chunk;
  });
  if constexpr (kPrefillWgmma) fence_shared_for_wgmma();  // the products read Q after the loop's barrier
  const PrefillScoreMap score_map(a, q_gain);

  float m[2] = {-INFINITY, -INFINITY};  // running maxima (log2 units)
  float l[2] = {0.0f, 0.0f};            // the thread's share of the denominators
  float o[T::kOutputTiles][4];
#pragma unroll
  for (int j = 0; j < T::kOutputTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  // (A loop over tile0 and range_end: counting tiles instead costs up to 13 more registers.)
  int stage = 0;
  for (int tile0 = w.first_tile0; tile0 < w.range_end; tile0 += T::kKvTile, stage ^= 1) {
    copy_async_wait<0>();
    __syncthreads();  // the stage has landed; every warp is done with the previous tile's rows
    if (tile0 + T::kKvTile < w.range_end) {
      copier.copy(sh.stages[stage ^ 1], tile0 + T::kKvTile, next_page);
      next_page = copier.page(tile0 + 2 * T::kKvTile);  // used a tile from now
    }

    // ---- 2. dequantize: the staged bytes into fp16 K and V rows ----------------------------------
    const typename T::Stage& st = sh.stages[stage];
    bool tile_ok = true;  // every position of the tile on a page inside the pools
#pragma unroll
    for (int i = int(tid); i < T::kKvTile * T::kGroups; i += kPrefillThreads) {
      int p = i / T::kGroups, g = i % T::kGroups;
      if constexpr (kPrefillWgmma) blocked_item<T::kGroups>(i, p, g);
      tile_ok = tile_ok && st.position_ok[p];
      uint32_t k_words[8], v_words[8];
      dequantize_group<BITS, HEAD_DIM>(st, sh.level_pairs, 0u, p, g, k_words, v_words);
      if constexpr (kPrefillWgmma) {
        store_blocked_group<HEAD_DIM>(sh.blocked.k, p, g, k_words);
        store_blocked_group<HEAD_DIM>(sh.blocked.v, p, g, v_words);
      } else {
        uint4* k_row = reinterpret_cast<uint4*>(&sh.tiles.k[p][g * kGroupElems]);
        uint4* v_row = reinterpret_cast<uint4*>(&sh.tiles.v[p][g * kGroupElems]);
        k_row[0] = make_uint4(k_words[0], k_words[1], k_words[2], k_words[3]);
        k_row[1] = make_uint4(k_words[4], k_words[5], k_words[6], k_words[7]);
        v_row[0] = make_uint4(v_words[0], v_words[1], v_words[2], v_words[3]);
        v_row[1] = make_uint4(v_words[4], v_words[5], v_words[6], v_words[7]);
      }
    }
    if constexpr (kPrefillWgmma) fence_shared_for_wgmma();  // the tiles, for the products' reads
    tile_ok = __syncthreads_and(tile_ok) != 0;
    const bool masked = tile_needs_mask<T::kKvTile>(tile_ok, rows, tile0);

    // ---- 3. scores: S = Q·Kᵀ for the warp's 16 rows ----------------------------------------------
    float s[T::kScoreTiles][4];
#pragma unroll
    for (int j = 0; j < T::kScoreTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    if constexpr (kPrefillWgmma) {
      // The warpgroup's 64 rows at once.
      wgmma_scores<T::kKvTile, HEAD_DIM>(s, shared_address(sh.blocked.q), shared_address(sh.blocked.k));
    } else {
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        uint32_t q_frag[4];
        load_matrices_x4<false>(q_frag, shared_address(&sh.tiles.q[warp * 16 + lane % 16][ks * 16 + (lane / 16) * 8]));
#pragma unroll
        for (int j = 0; j < T::kScoreTiles; j += 2) {
          uint32_t k_frag[4];  // n-tiles j and j + 1, each its two k halves
          load_matrices_x4<false>(
              k_frag, shared_address(&sh.tiles.k[j * 8 + (lane / 16) * 8 + lane % 8][ks * 16 + ((lane / 8) % 2) * 8]));
          mma_16x8x16(s[j], q_frag, k_frag[0], k_frag[1]);
          mma_16x8x16(s[j + 1], q_frag, k_frag[2], k_frag[3]);
        }
      }
    }

    // ---- 4. softmax: scale, soft-cap, mask, the online state --------------------------------------
    prefill_softmax(s, o, m, l, score_map, masked, st.position_ok, rows, tile0, lane);

    // ---- 5. values: O += P·V (P's accumulator fragments are the A fragments of 16 positions) ------
    if constexpr (kPrefillWgmma) {
      wgmma_values<HEAD_DIM>(o, s, shared_address(sh.blocked.v));  // done before the next tile's stores overwrite V
    } else {
#pragma unroll
      for (int kk = 0; kk < T::kKvTile / 16; ++kk) {
        uint32_t p_frag[4];
        weight_fragments(s, kk, p_frag);
#pragma unroll
        for (int j = 0; j < T::kOutputTiles; j += 2) {
          uint32_t v_frag[4];  // n-tiles j and j + 1, each its two k halves
          load_matrices_x4<true>(
              v_frag, shared_address(&sh.tiles.v[kk * 16 + ((lane / 8) % 2) * 8 + lane % 8][j * 8 + (lane / 16) * 8]));
          mma_16x8x16(o[j], p_frag, v_frag[0], v_frag[1]);
          mma_16x8x16(o[j + 1], p_frag, v_frag[2], v_frag[3]);
        }
      }
    }
  }

  // ---- Finish: normalised rows in shared memory, then the store --------------------------------------
  __syncthreads();  // every warp is done with the tiles: their space takes the fp32 rows
  finish_rows<HEAD_DIM, T::kOutputPitch>(a, w, o, m, l, rows, sh.o, int(warp) * 16, lane);
  __syncthreads();
  store_rows<HEAD_DIM, T::kOutputPitch, kPrefillThreads>(a, w, sh.o, 0, T::kQueryRows, int(tid));
#endif
}

}  // namespace fp8kturbov
