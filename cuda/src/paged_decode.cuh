// Paged decode attention over the fp8k_turbo{2,3,4}v cache (FORMAT §5), on tensor cores.
//
// Work split. A CTA handles one (sequence, KV head, chunk of up to 8 query heads of its GQA group,
// context split). The context split (flash-decoding) lets a few long sequences fill the GPU: each
// split writes an unnormalised partial (O, running max, denominator) to the caller's workspace and
// a merge kernel combines them in a fixed order, so results are deterministic for a plan.
//
// Inside a CTA, 4 warps each own a d-slice of kSliceDim (<= 128) elements and a stream of 16-token
// tiles; with head_dim > 128 several warps share one stream and sum their partial scores. Per tile
// a warp computes S^T = K · Q^T (mma m16n8k16, tokens × heads) from FP8 bytes converted to fp16, the
// online softmax in fp32, and O^T += V^T · P^T (d × heads) from codes looked up in a level table and
// scaled per 16-element group. Any permutation of the reduction index of an mma is free, so each
// thread loads whole 16-byte chunks of K rows and contiguous code bytes of V rows, and the query is
// laid out in shared memory to match.
#pragma once

#include <cuda_fp16.h>

#include <cfloat>

#include "format.cuh"
#include "kernel_args.h"

namespace fp8kturbov {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kTileTokens = kDecodeTileTokens;    // the mma's M (scores) and K (P·V) extent
constexpr int kHeadsPerCta = kDecodeHeadsPerCta;  // the mma's N extent
constexpr float kLog2e = 1.4426950408889634f;

// ---- Warp-level matrix instructions --------------------------------------------------------

__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Transposes an 8x8 fp16 matrix held in the standard fragment layout across the warp.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two E4M3 bytes (low byte first) to two fp16 values, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_half2_bits(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two_bytes), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// ---- Loads -------------------------------------------------------------------------------------

// Loads the BYTES code bytes at `src` into little-endian 32-bit words w[0..]. Chunks whose size is
// a multiple of 4 are naturally aligned and loaded as they are; others (6 bytes for 3-bit codes
// at head_dim 128, ...) are read as the aligned words that cover them and shifted into place, which
// never reads past the 4-aligned end of the V row that holds them.
template <int BYTES>
struct CodeChunk {
  static constexpr int kNaturalAlign = BYTES % 8 == 0 ? 8 : BYTES % 4 == 0 ? 4 : BYTES % 2 == 0 ? 2 : 1;
  static constexpr int kMaxMisalign = kNaturalAlign >= 4 ? 0 : 4 - kNaturalAlign;
  static constexpr int kLoadWords = (BYTES + kMaxMisalign + 3) / 4;
  static constexpr int kWords = (BYTES + 3) / 4 + 1;  // one spare zero word for code_at's funnel shift
};

template <int BYTES>
__device__ __forceinline__ void load_code_bytes(const uint8_t* src, uint32_t (&w)[CodeChunk<BYTES>::kWords]) {
  using C = CodeChunk<BYTES>;
#pragma unroll
  for (int i = 0; i < C::kWords; ++i) w[i] = 0;
  if constexpr (C::kNaturalAlign == 8) {
#pragma unroll
    for (int i = 0; i < BYTES / 8; ++i) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src) + i);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else if constexpr (C::kNaturalAlign == 4) {
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) w[i] = __ldg(reinterpret_cast<const uint32_t*>(src) + i);
  } else {
    const uintptr_t address = reinterpret_cast<uintptr_t>(src);
    const uint32_t* aligned = reinterpret_cast<const uint32_t*>(address & ~uintptr_t(3));
    const uint32_t shift = uint32_t(address & 3) * 8;
    uint32_t raw[C::kLoadWords + 1];
#pragma unroll
    for (int i = 0; i < C::kLoadWords; ++i) raw[i] = __ldg(aligned + i);
    raw[C::kLoadWords] = 0;
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
  }
}

// Code of element `e` in a little-endian stream of BITS-bit codes (FORMAT §3.3: within a group the
// codes are consecutive BITS-bit fields; the 3-bit triplets are the same stream).
template <int BITS, int WORDS>
__device__ __forceinline__ uint32_t code_at(const uint32_t (&w)[WORDS], int e) {
  const int bit = e * BITS;
  return __funnelshift_r(w[bit / 32], w[bit / 32 + 1], bit % 32) & ((1u << BITS) - 1);
}

