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
// bytes of V rows, and the query is laid out in shared memory to match.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the runtime)
#include <cuda_fp16.h>

#include <atomic>
#include <cfloat>
#include <type_traits>

#include "format.cuh"
#include "kernel_args.h"

namespace fp8kturbov {

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

// Four E4M3 bytes to two fp16 pairs: lo from bytes 0-1, hi from bytes 2-3, exactly. Splitting the
// word in PTX lets the conversion read its upper half directly instead of after a shift. (The
// conversion instruction needs sm_89; older architectures take the intrinsic's emulation.)
__device__ __forceinline__ void e4m3x4_to_half2x2_bits(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four_bytes));
#else
  lo = e4m3x2_to_half2_bits(four_bytes & 0xFFFF);
  hi = e4m3x2_to_half2_bits(four_bytes >> 16);
#endif
}

// A barrier of the SLICES warps of one token stream (named barrier 1 + stream; 0 is
// __syncthreads'): the streams of a CTA do not wait on each other.
template <int SLICES>
__device__ __forceinline__ void stream_barrier(int stream) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + stream), "n"(32 * SLICES) : "memory");
}

__device__ __forceinline__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// ---- Asynchronous copies (global -> shared, sm_80+) -----------------------------------------

// Copies BYTES (4, 8 or 16) from global to shared memory without passing through registers; a
// row outside the attended range copies nothing and zero-fills its bytes (src-size 0).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  const uint32_t dst_addr = shared_address(dst);
  const uint32_t src_bytes = valid ? BYTES : 0;
  if constexpr (BYTES == 16) {  // streamed once: keep it out of L1
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;\n" ::"r"(dst_addr), "l"(src),
                 "n"(BYTES), "r"(src_bytes));
  }
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// ---- Tensor copies (global -> shared by the copy engine, sm_90) --------------------------------

// A tensor copy moves a box of a pool (16 token rows of a warp's slice) to shared memory without
// the load/store pipe, from a tensor map the host encodes per launch, and counts its bytes on an
// mbarrier in shared memory (its transaction count), which the consuming threads wait on. Each
// stage of a warp's ring has one barrier, with one arrival per filling.
//
// Tensor copies, the barriers' transaction counts and their initialisation fence need sm_90: a kernel
// compiled for an older architecture copies every tile with cp.async, whatever the launch's maps
// say, and synchronises its stages as before (cp.async groups and warp barriers alone).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kArchHasTensorCopies = false;
#else
constexpr bool kArchHasTensorCopies = true;
#endif
struct DecodeTensorMaps {
  CUtensorMap k;      // K pool: [pages][block_size rows][row bytes], box: a warp's slice of 16 rows
  CUtensorMap codes;  // V code rows, the same box shape
  // V scale rows, [pages][block_size rows][row scale bytes]; box: 16 bytes of 16 rows, from the warp's
  // slice's scales on (the narrowest box a tensor copy moves)
  CUtensorMap scales;
  uint32_t enabled;         // 0: the threads copy every tile (cp.async)
  uint32_t scales_enabled;  // with enabled: the scales by the copy engine too (0: by the threads)
};

// The barrier helpers and copy_box take shared-memory addresses (shared_address): a warp computes
// its barriers' addresses once, not per tile.
__device__ __forceinline__ void barrier_init(uint32_t barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(barrier));
}
// Makes initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// The filling thread's arrival, announcing `bytes` to come from tensor copies (0: none).
__device__ __forceinline__ void barrier_arrive_expecting(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void barrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}
// True in one lane of the warp (all lanes active; sm_90, like the tensor copies). Where lane 0 alone
// issues a tensor copy, whose operands must be uniform, the compiler wraps it in a loop over the
// active lanes, since it cannot tell that only one is; an elected lane needs no loop.
__device__ __forceinline__ bool elect_one_lane() {
  uint32_t elected;
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}
// Programmatic dependent launch (sm_90 code, as kArchHasTensorCopies): each decode CTA allows the
// merge kernel's launch once it has read its last tile, so that the merge's launch overlaps the
// decode's last epilogues; the merge kernel waits for the whole decode grid (its completion and
// its writes) before it reads the partials. Without the launch attribute both are no-ops.
__device__ __forceinline__ void allow_dependent_launch() {
  if constexpr (kArchHasTensorCopies) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
  if constexpr (kArchHasTensorCopies) asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Fetches a tensor map (a kernel parameter) into the copy engine's descriptor cache ahead of the
// first copy that uses it.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}
// The box of `map` at (byte x of a row, row y of a page, page z) into `dst` (128-byte aligned),
// counted on `barrier`.
__device__ __forceinline__ void copy_box(uint32_t dst, const CUtensorMap& map, int x, int y, int z, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(z), "r"(barrier)
      : "memory");
}

// ---- Code reads from shared memory -------------------------------------------------------------

