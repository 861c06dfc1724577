// Every byte rule of the fp8k_turbo{2,3,4}v format (docs/format.md, "FORMAT" below), in one place.
// Host and device code both include this header; nothing here launches anything.
#pragma once

#include <cfloat>
#include <cstdint>
#include <limits>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace fp8kturbov {

// FORMAT §3: a group is 16 consecutive elements of a token row with one E4M3 scale.
constexpr int kGroupElems = 16;
constexpr float kE4M3Max = 448.0f;

// FORMAT §1: head dims the kernels are instantiated for.
constexpr bool is_supported_head_dim(uint32_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256 || head_dim == 512;
}
constexpr bool is_supported_v_bits(uint32_t bits) { return bits >= 2 && bits <= 4; }

// FORMAT §3: bytes of packed codes per group (8, 6, 4 for 4, 3, 2 bits).
__host__ __device__ constexpr uint32_t v_group_bytes(uint32_t bits) { return 2 * bits; }

// FORMAT §2 and §3: packed page sizes in bytes, for a token row of n = num_kv_heads * head_dim.
constexpr uint64_t k_page_bytes(uint64_t block_size, uint64_t row_elems) {
  return block_size * row_elems;
}
constexpr uint64_t v_data_section_bytes(uint64_t block_size, uint64_t row_elems, uint32_t bits) {
  return block_size * row_elems / 8 * bits;  // row_elems % 16 == 0: exact, and no overflow first
}
constexpr uint64_t v_scale_section_bytes(uint64_t block_size, uint64_t row_elems) {
  return block_size * row_elems / kGroupElems;
}
constexpr uint64_t v_page_bytes(uint64_t block_size, uint64_t row_elems, uint32_t bits) {
  return v_data_section_bytes(block_size, row_elems, bits) +
         v_scale_section_bytes(block_size, row_elems);
}
static_assert(v_page_bytes(16, 128, 4) == 9 * 16 * 128 / 16, "FORMAT §3: 4-bit page is 9Bn/16");
static_assert(v_page_bytes(16, 128, 3) == 7 * 16 * 128 / 16, "FORMAT §3: 3-bit page is 7Bn/16");
static_assert(v_page_bytes(16, 128, 2) == 5 * 16 * 128 / 16, "FORMAT §3: 2-bit page is 5Bn/16");

