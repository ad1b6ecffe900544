// Varlen MLA prefill attention for sm_90a: q/k head dim 192, v head dim 128, one tile per CTA.
//
// Grid (num_m_blocks, h_q, batch): CTA (m, h, b) owns query rows [128m', 128m' + 128) of request b,
// head h, with m' = num_m_blocks - 1 - m so that the longest causal tiles start first. CTAs whose
// tile lies past the request's end exit at once.
//
// Warpgroup roles (384 threads):
//   WG 2  producer: one thread issues TMA copies of Q (once) and of K and V blocks (128 keys each)
//         into 2-stage rings; K and V have separate full/empty mbarriers, so K of block j + 1 can
//         load while V of block j is still being read.
//   WG 0,1 math: warpgroup w owns tile rows [64w, 64w + 64). KV blocks are walked from the last to
//         the first (the masked blocks come first). Per block, intra-warpgroup overlap: issue
//         S = Q K_j^T, issue O += P_{j-1} V_{j-1}, wait for S, run the online softmax of block j on
//         the CUDA cores while the tensor cores finish P V, then rescale O and convert P_j to 16 bit
//         in registers (P is the register A operand of the P V WGMMA).
#pragma once
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "common/device_utils.cuh"
#include "mla_prefill/config.h"
#include "mla_prefill/params.h"
#include "mla_prefill/traits.h"

namespace mla_prefill {
using namespace cute;
using mla_common::named_barrier_sync;

// What one CTA computes: its request, head and query rows, and the KV blocks those rows can see.
struct Tile {
  int b, head, head_k, m0;      // request, q head, k/v head, first request-local query row
  int q_start, seqlen_q;        // packed row of the request's first query, its query count
  int k_start, seqlen_k;
  int num_blocks;               // KV blocks [0, num_blocks) hold a key visible to some row

  __device__ static bool load(const PrefillParams& p, Tile& t) {
    t.b = blockIdx.z;
    t.head = blockIdx.y;
    t.head_k = t.head / (p.num_heads_q / p.num_heads_k);
    t.m0 = (p.num_m_blocks - 1 - int(blockIdx.x)) * kBlockM;
    // cu_seqlens are checked on the GPU only under validation (their values need a host sync): the
    // spans are clamped into the packed tensors, so bad offsets give wrong rows, never an access outside
    // q, out, lse, k or v, nor a walk over blocks that hold no key.
    clamp_span(p.cu_seqlens_q, t.b, p.total_q, t.q_start, t.seqlen_q);
    if (t.m0 >= t.seqlen_q) return false;
    clamp_span(p.cu_seqlens_k, t.b, p.total_k, t.k_start, t.seqlen_k);
    // Keys past the last row's diagonal are invisible to the whole tile (bottom-right causal).
    const int last_row = min(t.m0 + kBlockM, t.seqlen_q) - 1;
    const int key_end = p.causal ? min(t.seqlen_k, last_row + t.seqlen_k - t.seqlen_q + 1) : t.seqlen_k;
    t.num_blocks = max(mla_common::ceil_div(key_end, kBlockN), 0);
    return true;
  }
  __device__ static void clamp_span(const int* cu_seqlens, int b, int total, int& start, int& count) {
    start = min(max(cu_seqlens[b], 0), total);
    count = min(max(cu_seqlens[b + 1], start), total) - start;
  }
  // Last key (inclusive) that request-local query row `row` sees.
  __device__ int last_key(const PrefillParams& p, int row) const {
    return p.causal ? min(row + seqlen_k - seqlen_q, seqlen_k - 1) : seqlen_k - 1;
  }
};

// Issues every TMA copy of the tile (one thread). Block i of the walk is KV block num_blocks - 1 - i.
template <typename Traits>
__device__ void produce_tiles(const PrefillParams& p, const PrefillTma& tma, typename Traits::SharedStorage& ss,
                              const Tile& t) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using Element = typename Traits::Element;
  constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Traits::SmemLayoutQ{});
  Barrier::arrive_and_expect_tx(&ss.q_full, kBlockM * kHeadDimQK * sizeof(Element));
#pragma unroll
  for (int slab = 0; slab < kSlabsQK; ++slab) {
    SM90_TMA_LOAD_3D::copy(&tma.q, &ss.q_full, kHint, &sQ(0, slab * kTmaColumns), slab * kTmaColumns,
                           t.q_start + t.m0, t.head);
  }
  const int k_pe_head = tma.k_pe_shared ? 0 : t.head_k;
  for (int i = 0; i < t.num_blocks; ++i) {
    const int stage = i % kStages;
    const uint32_t empty_phase = ((i / kStages) - 1) & 1;
    const int row = t.k_start + (t.num_blocks - 1 - i) * kBlockN;
    Tensor sK = make_tensor(make_smem_ptr(ss.k[stage]), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v[stage]), typename Traits::SmemLayoutV{});
    if (i >= kStages) cutlass::arch::ClusterBarrier::wait(&ss.k_empty[stage], empty_phase);
    Barrier::arrive_and_expect_tx(&ss.k_full[stage], kBlockN * kHeadDimQK * sizeof(Element));
