// Host side of a split kernel (kernel_shell.cuh) and the combine kernel behind it. Each kernel's
// kernel.cuh defines its run_* launcher (decode.h) with this; its instantiations/ hold the explicit
// instantiations.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "mla_decode/combine/combine_kernel.cuh"
#include "mla_decode/decode.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/kernel_shell.cuh"
#include "mla_decode/shared/kv_producer.cuh"

namespace mla_decode {

// Whether a kernel's cache is only ever gathered row by row (Traits::kGatherOnly: the row-staged forms;
// ds_mla_fp8 rows have no TMA map); the caller then sets DecodeTma::gather.
template <typename Traits>
inline constexpr bool kGathersOnly = requires { requires Traits::kGatherOnly; };
// Whether it never gathers (Traits::kTmaOnly: a kernel whose gathered rows go to another form).
template <typename Traits>
inline constexpr bool kNeverGathers = requires { requires Traits::kTmaOnly; };

// The policy of a kernel whose CTAs each run Short or Long by the length of their part
// (mla_decode_split_kernel_by_part). TMA boxes only: the caller sends gathered rows to another kernel.
template <typename Short, typename Long>
struct ByPartKernel {
  using ShortKernel = Short;
  using LongKernel = Long;
  struct Traits {
    using Element = typename Short::Traits::Element;
    static_assert(std::is_same_v<Element, typename Long::Traits::Element>);
    static constexpr int kSmemBytes = std::max(Short::Traits::kSmemBytes, Long::Traits::kSmemBytes);
  };
  static constexpr int kThreads = Short::kThreads;
};
template <typename Kernel>
inline constexpr bool kIsByPart = requires { typename Kernel::LongKernel; };

// Launches the split kernel (grid: q-tiles x parts; its gathering variant where DecodeTma::gather)
// and, when any request is split, the combine kernel chained with PDL. kMayStoreFp32Partials: the
// kernel writes fp32 partials where DecodeParams::partials_fp32 (the combine is instantiated for them).
template <typename Kernel, bool kMayStoreFp32Partials = false>
cudaError_t launch_split_and_combine(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  using Element = typename Kernel::Traits::Element;
  if constexpr (kIsByPart<Kernel>) {
    if (tma.gather) return cudaErrorInvalidValue;  // dispatch.h: decode_kernel_that_runs sends those to rows64
  }
  // The cache map must have the form the kernel reads (row groups: the narrow kernel's fp8 tiles;
  // the host asks make_kv_tma for it by the kernel it chose).
  if (!tma.gather && tma.row_groups != kTilesByRowGroups<typename Kernel::Traits>) return cudaErrorInvalidValue;
  const auto kernel = [&] {
    using Traits = typename Kernel::Traits;
    if constexpr (kIsByPart<Kernel>) {
      return mla_decode_split_kernel_by_part<typename Kernel::ShortKernel, typename Kernel::LongKernel>;
    } else if constexpr (kGathersOnly<Traits>) {
      return mla_decode_split_kernel<Kernel, true>;
    } else if constexpr (kNeverGathers<Traits>) {
      return mla_decode_split_kernel<Kernel, false>;
    } else {
      return tma.gather ? mla_decode_split_kernel<Kernel, true> : mla_decode_split_kernel<Kernel, false>;
    }
  }();
  constexpr int smem = Kernel::Traits::kSmemBytes + 1024;  // + slack to align the map to 1024 bytes
  const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(params.num_q_tiles, params.num_sm_parts);
  kernel<<<grid, Kernel::kThreads, smem, stream>>>(params, tma);
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
  auto launch_for = [&]<typename Partial>() -> cudaError_t {
    // A warp per row only with >= 2048 rows, hence one chunk.
    if (warps_per_row == 1) return launch(mla_combine_kernel<Element, Partial, 1, 1>);
    static_assert(kCombineMaxChunks == 32, "one instantiation per chunk count");
    switch (chunks) {
      case 1: return launch(mla_combine_kernel<Element, Partial, 1, kCombineWarps>);
      case 2: return launch(mla_combine_kernel<Element, Partial, 2, kCombineWarps>);
      case 4: return launch(mla_combine_kernel<Element, Partial, 4, kCombineWarps>);
      case 8: return launch(mla_combine_kernel<Element, Partial, 8, kCombineWarps>);
      case 16: return launch(mla_combine_kernel<Element, Partial, 16, kCombineWarps>);
      default: return launch(mla_combine_kernel<Element, Partial, 32, kCombineWarps>);
    }
  };
  if constexpr (kMayStoreFp32Partials) {
    if (params.partials_fp32) return launch_for.template operator()<float>();
  }
  return launch_for.template operator()<Element>();
}

}  // namespace mla_decode