// Position -> (block, offset) by the runtime block size with a multiply and a shift
// (round-up reciprocal, exact for positions < 2^31; the host computes multiplier and shift).
__device__ __forceinline__ void split_position(const DecodeArgs& a, uint32_t pos, uint32_t& block,
                                               uint32_t& offset) {
  block = uint32_t((uint64_t(__umulhi(pos, a.block_size_multiplier)) + pos) >> a.block_size_shift);
  offset = pos - block * a.block_size;
}

// ---- The kernel --------------------------------------------------------------------------------

template <int BITS, int HEAD_DIM>
struct DecodeShape {
  static constexpr int kSliceDim = HEAD_DIM < 128 ? HEAD_DIM : 128;     // d handled by one warp
  static constexpr int kSlices = HEAD_DIM / kSliceDim;                   // warps sharing a stream
  static constexpr int kStreams = kDecodeWarps / kSlices;                // token streams per CTA
  static constexpr int kKChunks = kSliceDim / 64;                        // 16-byte K loads per row
  static constexpr int kKSteps = kSliceDim / 16;                         // mma k-steps of Q·K
  static constexpr int kThreadDims = kSliceDim / 8;                      // V d-values per thread
  static constexpr int kMTiles = kSliceDim / 16;                         // mma m-tiles of P·V
  static constexpr int kCodeBytes = kThreadDims * BITS / 8;              // per token per thread
  static constexpr int kScalesPerThread = kThreadDims >= 16 ? kThreadDims / 16 : 1;
  static_assert(kSliceDim % 64 == 0, "head_dim must be 64, 128, 256 or 512");
};

// Page ids of the rows a thread loads in a tile (fetched one tile ahead of the data, so that the
// block-table latency never stalls the data loads); -1 marks rows outside the range.
struct TilePages {
  int32_t k[2];      // tokens g, g+8
  int32_t v[4];      // tokens 2t, 2t+1, 2t+8, 2t+9
  uint32_t offset0;  // page offset of the tile's first position (tiles within one page)
};

// Per-tile register data of one thread: its K bytes, V codes and V scales.
template <int BITS, int HEAD_DIM>
struct TileRegs {
  using S = DecodeShape<BITS, HEAD_DIM>;
  uint4 k[2][S::kKChunks];                       // rows g and g+8
  uint32_t codes[4][CodeChunk<S::kCodeBytes>::kWords];  // tokens 2t, 2t+1, 2t+8, 2t+9
  uint32_t scales[4];                            // scale bytes of those tokens (packed)
};

