#include "kv_cache/kv_cache_kernel.cuh"

namespace mla_kv_cache {

using mla_common::Dtype;
using mla_common::with_type;

cudaError_t run_write_kv_cache(const WriteParams& params, Dtype in, Dtype cache, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  return with_type(in, [&](auto in_tag) {
    return with_type(cache, [&](auto cache_tag) {
      using Tin = decltype(in_tag);
      using Tcache = decltype(cache_tag);
      constexpr bool kHalf = std::is_same_v<Tin, __nv_bfloat16> || std::is_same_v<Tin, __half>;
      if constexpr (kHalf && (std::is_same_v<Tcache, Tin> || std::is_same_v<Tcache, Fp8>)) {
        write_kernel<Tin, Tcache><<<num_blocks(params.num_tokens * kChunksRow), kThreads, 0, stream>>>(params);
        return cudaGetLastError();
      } else {
        return cudaErrorInvalidValue;  // the bindings only pass the pairs above
      }
    });
  });
}

cudaError_t run_gather_kv_cache(const GatherParams& params, Dtype cache, Dtype out, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  return with_type(cache, [&](auto cache_tag) {
    return with_type(out, [&](auto out_tag) {
      using Tcache = decltype(cache_tag);
      using Tout = decltype(out_tag);
      if constexpr (!std::is_same_v<Tcache, float> && !std::is_same_v<Tout, Fp8>) {
        gather_kernel<Tcache, Tout><<<num_blocks(params.num_tokens * kChunksRow), kThreads, 0, stream>>>(params);
        return cudaGetLastError();
      } else {
        return cudaErrorInvalidValue;  // the bindings only pass the pairs above
      }
    });
  });
}

}  // namespace mla_kv_cache
