// Split-KV paged MLA decode for sm_90a.
//
// Grid (num_q_tiles, num_sm_parts): CTA (m, part) owns query rows [64m, 64m + 64) of every request
// in its part of the schedule (tile_sched[part]) and walks that part's KV blocks in order. Rows of a
// request are (token, head) pairs, token-major; all rows attend to the request's single KV head.
//
// Warpgroup roles (384 threads):
//   WG 2  producer: one thread issues TMA copies of 64-key x 576-dim K tiles (9 swizzle slabs per
//         page piece) into a 2-stage ring; one kv_full mbarrier per slab, one kv_empty per stage.
//   WG 0,1 math: S = Q K^T with each warpgroup taking 32 of the 64 keys (no redundant work), row
//         maxima exchanged through shared memory, P = exp2(S - m) written to shared memory, then
//         O[:, 256w:256w+256] += P V with V read from the same K tile (first 512 columns).
// A split writes either the final row (request not split) or an fp32 partial + LSE that
// combine_kernel.cuh merges.
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/schedule.cuh"
#include "mla_decode/traits.h"

namespace mla_decode {
using namespace cute;
using mla_common::named_barrier_sync;

// Issues all K-tile loads of this CTA's schedule. Runs on one thread.
template <typename Traits>
__device__ void produce_kv_tiles(const DecodeParams& p, const DecodeTma& tma,
                                 typename Traits::SharedStorage& ss, const PartRange& range,
                                 int m_block) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int rows = tma.rows_per_copy;  // divides both page_size and kBlockN
  const uint32_t bytes_per_slab_row = kTmaColumns * sizeof(typename Traits::Element);
  int iteration = 0;
  for (int b = range.begin_b; b <= range.last_b; ++b) {
    Segment seg;
    if (!range.segment(p, b, m_block, seg)) continue;
    const int* pages = p.block_table + int64_t(b) * p.block_table_stride;
    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) {
      const int stage = iteration % kStages;
      if (iteration >= kStages) {
        cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / kStages) - 1) & 1);
      }
      // Only pieces that start before the sequence end are loaded; the math warpgroups zero the
      // rest of the tile, so no page past ceil(L / page_size) is ever dereferenced. Each 64-column
      // slab completes its own barrier, so QK can start on slab 0 while the others are in flight.
      const int key0 = blk * kBlockN;
      const int num_copies = mla_common::ceil_div(min(max(seg.seqlen_k - key0, 0), kBlockN), rows);
      // Expected bytes first (a barrier's transaction count may dip below zero meanwhile).
#pragma unroll
      for (int slab = 0; slab < kSlabs; ++slab) {
        Barrier::arrive_and_expect_tx(&ss.kv_full[stage][slab], num_copies * rows * bytes_per_slab_row);
      }
      Tensor sK = make_tensor(make_smem_ptr(ss.k[stage]), typename Traits::SmemLayoutK{});
      for (int c = 0; c < num_copies; ++c) {
        const int key = key0 + c * rows;
        const int page = min(max(pages[key / p.page_size], 0), p.num_pages - 1);
#pragma unroll
        for (int slab = 0; slab < kSlabs; ++slab) {
          SM90_TMA_LOAD_3D::copy(&tma.kv, &ss.kv_full[stage][slab], uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                                 &sK(c * rows, slab * kTmaColumns), slab * kTmaColumns, key % p.page_size, page);
        }
      }
    }
  }
}

