// Kernels of the benchmark harness (python -m fp8kturbov bench), not of the library: the HBM read
// ceiling every "% ceil" refers to, and an empty kernel whose graph replay is the launch floor.
// Built as its own small library (libfp8kturbov_bench), which the harness loads with ctypes; the
// C ABI of libfp8kturbov does not change.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kReadThreads = 256;
constexpr int kLoadsInFlight = 4;  // 16-byte loads per thread per step

// Reads n16 16-byte words with a grid-stride loop, kLoadsInFlight loads issued before any is used.
// The words are folded into one value, stored only when it equals an arbitrary constant: the store
// depends on every load, so none can be dropped, and in practice nothing is written.
__global__ void __launch_bounds__(kReadThreads) read_kernel(const uint4* __restrict__ src, uint64_t n16,
                                                             uint32_t* __restrict__ sink) {
  const uint64_t stride = uint64_t(gridDim.x) * kReadThreads;
  uint64_t i = uint64_t(blockIdx.x) * kReadThreads + threadIdx.x;
  uint32_t folded = 0;
  for (; i + (kLoadsInFlight - 1) * stride < n16; i += kLoadsInFlight * stride) {
    uint4 words[kLoadsInFlight];
#pragma unroll
    for (int k = 0; k < kLoadsInFlight; ++k) words[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < kLoadsInFlight; ++k) folded ^= words[k].x ^ words[k].y ^ words[k].z ^ words[k].w;
  }
  for (; i < n16; i += stride) {
    const uint4 word = src[i];
    folded ^= word.x ^ word.y ^ word.z ^ word.w;
  }
  if (folded == 0x5eed1e55u) *sink = folded;
}

__global__ void empty_kernel() {}

}  // namespace

extern "C" {

// Reads `bytes` (a multiple of 16) from the 16-byte aligned `src` on `stream`, with `num_ctas`
// CTAs of 256 threads; `sink` is one writable uint32. Returns the launch's cudaError_t.
__attribute__((visibility("default"))) int fp8kturbov_bench_read(const void* src, uint64_t bytes, uint32_t* sink,
                                                                 uint32_t num_ctas, cudaStream_t stream) {
  read_kernel<<<num_ctas, kReadThreads, 0, stream>>>(static_cast<const uint4*>(src), bytes / 16, sink);
  return cudaGetLastError();
}

// One CTA of one warp that does nothing, on `stream`. Returns the launch's cudaError_t.
__attribute__((visibility("default"))) int fp8kturbov_bench_empty(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  return cudaGetLastError();
}

}  // extern "C"
