// The producer of the decode kernels: walks a CTA's schedule and loads its K tiles, slab by slab
// (the narrow kernel's fp8 tiles: by 16-key row groups), into a ring of Traits::kStages stages: by TMA
// where keys come in runs of >= 16 rows of one page (BlockCopies), else row by row by cp.async into
// the same swizzled layout (GatheredRows: page sizes that are not a multiple of 16, the sparse key
// lists of kv_slots). The 64-row kernel's fp8 forms copy
// whole rows instead (shared/row_copies.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {
using namespace cute;

// The TMA copies of one KV block, as seen by one lane of a producer warp: copy c (lane c) loads
// rows [c * rows, (c + 1) * rows) of the block from one page. Only copies that start before the
// sequence end are issued; the math warpgroups zero the rest of the tile, so no page past
// ceil(L / page_size) is ever dereferenced. The dependent block-table read happens here, before the
// warp waits for a free stage, so it is off the critical path.
template <typename Traits>
struct BlockCopies {
  int num_copies, rows, row_in_page, page;

  // Rows per copy divide both page_size and kBlockN, and are >= 16, so <= 4 copies. No division
  // by a run-time divisor per tile: a shift, and FastDivisor for the page (params.h).
  __device__ static BlockCopies plan(const DecodeParams& p, const DecodeTma& tma, const int* pages,
                                     const Segment& seg, int blk, int lane) {
    BlockCopies c;
    c.rows = 1 << tma.rows_per_copy_log2;
    const int key0 = blk * kBlockN;
    c.num_copies = (min(max(seg.seqlen_k - key0, 0), kBlockN) + c.rows - 1) >> tma.rows_per_copy_log2;
    const int key = key0 + lane * c.rows;
    const int page_index = __umulhi(uint32_t(key), tma.page_size.multiplier) >> tma.page_size.shift;
    c.row_in_page = key - page_index * tma.page_size.divisor;
    c.page = lane < c.num_copies ? min(max(pages[page_index], 0), p.num_pages - 1) : 0;
    return c;
  }
  // Lane 0 posts the bytes slab `slab` of the block will bring. Expected bytes may be posted after
  // some copies land (the transaction count may dip below zero within a phase).
  __device__ void expect(typename Traits::SharedStorage& ss, int stage, int slab, int lane) const {
    constexpr uint32_t kBytesPerSlabRow = Traits::kFp8Kv ? kTmaColumns : kTmaColumns * sizeof(typename Traits::MmaElement);
    if (lane == 0) {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full[stage][slab],
                                                                     num_copies * rows * kBytesPerSlabRow);
    }
  }
  // Row groups (kRowGroupTiles; 16 rows per copy): copy c brings all nine slabs of rows [16 c, 16 c + 16)
  // to the group's place in the tile, and lane 0 posts the tile's bytes on the stage's one barrier.
  __device__ void copy_row_groups(const DecodeTma& tma, typename Traits::SharedStorage& ss, int stage, int lane) const {
    if (lane == 0) {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full[stage][0], num_copies * kFp8GroupBytes);
    }
    if (lane < num_copies) {
      SM90_TMA_LOAD_4D::copy(&tma.kv, &ss.kv_full[stage][0], uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                             reinterpret_cast<uint8_t*>(ss.kv[stage]) + lane * kFp8GroupBytes, 0, row_in_page, 0, page);
    }
  }
  // Each lane issues its copy of slab `slab`; each 64-column slab completes its own barrier, so
  // QK can start on a slab while the others are in flight.
  __device__ void copy(const DecodeTma& tma, typename Traits::SharedStorage& ss, int stage, int slab, int lane) const {
    if (lane < num_copies) {
      SM90_TMA_LOAD_3D::copy(&tma.kv, &ss.kv_full[stage][slab], uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                             Traits::kv_copy_dst(ss, stage, slab, lane * rows), slab * kTmaColumns,
                             row_in_page, page);
    }
  }
};

// Whether Traits' TMA tiles arrive by 16-key row groups (Traits::kRowGroupTiles: the narrow kernel's fp8
// form; DecodeTma::kv is then the row-group map, make_kv_tma).
template <typename Traits>
inline constexpr bool kTilesByRowGroups = requires { requires Traits::kRowGroupTiles; };

// Whether Traits stages whole key rows with one kv_full barrier per stage (Traits::kRowStaged, the
// 64-row kernel's fp8 forms; kernels without the member do not).
template <typename Traits>
inline constexpr bool kStagesRows = requires { requires Traits::kRowStaged; };