// FORMAT §3.1: Lloyd–Max levels (code 0 … 2^b−1) and ascending decision bounds, as float32. They
// are compile-time constants: kernels read the tables derived from them (kCodebookTable below), and
// the 2-bit encoder compares with the bounds as immediates.
template <int BITS>
struct Codebook;
template <>
struct Codebook<4> {
  static constexpr float kLevels[16] = {-2.7326f, -2.0690f, -1.6180f, -1.2562f, -0.9423f, -0.6568f,
                                        -0.3880f, -0.1284f, 0.1284f,  0.3880f,  0.6568f,  0.9423f,
                                        1.2562f,  1.6180f,  2.0690f,  2.7326f};
  static constexpr float kBounds[15] = {-2.4008f, -1.8435f, -1.4371f, -1.0993f, -0.7996f,
                                        -0.5224f, -0.2582f, 0.0f,     0.2582f,  0.5224f,
                                        0.7996f,  1.0993f,  1.4371f,  1.8435f,  2.4008f};
};
template <>
struct Codebook<3> {
  static constexpr float kLevels[8] = {-2.1520f, -1.3440f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3440f, 2.1520f};
  static constexpr float kBounds[7] = {-1.748f, -1.050f, -0.501f, 0.0f, 0.501f, 1.050f, 1.748f};
};
template <>
struct Codebook<2> {
  static constexpr float kLevels[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
  static constexpr float kBounds[3] = {-0.9816f, 0.0f, 0.9816f};
};
// The largest level, which the matched-norm scale maps a group's largest magnitude to.
template <int BITS>
constexpr float kMaxLevel = Codebook<BITS>::kLevels[(1 << BITS) - 1];

// FORMAT §2: E4M3_rn_satfinite (round to nearest even, finite overflow saturates to ±448,
// NaN -> 0x7F). The hardware conversion does exactly this.
__device__ __forceinline__ uint8_t e4m3_encode(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_decode(uint8_t byte) {
  __nv_fp8_e4m3 v;
  v.__x = byte;
  return static_cast<float>(v);
}

// FORMAT §3.2 step 3 gives a value y the code "number of bounds that y reaches (y >= bound)". The
// encoders find it in one table lookup: the scaled values' range [-kMaxLevel, kMaxLevel] is cut into kCells
// equal cells, each narrower than the gaps between the bounds, and y's cell,
// min(floor(y * kCellsPerUnit + kCells / 2), kCells - 1) (0 for y below the range and for NaN), holds
// the code of the values just below the cell (`code_below`, the bounds that they reach) and the next
// bound, which is the only one that y can reach besides: code = code_below + (y >= bound). The count
// is the same, bit for bit, wherever the cell computation rounds: a cell's entry is made for its
// window widened by kCellSlack on both sides (the first and last cells reach to -inf and +inf), far
// beyond that rounding, and the compile-time check below keeps every window to one bound at most.
// With 2 bits (three bounds) two comparisons with the bounds themselves cost less than the lookup,
// and the codebook table has no cells.
struct CodeCell {
  float bound;          // the next bound (NaN where none is left: no value reaches it)
  uint32_t code_below;  // the code of the values below the cell's window
};
constexpr float kCellSlack = 1e-5f;  // in units of y; the cell computation's rounding is below 1e-6

template <int BITS>
struct CodeCells {
  static_assert(BITS >= 3, "2-bit codes are found without cells");
  using CB = Codebook<BITS>;
  static constexpr int kCells = 2 << BITS;  // cells 0.27 and 0.17 wide (3 and 4 bits)
  static constexpr float kCellsPerUnit = float(kCells) / (2.0f * kMaxLevel<BITS>);
  static constexpr int kBoundCount = (1 << BITS) - 1;
  // Every window holds at most one bound: the bounds are further apart than a widened cell, and the
  // first (last) window, which reaches to -inf (+inf), ends below the second (above the last but one).
  static constexpr bool windows_hold_one_bound() {
    const float window = 1.0f / kCellsPerUnit + 2.0f * kCellSlack;
    for (int i = 1; i < kBoundCount; ++i)
      if (CB::kBounds[i] - CB::kBounds[i - 1] <= window) return false;
    return CB::kBounds[1] > -kMaxLevel<BITS> + window && CB::kBounds[kBoundCount - 2] < kMaxLevel<BITS> - window;
  }
  static_assert(windows_hold_one_bound(), "a code cell's window holds at most one bound");

  // Entry `cell`, computed at compile time from the bounds (FORMAT §3.1): the bounds at or below a
  // window's lower end, y_cell − kCellSlack (y_cell = (cell − kCells / 2) / kCellsPerUnit, the cell's
  // lower edge; −inf for cell 0), are reached by every value in the window.
  static constexpr CodeCell entry(int cell) {
    const float window_low = float(cell - kCells / 2) / kCellsPerUnit - kCellSlack;
    uint32_t below = 0;
    for (int i = 0; cell > 0 && i < kBoundCount; ++i) below += CB::kBounds[i] <= window_low ? 1u : 0u;
    return {below < uint32_t(kBoundCount) ? CB::kBounds[below] : std::numeric_limits<float>::quiet_NaN(), below};
  }
};

// The codebook where the threads of a warp read different entries at once: the levels and, from 3
// bits, the code cells. It is computed at compile time and held in global memory (kCodebookTable),
// where a warp reads it in one coalesced request (constant memory would serialise different
// addresses); kernels that look entries up per value keep a copy in shared memory.
template <int BITS>
struct CodebookTable {
  float levels[1 << BITS];
  CodeCell cells[CodeCells<BITS>::kCells];
};
template <>
struct CodebookTable<2> {
  float levels[4];
};
template <int BITS>
constexpr CodebookTable<BITS> codebook_table() {
  CodebookTable<BITS> t{};
  for (int i = 0; i < (1 << BITS); ++i) t.levels[i] = Codebook<BITS>::kLevels[i];
  if constexpr (BITS >= 3) {
    for (int i = 0; i < CodeCells<BITS>::kCells; ++i) t.cells[i] = CodeCells<BITS>::entry(i);
  }
  return t;
}
template <int BITS>
__device__ const CodebookTable<BITS> kCodebookTable = codebook_table<BITS>();

// FORMAT §3.2 step 3: the code of y, by its code cell; with 2 bits, by the middle bound and then the
// outer bound on y's side (compile-time constants: no table read).
template <int BITS>
__device__ __forceinline__ uint32_t code_of(float y, const CodebookTable<BITS>& table) {
  if constexpr (BITS == 2) {
    constexpr float lower = Codebook<2>::kBounds[0], middle = Codebook<2>::kBounds[1], upper = Codebook<2>::kBounds[2];
    const bool upper_half = y >= middle;
    return (upper_half ? 2u : 0u) + (y >= (upper_half ? upper : lower) ? 1u : 0u);
  } else {
    using C = CodeCells<BITS>;
    // Float-to-integer conversion saturates: negative (and NaN) to 0.
    const uint32_t cell = min(__float2uint_rz(fmaf(y, C::kCellsPerUnit, float(C::kCells / 2))), uint32_t(C::kCells - 1));
    const CodeCell entry = table.cells[cell];
    return entry.code_below + (y >= entry.bound ? 1u : 0u);
  }
}

// FORMAT §3.2: the reference "matched-norm" encoder for one group of 16 values.
// Arithmetic is explicit round-to-nearest without fused multiply-add and the sums run
// sequentially, which makes the bytes identical to the original engine's (built with
// --fmad=false) and to the NumPy reference.
template <int BITS>
struct EncodedGroup {
  uint8_t codes[kGroupElems];
  uint8_t scale_byte;
};

template <int BITS>
__device__ __forceinline__ EncodedGroup<BITS> encode_v_group(const float (&x)[kGroupElems],
                                                             const CodebookTable<BITS>& table) {
  using CB = Codebook<BITS>;
  float n2 = 0.0f;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) {
    n2 = __fadd_rn(n2, __fmul_rn(x[i], x[i]));
    amax = fmaxf(amax, fabsf(x[i]));  // NaN-ignoring, as FORMAT §3.2 step 1
  }
  const float inv = amax > 1e-12f ? __fdiv_rn(kMaxLevel<BITS>, amax) : 1.0f;

  EncodedGroup<BITS> out;
  float r2 = 0.0f;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) {
    const uint32_t code = code_of<BITS>(__fmul_rn(x[i], inv), table);
    out.codes[i] = uint8_t(code);
    const float level = table.levels[code];
    r2 = __fadd_rn(r2, __fmul_rn(level, level));
  }
  const float root_r2 = __fsqrt_rn(r2);
  float s = root_r2 > 1e-10f ? __fdiv_rn(__fsqrt_rn(n2), root_r2) : 0.0f;
  s = s > kE4M3Max ? kE4M3Max : s;  // written so that NaN stays NaN (not fminf)
  out.scale_byte = e4m3_encode(s);
  return out;
}

