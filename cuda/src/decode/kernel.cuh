// Paged decode attention over the fp8k_turbo{2,3,4}v cache (FORMAT §5), on tensor cores.
//
// Work split. A CTA handles one (sequence, KV head, chunk of up to 8 query columns, context
// split), a column being one query head of the KV head's GQA group for one query token of the
// sequence (one token, or up to 16 in multi-token decode; token-major, so that the tokens of a
// small group share a CTA and its reads). The context split (flash-decoding) lets a few long
// sequences fill the GPU: each split writes an unnormalised partial (O, running max, denominator)
// to the caller's workspace and the merge kernel (decode/merge.cuh) combines them in a fixed
// order, so results are deterministic for a plan.
//
// Inside a CTA, 4 warps each own a d-slice of up to 128 elements and a stream of 16-token tiles
// (decode/pipeline.cuh); with head_dim > 128 several warps share one stream and sum their partial
// scores. Head groups (DecodeVariant::kHeadGroups): the 4 CTAs of a group of 4 KV heads each take
// one stream of the split instead, and their warps the group's heads, so that a CTA reads the
// neighbouring heads' pieces of the same token rows together; each warp then writes its head's
// partial.
//
// Compute. Per tile a warp computes S^T = K · Q^T (mma m16n8k16, tokens × heads) from FP8 bytes
// converted to fp16, the online softmax in fp32 (decode/softmax_state.cuh), and O^T += V^T · P^T
// (d × heads) from codes looked up in a level table and scaled per 16-element group. Any
// permutation of the reduction index of an mma is free, so each thread reads whole 16-byte chunks
// of K rows and contiguous code bytes of V rows, and the query is laid out in shared memory to
// match.
//
// The kernel runs in three phases: the prologue (the CTA's work: sequence, split, columns, the
// query in shared memory, the attended range), the tile loop, and the epilogue (the streams merged
// and the output or the split's partial written).
#pragma once

#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "decode/decode_args.h"
#include "decode/pipeline.cuh"
#include "decode/ptx.cuh"
#include "decode/schedule.cuh"
#include "decode/softmax_state.cuh"
#include "decode/traits.cuh"
#include "decode/v_codes.cuh"
#include "decode/variants.cuh"
#include "format.cuh"

namespace fp8kturbov {

// What a CTA computes, found by the prologue.
template <bool MULTI_TOKEN>
struct CtaWork {
  uint32_t seq, split;
  SplitShare share;
  bool reports;  // the CTA that reports the sequence's index errors (checked mode)
  // This warp's KV head, the first of the CTA's (head groups), its token stream and d-slice.
  uint32_t first_kv_head, kv_head;
  int stream, slice_d0;
  // The sequence's query rows, and this CTA's columns first_column + c for c < num_columns.
  uint32_t row0;
  int q_len;
  uint32_t group_size;
  int first_column, num_columns;
  // The attended positions: the sequence's clamped length, the CTA's range (the union of its
  // columns' ranges, cut to its split), the split's first position.
  int seq_len, range_begin, range_end;
  int64_t split_begin;
  bool columns_masked;  // its columns attend different ranges (several query tokens)

  // Column c's query token (token-major columns) and query head.
  __device__ __forceinline__ uint32_t column_token(int c) const {
    return MULTI_TOKEN ? uint32_t(first_column + c) / group_size : 0u;
  }
  __device__ __forceinline__ uint32_t column_head(int c) const {
    return kv_head * group_size + (MULTI_TOKEN ? uint32_t(first_column + c) % group_size : uint32_t(first_column + c));
  }
  // FORMAT §5: column c attends positions [window_start(end), end), end = seq_len - q_len + token
  // + 1 (causal inside the query chunk; seq_len for one token).
  __device__ __forceinline__ int column_end(int c) const { return max(seq_len - q_len + int(column_token(c)) + 1, 0); }
};

// The shared memory of a CTA: the dynamic buffer (DecodeSmem's layout) and the kernel's static arrays.
template <int BITS, int HEAD_DIM, bool GROUPED>
struct DecodeShared {
  using S = DecodeShape<BITS, HEAD_DIM>;
  using L = DecodeSmem<BITS, HEAD_DIM, GROUPED>;
  uint8_t* smem;
  __half (*q)[L::kQRowElems];  // [L::kQRows] the fp16 query chunk
  float (*o)[kHeadsPerCta][HEAD_DIM];  // per stream: O, in the ring after the loop
  float (*max)[kHeadsPerCta];      // per stream
  float (*denom)[kHeadsPerCta];    // per stream
  float (*stream_weight)[kHeadsPerCta];  // the epilogue's merge over the streams
  float* column_max;
  float* column_denom;
  float4 (*score)[kDecodeWarps][S::kSlices > 1 ? 32 : 1];  // the slices' score exchange
  // The fp16 levels of every pair of codes (a | b << BITS -> low half level[a], high level[b]), in
  // LevelPairTable's copies.
  uint32_t* level_pairs;
  float* q_absmax;  // per warp
  StreamSmem stream;
};

template <int BITS, int HEAD_DIM, int CODE_COPY, class Variant>
struct DecodeKernel {
  using S = DecodeShape<BITS, HEAD_DIM>;
  static constexpr bool kGrouped = Variant::kHeadGroups;
  static constexpr bool kMultiToken = Variant::kMultiToken;
  using L = DecodeSmem<BITS, HEAD_DIM, kGrouped>;
  using Shared = DecodeShared<BITS, HEAD_DIM, kGrouped>;
  using Work = CtaWork<kMultiToken>;
  using LevelPairs = LevelPairTable<BITS, HEAD_DIM>;
  using Rows = MmaRows<S::kKRowBytes == 128>;
  static_assert(Variant::built(BITS, HEAD_DIM), "an instance of the table in decode/instances.cuh");

