// How the seesaw kernel's Q tiles arrive: by TMA or by cp.async (shared/q_load.cuh).
#pragma once
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/q_load.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// How the seesaw kernel's Q tiles arrive: by TMA where DecodeTma::q_by_tma (h_q a multiple of 64:
// a tile is heads [h0, h0 + 64) of one token, all rows valid), 9 slab copies issued by math thread 0
// completing `q_full`; otherwise by cp.async from all math threads (rows past the request
// zero-filled). TMA measured faster at h_q 128, batch 1. The 64-row kernel keeps its plain cp.async
// load: with this loader its batch-1 cells ran slower, TMA or not.
struct QTileLoader {
  const DecodeParams& p;
  const DecodeTma& tma;
  uint64_t* q_full;
  uint32_t phase = 0;

  template <typename Element, typename SmemLayoutQ, typename SmemElement>
  __device__ void issue(const Segment& s, SmemElement* q_smem) const {
    if (!tma.q_by_tma) return issue_q_tile_load<Element, SmemLayoutQ>(p, s, q_smem);
    if (threadIdx.x != 0) return;
    const QueryRow row0 = QueryRow::of(p, int(blockIdx.x) * kBlockM);
    const int token = s.first_token + row0.token, h0 = row0.head;
    const int batch = p.cu_seqlens_q ? 0 : s.b;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(q_full, kBlockM * kHeadDimK * sizeof(Element));
#pragma unroll
    for (int slab = 0; slab < kSlabs; ++slab) {
      const bool pe = slab == kSlabs - 1;
      cute::SM90_TMA_LOAD_4D::copy(pe ? &tma.q_pe : &tma.q_nope, q_full, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                   q_smem + slab * kBlockM * kTmaColumns, pe ? 0 : slab * kTmaColumns, h0, token, batch);
    }
  }
  // The tile issued last is in shared memory (for this thread; a fence and a barrier over the math
  // threads make it visible to WGMMA and to the other threads).
  __device__ void wait() {
    if (!tma.q_by_tma) return mla_common::cp_async_wait_all();
    cutlass::arch::ClusterTransactionBarrier::wait(q_full, phase);
    phase ^= 1;
  }
};

}  // namespace mla_decode