// The MSE encoder (FP8KTURBOV_V_ENCODER_MSE; the reference's encode_v(encoder="mse")): each scale
// byte 0x00..0x7E in turn, the codes it implies (the bounds rule of FORMAT §3.2 step 3 applied to
// x / scale; byte 0x00 keeps x) and their squared error, all float32 with explicit rounding and
// sequential sums; the first byte with the least error wins. A group without a finite error (NaN,
// ±inf, or so large that every error overflows) takes the matched-norm encoding.
//
// Only the bytes that can win are evaluated, by LANES threads (1, or the 32 of a warp) at once; the
// result is the exhaustive search's, bit for bit. Every reconstructed value has a magnitude between
// l_min·s and k_max·s (the smallest and largest level magnitudes), so a candidate's error is at least
//   clip(s) = (amax − k_max·s)₊²           (the largest element, falling off the top level), and
//   low(s)  = Σ_i (l_min·s − |x_i|)₊²      (every element, pushed out to the nearest level).
// Both are computed with slack (factors 1 ± 1e-5, far beyond float32 rounding) so that they stay
// below the error the search itself would compute; a byte whose bound exceeds 1.001 × the
// matched-norm byte's error cannot win or tie, and is skipped. clip falls and low rises with the
// byte, so the bytes left form one range, found by bisection: about 10 to 40 of the 127 bytes for
// Gaussian data. A single thread also tightens the bound with the best error it has found and
// stops where low exceeds it.
template <int BITS>
__device__ __forceinline__ float mse_candidate_error(const float (&x)[kGroupElems], uint32_t byte,
                                                     const CodebookTable<BITS>& table, uint64_t& codes) {
  const float s = e4m3_decode(uint8_t(byte));
  codes = 0;  // code i at bits [BITS·i, BITS·i + BITS)
  float err = 0.0f;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) {
    const uint32_t code = code_of<BITS>(byte == 0 ? x[i] : __fdiv_rn(x[i], s), table);
    codes |= uint64_t(code) << (BITS * i);
    const float d = __fsub_rn(x[i], __fmul_rn(table.levels[code], s));
    err = __fadd_rn(err, __fmul_rn(d, d));
  }
  return err;
}

