// The cache write (FORMAT §4): K rows to FP8 E4M3, V rows to b-bit codes + E4M3 group scales.
#pragma once

#include <type_traits>

#include "format.cuh"
#include "kernel_args.h"

namespace fp8kturbov {

// A group's 16 bf16 values as loaded, not yet widened: two 16-byte loads when the rows allow it
// (the usual case; words[i] holds elements 2i and 2i + 1), else element by element (any element
// stride; words[i] holds element i). Nothing reads them before widen_bf16_group, so that the
// kernel can do other work while the loads are in flight.
struct Bf16Group {
  uint32_t words[kGroupElems];
  bool vector_loads;
};
__device__ __forceinline__ Bf16Group load_bf16_group(const uint16_t* src, bool vector_loads) {
  Bf16Group g;
  g.vector_loads = vector_loads;
  if (vector_loads) {
    const uint4 halves[2] = {__ldg(reinterpret_cast<const uint4*>(src)),
                             __ldg(reinterpret_cast<const uint4*>(src) + 1)};
#pragma unroll
    for (int i = 0; i < kGroupElems / 2; ++i) g.words[i] = reinterpret_cast<const uint32_t*>(halves)[i];
  } else {
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) g.words[i] = __ldg(src + i);
  }
  return g;
}
__device__ __forceinline__ void widen_bf16_group(const Bf16Group& g, float (&x)[kGroupElems]) {
  if (g.vector_loads) {
#pragma unroll
    for (int i = 0; i < kGroupElems / 2; ++i) {
      x[2 * i] = __uint_as_float(g.words[i] << 16);
      x[2 * i + 1] = __uint_as_float(g.words[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) x[i] = __uint_as_float(g.words[i] << 16);
  }
}

// Stores N bytes with the widest stores that N and the address allow.
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint8_t (&bytes)[N]) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(dst);
  if (N % 8 == 0 && address % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
      reinterpret_cast<uint2*>(dst)[i] = make_uint2(
          bytes[8 * i] | bytes[8 * i + 1] << 8 | bytes[8 * i + 2] << 16 | uint32_t(bytes[8 * i + 3]) << 24,
          bytes[8 * i + 4] | bytes[8 * i + 5] << 8 | bytes[8 * i + 6] << 16 | uint32_t(bytes[8 * i + 7]) << 24);
  } else if (N % 4 == 0 && address % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      reinterpret_cast<uint32_t*>(dst)[i] =
          bytes[4 * i] | bytes[4 * i + 1] << 8 | bytes[4 * i + 2] << 16 | uint32_t(bytes[4 * i + 3]) << 24;
  } else if (N % 2 == 0 && address % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) reinterpret_cast<uint16_t*>(dst)[i] = uint16_t(bytes[2 * i] | bytes[2 * i + 1] << 8);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = bytes[i];
  }
}

// Fills the CTA's shared copy of the codebook table (CodebookTable) from its global one, word by
// word in one coalesced request per warp, then a CTA barrier.
template <int BITS>
__device__ __forceinline__ void load_codebook(CodebookTable<BITS>& table) {
  constexpr int kWords = sizeof(CodebookTable<BITS>) / 4;
  static_assert(sizeof(CodebookTable<BITS>) % 4 == 0, "whole words");
  for (int i = threadIdx.x; i < kWords; i += blockDim.x)
    reinterpret_cast<uint32_t*>(&table)[i] = reinterpret_cast<const uint32_t*>(&kCodebookTable<BITS>)[i];
  __syncthreads();
}

// FORMAT §2: a group's K bytes, E4M3_rn_satfinite(k * inv_scale), written as one aligned 16-byte store.
__device__ __forceinline__ void store_k_group(uint8_t* dst, const float (&k)[kGroupElems], float inv_scale) {
  alignas(16) uint8_t bytes[kGroupElems];
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) bytes[i] = e4m3_encode(__fmul_rn(k[i], inv_scale));
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(bytes);
}

// FORMAT §3: group `group` of slot offset `offset` of a V page, its packed codes in the data
// section and its scale byte in the scale section.
template <int BITS>
__device__ __forceinline__ void store_v_group(uint8_t* page, const VPageLayout& layout, uint32_t offset,
                                              uint32_t group, const EncodedGroup<BITS>& enc) {
  uint8_t packed[2 * BITS];
  pack_group<BITS>(enc.codes, packed);
  store_bytes(page + layout.data_offset(offset, group, BITS), packed);
  page[layout.scale_offset(offset, group)] = enc.scale_byte;
}

