// The WGMMA chains of the 64-row kernels (rows64, seesaw, fp8mma): S = Q K^T slab by slab as the
// slabs land, and O = O * rescale + P V.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"

namespace mla_decode {

// S = Q K^T of the K tile at k_smem, slabs [first_slab, end_slab): one WGMMA commit group per slab,
// each issued once the slab has landed (kv_full[slab] at `phase`); the k-steps accumulate into tSrS
// after the first (callers start a tile with ScaleOut::Zero). Pass a warp-uniform k_smem
// (mla_common::warp_uniform): its descriptors are then built on the uniform datapath.
// kPollSlabs: poll the slab barriers (mla_common::poll_wait) instead of suspending in try_wait:
// measured faster in the seesaw kernel, slower in the e4m3-MMA kernel (there the polling warps take
// issue slots from the other warpgroup's work).
template <typename SmemLayoutQ, typename SmemLayoutK, bool kPollSlabs = false, typename Mma, typename ThrMma,
          typename TensorS, typename T>
__device__ __forceinline__ void issue_qk_slabs(Mma& mma, const ThrMma& thr, TensorS& tSrS, T* q_smem, T* k_smem,
                                               const uint64_t* kv_full, uint32_t phase, int first_slab, int end_slab) {
  using namespace cute;
  Tensor tSrQ = thr.partition_fragment_A(make_tensor(make_smem_ptr(q_smem), SmemLayoutQ{}));
  Tensor tSrK = thr.partition_fragment_B(make_tensor(make_smem_ptr(k_smem), SmemLayoutK{}));
  constexpr int kStepsPerSlab = int(decltype(size<2>(tSrQ))::value) / kSlabs;
#pragma unroll
  for (int slab = first_slab; slab < end_slab; ++slab) {
    if constexpr (kPollSlabs) {
      mla_common::poll_wait(&kv_full[slab], phase);
    } else {
      cutlass::arch::ClusterBarrier::wait(&kv_full[slab], phase);
    }
    warpgroup_arrive();
#pragma unroll
    for (int k = slab * kStepsPerSlab; k < (slab + 1) * kStepsPerSlab; ++k) {
      gemm(mma, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  }
}

// O[:, this warpgroup's columns] = O * rescale + P V, no PV of the warpgroup in flight: the
// rescale is skipped while every factor of the warp is 1 (the running max settled: 128 multiplies
// saved), then one commit group of PV WGMMAs with P (A) and V (B) from shared memory. Element e of
// the accumulator is in row r0 + 8 ((e >> 1) & 1).
template <typename SmemLayoutP, typename SmemLayoutV, typename Mma, typename ThrMma, typename TensorO, typename T>
__device__ __forceinline__ void rescale_and_issue_pv(Mma& mma, const ThrMma& thr, TensorO& tOrO, const float (&rescale)[2],
                                                     T* p_smem, T* v_smem) {
  using namespace cute;
  if (__any_sync(0xffffffff, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
    for (int e = 0; e < int(size(tOrO)); ++e) tOrO(e) *= rescale[(e >> 1) & 1];
  }
  Tensor tOrP = thr.partition_fragment_A(make_tensor(make_smem_ptr(p_smem), SmemLayoutP{}));
  Tensor tOrV = thr.partition_fragment_B(make_tensor(make_smem_ptr(v_smem), SmemLayoutV{}));
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < size<2>(tOrP); ++k) gemm(mma, tOrP(_, _, k), tOrV(_, _, k), tOrO);
  warpgroup_commit_batch();
}

}  // namespace mla_decode