// Stage fills recorded for kernels whose math warpgroups take a ring's tiles in turn and whose stages do not
// divide among them (Traits::kStagesChangeHands, with SharedStorage::kv_fill[kStages]: the narrow kernel's
// e4m3 forms, tile i to warpgroup i % kMathWarpgroups and stage i % kStages, 5 stages for 2 or 3 warpgroups).
// There the uses of one stage go to different warpgroups, and one may wait for use n + 2 of a stage while
// use n + 1 has not landed: a parity wait cannot tell use n + 2 from use n (same parity), so it passed on
// the old bytes, released the stage early, and the ring's barriers lost their phases (wrong results, hangs,
// launch failures, under load at page 16). Thread 0 of the producer records the iteration it fills a stage
// with once the stage is free, i.e. once use n + 1's consumer has released it (so it had landed); the
// consumer of an iteration waits for that record before its parity waits (wait_for_stage_fill).
template <typename Traits>
inline constexpr bool kRecordsStageFills = requires { requires Traits::kStagesChangeHands; };

template <typename Traits>
__device__ __forceinline__ void record_stage_fill(typename Traits::SharedStorage& ss, int stage, int iteration) {
  if constexpr (kRecordsStageFills<Traits>) {
    if (threadIdx.x % 128 == 0) mla_common::st_release_shared(&ss.kv_fill[stage], iteration);
  }
}

template <typename Traits>
__device__ __forceinline__ void wait_for_stage_fill(typename Traits::SharedStorage& ss, int stage, int iteration) {
  while (mla_common::ld_acquire_shared(&ss.kv_fill[stage]) != iteration) {
  }
}

// A key row's block-table entry: the page id of its page, or its cache slot (kv_slots).
__device__ __forceinline__ int table_entry(const DecodeParams& p, const DecodeTma& tma, const int* table, int key) {
  return p.kv_slots ? table[key] : table[tma.page_size.divide(key)];
}

// The cache element offset of key `key` (< the request's length) whose table entry is `entry`. Never
// past the cache: a slot or page outside it is clamped (the Python layer checks them).
__device__ __forceinline__ int64_t cache_row_offset(const DecodeParams& p, const DecodeTma& tma, int entry, int key) {
  int page, row;
  if (p.kv_slots) {
    const int slot = min(max(entry, 0), p.num_pages * p.page_size - 1);
    page = tma.page_size.divide(slot);
    row = slot - page * p.page_size;
  } else {
    page = min(max(entry, 0), p.num_pages - 1);
    row = key - tma.page_size.divide(key) * p.page_size;
  }
  return int64_t(page) * p.kv_page_stride + int64_t(row) * p.kv_token_stride;
}
__device__ __forceinline__ int64_t cache_row_offset(const DecodeParams& p, const DecodeTma& tma, const int* table,
                                                    int key) {
  return cache_row_offset(p, tma, table_entry(p, tma, table, key), key);
}

// The cp.async gather of one KV block, as seen by one lane of a producer warp. A lane holds the cache
// byte offsets of key rows lane and lane + 32 of the block (0 for rows >= valid_rows, past the
// sequence end, which are zero-filled); the lanes that copy a row get its offset by shuffles. copy_slabs():
// each slab is issued by one warp, whose 32 lanes then arrive on its kv_full barrier (count 32) when
// their copies have landed (.noinc: the arrival is the cp.async completion's, as CUTLASS's cp.async
// GMMA pipelines do); copy_rows(): every warp copies whole rows and arrives on every slab's barrier.
template <typename Traits>
struct GatheredRows {
  static constexpr int kRowBytes = Traits::kFp8Kv ? kTmaColumns : kTmaColumns * 2;  // of a slab
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRowsPerPass = 32 / kChunksPerRow;  // rows one warp instruction covers
  int64_t offset[2];
  int valid_rows;  // rows of the block before the sequence end

