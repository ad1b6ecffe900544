// Split-KV paged MLA decode for sm_90a, 16-bit cache: the two math warpgroups work on a pair of KV
// blocks at once, so that one's softmax runs under the other's MMAs ("seesaw", after FlashMLA).
//
// Grid, schedule and the producer warpgroup's TMA loads as in rows64/kernel.cuh, except that the
// stages of the ring are released per V half (kv_empty[stage][w]). Per pair (a, b) = two consecutive
// blocks of a request (b absent at the end of an odd-length segment); warpgroup w owns output
// columns [256 w, 256 w + 256) and a running max m (equal in both after each pair):
//   WG 0: S_a = Q K_a^T; m_a = max(m, rowmax S_a) -> max_a; P_a = exp2(S_a - m_a);
//         O_0 = O_0 e^(m - m_a) + P_a V_a[:, half 0]             (P from registers)
//         <- max_b;  P_a e^(m_a - m_b) -> shared;  O_0 = O_0 e^(m_a - m_b) + P_b V_b[:, half 0]
//   WG 1: S_b = Q K_b^T;  <- max_a;  m_b = max(m_a, rowmax S_b) -> max_b; P_b = exp2(S_b - m_b) -> shared;
//         O_1 = O_1 e^(m - m_b) + P_b V_b[:, half 1] + P_a e^(m_a - m_b) V_a[:, half 1]
// WG 0 issues the next pair's S_a right behind its last PV, WG 1 its S_b once its PVs are done, so
// the two QK^T chains are staggered and each softmax overlaps MMAs of the other warpgroup. The PVs
// queue as P_a V_a[0], P_b V_b[1] (issued before the P hand-off), P_a V_a[1], then P_b V_b[0]: V_a's
// half 1 and rope slab, which the next S_a waits for, free one PV earlier (FlashMLA's order). The
// hand-offs (max_a, max_b, the P tiles) are rendezvous of both warpgroups (seesaw/traits.h).
// P of a block goes to the other warpgroup through the block's rope slab (the map is full).
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/seesaw/q_tile_loader.cuh"
#include "mla_decode/seesaw/traits.h"
#include "mla_decode/shared/causal_mask.cuh"
#include "mla_decode/shared/epilogue.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/launch.cuh"
#include "mla_decode/shared/mma_issue.cuh"
#include "mla_decode/shared/online_softmax.cuh"
#include "mla_decode/shared/packed_pair.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {
using namespace cute;
using mla_common::named_barrier_sync;

// TMA: producer warp w loads blocks in stage w / 2; warps 0, 2 slabs 0-3 once warpgroup 0 freed its
// V half, then the rope slab once warpgroup 1 did too (it held the block's P for both); warps 1, 3
// slabs 4-7 once warpgroup 1 freed its half. Separate warps per stage and half: the halves free in
// different orders in the two stages. Gathered rows: all four warps copy whole rows of every block
// once both halves are free (the copies' issue bounds a gathered block: one warp per half was slower).
template <typename Traits, bool kGather>
__device__ void produce_seesaw_tiles(const DecodeParams& p, const DecodeTma& tma, typename Traits::SharedStorage& ss,
                                     const PartRange& range, int m_block, int warp) {
  const int lane = threadIdx.x % 32;
  const int my_stage = warp / 2, half = warp % 2;
  if constexpr (kGather) {  // every warp copies whole rows of every block, once both halves are free
    for_each_gathered_block<Traits>(p, tma, range, m_block, lane, [&](const GatheredRows<Traits>& rows, int iteration) {
      const int stage = iteration % Traits::kStages;
      if (iteration >= Traits::kStages) {
        const uint32_t free_parity = ((iteration / Traits::kStages) - 1) & 1;
        cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage][0], free_parity);
        cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage][1], free_parity);
      }
      rows.template copy_rows<2>(p, ss, stage, warp, lane);
    });
    return;
  }
  for_each_scheduled_block(p, range, m_block, [&](const Segment& seg, const int* pages, int blk, int iteration) {
    const int stage = iteration % Traits::kStages;
    if (stage != my_stage) return;
    const uint32_t free_parity = ((iteration / Traits::kStages) - 1) & 1;
    const bool reused = iteration >= Traits::kStages;
    const auto copies = BlockCopies<Traits>::plan(p, tma, pages, seg, blk, lane);
    if (reused) cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage][half], free_parity);
    for (int slab = 4 * half; slab < 4 * half + 4; ++slab) copies.expect(ss, stage, slab, lane);
    for (int slab = 4 * half; slab < 4 * half + 4; ++slab) copies.copy(tma, ss, stage, slab, lane);
    if (half == 0) {
      if (reused) cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage][1], free_parity);
      copies.expect(ss, stage, kSlabs - 1, lane);
      copies.copy(tma, ss, stage, kSlabs - 1, lane);
    }
  });
}

