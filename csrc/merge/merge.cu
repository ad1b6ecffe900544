#include "merge/merge_kernel.cuh"

namespace mla_merge {

cudaError_t run_merge(const MergeParams& params, mla_common::Dtype dtype, cudaStream_t stream) {
  return mla_common::with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
      return cudaErrorInvalidValue;  // the bindings accept bf16, fp16 and fp32 only
    } else {
      return launch_merge<T>(params, stream);
    }
  });
}

}  // namespace mla_merge