// Reads the BYTES code bytes at byte `offset` of `row` (shared memory, 4-byte aligned) into
// little-endian 32-bit words w[0..]. (Offsets, not a shifted address: the pointer must stay one
// the compiler knows to be in shared memory.)
// Chunks whose size is a multiple of 4 are naturally aligned and read as they are; others (6
// bytes for 3-bit codes at head_dim 128, ...) are read as the aligned words that cover them and
// shifted into place. Only the words that the chunk reaches into are read: a fixed count would read
// past the end of the last row of a stage (3-byte chunks at offset 21 of a 24-byte row), into bytes
// that another warp's copies may be writing.
template <int BYTES>
struct CodeChunk {
  static constexpr int kNaturalAlign = BYTES % 8 == 0 ? 8 : BYTES % 4 == 0 ? 4 : BYTES % 2 == 0 ? 2 : 1;
  static constexpr int kMaxMisalign = kNaturalAlign >= 4 ? 0 : 4 - kNaturalAlign;
  static constexpr int kLoadWords = (BYTES + kMaxMisalign + 3) / 4;
  static constexpr int kWords = (BYTES + 3) / 4 + 1;  // one spare zero word for code_chunk's funnel shift
};

template <int BYTES>
__device__ __forceinline__ void read_code_bytes(const uint8_t* row, uint32_t offset,
                                                uint32_t (&w)[CodeChunk<BYTES>::kWords]) {
  using C = CodeChunk<BYTES>;
  const uint8_t* src = row + offset;
#pragma unroll
  for (int i = 0; i < C::kWords; ++i) w[i] = 0;
  if constexpr (C::kNaturalAlign == 8) {
#pragma unroll
    for (int i = 0; i < BYTES / 8; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(src)[i];
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else if constexpr (C::kNaturalAlign == 4) {
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) w[i] = reinterpret_cast<const uint32_t*>(src)[i];
  } else {
    const uint32_t* aligned = reinterpret_cast<const uint32_t*>(row + (offset & ~3u));
    const uint32_t shift = (offset & 3) * 8;
    uint32_t raw[C::kLoadWords + 1];
#pragma unroll
    for (int i = 0; i < C::kLoadWords; ++i)  // only the words the chunk reaches into
      raw[i] = 4 * i < BYTES || 4 * i < int(offset & 3) + BYTES ? aligned[i] : 0u;
    raw[C::kLoadWords] = 0;
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
  }
}

// Codes of two tokens A and B, paired: the level table below is indexed by a(e) | b(e) << BITS.
// A thread's codes are consecutive BITS-bit fields (FORMAT §3.3: within a group the codes are one
// little-endian stream; the 3-bit triplets are the same stream). They are taken in chunks of
// kCodesPerChunk codes that lie whole in 32 bits (8 for 3 bits: 24 bits), and each chunk of A and
// B becomes two words whose 2·BITS-bit fields are the pair indices of its even and its odd
// elements: one select (LOP3) per word instead of two extractions per element.
template <int BITS>
struct CodePairs {
  static constexpr int kCodesPerChunk = BITS == 3 ? 8 : 32 / BITS;
  static constexpr uint32_t kFieldMask = (1u << BITS) - 1;
  // The fields of the even elements of a chunk, where the pair index of element 2f lands.
  static constexpr uint32_t even_fields() {
    uint32_t m = 0;
    for (int f = 0; f < kCodesPerChunk / 2; ++f) m |= kFieldMask << (2 * BITS * f);
    return m;
  }
  static constexpr uint32_t kEven = even_fields();
};

// Chunk `c` of a code stream held in words w[] (bit 0 = first code of the stream).
template <int BITS, int WORDS>
__device__ __forceinline__ uint32_t code_chunk(const uint32_t (&w)[WORDS], int c) {
  const int bit = c * CodePairs<BITS>::kCodesPerChunk * BITS;
  return bit % 32 == 0 ? w[bit / 32] : __funnelshift_r(w[bit / 32], w[bit / 32 + 1], bit % 32);
}

// Pair-index words of one chunk: pairs[0] holds a(2f) | b(2f) << BITS in field f, pairs[1] the
// same for the odd elements 2f + 1 (fields of 2·BITS bits).
template <int BITS>
__device__ __forceinline__ void pair_words(uint32_t a, uint32_t b, uint32_t (&pairs)[2]) {
  constexpr uint32_t kEven = CodePairs<BITS>::kEven;
  pairs[0] = (a & kEven) | ((b << BITS) & ~kEven);
  pairs[1] = ((a >> BITS) & kEven) | (b & ~kEven);
}

// The level-pair table in shared memory: kCopies copies of each entry side by side (32-bit word
// e·kCopies + c), lane l reading copy l % kCopies. A warp looks up random entries: with one copy,
// lanes that want different entries of one bank wait on each other (3 bits: 64 entries in 32 banks,
// two-way on average). With a copy per lane (3 bits: 8 KB) every lane reads a bank of its own. 2 bits
// need no copies (16 entries, each in a bank of its own); a copy per lane of the 4-bit table would
// take 32 KB, and a CTA per SM, as the 8 KB would at head_dim 512 (whose CTA needs more shared
// memory for the query and the score exchange).
template <int BITS, int HEAD_DIM>
struct LevelPairTable {
  static constexpr int kEntries = 1 << (2 * BITS);
  static constexpr int kCopies = BITS == 3 && HEAD_DIM <= 256 ? 32 : 1;
  static constexpr int kWords = kEntries * kCopies;
  static constexpr int kEntryShift = kCopies == 32 ? 7 : 2;  // byte offset of entry e in copy 0: e << kEntryShift
  static_assert(4 * kCopies == 1 << kEntryShift, "entries are kCopies words apart");
};

// Byte offset in copy 0 of the level-pair table of the pair of field f in a pair-index word.
template <int BITS, int HEAD_DIM>
__device__ __forceinline__ uint32_t pair_offset(uint32_t pairs, int f) {
  constexpr int kEntryShift = LevelPairTable<BITS, HEAD_DIM>::kEntryShift;
  constexpr uint32_t kMask = ((1u << (2 * BITS)) - 1) << kEntryShift;
  const int shift = 2 * BITS * f - kEntryShift;
  return (shift >= 0 ? pairs >> shift : pairs << -shift) & kMask;
}

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

// Position -> (block, offset) by the runtime block size with a multiply and a shift
// (round-up reciprocal, exact for positions < 2^31; the host computes multiplier and shift).
__device__ __forceinline__ void split_position(const DecodeArgs& a, uint32_t pos, uint32_t& block,
                                               uint32_t& offset) {
  block = uint32_t((uint64_t(__umulhi(pos, a.block_size_multiplier)) + pos) >> a.block_size_shift);
  offset = pos - block * a.block_size;
}

// The output o / l of a head whose maximum score is m (log2 domain), with l = 0 (no attended
// position) giving 0 (FORMAT §5) and a NaN l staying NaN. An attention sink (logit sink2, log2
// domain; -inf = none) joins the denominator: o·2^(m−M) / (l·2^(m−M) + 2^(sink2−M)), M = max(m, sink2).
__device__ __forceinline__ float normalize(float o, float l, float m, float sink2) {
  if (sink2 == -INFINITY) return l == 0.0f ? 0.0f : o / l;
  const float top = fmaxf(m, sink2);
  const float scale = exp2f(m - top);  // 0 where nothing was attended (m = -inf)
  return o * scale / (l * scale + exp2f(sink2 - top));
}

// The sink logit of query head `head` in the log2 domain, or -inf without sinks.
__device__ __forceinline__ float sink_log2(const DecodeArgs& a, uint64_t head) {
  return a.sinks == nullptr ? -INFINITY : a.sinks[head] * kLog2e;
}

// Multi-token decode (DecodeArgs::query_start): the query rows [row0, row0 + q_len) of sequence
// `seq`, or its one row without query_start. False where query_start is inconsistent (negative,
// decreasing, q_len > max_q_len, or past num_query_rows in checked mode): the sequence is skipped.
__device__ __forceinline__ bool sequence_query_rows(const DecodeArgs& a, uint32_t seq, uint32_t& row0, int& q_len) {
  if (a.query_start == nullptr) {
    row0 = seq;
    q_len = 1;
    return true;
  }
  const int32_t first = a.query_start[seq];
  const int32_t end = a.query_start[seq + 1];
  row0 = uint32_t(first);
  q_len = int(int64_t(end) - first);
  return first >= 0 && end >= first && q_len <= int(a.max_q_len) &&
         (!a.index_check.enabled() || uint32_t(end) <= a.num_query_rows);
}

// FORMAT §5: a seq_len beyond the block table is clamped to it, so that no read leaves the table.
__device__ __forceinline__ int clamped_seq_len(const DecodeArgs& a, int given_seq_len) {
  const int table_positions = int(a.max_blocks_per_seq * a.block_size);  // < 2^31, validated
  return min(max(given_seq_len, 0), table_positions);
}

// The first position of the sliding window of a query token that attends the positions before `end`.
__device__ __forceinline__ int window_start(const DecodeArgs& a, int end) {
  return (a.sliding_window > 0 && end > int(a.sliding_window)) ? end - int(a.sliding_window) : 0;
}

// ---- Split slots ---------------------------------------------------------------------------------
// With splits the grid holds num_splits CTAs per sequence (for each KV head and query chunk): the
// split slots. Each sequence takes num_splits of them, of split_tokens positions each, except with
// DecodePlan::length_shares: a batch of mixed lengths would then leave the short sequences' CTAs
// idle and give the long ones few, so the slots are shared by length: every sequence gets one, and
// the others go to the sequences in proportion to the tiles that their last query token attends,
// a sequence taking at most one split per kDecodeMinSplitTiles tiles and kDecodeMaxSplits
// partials per query head; the splits of a share divide its range evenly. The decode CTAs and the
// merge kernel all compute the shares from seq_lens in the same order, so they agree and a result
// is deterministic for given inputs. Slots after the last share stay idle.
struct SplitShare {
  uint32_t seq;
  uint32_t first;  // the sequence's slots first ... first + count - 1 hold its splits 0 ... count - 1
  uint32_t count;  // 0: an idle slot
  int seq_len;     // seq_lens[seq] as given, read once by the search (unset for an idle slot)
};

// The weight of a sequence's share, given its seq_len: the tiles that its last query token attends.
// (Capped at `cap`, which keeps the weights' sum under 2^31.)
__device__ __forceinline__ uint32_t share_weight(const DecodeArgs& a, int given_seq_len, uint32_t cap) {
  const int end = clamped_seq_len(a, given_seq_len);
  return min(uint32_t(end / kTileTokens + (end % kTileTokens != 0) - window_start(a, end) / kTileTokens), cap);
}

// Exclusive prefix sum of x over the THREADS threads of the CTA (in thread order), and their total;
// scratch holds THREADS / 32 values.
template <int THREADS>
__device__ uint32_t block_exclusive_sum(uint32_t x, uint32_t& total, uint32_t* scratch) {
  const int lane = threadIdx.x % 32;
  uint32_t inclusive = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t below = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += below;
  }
  __syncthreads();  // scratch may still be read by an earlier sum
  if (lane == 31) scratch[threadIdx.x / 32] = inclusive;
  __syncthreads();
  uint32_t before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    before += w < int(threadIdx.x / 32) ? scratch[w] : 0;
    total += scratch[w];
  }
  return before + inclusive - x;
}

