// The decode's host side: the per-device facts it caches, the tensor maps of the pools, and the
// launch of the decode kernel and its merge.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the runtime)
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "decode/decode_args.h"
#include "decode/instances.cuh"
#include "decode/pipeline.cuh"
#include "decode/traits.cuh"

namespace fp8kturbov {

constexpr int kDecodeMaxCachedDevices = 64;  // devices whose decode facts (occupancy, code version) are cached

// A positive value per device that the runtime is asked once (get: 0 where not asked yet, or for a
// device beyond the cache, which is then asked every time).
class PerDeviceCache {
 public:
  int get(int device) const { return cacheable(device) ? values_[device].load(std::memory_order_relaxed) : 0; }
  void put(int device, int value) {
    if (cacheable(device)) values_[device].store(value, std::memory_order_relaxed);
  }

 private:
  static bool cacheable(int device) { return device >= 0 && device < kDecodeMaxCachedDevices; }
  std::atomic<int> values_[kDecodeMaxCachedDevices] = {};
};

// Whether `kernel`, as it runs on the current device, is sm_90 code and so uses the tensor maps:
// the device is sm_90 or later and the library was built for it (a build without sm_90 code runs
// older code there). Every kernel of the library is built for the same architectures, so the
// first kernel asked answers for all, once per device.
inline bool runs_sm90_code(const void* kernel) {
  static PerDeviceCache cache;  // 1: no, 2: yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (const int known = cache.get(device)) return known == 2;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const bool sm90 = attributes.binaryVersion >= 90;
  cache.put(device, sm90 ? 2 : 1);
  return sm90;
}

// Whether the driver is CUDA 12.3 or later, which captures programmatic launches into graphs
// (programmatic edges); asked once.
inline bool driver_captures_programmatic_launches() {
  static const bool captures = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12030;
  }();
  return captures;
}

// cuTensorMapEncodeTiled of the driver, found once through the runtime (the library does not link
// the driver library); null where the driver lacks it.
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                       const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encoder = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &entry, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess) (void)cudaGetLastError();  // not to surface in the caller's next error check
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<TensorMapEncoder>(entry)
                                                                      : nullptr;
  }();
  return encoder;
}

// Page ids are int32: the page dimension of a pool's tensor map spans all of them (the copy engine
// reads only the boxes it is given; the pools' real extent is the caller's).
constexpr uint64_t kTensorMapPages = uint64_t(1) << 31;

// A tensor map of a pool seen as [pages][block_size rows][row_bytes] bytes, with boxes of
// `box_bytes` × 16 rows of one page. False where the layout does not allow one (the pool address and
// strides must be multiples of 16 bytes) or the driver cannot encode it.
inline bool encode_pool_map(CUtensorMap* map, const void* pool, uint64_t row_bytes, uint32_t block_size,
                            uint64_t page_stride, uint32_t box_bytes, CUtensorMapSwizzle swizzle) {
  const TensorMapEncoder encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(pool) % 16 != 0 || row_bytes % 16 != 0 || page_stride % 16 != 0)
    return false;
  const cuuint64_t dims[3] = {row_bytes, block_size, kTensorMapPages};
  const cuuint64_t strides[2] = {row_bytes, page_stride};
  const cuuint32_t box[3] = {box_bytes, uint32_t(kTileTokens), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(pool), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The tensor maps of a launch: K and V code rows where pages hold whole tiles and the code rows of
// a warp's slice are 16-byte multiples at 16-byte aligned offsets (the wide code-copy instance);
// else disabled, and the threads copy. `kernel`: the decode kernel that the launch runs.
template <int BITS, int HEAD_DIM>
DecodeTensorMaps decode_tensor_maps(const DecodeArgs& args, const void* kernel) {
  using S = DecodeShape<BITS, HEAD_DIM>;
  DecodeTensorMaps maps{};
  if (!runs_sm90_code(kernel)) return maps;  // it would ignore them
  if constexpr (S::kCodeRowBytes % 16 == 0 && S::kMaxCodeCopy == 16) {
    const uint64_t row_elems = uint64_t(args.num_kv_heads) * HEAD_DIM;
    maps.enabled =
        args.block_size % kTileTokens == 0 && args.v_code_copy_bytes >= 16 &&
        encode_pool_map(&maps.k, args.k_cache, row_elems, args.block_size, args.k_block_stride_bytes, S::kKRowBytes,
                        S::kKRowBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE) &&
        encode_pool_map(&maps.codes, args.v_cache, row_elems / 8 * BITS, args.block_size, args.v_block_stride_bytes,
                        S::kCodeRowBytes, CU_TENSOR_MAP_SWIZZLE_NONE);
    // The scale rows' map needs 16-byte multiples too (an even number of KV heads at head_dim 128).
    maps.scales_enabled =
        S::kScalesByTensorCopy && maps.enabled && encode_pool_map(&maps.scales, args.v_cache + args.v_data_section_bytes,
                                        row_elems / kGroupElems, args.block_size, args.v_block_stride_bytes,
                                        S::kScaleRowPitch, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  return maps;
}

// CTAs per cluster of a decode launch on sm_90 (launch_paged_decode).
constexpr unsigned kDecodeClusterCtas = 4;

template <int BITS, int HEAD_DIM>
cudaError_t launch_paged_decode(const DecodeArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  const DecodeFeatures features{args.query_start != nullptr, args.rotated_v, plan.stream_partials > 1, plan.length_shares,
                                 args.v_code_copy_bytes >= DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy};
  const auto [kernel, merge, smem_bytes] = decode_instance<BITS, HEAD_DIM>(features);
  if (kernel == nullptr) return cudaErrorInvalidDeviceFunction;  // the planner plans only built features
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
  // the longest rows, short rows unchanged); at 256 it measured -2 ... +4 % (docs/PERFORMANCE.md).
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
  cudaLaunchConfig_t merge_config{};
  merge_config.gridDim = dim3(args.num_seqs * args.max_q_len * args.num_q_heads);
  merge_config.blockDim = dim3(HEAD_DIM);
  merge_config.stream = stream;
  // A programmatic launch behind the decode kernel (allow_dependent_launch): about 0.7 µs less at
  // 1 x 1024 (docs/PERFORMANCE.md). Only for sm_90 code, and with a driver that captures
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
  // The default kernel's: the other instances but the head groups' have its shared memory size, and
  // its twin for split shares as many CTAs per SM (decode_min_ctas_per_sm); the head groups' hold
  // more query rows.
  const auto [kernel, merge, smem_bytes] = decode_instance<BITS, HEAD_DIM>(DecodeFeatures{false, false, head_groups, false, true});
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