  // A block's table entries, loaded (load) a block before its offsets are needed (from).
  struct Entries {
    int entry[2];
    int first_key;
    int valid_rows;
  };
  __device__ static Entries load(const DecodeParams& p, const DecodeTma& tma, const int* table, const Segment& seg,
                                 int blk, int lane) {
    Entries e;
    e.first_key = blk * kBlockN;
    e.valid_rows = seg.seqlen_k - e.first_key;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = lane + 32 * i;
      e.entry[i] = row < e.valid_rows ? table_entry(p, tma, table, e.first_key + row) : 0;
    }
    return e;
  }
  __device__ static GatheredRows from(const DecodeParams& p, const DecodeTma& tma, const Entries& e, int lane) {
    constexpr int kElementBytes = Traits::kFp8Kv ? 1 : 2;
    GatheredRows g;
    g.valid_rows = e.valid_rows;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = lane + 32 * i;
      g.offset[i] = row < g.valid_rows ? cache_row_offset(p, tma, e.entry[i], e.first_key + row) * kElementBytes : 0;
    }
    return g;
  }

  // Byte offset within a slab of 16-byte chunk `chunk` of row `row`, in the layout TMA writes: 128-byte
  // swizzle of 16-bit rows, or the 64-byte swizzle of fp8 ones (fp8_slab_offset). Slabs are 64 rows
  // each, back to back (every kernel's Traits::kv_copy_dst).
  static constexpr int kSlabBytes = kBlockN * kRowBytes;
  __device__ static int chunk_offset(int row, int chunk) {
    if constexpr (Traits::kFp8Kv) return fp8_slab_offset(row, chunk);
    else return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
  }

  // Copies slabs first_slab + k * kStep (k < count <= kMaxCount) of the rows of passes first_pass,
  // first_pass + kPassStride, ... (kRowsPerPass rows each); the calling warp then arrives on those
  // slabs' barriers. Each copy of a row is at immediate offsets from the row's first destination and
  // source: the issue of these copies is on the gather's critical path (a stage refills no sooner
  // than its last copy is issued). kPassUnroll: passes unrolled, as registers allow.
  template <int kMaxCount, int kStep, int kPassStride, int kPassUnroll>
  __device__ void copy_passes(const DecodeParams& p, typename Traits::SharedStorage& ss, int stage, int first_slab,
                              int count, int first_pass, int lane) const {
    const int chunk = lane % kChunksPerRow;
    const uint8_t* kv = static_cast<const uint8_t*>(p.kv) + chunk * 16 + first_slab * kRowBytes;
    const uint32_t first = mla_common::smem_addr(Traits::kv_copy_dst(ss, stage, first_slab, 0));
#pragma unroll kPassUnroll
    for (int j = first_pass; j < kBlockN / kRowsPerPass; j += kPassStride) {
      const int row = lane / kChunksPerRow + j * kRowsPerPass;
      const uint8_t* from = kv + __shfl_sync(0xffffffff, j * kRowsPerPass < 32 ? offset[0] : offset[1], row % 32);
      const uint32_t to = first + chunk_offset(row, chunk);
      const bool valid = row < valid_rows;
#pragma unroll
      for (int k = 0; k < kMaxCount; ++k) {
        if (k < count) mla_common::cp_async_16(to + k * kStep * kSlabBytes, from + k * kStep * kRowBytes, valid);
      }
    }
#ifdef MLA_ATTN_RACECHECK
    // Only for compute-sanitizer (MLA_ATTN_RACECHECK=1, scripts/sanitize.sh): racecheck does not take
    // the completion arrival below as the end of the copies, so this build waits for them and arrives
    // plainly (the same arrivals, later).
    mla_common::cp_async_wait_all();
    for (int k = 0; k < count; ++k) cutlass::arch::ClusterBarrier::arrive(&ss.kv_full[stage][first_slab + k * kStep]);
#else
    for (int k = 0; k < count; ++k) cutlass::arch::cpasync_barrier_arrive_noinc(&ss.kv_full[stage][first_slab + k * kStep]);
#endif
  }
  // One warp's slabs (first_slab + k * kStep, k < count) of all 64 rows; its 32 lanes arrive on each.
  template <int kMaxCount, int kStep, int kPassUnroll>
  __device__ void copy_slabs(const DecodeParams& p, typename Traits::SharedStorage& ss, int stage, int first_slab,
                             int count, int lane) const {
    copy_passes<kMaxCount, kStep, 1, kPassUnroll>(p, ss, stage, first_slab, count, 0, lane);
  }
  // Whole rows, all nine slabs back to back, of passes warp, warp + kProducerWarps, ...: the four
  // producer warps share a block evenly; each arrives on every slab's barrier (kRingGatherArrivals).
  template <int kPassUnroll>
  __device__ void copy_rows(const DecodeParams& p, typename Traits::SharedStorage& ss, int stage, int warp,
                            int lane) const {
    copy_passes<kSlabs, 1, kProducerWarps, kPassUnroll>(p, ss, stage, 0, kSlabs, warp, lane);
  }
};

