// The producer of the row-staged forms (Traits::kRowStaged: the 64-row kernel's fp8 forms, ds_mla_fp8
// and e4m3, and the narrow kernel's gathering forms): every key row of a block arrives whole by bulk
// copy on the TMA unit (cp.async.bulk, no tensor map) into the stage's staging rows, where the kernel
// reads it from: Traits::staged_row_addr gets a row's first kStagedBytes (rows64: an e4m3 row's 576
// bytes, or a ds_mla_fp8 row's 512 e4m3 values and 4 scales; narrow: the whole row, 576, 656 or 1152
// bytes), Traits::rope_row_addr the kRopeBytes after them (rows64's ds_mla_fp8 rope, into its 16-bit
// rope slab; none elsewhere). Row gathers by 16-byte cp.async were bound by an SM's cp.async path
// (docs/design-decisions.md, "What bounds the gather"); a bulk copy moves a row per instruction. One
// kv_full barrier per stage counts the block's bytes: each producer warp arrives once with the bytes
// of the rows it copies, after it has stored which of its 16 keys those are in key_copied (keys past
// the sequence end, and with skip_invalid_slots keys whose slot lies outside the cache, are not
// copied; the consumer zeroes or masks their rows).
#pragma once
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// Thread 0 initialises the ring's barriers: kv_full[stage][0] (one arrival per producer warp, with its
// rows' bytes) and kv_empty[stage] (empty_arrivals: the consumers' arrivals that free a stage); the
// caller syncs the CTA after.
template <typename Traits>
__device__ __forceinline__ void init_row_ring(typename Traits::SharedStorage& ss, int empty_arrivals) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < Traits::kStages; ++s) {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full[s][0], kProducerWarps);
    cutlass::arch::ClusterBarrier::init(&ss.kv_empty[s], empty_arrivals);
  }
  cutlass::arch::fence_barrier_init();
}

// Producer warp `warp` (0-3): its lanes copy rows [16 * warp, 16 * warp + 16) of each block of the
// schedule, one row per lane; its lane 0 posts which of them and how many bytes.
template <typename Traits>
__device__ void produce_staged_rows(const DecodeParams& p, const DecodeTma& tma, typename Traits::SharedStorage& ss,
                                   const PartRange& range, int warp) {
  constexpr int kRowsPerWarp = kBlockN / kProducerWarps;
  constexpr uint32_t kStagedBytes = Traits::kStagedBytes, kRopeBytes = Traits::kRopeBytes;
  const int lane = threadIdx.x % 32;
  for_each_scheduled_block(p, range, blockIdx.x, [&](const Segment& seg, const int* table, int blk, int iteration) {
    const int stage = iteration % Traits::kStages;
    const int row = warp * kRowsPerWarp + lane;
    const int key = blk * kBlockN + row;
    bool copies = lane < kRowsPerWarp && key < seg.seqlen_k;
    if (p.skip_invalid_slots && copies) copies = uint32_t(table[key]) < uint32_t(p.num_pages * p.page_size);
    const uint8_t* src = static_cast<const uint8_t*>(p.kv) +
                         (copies ? cache_row_offset(p, tma, table, key) * Traits::kCacheElementBytes : 0);
    if (iteration >= Traits::kStages) {  // the consumers are done with the stage
      cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / Traits::kStages) - 1) & 1);
    }
    record_stage_fill<Traits>(ss, stage, iteration);
    const uint32_t copied = __ballot_sync(0xffffffffu, copies);  // bits 0-15: this warp's rows
    const uint32_t full = mla_common::smem_addr(&ss.kv_full[stage][0]);
    if (lane == 0) {  // the stage is free: its key_copied too; the arrival publishes this store
      reinterpret_cast<uint16_t*>(&ss.key_copied[stage])[warp] = uint16_t(copied);
      // May follow some of the copies' completions (the count dips below zero).
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full[stage][0],
                                                                     __popc(copied) * (kStagedBytes + kRopeBytes));
    }
    if (copies) {
      mla_common::bulk_copy_g2s(Traits::staged_row_addr(ss, stage, row), src, kStagedBytes, full);
      if constexpr (kRopeBytes > 0) {
        mla_common::bulk_copy_g2s(Traits::rope_row_addr(ss, stage, row), src + kStagedBytes, kRopeBytes, full);
      }
    }
  });
}

}  // namespace mla_decode
