// Small device helpers shared by the kernels.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace mla_common {

// Named barrier over `num_threads` threads (a multiple of 32). Id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(int num_threads, int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Programmatic dependent launch: wait until the preceding kernel's memory is visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace mla_common