// This thread's (token, 16-element group) in the grid of launch_per_token_group.
template <uint32_t THREADS_PER_GROUP = 1>
__device__ __forceinline__ void token_group_of_thread(uint32_t row_elems, uint64_t& token, uint32_t& group) {
  const uint32_t groups_per_row = row_elems / kGroupElems;
  const uint64_t index = (uint64_t(blockIdx.x) * kWriteThreads + threadIdx.x) / THREADS_PER_GROUP;
  token = index / groups_per_row;
  group = uint32_t(index % groups_per_row);
}

// FORMAT §6 on the V head row whose 16-element groups are held by head_dim / 16 consecutive
// threads (a CTA and a warp start at a head: their group counts are multiples of it), this
// thread's group in x. The threads of a head share its token, so they are all still running.
template <int HEAD_DIM>
__device__ __forceinline__ void rotate_head(float (&x)[kGroupElems]) {
  constexpr uint32_t kLanes = HEAD_DIM / kGroupElems;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t mask = kLanes == 32 ? 0xffffffffu : ((1u << (kLanes % 32)) - 1) << (lane & ~(kLanes - 1));
  using Signs = RotationSigns<HEAD_DIM>;
  hadamard_rotate<HEAD_DIM, kGroupElems>(x, lane % kLanes, mask, Signs::kS1, Signs::kS2);
}
__device__ __forceinline__ void rotate_head(uint32_t head_dim, float (&x)[kGroupElems]) {
  if (head_dim == 128)
    rotate_head<128>(x);
  else if (head_dim == 256)
    rotate_head<256>(x);
  else
    rotate_head<512>(x);
}

// A group's V encoding by ENCODER, with LANES threads per group (format.cuh: the searching
// encoders take 1 or 32, matched-norm 1).
template <int BITS, fp8kturbov_v_encoder_t ENCODER, int LANES>
__device__ __forceinline__ EncodedGroup<BITS> encode_v_group_by(const float (&x)[kGroupElems],
                                                                const CodebookTable<BITS>& table) {
  if constexpr (ENCODER == FP8KTURBOV_V_ENCODER_MSE)
    return encode_v_group_mse<BITS, LANES>(x, table);
  else if constexpr (ENCODER == FP8KTURBOV_V_ENCODER_PROJECTION)
    return encode_v_group_projection<BITS, LANES>(x, table);
  else
    return encode_v_group<BITS>(x, table);
}