#pragma unroll
    for (int slab = 0; slab < kHeadDimNope / kTmaColumns; ++slab) {
      SM90_TMA_LOAD_3D::copy(&tma.k, &ss.k_full[stage], kHint, &sK(0, slab * kTmaColumns), slab * kTmaColumns,
                             row, t.head_k);
    }
    SM90_TMA_LOAD_3D::copy(&tma.k_pe, &ss.k_full[stage], kHint, &sK(0, int(kHeadDimNope)), tma.k_pe_column, row,
                           k_pe_head);
    if (i >= kStages) cutlass::arch::ClusterBarrier::wait(&ss.v_empty[stage], empty_phase);
    Barrier::arrive_and_expect_tx(&ss.v_full[stage], kBlockN * kHeadDimV * sizeof(Element));
#pragma unroll
    for (int slab = 0; slab < kSlabsV; ++slab) {
      SM90_TMA_LOAD_3D::copy(&tma.v, &ss.v_full[stage], kHint, &sV(0, slab * kTmaColumns), slab * kTmaColumns,
                             row, t.head_k);
    }
  }
}

// The two math warpgroups (threads 0..255); see the header for the schedule.
template <typename Traits>
__device__ void consume_tiles(const PrefillParams& p, typename Traits::SharedStorage& ss, const Tile& t) {
  using Element = typename Traits::Element;
  const int tid = threadIdx.x;
  const int tid_in_wg = tid % 128;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);

  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});    // (64, 128) per WG
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (64, 128) per WG
  // P as the register A operand of P V. Element e of the S accumulator ((2 cols, 2 row halves, N/8))
  // and element e of this fragment ((2 cols, 2 row halves, 2 k-halves), 1, N/16) are the same (row,
  // key): a k-block of 16 keys is two adjacent 8-column groups of S. So P(e) = S(e).
  Tensor tOrP = make_tensor<Element>(partition_shape_A(mma_pv, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  static_assert(size(tOrP) == size(tSrS));
  // (row, key) / (row, dim) coordinates of this thread's accumulator elements.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  // Each thread holds two rows of every accumulator, r0 and r0 + 8.
  const int r0 = get<0>(tScS(0));
  auto row_half = [](int e) { return (e >> 1) & 1; };
  int last_key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) last_key[i] = t.last_key(p, t.m0 + r0 + 8 * i);
  // Keys a block must mask: past some row's diagonal, or past the request.
  const int tile_min_last_key = t.last_key(p, t.m0);

  float row_max[2] = {-INFINITY, -INFINITY};  // running max of scale * log2(e) * S
  float row_sum[2] = {0.f, 0.f};              // this thread's share of the denominator
  clear(tOrO);

  auto issue_qk = [&](int stage) {
    Tensor tSrQ = thr_qk.partition_fragment_A(
        make_tensor(make_smem_ptr(mla_common::opaque(ss.q)), typename Traits::SmemLayoutQ{}));
    Tensor tSrK = thr_qk.partition_fragment_B(
        make_tensor(make_smem_ptr(mla_common::opaque(ss.k[stage])), typename Traits::SmemLayoutK{}));
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int k = 0; k < size<2>(tSrQ); ++k) {
      cute::gemm(mma_qk, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  auto issue_pv = [&](int stage) {
    Tensor tOrV = thr_pv.partition_fragment_B(
        make_tensor(make_smem_ptr(mla_common::opaque(ss.v[stage])), typename Traits::SmemLayoutVt{}));
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < size<2>(tOrP); ++k) cute::gemm(mma_pv, tOrP(_, _, k), tOrV(_, _, k), tOrO);
    warpgroup_commit_batch();
  };
  auto release = [&](uint64_t* barrier) {
    if (tid_in_wg == 0) cutlass::arch::ClusterBarrier::arrive(barrier);
  };
  // Waits for V of KV block n. If the block runs past the request, both warpgroups zero its rows
  // past the last key (other requests' rows, or NaN): a 0 probability times NaN would still be NaN.
  auto wait_v = [&](int stage, uint32_t phase, int n) {
    cutlass::arch::ClusterBarrier::wait(&ss.v_full[stage], phase);
    const int valid_keys = t.seqlen_k - n * kBlockN;
    if (valid_keys < kBlockN) {
      Tensor sV = make_tensor(make_smem_ptr(ss.v[stage]), typename Traits::SmemLayoutV{});
      constexpr int kChunks = kHeadDimV / 8;
      for (int c = tid; c < (kBlockN - valid_keys) * kChunks; c += 2 * 128) {
        mla_common::st_shared_zero16(&sV(valid_keys + c / kChunks, c % kChunks * 8));
      }
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync<int(PrefillBarrier::kVTailZeroed), 2 * 128>();
    }
  };
  // Online softmax of block n on tSrS (raw scores in, probabilities out); returns the O rescale.
  auto softmax_step = [&](int n, float (&rescale)[2]) {
    const int key0 = n * kBlockN;
    float block_max[2] = {-INFINITY, -INFINITY};
    if (key0 + kBlockN - 1 > tile_min_last_key) {  // uniform over the CTA
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) {
        if (key0 + get<1>(tScS(e)) > last_key[row_half(e)]) tSrS(e) = -INFINITY;
      }
    }
#pragma unroll
    for (int e = 0; e < size(tSrS); ++e) block_max[row_half(e)] = fmaxf(block_max[row_half(e)], tSrS(e));
    float base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 1));
      block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 2));
      const float new_max = fmaxf(row_max[i], block_max[i] * p.scale_log2);  // scale > 0
      base[i] = new_max == -INFINITY ? 0.f : new_max;  // row sees no key yet: keep exp2 finite
      rescale[i] = exp2f(row_max[i] - base[i]);
      row_max[i] = new_max;
      row_sum[i] *= rescale[i];
    }
