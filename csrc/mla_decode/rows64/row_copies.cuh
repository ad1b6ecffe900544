// The producer of the row-staged forms of the 64-row kernel (Rows64Traits::kRowStaged: its fp8 forms,
// ds_mla_fp8 and e4m3, at every page size): every key row of a block arrives whole by bulk copy on the TMA unit
// (cp.async.bulk, no tensor map) into the stage's staging rows (Rows64Traits: kRowStagingOffset): an
// e4m3 row's 576 bytes in one copy; a ds_mla_fp8 row's 512 e4m3 values and 4 scales (528 bytes) in one
// and its 64 bf16 rope values (128 bytes) in another, into the rope slab (kDsRopeSlabOffset). Row gathers
// by 16-byte cp.async were bound by an SM's cp.async path (docs/design-decisions.md, "What bounds the
// gather"); a bulk copy moves a row per instruction. One kv_full barrier per stage counts the block's
// bytes: each producer warp arrives once with the bytes of the rows it copies, after it has stored
// which of its 16 keys those are in key_copied (keys past the sequence end, and with
// skip_invalid_slots keys whose slot lies outside the cache, are not copied; the converter zeroes
// their rows and the softmax masks them).
#pragma once
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "common/ds_mla_fp8_layout.h"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// Thread 0 initialises the ring's barriers: kv_full[stage][0] (one arrival per producer warp, with its
// rows' bytes) and kv_empty[stage] (the math warpgroups); the caller syncs the CTA after.
template <typename Traits>
__device__ __forceinline__ void init_row_ring(typename Traits::SharedStorage& ss) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < Traits::kStages; ++s) {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full[s][0], kProducerWarps);
    cutlass::arch::ClusterBarrier::init(&ss.kv_empty[s], kNumMathWarpgroups * kStageReleaseArrivals);
  }
  cutlass::arch::fence_barrier_init();
}

// Producer warp `warp` (0-3): its lanes copy rows [16 * warp, 16 * warp + 16) of each block of the
// schedule, one row per lane; its lane 0 posts which of them and how many bytes.
template <typename Traits>
__device__ void produce_staged_rows(const DecodeParams& p, const DecodeTma& tma, typename Traits::SharedStorage& ss,
                                   const PartRange& range, int warp) {
  constexpr int kRowsPerWarp = kBlockN / kProducerWarps;
  // The bytes of a row: staged (e4m3 values, and the ds_mla_fp8 scales) and the ds_mla_fp8 rope.
  constexpr uint32_t kStagedBytes = Traits::kDsMlaFp8 ? mla_common::kDsRopeOffset : kHeadDimK;
  constexpr uint32_t kRopeBytes = Traits::kDsMlaFp8 ? mla_common::kDsRowBytes - kStagedBytes : 0;
  const int lane = threadIdx.x % 32;
  for_each_scheduled_block(p, range, blockIdx.x, [&](const Segment& seg, const int* table, int blk, int iteration) {
    const int stage = iteration % Traits::kStages;
    const int row = warp * kRowsPerWarp + lane;
    const int key = blk * kBlockN + row;
    bool copies = lane < kRowsPerWarp && key < seg.seqlen_k;
    if (p.skip_invalid_slots && copies) copies = uint32_t(table[key]) < uint32_t(p.num_pages * p.page_size);
    const uint8_t* src = static_cast<const uint8_t*>(p.kv) + (copies ? cache_row_offset(p, tma, table, key) : 0);
    if (iteration >= Traits::kStages) {  // the math warpgroups are done with the stage
      cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / Traits::kStages) - 1) & 1);
    }
    const uint32_t copied = __ballot_sync(0xffffffffu, copies);  // bits 0-15: this warp's rows
    const uint32_t full = mla_common::smem_addr(&ss.kv_full[stage][0]);
    if (lane == 0) {  // the stage is free: its key_copied too; the arrival publishes this store
      reinterpret_cast<uint16_t*>(&ss.key_copied[stage])[warp] = uint16_t(copied);
      // May follow some of the copies' completions (the count dips below zero).
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full[stage][0],
                                                                     __popc(copied) * (kStagedBytes + kRopeBytes));
    }
    if (copies) {
      const uint32_t tile = mla_common::smem_addr(ss.k[stage]);
      const uint32_t staged = tile + Traits::kRowStagingOffset + row * Traits::kRowStagingStride;
      const uint32_t rope = tile + Traits::kDsRopeSlabOffset + row * 128;
      mla_common::bulk_copy_g2s(staged, src, kStagedBytes, full);
      if constexpr (Traits::kDsMlaFp8) mla_common::bulk_copy_g2s(rope, src + kStagedBytes, kRopeBytes, full);
    }
  });
}

}  // namespace mla_decode
