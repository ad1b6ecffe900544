// Split-KV paged MLA decode for sm_90a.
//
// Grid (num_q_tiles, num_sm_parts): CTA (m, part) owns query rows [64m, 64m + 64) of every request
// in its part of the schedule (tile_sched[part]) and walks that part's KV blocks in order. Rows of a
// request are (token, head) pairs, token-major; all rows attend to the request's single KV head.
//
// Warpgroup roles (384 threads):
//   WG 2  producer: its warps issue TMA copies of 64-key x 576-dim K tiles (9 swizzle slabs per
//         page piece, one lane per piece, warp w slabs w, w + 4, w + 8) into a 2-stage ring; one
//         kv_full mbarrier per slab, one kv_empty per stage; or they gather the rows by cp.async
//         (kv_producer.cuh). FP8 cache: the slabs land as bytes in the upper part of the stage
//         (ds_mla_fp8, DeepSeek-V3.2's 656-byte rows: gathered only, rope and scales beside them),
//         and the producer converts them in place to 16 bit (fp8_producer.cuh), one kv_converted
//         mbarrier per slab.
//   WG 0,1 math: KV blocks alternate between them. The owner of a block computes S = Q K^T for all 64 keys, the
//         online-softmax step and P = exp2(S - m), and hands P and the new row max to the other
//         through shared memory; both then add P V to their half of O (256 columns), with V read
//         from the same K tile (its first 512 columns).
// A split writes either the final row (request not split) or an fp32 partial + LSE that
// combine/combine_kernel.cuh merges.
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/rows64/fp8_producer.cuh"
#include "mla_decode/rows64/traits.h"
#include "mla_decode/shared/causal_mask.cuh"
#include "mla_decode/shared/epilogue.cuh"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/launch.cuh"
#include "mla_decode/shared/mma_issue.cuh"
#include "mla_decode/shared/online_softmax.cuh"
#include "mla_decode/shared/q_load.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {
using namespace cute;
using mla_common::named_barrier_sync;

// The math warpgroups. KV blocks of a segment alternate between them: the owner of a block
// computes its full S = Q K^T (64 x 64), the online-softmax step and P, and publishes P and the new
// row max in shared memory; both warpgroups then rescale their half of O and add P V for their 256
// columns. (The softmax is not overlapped with MMAs yet: docs/decode.md, "Limits".)
template <typename Traits>
__device__ void consume_kv_tiles(const DecodeParams& p, typename Traits::SharedStorage& ss,
                                 const PartRange& range, int m_block) {
  using Element = typename Traits::Element;
  using MmaElement = typename Traits::MmaElement;
  const int tid = threadIdx.x;          // 0..255 over the two math warpgroups
  const int warpgroup = mla_common::warp_uniform(tid / 128);
  const int tid_in_wg = tid % 128;
  static_assert(2 * kStagingBytes <= int(sizeof(MmaElement)) * cosize_v<typename Traits::SmemLayoutK>,
                "the epilogue stages both warpgroups' output in one K stage");

  typename Traits::TiledMmaQK mma_qk;   // one warpgroup
  typename Traits::TiledMmaPV mma_pv;   // two warpgroups, split along the 512 output columns
  auto thr_qk = mma_qk.get_thread_slice(tid_in_wg);
  auto thr_pv = mma_pv.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Traits::SmemLayoutQ{});   // (64, 576)
  Tensor sP = make_tensor(make_smem_ptr(ss.p), typename Traits::SmemLayoutP{});   // (64, 64)
  Tensor tSsP = thr_qk.partition_C(sP);  // where this thread's probabilities go in P
  // Coordinates (row, key) / (row, dim) of each accumulator element of this thread.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (64, 256) per WG
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});    // (64, 64)
  // Each thread holds two rows of every accumulator, r0 and r0 + 8: element e of an SM90 WGMMA
  // accumulator ((2 columns, 2 row halves, N/8), ...) belongs to row r0 + 8 * row_half(e).
  const int r0 = get<0>(tScS(0));
  auto row_half = [](int e) { return (e >> 1) & 1; };
  // e4m3 cache: the scale multiplies every score and every output value (the tile holds stored
  // values; a ds_mla_fp8 tile holds real ones).
  const float k_scale = Traits::kFp8Kv && !Traits::kDsMlaFp8 ? *p.k_scale : 1.f;
  const float scale_log2 = p.scale_log2 * k_scale;

  // ---- kScaledQ (bf16 q, fp8 cache): each thread rescales the chunks it copied (its own cp.async
  // writes, visible after cp_async_wait_all) in place from bf16 to fp16 times fp16_row_scale of the
  // row (the 4 threads of a row are adjacent lanes), and records the factor in ss.q_scale. The loops
  // are not unrolled: once per request, code size matters more (cold instruction fetch at batch 1).
  auto scale_q_rows = [&] {
    constexpr int kChunks = kHeadDimK / 8, kThreadsPerRow = 256 / kBlockM;
    const int thread = threadIdx.x, r = thread / kThreadsPerRow;
    float row_max = 0.f;
#pragma unroll 1
    for (int c = thread % kThreadsPerRow; c < kChunks; c += kThreadsPerRow) {
      const uint4 raw = *reinterpret_cast<const uint4*>(&sQ(r, c * 8));
      const Element* v = reinterpret_cast<const Element*>(&raw);
#pragma unroll
      for (int k = 0; k < 8; ++k) row_max = fmaxf(row_max, fabsf(float(v[k])));
    }
    for (int x = 1; x < kThreadsPerRow; x *= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffff, row_max, x));
    const float scale = fp16_row_scale(row_max);
    if (thread % kThreadsPerRow == 0) ss.q_scale[r] = scale;