// The share of sequence `key` (BY_SLOT false), or the share that holds split slot `key` (BY_SLOT
// true; count 0 where the slot is idle), also left in found_s. Called by all THREADS threads of
// the CTA, with length_shares; found_s and scratch (THREADS / 32 values) in shared memory.
template <int THREADS, bool BY_SLOT>
__device__ SplitShare split_share(const DecodeArgs& a, const DecodePlan& plan, uint32_t key, uint32_t* scratch,
                                  SplitShare& found_s) {
  const uint32_t num_seqs = a.num_seqs;
  const uint32_t extra_slots = num_seqs * (plan.num_splits - 1);  // the grid's size < 2^31
  const uint32_t most_splits = kDecodeMaxSplits / plan.stream_partials;
  const uint32_t weight_cap = 0x7fffffffu / num_seqs;
  // The sequences go THREADS at a time, a thread each; a batch of THREADS or fewer (the usual one)
  // needs one pass, whose weights and sums the placement then takes as they are.
  const bool one_pass = num_seqs <= THREADS;
  const uint32_t own_seq = threadIdx.x;
  const int own_seq_len = one_pass && own_seq < num_seqs ? a.seq_lens[own_seq] : 0;
  const uint32_t own_weight = share_weight(a, own_seq_len, weight_cap);
  uint32_t total_weight = 0, own_before = 0;
  if (one_pass) {
    own_before = block_exclusive_sum<THREADS>(own_weight, total_weight, scratch);
  } else {
    for (uint32_t first_seq = 0; first_seq < num_seqs; first_seq += THREADS) {
      const uint32_t seq = first_seq + threadIdx.x;
      uint32_t weight;
      block_exclusive_sum<THREADS>(seq < num_seqs ? share_weight(a, a.seq_lens[seq], weight_cap) : 0, weight, scratch);
      total_weight += weight;
    }
  }
  // The slots past one per sequence that go to the sequences whose weights precede `weight`: any
  // nondecreasing function from 0 at 0 to all of them at the total makes the shares sum to the
  // slots, so single precision does (and needs no division routine, whose call spilled registers
  // of the tile loop).
  const float extra_per_weight = total_weight == 0 ? 0.0f : __fdividef(float(extra_slots), float(total_weight));
  auto extra_before = [&](uint32_t weight) {
    return weight >= total_weight ? extra_slots : min(extra_slots, uint32_t(float(weight) * extra_per_weight));
  };
  if (threadIdx.x == 0) found_s = SplitShare{0, 0, 0, 0};
  uint32_t weight_before = 0, slots_before = 0;
  for (uint32_t first_seq = 0; first_seq < num_seqs; first_seq += THREADS) {
    const uint32_t seq = first_seq + threadIdx.x;
    uint32_t chunk_weight = total_weight, chunk_slots;
    const int seq_len = one_pass ? own_seq_len : seq < num_seqs ? a.seq_lens[seq] : 0;
    const uint32_t weight = one_pass ? own_weight : share_weight(a, seq_len, weight_cap);
    const uint32_t before =
        one_pass ? own_before : weight_before + block_exclusive_sum<THREADS>(weight, chunk_weight, scratch);
    uint32_t count = 0;
    if (seq < num_seqs) {
      count = 1 + extra_before(before + weight) - extra_before(before);
      count = min(count, max(weight / kDecodeMinSplitTiles, 1u));
      count = min(count, most_splits);
    }
    const uint32_t first = slots_before + block_exclusive_sum<THREADS>(count, chunk_slots, scratch);
    if (count > 0 && (BY_SLOT ? key >= first && key < first + count : key == seq))
      found_s = SplitShare{seq, uint32_t(first), uint32_t(count), seq_len};
    weight_before += chunk_weight;
    slots_before += chunk_slots;
  }
  __syncthreads();
  return found_s;
}

