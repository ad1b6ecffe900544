// Host launchers of the split kernels and the combine kernel (templated on the element type;
// explicit instantiations live in instantiations/).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "mla_decode/combine_kernel.cuh"
#include "mla_decode/decode.h"
#include "mla_decode/decode_kernel.cuh"
#include "mla_decode/fp8mma_kernel.cuh"
#include "mla_decode/narrow_kernel.cuh"
#include "mla_decode/seesaw_kernel.cuh"

namespace mla_decode {

// Launches the split kernel (grid: q-tiles x parts) and, when any request is split, the combine
// kernel chained with PDL.
template <typename Element, typename Traits, typename Kernel>
cudaError_t launch_split_and_combine(Kernel kernel, const DecodeParams& params, const DecodeTma& tma,
                                     cudaStream_t stream) {
  constexpr int smem = Traits::kSmemBytes + 1024;  // + slack to align the map to 1024 bytes
  const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(params.num_q_tiles, params.num_sm_parts);
  kernel<<<grid, Traits::kThreads, smem, stream>>>(params, tma);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || params.num_sm_parts == 1) return err;  // one part: nothing is split

  const int max_rows = params.max_seqlen_q * params.num_heads_q;
  const int requests = std::min(params.batch, params.num_sm_parts - 1);  // that may be split
  const int chunks = combine_chunks(requests, max_rows);
  const int warps_per_row = combine_warps_per_row(requests, max_rows);
  const int rows_per_cta = kCombineWarps / warps_per_row;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(requests, (max_rows + rows_per_cta - 1) / rows_per_cta, chunks);
  config.blockDim = dim3(kCombineThreads);
  config.stream = stream;
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = pdl;
  config.numAttrs = 1;
  auto launch = [&](auto combine) -> cudaError_t {
    // Same shared-memory carveout as the split kernel, so the SMs need no reconfiguration between them.
    const cudaError_t attr = cudaFuncSetAttribute(combine, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                  int(cudaSharedmemCarveoutMaxShared));
    return attr != cudaSuccess ? attr : cudaLaunchKernelEx(&config, combine, params);
  };
  // A warp per row only with >= 2048 rows, hence one chunk.
  if (warps_per_row == 1) return launch(mla_combine_kernel<Element, 1, 1>);
  static_assert(kCombineMaxChunks == 32, "one instantiation per chunk count");
  switch (chunks) {
    case 1: return launch(mla_combine_kernel<Element, 1, kCombineWarps>);
    case 2: return launch(mla_combine_kernel<Element, 2, kCombineWarps>);
    case 4: return launch(mla_combine_kernel<Element, 4, kCombineWarps>);
    case 8: return launch(mla_combine_kernel<Element, 8, kCombineWarps>);
    case 16: return launch(mla_combine_kernel<Element, 16, kCombineWarps>);
    default: return launch(mla_combine_kernel<Element, 32, kCombineWarps>);
  }
}

template <typename Element, bool kFp8Kv>
cudaError_t run_mla_decode(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  using Traits = DecodeTraits<Element, kFp8Kv>;
  return launch_split_and_combine<Element, Traits>(mla_decode_kernel<Traits>, params, tma, stream);
}

template <typename Element>
cudaError_t run_mla_decode_fp8mma(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  using Traits = Fp8MmaTraits<Element>;
  return launch_split_and_combine<Element, Traits>(mla_decode_fp8mma_kernel<Traits>, params, tma, stream);
}

template <typename Element, bool kSteadyLoop>
cudaError_t run_mla_decode_seesaw(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  using Traits = SeesawTraits<Element>;
  return launch_split_and_combine<Element, Traits>(mla_decode_seesaw_kernel<Traits, kSteadyLoop>, params, tma,
                                                   stream);
}

template <typename Element, int kRows, int kMathWarpgroups, bool kFp8Kv>
cudaError_t run_mla_decode_narrow(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  using Traits = NarrowTraits<Element, kRows, kMathWarpgroups, kFp8Kv>;
  return launch_split_and_combine<Element, Traits>(mla_decode_narrow_kernel<Traits>, params, tma, stream);
}

}  // namespace mla_decode
