// The decode's launch: the kernel instance for a launch, its grid, cluster and programmatic merge,
// and the occupancy the planner asks for.
#pragma once

#include <cuda_runtime.h>

#include "kernel_args.h"
#include "decode/kernel.cuh"
#include "decode/merge.cuh"
#include "decode/tensor_maps.cuh"
#include "decode/traits.cuh"

namespace fp8kturbov {

// A decode kernel instance and the dynamic shared memory it runs with.
struct DecodeInstance {
  const void* kernel;  // null where the instance is not built
  int smem_bytes;
};

// The decode kernel instance for a pool layout (wide_code_copy: the shape's widest code copy, else
// 4 bytes) and a variant (DecodeVariant).
template <int BITS, int HEAD_DIM, bool EXTENDED, bool GROUPED, bool SHARES, bool APPEND>
DecodeInstance decode_instance(bool wide_code_copy) {
  if constexpr (GROUPED && !decode_head_groups_built(BITS, HEAD_DIM)) {
    return {nullptr, 0};
  } else {
    constexpr int kWideCopy = DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy;
    const void* kernel =
        wide_code_copy
            ? reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM, kWideCopy, EXTENDED, GROUPED, SHARES, APPEND>)
            : reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM, 4, EXTENDED, GROUPED, SHARES, APPEND>);
    return {kernel, DecodeSmem<BITS, HEAD_DIM, GROUPED>::kBytes};
  }
}

// The variants a launch needs, from its arguments and plan: EXTENDED (several query tokens or rotated
// V), GROUPED (head groups, DecodePlan::stream_partials > 1: the planner allows them for the default
// decode only), SHARES (DecodePlan::length_shares; the extended instance follows the plan's flag)
// and APPEND (the fused append).
struct DecodeVariant {
  bool extended;
  bool grouped;
  bool shares;
  bool append;
};
inline DecodeVariant decode_variant(const DecodeArgs& args, const DecodePlan& plan) {
  const bool extended = args.query_start != nullptr || args.rotated_v;
  return {extended, !extended && plan.stream_partials > 1, !extended && plan.length_shares, args.append.enabled()};
}

// The built variants of a (BITS, HEAD_DIM), one row each (the kernel's template flags): adding a
// variant is a row here and its flag in the kernel. Head groups exist for some shapes only
// (decode_head_groups_built): their rows give no kernel elsewhere.
template <int BITS, int HEAD_DIM>
DecodeInstance decode_instance(const DecodeVariant& variant, bool wide_code_copy) {
  struct Row {
    DecodeVariant variant;
    DecodeInstance (*instance)(bool wide_code_copy);
  };
  static constexpr Row kRows[] = {
      {{false, false, false, false}, &decode_instance<BITS, HEAD_DIM, false, false, false, false>},
      {{false, false, true, false}, &decode_instance<BITS, HEAD_DIM, false, false, true, false>},
      {{false, true, false, false}, &decode_instance<BITS, HEAD_DIM, false, true, false, false>},
      {{false, true, true, false}, &decode_instance<BITS, HEAD_DIM, false, true, true, false>},
      {{true, false, false, false}, &decode_instance<BITS, HEAD_DIM, true, false, false, false>},
      {{false, false, false, true}, &decode_instance<BITS, HEAD_DIM, false, false, false, true>},
      {{false, false, true, true}, &decode_instance<BITS, HEAD_DIM, false, false, true, true>},
      {{false, true, false, true}, &decode_instance<BITS, HEAD_DIM, false, true, false, true>},
      {{false, true, true, true}, &decode_instance<BITS, HEAD_DIM, false, true, true, true>},
      {{true, false, false, true}, &decode_instance<BITS, HEAD_DIM, true, false, false, true>},
  };
  for (const Row& row : kRows)
    if (row.variant.extended == variant.extended && row.variant.grouped == variant.grouped &&
        row.variant.shares == variant.shares && row.variant.append == variant.append)
      return row.instance(wide_code_copy);
  return {nullptr, 0};
}

// The merge kernel of a variant: EXTENDED and SHARES as the decode's (head groups need no instance
// of their own).
template <int HEAD_DIM>
const void* merge_instance(const DecodeVariant& variant) {
  return variant.extended ? reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, true, false>)
         : variant.shares ? reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, false, true>)
                          : reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, false, false>);
}