// kSteadyLoop: segments of this many blocks run their full pairs in the steady loop
// (consume_seesaw_pairs).
constexpr int kSteadyMinBlocks = 32;

// Inlined into the kernel: as a separate function (two pair loops make it large) its WGMMAs were
// serialized (ptxas C7520).
template <typename Traits, bool kSteadyLoop>
__device__ __forceinline__ void consume_seesaw_pairs(const DecodeParams& p, const DecodeTma& tma,
                                                     typename Traits::SharedStorage& ss, const PartRange& range,
                                                     int m_block) {
  using Element = typename Traits::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  static_assert(2 * kStagingBytes <= int(sizeof(Element)) * cosize_v<typename Traits::SmemLayoutK>,
                "the epilogue stages both warpgroups' output in one K stage");
  const int tid = threadIdx.x;  // 0..255 over the two math warpgroups
  const int wg = mla_common::warp_uniform(tid / 128), tid_in_wg = tid % 128;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPVLocal mma_pv_local;
  typename Traits::TiledMmaPVRemote mma_pv_remote;
  auto thr_qk = mma_qk.get_thread_slice(tid_in_wg);
  auto thr_pv_local = mma_pv_local.get_thread_slice(tid_in_wg);
  auto thr_pv_remote = mma_pv_remote.get_thread_slice(tid_in_wg);

  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});            // 32 floats
  Tensor tOrO = partition_fragment_C(mma_pv_local, Shape<Int<kBlockM>, Int<kHeadDimV / 2>>{});  // 128 floats
  Tensor tOrP = make_tensor<Element>(typename Traits::FragmentALayout{});  // own P as the PV A operand
  // Each thread holds rows r0 and r0 + 8 of every accumulator; element e is in row r0 + 8 row_half(e).
  // Recomputed where used, from an opaque thread index: held across the loop over blocks it is
  // spilled.
  auto row0 = [] { const int t = mla_common::opaque(int(threadIdx.x)) % 128; return (t / 32) * 16 + (t % 32) / 4; };
  auto row_half = [](int e) { return (e >> 1) & 1; };
  auto base_of = [](float m) { return m == -INFINITY ? 0.f : m; };  // fully masked row: exp2 stays finite

  // S = Q K^T for the block in `stage`, slabs [first_slab, end_slab), one commit group per slab,
  // each issued once its slab landed. Warpgroup 0 goes in slab order; warpgroup 1 starts with its
  // own V half, which its PVs free first. The rope slab is last: it waits for both halves to be free.
  // The lambdas with a body are always_inline: the kernel's TMA and gathering variants both inline
  // this function, so each lambda has two callers, and LLVM then outlined the large ones (calls with
  // spills in the steady loop).
  auto issue_qk_slabs = [&](int stage, uint32_t phase, int first_slab, int end_slab) __attribute__((always_inline)) {
    mla_decode::issue_qk_slabs<typename Traits::SmemLayoutQ, typename Traits::SmemLayoutK, /*kPollSlabs=*/true>(
        mma_qk, thr_qk, tSrS, ss.q, ss.k[mla_common::warp_uniform(stage)], ss.kv_full[stage], phase, first_slab, end_slab);
  };
  auto start_qk = [&]() __attribute__((always_inline)) {
    warpgroup_fence_operand(tSrS);
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
  };
  // O += P V[:, own half] for the block in `stage`, P from registers or from a shared tile.
  auto issue_pv_local = [&](int stage) __attribute__((always_inline)) {
    Tensor sVt = make_tensor(make_smem_ptr(ss.k[mla_common::warp_uniform(stage)]), typename Traits::SmemLayoutVt{});
    Tensor tOrV = thr_pv_local.partition_fragment_B(local_tile(sVt, Shape<Int<kHeadDimV / 2>, Int<kBlockN>>{}, make_coord(wg, 0)));
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < size<2>(tOrP); ++k) cute::gemm(mma_pv_local, tOrP(_, _, k), tOrV(_, _, k), tOrO);
    warpgroup_commit_batch();
  };
  // P: the other warpgroup's, in the block's rope slab
  auto issue_pv_remote = [&](int stage) __attribute__((always_inline)) {
    Tensor sVt = make_tensor(make_smem_ptr(ss.k[mla_common::warp_uniform(stage)]), typename Traits::SmemLayoutVt{});
    Tensor tOrV = thr_pv_remote.partition_fragment_B(local_tile(sVt, Shape<Int<kHeadDimV / 2>, Int<kBlockN>>{}, make_coord(wg, 0)));
    Tensor tOrPs = thr_pv_remote.partition_fragment_A(make_tensor(make_smem_ptr(Traits::p_tile(ss, mla_common::warp_uniform(stage))), typename Traits::SmemLayoutSlab{}));
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < size<2>(tOrPs); ++k) cute::gemm(mma_pv_remote, tOrPs(_, _, k), tOrV(_, _, k), tOrO);
    warpgroup_commit_batch();
  };
  Segment seg{};  // the request being processed
  auto release = [&](int stage) __attribute__((always_inline)) {
    if (kEveryThreadReleases || tid_in_wg == 0) Barrier::arrive(&ss.kv_empty[stage][wg]);
  };
  // The segment's last block stays in its stage until the epilogue has staged the output there.
  auto release_unless_last = [&](int stage, int blk) __attribute__((always_inline)) {
    if (blk + 1 < seg.blk_hi) release(stage);
  };
  // Tail block: zero the key rows past the sequence end in this warpgroup's V half (never loaded,
  // or slots past L) before a PV reads them, so 0-probability keys cannot inject NaN/Inf. Only once
  // the block's QK^T has completed (it reads those rows too) and its slabs have landed. Both
  // warpgroups zero their half of a tail block, then meet at kTailZeroed (a barrier over both, not
  // one per warpgroup: racecheck mis-orders the hand-offs between warpgroups that ran their own
  // barriers unequally often, scripts/racecheck_probe.cu). The keys of a block are derived where
  // used: held across the pair, they were spilled.
  auto is_tail = [&](int blk) { return seg.seqlen_k - blk * kBlockN < kBlockN; };
  auto zero_tail_of_own_half = [&](int stage, uint32_t phase, int blk) __attribute__((always_inline)) {
    const int valid_keys = seg.seqlen_k - blk * kBlockN;
    for (int slab = 4 * wg; slab < 4 * wg + 4; ++slab) Barrier::wait(&ss.kv_full[stage][slab], phase);
    constexpr int kChunksPerRow = 4 * kTmaColumns / 8;  // 16-byte chunks of a row in 4 slabs
    Element* half = ss.k[stage] + 4 * wg * Traits::kSlabElements;
    for (int i = mla_common::opaque(tid_in_wg); i < (kBlockN - valid_keys) * kChunksPerRow; i += 128) {
      const int row = valid_keys + i / kChunksPerRow, chunk = i % kChunksPerRow;
      const int slab = chunk / 8, swizzled = (chunk % 8) ^ (row % 8);  // 128-byte swizzle
      mla_common::st_shared_zero16(half + slab * Traits::kSlabElements + row * kTmaColumns + swizzled * 8);
    }
    cutlass::arch::fence_view_async_shared();
  };
  auto tail_zeroed = [] { named_barrier_sync<int(SeesawBarrier::kTailZeroed), 256>(); };
  auto scale_o = [&](const float (&factor)[2]) __attribute__((always_inline)) {
    // Once the running max settles the factors are exactly 1: skip the 128 multiplies then.
    if (__any_sync(0xffffffff, factor[0] != 1.f || factor[1] != 1.f)) {
#pragma unroll
      for (int e = 0; e < size(tOrO); ++e) tOrO(e) *= factor[row_half(e)];
    }
  };
  // Block max of block `blk`'s raw scores, masked only where a row needs it (shared/online_softmax.cuh);
  // exponentiate applies the scale.
  // full: no row masks any key of the block (is_full_block, or known so by the caller).
  auto block_max_of_block = [&](int blk, const int (&last_key)[2], bool full,
                                float (&block_max)[2]) __attribute__((always_inline)) {
    // Key of element e: key0 + 8 (e >> 2) + 2 (lane % 4) + (e & 1) (from an opaque thread index,
    // as row0).
    const int key0 = blk * kBlockN + 2 * (mla_common::opaque(int(threadIdx.x)) % 4);
    const float scale[2] = {p.scale_log2, p.scale_log2};
    block_max_of_scores(tSrS, [&](int e) { return key0 + 8 * (e >> 2) + (e & 1); }, last_key, full, scale,
                        block_max);
  };
  // tOrP as packed pairs (elements e, e + 1 in word e / 2): converting element by element leaves
  // each 16-bit value in a register of its own.
  uint32_t* p_pairs = reinterpret_cast<uint32_t*>(raw_pointer_cast(tOrP.data()));
  // P = exp2(S scale_log2 - base), in place and into tOrP (16 bit), adding the row sums to `row_sum`.
  auto exponentiate = [&](const float (&base)[2], float (&row_sum)[2]) __attribute__((always_inline)) {
#pragma unroll
    for (int e = 0; e < size(tSrS); e += 2) {
      tSrS(e) = exp2f(fmaf(tSrS(e), p.scale_log2, -base[row_half(e)]));
      tSrS(e + 1) = exp2f(fmaf(tSrS(e + 1), p.scale_log2, -base[row_half(e)]));
      row_sum[row_half(e)] += tSrS(e) + tSrS(e + 1);
      p_pairs[e / 2] = pack_pair<Element>(tSrS(e), tSrS(e + 1));
    }
  };
  // This warpgroup's P of the block in `stage`, pair(e) the packed elements e, e + 1, to the block's
  // rope slab (64 x 64, 128-byte rows, 16-byte chunk c of row r at c ^ (r % 8)). Element e of the
  // accumulator is row r0 + 8 ((e >> 1) & 1), column 8 (e >> 2) + 2 (lane % 4) + (e & 1).
  // Addresses from an opaque thread index: otherwise the compiler hoists all 16 out of the loop.
  auto store_p = [&](int stage, auto&& pair) __attribute__((always_inline)) {
    const int t = mla_common::opaque(tid_in_wg);
    const int row = (t / 32) * 16 + (t % 32) / 4;
    // The swizzle as one XOR with a constant per chunk: bits 4-6 of row_addr hold row % 8.
    const uint32_t row_addr = mla_common::smem_addr(Traits::p_tile(ss, stage)) + row * 128 + (row % 8) * 16 + (t % 4) * 4;
#pragma unroll
    for (int e = 0; e < size(tSrS); e += 2) {
      mla_common::st_shared_4((row_addr ^ ((e >> 2) << 4)) + row_half(e) * 8 * 128, pair(e));
    }
    cutlass::arch::fence_view_async_shared();
  };

  QTileLoader q_loader{p, tma, &ss.q_full};
  int iteration = 0;  // blocks consumed so far: block i of the CTA's sequence is in stage i % 2
  bool have_segment = range.next_segment(p, range.begin_b, m_block, seg);
  if (have_segment) q_loader.issue<Element, typename Traits::SmemLayoutQ>(seg, ss.q);
  while (have_segment) {
    q_loader.wait();
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<int(SeesawBarrier::kQReady), 256>();
    const int last_key[2] = {last_visible_key(p, seg, m_block * kBlockM + row0()),
                             last_visible_key(p, seg, m_block * kBlockM + row0() + 8)};
    const int lowest_last_key = last_visible_key(p, seg, 0);  // row 0 (token 0) sees the fewest keys
    float row_max[2] = {-INFINITY, -INFINITY};  // running max, log2 units; equal in both WGs per pair
    float row_sum[2] = {0.f, 0.f};              // this WG's share of the denominator
    clear(tOrO);

    // The first pair's QK^T.
    if (seg.blk_lo < seg.blk_hi) {
      const int first = seg.blk_lo + wg;
      if (first < seg.blk_hi) {
        const int it = iteration + wg;
        start_qk();
        if (wg == 0) issue_qk_slabs(it % 2, (it / 2) & 1, 0, kSlabs);
        else {
          issue_qk_slabs(it % 2, (it / 2) & 1, 4, 8);
          issue_qk_slabs(it % 2, (it / 2) & 1, 0, 4);
          issue_qk_slabs(it % 2, (it / 2) & 1, 8, kSlabs);
        }
      }
    }

    // kSteady: a pair of two blocks that no row masks, neither the segment's last, with a next pair
    // of two: no masking, tail, missing b or held-back stage, so the loop over such pairs carries
    // none of that code (in one loop for all pairs, that code stood in line and instruction fetch
    // stalled the softmax phases). The loop below
    // runs a pair with the steady body where it qualifies (with kSteadyLoop), else the general one.
    auto run_pair = [&](const int blk, auto steady) __attribute__((always_inline)) {
      constexpr bool kSteady = decltype(steady)::value;
      const bool has_b = kSteady || blk + 1 < seg.blk_hi;
      const int stage_a = iteration % 2, stage_b = (iteration + 1) % 2;
      const uint32_t phase_a = (iteration / 2) & 1, phase_b = ((iteration + 1) / 2) & 1;
      const bool has_next_a = kSteady || blk + 2 < seg.blk_hi, has_next_b = kSteady || blk + 3 < seg.blk_hi;
      if (wg == 0) {
        warpgroup_wait<0>();  // S_a (and the previous pair's last PV)
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tOrO);
        float block_max[2], base[2], factor[2];
        block_max_of_block(blk, last_key, kSteady || is_full_block(blk, lowest_last_key), block_max);
        float max_a[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          max_a[i] = next_running_max(row_max[i], block_max[i], kMaxSlack);
          base[i] = base_of(max_a[i]);
          factor[i] = exp2f(row_max[i] - base[i]);
          row_sum[i] *= factor[i];
        }
        if (tid_in_wg % 4 == 0) {
          ss.max_a[row0()] = max_a[0];
          ss.max_a[row0() + 8] = max_a[1];
        }
        named_barrier_sync<int(SeesawBarrier::kMaxA), 256>();
        exponentiate(base, row_sum);
        scale_o(factor);
        if (!kSteady && is_tail(blk)) {  // (then there is no b)
          zero_tail_of_own_half(stage_a, phase_a, blk);
          tail_zeroed();
        }
        issue_pv_local(stage_a);
        // P_a rescaled to the pair's max (the same as max_a when there is no b), for warpgroup 1.
        named_barrier_sync<int(SeesawBarrier::kMaxB), 256>();
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float max_b = ss.max_b[row0() + 8 * i];
          factor[i] = exp2f(max_a[i] - base_of(max_b));
          row_sum[i] *= factor[i];
          row_max[i] = max_b;
        }
        if (!kSteady && has_b && is_tail(blk + 1)) {
          zero_tail_of_own_half(stage_b, phase_b, blk + 1);
          tail_zeroed();
        }
        store_p(stage_a, [&](int e) {
          return pack_pair<Element>(tSrS(e) * factor[row_half(e)], tSrS(e + 1) * factor[row_half(e)]);
        });
        // V_a's half 0 is free once P_a V_a completes: released before the P hand-off, so that its
        // reload starts while warpgroup 1 still exponentiates P_b (measured faster, BENCHMARKS.md).
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        kSteady ? release(stage_a) : release_unless_last(stage_a, blk);
        named_barrier_sync<int(SeesawBarrier::kPReady), 256>();
        if (has_b) {
          scale_o(factor);
          named_barrier_sync<int(SeesawBarrier::kRemoteIssued), 256>();
          issue_pv_remote(stage_b);
          if (has_next_a) {  // the next pair's S_a behind it; stage_b is free once the PV completes
            start_qk();
            issue_qk_slabs(stage_a, phase_a ^ 1, 0, 4);
            warpgroup_wait<4>();
            release(stage_b);
            issue_qk_slabs(stage_a, phase_a ^ 1, 4, kSlabs);
          } else {
            warpgroup_wait<0>();
            kSteady ? release(stage_b) : release_unless_last(stage_b, blk + 1);
          }
        }
      } else {
        float block_max[2] = {-INFINITY, -INFINITY};
        // max_a before S_b completes: warpgroup 0 goes on to P_a V_a while S_b runs (measured faster,
        // BENCHMARKS.md).
        named_barrier_sync<int(SeesawBarrier::kMaxA), 256>();
        // S_b. Unconditional: a wait under a branch makes ptxas serialize all WGMMAs.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tOrO);
        if (has_b) {
          block_max_of_block(blk + 1, last_key, kSteady || is_full_block(blk + 1, lowest_last_key), block_max);
        }
        if (!kSteady && is_tail(blk)) {  // S_a is done; there is no b
          zero_tail_of_own_half(stage_a, phase_a, blk);
          tail_zeroed();
        }
        float base[2], factor[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float max_b = next_running_max(ss.max_a[row0() + 8 * i], block_max[i], kMaxSlack);
          base[i] = base_of(max_b);
          factor[i] = exp2f(row_max[i] - base[i]);
          row_sum[i] *= factor[i];
          row_max[i] = max_b;
        }
        if (tid_in_wg % 4 == 0) {
          ss.max_b[row0()] = row_max[0];
          ss.max_b[row0() + 8] = row_max[1];
        }
        named_barrier_sync<int(SeesawBarrier::kMaxB), 256>();
        scale_o(factor);
        if (has_b) {
          if (!kSteady && is_tail(blk + 1)) {
            zero_tail_of_own_half(stage_b, phase_b, blk + 1);
            tail_zeroed();
          }
          exponentiate(base, row_sum);
          store_p(stage_b, [&](int e) { return p_pairs[e / 2]; });
          issue_pv_local(stage_b);
        }
        named_barrier_sync<int(SeesawBarrier::kPReady), 256>();
        issue_pv_remote(stage_a);
        if (has_b) named_barrier_sync<int(SeesawBarrier::kRemoteIssued), 256>();
        if (has_b) {
          warpgroup_wait<1>();
          kSteady ? release(stage_b) : release_unless_last(stage_b, blk + 1);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        kSteady ? release(stage_a) : release_unless_last(stage_a, blk);
        if (has_next_b) {
          start_qk();
          issue_qk_slabs(stage_b, phase_b ^ 1, 4, 8);
          issue_qk_slabs(stage_b, phase_b ^ 1, 0, 4);
          issue_qk_slabs(stage_b, phase_b ^ 1, 8, kSlabs);
        }
      }
      iteration += has_b ? 2 : 1;
    };
    // The steady loop only in long segments: a call that runs both loops fetches more code, slow
    // when it is not in L2 (cold), which only a long run of steady pairs repays. The general loop comes
    // first in the source, so that ptxas places the steady loop after it (placed before, it cost the
    // same cold fetch to calls that jump over it).
    const bool long_segment = kSteadyLoop && seg.blk_hi - seg.blk_lo >= kSteadyMinBlocks;
    auto is_steady_pair = [&](int blk) __attribute__((always_inline)) {
      return long_segment && blk + 3 < seg.blk_hi && is_full_block(blk + 1, lowest_last_key);
    };
    for (int blk = seg.blk_lo; blk < seg.blk_hi;) {
      if (!is_steady_pair(blk)) {
        run_pair(blk, std::false_type{});
        blk += 2;
      } else if constexpr (kSteadyLoop) {
        do {
          run_pair(blk, std::true_type{});
          blk += 2;
        } while (is_steady_pair(blk));
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);

    // ---- Epilogue: total denominator over both warpgroups, then normalise and store. Past
    // kRowSum no MMA of either warpgroup reads sQ, so the next request's Q load starts.
    const float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
    __syncwarp();  // the quad's other lanes read row_sum in the previous epilogue
    if (tid_in_wg % 4 == 0) {
      ss.row_sum[wg][row0()] = total[0];
      ss.row_sum[wg][row0() + 8] = total[1];
    }
    named_barrier_sync<int(SeesawBarrier::kRowSum), 256>();
    Segment next;
    const bool have_next = range.next_segment(p, seg.b + 1, m_block, next);
    if (have_next) q_loader.issue<Element, typename Traits::SmemLayoutQ>(next, ss.q);
    const int r0 = row0();
    float sums[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) sums[i] = ss.row_sum[0][r0 + 8 * i] + ss.row_sum[1][r0 + 8 * i];
    if (seg.blk_lo < seg.blk_hi) {
      // Through the last block's stage (its PVs are done: kRowSum), then hand the stage back.
      const int last_stage = (iteration - 1) % Traits::kStages;
      const uint32_t staging = mla_common::smem_addr(ss.k[last_stage]) + wg * kStagingBytes;
      racecheck_acquire_stage<Traits>(ss, iteration - 1);
      store_output_columns_staged<Element>(p, seg, m_block, r0, row_max, sums, 1.f, /*write_lse=*/wg == 0, staging,
                                           tid_in_wg, 256 * wg, tOrO, [&] {
        named_barrier_sync<int(SeesawBarrier::kStaged0), 128>(wg);
      });
      // The stage's next bytes come by TMA (the async proxy), ordered after these stores.
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync<int(SeesawBarrier::kStagingRead), 256>();
      release(last_stage);
    } else {  // no key block was loaded: no stage to stage through
      store_empty_output_tile<Element>(p, seg, m_block);
    }
    seg = next;
    have_segment = have_next;
  }
}