  // ---- Prologue --------------------------------------------------------------------------------

  // The CTA's sequence, split, heads and columns; false where it has nothing to do (an idle split
  // slot, a sequence skipped for its query_start, a chunk beyond its query tokens: CTA-uniform).
  __device__ __forceinline__ static bool find_work(const DecodeArgs& a, const DecodePlan& plan, const Shared& sh, int warp, Work& w) {
    // CTA order: the chunks and KV heads of one (sequence, split) are neighbours, so the CTAs that
    // read the same token rows of the pools run side by side and share their DRAM pages and sectors.
    const uint32_t chunk = blockIdx.x % plan.chunks_per_group;
    const uint32_t cta_head = blockIdx.x / plan.chunks_per_group % a.num_kv_heads;
    const uint32_t slot = blockIdx.x / plan.chunks_per_group / a.num_kv_heads;  // its split slot
    // The shares are found in the query's shared memory, which the query fills only after them:
    // static shared memory of their own cost some shapes a CTA per multiprocessor (head_dim 64).
    static_assert(L::kQBytes >= kDecodeWarps * sizeof(uint32_t) + sizeof(SplitShare), "room for the shares");
    uint32_t* const share_scratch = reinterpret_cast<uint32_t*>(sh.smem + L::kQOffset);
    SplitShare& share_s = *reinterpret_cast<SplitShare*>(sh.smem + L::kQOffset + kDecodeWarps * sizeof(uint32_t));
    const bool length_shares = Variant::length_shares(plan);
    w.share = length_shares ? split_share<kDecodeThreads, true>(a, plan, slot, share_scratch, share_s)
                            : SplitShare{slot / plan.num_splits, slot / plan.num_splits * plan.num_splits, plan.num_splits, 0};
    if (w.share.count == 0) return false;  // an idle slot
    w.seq = w.share.seq;
    w.split = slot - w.share.first;
    // Issued first: the CTA's range waits on it. The shares' search has read it already.
    w.seq_len = length_shares ? w.share.seq_len : a.seq_lens[w.seq];  // as given, clamped in attended_range
    w.reports = a.index_check.enabled() && threadIdx.x == 0 && chunk == 0 && cta_head == 0 && w.split == 0;
    // Head groups: the kDecodeWarps CTAs of a group (cta_head over its heads) each take one token
    // stream of the split, and their warps the group's heads.
    w.first_kv_head = kGrouped ? cta_head / S::kStreams * S::kStreams : cta_head;
    w.kv_head = kGrouped ? w.first_kv_head + uint32_t(warp) : cta_head;
    w.stream = kGrouped ? int(cta_head % S::kStreams) : warp / S::kSlices;
    w.slice_d0 = warp % S::kSlices * S::kSliceDim;
    w.row0 = w.seq;
    w.q_len = 1;
    if (kMultiToken && !sequence_query_rows(a, w.seq, w.row0, w.q_len)) {
      if (w.reports) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
      return false;
    }
    w.group_size = a.num_q_heads / a.num_kv_heads;
    w.first_column = int(chunk) * kHeadsPerCta;
    w.num_columns = min(kHeadsPerCta, w.q_len * int(w.group_size) - w.first_column);
    return w.num_columns > 0;  // a sequence with fewer query tokens than the grid is sized for
  }