// The first byte in [begin, 0x7F) where `passes` (false, then true as the byte grows) holds, or 0x7F.
template <typename Predicate>
__device__ __forceinline__ uint32_t first_scale_byte(uint32_t begin, Predicate passes) {
  uint32_t end = 0x7F;
  while (begin < end) {
    const uint32_t mid = (begin + end) / 2;
    if (passes(mid)) end = mid; else begin = mid + 1;
  }
  return begin;
}

// The searching encoders' warp reduction: every lane gets the best of the lanes' (value, byte),
// `better` (a strict order) deciding and, of equal values, the smaller byte. Each lane searched its
// bytes in ascending order keeping the first of equal values, so this is the sequential search's
// choice.
template <typename Better>
__device__ __forceinline__ void warp_best_candidate(float& value, uint32_t& byte, Better better) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, o);
    const uint32_t other_byte = __shfl_xor_sync(0xffffffffu, byte, o);
    if (better(other_value, value) || (other_value == value && other_byte < byte)) {
      value = other_value;
      byte = other_byte;
    }
  }
}
__device__ __forceinline__ uint64_t shfl_u64(uint64_t value, int lane) {
  const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(value), lane);
  const uint32_t hi = __shfl_sync(0xffffffffu, uint32_t(value >> 32), lane);
  return uint64_t(lo) | (uint64_t(hi) << 32);
}
// A searching encoder's thread among the LANES that search a group: 1, a thread per group, or 32,
// the lanes of a warp called with the same group (every lane gets the encoding).
template <int LANES>
__device__ __forceinline__ uint32_t search_lane() {
  static_assert(LANES == 1 || LANES == 32, "a thread or a warp per group");
  return LANES == 1 ? 0 : threadIdx.x % 32;
}
// A searched group: its codes as packed by the candidate functions (code i at bits [BITS·i, BITS·i + BITS)).
template <int BITS>
__device__ __forceinline__ EncodedGroup<BITS> candidate_group(uint64_t codes, uint8_t scale_byte) {
  static_assert(BITS * kGroupElems <= 64, "a group's codes fit one 64-bit word");
  EncodedGroup<BITS> out;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) out.codes[i] = uint8_t((codes >> (BITS * i)) & ((1u << BITS) - 1));
  out.scale_byte = scale_byte;
  return out;
}

// The MSE encoder's search (above), by LANES threads (search_lane).
template <int BITS, int LANES>
__device__ __forceinline__ EncodedGroup<BITS> encode_v_group_mse(const float (&x)[kGroupElems],
                                                                 const CodebookTable<BITS>& table) {
  const uint32_t lane = search_lane<LANES>();
  const EncodedGroup<BITS> matched_norm = encode_v_group<BITS>(x, table);
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) {
    finite = finite && isfinite(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  if (!finite) return matched_norm;  // every candidate's error is NaN or +inf

  const float l_min = table.levels[1 << (BITS - 1)];  // the levels are symmetric about zero
  const float k_max = table.levels[(1 << BITS) - 1];
  uint64_t codes;
  float limit = __fmul_rn(1.001f, mse_candidate_error<BITS>(x, matched_norm.scale_byte, table, codes));
  auto clip_passes = [&](uint32_t byte) {  // +inf limit (no finite error known): every byte passes
    const float clip = fmaxf(__fsub_rn(amax, __fmul_rn(__fmul_rn(k_max, e4m3_decode(uint8_t(byte))), 1.00001f)), 0.0f);
    return __fmul_rn(clip, clip) <= limit;
  };
  auto low_fails = [&](uint32_t byte) {
    const float l_min_s = __fmul_rn(__fmul_rn(l_min, e4m3_decode(uint8_t(byte))), 0.99999f);
    float low = 0.0f;
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) {
      const float gap = fmaxf(__fsub_rn(l_min_s, fabsf(x[i])), 0.0f);
      low = __fadd_rn(low, __fmul_rn(gap, gap));
    }
    return low > limit;
  };
  const uint32_t first = first_scale_byte(0, clip_passes);
  const uint32_t end = first_scale_byte(first, low_fails);

  // Each lane searches bytes first + lane, first + lane + LANES, ... (ties keep its smaller byte);
  // then the warp keeps the least error, and of equal ones the smallest byte.
  float best_err = INFINITY;
  uint32_t best_byte = 0x7F;
  uint64_t best_codes = 0;
  for (uint32_t byte = first + lane; byte < end; byte += LANES) {
    if (LANES == 1 && low_fails(byte)) break;  // with the tightened bound: no later byte can win
    const float err = mse_candidate_error<BITS>(x, byte, table, codes);
    if (err < best_err) {
      best_err = err;
      best_byte = byte;
      best_codes = codes;
      if (LANES == 1) limit = fminf(limit, __fmul_rn(1.001f, err));
    }
  }
  if constexpr (LANES > 1) {
    warp_best_candidate(best_err, best_byte, [](float a, float b) { return a < b; });
    best_codes = shfl_u64(best_codes, int((best_byte - first) % LANES));  // from the lane that evaluated it
  }
  if (!(best_err <= FLT_MAX)) return matched_norm;
  return candidate_group<BITS>(best_codes, uint8_t(best_byte));
}

