// V codes in shared memory: a thread's code bytes as words, pairs of codes as indices into the
// level-pair table, and the table's layout.
#pragma once

#include <cstdint>

#include "decode/ptx.cuh"  // half2_bits
#include "format.cuh"

namespace fp8kturbov {

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

// Fills COPIES copies of the level-pair table (entry e = a | b << BITS: level[a] in the low half,
// level[b] in the high half, as fp16, which FORMAT §3.4 allows) with `threads` threads of the CTA,
// this one being `thread`; the CTA barrier before the table is read is the caller's.
template <int BITS, int COPIES>
__device__ __forceinline__ void fill_level_pairs(uint32_t* words, int thread, int threads) {
  for (int i = thread; i < (1 << (2 * BITS)) * COPIES; i += threads) {
    const int e = i / COPIES;
    words[i] = half2_bits(kCodebookTable<BITS>.levels[e & ((1 << BITS) - 1)], kCodebookTable<BITS>.levels[e >> BITS]);
  }
}

// Byte offset in copy 0 of the level-pair table of the pair of field f in a pair-index word.
template <int BITS, int HEAD_DIM>
__device__ __forceinline__ uint32_t pair_offset(uint32_t pairs, int f) {
  constexpr int kEntryShift = LevelPairTable<BITS, HEAD_DIM>::kEntryShift;
  constexpr uint32_t kMask = ((1u << (2 * BITS)) - 1) << kEntryShift;
  const int shift = 2 * BITS * f - kEntryShift;
  return (shift >= 0 ? pairs >> shift : pairs << -shift) & kMask;
}

}  // namespace fp8kturbov
