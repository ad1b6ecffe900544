// Host launcher of the prefill kernel (templated on the element type; explicit instantiations live
// in instantiations/).
#pragma once
#include <cuda_runtime.h>

#include "mla_prefill/prefill.h"
#include "mla_prefill/prefill_kernel.cuh"

namespace mla_prefill {

template <typename Element>
cudaError_t run_mla_prefill(const PrefillParams& params, const PrefillTma& tma, cudaStream_t stream) {
  using Traits = PrefillTraits<Element>;
  auto kernel = mla_prefill_kernel<Traits>;
  constexpr int smem = Traits::kSmemBytes + 1024;  // + slack to align the map to 1024 bytes
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(params.num_m_blocks, params.num_heads_q, params.batch);
  kernel<<<grid, kNumThreads, smem, stream>>>(params, tma);
  return cudaGetLastError();
}

}  // namespace mla_prefill