// Gathered 16-bit rows are copied whole (GatheredRows::copy_rows: every producer warp arrives on every
// slab); fp8 slab rows one slab per warp (copy_slabs: its 32 lanes arrive; whole rows made the 32-row narrow
// kernel spill).
template <typename Traits>
inline constexpr bool kWholeRowGather = !Traits::kFp8Kv;
// kv_full arrivals per slab and phase: one arrive_and_expect_tx (TMA), or the lanes that gather it.
template <typename Traits, bool kGather>
inline constexpr int kRingGatherArrivals = !kGather ? 1 : kWholeRowGather<Traits> ? 32 * kProducerWarps : 32;

// Calls fn(seg, pages, blk, iteration) for every KV block of this CTA's schedule, in order; iteration
// counts the blocks (a block's place in the stage ring), pages is the request's block-table row.
template <typename Fn>
__device__ __forceinline__ void for_each_scheduled_block(const DecodeParams& p, const PartRange& range, int m_block,
                                                         Fn&& fn) {
  int iteration = 0;
  Segment seg;
  for (int b = range.begin_b; range.next_segment(p, b, m_block, seg); b = seg.b + 1) {
    const int* pages = p.block_table + int64_t(seg.b) * p.block_table_stride;
    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) fn(seg, pages, blk, iteration);
  }
}

// Calls copy(rows, iteration) for every KV block of this CTA's schedule, in order, with each block's
// table entries loaded a block ahead: before the previous block's copies, whose cp.async traffic the
// load would otherwise queue behind (it held a page-1 producer ~1,100 cycles past its free stage).
template <typename Traits, typename Copy>
__device__ __forceinline__ void for_each_gathered_block(const DecodeParams& p, const DecodeTma& tma,
                                                        const PartRange& range, int m_block, int lane, Copy&& copy) {
  using Rows = GatheredRows<Traits>;
  typename Rows::Entries pending{};
  int blocks = 0;
  for_each_scheduled_block(p, range, m_block, [&](const Segment& seg, const int* pages, int blk, int iteration) {
    const auto next = Rows::load(p, tma, pages, seg, blk, lane);
    if (iteration > 0) copy(Rows::from(p, tma, pending, lane), iteration - 1);
    pending = next;
    blocks = iteration + 1;
  });
  if (blocks > 0) copy(Rows::from(p, tma, pending, lane), blocks - 1);
}

// Only for compute-sanitizer (MLA_ATTN_RACECHECK=1, scripts/sanitize.sh): a warpgroup about to write
// into the stage of block `iteration` (the epilogue's output staging) first waits on each of its
// slabs itself. The production build relies on the slabs the other warpgroup waited on and a named
// barrier between them, an order racecheck does not follow. The stage's phase has completed and the
// stage is not released yet, so these waits return at once.
template <typename Traits>
__device__ __forceinline__ void racecheck_acquire_stage(typename Traits::SharedStorage& ss, int iteration) {
#ifdef MLA_ATTN_RACECHECK
  const int stage = iteration % Traits::kStages;
  const uint32_t phase = (iteration / Traits::kStages) & 1;
  constexpr int kBarriers = kStagesRows<Traits> ? 1 : kSlabs;  // staged rows: one per stage
  for (int slab = 0; slab < kBarriers; ++slab) cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
#else
  (void)ss, (void)iteration;
#endif
}

// A math warpgroup hands a stage back with one arrival on its kv_empty barrier, from thread 0 after
// a barrier over the warpgroup. Racecheck builds (MLA_ATTN_RACECHECK): every thread arrives, after
// its own shared-memory writes into the stage (output staging, the fp8 conversion), since racecheck
// does not carry the order of those writes through the named barrier to thread 0's arrival and on
// to the producer's next copies into the stage (scripts/racecheck_probe.cu).
#ifdef MLA_ATTN_RACECHECK
inline constexpr bool kRacecheckBuild = true;
#else
inline constexpr bool kRacecheckBuild = false;
#endif
inline constexpr bool kEveryThreadReleases = kRacecheckBuild;
inline constexpr int kStageReleaseArrivals = kEveryThreadReleases ? 128 : 1;  // per warpgroup

// Thread 0 initialises the ring's barriers: kv_full[stage][slab] (kRingGatherArrivals) and
// kv_empty[stage] (empty_arrivals); the caller syncs the CTA after.
template <typename Traits, bool kGather>
__device__ __forceinline__ void init_kv_ring(typename Traits::SharedStorage& ss, int empty_arrivals) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < Traits::kStages; ++s) {
    for (int slab = 0; slab < kSlabs; ++slab) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full[s][slab], kRingGatherArrivals<Traits, kGather>);
    }
    cutlass::arch::ClusterBarrier::init(&ss.kv_empty[s], empty_arrivals);
  }
  cutlass::arch::fence_barrier_init();
}