#pragma unroll
    for (int e = 0; e < size(tSrS); ++e) {
      const int i = row_half(e);
      tSrS(e) = exp2f(fmaf(tSrS(e), p.scale_log2, -base[i]));
      row_sum[i] += tSrS(e);
    }
  };
  auto convert_p = [&]() {
#pragma unroll
    for (int e = 0; e < size(tSrS); ++e) tOrP(e) = Element(tSrS(e));
  };

  cutlass::arch::ClusterBarrier::wait(&ss.q_full, 0);
  if (t.num_blocks > 0) {
    float rescale[2];
    // First block (the last KV block): S, softmax, P.
    int n = t.num_blocks - 1;
    cutlass::arch::ClusterBarrier::wait(&ss.k_full[0], 0);
    issue_qk(0);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    release(&ss.k_empty[0]);
    softmax_step(n, rescale);
    convert_p();
    for (int i = 1; i < t.num_blocks; ++i) {
      const int stage = i % kStages, prev = (i - 1) % kStages;
      cutlass::arch::ClusterBarrier::wait(&ss.k_full[stage], (i / kStages) & 1);
      issue_qk(stage);
      wait_v(prev, ((i - 1) / kStages) & 1, n);
      issue_pv(prev);
      --n;
      warpgroup_wait<1>();  // S of block n; P V of block n + 1 may still run
      warpgroup_fence_operand(tSrS);
      release(&ss.k_empty[stage]);
      softmax_step(n, rescale);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      release(&ss.v_empty[prev]);
      if (__any_sync(0xffffffff, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
        for (int e = 0; e < size(tOrO); ++e) tOrO(e) *= rescale[row_half(e)];
      }
      convert_p();
    }
    const int last = (t.num_blocks - 1) % kStages;
    wait_v(last, ((t.num_blocks - 1) / kStages) & 1, n);
    issue_pv(last);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release(&ss.v_empty[last]);
  }

  // ---- Epilogue: normalise, store the rows of this request (4-byte pairs), and the LSE.
  Element* out_row[2];
  float inv_sum[2];
  bool row_valid[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 2);
    const int row = t.m0 + r0 + 8 * i;
    row_valid[i] = row < t.seqlen_q;
    const bool empty = row_sum[i] == 0.f;  // no visible key: out 0, lse +inf
    inv_sum[i] = empty ? 0.f : 1.f / row_sum[i];
    const int64_t token = t.q_start + row;
    out_row[i] = static_cast<Element*>(p.out) + token * p.out_token_stride + t.head * p.out_head_stride;
    if (row_valid[i] && tid % 4 == 0) {
      p.lse[token * p.lse_token_stride + t.head * p.lse_head_stride] =
          empty ? INFINITY : (row_max[i] + __log2f(row_sum[i])) * float(M_LN2);
    }
  }
#pragma unroll
  for (int e = 0; e < size(tOrO); e += 2) {
    const int i = row_half(e);
    if (!row_valid[i]) continue;
    const Element pair[2] = {Element(tOrO(e) * inv_sum[i]), Element(tOrO(e + 1) * inv_sum[i])};
    *reinterpret_cast<uint32_t*>(out_row[i] + get<1>(tOcO(e))) = *reinterpret_cast<const uint32_t*>(pair);
  }
}

template <typename Traits>
__global__ void __launch_bounds__(kNumThreads, 1)
    mla_prefill_kernel(__grid_constant__ const PrefillParams params, __grid_constant__ const PrefillTma tma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto& ss = mla_common::shared_storage_1024<typename Traits::SharedStorage>();
  Tile tile;
  if (!Tile::load(params, tile)) return;  // the whole CTA: the tile is past the request's end

  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.k_full[s], 1);
      cutlass::arch::ClusterTransactionBarrier::init(&ss.v_full[s], 1);
      cutlass::arch::ClusterBarrier::init(&ss.k_empty[s], kNumMathWarpgroups);
      cutlass::arch::ClusterBarrier::init(&ss.v_empty[s], kNumMathWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == kNumMathWarpgroups) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x == kNumMathWarpgroups * 128) {
      cute::prefetch_tma_descriptor(&tma.q);
      cute::prefetch_tma_descriptor(&tma.k);
      cute::prefetch_tma_descriptor(&tma.v);
      produce_tiles<Traits>(params, tma, ss, tile);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
    consume_tiles<Traits>(params, ss, tile);
  }
#endif
}

}  // namespace mla_prefill
