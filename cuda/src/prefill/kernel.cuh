// The paged prefill kernel: chunks of query tokens attend their cached prefix and themselves
// (causal), on tensor cores, with K and V dequantized in shared memory as each tile of positions
// arrives.
//
// A CTA takes kQueryRows query rows of one sequence's chunk and one KV head: rows are (token, query
// head of the KV head's group) pairs, token-major, so that the heads of a group share every K and
// V tile the CTA dequantizes. Each of its warps holds 16 rows. The query is held as fp16 scaled by
// a power of two (its largest magnitude below 2^15; the factor is undone in the score scale), so
// that K's E4M3 bytes convert exactly with the hardware's pair conversion. Per tile of kKvTile
// positions:
//   1. copy: the next tile's raw bytes (K, V codes, V scales) into the other of two staging
//      buffers (cp.async), in flight while this tile is worked on;
//   2. dequantize: this tile's staged bytes into fp16 K and V rows (V = level[code]·scale);
//   3. scores: S = Q·Kᵀ (fp16 mma, fp32 accumulators), scaled, soft-capped, masked;
//   4. softmax: the online softmax state of each row (running max in log2 units, denominator);
//   5. values: O += P·V (P in [0, 1] and every V value lie in fp16's normal range).
// Then the rows are normalised (sinks joining the denominator), written to shared memory as fp32,
// rotated back where V was rotated (FORMAT §6), and stored as bf16 with their log-denominators.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "decode/ptx.cuh"
#include "decode/ranges.cuh"
#include "decode/traits.cuh"  // kLog2e
#include "format.cuh"
#include "kernel_args.h"
#include "prefill/mma.cuh"
#include "reshape_and_cache.cuh"  // load_codebook

