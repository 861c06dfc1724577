// The dequantize (pages -> bf16): the write's inverse, K = E4M3(byte)·k_scale and
// V = level[code]·E4M3(scale), each product rounded once to bf16 (FORMAT §2, §3).
#pragma once

#include "format.cuh"
#include "kernel_args.h"
#include "reshape_and_cache.cuh"  // load_codebook, token_group_of_thread

namespace fp8kturbov {

// Stores 16 floats as bf16: two 16-byte stores when the rows allow it, else element by element.
__device__ __forceinline__ void store_bf16_group(uint16_t* dst, bool vector_stores,
                                                 const float (&x)[kGroupElems]) {
  uint16_t bits[kGroupElems];
#pragma unroll
  for (int i = 0; i < kGroupElems; ++i) bits[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  if (vector_stores) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = bits[8 * h + 2 * i] | (uint32_t(bits[8 * h + 2 * i + 1]) << 16);
      reinterpret_cast<uint4*>(dst)[h] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) dst[i] = bits[i];
  }
}

// One thread per (token, 16-element group), like the write.
template <int BITS>
__global__ void __launch_bounds__(kWriteThreads) dequantize_kernel(const DequantizeArgs a) {
  __shared__ CodebookTable<BITS> codebook_s;
  load_codebook<BITS>(codebook_s);
  uint64_t token;
  uint32_t group;
  token_group_of_thread(a.row_elems, token, group);
  if (token >= a.num_tokens) return;
  const int64_t slot = __ldg(a.slot_mapping + token);
  float k[kGroupElems], v[kGroupElems];
  const uint64_t page = uint64_t(slot) / a.block_size;
  const bool page_out_of_range = slot >= 0 && a.index_check.slot_page_out_of_range(page);
  if (page_out_of_range && group == 0) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SLOT);
  if (slot < 0 || page_out_of_range) {  // padding, or a page checked mode skips: a row of zeros
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) k[i] = v[i] = 0.0f;
  } else {
    const uint32_t offset = uint32_t(uint64_t(slot) % a.block_size);
    const uint4 k_chunk = __ldg(reinterpret_cast<const uint4*>(
        a.k_cache + page * a.k_block_stride_bytes + uint64_t(offset) * a.row_elems + group * kGroupElems));
    const uint8_t* k_bytes = reinterpret_cast<const uint8_t*>(&k_chunk);
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) k[i] = __fmul_rn(e4m3_decode(k_bytes[i]), a.k_scale);

    const VPageLayout layout{uint64_t(a.row_elems) * BITS / 8, a.row_elems / kGroupElems,
                             a.v_data_section_bytes};
    const uint8_t* v_page = a.v_cache + page * a.v_block_stride_bytes;
    uint8_t codes[2 * BITS];
#pragma unroll
    for (int j = 0; j < 2 * BITS; ++j) codes[j] = __ldg(v_page + layout.data_offset(offset, group, BITS) + j);
    const float scale = e4m3_decode(__ldg(v_page + layout.scale_offset(offset, group)));
#pragma unroll
    for (int i = 0; i < kGroupElems; ++i) v[i] = __fmul_rn(codebook_s.levels[unpack_code<BITS>(codes, i)], scale);
  }
  store_bf16_group(a.key + token * a.key_stride + group * kGroupElems, a.key_vector_stores, k);
  store_bf16_group(a.value + token * a.value_stride + group * kGroupElems, a.value_vector_stores, v);
}

template <int BITS>
cudaError_t launch_dequantize(const DequantizeArgs& args, cudaStream_t stream) {
  return launch_per_token_group(reinterpret_cast<const void*>(&dequantize_kernel<BITS>), args, stream);
}

}  // namespace fp8kturbov