// One thread per (token, 16-element group): the group's V encoding needs its own sums only, so
// a thread computes them sequentially, exactly as FORMAT §3.2 orders them. ENCODER: the V encoder
// (WriteArgs::v_encoder); the searching ones in kernels of their own so that the default one stays
// as it is, with LANES (1 or 32) threads per group searching its scales; the first of them writes.
// ROTATE: the V rotation (WriteArgs::rotation_head_dim), likewise in instances of its own (its
// butterflies, unrolled for three head dims, would quadruple the default kernel's code); one
// thread per group.
template <int BITS, fp8kturbov_v_encoder_t ENCODER, int LANES, bool ROTATE>
__global__ void __launch_bounds__(kWriteThreads) reshape_and_cache_kernel(const WriteArgs a) {
  static_assert(!ROTATE || LANES == 1, "the rotation runs across the threads of a head's groups");
  static_assert(ENCODER != FP8KTURBOV_V_ENCODER_MATCHED_NORM || LANES == 1, "matched-norm: a thread per group");
  uint64_t token;
  uint32_t group;
  token_group_of_thread<LANES>(a.row_elems, token, group);
  const bool writes = threadIdx.x % LANES == 0;
  // The slot and both input groups are requested first, and the codebook table is built while they
  // are in flight: nothing reads them before the barrier (they are widened to floats after it), so
  // for a few tokens the write is one memory round trip plus the encoding. (Widened where they are
  // loaded, the threads waited for their inputs before reading the codebook's constants: two round
  // trips.)
  // A thread past the last token loads the first token's inputs (a launch has one) and writes
  // nothing: loads without a branch are issued ahead of the codebook's.
  const bool has_token = token < a.num_tokens;
  const uint64_t input_token = has_token ? token : 0;
  const int64_t slot = has_token ? __ldg(a.slot_mapping + token) : -1;
  const Bf16Group k_in = load_bf16_group(a.key + input_token * a.key_stride + group * kGroupElems, a.key_vector_loads);
  const Bf16Group v_in =
      load_bf16_group(a.value + input_token * a.value_stride + group * kGroupElems, a.value_vector_loads);
  __shared__ CodebookTable<BITS> codebook_s;
  load_codebook<BITS>(codebook_s);  // a CTA barrier: every thread reaches it
  if (slot < 0) return;  // no token, or padding: writes nothing (FORMAT §4)
  float k[kGroupElems], x[kGroupElems];
  widen_bf16_group(k_in, k);
  widen_bf16_group(v_in, x);
  const uint64_t page = uint64_t(slot) / a.block_size;
  const uint32_t offset = uint32_t(uint64_t(slot) % a.block_size);
  if (a.index_check.slot_page_out_of_range(page)) {  // checked mode: skip the token
    if (group == 0 && writes) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SLOT);
    return;
  }

  if (writes)
    store_k_group(a.k_cache + page * a.k_block_stride_bytes + uint64_t(offset) * a.row_elems + group * kGroupElems, k,
                  a.k_inv_scale);

  // V (FORMAT §3): packed codes in the data section, the scale byte in the scale section; first,
  // where asked, the head's rotation (FORMAT §6) across the threads holding its groups.
  if constexpr (ROTATE) rotate_head(a.rotation_head_dim, x);
  const EncodedGroup<BITS> enc = encode_v_group_by<BITS, ENCODER, LANES>(x, codebook_s);
  if (!writes) return;
  const VPageLayout layout{uint64_t(a.row_elems) * BITS / 8, a.row_elems / kGroupElems,
                           a.v_data_section_bytes};
  store_v_group<BITS>(a.v_cache + page * a.v_block_stride_bytes, layout, offset, group, enc);
}

template <int BITS, fp8kturbov_v_encoder_t ENCODER, int LANES, bool ROTATE>
const void* write_kernel() {
  return reinterpret_cast<const void*>(&reshape_and_cache_kernel<BITS, ENCODER, LANES, ROTATE>);
}

// A write with a searching encoder: a warp or a thread per group (search_lanes_per_group); a
// rotated write keeps a thread per group, as the rotation runs across a head's threads.
template <int BITS, fp8kturbov_v_encoder_t ENCODER>
cudaError_t launch_searching_write(const WriteArgs& args, cudaStream_t stream) {
  const bool rotate = args.rotation_head_dim != 0;
  const uint32_t lanes = rotate ? 1 : search_lanes_per_group(args.num_tokens, args.row_elems);
  const void* kernel = lanes == kSearchWarpLanes ? write_kernel<BITS, ENCODER, kSearchWarpLanes, false>()
                       : rotate                  ? write_kernel<BITS, ENCODER, 1, true>()
                                                 : write_kernel<BITS, ENCODER, 1, false>();
  return launch_per_token_group(kernel, args, stream, lanes);
}

template <int BITS>
cudaError_t launch_reshape_and_cache(const WriteArgs& args, cudaStream_t stream) {
  switch (args.v_encoder) {
    case FP8KTURBOV_V_ENCODER_MSE:
      return launch_searching_write<BITS, FP8KTURBOV_V_ENCODER_MSE>(args, stream);
    case FP8KTURBOV_V_ENCODER_PROJECTION:
      return launch_searching_write<BITS, FP8KTURBOV_V_ENCODER_PROJECTION>(args, stream);
    default: {  // matched-norm (validated)
      constexpr fp8kturbov_v_encoder_t kMatchedNorm = FP8KTURBOV_V_ENCODER_MATCHED_NORM;
      return launch_per_token_group(args.rotation_head_dim != 0 ? write_kernel<BITS, kMatchedNorm, 1, true>()
                                                                : write_kernel<BITS, kMatchedNorm, 1, false>(),
                                    args, stream);
    }
  }
}

}  // namespace fp8kturbov
