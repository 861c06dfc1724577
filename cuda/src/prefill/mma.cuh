// The prefill's warp-level matrix PTX beyond the decode's (decode/ptx.cuh): shared-memory fragment
// loads (ldmatrix) and bf16 pairs for the output. sm_80 and newer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode/ptx.cuh"  // mma_16x8x16, half2_bits, shared_address

namespace fp8kturbov {

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
