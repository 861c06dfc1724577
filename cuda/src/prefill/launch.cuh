// The prefill's launch: one CTA per (query tile of a sequence's chunk, KV head).
#pragma once

#include <cuda_runtime.h>

#include "kernel_args.h"
#include "prefill/kernel.cuh"

namespace fp8kturbov {

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_prefill(const PrefillArgs& args, cudaStream_t stream) {
  constexpr int kSharedBytes = int(sizeof(typename PrefillTraits<BITS, HEAD_DIM>::Shared));
  const void* kernel = reinterpret_cast<const void*>(&paged_prefill_kernel<BITS, HEAD_DIM>);
  // Above 48 KB of dynamic shared memory a kernel must ask (a host attribute, no synchronisation).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(args.num_seqs * args.tiles_per_seq, args.num_kv_heads);  // < 2^31 and <= 65535, validated
  PrefillArgs kernel_args = args;
  void* params[] = {&kernel_args};
  return cudaLaunchKernel(kernel, grid, dim3(kPrefillThreads), params, kSharedBytes, stream);
}

}  // namespace fp8kturbov
