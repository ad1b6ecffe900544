// Launchers of the ds_mla_fp8 cache kernels (ds_mla_fp8_kernel.cuh).
#include "kv_cache/ds_mla_fp8_kernel.cuh"

namespace mla_kv_cache {

using mla_common::Dtype;
using mla_common::with_type;

cudaError_t run_write_ds_mla_fp8(const WriteParams& params, Dtype in, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  return with_type(in, [&](auto in_tag) {
    using Tin = decltype(in_tag);
    if constexpr (std::is_same_v<Tin, __nv_bfloat16> || std::is_same_v<Tin, __half>) {
      const int blocks = num_blocks(params.num_tokens * 32);  // a warp per token
      write_ds_mla_fp8_kernel<Tin><<<blocks, kThreads, 0, stream>>>(params);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;  // the bindings only pass bf16 / fp16
    }
  });
}

cudaError_t run_gather_ds_mla_fp8(const GatherParams& params, Dtype out, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  return with_type(out, [&](auto out_tag) {
    using Tout = decltype(out_tag);
    if constexpr (!std::is_same_v<Tout, Fp8>) {
      gather_ds_mla_fp8_kernel<Tout><<<num_blocks(params.num_tokens * kChunksRow), kThreads, 0, stream>>>(params);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;  // the bindings only pass bf16 / fp16 / fp32
    }
  });
}

}  // namespace mla_kv_cache
