// The 16-bit split kernel for one q-tile per request (17-64 query rows): the 64-row kernel's CTAs
// and the seesaw kernel's in one grid, each CTA choosing by its part's KV blocks. The seesaw kernel
// hides one warpgroup's softmax under the other's MMAs but costs more per segment; which pays
// depends on the KV lengths, which only the device sees (docs/design-decisions.md).
#pragma once
#include "mla_decode/rows64/kernel.cuh"
#include "mla_decode/seesaw/kernel.cuh"

namespace mla_decode {

template <typename Element>
cudaError_t run_mla_decode_rows64_seesaw(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  using Short = Rows64Kernel<Rows64Traits<Element, false>>;
  using Long = SeesawKernel<SeesawTraits<Element>, /*kSteadyLoop=*/true>;
  return launch_split_and_combine<ByPartKernel<Short, Long>>(params, tma, stream);
}

}  // namespace mla_decode