// CTAs per cluster of a decode launch on sm_90 (launch_paged_decode).
constexpr unsigned kDecodeClusterCtas = 4;

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  const DecodeVariant variant = decode_variant(args, plan);
  const bool wide_code_copy = args.v_code_copy_bytes >= DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy;
  const auto [kernel, smem_bytes] = decode_instance<BITS, HEAD_DIM>(variant, wide_code_copy);
  // Set on every launch: the attribute belongs to the current device's copy of the kernel. It is
  // not a stream operation, so launches stay capturable.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  DecodeArgs kernel_args = args;
  DecodePlan kernel_plan = plan;
  DecodeTensorMaps maps = decode_tensor_maps<BITS, HEAD_DIM>(args, kernel);
  void* params[] = {&kernel_args, &kernel_plan, &maps};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(args.num_seqs * plan.num_splits * args.num_kv_heads * plan.chunks_per_group);  // < 2^31
  config.blockDim = dim3(kDecodeThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  // On sm_90, where a (sequence, split) has a multiple of kDecodeClusterCtas CTAs, clusters of that
  // many consecutive ones: chunks and KV heads of one (sequence, split), which read the same token
  // rows of the pools (CTA order), then start side by side in one GPC, and their reads of those rows
  // meet in DRAM. The kernel uses nothing of the cluster: it changes where and when CTAs run, not
  // what they compute. Placed by load balance: with the default policy fewer clusters of 4 fit the
  // H200 at once (124 of 132). Up to head_dim 128 only, where it measured faster (up to -4 % on
  // the longest rows, short rows unchanged); at 256 it measured -2 ... +4 % (docs/PERFORMANCE.md,
  // log 53).
  cudaLaunchAttribute cluster[2] = {};
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = kDecodeClusterCtas;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  cluster[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  cluster[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
  if (HEAD_DIM <= kDecodeSliceDim && args.num_kv_heads * plan.chunks_per_group % kDecodeClusterCtas == 0 &&
      runs_sm90_code(kernel)) {
    config.attrs = cluster;
    config.numAttrs = 2;
  }
  err = cudaLaunchKernelExC(&config, kernel, params);
  if (err != cudaSuccess || decode_partials(plan) == 1) return err;
  const void* merge = merge_instance<HEAD_DIM>(variant);
  cudaLaunchConfig_t merge_config{};
  merge_config.gridDim = dim3(args.num_seqs * args.max_q_len * args.num_q_heads);
  merge_config.blockDim = dim3(HEAD_DIM);
  merge_config.stream = stream;
  // A programmatic launch behind the decode kernel (allow_dependent_launch): about 0.7 µs less at
  // 1 x 1024 (docs/PERFORMANCE.md, log 57). Only for sm_90 code, and with a driver that captures
  // programmatic dependencies into graphs (CUDA 12.3).
  cudaLaunchAttribute programmatic{};
  programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic.val.programmaticStreamSerializationAllowed = 1;
  if (runs_sm90_code(kernel) && driver_captures_programmatic_launches()) {
    merge_config.attrs = &programmatic;
    merge_config.numAttrs = 1;
  }
  return cudaLaunchKernelExC(&merge_config, merge, params);
}

template <int BITS, int HEAD_DIM>
cudaError_t decode_ctas_per_sm(int device, bool head_groups, int* count) {
  static PerDeviceCache caches[2];  // the answers depend on the device only
  PerDeviceCache& cache = caches[head_groups];
  if ((*count = cache.get(device)) > 0) return cudaSuccess;
  // The default (not EXTENDED) kernel's: the other instances but the head groups' have its shared
  // memory size, and its twin for split shares as many CTAs per SM (decode_min_ctas_per_sm); the
  // head groups' hold more query rows.
  const auto [kernel, smem_bytes] =
      decode_instance<BITS, HEAD_DIM>(DecodeVariant{false, head_groups, false, false}, true);
  if (kernel == nullptr) {  // head groups not built for this shape
    *count = 0;
    return cudaSuccess;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel, kDecodeThreads, smem_bytes);
  if (err != cudaSuccess) return err;
  if (*count < 1) *count = 1;
  cache.put(device, *count);
  return cudaSuccess;
}

}  // namespace fp8kturbov