template <typename Traits>
__device__ void consume_kv_tiles(const DecodeParams& p, typename Traits::SharedStorage& ss,
                                 const PartRange& range, int m_block) {
  using Element = typename Traits::Element;
  const int tid = threadIdx.x;          // 0..255 over the two math warpgroups
  const int warpgroup = tid / 128;
  const int tid_in_wg = tid % 128;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Traits::SmemLayoutQ{});   // (64, 576)
  Tensor sP = make_tensor(make_smem_ptr(ss.p), typename Traits::SmemLayoutP{});   // (64, 64)
  Tensor tSsP = thr_qk.partition_C(sP);  // where this thread's scores go in P
  // Coordinates (row, key) / (row, dim) of each accumulator element of this thread.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (64, 256) per WG
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});    // (64, 32) per WG
  // Each thread holds two rows of every accumulator, r0 and r0 + 8: element e of an SM90 WGMMA
  // accumulator ((2 columns, 2 row halves, N/8), ...) belongs to row r0 + 8 * row_half(e).
  const int r0 = get<0>(tScS(0));
  auto row_half = [](int e) { return (e >> 1) & 1; };

  int iteration = 0;
  for (int b = range.begin_b; b <= range.last_b; ++b) {
    Segment seg;
    if (!range.segment(p, b, m_block, seg)) continue;
    const int rows_in_request = seg.seqlen_q * p.num_heads_q;
    const int row_base = m_block * kBlockM;

    // ---- Q tile: 16-byte cp.async copies into the swizzled layout, all in flight at once (rows
    // past the request are zero-filled).
    {
      constexpr int kChunks = kHeadDimK / 8;
      for (int i = tid; i < kBlockM * kChunks; i += 256) {
        const int r = i / kChunks, c = i % kChunks, row = row_base + r;
        const bool valid = row < rows_in_request;
        const int t = valid ? row / p.num_heads_q : 0, h = valid ? row % p.num_heads_q : 0;
        const int64_t token = seg.first_token + t;
        const Element* src =
            c < kHeadDimV / 8
                ? static_cast<const Element*>(p.q_nope) + seg.b * p.q_nope_batch_stride +
                      token * p.q_nope_token_stride + h * p.q_nope_head_stride + c * 8
                : static_cast<const Element*>(p.q_pe) + seg.b * p.q_pe_batch_stride +
                      token * p.q_pe_token_stride + h * p.q_pe_head_stride + (c * 8 - kHeadDimV);
        mla_common::cp_async_16(&sQ(r, c * 8), valid ? src : p.q_nope, valid);
      }
      mla_common::cp_async_wait_all();
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(256, int(DecodeBarrier::kQReady));
    }

    // Last visible key (inclusive) of this thread's two rows: bottom-right causal alignment.
    int last_key[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = (row_base + r0 + 8 * i) / p.num_heads_q;
      last_key[i] = p.causal ? min(seg.seqlen_k - seg.seqlen_q + t, seg.seqlen_k - 1)
                             : seg.seqlen_k - 1;
    }
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};
    clear(tOrO);

    // S = Q K^T for this warpgroup's 32 keys of block `blk` (ring slot `it`), issued as each
    // 64-column slab of the tile lands, so the MMAs overlap the rest of the copy.
    auto issue_qk = [&](int blk, int it) {
      const int stage = it % kStages;
      const uint32_t phase = (it / kStages) & 1;
      Tensor sK = make_tensor(make_smem_ptr(ss.k[stage]), typename Traits::SmemLayoutK{});
      // Tail block: zero this warpgroup's key rows past the sequence end (never loaded, or
      // holding slots past L) so that 0-probability keys cannot inject NaN/Inf through P V.
      const int valid_keys = seg.seqlen_k - blk * kBlockN;
      if (valid_keys < kBlockN) {
        for (int slab = 0; slab < kSlabs; ++slab) {
          cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
        }
        constexpr int kChunks = kHeadDimK / 8;
        const int first = max(valid_keys, warpgroup * 32), last = warpgroup * 32 + 32;
        for (int i = tid_in_wg; i < (last - first) * kChunks; i += 128) {
          *reinterpret_cast<uint4*>(&sK(first + i / kChunks, i % kChunks * 8)) = make_uint4(0, 0, 0, 0);
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(128, int(DecodeBarrier::kTailZeroed0) + warpgroup);
      }
      // One WGMMA commit group per slab, each issued as soon as its slab has landed (a barrier
      // wait inside a group would make the compiler serialize the MMAs around it).
      constexpr int kStepsPerSlab = kTmaColumns / 16;
      warpgroup_fence_operand(tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
      for (int slab = 0; slab < kSlabs; ++slab) {
        cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
        // Descriptors are rebuilt per slab from opaque bases (cheap integer math): otherwise the
        // compiler computes all 2 x 36 of them up front and holds them across the waits.
        Tensor tSrQ = thr_qk.partition_fragment_A(
            make_tensor(make_smem_ptr(mla_common::opaque(ss.q)), typename Traits::SmemLayoutQ{}));
        Tensor tSrK = thr_qk.partition_fragment_B(
            make_tensor(make_smem_ptr(mla_common::opaque(ss.k[stage])), typename Traits::SmemLayoutK{}));
        warpgroup_arrive();
#pragma unroll
        for (int k = slab * kStepsPerSlab; k < (slab + 1) * kStepsPerSlab; ++k) {
          cute::gemm(mma_qk, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
          mma_qk.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
      }
    };

    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) {
      const int stage = iteration % kStages;
      Tensor sVt = make_tensor(make_smem_ptr(ss.k[stage]), typename Traits::SmemLayoutVt{});
      const int key0 = blk * kBlockN;
      issue_qk(blk, iteration);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);

      // ---- Scale to log2 units, mask, partial row max over this warpgroup's keys.
      float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) {
        const int i = row_half(e);
        const int key = key0 + get<1>(tScS(e));
        const float s = key <= last_key[i] ? tSrS(e) * p.scale_log2 : -INFINITY;
        tSrS(e) = s;
        block_max[i] = fmaxf(block_max[i], s);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 1));
        block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 2));
      }
      if (tid % 4 == 0) {
        ss.row_max[warpgroup][r0] = block_max[0];
        ss.row_max[warpgroup][r0 + 8] = block_max[1];
      }
      named_barrier_sync(256, int(DecodeBarrier::kRowMax));

      // ---- Online softmax: both warpgroups derive the same new max, so O and l stay consistent.
      float rescale[2], base[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = r0 + 8 * i;
        const float new_max =
            fmaxf(row_max[i], fmaxf(ss.row_max[0][r], ss.row_max[1][r]));
        base[i] = new_max == -INFINITY ? 0.f : new_max;  // fully masked row: keep exp2 finite
        rescale[i] = exp2f(row_max[i] - base[i]);
        row_max[i] = new_max;
        row_sum[i] *= rescale[i];
      }
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) {
        const int i = row_half(e);
        const float prob = exp2f(tSrS(e) - base[i]);
        row_sum[i] += prob;
        tSsP(e) = Element(prob);
      }
