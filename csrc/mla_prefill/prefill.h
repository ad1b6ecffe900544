// Launcher of the prefill kernel (declarations only: the bindings never parse CuTe).
#pragma once
#include <cuda_runtime.h>
#include "mla_prefill/params.h"

namespace cutlass {  // element types of the instantiations, declared so the bindings need no CUTLASS
struct bfloat16_t;
struct half_t;
}  // namespace cutlass

namespace mla_prefill {

template <typename Element>
cudaError_t run_mla_prefill(const PrefillParams& params, const PrefillTma& tma, cudaStream_t stream);

}  // namespace mla_prefill