  // The query chunk to fp16 in sh.q, scaled by a power of two so that its largest finite magnitude
  // fits fp16's range; returns the factor, which the score scale undoes (exact). Non-finite
  // elements do not take part, so an Inf or NaN stays in its own head (RELIABILITY.md §4.3).
  // q_at(i): element i = c·HEAD_DIM + d of the chunk, column c, dimension d; with head groups
  // element (k·num_columns + c)·HEAD_DIM + d is column c of the group's k-th KV head, held in q
  // row k·kHeadsPerCta + c.
  template <typename QAt>
  __device__ __forceinline__ static float load_query_with(const Shared& sh, int num_columns, int warp, int lane, QAt q_at) {
    const int tid = threadIdx.x;
    float q_absmax = 0.0f;
    for (int i = tid; i < L::kKvHeads * num_columns * HEAD_DIM; i += kDecodeThreads) {
      const float magnitude = fabsf(__bfloat162float(__ushort_as_bfloat16(q_at(i))));
      if (magnitude <= FLT_MAX) q_absmax = fmaxf(q_absmax, magnitude);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q_absmax = fmaxf(q_absmax, __shfl_xor_sync(0xffffffffu, q_absmax, o));
    if (lane == 0) sh.q_absmax[warp] = q_absmax;
    __syncthreads();
    q_absmax = fmaxf(fmaxf(sh.q_absmax[0], sh.q_absmax[1]), fmaxf(sh.q_absmax[2], sh.q_absmax[3]));
    int q_exp = 0;
    if (q_absmax > 0.0f) frexpf(q_absmax, &q_exp);  // q_absmax < 2^q_exp
    q_exp = max(q_exp, 15 - 127);  // the gain stays a finite float even for subnormal queries
    const float gain = ldexpf(1.0f, 15 - q_exp);
    for (int i = tid; i < L::kQRows * HEAD_DIM; i += kDecodeThreads) {
      const int h = i / HEAD_DIM;
      const int column = kGrouped ? h % kHeadsPerCta : h;
      const int element = kGrouped ? (h / kHeadsPerCta * num_columns + column) * HEAD_DIM + i % HEAD_DIM : i;
      const float v = column < num_columns ? __bfloat162float(__ushort_as_bfloat16(q_at(element))) : 0.0f;
      sh.q[h][i % HEAD_DIM] = __float2half_rn(v * gain);
    }
    return gain;
  }

  // One query token: the chunk's heads are consecutive in its q row (with head groups, whose KV
  // heads have one chunk each, the group's heads too), so the loads are one strided stream that
  // the compiler batches (in flight together); several tokens: per column. The query is loaded
  // before anything waits on seq_lens, so that the two loads' latencies overlap.
  __device__ __forceinline__ static float load_query(const DecodeArgs& a, const Shared& sh, const Work& w, int warp, int lane) {
    if constexpr (kMultiToken) {
      return load_query_with(sh, w.num_columns, warp, lane, [&](int i) {
        const int c = i / HEAD_DIM;
        return a.q[uint64_t(w.row0 + w.column_token(c)) * a.q_stride + uint64_t(w.column_head(c)) * HEAD_DIM + i % HEAD_DIM];
      });
    } else {
      const uint32_t first_q_head = kGrouped ? w.first_kv_head * w.group_size : w.column_head(0);
      const uint16_t* q_row = a.q + uint64_t(w.row0) * a.q_stride + uint64_t(first_q_head) * HEAD_DIM;
      return load_query_with(sh, w.num_columns, warp, lane, [&](int i) { return q_row[i]; });
    }
  }

  // The CTA's range: its columns' ranges together, the splits of its sequence's share dividing the
  // range's tiles evenly, in whole tiles per token stream. Tiles sit on absolute multiples of 16
  // positions (so that with block_size % 16 == 0 a tile lies in one page); rows outside
  // [range_begin, range_end) are masked.
  __device__ __forceinline__ static void attended_range(const DecodeArgs& a, const DecodePlan& plan, Work& w) {
    const int given_seq_len = w.seq_len;
    w.seq_len = clamped_seq_len(a, given_seq_len);
    if (w.reports && w.seq_len != given_seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SEQ_LEN);
    if (w.reports && kMultiToken && w.q_len > w.seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
    const int start = window_start(a, w.column_end(0));
    const int attend_end = w.column_end(w.num_columns - 1);
    w.columns_masked = w.column_token(0) != w.column_token(w.num_columns - 1);
    const int first_position = start & ~(kTileTokens - 1);
    const int range_tiles = int((int64_t(max(attend_end - first_position, 0)) + kTileTokens - 1) / kTileTokens);
    const int64_t split_tokens =
        Variant::length_shares(plan)
            ? int64_t((range_tiles + int(w.share.count) - 1) / int(w.share.count) + S::kStreams - 1) / S::kStreams *
                  S::kStreams * kTileTokens
            : plan.split_tokens;
    w.split_begin = first_position + w.split * split_tokens;
    const int64_t split_end = w.split_begin + split_tokens;
    w.range_begin = int(w.split_begin > start ? w.split_begin : start);
    w.range_end = int(split_end < attend_end ? split_end : attend_end);
  }

  // Checked mode: whether a page of a position the CTA attends (block-table entries [check_begin,
  // check_end)) is out of range, reported; only such a CTA masks tiles in its loop.
  __device__ __forceinline__ static bool pages_out_of_range(const DecodeArgs& a, const Work& w, const int32_t* table) {
    if (!a.index_check.enabled()) return false;  // CTA-uniform
    uint32_t check_begin = 0, check_end = 0, offset;
    if (w.range_begin < w.range_end) {
      split_position(a, uint32_t(w.range_begin), check_begin, offset);
      split_position(a, uint32_t(w.range_end - 1), check_end, offset);
      ++check_end;
    }
    bool out_of_range = false;
    for (uint32_t block = check_begin + threadIdx.x; block < check_end; block += kDecodeThreads)
      out_of_range |= a.index_check.page_out_of_range(__ldg(table + block));
    const bool masked = __syncthreads_or(out_of_range) != 0;
    if (masked && threadIdx.x == 0) a.index_check.report(FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE);
    return masked;
  }

  // ---- Tile loop ---------------------------------------------------------------------------------

  // S^T = K · Q^T of a tile over this warp's d-slice: mma rows g, g+8 (tokens row_token), columns
  // the heads (2t, 2t+1) of q rows q_row0...; with d-slices, summed over the stream's slices in
  // slice order (exchange buffer k & 1).
  template <class Tiles>
  __device__ __forceinline__ static void score_tile(const Shared& sh, const Tiles& tiles, const Stage& st, int k,
                                                    const int (&row_token)[2], int q_row0, int slice_d0, int stream,
                                                    int warp, int lane, float (&s)[4]) {
    const int g = lane / 4, t = lane % 4;
    uint4 k_bytes[2][S::kKChunks];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int c = 0; c < S::kKChunks; ++c)
        k_bytes[half][c] = *reinterpret_cast<const uint4*>(st.k + row_token[half] * S::kKRowBytes +
                                                           tiles.k_chunk_offset(row_token[half], t + 4 * c));
    }
    // Two accumulators (even and odd k-steps) halve the dependent chain of mma instructions.
    float s_part[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int j = 0; j < S::kKSteps; ++j) {
      uint32_t a_frag[4];  // rows g (k_lo) and g + 8 (k_hi), reduction pairs 0-1 and 2-3 of the chunk
      e4m3x4_to_half2x2_bits(reinterpret_cast<const uint32_t*>(&k_bytes[0][j / 4])[j % 4], a_frag[0], a_frag[2]);
      e4m3x4_to_half2x2_bits(reinterpret_cast<const uint32_t*>(&k_bytes[1][j / 4])[j % 4], a_frag[1], a_frag[3]);
      const uint2 q_frag = *reinterpret_cast<const uint2*>(&sh.q[q_row0 + g][slice_d0 + 64 * (j / 4) + 16 * t + 4 * (j % 4)]);
      mma_16x8x16(s_part[j % 2], a_frag, q_frag.x, q_frag.y);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) s[r] = s_part[0][r] + s_part[1][r];
    if constexpr (S::kSlices > 1) {
      sh.score[k & 1][warp][lane] = make_float4(s[0], s[1], s[2], s[3]);
      stream_barrier<S::kSlices>(stream);
      float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < S::kSlices; ++w) {
        const float4 p = sh.score[k & 1][stream * S::kSlices + w][lane];
        total.x += p.x; total.y += p.y; total.z += p.z; total.w += p.w;
      }
      s[0] = total.x; s[1] = total.y; s[2] = total.z; s[3] = total.w;
    }
  }