// Issues the K-tile loads of this CTA's schedule into a ring of Traits::kStages stages, one kv_empty
// barrier per stage. Runs on each of the producer's four warps: TMA boxes and gathered fp8 rows for
// slabs warp, warp + 4, warp + 8 (TMA issue from one thread is serial, and page 16 needs 4 copies x 9
// slabs per tile); gathered 16-bit rows whole, a quarter of the block's rows per warp. Tiles by row
// groups (kTilesByRowGroups, at most 4 copies): warp 0 alone.
// Traits: kStages, kFp8Kv, MmaElement (of the 16-bit tile), SharedStorage (kv_full [kStages][kSlabs] (row
// groups: [stage][0] only), kv_empty [kStages], kv_fill [kStages] where the fills are recorded) and
// kv_copy_dst(ss, stage, slab, row): where rows [row, row + rows_per_copy) of a slab land (slab copies).
// kGather (DecodeTma::gather): rows gathered one by one instead of TMA boxes of 16-64 rows.
template <typename Traits, bool kGather>
__device__ void produce_kv_tiles(const DecodeParams& p, const DecodeTma& tma,
                                 typename Traits::SharedStorage& ss, const PartRange& range,
                                 int m_block, int warp) {
  const int lane = threadIdx.x % 32;
  auto wait_free = [&](int stage, int iteration) {
    if (iteration >= Traits::kStages) {
      cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / Traits::kStages) - 1) & 1);
    }
    record_stage_fill<Traits>(ss, stage, iteration);
  };
  if constexpr (kGather) {
    for_each_gathered_block<Traits>(p, tma, range, m_block, lane, [&](const GatheredRows<Traits>& rows, int iteration) {
      const int stage = iteration % Traits::kStages;
      wait_free(stage, iteration);
      if constexpr (kWholeRowGather<Traits>) {
        rows.template copy_rows<2>(p, ss, stage, warp, lane);
      } else {
        rows.template copy_slabs<3, kProducerWarps, 2>(p, ss, stage, warp, warp == 0 ? 3 : 2, lane);  // slabs warp, warp + 4 (, 8)
      }
    });
  } else if constexpr (kTilesByRowGroups<Traits>) {
    if (warp != 0) return;  // <= 4 copies per tile: one warp issues them all
    for_each_scheduled_block(p, range, m_block, [&](const Segment& seg, const int* pages, int blk, int iteration) {
      const int stage = iteration % Traits::kStages;
      const auto copies = BlockCopies<Traits>::plan(p, tma, pages, seg, blk, lane);
      wait_free(stage, iteration);
      copies.copy_row_groups(tma, ss, stage, lane);
    });
  } else {
    for_each_scheduled_block(p, range, m_block, [&](const Segment& seg, const int* pages, int blk, int iteration) {
      const int stage = iteration % Traits::kStages;
      const auto copies = BlockCopies<Traits>::plan(p, tma, pages, seg, blk, lane);
      wait_free(stage, iteration);
      for (int slab = warp; slab < kSlabs; slab += kProducerWarps) copies.expect(ss, stage, slab, lane);
      for (int slab = warp; slab < kSlabs; slab += kProducerWarps) copies.copy(tma, ss, stage, slab, lane);
    });
  }
}

// The policy (shared/kernel_shell.cuh) of a kernel fed by this producer with 64-row q-tiles
// (rows64, fp8mma) but for its consume(): two math warpgroups that both release each stage, and
// the producer's four warps, warp w issuing slabs w, w + 4, w + 8 of q-tile blockIdx.x.
template <typename Traits_>
struct KvRingKernel {
  using Traits = Traits_;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kThreads = kNumThreads, kMathWarpgroups = kNumMathWarpgroups;
  static constexpr int kMathRegisters = mla_decode::kMathRegisters, kProducerRegisters = mla_decode::kProducerRegisters;

  template <bool kGather>
  __device__ __forceinline__ static void init_barriers(SharedStorage& ss) {
    init_kv_ring<Traits, kGather>(ss, kNumMathWarpgroups * kStageReleaseArrivals);
  }
  template <bool kGather>
  __device__ __forceinline__ static void produce(const DecodeParams& p, const DecodeTma& tma, SharedStorage& ss,
                                                 const PartRange& range, int warp) {
    produce_kv_tiles<Traits, kGather>(p, tma, ss, range, blockIdx.x, warp);
  }
};

}  // namespace mla_decode