// Where the partial `partial` (split · stream_partials + stream) of a sequence's query row
// `row_in_seq` (token · num_q_heads + head) lies in the workspace: a share's partials follow
// each other per row, the rows of a sequence each other, and the sequences in slot order.
__device__ __forceinline__ float* partial_address(const DecodePlan& plan, const SplitShare& share, uint32_t rows_per_seq,
                                                  uint32_t row_in_seq, uint32_t partial, int head_dim) {
  const uint64_t slot_row = uint64_t(share.first) * rows_per_seq + uint64_t(row_in_seq) * share.count;
  return plan.workspace + (slot_row * plan.stream_partials + partial) * uint64_t(head_dim + 2);
}

// 2^x on the special function unit (ex2.approx.ftz: relative error ~2^-22, results below 2^-126
// flushed to 0, 2^-inf = 0, NaN stays NaN). exp2f adds a range fix-up of four instructions for
// subnormal results, which softmax weights that are rounded to fp16 next do not need.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) for logit soft-capping: 1 − 2 / (e^(2x) + 1), exact to a few float ulps in absolute
// terms (which is what a score needs) and ±1 for large |x|.
__device__ __forceinline__ float soft_cap_tanh(float x) {
  return 1.0f - __fdividef(2.0f, exp2f(x * (2.0f * kLog2e)) + 1.0f);
}

// ---- The kernel --------------------------------------------------------------------------------

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