  // O^T += V^T · P^T of a tile: P^T (the fp16 weights p_lo of mma row g, p_hi of row g + 8) as the
  // B operand, V^T from this thread's codes and scales of the tokens of mma rows 2t, 2t+1, 2t+8,
  // 2t+9 (stage rows v_row_first + Rows::v_row_offset(j)), looked up in the level-pair table.
  __device__ __forceinline__ static void accumulate_pv(const Shared& sh, const Stage& st, int v_row_first, int lane,
                                                       uint32_t p_lo, uint32_t p_hi, float (&acc)[S::kMTiles][4]) {
    const int g = lane / 4;
    const uint32_t pb0 = transpose_8x8(p_lo);  // mma rows (2t, 2t+1) and (2t+8, 2t+9) of head g
    const uint32_t pb1 = transpose_8x8(p_hi);
    uint32_t codes[4][CodeChunk<S::kCodeBytes>::kWords];
    uint32_t scale_bytes[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = v_row_first + Rows::v_row_offset(j);
      read_code_bytes<S::kCodeBytes>(st.codes + row * S::kCodeRowBytes, g * S::kCodeBytes, codes[j]);
      scale_bytes[j] = st.scales[row * S::kScaleRowPitch + g * S::kThreadDims / kGroupElems];
    }
    // Scales as fp16 pairs of rows (2t, 2t+1) and (2t+8, 2t+9).
    const uint32_t scale_pair[2] = {e4m3x2_to_half2_bits(scale_bytes[0] | (scale_bytes[1] << 8)),
                                    e4m3x2_to_half2_bits(scale_bytes[2] | (scale_bytes[3] << 8))};
    // Pair-index words of mma rows (2t, 2t+1) and (2t+8, 2t+9): [pair][chunk][even/odd].
    using P = CodePairs<BITS>;
    constexpr int kChunks = (S::kThreadDims + P::kCodesPerChunk - 1) / P::kCodesPerChunk;
    uint32_t pairs[2][kChunks][2];
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        pair_words<BITS>(code_chunk<BITS>(codes[2 * pair], c), code_chunk<BITS>(codes[2 * pair + 1], c), pairs[pair][c]);
    }
    const uint8_t* level_pairs = reinterpret_cast<const uint8_t*>(sh.level_pairs);
    const uint32_t lane_copy = 4 * (lane % LevelPairs::kCopies);  // byte offset of this lane's copy
#pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) {
      uint32_t a_frag[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // (d 2i, tokens 2t..), (d 2i+1, ..), (d 2i, 2t+8..), (d 2i+1, ..)
        const int e = 2 * i + (r & 1);
        const int pair = r >> 1;
        const int local = e % P::kCodesPerChunk;
        const uint32_t offset = pair_offset<BITS, HEAD_DIM>(pairs[pair][e / P::kCodesPerChunk][local % 2], local / 2) | lane_copy;
        const __half2 levels = *reinterpret_cast<const __half2*>(level_pairs + offset);
        const __half2 v = __hmul2(levels, *reinterpret_cast<const __half2*>(&scale_pair[pair]));
        a_frag[r] = *reinterpret_cast<const uint32_t*>(&v);
      }
      mma_16x8x16(acc[i], a_frag, pb0, pb1);
    }
  }

  // The tile loop and the epilogue, in instances: with tiles masked where checked mode found a page
  // out of range (and, for several tokens, per column), with positions masked per column (CTAs
  // holding columns of several tokens), and without either, which every other CTA runs (all of them
  // in an unchecked one-token decode).
  template <bool MASK_PAGES, bool MASK_COLUMNS>
  __device__ __forceinline__ static void decode_tiles(const DecodeArgs& a, const DecodePlan& plan, const DecodeTensorMaps& maps,
                                      const Shared& sh, const Work& w, const int32_t* table, int warp, int lane,
                                      const ScoreTransform& score) {
    const int g = lane / 4;  // mma groupID
    const int t = lane % 4;  // mma threadID_in_group
    const int q_row0 = kGrouped ? warp * kHeadsPerCta : 0;  // this warp's columns in sh.q
    // The stream's tiles. With d-slices, every warp runs the same number of iterations (a stream's
    // last one may be fully masked). The d-slices of a stream meet at every score exchange; the
    // streams, whose exchanges use barriers of their own, need not, but where their counts of
    // barrier phases differed, compute-sanitizer's racecheck reported hazards across the CTA
    // barriers after the loop.
    const int first_tile = int(w.split_begin) + w.stream * kTileTokens;
    const int tile_step = S::kStreams * kTileTokens;
    const int loop_end = S::kSlices > 1 ? int(w.split_begin) + (w.range_end - int(w.split_begin) + tile_step - 1) /
                                                                   tile_step * tile_step
                                        : w.range_end;
    const int num_tiles = loop_end > first_tile ? (loop_end - first_tile + tile_step - 1) / tile_step : 0;
    TileStream<BITS, HEAD_DIM, CODE_COPY, kGrouped, MASK_PAGES> tiles(a, maps, sh.stream, table, warp, lane, first_tile,
                                                                      tile_step, num_tiles, w.range_begin, w.range_end,
                                                                      w.kv_head, w.slice_d0);

    // The attended ranges of this thread's columns 2t and 2t+1, where they differ from the CTA's.
    int column_begin[2] = {0, 0}, column_stop[2] = {0, 0};
    if constexpr (MASK_COLUMNS) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        column_stop[c] = w.column_end(2 * t + c);
        column_begin[c] = window_start(a, column_stop[c]);
      }
    }
    OnlineSoftmax softmax;
    float acc[S::kMTiles][4];
#pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    tiles.start();
    // The level-pair table, while the first tiles are in flight: its reads (the codebook table, from
    // L2 at a CTA's start) overlap theirs; the CTA barrier makes it, and the query in sh.q, visible
    // to every warp.
    for (int i = threadIdx.x; i < LevelPairs::kWords; i += kDecodeThreads) {
      const int e = i / LevelPairs::kCopies;
      sh.level_pairs[i] = half2_bits(kCodebookTable<BITS>.levels[e & ((1 << BITS) - 1)], kCodebookTable<BITS>.levels[e >> BITS]);
    }
    __syncthreads();

    const int row_token[2] = {Rows::token(g), Rows::token(g + 8)};
    const int v_row_first = Rows::token(2 * t);  // the stage row of this thread's first P·V token
    int slot = 0;                // k % kDecodeStages: tile k's stage
    uint32_t filled_parity = 0;  // (k / kDecodeStages) % 2: the phase of its barrier that tile k completes
    for (int k = 0; k < num_tiles; ++k) {
      const Stage st = tiles.next_tile(k, slot, filled_parity);
      const int tile = tiles.tile_of(k);
      float s[4];
      score_tile(sh, tiles, st, k, row_token, q_row0, w.slice_d0, w.stream, warp, lane, s);

      // Masked tokens get weight 0. A NaN score is not a maximum (fmaxf) but its weight
      // exp2(NaN - m) is NaN, so it reaches the head's output as NaN.
      bool row_valid[2] = {tiles.in_range(tile + row_token[0]), tiles.in_range(tile + row_token[1])};
      if (MASK_PAGES) {  // rows of out-of-range pages take no part (copied as zeros)
        const uint32_t masked = sh.stream.masked_rows[warp][slot];
        row_valid[0] = row_valid[0] && !((masked >> row_token[0]) & 1);
        row_valid[1] = row_valid[1] && !((masked >> row_token[1]) & 1);
      }
      score.apply(s);
      float masked_s[4];  // s with the rows outside the column's range at -inf
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        bool valid[2] = {row_valid[0], row_valid[1]};
        if constexpr (MASK_COLUMNS) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int pos = tile + row_token[half];
            valid[half] = valid[half] && pos >= column_begin[c] && pos < column_stop[c];
          }
        }
        masked_s[c] = valid[0] ? s[c] : -INFINITY;
        masked_s[2 + c] = valid[1] ? s[2 + c] : -INFINITY;
      }
      softmax.observe(masked_s, acc);
      float p[4];
      uint32_t p_lo, p_hi;
      softmax.weigh(masked_s, p, p_lo, p_hi);
      // FORMAT §5 sparse V at tile granularity: only heads of this CTA vote. The reference is a
      // maximum over positions already seen, so a skipped row qualifies under the per-row rule. The
      // vote's comparisons sit behind the (kernel-uniform) threshold test, off the default path.
      bool skip = false;
      if (a.sparse_v_threshold > 0.0f) {
        bool all_small = true;
#pragma unroll
        for (int c = 0; c < 2; ++c)
          if (2 * t + c < w.num_columns) all_small = all_small && p[c] <= a.sparse_v_threshold && p[2 + c] <= a.sparse_v_threshold;
        skip = __all_sync(0xffffffffu, all_small);
      }
      if (!skip) accumulate_pv(sh, st, v_row_first, lane, p_lo, p_hi, acc);
      slot = tiles.slot_after(slot, 1);
      if (slot == 0) filled_parity ^= 1;
    }
    tiles.drain();
    allow_dependent_launch();
    softmax.reduce_denominators();
    const int thread_d0 = w.slice_d0 + g * S::kThreadDims;  // first V/O element of this thread
    if constexpr (kGrouped)
      write_warp_partials(a, plan, w, warp, lane, thread_d0, softmax, acc);
    else
      merge_streams_and_write(a, plan, sh, w, warp, lane, thread_d0, softmax, acc);
  }

  // ---- Epilogue ----------------------------------------------------------------------------------

  // Head groups: this warp's stream is a partial of its own KV head, written from its registers;
  // the merge kernel combines them.
  __device__ __forceinline__ static void write_warp_partials(const DecodeArgs& a, const DecodePlan& plan, const Work& w, int warp,
                                             int lane, int thread_d0, const OnlineSoftmax& softmax,
                                             const float (&acc)[S::kMTiles][4]) {
    const int g = lane / 4, t = lane % 4;
    const uint32_t partial = w.split * S::kStreams + uint32_t(w.stream);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int column = 2 * t + c;
      if (column >= w.num_columns) continue;
      float* part = partial_address(plan, w.share, a.num_q_heads, w.column_head(column), partial, HEAD_DIM);
#pragma unroll
      for (int i = 0; i < S::kMTiles; ++i)
        *reinterpret_cast<float2*>(part + thread_d0 + 2 * i) = make_float2(acc[i][c], acc[i][2 + c]);
      if (g == 0) {
        part[HEAD_DIM] = softmax.max_of(c);
        part[HEAD_DIM + 1] = softmax.denom[c];
      }
    }
  }

  // The CTA's token streams merged (in shared memory, in stream order) into each column's output,
  // normalised, or into the split's partial.
  __device__ __forceinline__ static void merge_streams_and_write(const DecodeArgs& a, const DecodePlan& plan, const Shared& sh,
                                                 const Work& w, int warp, int lane, int thread_d0,
                                                 const OnlineSoftmax& softmax, const float (&acc)[S::kMTiles][4]) {
    const int tid = threadIdx.x;
    const int g = lane / 4, t = lane % 4;
    __syncthreads();
    // Per stream: publish O, max, denominator.
    if (warp % S::kSlices == 0 && g == 0) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        sh.max[w.stream][2 * t + c] = softmax.max_of(c);
        sh.denom[w.stream][2 * t + c] = softmax.denom[c];
      }
    }
#pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) {
      const int d = thread_d0 + 2 * i;
      sh.o[w.stream][2 * t][d] = acc[i][0];
      sh.o[w.stream][2 * t + 1][d] = acc[i][1];
      sh.o[w.stream][2 * t][d + 1] = acc[i][2];
      sh.o[w.stream][2 * t + 1][d + 1] = acc[i][3];
    }
    __syncthreads();
    // Per column h: its maximum over the streams, each stream's weight under it and the merged
    // denominator, computed once (by lane h of warp 0) instead of for every output element.
    if (warp == 0 && lane < kHeadsPerCta) {
      const int h = lane;
      float m = -INFINITY;
#pragma unroll
      for (int st = 0; st < S::kStreams; ++st) m = fmaxf(m, sh.max[st][h]);
      float l = 0.0f;
#pragma unroll
      for (int st = 0; st < S::kStreams; ++st) {
        const float weight = partial_weight(sh.max[st][h], m);
        sh.stream_weight[st][h] = weight;
        l += weight * sh.denom[st][h];
      }
      sh.column_max[h] = m;
      sh.column_denom[h] = l;
    }
    __syncthreads();
    // Column h's output element d merged over the streams (fixed order).
    auto merged = [&](int h, int d) {
      float o = 0.0f;
#pragma unroll
      for (int st = 0; st < S::kStreams; ++st) o += sh.stream_weight[st][h] * sh.o[st][h][d];
      return o;
    };
    // Rotated V (FORMAT §6) without splits: the merged rows are rotated back before they are
    // normalised, in the first stream's rows, a warp per column. (Split partials stay rotated:
    // the merge kernel rotates their sum back.)
    bool rotate_back = false;
    if constexpr (Variant::kRotation && kRotatableHeadDim<HEAD_DIM>) {
      rotate_back = a.rotated_v && plan.num_splits == 1;  // CTA-uniform
      if (rotate_back) {
        for (int i = tid; i < w.num_columns * HEAD_DIM; i += kDecodeThreads)
          sh.o[0][i / HEAD_DIM][i % HEAD_DIM] = merged(i / HEAD_DIM, i % HEAD_DIM);
        __syncthreads();
        for (int h = warp; h < w.num_columns; h += kDecodeWarps) unrotate_row<HEAD_DIM>(sh.o[0][h], lane);
        __syncthreads();
      }
    }
    for (int i = tid; i < w.num_columns * HEAD_DIM; i += kDecodeThreads) {
      const int h = i / HEAD_DIM;
      const int d = i % HEAD_DIM;
      const float m = sh.column_max[h];
      const float l = sh.column_denom[h];
      const float o = rotate_back ? sh.o[0][h][d] : merged(h, d);  // with rotate_back, rotated back in sh.o[0]
      const uint32_t token = w.column_token(h);
      const uint32_t head = w.column_head(h);
      if (plan.num_splits == 1) {
        const float out = normalize(o, l, m, sink_log2(a, head));
        const uint64_t row = uint64_t(w.row0 + token) * a.num_q_heads + head;
        a.output[row * HEAD_DIM + d] = __bfloat16_as_ushort(__float2bfloat16(out));
      } else {
        float* part = partial_address(plan, w.share, Variant::rows_per_seq(a) * a.num_q_heads, token * a.num_q_heads + head,
                                      w.split, HEAD_DIM);
        part[d] = o;
        if (d == 0) {
          part[HEAD_DIM] = m;
          part[HEAD_DIM + 1] = l;
        }
      }
    }
  }
};

