// Host side of the tensor copies: which code a kernel runs on the current device, and the pools'
// tensor maps of a launch (encoded through the driver entry point the runtime finds).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernel_args.h"
#include "decode/ptx.cuh"
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

}  // namespace fp8kturbov