#pragma unroll 1
    for (int c = thread % kThreadsPerRow; c < kChunks; c += kThreadsPerRow) {
      uint4 raw = *reinterpret_cast<const uint4*>(&sQ(r, c * 8));
      uint32_t* words = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
      for (int k = 0; k < 4; ++k) words[k] = scaled_f16x2<Element>(words[k], scale);
      mla_common::st_shared_16(&sQ(r, c * 8), raw);
    }
  };

  int iteration = 0;
  Segment seg;
  bool have_segment = range.next_segment(p, range.begin_b, m_block, seg);
  if (have_segment) issue_q_tile_load<Element, typename Traits::SmemLayoutQ>(p, seg, ss.q);
  while (have_segment) {
    const int row_base = m_block * kBlockM;
    mla_common::cp_async_wait_all();
    if constexpr (Traits::kScaledQ) scale_q_rows();
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<int(Rows64Barrier::kQReady), 256>();
    // Score scale of this thread's two rows, log2 units (a scaled Q row's factor undone here).
    float score_scale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) score_scale[i] = Traits::kScaledQ ? scale_log2 / ss.q_scale[r0 + 8 * i] : scale_log2;

    const int last_key[2] = {last_visible_key(p, seg, row_base + r0), last_visible_key(p, seg, row_base + r0 + 8)};
    const int lowest_last_key = last_visible_key(p, seg, 0);
    float row_max[2] = {-INFINITY, -INFINITY};  // running max, log2 units; equal in both WGs
    float row_sum[2] = {0.f, 0.f};              // this WG's share of the denominator
    clear(tOrO);

    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) {
      const int stage = iteration % kStages;
      const uint32_t phase = (iteration / kStages) & 1;
      const int owner = (blk - seg.blk_lo) & 1;
      float rescale[2];
      // -- Tail block: both warpgroups zero the key rows past the sequence end (never loaded, or
      // holding slots past L) so that 0-probability keys cannot inject NaN/Inf through P V (the fp8
      // converter writes those rows as zeros instead).
      const int valid_keys = max(seg.seqlen_k - blk * kBlockN, 0);
      if (!Traits::kFp8Kv && valid_keys < kBlockN) {
        Tensor sK = make_tensor(make_smem_ptr(ss.k[stage]), typename Traits::SmemLayoutK{});
        for (int slab = 0; slab < kSlabs; ++slab) cutlass::arch::ClusterBarrier::wait(Traits::slab_ready(ss, stage, slab), phase);
        constexpr int kChunks = kHeadDimK / 8;
        for (int i = tid; i < (kBlockN - valid_keys) * kChunks; i += 256) {
          mla_common::st_shared_zero16(&sK(valid_keys + i / kChunks, i % kChunks * 8));
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync<int(Rows64Barrier::kTailZeroed), 256>();
      }
      if (owner == warpgroup) {
        // -- S = Q K^T, one WGMMA commit group per slab, each issued as soon as the slab has landed
        // (16-bit cache) or been converted (fp8); a barrier wait inside a group makes the compiler
        // serialize the MMAs.
        constexpr int kStepsPerSlab = kTmaColumns / 16;
        warpgroup_fence_operand(tSrS);
        mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
        auto issue_qk = [&](int first_slab, int end_slab) {
          // The stage index made warp-uniform: the descriptors are built on the uniform datapath
          // (no R2UR per WGMMA).
          Tensor tSrQ = thr_qk.partition_fragment_A(make_tensor(make_smem_ptr(ss.q), typename Traits::SmemLayoutQ{}));
          Tensor tSrK = thr_qk.partition_fragment_B(
              make_tensor(make_smem_ptr(ss.k[mla_common::warp_uniform(stage)]), typename Traits::SmemLayoutK{}));
          warpgroup_arrive();
#pragma unroll
          for (int k = first_slab * kStepsPerSlab; k < end_slab * kStepsPerSlab; ++k) {
            cute::gemm(mma_qk, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
            mma_qk.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
        };
        // The previous block's stage is free once this WG's PV of it completes (the other WG
        // released it before its P V). With one q-tile (16-bit cache) the CTA's loads are what
        // bounds it: release right after the first QK group, so that the next block's load starts
        // while the rest of QK^T runs (measured faster with one q-tile, slower with two).
        const bool release_early = p.num_q_tiles == 1;
        auto release_previous_stage = [&] {
          if (blk > seg.blk_lo && (kEveryThreadReleases || tid_in_wg == 0)) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[(iteration - 1) % kStages]);
        };
#pragma unroll
        for (int slab = 0; slab < kSlabs; ++slab) {
          cutlass::arch::ClusterBarrier::wait(Traits::slab_ready(ss, stage, slab), phase);
          issue_qk(slab, slab + 1);
          if (slab == 0 && release_early) {
            warpgroup_wait<1>();  // the PV group issued before this first QK group
            release_previous_stage();
          }
        }
        warpgroup_wait<0>();  // S, and this WG's PV of the previous block
        if (!release_early) release_previous_stage();
        warpgroup_fence_operand(tSrS);

        // -- Online softmax in log2 units over the 64 keys of the block.
        float base[2];
        owner_softmax_step(tSrS, tScS, blk * kBlockN, last_key, is_full_block(blk, lowest_last_key), score_scale,
                           kMaxSlack, row_max, row_sum, base, rescale);
        // The other WG must be done reading the previous P before it is overwritten.
        if (blk > seg.blk_lo) named_barrier_sync<int(Rows64Barrier::kPFree0), 256>(warpgroup);
#pragma unroll
        for (int e = 0; e < size(tSrS); e += 2) {  // elements e, e + 1: adjacent keys of one row
          const int i = row_half(e);
          const float p0 = exp2f(fmaf(tSrS(e), score_scale[i], -base[i]));
          const float p1 = exp2f(fmaf(tSrS(e + 1), score_scale[i], -base[i]));
          row_sum[i] += p0 + p1;
          const MmaElement pair[2] = {MmaElement(p0), MmaElement(p1)};
          *reinterpret_cast<uint32_t*>(&tSsP(e)) = *reinterpret_cast<const uint32_t*>(pair);
        }
        __syncwarp();  // the quad's other lanes read row_max as the previous block's non-owner
        if (tid_in_wg % 4 == 0) {
          ss.row_max[r0] = row_max[0];
          ss.row_max[r0 + 8] = row_max[1];
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync<int(Rows64Barrier::kPReady0), 256>(warpgroup);
      } else {
        warpgroup_wait<0>();  // this WG's PV of the previous block: it no longer reads P
        if (blk > seg.blk_lo && (kEveryThreadReleases || tid_in_wg == 0)) {
          cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[(iteration - 1) % kStages]);
        }
        if (blk > seg.blk_lo) named_barrier_sync<int(Rows64Barrier::kPFree0), 256>(owner);
        // V of this block is observed through the owner's hand-off, and directly here.
        for (int slab = 0; slab < kHeadDimV / kTmaColumns; ++slab) {
          cutlass::arch::ClusterBarrier::wait(Traits::slab_ready(ss, stage, slab), phase);
        }
        named_barrier_sync<int(Rows64Barrier::kPReady0), 256>(owner);
        adopt_row_max(ss.row_max, r0, row_max, row_sum, rescale);
      }

      // ---- O[:, own 256 columns] = O * rescale + P V.
      rescale_and_issue_pv<typename Traits::SmemLayoutP, typename Traits::SmemLayoutVt>(mma_pv, thr_pv, tOrO, rescale,
                                                                                         ss.p, ss.k[mla_common::warp_uniform(stage)]);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    // The last block's stage is released after the epilogue, which stages the output there.

    // Every QK of this segment has completed (the other warpgroup's last PV needed the last S), so
    // sQ is free: the next segment's Q load overlaps this epilogue.
    Segment next;
    const bool have_next = range.next_segment(p, seg.b + 1, m_block, next);
    if (have_next) issue_q_tile_load<Element, typename Traits::SmemLayoutQ>(p, next, ss.q);

    // ---- Epilogue: total denominator over both warpgroups' blocks, then normalise and store.
    float sums[2];
    total_row_sums<int(Rows64Barrier::kRowSum)>(ss.row_sum, warpgroup, r0, row_sum, sums);
    if (seg.blk_lo < seg.blk_hi) {
      // Through the last block's stage (both warpgroups' PVs are done: kRowSum), then release it.
      const int last_stage = (iteration - 1) % kStages;
      auto warpgroup_sync = [&] { named_barrier_sync<int(Rows64Barrier::kStaged0), 128>(warpgroup); };
      racecheck_acquire_stage<Traits>(ss, iteration - 1);
      store_output_columns_staged<Element>(p, seg, m_block, r0, row_max, sums, k_scale, /*write_lse=*/warpgroup == 0,
                                           mla_common::smem_addr(ss.k[last_stage]) + warpgroup * kStagingBytes,
                                           tid_in_wg, 256 * warpgroup, tOrO, warpgroup_sync);
      warpgroup_sync();
      if (kEveryThreadReleases || tid_in_wg == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[last_stage]);
    } else {  // no key block was loaded: no stage to stage through
      store_empty_output_tile<Element>(p, seg, m_block);
    }
    seg = next;
    have_segment = have_next;
  }
}

// The kernel's policy for the shared shell (shared/kernel_shell.cuh).
template <typename Traits>
struct Rows64Kernel : KvRingKernel<Traits> {
  // fp8: the converting producer holds two chunks of four staged slabs and their row scales.
  static constexpr int kMathRegisters = Traits::kFp8Kv ? 224 : mla_decode::kMathRegisters;
  static constexpr int kProducerRegisters = Traits::kFp8Kv ? 56 : mla_decode::kProducerRegisters;
  static_assert(2 * kMathRegisters + kProducerRegisters <= 512, "3 warpgroups x 128 threads in 64K registers");
  template <bool kGather>
  __device__ __forceinline__ static void init_barriers(typename Traits::SharedStorage& ss) {
    KvRingKernel<Traits>::template init_barriers<kGather>(ss);
    if (Traits::kFp8Kv && threadIdx.x == 0) {
      for (int s = 0; s < Traits::kStages; ++s) {
        for (int slab = 0; slab < kSlabs; ++slab) cutlass::arch::ClusterBarrier::init(&ss.kv_converted[s][slab], 128);
      }
      cutlass::arch::fence_barrier_init();
    }
  }
  template <bool kGather>
  __device__ __forceinline__ static void produce(const DecodeParams& p, const DecodeTma& tma,
                                                 typename Traits::SharedStorage& ss, const PartRange& range, int warp) {
    if constexpr (Traits::kFp8Kv) produce_converted_kv_tiles<Traits, kGather>(p, tma, ss, range, blockIdx.x);
    else KvRingKernel<Traits>::template produce<kGather>(p, tma, ss, range, warp);
  }
  __device__ __forceinline__ static void consume(const DecodeParams& p, const DecodeTma&,
                                                 typename Traits::SharedStorage& ss, const PartRange& range, int) {
    consume_kv_tiles<Traits>(p, ss, range, blockIdx.x);
  }
};

template <typename Element, bool kFp8Kv>
cudaError_t run_mla_decode(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  return launch_split_and_combine<Rows64Kernel<Rows64Traits<Element, kFp8Kv>>>(params, tma, stream);
}

template <typename Element>
cudaError_t run_mla_decode_ds_mla_fp8(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  return launch_split_and_combine<Rows64Kernel<Rows64Traits<Element, true, true>>>(params, tma, stream);
}

}  // namespace mla_decode