template <int BITS, int HEAD_DIM, int CODE_COPY, class Variant>
__global__ void __launch_bounds__(kDecodeThreads, (decode_min_ctas_per_sm<BITS, HEAD_DIM, CODE_COPY, Variant>()))
    paged_decode_kernel(const DecodeArgs a, const DecodePlan plan, const __grid_constant__ DecodeTensorMaps maps) {
  using K = DecodeKernel<BITS, HEAD_DIM, CODE_COPY, Variant>;
  using S = typename K::S;
  using L = typename K::L;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float max_s[S::kStreams][kHeadsPerCta];
  __shared__ float denom_s[S::kStreams][kHeadsPerCta];
  __shared__ float stream_weight_s[S::kStreams][kHeadsPerCta];
  __shared__ float column_max_s[kHeadsPerCta];
  __shared__ float column_denom_s[kHeadsPerCta];
  __shared__ __align__(16) float4 score_s[2][kDecodeWarps][S::kSlices > 1 ? 32 : 1];
  __shared__ float q_absmax_s[kDecodeWarps];
  __shared__ uint32_t masked_rows_s[kDecodeWarps][kDecodeStages];
  __shared__ __align__(8) uint64_t stage_filled_s[kDecodeWarps][kDecodeStages];
  const typename K::Shared sh{smem,
                              reinterpret_cast<__half(*)[L::kQRowElems]>(smem + L::kQOffset),
                              reinterpret_cast<float(*)[kHeadsPerCta][HEAD_DIM]>(smem),
                              max_s,
                              denom_s,
                              stream_weight_s,
                              column_max_s,
                              column_denom_s,
                              score_s,
                              reinterpret_cast<uint32_t*>(smem + L::kLevelPairsOffset),
                              q_absmax_s,
                              StreamSmem{smem, reinterpret_cast<int32_t*>(smem + L::kPagesOffset), masked_rows_s,
                                         stage_filled_s}};
  // Warp-uniform by construction; broadcast from lane 0 so that the compiler knows it, and may keep
  // the values derived from it (stream, slice, stage and barrier addresses) in uniform registers,
  // which leaves more of the registers per thread to the tile loop.
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);
  const int lane = threadIdx.x % 32;

  // ---- Prologue
  if constexpr (kArchHasTensorCopies) {
    if (maps.enabled && threadIdx.x == 0) {  // the descriptors' fetch overlaps the prologue
      prefetch_tensor_map(maps.k);
      prefetch_tensor_map(maps.codes);
      if (S::kScalesByTensorCopy && maps.scales_enabled) prefetch_tensor_map(maps.scales);
    }
  }
  typename K::Work w;
  if (!K::find_work(a, plan, sh, warp, w)) return;
  const float q_gain = K::load_query(a, sh, w, warp, lane);
  K::attended_range(a, plan, w);
  const int32_t* table = a.block_tables + w.seq * a.block_tables_stride;
  const bool pages_masked = K::pages_out_of_range(a, w, table);
  const ScoreTransform score = ScoreTransform::make(a, q_gain);

  // ---- Tile loop and epilogue
  if (pages_masked)
    K::template decode_tiles<true, Variant::kMultiToken>(a, plan, maps, sh, w, table, warp, lane, score);
  else if (w.columns_masked)  // never with one token
    K::template decode_tiles<false, Variant::kMultiToken>(a, plan, maps, sh, w, table, warp, lane, score);
  else
    K::template decode_tiles<false, false>(a, plan, maps, sh, w, table, warp, lane, score);
}

}  // namespace fp8kturbov