// The projection encoder (FP8KTURBOV_V_ENCODER_PROJECTION; the reference's
// encode_v(encoder="projection"), whose docstring is the exact rule): of the codes that the scale
// bytes 0x01..0x7E imply (the bounds rule of FORMAT §3.2 step 3 applied to x / scale), those of the
// least angle to x, i.e. the greatest q = <levels, x> / |levels| (the first byte of equal ones);
// then the scale xx / <levels, x> (xx = |x|², a compare to 448, E4M3), with which the decoded group
// keeps x's projection on its codes. All float32 with explicit rounding and sequential sums. A
// group where xx or the best q is not finite, or q is not > 0 (NaN, ±inf, all zero, or sums that
// overflow or vanish), takes the matched-norm encoding.
//
// Every byte is evaluated (q has no cheap bound to prune by), by LANES threads (1, or the 32 of a
// warp) at once: bytes 1 + lane, 1 + lane + LANES, ...; the result is the sequential search's.
template <int BITS>
__device__ __forceinline__ float projection_candidate_q(const float (&x)[kGroupElems], uint32_t byte,
                                                        const CodebookTable<BITS>& table, uint64_t& codes,
                                                        float& dot) {
  const float s = e4m3_decode(uint8_t(byte));
  codes = 0;  // code i at bits [BITS·i, BITS·i + BITS)
  dot = 0.0f;
  float ll = 0.0f;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) {
    const uint32_t code = code_of<BITS>(__fdiv_rn(x[i], s), table);
    codes |= uint64_t(code) << (BITS * i);
    const float level = table.levels[code];
    dot = __fadd_rn(dot, __fmul_rn(level, x[i]));
    ll = __fadd_rn(ll, __fmul_rn(level, level));
  }
  return __fdiv_rn(dot, __fsqrt_rn(ll));
}

// The projection encoder's search (above), by LANES threads (search_lane).
template <int BITS, int LANES>
__device__ __forceinline__ EncodedGroup<BITS> encode_v_group_projection(const float (&x)[kGroupElems],
                                                                        const CodebookTable<BITS>& table) {
  const uint32_t lane = search_lane<LANES>();
  float xx = 0.0f;
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) xx = __fadd_rn(xx, __fmul_rn(x[i], x[i]));

  float best_q = -INFINITY, best_dot = 0.0f;
  uint32_t best_byte = 0x7F;  // past the candidates: a lane that keeps none loses every tie
  uint64_t best_codes = 0, codes;
  for (uint32_t byte = 1 + lane; byte < 0x7F; byte += LANES) {
    float dot;
    const float q = projection_candidate_q<BITS>(x, byte, table, codes, dot);
    if (q > best_q) {  // NaN never wins
      best_q = q;
      best_byte = byte;
      best_dot = dot;
      best_codes = codes;
    }
  }
  if constexpr (LANES > 1) {
    warp_best_candidate(best_q, best_byte, [](float a, float b) { return a > b; });
    const int owner = int((best_byte - 1) % LANES);  // the lane that evaluated it
    best_codes = shfl_u64(best_codes, owner);
    best_dot = __shfl_sync(0xffffffffu, best_dot, owner);
  }
  if (!(isfinite(xx) && isfinite(best_q) && best_q > 0.0f)) return encode_v_group<BITS>(x, table);
  float s = __fdiv_rn(xx, best_dot);  // best_q > 0: best_dot > 0
  s = s > kE4M3Max ? kE4M3Max : s;
  return candidate_group<BITS>(best_codes, e4m3_encode(s));
}