template <int BITS, int HEAD_DIM, int CODE_COPY, bool EXTENDED, bool GROUPED, bool SHARES>
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

  // Query chunk to fp16, scaled by a power of two so that its largest finite magnitude fits
  // fp16's range; the factor is undone in the score scale (exact). Non-finite elements do not
  // take part, so an Inf or NaN stays in its own head (RELIABILITY.md §4.3).
  // q_at(i): element i = c·HEAD_DIM + d of the chunk, column c, dimension d; with head groups
  // element (k·num_columns + c)·HEAD_DIM + d is column c of the group's k-th KV head, held in q_s
  // row k·kHeadsPerCta + c. Returns the gain.
  auto load_query = [&](auto q_at) {
    float q_absmax = 0.0f;
    for (int i = tid; i < L::kKvHeads * num_columns * HEAD_DIM; i += kDecodeThreads) {
      const float magnitude = fabsf(__bfloat162float(__ushort_as_bfloat16(q_at(i))));
      if (magnitude <= FLT_MAX) q_absmax = fmaxf(q_absmax, magnitude);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q_absmax = fmaxf(q_absmax, __shfl_xor_sync(0xffffffffu, q_absmax, o));
    if (lane == 0) q_absmax_s[warp] = q_absmax;
    __syncthreads();
    q_absmax = fmaxf(fmaxf(q_absmax_s[0], q_absmax_s[1]), fmaxf(q_absmax_s[2], q_absmax_s[3]));
    int q_exp = 0;
    if (q_absmax > 0.0f) frexpf(q_absmax, &q_exp);  // q_absmax < 2^q_exp
    q_exp = max(q_exp, 15 - 127);  // the gain stays a finite float even for subnormal queries
    const float gain = ldexpf(1.0f, 15 - q_exp);
    for (int i = tid; i < L::kQRows * HEAD_DIM; i += kDecodeThreads) {
      const int h = i / HEAD_DIM;
      const int column = GROUPED ? h % kHeadsPerCta : h;
      const int element = GROUPED ? (h / kHeadsPerCta * num_columns + column) * HEAD_DIM + i % HEAD_DIM : i;
      const float v = column < num_columns ? __bfloat162float(__ushort_as_bfloat16(q_at(element))) : 0.0f;
      q_s[h][i % HEAD_DIM] = __float2half_rn(v * gain);
    }
    return gain;
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
  if (reports && EXTENDED && q_len > seq_len) a.index_check.report(FP8KTURBOV_INDEX_ERROR_QUERY_START);
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
    // Online-softmax state for heads 2t and 2t+1 (identical in the 8 lanes sharing t). The
    // reference maximum that the weights and sums are relative to is the maximum of the scores seen
    // when it last moved, which it does only when a score exceeds it by more than
    // kRescaleSlackLog2 (lazy rescaling). Weights stay <= 2^kRescaleSlackLog2, well inside fp16,
    // and a tile whose scores stay under the reference skips the max reduction and the rescale.
    // It is held as the two values that each tile reads, set only when it moves: run_reference (0
    // while the column has seen nothing, so that a masked row's weight is 2^-inf = 0) and
    // run_limit (reference + slack; -inf while the column has seen nothing).
    constexpr float kRescaleSlackLog2 = 8.0f;
    float run_reference[2] = {0.0f, 0.0f};
    float run_limit[2] = {-INFINITY, -INFINITY};
    auto reference_max = [&](int c) { return run_limit[c] == -INFINITY ? -INFINITY : run_reference[c]; };
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
    for (int i = tid; i < LevelPairs::kWords; i += kDecodeThreads) {
      const int e = i / LevelPairs::kCopies;
      level_pair_s[i] = half2_bits(kCodebookTable<BITS>.levels[e & ((1 << BITS) - 1)], kCodebookTable<BITS>.levels[e >> BITS]);
    }
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
      if (__any_sync(0xffffffffu, exceeds)) {
        float alpha[2];
  #pragma unroll
        for (int c = 0; c < 2; ++c) {
          float tile_max = fmaxf(masked_s[c], masked_s[2 + c]);
  #pragma unroll
          for (int o = 4; o < 32; o <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
          const float old_max = reference_max(c);
          const float new_max = fmaxf(old_max, tile_max);
          alpha[c] = new_max == -INFINITY ? 1.0f : exp2_fast(old_max - new_max);
          run_reference[c] = new_max == -INFINITY ? 0.0f : new_max;
          run_limit[c] = new_max + kRescaleSlackLog2;
          run_denom[c] *= alpha[c];
        }
  #pragma unroll
        for (int i = 0; i < S::kMTiles; ++i) {
          acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
        }
      }
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
      if (!skip) {
        // P^T as the B operand: mma rows (2t, 2t+1) and (2t+8, 2t+9) of head g.
        const uint32_t pb0 = transpose_8x8(p_lo);
        const uint32_t pb1 = transpose_8x8(p_hi);
        // This thread's codes and scales of the tokens of mma rows 2t, 2t+1, 2t+8, 2t+9;
        // scales as fp16 pairs of rows (2t, 2t+1) and (2t+8, 2t+9).
        uint32_t codes[4][CodeChunk<S::kCodeBytes>::kWords];
        uint32_t scale_bytes[4];
  #pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int row = v_row_first + Rows::v_row_offset(j);
          read_code_bytes<S::kCodeBytes>(stage.codes + row * S::kCodeRowBytes, g * S::kCodeBytes, codes[j]);
          scale_bytes[j] = stage.scales[row * S::kScaleRowPitch + g * S::kThreadDims / kGroupElems];
        }
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
        const uint8_t* level_pairs = reinterpret_cast<const uint8_t*>(level_pair_s);
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
        // With m = -inf no stream has a finite score: its sums are 0 (no positions) or NaN.
        const float w = m == -INFINITY ? 1.0f : exp2f(max_s[st][h] - m);
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

// Block-wide reductions of the merge kernel (THREADS a multiple of 32, <= 1024); every thread gets
// the result. The order is fixed, so results are deterministic.
template <int THREADS, typename Op>
__device__ __forceinline__ float block_reduce(float x, Op op, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();  // scratch may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) x = op(x, scratch[w]);
  return x;
}

// Splits whose partial elements a merge thread loads at once: one round of L2 latency per this many.
constexpr int kMergeLoadBatch = 32;

// Combines the splits' partials of one (sequence, query token, query head): the splits' weights
// are computed once, in parallel, then every thread sums its element over the splits in order,
// its loads kMergeLoadBatch at a time (predicated, so a short last batch costs no serial tail);
// the first batch is requested before the weights, so its latency overlaps theirs. EXTENDED as for
// the decode kernel: the default decode gets an instance without the multi-token indexing and the
// rotation.
template <int HEAD_DIM, bool EXTENDED, bool SHARES>
__global__ void __launch_bounds__(HEAD_DIM) merge_splits_kernel(const DecodeArgs a, const DecodePlan plan) {
  __shared__ float weight_s[kDecodeMaxSplits];  // per partial
  __shared__ float scratch[HEAD_DIM / 32];
  __shared__ float row_s[HEAD_DIM];  // rotated V: the merged row, rotated back by the first warp
  const uint32_t row = blockIdx.x;  // (sequence * max_q_len + token) * num_q_heads + head (< 2^31)
  // The output's (query row, head) index: row itself with one token per sequence.
  uint64_t out_row = row;
  if constexpr (EXTENDED) {
    const uint32_t seq_token = row / a.num_q_heads;
    const uint32_t token = seq_token % a.max_q_len;
    uint32_t row0;
    int q_len;
    if (!sequence_query_rows(a, seq_token / a.max_q_len, row0, q_len) || int(token) >= q_len)
      return;  // no partials: the decode kernel skipped the sequence, or it has fewer tokens
    out_row = uint64_t(row0 + token) * a.num_q_heads + row % a.num_q_heads;
  }
  const int tid = threadIdx.x;
  // The shares read seq_lens only, so they are found while the decode grid still runs.
  const uint32_t rows_per_seq = (EXTENDED ? a.max_q_len : 1u) * a.num_q_heads;
  const uint32_t seq = row / rows_per_seq;
  __shared__ SplitShare share_s;
  __shared__ uint32_t share_scratch[HEAD_DIM / 32];
  const bool length_shares = EXTENDED ? plan.length_shares : SHARES;  // as in the decode kernel
  const SplitShare share = length_shares ? split_share<HEAD_DIM, false>(a, plan, seq, share_scratch, share_s)
                                              : SplitShare{seq, seq * plan.num_splits, plan.num_splits, 0};
  const int num_partials = int(share.count * plan.stream_partials);
  const float* parts = partial_address(plan, share, rows_per_seq, row % rows_per_seq, 0, HEAD_DIM);
  wait_for_prerequisite_grid();
  float batch[kMergeLoadBatch];  // this thread's elements of splits s0 ... s0 + kMergeLoadBatch - 1
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int k = 0; k < kMergeLoadBatch; ++k)
      batch[k] = s0 + k < num_partials ? parts[(s0 + k) * (HEAD_DIM + 2) + tid] : 0.0f;
  };
  load_batch(0);
  float m = -INFINITY;
  for (int s = tid; s < num_partials; s += HEAD_DIM) m = fmaxf(m, parts[s * (HEAD_DIM + 2) + HEAD_DIM]);
  m = block_reduce<HEAD_DIM>(m, [](float x, float y) { return fmaxf(x, y); }, scratch);
  float l = 0.0f;
  for (int s = tid; s < num_partials; s += HEAD_DIM) {
    const float* part = parts + s * (HEAD_DIM + 2);
    const float w = m == -INFINITY ? 1.0f : exp2f(part[HEAD_DIM] - m);  // as in the stream merge
    weight_s[s] = w;
    l += w * part[HEAD_DIM + 1];
  }
  l = block_reduce<HEAD_DIM>(l, [](float x, float y) { return x + y; }, scratch);  // also publishes weight_s
  float o = 0.0f;
  for (int s0 = 0; s0 < num_partials; s0 += kMergeLoadBatch) {
    if (s0 > 0) load_batch(s0);
#pragma unroll
    for (int k = 0; k < kMergeLoadBatch; ++k)
      if (s0 + k < num_partials) o += weight_s[s0 + k] * batch[k];
  }
  if constexpr (EXTENDED && kRotatableHeadDim<HEAD_DIM>) {
    if (a.rotated_v) {  // FORMAT §6: the partials are of rotated V
      row_s[tid] = o;
      __syncthreads();
      if (tid < 32) unrotate_row<HEAD_DIM>(row_s, tid);
      __syncthreads();
      o = row_s[tid];
    }
  }
  const float out = normalize(o, l, m, sink_log2(a, row % a.num_q_heads));
  a.output[out_row * HEAD_DIM + tid] = __bfloat16_as_ushort(__float2bfloat16(out));
}

// A decode kernel instance and the dynamic shared memory it runs with.
struct DecodeInstance {
  const void* kernel;  // null where the instance is not built
  int smem_bytes;
};

// The decode kernel instance for a pool layout (wide_code_copy: the shape's widest code copy, else
// 4 bytes), EXTENDED, GROUPED and SHARES. Head groups are built for some shapes only, and for the
// default decode only; the extended instance has no SHARES twin.
template <int BITS, int HEAD_DIM, bool EXTENDED, bool GROUPED = false, bool SHARES = false>
DecodeInstance decode_instance(bool wide_code_copy) {
  if constexpr ((GROUPED && (EXTENDED || !decode_head_groups_built(BITS, HEAD_DIM))) || (SHARES && EXTENDED)) {
    return {nullptr, 0};
  } else {
    constexpr int kWideCopy = DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy;
    const void* kernel =
        wide_code_copy
            ? reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM, kWideCopy, EXTENDED, GROUPED, SHARES>)
            : reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM, 4, EXTENDED, GROUPED, SHARES>);
    return {kernel, DecodeSmem<BITS, HEAD_DIM, GROUPED>::kBytes};
  }
}

