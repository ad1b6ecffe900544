// The __global__ function of every split kernel (rows64, seesaw, narrow, fp8mma). Each runs a
// producer warpgroup that issues the TMA loads of the KV tiles and math warpgroups that consume
// them, with the registers moved from the one to the others; what differs is the Kernel policy:
//   Kernel::Traits              Element, SharedStorage, kSmemBytes of the kernel
//   Kernel::kThreads            (kMathWarpgroups + 1) x 128; also the launch bounds
//   Kernel::kMathWarpgroups     the producer is warpgroup kMathWarpgroups
//   Kernel::kMathRegisters, kProducerRegisters      the setmaxnreg split
//   Kernel::init_barriers<kGather>(ss)   thread 0 initialises the mbarriers (the shell syncs the CTA after)
//   Kernel::produce<kGather>(params, tma, ss, range, warp)   warp: 0..3 within the producer warpgroup
//   Kernel::consume<kGather>(params, tma, ss, range, warpgroup)
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

// Grid (num_q_tiles, num_sm_parts): CTA (m, part) works on q-tile m of its part of the schedule.
template <typename Kernel, bool kGather>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    mla_decode_split_kernel(__grid_constant__ const DecodeParams params, __grid_constant__ const DecodeTma tma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto& ss = mla_common::shared_storage_1024<typename Kernel::Traits::SharedStorage>();
  const int warpgroup = mla_common::warp_uniform(threadIdx.x / 128);
  const PartRange range = PartRange::load(params, blockIdx.y);
  // The combine kernel may start now: its CTAs fill SMs whose parts are done (or empty) and wait
  // in griddepcontrol.wait until this grid has finished and flushed.
  mla_common::launch_dependents();

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
#endif
}

}  // namespace mla_decode
