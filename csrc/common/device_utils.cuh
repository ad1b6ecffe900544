// Small device helpers shared by the kernels.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace mla_common {

// Named barrier kId over kThreads threads (a multiple of 32); id 0 is __syncthreads. Id and count
// are immediates, so every barrier instruction names its barrier statically.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0);
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

// Barrier kId0 + which (which is 0 or 1, uniform across the warp).
template <int kId0, int kThreads>
__device__ __forceinline__ void named_barrier_sync(int which) {
  if (which == 0) named_barrier_sync<kId0, kThreads>();
  else named_barrier_sync<kId0 + 1, kThreads>();
}

// `v` (equal in all lanes) broadcast from lane 0, which the compiler knows is warp-uniform: WGMMA
// descriptors derived from it are computed on the uniform datapath instead of in vector registers
// moved over with R2UR before each WGMMA.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffff, v, 0); }

// Programmatic dependent launch: wait until the preceding kernel's memory is visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Zeroes 16 bytes through a generic pointer known to point into shared memory, as st.shared (CuTe's
// swizzled smem pointers are computed with integer arithmetic, which makes plain stores generic).
__device__ __forceinline__ void st_shared_zero16(void* smem) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
               "r"(0)
               : "memory");
}

// Stores 16 bytes through a generic pointer known to point into shared memory, as st.shared.
__device__ __forceinline__ void st_shared_16(void* smem, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Stores 2 bytes through a generic pointer known to point into shared memory, as st.shared.
__device__ __forceinline__ void st_shared_2(void* smem, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "h"(v)
               : "memory");
}

// Shared-window address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* smem) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
}

// Waits until the phase of parity `phase` of the mbarrier at `bar` has completed by polling it
// (test_wait) instead of suspending in try_wait, as cutlass::arch::ClusterBarrier::wait does: the 4
// warps of a warpgroup that wait for the same TMA slab then reach the WGMMA that needs all of them
// closer together, at the price of issue slots while they wait (issue_qk_slabs: kPollSlabs).
__device__ __forceinline__ void poll_wait(const uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_POLL:\nmbarrier.test_wait.parity.shared::cta.b64 P1, [%0], %1;\n@!P1 bra LAB_POLL;\n}"
      ::"r"(smem_addr(bar)), "r"(phase) : "memory");
}

// A 4-byte shared-memory flag written with release and read with acquire semantics (CTA scope).
__device__ __forceinline__ void st_release_shared(int* flag, int v) {
  asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"(smem_addr(flag)), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_shared(const int* flag) {
  int v;
  asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(v) : "r"(smem_addr(flag)) : "memory");
  return v;
}

// Stores 4 bytes at a shared-window address.
__device__ __forceinline__ void st_shared_4(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_8(uint32_t addr, uint32_t lo, uint32_t hi) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(lo), "r"(hi) : "memory");
}
__device__ __forceinline__ void st_shared_16(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// 16-byte global -> shared copy that bypasses registers; src_bytes = 0 writes zeros instead.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Bulk copy (the TMA unit, no tensor map) of `bytes` (a multiple of 16, both addresses 16-byte
// aligned) from global memory to this CTA's shared memory at `dst`, completing `bytes` of transaction
// on the mbarrier at `bar`.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// 16-byte shared-memory load (shared-window address).
__device__ __forceinline__ uint4 ld_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// 4-byte shared-memory load of a float (shared-window address).
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}

// ldmatrix.x4.trans: four 8x8 16-bit matrices, lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// stmatrix.x4: four 8x8 16-bit matrices from registers (ri: this lane's pair of row lane / 4 of matrix
// i), lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// Returns `ptr` through an opaque move, so the compiler recomputes what derives from it (WGMMA
// descriptors) at each use instead of keeping dozens of them live in registers across a loop.
template <typename T>
__device__ __forceinline__ T* opaque(T* ptr) {
  uint64_t v = reinterpret_cast<uint64_t>(ptr);
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  return reinterpret_cast<T*>(v);
}

// The same for an integer: what derives from it is recomputed at each use, not hoisted.
__device__ __forceinline__ int opaque(int v) {
  asm volatile("mov.b32 %0, %0;" : "+r"(v));
  return v;
}

// Programmatic dependent launch: lets the next kernel in the stream start its prologue now.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The kernel's shared-memory map, placed at the first 1024-byte boundary of the dynamic shared memory:
// the 128-byte swizzle pattern is anchored there (launchers request 1024 bytes of slack). Offsetting
// the array itself (not an integer-cast pointer) keeps accesses in the shared state space: LDS/STS
// instead of generic loads and stores.
template <typename Storage>
__device__ __forceinline__ Storage& shared_storage_1024() {
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return *reinterpret_cast<Storage*>(smem + (((base + 1023) & ~1023u) - base));
}

}  // namespace mla_common
