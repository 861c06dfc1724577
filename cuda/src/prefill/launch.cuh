// The prefill's launches: one CTA per (query tile of a sequence's chunk, KV head, context split),
// then, with splits, the merge kernel over the same tiles.
#pragma once

#include <cuda_runtime.h>

#include "decode/tensor_maps.cuh"  // PerDeviceCache
#include "kernel_args.h"
#include "prefill/kernel.cuh"
#include "prefill/merge.cuh"

namespace fp8kturbov {

template <int BITS, int HEAD_DIM>
constexpr int kPrefillSharedBytes = int(sizeof(typename PrefillTraits<BITS, HEAD_DIM>::Shared));

// The prefill kernel of an instance, allowed its dynamic shared memory (above 48 KB a kernel must
// ask: a host attribute, no synchronisation).
template <int BITS, int HEAD_DIM>
cudaError_t prefill_kernel(const void** kernel) {
  *kernel = reinterpret_cast<const void*>(&paged_prefill_kernel<BITS, HEAD_DIM>);
  return cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPrefillSharedBytes<BITS, HEAD_DIM>);
}

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_prefill(const PrefillArgs& args, cudaStream_t stream) {
  const void* kernel = nullptr;
  cudaError_t err = prefill_kernel<BITS, HEAD_DIM>(&kernel);
  if (err != cudaSuccess) return err;
  // < 2^31, <= 65535 and <= kPrefillMaxSplits: validated and planned
  const dim3 grid(args.num_seqs * args.tiles_per_seq, args.num_kv_heads, args.num_splits);
  PrefillArgs kernel_args = args;
  void* params[] = {&kernel_args};
  err = cudaLaunchKernel(kernel, grid, dim3(kPrefillThreads), params, kPrefillSharedBytes<BITS, HEAD_DIM>, stream);
  if (err != cudaSuccess || args.num_splits <= 1) return err;
  return cudaLaunchKernel(reinterpret_cast<const void*>(&paged_prefill_merge_kernel<HEAD_DIM>), dim3(grid.x, grid.y, kPrefillMergeCtasPerTile),
                          dim3(kPrefillThreads), params, 0, stream);
}

template <int BITS, int HEAD_DIM>
cudaError_t prefill_ctas_per_sm(int device, int* count) {
  static PerDeviceCache cache;  // the answer depends on the device only
  if ((*count = cache.get(device)) > 0) return cudaSuccess;
  const void* kernel = nullptr;
  cudaError_t err = prefill_kernel<BITS, HEAD_DIM>(&kernel);
  if (err == cudaSuccess)
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel, kPrefillThreads, kPrefillSharedBytes<BITS, HEAD_DIM>);
  if (err != cudaSuccess) return err;
  if (*count < 1) *count = 1;
  cache.put(device, *count);
  return cudaSuccess;
}

}  // namespace fp8kturbov
