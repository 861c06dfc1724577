// The paged prefill kernel on sm_90a with its warpgroups specialised: one producer warpgroup copies
// each tile's raw bytes (cp.async) and dequantizes them into fp16 K and V tiles in wgmma's blocked
// layout, a ring of kBuffers of them; kConsumers consumer warpgroups, 64 query rows each, multiply
// them with wgmma (Q·Kᵀ from shared memory, P·V with P from registers) and keep the online softmax.
// The producer dequantizes tile t + 1 while the consumers multiply tile t, and one dequantized tile
// serves all kConsumers · 64 rows. The consumers take the tiles one at a time, or two per softmax
// step (kStepTiles) where the tiles come whole from an expanded context. The hand-over is by named
// barriers per buffer: FULL(b) (the producer arrives, the consumers wait) and EMPTY(b) (the
// consumers arrive, the producer waits).
// Each buffer's n-th FULL completes before its (n+1)-th arrival and each EMPTY likewise, since the
// other side must pass the one before. (compute-sanitizer's racecheck does not follow such
// bar.arrive → bar.sync hand-overs: it reports the same hazards for two warps that pass one buffer
// back and forth that way.)
// The work, copies, dequantization, softmax and finish are prefill/phases.cuh's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "decode/v_codes.cuh"  // LevelPairTable
#include "prefill/phases.cuh"
#include "prefill/wgmma.cuh"

namespace fp8kturbov {

// Tiles per step of the warp-specialised kernel for a launch (PrefillWsTraits::kStepTiles): one
// softmax over the scores of that many tiles, so that its fixed work (the row maxima's shuffles, the
// corrections, O's rescale, the barrier waits) is paid once for them. Two at head_dim 128 and 256
// over an expanded context, where that paid; the consumers then need 224 registers (240 at head_dim
// 256, whose two tiles' scores spill at 224), which leaves the producer too few to dequantize (it only
// copies there).
FP8KTURBOV_HOST_DEVICE constexpr int prefill_ws_step_tiles(int head_dim, bool expanded) {
  return head_dim >= 128 && expanded ? 2 : 1;
}

template <int BITS, int HEAD_DIM, int STEP_TILES>
struct PrefillWsTraits {
  using Base = PrefillTileTraits<BITS, HEAD_DIM>;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kQueryRows = 64 * kConsumers;
  static_assert(kQueryRows == int(kPrefillWsQueryRows), "the planner's tiles");
  static constexpr int kKvTile = Base::kKvTile;
  static constexpr int kGroups = Base::kGroups;
  static constexpr int kStepTiles = STEP_TILES;
  // Steps of several tiles read an expanded context only: their producer copies, never dequantizes.
  static constexpr bool kExpandedOnly = kStepTiles > 1;
  // With steps of one tile, a step's P·V is issued after the next step's Q·Kᵀ and runs beside that
  // step's weights; with steps of two, it is issued at the end of its step and left in flight across
  // the next step's barrier. Each paid only there.
  static constexpr bool kWeightsBesideValues = kStepTiles == 1;
  // The ring: the consumers hold two steps' tiles at a time (one step's P·V in flight while the next
  // one's scores are taken); with steps of one tile a third buffer lets the producer fill ahead.
  static constexpr int kBuffers = kStepTiles == 1 ? 3 : 2 * kStepTiles;
  // Registers per thread: kEntryRegisters at launch (ptxas gives a kernel with setmaxnreg all that
  // __launch_bounds__ allows), then the producer's work in fewer and the consumers' scores beside
  // their output rows in more, the producer's release paying. Below 224 the consumers of two-tile
  // steps have their wgmma serialised (ptxas C7512).
  static constexpr int kEntryRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kThreads * kEntryRegisters > 65536 / 2, "one CTA per SM, as prefill_ctas_per_sm assumes");
  static constexpr int kProducerRegisters = kStepTiles == 1 ? 88 : HEAD_DIM > 128 ? 24 : 56;
  static constexpr int kConsumerRegisters = kStepTiles == 1 ? 208 : HEAD_DIM > 128 ? 240 : 224;
  static_assert(128 * (kEntryRegisters - kProducerRegisters) == 128 * kConsumers * (kConsumerRegisters - kEntryRegisters),
                "the producer's release pays for the consumers' claims");
  static constexpr int kTileBytes = kKvTile * HEAD_DIM * 2;  // one fp16 K (or V) tile, blocked
  static constexpr int kOutputPitch = HEAD_DIM + 4;
  // An expanded tile's bytes that the producer copies: K, V and position_ok, a multiple of 16.
  static constexpr int kExpandedCopyBytes = 2 * kTileBytes + kKvTile;
  // A copy of the level pairs per producer lane where the table is small enough (decode/v_codes.cuh).
  static constexpr int kLevelPairCopies = LevelPairTable<BITS, HEAD_DIM>::kCopies;
  struct Tile {
    alignas(128) uint8_t k[kTileBytes];
    alignas(128) uint8_t v[kTileBytes];
    bool position_ok[kKvTile];
  };
  static_assert(sizeof(Tile) == prefill_expanded_tile_bytes(HEAD_DIM), "the planner's expanded tiles");
  static_assert(offsetof(Tile, position_ok) == 2 * kTileBytes && kExpandedCopyBytes % 16 == 0, "one bulk copy");
  struct Shared {
    union {
      struct {
        alignas(128) uint8_t q[kQueryRows * HEAD_DIM * 2];  // each consumer's 64 rows, blocked
        Tile tiles[kBuffers];
      } work;
      alignas(16) float o[kQueryRows][kOutputPitch];  // the epilogue's normalised rows
    };
    typename Base::Stage stages[2];
    uint64_t expanded_full[kBuffers];  // with an expanded context: each buffer's copy landed
    PrefillLevelPairs<BITS, kLevelPairCopies> level_pairs;
    float q_absmax[kConsumers][4];
  };
  // Named barriers (0 is __syncthreads).
  static constexpr int kProducerBarrier = 1;
  static constexpr int kConsumerBarrier = 2;                      // + consumer: its warpgroup
  static constexpr int kConsumersBarrier = kConsumerBarrier + kConsumers;  // all consumers
  static constexpr int kFullBarrier = kConsumersBarrier + 1;      // + buffer
  static constexpr int kEmptyBarrier = kFullBarrier + kBuffers;   // + buffer
  static_assert(kEmptyBarrier + kBuffers <= 16, "16 named barriers");
};

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// A warpgroup's registers per thread from here on (setmaxnreg): the producer gives some back to the
// CTA's pool, the consumers take them from it (and wait until they are there).
template <int REGISTERS>
__device__ __forceinline__ void release_registers() {
#if FP8KTURBOV_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
#endif
}
template <int REGISTERS>
__device__ __forceinline__ void claim_registers() {
#if FP8KTURBOV_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
#endif
}