// The kernel's policy for the shared shell (shared/kernel_shell.cuh).
template <typename Traits_, bool kSteadyLoop>
struct SeesawKernel {
  using Traits = Traits_;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kThreads = Traits::kThreads, kMathWarpgroups = 2;
  static constexpr int kMathRegisters = kSeesawMathRegisters, kProducerRegisters = kSeesawProducerRegisters;

  // kv_empty[stage][w]: warpgroup w freed its V half; q_full: a Q tile by TMA.
  template <bool kGather>
  __device__ __forceinline__ static void init_barriers(SharedStorage& ss) {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < Traits::kStages; ++s) {
      for (int slab = 0; slab < kSlabs; ++slab) {
        cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full[s][slab], kRingGatherArrivals<Traits, kGather>);
      }
      for (int w = 0; w < 2; ++w) cutlass::arch::ClusterBarrier::init(&ss.kv_empty[s][w], kStageReleaseArrivals);
    }
    cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full, 1);
    cutlass::arch::fence_barrier_init();
  }
  template <bool kGather>
  __device__ __forceinline__ static void produce(const DecodeParams& p, const DecodeTma& tma, SharedStorage& ss,
                                                 const PartRange& range, int warp) {
    produce_seesaw_tiles<Traits, kGather>(p, tma, ss, range, blockIdx.x, warp);
  }
  template <bool kGather>
  __device__ __forceinline__ static void consume(const DecodeParams& p, const DecodeTma& tma, SharedStorage& ss,
                                                 const PartRange& range, int) {
    consume_seesaw_pairs<Traits, kSteadyLoop>(p, tma, ss, range, blockIdx.x);
  }
};

template <typename Element, bool kSteadyLoop>
cudaError_t run_mla_decode_seesaw(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  return launch_split_and_combine<SeesawKernel<SeesawTraits<Element>, kSteadyLoop>>(params, tma, stream);
}

}  // namespace mla_decode