#pragma unroll
      for (int e = 0; e < size(tOrO); ++e) {
        tOrO(e) *= rescale[row_half(e)];
      }
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(256, int(DecodeBarrier::kPReady));

      // ---- O[:, own 256 columns] += P V.
      Tensor tOrP = thr_pv.partition_fragment_A(
          make_tensor(make_smem_ptr(mla_common::opaque(ss.p)), typename Traits::SmemLayoutP{}));
      Tensor tOrV = thr_pv.partition_fragment_B(sVt);
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < size<2>(tOrP); ++k) {
        cute::gemm(mma_pv, tOrP(_, _, k), tOrV(_, _, k), tOrO);
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      if (tid_in_wg == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[stage]);
    }

    // ---- Epilogue: total denominator over both warpgroups' keys, then normalise and store.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 1);
      row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 2);
    }
    if (tid % 4 == 0) {
      ss.row_sum[warpgroup][r0] = row_sum[0];
      ss.row_sum[warpgroup][r0 + 8] = row_sum[1];
    }
    named_barrier_sync(256, int(DecodeBarrier::kRowSum));
    float inv_sum[2], lse[2];
    const int num_splits = p.req_splits[2 * seg.b];
    const bool is_partial = num_splits > 1;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = r0 + 8 * i;
      const float total = ss.row_sum[0][r] + ss.row_sum[1][r];
      const bool empty = total == 0.f;  // no visible key in this split
      inv_sum[i] = empty ? 0.f : 1.f / total;
      const float final_empty_lse = is_partial ? -INFINITY : INFINITY;
      lse[i] = empty ? final_empty_lse : (row_max[i] + __log2f(total)) * float(M_LN2);
    }
    const int slot = p.req_splits[2 * seg.b + 1] + seg.split;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row_base + r0 + 8 * i;
      if (row >= rows_in_request || warpgroup != 0 || tid % 4 != 0) continue;
      if (is_partial) {
        p.partial_lse[(int64_t(slot) * p.num_q_tiles + m_block) * kBlockM + r0 + 8 * i] = lse[i];
      } else {
        const int t = row / p.num_heads_q, h = row % p.num_heads_q;
        p.lse[seg.b * p.lse_batch_stride + (seg.first_token + t) * p.lse_token_stride +
              h * p.lse_head_stride] = lse[i];
      }
    }
#pragma unroll
    for (int e = 0; e < size(tOrO); e += 2) {
      const int i = row_half(e);
      const int row = row_base + r0 + 8 * i;
      const int col = get<1>(tOcO(e));
      if (row >= rows_in_request) continue;
      const float v0 = tOrO(e) * inv_sum[i], v1 = tOrO(e + 1) * inv_sum[i];
      if (is_partial) {
        float* dst = p.partial_out +
                     ((int64_t(slot) * p.num_q_tiles + m_block) * kBlockM + row - row_base) * kHeadDimV + col;
        *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
      } else {
        const int t = row / p.num_heads_q, h = row % p.num_heads_q;
        Element* dst = static_cast<Element*>(p.out) + seg.b * p.out_batch_stride +
                       (seg.first_token + t) * p.out_token_stride + h * p.out_head_stride + col;
        dst[0] = Element(v0);
        dst[1] = Element(v1);
      }
    }
  }
}

template <typename Traits>
__global__ void __launch_bounds__(kNumThreads, 1)
    mla_decode_kernel(__grid_constant__ const DecodeParams params, __grid_constant__ const DecodeTma tma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  // The 128-byte swizzle pattern is anchored at 1024-byte boundaries; the launcher adds the slack.
  char* smem_aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_aligned);
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  const int m_block = blockIdx.x;
  const PartRange range = PartRange::load(params, blockIdx.y);
  // The combine kernel may start now: its CTAs fill SMs whose parts are done (or empty) and wait
  // in griddepcontrol.wait until this grid has finished and flushed.
  mla_common::launch_dependents();

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      for (int slab = 0; slab < kSlabs; ++slab) {
        cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full[s][slab], 1);
      }
      cutlass::arch::ClusterBarrier::init(&ss.kv_empty[s], kNumMathWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == kNumMathWarpgroups) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x == kNumMathWarpgroups * 128) {
      cute::prefetch_tma_descriptor(&tma.kv);
      produce_kv_tiles<Traits>(params, tma, ss, range, m_block);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
    consume_kv_tiles<Traits>(params, ss, range, m_block);
  }
#endif
}

}  // namespace mla_decode
