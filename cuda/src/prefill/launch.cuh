// The prefill's launches: one CTA per (query tile of a sequence's chunk, KV head, context split),
// of the mma.sync kernel or (sm_90a, tiles of kPrefillWsQueryRows) the warp-specialised wgmma
// kernel, then, with splits, the merge kernel over the same tiles.
#pragma once

#include <cuda_runtime.h>

#include "decode/tensor_maps.cuh"  // PerDeviceCache
#include "kernel_args.h"
#include "prefill/expand.cuh"
#include "prefill/kernel.cuh"
#include "prefill/kernel_ws.cuh"
#include "prefill/merge.cuh"

namespace fp8kturbov {

// A prefill kernel of an instance with its block and dynamic shared memory, allowed the latter
// (above 48 KB a kernel must ask: a host attribute, no synchronisation).
struct PrefillKernel {
  const void* function;
  int threads;
  int shared_bytes;
};

template <int BITS, int HEAD_DIM, int STEP_TILES>
PrefillKernel prefill_ws_kernel() {
  using T = PrefillWsTraits<BITS, HEAD_DIM, STEP_TILES>;
  return {reinterpret_cast<const void*>(&paged_prefill_ws_kernel<BITS, HEAD_DIM, STEP_TILES>), T::kThreads,
          int(sizeof(typename T::Shared))};
}

template <int BITS, int HEAD_DIM>
cudaError_t prefill_kernel(bool warp_specialized, bool expanded, PrefillKernel* kernel) {
  if (!warp_specialized)
    *kernel = {reinterpret_cast<const void*>(&paged_prefill_kernel<BITS, HEAD_DIM>), kPrefillThreads,
               int(sizeof(typename PrefillTraits<BITS, HEAD_DIM>::Shared))};
  else
    *kernel = expanded ? prefill_ws_kernel<BITS, HEAD_DIM, prefill_ws_step_tiles(HEAD_DIM, true)>()
                       : prefill_ws_kernel<BITS, HEAD_DIM, prefill_ws_step_tiles(HEAD_DIM, false)>();
  return cudaFuncSetAttribute(kernel->function, cudaFuncAttributeMaxDynamicSharedMemorySize, kernel->shared_bytes);
}

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_prefill(const PrefillArgs& args, cudaStream_t stream) {
  PrefillKernel kernel{};
  cudaError_t err =
      prefill_kernel<BITS, HEAD_DIM>(args.query_tile_rows == kPrefillWsQueryRows, args.expanded_kv != nullptr, &kernel);
  if (err != cudaSuccess) return err;
  // < 2^31, <= 65535 and <= kPrefillMaxSplits: validated and planned
  const dim3 grid(args.num_seqs * args.tiles_per_seq, args.num_kv_heads, args.num_splits);
  PrefillArgs kernel_args = args;
  void* params[] = {&kernel_args};
  if (args.expanded_kv != nullptr) {  // tiles <= 2^26, KV heads and sequences <= 65535: planned
    err = cudaLaunchKernel(reinterpret_cast<const void*>(&prefill_expand_kernel<BITS, HEAD_DIM>),
                           dim3(args.expanded_tiles, args.num_kv_heads, args.num_seqs),
                           dim3(PrefillTileTraits<BITS, HEAD_DIM>::kCopyThreads), params, 0, stream);
    if (err != cudaSuccess) return err;
  }
  err = cudaLaunchKernel(kernel.function, grid, dim3(kernel.threads), params, kernel.shared_bytes, stream);
  if (err != cudaSuccess || args.num_splits <= 1) return err;
  // A warp per query row of each tile.
  const dim3 merge_grid(grid.x, grid.y, args.query_tile_rows / kPrefillWarps);
  return cudaLaunchKernel(reinterpret_cast<const void*>(&paged_prefill_merge_kernel<HEAD_DIM>), merge_grid,
                          dim3(kPrefillThreads), params, 0, stream);
}

template <int BITS, int HEAD_DIM>
cudaError_t prefill_ctas_per_sm(int device, bool warp_specialized, int* count) {
  // The answer depends on the device and the kernel only; the kernels over an expanded context hold
  // as many CTAs as the others (one: PrefillWsTraits).
  static PerDeviceCache caches[2];
  PerDeviceCache& cache = caches[warp_specialized];
  if ((*count = cache.get(device)) > 0) return cudaSuccess;
  PrefillKernel kernel{};
  cudaError_t err = prefill_kernel<BITS, HEAD_DIM>(warp_specialized, false, &kernel);
  if (err == cudaSuccess)
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel.function, kernel.threads, kernel.shared_bytes);
  if (err != cudaSuccess) return err;
  if (*count < 1) *count = 1;
  cache.put(device, *count);
  return cudaSuccess;
}

}  // namespace fp8kturbov
