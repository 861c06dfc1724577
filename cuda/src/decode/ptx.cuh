// The PTX the decode uses: warp-level matrix instructions and conversions, named barriers,
// asynchronous copies (cp.async), tensor copies with their mbarriers (sm_90), programmatic launch.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the runtime)
#include <cuda_fp16.h>
#include <cuda_fp8.h>  // the E4M3 pair conversion's fallback

#include <cstdint>

namespace fp8kturbov {

// ---- Warp-level matrix instructions --------------------------------------------------------

__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Transposes an 8x8 fp16 matrix held in the standard fragment layout across the warp.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two E4M3 bytes (low byte first) to two fp16 values, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_half2_bits(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two_bytes), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Four E4M3 bytes to two fp16 pairs: lo from bytes 0-1, hi from bytes 2-3, exactly. Splitting the
// word in PTX lets the conversion read its upper half directly instead of after a shift. (The
// conversion instruction needs sm_89; older architectures take the intrinsic's emulation.)
__device__ __forceinline__ void e4m3x4_to_half2x2_bits(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four_bytes));
#else
  lo = e4m3x2_to_half2_bits(four_bytes & 0xFFFF);
  hi = e4m3x2_to_half2_bits(four_bytes >> 16);
#endif
}

// A barrier of the SLICES warps of one token stream (named barrier 1 + stream; 0 is
// __syncthreads'): the streams of a CTA do not wait on each other.
template <int SLICES>
__device__ __forceinline__ void stream_barrier(int stream) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + stream), "n"(32 * SLICES) : "memory");
}

__device__ __forceinline__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// ---- Asynchronous copies (global -> shared, sm_80+) -----------------------------------------

// Copies BYTES (4, 8 or 16) from global to shared memory without passing through registers; a
// row outside the attended range copies nothing and zero-fills its bytes (src-size 0).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  const uint32_t dst_addr = shared_address(dst);
  const uint32_t src_bytes = valid ? BYTES : 0;
  if constexpr (BYTES == 16) {  // streamed once: keep it out of L1
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;\n" ::"r"(dst_addr), "l"(src),
                 "n"(BYTES), "r"(src_bytes));
  }
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// ---- Tensor copies (global -> shared by the copy engine, sm_90) --------------------------------

// A tensor copy moves a box of a pool (16 token rows of a warp's slice) to shared memory without
// the load/store pipe, from a tensor map the host encodes per launch, and counts its bytes on an
// mbarrier in shared memory (its transaction count), which the consuming threads wait on. Each
// stage of a warp's ring has one barrier, with one arrival per filling.
//
// Tensor copies, the barriers' transaction counts and their initialisation fence need sm_90: a kernel
// compiled for an older architecture copies every tile with cp.async, whatever the launch's maps
// say, and synchronises its stages as before (cp.async groups and warp barriers alone).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kArchHasTensorCopies = false;
#else
constexpr bool kArchHasTensorCopies = true;
#endif
struct DecodeTensorMaps {
  CUtensorMap k;      // K pool: [pages][block_size rows][row bytes], box: a warp's slice of 16 rows
  CUtensorMap codes;  // V code rows, the same box shape
  // V scale rows, [pages][block_size rows][row scale bytes]; box: 16 bytes of 16 rows, from the warp's
  // slice's scales on (the narrowest box a tensor copy moves)
  CUtensorMap scales;
  uint32_t enabled;         // 0: the threads copy every tile (cp.async)
  uint32_t scales_enabled;  // with enabled: the scales by the copy engine too (0: by the threads)
};

// The barrier helpers and copy_box take shared-memory addresses (shared_address): a warp computes
// its barriers' addresses once, not per tile.
__device__ __forceinline__ void barrier_init(uint32_t barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(barrier));
}
// Makes initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// The filling thread's arrival, announcing `bytes` to come from tensor copies (0: none).
__device__ __forceinline__ void barrier_arrive_expecting(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void barrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}
// True in one lane of the warp (all lanes active; sm_90, like the tensor copies). Where lane 0 alone
// issues a tensor copy, whose operands must be uniform, the compiler wraps it in a loop over the
// active lanes, since it cannot tell that only one is; an elected lane needs no loop.
__device__ __forceinline__ bool elect_one_lane() {
  uint32_t elected;
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}
// Programmatic dependent launch (sm_90 code, as kArchHasTensorCopies): each decode CTA allows the
// merge kernel's launch once it has read its last tile, so that the merge's launch overlaps the
// decode's last epilogues; the merge kernel waits for the whole decode grid (its completion and
// its writes) before it reads the partials. Without the launch attribute both are no-ops.
__device__ __forceinline__ void allow_dependent_launch() {
  if constexpr (kArchHasTensorCopies) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
  if constexpr (kArchHasTensorCopies) asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Orders this thread's earlier writes to global memory before the tensor copies (the async
// proxy) that the CTA issues after a following barrier: the fused append's tokens, which the
// decode's copies read back.
__device__ __forceinline__ void fence_writes_before_tensor_copies() {
  if constexpr (kArchHasTensorCopies) asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Fetches a tensor map (a kernel parameter) into the copy engine's descriptor cache ahead of the
// first copy that uses it.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}
// The box of `map` at (byte x of a row, row y of a page, page z) into `dst` (128-byte aligned),
// counted on `barrier`.
__device__ __forceinline__ void copy_box(uint32_t dst, const CUtensorMap& map, int x, int y, int z, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(z), "r"(barrier)
      : "memory");
}
// `bytes` (a multiple of 16) of global memory at `src` into `dst`, both 16-byte aligned, by the copy
// engine, counted on `barrier`.
__device__ __forceinline__ void copy_bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(barrier)
               : "memory");
}

}  // namespace fp8kturbov