// FORMAT §3.3: packing of 16 codes into 2*BITS bytes, little-endian bit order.
template <int BITS>
__device__ __forceinline__ void pack_group(const uint8_t (&codes)[kGroupElems],
                                           uint8_t (&bytes)[2 * BITS]) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < 8; ++j) bytes[j] = codes[2 * j] | (codes[2 * j + 1] << 4);
  } else if constexpr (BITS == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      bytes[j] = codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) |
                 (codes[4 * j + 3] << 6);
  } else {
#pragma unroll
    for (int t = 0; t < 2; ++t) {  // two 24-bit triplets of 8 codes each
      uint32_t triplet = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) triplet |= uint32_t(codes[8 * t + i]) << (3 * i);
      bytes[3 * t + 0] = triplet & 0xFF;
      bytes[3 * t + 1] = (triplet >> 8) & 0xFF;
      bytes[3 * t + 2] = (triplet >> 16) & 0xFF;
    }
  }
}

// FORMAT §3.3: code of element i (0…15) of a group whose packed bytes start at `bytes`.
template <int BITS>
__device__ __forceinline__ uint32_t unpack_code(const uint8_t* bytes, int i) {
  if constexpr (BITS == 4) {
    return (bytes[i >> 1] >> ((i & 1) * 4)) & 0xF;
  } else if constexpr (BITS == 2) {
    return (bytes[i >> 2] >> ((i & 3) * 2)) & 0x3;
  } else {
    const uint8_t* t = bytes + 3 * (i >> 3);
    const uint32_t triplet = t[0] | (uint32_t(t[1]) << 8) | (uint32_t(t[2]) << 16);
    return (triplet >> (3 * (i & 7))) & 0x7;
  }
}

// FORMAT §3: byte offsets of slot offset `o` inside a V page; group `g` counts from the row start.
struct VPageLayout {
  uint64_t row_data_bytes;   // n * b / 8
  uint64_t row_scale_bytes;  // n / 16
  uint64_t data_section_bytes;
  __host__ __device__ uint64_t data_offset(uint32_t o, uint32_t g, uint32_t bits) const {
    return o * row_data_bytes + uint64_t(g) * v_group_bytes(bits);
  }
  __host__ __device__ uint64_t scale_offset(uint32_t o, uint32_t g) const {
    return data_section_bytes + o * row_scale_bytes + g;
  }
};

// ---- The optional V rotation (FORMAT §6) -------------------------------------------------------

// The fixed signs: bit i of word i / 64 set <=> sign[i] = -1. S1 and S2 for head_dim 128, 256, 512.
static __constant__ const uint64_t kRotationSignWords[28] = {
    0x42F85949E46A0359ull, 0x49F250A9A4C63BBBull,                                              // S1_128
    0x3F628FDC16ACEE90ull, 0xBEA56562B7A5357Aull,                                              // S2_128
    0xFE5483E8C028BDDDull, 0x9A94A01800B54509ull, 0xDBBF19A357DE2FF8ull, 0xEBDA40343AFE2DC7ull,  // S1_256
    0x7682761DE85431D9ull, 0x8A4336C9A7532CC2ull, 0x65C15681E40C84FDull, 0x4B75DB54555AACC1ull,  // S2_256
    0xFE5483E8C028BDDDull, 0x9A94A01800B54509ull, 0xDBBF19A357DE2FF8ull, 0xEBDA40343AFE2DC7ull,  // S1_512:
    0x7682761DE85431D9ull, 0x8A4336C9A7532CC2ull, 0x65C15681E40C84FDull, 0x4B75DB54555AACC1ull,  // S1_256, S2_256
    0x5B0E056556746A09ull, 0x33754D8471316A21ull, 0x491196087363B6E8ull, 0x74E09D969DFA1143ull,  // S2_512
    0xD49B9E8DFD26399Eull, 0x3E65CA562BF53DB5ull, 0xAD67A2B67F01D99Cull, 0x3A6CBE9800803A7Bull};

