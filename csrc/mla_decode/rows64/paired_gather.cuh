// The producer of the paired ds_mla_fp8 form of the 64-row kernel (Rows64Traits::kPairedQTiles).
//
// The two CTAs of a cluster run q-tiles 2i and 2i + 1 of the same requests (uniform query lengths:
// every q-tile of a request walks the same blocks), so both need every key row of every block. CTA r
// gathers rows [32r, 32r + 32) of each block by cp.async (producer warps 0-2: slabs w, w + 3, w + 6)
// and producer warp 3 copies that half into the other CTA's stage by bulk copies over distributed
// shared memory. A row then crosses an SM's cp.async path once per pair instead of once per q-tile:
// that path, not DRAM, bounds the row gather (docs/design-decisions.md, "What bounds the gather").
//
// Barriers of a stage, in each CTA:
//   kv_full[stage][slab]  33 arrivals: the 32 lanes of the warp that gathers the slab's local half (on
//                         their copies' completion) and its lane 0 posting the bytes of the peer's half,
//                         which the peer's bulk copies complete;
//   kv_empty[stage]       both CTAs' math warpgroups: a stage is released in both CTAs (the peer copies
//                         into it);
//   kv_landed[stage]      the 96 gathering lanes: the local half has landed (warp 3 copies it out);
//   kv_sent[stage]        one arrival by the peer's warp 3 once the peer holds this CTA's half: the bulk
//                         copies have read their source, which the converter then overwrites in place.
#pragma once
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

constexpr int kPairSize = 2;                   // CTAs of a cluster
constexpr int kPairRows = kBlockN / kPairSize;  // rows of a block each CTA gathers
constexpr int kPairGatherWarps = 3;             // producer warps that gather; the fourth sends

// The rank of the other CTA of the pair.
__device__ __forceinline__ uint32_t pair_peer_rank() { return cute::block_rank_in_cluster() ^ 1u; }

// One bulk copy of a CTA's half of a stage to its peer: bytes at `offset` in the stage (the same offset
// in the peer's), completing on kv_full[stage][slab].
struct PairPiece {
  int offset, bytes, slab;
};

// The 13 pieces of CTA `rank`'s half (rows [32 rank, 32 rank + 32)): the 8 staged e4m3 latent slabs
// (64-byte rows), the 16-bit rope slab (128-byte rows), and the rows' scales, 8 rows (128 bytes) per
// piece (Rows64Traits::ds_scales_offset), which count towards slab 0.
template <typename Traits>
struct PairHalf {
  static constexpr int kLatentSlabs = Traits::kFp8Slabs;
  static constexpr int kScalePieces = kPairRows / 8;
  static constexpr int kPieces = kLatentSlabs + 1 + kScalePieces;
  static_assert(Traits::kDsMlaFp8 && kPieces <= 32, "a lane per piece");

  __device__ static PairPiece piece(int i, int rank) {
    if (i < kLatentSlabs) {
      return {Traits::kFp8StagingOffset + i * kFp8SlabBytes + rank * kPairRows * kTmaColumns, kPairRows * kTmaColumns, i};
    }
    if (i == kLatentSlabs) return {Traits::kDsRopeSlabOffset + rank * kPairRows * 128, kPairRows * 128, kSlabs - 1};
    return {Traits::ds_scales_offset(rank * kPairRows + 8 * (i - kLatentSlabs - 1)), 8 * 16, 0};
  }
  // The bytes the peer's half brings to slab `slab` (what its pieces of that slab add up to).
  __device__ static constexpr uint32_t peer_bytes(int slab) {
    return slab == kSlabs - 1 ? kPairRows * 128 : kPairRows * kTmaColumns + (slab == 0 ? kPairRows * 16 : 0);
  }
};

