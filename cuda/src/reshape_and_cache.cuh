// The cache write (FORMAT §4): K rows to FP8 E4M3, V rows to b-bit codes + E4M3 group scales.
#pragma once

#include "format.cuh"
#include "kernel_args.h"

namespace fp8kturbov {

// 16 bf16 values as floats: two 16-byte loads when the rows allow it (the usual case), else
// element by element (any element stride).
__device__ __forceinline__ void load_bf16_group(const uint16_t* src, bool vector_loads,
                                                float (&x)[kGroupElems]) {
  if (vector_loads) {
    const uint4 halves[2] = {__ldg(reinterpret_cast<const uint4*>(src)),
                             __ldg(reinterpret_cast<const uint4*>(src) + 1)};
    const uint32_t* words = reinterpret_cast<const uint32_t*>(halves);
#pragma unroll
    for (int i = 0; i < kGroupElems / 2; ++i) {
      x[2 * i] = __uint_as_float(words[i] << 16);
      x[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) x[i] = __bfloat162float(__ushort_as_bfloat16(__ldg(src + i)));
  }
}

// One thread per (token, 16-element group): the group's V encoding needs its own sums only, so
// a thread computes them sequentially, exactly as FORMAT §3.2 orders them.
template <int BITS>
__global__ void __launch_bounds__(kWriteThreads) reshape_and_cache_kernel(const WriteArgs a) {
  const uint32_t groups_per_row = a.row_elems / kGroupElems;
  const uint64_t index = uint64_t(blockIdx.x) * kWriteThreads + threadIdx.x;
  const uint64_t token = index / groups_per_row;
  const uint32_t group = uint32_t(index % groups_per_row);
  if (token >= a.num_tokens) return;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;  // padding: writes nothing (FORMAT §4)
  const uint64_t page = uint64_t(slot) / a.block_size;
  const uint32_t offset = uint32_t(uint64_t(slot) % a.block_size);
  float x[kGroupElems];

  // K (FORMAT §2): byte = E4M3_rn_satfinite(k * inv), 16 bytes written as one aligned store.
  load_bf16_group(a.key + token * a.key_stride + group * kGroupElems, a.key_vector_loads, x);
  alignas(16) uint8_t k_bytes[kGroupElems];
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) k_bytes[i] = e4m3_encode(__fmul_rn(x[i], a.k_inv_scale));
  uint8_t* k_dst = a.k_cache + page * a.k_block_stride_bytes + uint64_t(offset) * a.row_elems +
                   group * kGroupElems;
  *reinterpret_cast<uint4*>(k_dst) = *reinterpret_cast<const uint4*>(k_bytes);

  // V (FORMAT §3): packed codes in the data section, the scale byte in the scale section.
  load_bf16_group(a.value + token * a.value_stride + group * kGroupElems, a.value_vector_loads, x);
  const EncodedGroup<BITS> enc = encode_v_group<BITS>(x);
  uint8_t packed[2 * BITS];
  pack_group<BITS>(enc.codes, packed);
  const VPageLayout layout{uint64_t(a.row_elems) * BITS / 8, a.row_elems / kGroupElems,
                           a.v_data_section_bytes};
  uint8_t* v_page = a.v_cache + page * a.v_block_stride_bytes;
  uint8_t* v_dst = v_page + layout.data_offset(offset, group, BITS);
#pragma unroll
  for (int j = 0; j < 2 * BITS; ++j) v_dst[j] = packed[j];
  v_page[layout.scale_offset(offset, group)] = enc.scale_byte;
}

template <int BITS>
cudaError_t launch_reshape_and_cache(const WriteArgs& args, cudaStream_t stream) {
  const uint64_t threads = uint64_t(args.num_tokens) * (args.row_elems / kGroupElems);
  const dim3 grid(unsigned((threads + kWriteThreads - 1) / kWriteThreads));
  WriteArgs kernel_args = args;
  void* params[] = {&kernel_args};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&reshape_and_cache_kernel<BITS>), grid,
                          dim3(kWriteThreads), params, 0, stream);
}

}  // namespace fp8kturbov