// The head dims FORMAT §6 defines signs for (the host's validation asks too).
__host__ __device__ constexpr bool rotatable_head_dim(uint32_t head_dim) {
  return head_dim == 128 || head_dim == 256 || head_dim == 512;
}
template <int HEAD_DIM>
constexpr bool kRotatableHeadDim = rotatable_head_dim(HEAD_DIM);

template <int HEAD_DIM>
struct RotationSigns {
  static_assert(kRotatableHeadDim<HEAD_DIM>, "FORMAT §6 defines 128, 256, 512");
  static constexpr int kS1 = HEAD_DIM == 128 ? 0 : HEAD_DIM == 256 ? 4 : 12;  // word offsets
  static constexpr int kS2 = kS1 + HEAD_DIM / 64;
};

// The signs of elements [ELEMS·row_lane, ELEMS·row_lane + ELEMS) of a table at word `offset`.
template <int ELEMS>
__device__ __forceinline__ uint32_t rotation_sign_bits(int offset, uint32_t row_lane) {
  static_assert(64 % ELEMS == 0, "a lane's signs lie in one word");
  const uint32_t first = ELEMS * row_lane;
  return uint32_t(kRotationSignWords[offset + first / 64] >> (first % 64)) & ((1u << ELEMS) - 1);
}

// FORMAT §6 on one head row of HEAD_DIM floats spread over LANES = HEAD_DIM / ELEMS consecutive,
// aligned lanes of a warp (`mask`), lane row_lane holding elements ELEMS·row_lane + e in x[e]:
// the signs at `first` (exact), the Walsh-Hadamard butterflies (a, b) -> (a + b, a - b) over the
// element index bits in increasing order (the lane's own bits, then the lane bits through
// shuffles), float(1/sqrt(HEAD_DIM)), the signs at `second`. With (S1, S2) this is
// reference.rotate_f32 bit for bit; with (S2, S1) it is the inverse rotation.
template <int HEAD_DIM, int ELEMS>
__device__ __forceinline__ void hadamard_rotate(float (&x)[ELEMS], uint32_t row_lane, uint32_t mask, int first,
                                                int second) {
  constexpr int kLanes = HEAD_DIM / ELEMS;
  static_assert(kLanes >= 1 && kLanes <= 32, "a row spans at most one warp");
  const uint32_t first_signs = rotation_sign_bits<ELEMS>(first, row_lane);
#pragma unroll
  for (int e = 0; e < ELEMS; ++e)
    if ((first_signs >> e) & 1) x[e] = -x[e];
#pragma unroll
  for (int half = 1; half < ELEMS; half *= 2) {
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      if (i & half) continue;
      const float a = x[i], b = x[i + half];
      x[i] = __fadd_rn(a, b);
      x[i + half] = __fsub_rn(a, b);
    }
  }
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2) {
    const bool high = row_lane & m;  // this lane holds the b of its pairs
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) {
      const float other = __shfl_xor_sync(mask, x[e], m);
      x[e] = high ? __fsub_rn(other, x[e]) : __fadd_rn(x[e], other);
    }
  }
  const float scale = float(1.0 / sqrt(double(HEAD_DIM)));
  const uint32_t second_signs = rotation_sign_bits<ELEMS>(second, row_lane);
#pragma unroll
  for (int e = 0; e < ELEMS; ++e) {
    x[e] = __fmul_rn(x[e], scale);  // the _rn intrinsics: never contracted into an FMA
    if ((second_signs >> e) & 1) x[e] = -x[e];
  }
}

// The inverse rotation of one row of HEAD_DIM floats in shared memory by a whole warp.
template <int HEAD_DIM>
__device__ __forceinline__ void unrotate_row(float* row, uint32_t lane) {
  constexpr int kElems = HEAD_DIM / 32;
  using Signs = RotationSigns<HEAD_DIM>;
  float x[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) x[e] = row[kElems * lane + e];
  hadamard_rotate<HEAD_DIM, kElems>(x, lane, 0xffffffffu, Signs::kS2, Signs::kS1);
#pragma unroll
  for (int e = 0; e < kElems; ++e) row[kElems * lane + e] = x[e];
}

}  // namespace fp8kturbov