namespace fp8kturbov {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = 32 * kPrefillWarps;

template <int BITS, int HEAD_DIM>
struct PrefillTraits {
  static constexpr int kQueryRows = int(kPrefillQueryRows);
  static_assert(kQueryRows == 16 * kPrefillWarps, "16 rows per warp");
  static constexpr int kKvTile = int(prefill_kv_tile(HEAD_DIM));  // positions per tile (the planner's)
  // Shared-memory rows of fp16 elements, padded by 16 bytes: the 8 rows of an ldmatrix matrix then
  // start in 8 different 16-byte bank groups.
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kScoreTiles = kKvTile / 8;   // n-tiles of a warp's scores
  static constexpr int kOutputTiles = HEAD_DIM / 8;  // n-tiles of a warp's output rows
  static constexpr int kGroups = HEAD_DIM / kGroupElems;
  // A position's staged bytes, copied in 16-byte (K) and 4-byte (V codes, V scales) pieces: the
  // pools' validated alignment (FORMAT §3: a head's codes and scales start at multiples of 4).
  static constexpr int kCodeBytes = HEAD_DIM * BITS / 8;
  static constexpr int kScaleBytes = HEAD_DIM / kGroupElems;
  static constexpr int kPieces = HEAD_DIM / 16 + kCodeBytes / 4 + kScaleBytes / 4;
  static_assert(kPrefillThreads % kKvTile == 0, "whole threads per position");
  struct Stage {
    alignas(16) uint8_t k[kKvTile][HEAD_DIM];
    alignas(16) uint8_t codes[kKvTile][kCodeBytes];
    alignas(16) uint8_t scales[kKvTile][kScaleBytes];
    bool position_ok[kKvTile];
  };
  struct Shared {
    union {
      struct {
        alignas(16) __half q[kQueryRows][kPitch];
        alignas(16) __half k[kKvTile][kPitch];
        alignas(16) __half v[kKvTile][kPitch];
      } tiles;
      alignas(16) float o[kQueryRows][HEAD_DIM + 4];  // the epilogue's normalised rows
    };
    Stage stages[2];
    CodebookTable<BITS> codebook;
    float q_absmax[kPrefillWarps];
  };
};

// A warp's row of the CTA's tile: where its query token lies and which positions it attends.
struct PrefillRow {
  int token;  // in the chunk; >= q_len: no row (padding of the last tile)
  int head;   // query head
  int begin;  // attends positions [begin, end)
  int end;
};

template <int BITS, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(const PrefillArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using T = PrefillTraits<BITS, HEAD_DIM>;
  extern __shared__ __align__(16) uint8_t prefill_smem[];
  typename T::Shared& sh = *reinterpret_cast<typename T::Shared*>(prefill_smem);

  const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint32_t seq = blockIdx.x / a.tiles_per_seq;
  const uint32_t tile = blockIdx.x % a.tiles_per_seq;
  const uint32_t kv_head = blockIdx.y;
  const bool reports = a.index_check.enabled() && tile == 0 && kv_head == 0 && tid == 0;

  // ---- The work: the tile's rows of the sequence's chunk -----------------------------------------
  uint32_t row0;
  int q_len;
  if (!sequence_query_rows(a, seq, row0, q_len)) {  // CTA-uniform
    if (reports) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
    return;
  }
  const int group = int(a.group_size);
  const int first_flat = int(tile) * T::kQueryRows;  // (token, head) pairs, token-major
  if (first_flat >= q_len * group) return;
  const int given_seq_len = __ldg(a.seq_lens + seq);
  const int seq_len = clamped_seq_len(a, given_seq_len);
  if (reports && seq_len != given_seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SEQ_LEN);
  if (reports && q_len > seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
  auto row_of = [&](int r) {
    PrefillRow row;
    const int flat = first_flat + r;
    row.token = flat / group;
    row.head = int(kv_head) * group + flat % group;
    row.end = row.token < q_len ? max(seq_len - q_len + row.token + 1, 0) : 0;
    row.begin = window_start(a, row.end);
    return row;
  };
  const int last_r = min(T::kQueryRows, q_len * group - first_flat) - 1;
  // The positions the CTA reads: its rows' ranges (which grow with the token) within its split's.
  const int64_t split_begin = int64_t(blockIdx.z) * a.split_positions;
  const int range_begin = int(max(int64_t(row_of(0).begin), split_begin));
  const int range_end = int(min(int64_t(row_of(last_r).end), split_begin + a.split_positions));
  // The thread's two rows in the mma fragments: lane / 4 and lane / 4 + 8 of its warp's 16.
  const PrefillRow rows[2] = {row_of(int(warp) * 16 + int(lane) / 4), row_of(int(warp) * 16 + int(lane) / 4 + 8)};

  const int32_t* table = a.block_tables + uint64_t(seq) * a.block_tables_stride;
  const uint64_t row_code_bytes = uint64_t(a.num_kv_heads) * T::kCodeBytes;
  const uint64_t row_scale_bytes = uint64_t(a.num_kv_heads) * T::kScaleBytes;
  // 1. copy: the raw bytes of the tile at `tile0` into stage `s` (zeros, and not ok, for positions
  // outside [range_begin, range_end) or on pages checked mode finds outside the pools). The
  // kThreadsPerPosition threads of a position copy its pieces; `page` is its page id, which
  // `tile_page` loaded a tile earlier, so that the copies do not wait for the table.
  constexpr int kThreadsPerPosition = kPrefillThreads / T::kKvTile;
  const int thread_pos = int(tid) / kThreadsPerPosition, thread_part = int(tid) % kThreadsPerPosition;
  auto tile_page = [&](int tile0) -> int32_t {
    const int pos = tile0 + thread_pos;
    if (pos < range_begin || pos >= range_end) return 0;
    uint32_t block = 0, offset = 0;
    split_position(a, uint32_t(pos), block, offset);
    return __ldg(table + block);
  };
  auto copy_tile = [&](int s, int tile0, int32_t page) {
    typename T::Stage& stage = sh.stages[s];
    const int p = thread_pos, part = thread_part;
    const int pos = tile0 + p;
    bool ok = pos >= range_begin && pos < range_end;
    uint32_t block = 0, offset = 0;
    if (ok) {
      split_position(a, uint32_t(pos), block, offset);
      if (a.index_check.enabled() && a.index_check.page_out_of_range(page)) {
        ok = false;
        if (part == 0) a.index_check.report(FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE);
      }
    }
    if (!ok) page = 0;
    if (part == 0) stage.position_ok[p] = ok;
    const uint8_t* k_row = a.k_cache + uint64_t(page) * a.k_block_stride_bytes +
                           (uint64_t(offset) * a.num_kv_heads + kv_head) * HEAD_DIM;
    const uint8_t* v_page = a.v_cache + uint64_t(page) * a.v_block_stride_bytes;
    const uint8_t* code_row = v_page + offset * row_code_bytes + kv_head * T::kCodeBytes;
    const uint8_t* scale_row = v_page + a.v_data_section_bytes + offset * row_scale_bytes + kv_head * T::kScaleBytes;
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
  };
  const int first_tile0 = range_begin & ~(T::kKvTile - 1);
  if (first_tile0 < range_end) copy_tile(0, first_tile0, tile_page(first_tile0));
  int32_t next_page = tile_page(first_tile0 + T::kKvTile);  // the second tile's

  // ---- Q: the tile's rows into shared memory as fp16, scaled by a power of two ----------------------
  constexpr int kChunks = HEAD_DIM / 8;  // 8-element chunks of a head row
  auto q_chunk = [&](int i, float (&x)[8]) {
    const int r = i / kChunks, c = i % kChunks;
    const PrefillRow row = row_of(r);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = 0.0f;
    if (row.token >= q_len) return;
    const uint16_t* src = a.q + uint64_t(row0 + uint32_t(row.token)) * a.q_stride + uint64_t(row.head) * HEAD_DIM + c * 8;
    uint16_t e[8];
    if (a.q_vector_loads) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(src));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) e[j] = uint16_t(words[j / 2] >> (16 * (j % 2)));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) e[j] = __ldg(src + j);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = __bfloat162float(__ushort_as_bfloat16(e[j]));
  };
  // Non-finite elements do not take part in the gain: an Inf or NaN stays in its own row.
  float q_absmax = 0.0f;
  for (int i = int(tid); i < T::kQueryRows * kChunks; i += kPrefillThreads) {
    float x[8];
    q_chunk(i, x);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (fabsf(x[j]) <= FLT_MAX) q_absmax = fmaxf(q_absmax, fabsf(x[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) q_absmax = fmaxf(q_absmax, __shfl_xor_sync(0xffffffffu, q_absmax, o));
  if (lane == 0) sh.q_absmax[warp] = q_absmax;
  load_codebook<BITS>(sh.codebook);  // a CTA barrier: the warps' maxima are in
#pragma unroll
  for (int w = 0; w < kPrefillWarps; ++w) q_absmax = fmaxf(q_absmax, sh.q_absmax[w]);
  int q_exp = 0;
  if (q_absmax > 0.0f) frexpf(q_absmax, &q_exp);  // q_absmax < 2^q_exp
  q_exp = max(q_exp, 15 - 127);  // the gain stays a finite float even for subnormal queries
  const float q_gain = ldexpf(1.0f, 15 - q_exp);
  for (int i = int(tid); i < T::kQueryRows * kChunks; i += kPrefillThreads) {
    float x[8];
    q_chunk(i, x);
    const uint4 h = make_uint4(half2_bits(x[0] * q_gain, x[1] * q_gain), half2_bits(x[2] * q_gain, x[3] * q_gain),
                               half2_bits(x[4] * q_gain, x[5] * q_gain), half2_bits(x[6] * q_gain, x[7] * q_gain));
    *reinterpret_cast<uint4*>(&sh.tiles.q[i / kChunks][(i % kChunks) * 8]) = h;
  }
  const float score_scale = a.score_scale / q_gain;  // a power of two: exact
  // A score in log2 units (exp2f below) is s·outer, or outer·tanh(s·inner) under a soft cap.
  const bool capped = a.soft_cap > 0.0f;
  const float outer = (capped ? a.soft_cap : score_scale) * kLog2e;
  const float inner = capped ? score_scale / a.soft_cap : 1.0f;

  float m[2] = {-INFINITY, -INFINITY};  // running maxima (log2 units)
  float l[2] = {0.0f, 0.0f};            // the thread's share of the denominators
  float o[T::kOutputTiles][4];
#pragma unroll
  for (int j = 0; j < T::kOutputTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  int stage = 0;
  for (int tile0 = first_tile0; tile0 < range_end; tile0 += T::kKvTile, stage ^= 1) {
    copy_async_wait<0>();
    __syncthreads();  // the stage has landed; every warp is done with the previous tile's rows
    if (tile0 + T::kKvTile < range_end) {
      copy_tile(stage ^ 1, tile0 + T::kKvTile, next_page);
      next_page = tile_page(tile0 + 2 * T::kKvTile);  // used a tile from now
    }

    // ---- 2. dequantize: the staged bytes into fp16 K and V rows ----------------------------------
    const typename T::Stage& st = sh.stages[stage];
    bool tile_ok = true;  // every position of the tile attended by some row (no page masked)
    static_assert(T::kKvTile * T::kGroups % kPrefillThreads == 0, "whole groups per thread");
#pragma unroll
    for (int i = int(tid); i < T::kKvTile * T::kGroups; i += kPrefillThreads) {
      const int p = i / T::kGroups, g = i % T::kGroups;
      tile_ok = tile_ok && st.position_ok[p];
      const uint4 kb = *reinterpret_cast<const uint4*>(&st.k[p][g * kGroupElems]);
      uint32_t k_words[8];
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
      const float scale = e4m3_decode(st.scales[p][g]);
      uint32_t v_words[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float lo = sh.codebook.levels[(codes >> (BITS * 2 * j)) & ((1u << BITS) - 1)];
        const float hi = sh.codebook.levels[(codes >> (BITS * (2 * j + 1))) & ((1u << BITS) - 1)];
        v_words[j] = half2_bits(__fmul_rn(lo, scale), __fmul_rn(hi, scale));
      }
      uint4* k_dst = reinterpret_cast<uint4*>(&sh.tiles.k[p][g * kGroupElems]);
      uint4* v_dst = reinterpret_cast<uint4*>(&sh.tiles.v[p][g * kGroupElems]);
      k_dst[0] = make_uint4(k_words[0], k_words[1], k_words[2], k_words[3]);
      k_dst[1] = make_uint4(k_words[4], k_words[5], k_words[6], k_words[7]);
      v_dst[0] = make_uint4(v_words[0], v_words[1], v_words[2], v_words[3]);
      v_dst[1] = make_uint4(v_words[4], v_words[5], v_words[6], v_words[7]);
    }
    tile_ok = __syncthreads_and(tile_ok) != 0;
    // A warp whose rows all attend the whole tile needs no mask.
    const bool masked = !tile_ok || !__all_sync(0xffffffffu, rows[0].begin <= tile0 && rows[1].begin <= tile0 &&
                                                                  rows[0].end >= tile0 + T::kKvTile &&
                                                                  rows[1].end >= tile0 + T::kKvTile);

    // ---- 3. scores: S = Q·Kᵀ for the warp's 16 rows ----------------------------------------------
    float s[T::kScoreTiles][4];
#pragma unroll
    for (int j = 0; j < T::kScoreTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
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

    // ---- 4. softmax: scale, soft-cap, mask, the online state --------------------------------------
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < T::kScoreTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = capped ? outer * tanhf(s[j][e] * inner) : s[j][e] * outer;
        if (masked) {
          const int col = j * 8 + 2 * int(lane % 4) + (e & 1);
          const PrefillRow& row = rows[e / 2];
          const int pos = tile0 + col;
          if (!(st.position_ok[col] && pos >= row.begin && pos < row.end)) x = -INFINITY;
        }
        s[j][e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(m[h], tile_max[h]);
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // no position yet: every weight is 0
      correction[h] = exp2f(m[h] - base);
      m[h] = m_new;
      l[h] *= correction[h];
#pragma unroll
      for (int j = 0; j < T::kScoreTiles; ++j) {
        s[j][2 * h] = exp2f(s[j][2 * h] - base);
        s[j][2 * h + 1] = exp2f(s[j][2 * h + 1] - base);
        l[h] += s[j][2 * h] + s[j][2 * h + 1];
      }
    }
#pragma unroll
    for (int j = 0; j < T::kOutputTiles; ++j) {
      o[j][0] *= correction[0];
      o[j][1] *= correction[0];
      o[j][2] *= correction[1];
      o[j][3] *= correction[1];
    }

    // ---- 5. values: O += P·V (P's accumulator fragments are the A fragments of 16 positions) ------
#pragma unroll
    for (int kk = 0; kk < T::kKvTile / 16; ++kk) {
      const uint32_t p_frag[4] = {half2_bits(s[2 * kk][0], s[2 * kk][1]), half2_bits(s[2 * kk][2], s[2 * kk][3]),
                                  half2_bits(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  half2_bits(s[2 * kk + 1][2], s[2 * kk + 1][3])};
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

  // ---- Finish: denominators (sinks join them, unless the merge adds them), normalised rows --------
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
    row_scale[h] = l[h] > 0.0f ? weight / l[h] : 0.0f;
    lse[h] = l[h] > 0.0f ? (m[h] + log2f(l[h])) * 0.6931471805599453f : -INFINITY;
  }
  __syncthreads();  // every warp is done with the tiles: their space takes the fp32 rows
#pragma unroll
  for (int j = 0; j < T::kOutputTiles; ++j) {
    const int col = j * 8 + 2 * int(lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* dst = &sh.o[warp * 16 + lane / 4 + 8 * h][col];
      dst[0] = o[j][2 * h] * row_scale[h];
      dst[1] = o[j][2 * h + 1] * row_scale[h];
    }
  }
  // Row r's place in the output (and, with splits, in this split's partials).
  auto output_row = [&](const PrefillRow& row) {
    return uint64_t(row0 + uint32_t(row.token)) * a.num_q_heads + uint32_t(row.head);
  };
  const uint64_t split_rows = uint64_t(blockIdx.z) * a.num_query_rows * a.num_q_heads;
  float* const lse_out = split ? a.partial_lse + split_rows : a.lse;
  if (lse_out != nullptr && lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (rows[h].token < q_len) lse_out[output_row(rows[h])] = lse[h];
  }
  if constexpr (kRotatableHeadDim<HEAD_DIM>) {
    if (a.rotated_v && !split) {  // FORMAT §6: attention is linear in V, so the rows are rotated back
      // (Partials stay rotated: the merge rotates their combination back.)
      __syncwarp();
      for (int r = int(warp) * 16; r < int(warp) * 16 + 16; ++r) unrotate_row<HEAD_DIM>(sh.o[r], lane);
    }
  }
  __syncthreads();

  // ---- Store: bf16 rows (fp32 partials with splits), 8 elements per thread and step ----------------
  for (int i = int(tid); i < T::kQueryRows * kChunks; i += kPrefillThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const PrefillRow row = row_of(r);
    if (row.token >= q_len) continue;
    const float* src = &sh.o[r][c * 8];
    if (split) {
      float4* dst = reinterpret_cast<float4*>(a.partial_o + (split_rows + output_row(row)) * HEAD_DIM + c * 8);
      dst[0] = make_float4(src[0], src[1], src[2], src[3]);
      dst[1] = make_float4(src[4], src[5], src[6], src[7]);
      continue;
    }
    const uint4 chunk = make_uint4(bf16x2_bits(src[0], src[1]), bf16x2_bits(src[2], src[3]), bf16x2_bits(src[4], src[5]),
                                   bf16x2_bits(src[6], src[7]));
    uint16_t* dst = a.output + output_row(row) * HEAD_DIM + c * 8;
    if (a.output_vector_stores) {
      *reinterpret_cast<uint4*>(dst) = chunk;
    } else {
      const uint32_t w[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = uint16_t(w[j / 2] >> (16 * (j % 2)));
    }
  }
#endif
}

}  // namespace fp8kturbov
