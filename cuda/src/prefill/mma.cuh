// The prefill's warp-level matrix PTX beyond the decode's (decode/ptx.cuh): bf16 products for
// Q·Kᵀ and shared-memory fragment loads (ldmatrix). sm_80 and newer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode/ptx.cuh"  // mma_16x8x16 (fp16), half2_bits, shared_address

namespace fp8kturbov {

// D += A·B, m16n8k16, bf16 inputs, fp32 accumulators (the fp16 form is mma_16x8x16).
__device__ __forceinline__ void mma_16x8x16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices of 16-bit elements from shared memory, lane l giving the address of row l % 8
// of matrix l / 8; r[i] is matrix i in the fragment layout (TRANSPOSED: each matrix transposed).
template <bool TRANSPOSED>
__device__ __forceinline__ void load_matrices_x4(uint32_t (&r)[4], uint32_t address) {
  if constexpr (TRANSPOSED)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Two floats as a bf16 pair (lo in the low half), each rounded to nearest.
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

}  // namespace fp8kturbov