template <int BITS, int HEAD_DIM>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeCtasPerSm)
    paged_decode_kernel(const DecodeArgs a, const DecodePlan plan) {
  using S = DecodeShape<BITS, HEAD_DIM>;
  __shared__ __align__(16) __half q_s[kHeadsPerCta][HEAD_DIM + 4];  // +4: no bank conflicts
  __shared__ __align__(16) float o_s[S::kStreams][kHeadsPerCta][HEAD_DIM];
  __shared__ float max_s[S::kStreams][kHeadsPerCta];
  __shared__ float denom_s[S::kStreams][kHeadsPerCta];
  __shared__ __align__(16) float4 score_s[2][kDecodeWarps][32];
  __shared__ __half level_s[1 << BITS];
  __shared__ float q_absmax_s[kDecodeWarps];

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // mma groupID
  const int t = lane % 4;  // mma threadID_in_group
  const int stream = warp / S::kSlices;
  const int slice = warp % S::kSlices;
  const int slice_d0 = slice * S::kSliceDim;

  const uint32_t seq = blockIdx.x / plan.num_splits;
  const uint32_t split = blockIdx.x % plan.num_splits;
  const uint32_t group_size = a.num_q_heads / a.num_kv_heads;
  const uint32_t kv_head = blockIdx.y / plan.chunks_per_group;
  const uint32_t chunk = blockIdx.y % plan.chunks_per_group;
  const uint32_t first_head = kv_head * group_size + chunk * kHeadsPerCta;
  const int num_heads = min(kHeadsPerCta, int(group_size - chunk * kHeadsPerCta));

  // FORMAT §5: attended positions [start, seq_len); a length beyond the block table is clamped to
  // it so that no read leaves the table. This CTA takes its split's share of whole tiles.
  const int table_positions = int(a.max_blocks_per_seq * a.block_size);  // < 2^31, validated
  const int seq_len = min(max(a.seq_lens[seq], 0), table_positions);
  const int start = (a.sliding_window > 0 && seq_len > int(a.sliding_window))
                        ? seq_len - int(a.sliding_window)
                        : 0;
  // Tiles sit on absolute multiples of 16 positions (so that with block_size % 16 == 0 a tile lies
  // in one page); rows outside [range_begin, range_end) are masked.
  const int64_t split_begin = (start & ~(kTileTokens - 1)) + int64_t(split) * plan.split_tokens;
  const int64_t split_end = split_begin + plan.split_tokens;
  const int range_begin = int(split_begin > start ? split_begin : start);
  const int range_end = int(split_end < seq_len ? split_end : seq_len);
  const bool tile_in_one_page = a.block_size % kTileTokens == 0;

  // Query chunk to fp16, scaled by a power of two so that its largest magnitude fits fp16's
  // range; the factor is undone in the score scale (exact).
  float q_absmax = 0.0f;
  for (int i = tid; i < num_heads * HEAD_DIM; i += kDecodeThreads) {
    const uint16_t bits =
        a.q[uint64_t(seq) * a.q_stride + uint64_t(first_head) * HEAD_DIM + i];
    q_absmax = fmaxf(q_absmax, fabsf(__bfloat162float(__ushort_as_bfloat16(bits))));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) q_absmax = fmaxf(q_absmax, __shfl_xor_sync(0xffffffffu, q_absmax, o));
  if (lane == 0) q_absmax_s[warp] = q_absmax;
  if (tid < (1 << BITS)) level_s[tid] = __float2half_rn(Codebook<BITS>::levels()[tid]);
  __syncthreads();
  q_absmax = fmaxf(fmaxf(q_absmax_s[0], q_absmax_s[1]), fmaxf(q_absmax_s[2], q_absmax_s[3]));
  int q_exp = 0;
  if (q_absmax > 0.0f && q_absmax <= FLT_MAX) frexpf(q_absmax, &q_exp);  // q_absmax < 2^q_exp
  const float q_gain = ldexpf(1.0f, 15 - q_exp);
  for (int i = tid; i < kHeadsPerCta * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    float v = 0.0f;
    if (h < num_heads)
      v = __bfloat162float(__ushort_as_bfloat16(
          a.q[uint64_t(seq) * a.q_stride + uint64_t(first_head) * HEAD_DIM + i]));
    q_s[h][i % HEAD_DIM] = __float2half_rn(v * q_gain);
  }
  __syncthreads();
  // Scores in the log2 domain: s2 = (q·k) · k_scale · inv_sqrt_d · log2(e).
  const float score_to_log2 = a.score_scale * kLog2e / q_gain;

  const uint64_t row_elems = uint64_t(a.num_kv_heads) * HEAD_DIM;
  const VPageLayout v_layout{row_elems * BITS / 8, row_elems / kGroupElems, a.v_data_section_bytes};
  const int32_t* table = a.block_tables + uint64_t(seq) * a.max_blocks_per_seq;
  // This thread's byte offsets inside a token row of the pools.
  const uint64_t k_col = uint64_t(kv_head) * HEAD_DIM + slice_d0 + 16 * t;
  const int thread_d0 = slice_d0 + g * S::kThreadDims;  // first V/O element of this thread
  const uint64_t v_code_col = (uint64_t(kv_head) * HEAD_DIM + thread_d0) * BITS / 8;
  const uint64_t v_scale_col = (uint64_t(kv_head) * HEAD_DIM + thread_d0) / kGroupElems;
  const int k_row_token[2] = {g, g + 8};
  const int v_row_token[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};

  auto in_range = [&](int pos) { return pos >= range_begin && pos < range_end; };
  // One table read per tile when a tile lies in one page, else one per row.
  auto fetch_pages = [&](int tile_begin, TilePages& pages) {
    uint32_t block, offset;
    split_position(a, uint32_t(tile_begin), block, offset);
    pages.offset0 = offset;
    const int32_t tile_page = tile_in_one_page && tile_begin < range_end ? __ldg(table + block) : -1;
    auto page_of = [&](int pos) {
      if (!in_range(pos)) return -1;
      if (tile_in_one_page) return tile_page;
      uint32_t row_block, row_offset;
      split_position(a, uint32_t(pos), row_block, row_offset);
      return __ldg(table + row_block);
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) pages.k[r] = page_of(tile_begin + k_row_token[r]);
#pragma unroll
    for (int r = 0; r < 4; ++r) pages.v[r] = page_of(tile_begin + v_row_token[r]);
  };
  auto page_offset = [&](int tile_begin, const TilePages& pages, int row_token) {
    if (tile_in_one_page) return pages.offset0 + row_token;
    uint32_t block, offset;
    split_position(a, uint32_t(tile_begin + row_token), block, offset);
    return offset;
  };

  auto load_tile = [&](int tile_begin, const TilePages& pages, TileRegs<BITS, HEAD_DIM>& r) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t offset = page_offset(tile_begin, pages, k_row_token[half]);
      const bool valid = pages.k[half] >= 0;
      const uint8_t* row = a.k_cache + uint64_t(valid ? pages.k[half] : 0) * a.k_block_stride_bytes +
                           uint64_t(offset) * row_elems + k_col;
#pragma unroll
      for (int c = 0; c < S::kKChunks; ++c)
        r.k[half][c] = valid ? __ldg(reinterpret_cast<const uint4*>(row + 64 * c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t offset = page_offset(tile_begin, pages, v_row_token[j]);
      if (pages.v[j] >= 0) {
        const uint8_t* page = a.v_cache + uint64_t(pages.v[j]) * a.v_block_stride_bytes;
        load_code_bytes<S::kCodeBytes>(page + offset * v_layout.row_data_bytes + v_code_col, r.codes[j]);
        const uint8_t* scale = page + v_layout.scale_offset(offset, 0) + v_scale_col;
        uint32_t packed = 0;
#pragma unroll
        for (int s = 0; s < S::kScalesPerThread; ++s) packed |= uint32_t(__ldg(scale + s)) << (8 * s);
        r.scales[j] = packed;
      } else {
#pragma unroll
        for (int w = 0; w < CodeChunk<S::kCodeBytes>::kWords; ++w) r.codes[j][w] = 0;
        r.scales[j] = 0;  // scale 0: the row contributes exact zeros
      }
    }
  };

  // Online-softmax state for heads 2t and 2t+1 (identical in the 8 lanes sharing t).
  float run_max[2] = {-INFINITY, -INFINITY};
  float run_denom[2] = {0.0f, 0.0f};  // this lane's tokens only; reduced at the end
  float acc[S::kMTiles][4];
#pragma unroll
  for (int i = 0; i < S::kMTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  const int first_tile = int(split_begin) + stream * kTileTokens;
  const int tile_step = S::kStreams * kTileTokens;
  // Software pipeline: pages two tiles ahead, data one tile ahead of the compute.
  TilePages pages_next, pages_after;
  TileRegs<BITS, HEAD_DIM> cur;
  fetch_pages(first_tile, pages_next);
  load_tile(first_tile, pages_next, cur);  // rows out of range load as zeros
  fetch_pages(first_tile + tile_step, pages_next);
  int parity = 0;
  // With d-slices, every warp runs the same number of iterations (a stream's last one may be
  // fully masked) so that the score exchange can use a CTA-wide barrier.
  const int loop_end = S::kSlices > 1 ? int(split_begin) + (range_end - int(split_begin) + tile_step - 1) /
                                                               tile_step * tile_step
                                      : range_end;
  for (int tile = first_tile; tile < loop_end; tile += tile_step, parity ^= 1) {
    fetch_pages(tile + 2 * tile_step, pages_after);
    TileRegs<BITS, HEAD_DIM> next;
    load_tile(tile + tile_step, pages_next, next);
    pages_next = pages_after;

    // S^T = K · Q^T over this warp's d-slice: rows = tokens (g, g+8), cols = heads (2t, 2t+1).
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < S::kKSteps; ++j) {
      const uint32_t k_lo = reinterpret_cast<const uint32_t*>(&cur.k[0][j / 4])[j % 4];
      const uint32_t k_hi = reinterpret_cast<const uint32_t*>(&cur.k[1][j / 4])[j % 4];
      const uint32_t a_frag[4] = {e4m3x2_to_half2_bits(k_lo & 0xFFFF), e4m3x2_to_half2_bits(k_hi & 0xFFFF),
                                  e4m3x2_to_half2_bits(k_lo >> 16), e4m3x2_to_half2_bits(k_hi >> 16)};
      const uint2 q_frag = *reinterpret_cast<const uint2*>(&q_s[g][slice_d0 + 64 * (j / 4) + 16 * t + 4 * (j % 4)]);
      mma_16x8x16(s, a_frag, q_frag.x, q_frag.y);
    }
    if constexpr (S::kSlices > 1) {  // sum the slices' partial scores, in slice order
      score_s[parity][warp][lane] = make_float4(s[0], s[1], s[2], s[3]);
      __syncthreads();
      float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < S::kSlices; ++w) {
        const float4 p = score_s[parity][stream * S::kSlices + w][lane];
        total.x += p.x; total.y += p.y; total.z += p.z; total.w += p.w;
      }
      s[0] = total.x; s[1] = total.y; s[2] = total.z; s[3] = total.w;
    }

    // Online softmax per head column; masked tokens get weight 0.
    const bool row_valid[2] = {in_range(tile + g), in_range(tile + g + 8)};
    float p[4];
    float alpha[2];
    bool all_small = true;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float s0 = row_valid[0] ? s[c] * score_to_log2 : -INFINITY;
      const float s1 = row_valid[1] ? s[2 + c] * score_to_log2 : -INFINITY;
      float tile_max = fmaxf(s0, s1);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      const float new_max = fmaxf(run_max[c], tile_max);
      const bool any = new_max != -INFINITY;
      alpha[c] = any ? exp2f(run_max[c] - new_max) : 1.0f;
      p[c] = any ? exp2f(s0 - new_max) : 0.0f;
      p[2 + c] = any ? exp2f(s1 - new_max) : 0.0f;
      run_max[c] = new_max;
      // FORMAT §5 sparse V at tile granularity: only heads of this CTA vote.
      if (2 * t + c < num_heads) all_small = all_small && p[c] <= a.sparse_v_threshold && p[2 + c] <= a.sparse_v_threshold;
    }
    const uint32_t p_lo = half2_bits(p[0], p[1]);  // token g, heads 2t, 2t+1
    const uint32_t p_hi = half2_bits(p[2], p[3]);  // token g+8
    {
      const __half2 lo = *reinterpret_cast<const __half2*>(&p_lo);
      const __half2 hi = *reinterpret_cast<const __half2*>(&p_hi);
      // The denominator sums the same fp16-rounded weights that multiply V.
      run_denom[0] = run_denom[0] * alpha[0] + __low2float(lo) + __low2float(hi);
      run_denom[1] = run_denom[1] * alpha[1] + __high2float(lo) + __high2float(hi);
    }
#pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) {
      acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
    }
    const bool skip = a.sparse_v_threshold > 0.0f && __all_sync(0xffffffffu, all_small);
    if (!skip) {
      // P^T as the B operand: tokens (2t, 2t+1) and (2t+8, 2t+9) of head g.
      const uint32_t pb0 = transpose_8x8(p_lo);
      const uint32_t pb1 = transpose_8x8(p_hi);
      // V scales as fp16 pairs of tokens (2t, 2t+1) and (2t+8, 2t+9), per group of this thread.
      uint32_t scale_pair[2][S::kScalesPerThread];
#pragma unroll
      for (int s2 = 0; s2 < S::kScalesPerThread; ++s2) {
        scale_pair[0][s2] = e4m3x2_to_half2_bits(((cur.scales[0] >> (8 * s2)) & 0xFF) |
                                                 (((cur.scales[1] >> (8 * s2)) & 0xFF) << 8));
        scale_pair[1][s2] = e4m3x2_to_half2_bits(((cur.scales[2] >> (8 * s2)) & 0xFF) |
                                                 (((cur.scales[3] >> (8 * s2)) & 0xFF) << 8));
      }
#pragma unroll
      for (int i = 0; i < S::kMTiles; ++i) {
        uint32_t a_frag[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // (d 2i, tokens 2t..), (d 2i+1, ..), (d 2i, 2t+8..), (d 2i+1, ..)
          const int e = 2 * i + (r & 1);
          const int pair = r >> 1;
          const __half2 levels = __halves2half2(level_s[code_at<BITS>(cur.codes[2 * pair], e)],
                                                level_s[code_at<BITS>(cur.codes[2 * pair + 1], e)]);
          const uint32_t sp = scale_pair[pair][S::kScalesPerThread > 1 ? e / 16 : 0];
          const __half2 v = __hmul2(levels, *reinterpret_cast<const __half2*>(&sp));
          a_frag[r] = *reinterpret_cast<const uint32_t*>(&v);
        }
        mma_16x8x16(acc[i], a_frag, pb0, pb1);
      }
    }
    cur = next;
  }

  // Per stream: reduce the denominators over the 8 lanes sharing t, publish O, max, denominator.
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) run_denom[c] += __shfl_xor_sync(0xffffffffu, run_denom[c], o);
  }
  if (slice == 0 && g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      max_s[stream][2 * t + c] = run_max[c];
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

  // Merge the streams (fixed order) and write the output or this split's partial.
  for (int i = tid; i < num_heads * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float m = -INFINITY;
#pragma unroll
    for (int st = 0; st < S::kStreams; ++st) m = fmaxf(m, max_s[st][h]);
    float o = 0.0f, l = 0.0f;
    if (m != -INFINITY) {
#pragma unroll
      for (int st = 0; st < S::kStreams; ++st) {
        const float w = exp2f(max_s[st][h] - m);
        o += w * o_s[st][h][d];
        l += w * denom_s[st][h];
      }
    }
    const uint64_t row = uint64_t(seq) * a.num_q_heads + first_head + h;
    if (plan.num_splits == 1) {
      // seq_len == 0 leaves the denominator at 0: the row is written as zeros (FORMAT §5).
      a.output[row * HEAD_DIM + d] = __bfloat16_as_ushort(__float2bfloat16(l > 0.0f ? o / l : 0.0f));
    } else {
      float* part = plan.workspace + (row * plan.num_splits + split) * (HEAD_DIM + 2);
      part[d] = o;
      if (d == 0) {
        part[HEAD_DIM] = m;
        part[HEAD_DIM + 1] = l;
      }
    }
  }
}