// Thread 0 initialises the paired ring's barriers (above); the caller syncs the cluster after.
template <typename Traits>
__device__ __forceinline__ void init_paired_ring(typename Traits::SharedStorage& ss) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < Traits::kStages; ++s) {
    for (int slab = 0; slab < kSlabs; ++slab) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full[s][slab], kKvFullArrivals<true> + 1);
    }
    cutlass::arch::ClusterBarrier::init(&ss.kv_empty[s], kPairSize * kNumMathWarpgroups * kStageReleaseArrivals);
    cutlass::arch::ClusterBarrier::init(&ss.kv_landed[s], kPairGatherWarps * 32);
    cutlass::arch::ClusterBarrier::init(&ss.kv_sent[s], 1);
  }
  cutlass::arch::fence_barrier_init();
}

// A math warpgroup hands a stage back in both CTAs (kEveryThreadReleases: every thread, else the
// caller's one).
__device__ __forceinline__ void release_paired_stage(uint64_t* kv_empty) {
  cutlass::arch::ClusterBarrier::arrive(kv_empty);
  cutlass::arch::ClusterBarrier::arrive(kv_empty, pair_peer_rank(), 1u);
}

// Producer warp `warp` (0-3) of a paired CTA: warps 0-2 gather the local half of every block of the
// schedule, warp 3 copies each landed half to the peer and tells the peer when its own half has arrived.
template <typename Traits>
__device__ void produce_paired_tiles(const DecodeParams& p, const DecodeTma& tma, typename Traits::SharedStorage& ss,
                                     const PartRange& range, int warp) {
  using Half = PairHalf<Traits>;
  const int lane = threadIdx.x % 32;
  if (warp < kPairGatherWarps) {
    // The first row of this CTA's half, read where it is used (%cluster_ctarank): a register held across
    // the loop made the 40-register producer spill.
    for_each_scheduled_block(p, range, blockIdx.x, [&](const Segment& seg, const int* table, int blk, int iteration) {
      const int stage = iteration % Traits::kStages;
      auto first_row = [] { return int(cute::block_rank_in_cluster()) * kPairRows; };
      const auto rows = GatheredRows<Traits, kPairRows>::plan(p, tma, table, seg, blk, lane, first_row());
      if (iteration >= Traits::kStages) {  // both CTAs' math warpgroups are done with the stage
        cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / Traits::kStages) - 1) & 1);
      }
      if (lane == 0) {
        for (int slab = warp; slab < kSlabs; slab += kPairGatherWarps) {
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full[stage][slab], Half::peer_bytes(slab));
        }
      }
      rows.copy(p, ss, stage, warp, kPairGatherWarps, kSlabs, lane, first_row());
      arrive_when_copies_land(&ss.kv_landed[stage]);
    });
    return;
  }
  const uint32_t rank = cute::block_rank_in_cluster(), peer = rank ^ 1u;
  for_each_scheduled_block(p, range, blockIdx.x, [&](const Segment&, const int*, int, int iteration) {
    const int stage = iteration % Traits::kStages;
    const uint32_t phase = (iteration / Traits::kStages) & 1;
    cutlass::arch::ClusterBarrier::wait(&ss.kv_landed[stage], phase);
    if (lane < Half::kPieces) {
      // The gathered bytes were written by cp.async (generic proxy); the bulk copy reads them in the
      // async proxy.
      cutlass::arch::fence_view_async_shared();
      const PairPiece piece = Half::piece(lane, int(rank));
      const uint32_t src = mla_common::smem_addr(ss.k[stage]) + piece.offset;
      mla_common::bulk_copy_to_peer(mla_common::peer_smem_addr(src, peer), src, piece.bytes,
                                    mla_common::peer_smem_addr(mla_common::smem_addr(&ss.kv_full[stage][piece.slab]), peer));
    }
    // Every slab of this CTA's stage complete: the peer's half is here, so the peer's copies have read
    // their source and the peer may convert over it.
    if (lane < kSlabs) cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][lane], phase);
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_sent[stage], peer, 1u);
  });
}

}  // namespace mla_decode
