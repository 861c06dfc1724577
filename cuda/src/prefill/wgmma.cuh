// The prefill's warpgroup matrix PTX (sm_90a: wgmma): products of a 64-row tile whose operands lie in
// shared memory in the no-swizzle ("interleaved") canonical layout of 8 x 8 core matrices (each 8
// rows of 16 bytes, 128 contiguous bytes), described by matrix descriptors; the accumulators are
// the threads' registers in the layout of mma.sync's m16n8 fragments (warp w of the warpgroup holds
// rows 16w .. 16w + 15). Compiled only where the target has the instructions
// (__CUDA_ARCH_FEAT_SM90_ALL); other targets keep the mma.sync path.
#pragma once

#include <cstdint>

namespace fp8kturbov {

// Byte offset of element (row r, column c) of a 16-bit tile of COLS columns in the blocked layout:
// core matrix (r / 8, c / 8) at (r / 8)·COLS·16 + (c / 8)·128, row r % 8 at 16 bytes a row.
template <int COLS>
__host__ __device__ constexpr uint32_t blocked_offset(int r, int c) {
  return uint32_t((r / 8) * COLS * 16 + (c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2);
}

// Whether this compilation's target runs wgmma (sm_90a); the kernel's other path where it does not.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP8KTURBOV_WGMMA 1
constexpr bool kPrefillWgmma = true;
#else
#define FP8KTURBOV_WGMMA 0
constexpr bool kPrefillWgmma = false;
#endif
// The wrappers below compile for every target, their instructions only where FP8KTURBOV_WGMMA is 1:
// the kernel calls them in `if constexpr (kPrefillWgmma)` branches only.

// A shared-memory matrix descriptor, no swizzle: start address, the byte distance between core
// matrices adjacent along K (leading) and along M or N (stride), each in 16-byte units.
__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes) {
  return uint64_t((address >> 4) & 0x3FFF) | uint64_t((leading_bytes >> 4) & 0x3FFF) << 16 |
         uint64_t((stride_bytes >> 4) & 0x3FFF) << 32;
}

// Orders this thread's register writes before the warpgroup's next products read them.
__device__ __forceinline__ void wgmma_fence() {
#if FP8KTURBOV_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if FP8KTURBOV_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most PENDING committed groups of products are in flight.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
#if FP8KTURBOV_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
#endif
}
// Pins a product's registers here: the compiler moves no instruction that reads or writes them across
// this point, so that none lands between a product's issue and the wgmma_wait that ends it (ptxas
// would then serialise the products).
template <int TILES>
__device__ __forceinline__ void wgmma_fence_operands(float (&r)[TILES][4]) {
#pragma unroll
  for (int j = 0; j < TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[j][e])::"memory");
}
template <int TILES>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&r)[TILES][4]) {
#pragma unroll
  for (int j = 0; j < TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[j][e])::"memory");
}
// Shared-memory writes of this thread visible to the asynchronous proxy (the products' reads).
__device__ __forceinline__ void fence_shared_for_wgmma() {
#if FP8KTURBOV_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// D (+)= A·B, 64 x N x 16: A 64 x 16 and B N x 16 both K-major in shared memory (descriptors);
// ACCUMULATE false overwrites D.
template <int N>
__device__ __forceinline__ void wgmma_ss_kk(float (&d)[N / 8][4], uint64_t a, uint64_t b, bool accumulate);
// D += A·B, 64 x N x 16: A from registers (mma.sync's A fragments of the warp's 16 rows), B 16 x N
// MN-major (transposed) in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_mn(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b);

template <>
__device__ __forceinline__ void wgmma_ss_kk<32>(float (&d)[4][4], uint64_t a, uint64_t b, bool accumulate) {
#if FP8KTURBOV_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(a), "l"(b), "r"(int(accumulate)));
#endif
}

template <>
__device__ __forceinline__ void wgmma_ss_kk<64>(float (&d)[8][4], uint64_t a, uint64_t b, bool accumulate) {
#if FP8KTURBOV_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a), "l"(b), "r"(int(accumulate)));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs_mn<64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {
#if FP8KTURBOV_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs_mn<128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {
#if FP8KTURBOV_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs_mn<256>(float (&d)[32][4], const uint32_t (&a)[4], uint64_t b) {
#if FP8KTURBOV_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
}

// S = Q·Kᵀ of a warpgroup's 64 query rows and N positions, issued and committed but not waited for:
// the Q and K tiles K-major in the blocked layout (blocks of 8 rows, HEAD_DIM · 16 bytes; head_dim
// the reduced dimension). s stays the products' until the warpgroup's next wgmma_wait.
template <int N, int HEAD_DIM>
__device__ __forceinline__ void issue_wgmma_scores(float (&s)[N / 8][4], uint32_t q_address, uint32_t k_address) {
  constexpr uint32_t kRowBlockBytes = HEAD_DIM * 16;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
    wgmma_ss_kk<N>(s, matrix_descriptor(q_address + ks * 256, 128, kRowBlockBytes),
                   matrix_descriptor(k_address + ks * 256, 128, kRowBlockBytes), ks > 0);
  wgmma_commit();
}

// The same, waited for.
template <int N, int HEAD_DIM>
__device__ __forceinline__ void wgmma_scores(float (&s)[N / 8][4], uint32_t q_address, uint32_t k_address) {
  issue_wgmma_scores<N, HEAD_DIM>(s, q_address, k_address);
  wgmma_wait<0>();
}

}  // namespace fp8kturbov