// A positive value per device that the runtime is asked once (get: 0 where not asked yet, or for a
// device beyond the cache, which is then asked every time).
class PerDeviceCache {
 public:
  int get(int device) const { return cacheable(device) ? values_[device].load(std::memory_order_relaxed) : 0; }
  void put(int device, int value) {
    if (cacheable(device)) values_[device].store(value, std::memory_order_relaxed);
  }

 private:
  static bool cacheable(int device) { return device >= 0 && device < kDecodeMaxCachedDevices; }
  std::atomic<int> values_[kDecodeMaxCachedDevices] = {};
};

// Whether `kernel`, as it runs on the current device, is sm_90 code and so uses the tensor maps:
// the device is sm_90 or later and the library was built for it (a build without sm_90 code runs
// older code there). Every kernel of the library is built for the same architectures, so the
// first kernel asked answers for all, once per device.
inline bool runs_sm90_code(const void* kernel) {
  static PerDeviceCache cache;  // 1: no, 2: yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (const int known = cache.get(device)) return known == 2;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const bool sm90 = attributes.binaryVersion >= 90;
  cache.put(device, sm90 ? 2 : 1);
  return sm90;
}

// Whether the driver is CUDA 12.3 or later, which captures programmatic launches into graphs
// (programmatic edges); asked once.
inline bool driver_captures_programmatic_launches() {
  static const bool captures = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12030;
  }();
  return captures;
}