// Combines the splits' partials of one (sequence, query head) in split order.
template <int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) merge_splits_kernel(const DecodeArgs a, const DecodePlan plan) {
  const uint64_t row = blockIdx.x;  // sequence * num_q_heads + head
  const int d = threadIdx.x;
  const float* parts = plan.workspace + row * plan.num_splits * (HEAD_DIM + 2);
  float m = -INFINITY;
  for (uint32_t s = 0; s < plan.num_splits; ++s) m = fmaxf(m, parts[s * (HEAD_DIM + 2) + HEAD_DIM]);
  float o = 0.0f, l = 0.0f;
  if (m != -INFINITY) {
    for (uint32_t s = 0; s < plan.num_splits; ++s) {
      const float* part = parts + s * (HEAD_DIM + 2);
      const float w = exp2f(part[HEAD_DIM] - m);
      o += w * part[d];
      l += w * part[HEAD_DIM + 1];
    }
  }
  a.output[row * HEAD_DIM + d] = __bfloat16_as_ushort(__float2bfloat16(l > 0.0f ? o / l : 0.0f));
}

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  const dim3 grid(args.num_seqs * plan.num_splits, args.num_kv_heads * plan.chunks_per_group);
  DecodeArgs kernel_args = args;
  DecodePlan kernel_plan = plan;
  void* params[] = {&kernel_args, &kernel_plan};
  cudaError_t err =
      cudaLaunchKernel(reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM>), grid,
                       dim3(kDecodeThreads), params, 0, stream);
  if (err != cudaSuccess || plan.num_splits == 1) return err;
  return cudaLaunchKernel(reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM>),
                          dim3(args.num_seqs * args.num_q_heads), dim3(HEAD_DIM), params, 0, stream);
}

}  // namespace fp8kturbov
