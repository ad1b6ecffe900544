// The TMA producer of the decode kernels: walks a CTA's schedule and loads its K tiles, slab by slab,
// into a ring of Traits::kStages stages.
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/schedule.cuh"

namespace mla_decode {
using namespace cute;

// Issues the K-tile loads of this CTA's schedule for slabs first_slab, first_slab + slab_step, ...
// Runs on one warp (several warps split the slabs: TMA issue from one thread is serial, and page 16
// needs 4 copies x 9 slabs per tile): lane c looks up the page of copy c of a block (a block spans
// up to 64 / rows_per_copy pages) before the warp waits for a free stage, so the dependent
// block-table read is off the critical path, then issues that copy's slabs.
// Traits: kStages, kFp8Kv, MmaElement (of the 16-bit tile), SharedStorage (kv_full [kStages][kSlabs], kv_empty [kStages])
// and kv_copy_dst(ss, stage, slab, row): where rows [row, row + rows_per_copy) of a slab land.
template <typename Traits>
__device__ void produce_kv_tiles(const DecodeParams& p, const DecodeTma& tma,
                                 typename Traits::SharedStorage& ss, const PartRange& range,
                                 int m_block, int first_slab, int slab_step) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int lane = threadIdx.x % 32;
  // Rows per copy divide both page_size and kBlockN, and are >= 16, so <= 4 copies. No division
  // by a run-time divisor per tile: a shift, and FastDivisor for the page (params.h).
  const int rows_log2 = tma.rows_per_copy_log2, rows = 1 << rows_log2;
  const uint32_t bytes_per_slab_row = Traits::kFp8Kv ? kTmaColumns : kTmaColumns * sizeof(typename Traits::MmaElement);
  int iteration = 0;
  Segment seg;
  for (int b = range.begin_b; range.next_segment(p, b, m_block, seg); b = seg.b + 1) {
    const int* pages = p.block_table + int64_t(seg.b) * p.block_table_stride;
    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) {
      const int stage = iteration % Traits::kStages;
      // Only copies that start before the sequence end are issued; the math warpgroups zero the
      // rest of the tile, so no page past ceil(L / page_size) is ever dereferenced.
      const int key0 = blk * kBlockN;
      const int num_copies = (min(max(seg.seqlen_k - key0, 0), kBlockN) + rows - 1) >> rows_log2;
      const int key = key0 + lane * rows;
      const int page_index = __umulhi(uint32_t(key), tma.page_size.multiplier) >> tma.page_size.shift;
      const int row_in_page = key - page_index * tma.page_size.divisor;
      const int page = lane < num_copies ? min(max(pages[page_index], 0), p.num_pages - 1) : 0;
      if (iteration >= Traits::kStages) {
        cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / Traits::kStages) - 1) & 1);
      }
      // Each 64-column slab completes its own barrier, so QK can start on slab 0 while the others
      // are in flight. Expected bytes may be posted after some copies land (the transaction count
      // may dip below zero within a phase).
      if (lane == 0) {
        for (int slab = first_slab; slab < kSlabs; slab += slab_step) {
          Barrier::arrive_and_expect_tx(&ss.kv_full[stage][slab], num_copies * rows * bytes_per_slab_row);
        }
      }
      if (lane < num_copies) {
        for (int slab = first_slab; slab < kSlabs; slab += slab_step) {
          SM90_TMA_LOAD_3D::copy(&tma.kv, &ss.kv_full[stage][slab], uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                                 Traits::kv_copy_dst(ss, stage, slab, lane * rows), slab * kTmaColumns,
                                 row_in_page, page);
        }
      }
    }
  }
}

}  // namespace mla_decode