template <int BITS, int HEAD_DIM, int STEP_TILES>
__global__ void __launch_bounds__(PrefillWsTraits<BITS, HEAD_DIM, STEP_TILES>::kThreads, 1)
    paged_prefill_ws_kernel(const PrefillArgs a) {
#if FP8KTURBOV_WGMMA
  using T = PrefillWsTraits<BITS, HEAD_DIM, STEP_TILES>;
  using B = typename T::Base;
  extern __shared__ __align__(128) uint8_t prefill_ws_smem[];
  typename T::Shared& sh = *reinterpret_cast<typename T::Shared*>(prefill_ws_smem);
  const uint32_t tid = threadIdx.x, role = tid / 128, wtid = tid % 128;  // role 0: the producer
  const uint32_t warp = wtid / 32, lane = tid % 32;

  PrefillWork w;
  if (!prefill_work<T::kQueryRows, T::kKvTile>(a, tid == 0, w)) return;  // CTA-uniform
  const bool expanded = T::kExpandedOnly || a.expanded_kv != nullptr;
  if (expanded) {
    if (tid == 0) {
      for (int b = 0; b < T::kBuffers; ++b) barrier_init(shared_address(&sh.expanded_full[b]));
      barrier_init_fence();
    }
  } else {
    fill_level_pairs<BITS, decltype(sh.level_pairs)::kCopies>(sh.level_pairs.words, int(tid), T::kThreads);
  }
  __syncthreads();  // the last CTA-wide barrier: the roles part here

  if (role == 0) {
    // ==== The producer: copies and dequantization =================================================
    release_registers<T::kProducerRegisters>();
    if (expanded) {
      // Each tile whole from the expanded context, by one thread's bulk copy.
      const uint8_t* const tiles = expanded_tile(a, w.seq, w.kv_head, 0);
      for (int t = 0; t < w.num_tiles; ++t) {
        const int buffer = t % T::kBuffers;
        if (t >= T::kBuffers) named_barrier_sync(T::kEmptyBarrier + buffer, T::kThreads);
        if (wtid == 0) {
          const uint32_t full = shared_address(&sh.expanded_full[buffer]);
          barrier_arrive_expecting(full, T::kExpandedCopyBytes);
          copy_bulk(shared_address(&sh.work.tiles[buffer]),
                    tiles + uint64_t(w.first_tile0 / T::kKvTile + t) * a.expanded_tile_bytes, T::kExpandedCopyBytes,
                    full);
        }
      }
      return;
    }
    const PrefillTileCopy<BITS, HEAD_DIM> copier(a, w, int(wtid));
    if (w.num_tiles > 0) copier.copy(sh.stages[0], w.first_tile0, copier.page(w.first_tile0));
    int32_t next_page = copier.page(w.first_tile0 + T::kKvTile);
    for (int t = 0; t < w.num_tiles; ++t) {
      const int tile0 = w.first_tile0 + t * T::kKvTile, stage = t & 1, buffer = t % T::kBuffers;
      copy_async_wait<0>();
      named_barrier_sync(T::kProducerBarrier, 128);  // the stage landed; the other one is free
      if (t + 1 < w.num_tiles) {
        copier.copy(sh.stages[stage ^ 1], tile0 + T::kKvTile, next_page);
        next_page = copier.page(tile0 + 2 * T::kKvTile);
      }
      // The consumers are done with tile t - kBuffers, the buffer's last tenant.
      if (t >= T::kBuffers) named_barrier_sync(T::kEmptyBarrier + buffer, T::kThreads);
      const typename B::Stage& st = sh.stages[stage];
      typename T::Tile& out = sh.work.tiles[buffer];
      dequantize_tile<BITS, HEAD_DIM, 128>(st, sh.level_pairs, int(wtid), out.k, out.v, out.position_ok);
      fence_shared_for_wgmma();  // the tiles, for the products' reads
      named_barrier_arrive(T::kFullBarrier + buffer, T::kThreads);
    }
    return;
  }

  // ==== A consumer: 64 rows, the products and the softmax =============================================
  claim_registers<T::kConsumerRegisters>();
  const int consumer = int(role) - 1;
  const int row_base = consumer * 64;  // its rows in the CTA's tile
  const int warp_row0 = row_base + int(warp) * 16;
  const int consumer_barrier = T::kConsumerBarrier + consumer;
  uint8_t* const q_tile = sh.work.q + consumer * 64 * HEAD_DIM * 2;
  const PrefillRow rows[2] = {prefill_row(a, w, warp_row0 + int(lane) / 4),
                              prefill_row(a, w, warp_row0 + int(lane) / 4 + 8)};

  // ---- Q: the consumer's rows, fp16 scaled by a power of two (its own gain) ---------------------------
  float q_absmax = query_warp_absmax<HEAD_DIM, 128>(a, w, row_base, 64, int(wtid));
  if (lane == 0) sh.q_absmax[consumer][warp] = q_absmax;
  named_barrier_sync(consumer_barrier, 128);
#pragma unroll
  for (int i = 0; i < 4; ++i) q_absmax = fmaxf(q_absmax, sh.q_absmax[consumer][i]);
  const float q_gain = query_gain(q_absmax);
  stage_query<HEAD_DIM, 128>(a, w, row_base, 64, int(wtid), q_gain, [&](int r, int c, uint4 chunk) {
    *reinterpret_cast<uint4*>(q_tile + blocked_offset<HEAD_DIM>(r - row_base, c * 8)) = chunk;
  });
  fence_shared_for_wgmma();
  named_barrier_sync(consumer_barrier, 128);  // Q complete before the warpgroup's products read it
  const PrefillScoreMap score_map(a, q_gain);

  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  float o[B::kOutputTiles][4];
#pragma unroll
  for (int j = 0; j < B::kOutputTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const uint32_t q_address = shared_address(q_tile);

  // Tile t's buffer is free for tile t + kBuffers, where the producer has one to put there.
  const auto release = [&](int t) {
    if (t + T::kBuffers < w.num_tiles) named_barrier_arrive(T::kEmptyBarrier + t % T::kBuffers, T::kThreads);
  };
  // A step's P·V is issued at its end and waited for with the next step's Q·Kᵀ; where the weights go
  // beside it, it is issued after that Q·Kᵀ instead, the scores alone are waited for, and the output
  // rows, which the product still holds, are rescaled once it is done. The first step has no P·V
  // before it, and the last may take fewer tiles: steps of their own, so that the loop's steps have
  // no branch around their products.
  constexpr int kStepWeights = T::kStepTiles * B::kScoreTiles / 2;
  uint32_t p[kStepWeights][4];  // the last step's weights: the A fragments of its P·V
  const auto tile_of = [&](int t) -> const typename T::Tile& { return sh.work.tiles[t % T::kBuffers]; };
  const auto issue_values = [&](int t, int tiles) {  // P·V of tiles t ... t + tiles - 1
    wgmma_fence_operands(o);
    wgmma_fence_operands(p);
#pragma unroll
    for (int i = 0; i < T::kStepTiles; ++i)
      if (i < tiles)
        issue_wgmma_values<HEAD_DIM>(o, reinterpret_cast<uint32_t(&)[B::kScoreTiles / 2][4]>(p[i * B::kScoreTiles / 2]),
                                     shared_address(tile_of(t + i).v));
  };
  // The step of tiles t ... t + kTiles - 1, after the step of tiles prev ... prev + prev_tiles - 1.
  const auto step = [&](int t, auto step_tiles, auto after_values, int prev, int prev_tiles) {
    constexpr int kTiles = decltype(step_tiles)::value;
    constexpr bool kAfterValues = decltype(after_values)::value;  // the previous step's P·V issued or to issue
    constexpr bool kBeside = kAfterValues && T::kWeightsBesideValues;
    const int tile0 = w.first_tile0 + t * T::kKvTile;
    bool tiles_ok = true;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int buffer = (t + i) % T::kBuffers;
      if (expanded)  // the producer's tile t + i
        barrier_wait(shared_address(&sh.expanded_full[buffer]), uint32_t((t + i) / T::kBuffers) & 1u);
      else
        named_barrier_sync(T::kFullBarrier + buffer, T::kThreads);
      tiles_ok = tile_positions_ok<T::kKvTile>(tile_of(t + i).position_ok, lane) && tiles_ok;
    }
    const bool masked = tile_needs_mask<kTiles * T::kKvTile>(tiles_ok, rows, tile0);
    // ---- scores: S = Q·Kᵀ, the warpgroup's 64 rows -------------------------------------------------
    float s[kTiles * B::kScoreTiles][4];
    wgmma_fence_operands(o);
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
      issue_wgmma_scores<T::kKvTile, HEAD_DIM>(reinterpret_cast<float(&)[B::kScoreTiles][4]>(s[i * B::kScoreTiles]),
                                               q_address, shared_address(tile_of(t + i).k));
    const auto release_previous = [&] {
      for (int i = 0; i < prev_tiles; ++i) release(prev + i);
    };
    if constexpr (kBeside) {
      issue_values(prev, prev_tiles);
      wgmma_wait<1>();  // the scores
    } else {
      wgmma_wait<0>();  // the scores and the previous step's P·V
      if constexpr (kAfterValues) release_previous();
    }
    wgmma_fence_operands(s);
    // ---- weights: the online softmax ---------------------------------------------------------------
    float correction[2];
    softmax_weights(s, m, l, correction, score_map, masked,
                    [&](int col) { return tile_of(t + col / T::kKvTile).position_ok[col % T::kKvTile]; }, rows,
                    tile0, lane);
    if constexpr (kBeside) {
      wgmma_wait<0>();  // the previous step's P·V
      release_previous();
    }
    wgmma_fence_operands(o);
    wgmma_fence_operands(p);
    rescale_rows(o, correction);
    weight_fragments(s, reinterpret_cast<uint32_t(&)[kTiles * B::kScoreTiles / 2][4]>(p));
    // ---- values: O += P·V, left in flight ----------------------------------------------------------
    if constexpr (!T::kWeightsBesideValues) issue_values(t, kTiles);
  };
  using One = std::integral_constant<int, 1>;
  using Full = std::integral_constant<int, T::kStepTiles>;
  if (w.num_tiles > 0) {
    int t = 0, prev_tiles = 0;
    if (w.num_tiles >= T::kStepTiles) {
      step(0, Full{}, std::false_type{}, 0, 0);
      prev_tiles = T::kStepTiles;
    } else {
      step(0, One{}, std::false_type{}, 0, 0);
      prev_tiles = 1;
    }
    for (t = prev_tiles; t + T::kStepTiles <= w.num_tiles; t += T::kStepTiles) {
      step(t, Full{}, std::true_type{}, t - prev_tiles, prev_tiles);
      prev_tiles = T::kStepTiles;
    }
    if constexpr (T::kStepTiles > 1) {
      for (; t < w.num_tiles; ++t) {  // the last tiles, fewer than a step
        step(t, One{}, std::true_type{}, t - prev_tiles, prev_tiles);
        prev_tiles = 1;
      }
    }
    if constexpr (T::kWeightsBesideValues) issue_values(t - prev_tiles, prev_tiles);
    wgmma_wait<0>();  // the last step's P·V
    wgmma_fence_operands(o);
  }

  // ---- Finish: normalised rows in shared memory, then the store -----------------------------------------
  named_barrier_sync(T::kConsumersBarrier, 128 * T::kConsumers);  // every consumer is done with the tiles
  finish_rows<HEAD_DIM, T::kOutputPitch>(a, w, o, m, l, rows, sh.o, warp_row0, lane);
  named_barrier_sync(consumer_barrier, 128);  // the warpgroup's rows are in
  store_rows<HEAD_DIM, T::kOutputPitch, 128>(a, w, sh.o, row_base, 64, int(wtid));
#endif
}

}  // namespace fp8kturbov
