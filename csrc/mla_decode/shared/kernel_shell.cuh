// The __global__ function of every split kernel (rows64, seesaw, narrow, fp8mma). Each runs a
// producer warpgroup that issues the TMA loads of the KV tiles and math warpgroups that consume
// them, with the registers moved from the one to the others; what differs is the Kernel policy:
//   Kernel::Traits              Element, SharedStorage, kSmemBytes of the kernel
//   Kernel::kThreads            (kMathWarpgroups + 1) x 128; also the launch bounds
//   Kernel::kMathWarpgroups     the producer is warpgroup kMathWarpgroups
//   Kernel::kMathRegisters, kProducerRegisters      the setmaxnreg split
//   Kernel::init_barriers<kGather>(ss)   initialises the mbarriers and any ring state (the shell syncs the CTA after)
//   Kernel::produce<kGather>(params, tma, ss, range, warp)   warp: 0..3 within the producer warpgroup
//   Kernel::consume<kGather>(params, tma, ss, range, warpgroup)
// mla_decode_split_kernel_by_part runs one of two such policies per CTA.
// kGather (DecodeTma::gather): the producer gathers key rows one by one (page sizes that are not a
// multiple of 16, sparse slot lists) instead of TMA boxes of 16-64 rows; a variant of its own, so that
// the TMA kernels carry none of its code or registers.
#pragma once
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "common/device_utils.cuh"
#include "mla_decode/params.h"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// One CTA of a split kernel: the barriers, then the producer warpgroup and the math warpgroups.
template <typename Kernel, bool kGather>
__device__ __forceinline__ void run_split_cta(const DecodeParams& params, const DecodeTma& tma,
                                              const PartRange& range) {
  auto& ss = mla_common::shared_storage_1024<typename Kernel::Traits::SharedStorage>();
  const int warpgroup = mla_common::warp_uniform(threadIdx.x / 128);
  Kernel::template init_barriers<kGather>(ss);
  __syncthreads();

  if (warpgroup == Kernel::kMathWarpgroups) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    if (!kGather && threadIdx.x % 32 == 0) cute::prefetch_tma_descriptor(&tma.kv);
    Kernel::template produce<kGather>(params, tma, ss, range, int(threadIdx.x / 32) - Kernel::kMathWarpgroups * 4);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kMathRegisters>();
    Kernel::template consume<kGather>(params, tma, ss, range, warpgroup);
  }
}

// Grid (num_q_tiles, num_sm_parts): CTA (m, part) works on q-tile m of its part of the schedule.
template <typename Kernel, bool kGather>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    mla_decode_split_kernel(__grid_constant__ const DecodeParams params, __grid_constant__ const DecodeTma tma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const PartRange range = PartRange::load(params, blockIdx.y);
  // The combine kernel may start now: its CTAs fill SMs whose parts are done (or empty) and wait
  // in griddepcontrol.wait until this grid has finished and flushed.
  mla_common::launch_dependents();
  run_split_cta<Kernel, kGather>(params, tma, range);
#endif
}

// The same, each CTA running ShortKernel or LongKernel by the KV blocks of its part (the lengths are
// on the device: the host cannot choose). Both take TMA boxes, the same threads and register split.
// Written this way round, ptxas lays the short kernel's body right behind the entry and the long one's
// after it (the other way round, the short body sat 127 KB in): short calls are the ones whose time
// instruction fetch shows in (docs/design-decisions.md).
template <typename ShortKernel, typename LongKernel>
__global__ void __launch_bounds__(ShortKernel::kThreads, 1)
    mla_decode_split_kernel_by_part(__grid_constant__ const DecodeParams params,
                                    __grid_constant__ const DecodeTma tma) {
  static_assert(ShortKernel::kThreads == LongKernel::kThreads &&
                    ShortKernel::kMathWarpgroups == LongKernel::kMathWarpgroups &&
                    ShortKernel::kMathRegisters == LongKernel::kMathRegisters &&
                    ShortKernel::kProducerRegisters == LongKernel::kProducerRegisters,
                "one launch configuration for both kernels");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const PartRange range = PartRange::load(params, blockIdx.y);
  mla_common::launch_dependents();
  if (range.blocks_at_least() >= kLongPartBlocks) {
    run_split_cta<LongKernel, false>(params, tma, range);
  } else {
    run_split_cta<ShortKernel, false>(params, tma, range);
  }
#endif
}

}  // namespace mla_decode