// cuTensorMapEncodeTiled of the driver, found once through the runtime (the library does not link
// the driver library); null where the driver lacks it.
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                       const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encoder = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &entry, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess) (void)cudaGetLastError();  // not to surface in the caller's next error check
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<TensorMapEncoder>(entry)
                                                                      : nullptr;
  }();
  return encoder;
}

// Page ids are int32: the page dimension of a pool's tensor map spans all of them (the copy engine
// reads only the boxes it is given; the pools' real extent is the caller's).
constexpr uint64_t kTensorMapPages = uint64_t(1) << 31;

// A tensor map of a pool seen as [pages][block_size rows][row_bytes] bytes, with boxes of
// `box_bytes` × 16 rows of one page. False where the layout does not allow one (the pool address and
// strides must be multiples of 16 bytes) or the driver cannot encode it.
inline bool encode_pool_map(CUtensorMap* map, const void* pool, uint64_t row_bytes, uint32_t block_size,
                            uint64_t page_stride, uint32_t box_bytes, CUtensorMapSwizzle swizzle) {
  const TensorMapEncoder encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(pool) % 16 != 0 || row_bytes % 16 != 0 || page_stride % 16 != 0)
    return false;
  const cuuint64_t dims[3] = {row_bytes, block_size, kTensorMapPages};
  const cuuint64_t strides[2] = {row_bytes, page_stride};
  const cuuint32_t box[3] = {box_bytes, uint32_t(kTileTokens), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(pool), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The tensor maps of a launch: K and V code rows where pages hold whole tiles and the code rows of
// a warp's slice are 16-byte multiples at 16-byte aligned offsets (the wide code-copy instance);
// else disabled, and the threads copy. `kernel`: the decode kernel that the launch runs.
template <int BITS, int HEAD_DIM>
DecodeTensorMaps decode_tensor_maps(const DecodeArgs& args, const void* kernel) {
  using S = DecodeShape<BITS, HEAD_DIM>;
  DecodeTensorMaps maps{};
  if (!runs_sm90_code(kernel)) return maps;  // it would ignore them
  if constexpr (S::kCodeRowBytes % 16 == 0 && S::kMaxCodeCopy == 16) {
    const uint64_t row_elems = uint64_t(args.num_kv_heads) * HEAD_DIM;
    maps.enabled =
        args.block_size % kTileTokens == 0 && args.v_code_copy_bytes >= 16 &&
        encode_pool_map(&maps.k, args.k_cache, row_elems, args.block_size, args.k_block_stride_bytes, S::kKRowBytes,
                        S::kKRowBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE) &&
        encode_pool_map(&maps.codes, args.v_cache, row_elems / 8 * BITS, args.block_size, args.v_block_stride_bytes,
                        S::kCodeRowBytes, CU_TENSOR_MAP_SWIZZLE_NONE);
    // The scale rows' map needs 16-byte multiples too (an even number of KV heads at head_dim 128).
    maps.scales_enabled =
        S::kScalesByTensorCopy && maps.enabled && encode_pool_map(&maps.scales, args.v_cache + args.v_data_section_bytes,
                                        row_elems / kGroupElems, args.block_size, args.v_block_stride_bytes,
                                        S::kScaleRowPitch, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  return maps;
}

// CTAs per cluster of a decode launch on sm_90 (launch_paged_decode).
constexpr unsigned kDecodeClusterCtas = 4;

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  const bool extended = args.query_start != nullptr || args.rotated_v;
  const bool wide_code_copy = args.v_code_copy_bytes >= DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy;
  // Head groups (stream_partials > 1): the planner allows them for the default decode only.
  const bool grouped = plan.stream_partials > 1, shares = plan.length_shares && !extended;
  const auto [kernel, smem_bytes] =
      extended            ? decode_instance<BITS, HEAD_DIM, true>(wide_code_copy)
      : grouped && shares ? decode_instance<BITS, HEAD_DIM, false, true, true>(wide_code_copy)
      : grouped           ? decode_instance<BITS, HEAD_DIM, false, true>(wide_code_copy)
      : shares            ? decode_instance<BITS, HEAD_DIM, false, false, true>(wide_code_copy)
                          : decode_instance<BITS, HEAD_DIM, false>(wide_code_copy);
  // Set on every launch: the attribute belongs to the current device's copy of the kernel. It is
  // not a stream operation, so launches stay capturable.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  DecodeArgs kernel_args = args;
  DecodePlan kernel_plan = plan;
  DecodeTensorMaps maps = decode_tensor_maps<BITS, HEAD_DIM>(args, kernel);
  void* params[] = {&kernel_args, &kernel_plan, &maps};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(args.num_seqs * plan.num_splits * args.num_kv_heads * plan.chunks_per_group);  // < 2^31
  config.blockDim = dim3(kDecodeThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  // On sm_90, where a (sequence, split) has a multiple of kDecodeClusterCtas CTAs, clusters of that
  // many consecutive ones: chunks and KV heads of one (sequence, split), which read the same token
  // rows of the pools (CTA order), then start side by side in one GPC, and their reads of those rows
  // meet in DRAM. The kernel uses nothing of the cluster: it changes where and when CTAs run, not
  // what they compute. Placed by load balance: with the default policy fewer clusters of 4 fit the
  // H200 at once (124 of 132). Up to head_dim 128 only, where it measured faster (up to -4 % on
  // the longest rows, short rows unchanged); at 256 it measured -2 ... +4 % (docs/PERFORMANCE.md,
  // log 53).
  cudaLaunchAttribute cluster[2] = {};
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = kDecodeClusterCtas;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  cluster[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  cluster[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
  if (HEAD_DIM <= kDecodeSliceDim && args.num_kv_heads * plan.chunks_per_group % kDecodeClusterCtas == 0 &&
      runs_sm90_code(kernel)) {
    config.attrs = cluster;
    config.numAttrs = 2;
  }
  err = cudaLaunchKernelExC(&config, kernel, params);
  if (err != cudaSuccess || decode_partials(plan) == 1) return err;
  const void* merge = extended ? reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, true, false>)
                      : shares   ? reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, false, true>)
                                 : reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, false, false>);
  cudaLaunchConfig_t merge_config{};
  merge_config.gridDim = dim3(args.num_seqs * args.max_q_len * args.num_q_heads);
  merge_config.blockDim = dim3(HEAD_DIM);
  merge_config.stream = stream;
  // A programmatic launch behind the decode kernel (allow_dependent_launch): about 0.7 µs less at
  // 1 x 1024 (docs/PERFORMANCE.md, log 57). Only for sm_90 code, and with a driver that captures
  // programmatic dependencies into graphs (CUDA 12.3).
  cudaLaunchAttribute programmatic{};
  programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic.val.programmaticStreamSerializationAllowed = 1;
  if (runs_sm90_code(kernel) && driver_captures_programmatic_launches()) {
    merge_config.attrs = &programmatic;
    merge_config.numAttrs = 1;
  }
  return cudaLaunchKernelExC(&merge_config, merge, params);
}

template <int BITS, int HEAD_DIM>
cudaError_t decode_ctas_per_sm(int device, bool head_groups, int* count) {
  static PerDeviceCache caches[2];  // the answers depend on the device only
  PerDeviceCache& cache = caches[head_groups];
  if ((*count = cache.get(device)) > 0) return cudaSuccess;
  // The default (not EXTENDED) kernel's: the other instances but the head groups' have its shared
  // memory size, and its twin for split shares as many CTAs per SM (decode_min_ctas_per_sm); the
  // head groups' hold more query rows.
  const auto [kernel, smem_bytes] =
      head_groups ? decode_instance<BITS, HEAD_DIM, false, true>(true) : decode_instance<BITS, HEAD_DIM, false>(true);
  if (kernel == nullptr) {  // head groups not built for this shape
    *count = 0;
    return cudaSuccess;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel, kDecodeThreads, smem_bytes);
  if (err != cudaSuccess) return err;
  if (*count < 1) *count = 1;
  cache.put(device, *count);
  return cudaSuccess;
}

}  // namespace fp8kturbov
