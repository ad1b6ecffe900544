// Split-KV paged MLA decode for sm_90a with an fp8 (e4m3) cache and fp8 MMAs: the 64-row kernel's
// structure (rows64/kernel.cuh: grid, schedule, producer, block ownership, epilogue) with every MMA
// operand in e4m3, so that no tile is converted to 16 bit:
//   S = Q K^T   A = Q (quantised per row to e4m3 when loaded), B = the K tile as TMA stages it;
//   O += P V    A = P (e4m3, times kPScale), B = V^T, which the block's non-owner transposes from
//               the K tile (transpose_v) while the owner computes S.
// fp8 MMAs run at twice the 16-bit rate and read half the shared-memory bytes per FLOP; the price
// is Q and P rounded to e4m3 (3 mantissa bits), on top of the cache's own rounding.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/fp8mma/traits.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/causal_mask.cuh"
#include "mla_decode/shared/epilogue.cuh"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/launch.cuh"
#include "mla_decode/shared/mma_issue.cuh"
#include "mla_decode/shared/online_softmax.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {
using namespace cute;
using mla_common::named_barrier_sync;

// P is stored times this power of two: probabilities in [2^-17, 1] stay e4m3 normals or
// subnormals (the smallest subnormal is 2^-9), the largest 256 < 448.
constexpr float kPScale = 256.f;

// Four floats -> four e4m3 (first lowest), rounded to nearest, saturated to +-448.
__device__ __forceinline__ uint32_t e4m3x4_from_floats(float v0, float v1, float v2, float v3) {
  uint32_t out;
  // cvt.e4m3x2.f32 d, a, b puts a in the upper byte of d.
  asm("{\n.reg .b16 l, h;\ncvt.rn.satfinite.e4m3x2.f32 l, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 h, %4, %3;\n"
      "mov.b32 %0, {l, h};\n}"
      : "=r"(out)
      : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
  return out;
}

// The power of two a Q row whose largest |value| is row_max (>= 0) is stored times as e4m3 (fp8
// MMAs): it brings row_max to [128, 256), below e4m3's largest finite 448. 1 for a zero row.
__device__ __forceinline__ float e4m3_row_scale(float row_max) {
  const int exponent = (__float_as_int(row_max) >> 23) - 127;  // floor(log2(row_max))
  return row_max > 0.f ? __int_as_float((min(7 - exponent, 100) + 127) << 23) : 1.f;
}

// V^T [512, 64 keys] from the first 512 columns of a staged K tile, by one warpgroup. Two
// ldmatrix.x4.trans of keys [0, 32) and [32, 64) x dims [16 u, 16 u + 16) give thread (g, c) of its
// warp, in register m (0..7), the bytes (key 8m + 2c (+1), dim 16 u + 2g (+1)); two byte permutes
// per register pair make the word of keys 16q + {2c, 2c + 1, 8 + 2c, 9 + 2c} of dim 2g, and of
// 2g + 1: logical columns 16c + 4q ... + 3 (fp8mma/traits.h), so the 4 words of a dim are one
// 16-byte store. Warp w transposes slabs 2w and 2w + 1, waiting only for those. Keys >= valid_keys
// become zeros (never loaded, or slots past L).
template <typename Traits>
__device__ __forceinline__ void transpose_v(typename Traits::SharedStorage& ss, int stage, uint32_t phase, int vt_buffer,
                                            int tid_in_wg, int valid_keys) {
  // From an opaque thread index: otherwise the swizzled offsets are computed once and spilled.
  const int thread = mla_common::opaque(tid_in_wg);
  const int warp = thread / 32, lane = thread % 32, g = lane / 4, c = lane % 4;
  const uint32_t k_base = mla_common::smem_addr(ss.k[stage]);
  const uint32_t vt_base = mla_common::smem_addr(ss.vt[vt_buffer]);
  // Byte b of word q holds key 16q + 8 (b / 2) + 2c + b % 2.
  uint32_t keep[4] = {~0u, ~0u, ~0u, ~0u};
  if (valid_keys < kBlockN) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      keep[q] = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) keep[q] |= (16 * q + 8 * (b / 2) + 2 * c + b % 2 < valid_keys ? 0xffu : 0u) << (8 * b);
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int slab = 2 * warp + s;
    cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
#pragma unroll
    for (int u = 0; u < kTmaColumns / 16; ++u) {  // 16-dim chunk of the slab
      uint32_t r[8];
      // Lane l gives the row address of matrix l / 8, row l % 8: key 32 j + l.
      mla_common::ldsm_x4_trans(k_base + slab * kFp8SlabBytes + fp8_slab_offset(lane, u), *reinterpret_cast<uint32_t(*)[4]>(r));
      mla_common::ldsm_x4_trans(k_base + slab * kFp8SlabBytes + fp8_slab_offset(32 + lane, u),
                                *reinterpret_cast<uint32_t(*)[4]>(r + 4));
      uint32_t even[4], odd[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        even[q] = __byte_perm(r[2 * q], r[2 * q + 1], 0x6420) & keep[q];
        odd[q] = __byte_perm(r[2 * q], r[2 * q + 1], 0x7531) & keep[q];
      }
      // Lanes with odd g store dim 2g + 1 first: a quarter warp then writes rows 4k and 4k + 3,
      // whose chunks fall in different banks.
      const bool swap = g & 1;
      const int dim = slab * kTmaColumns + 16 * u + 2 * g + swap;
      mla_common::st_shared_16(vt_base + fp8_slab_offset(dim, c),
                               swap ? make_uint4(odd[0], odd[1], odd[2], odd[3]) : make_uint4(even[0], even[1], even[2], even[3]));
      const int other = dim + 1 - 2 * swap;
      mla_common::st_shared_16(vt_base + fp8_slab_offset(other, c),
                               swap ? make_uint4(even[0], even[1], even[2], even[3]) : make_uint4(odd[0], odd[1], odd[2], odd[3]));
    }
  }
  cutlass::arch::fence_view_async_shared();
}

template <typename Traits>
__device__ void consume_fp8mma_tiles(const DecodeParams& p, typename Traits::SharedStorage& ss,
                                     const PartRange& range, int m_block) {
  using Element = typename Traits::Element;
  const int tid = threadIdx.x;  // 0..255 over the two math warpgroups
  const int warpgroup = mla_common::warp_uniform(tid / 128);
  const int tid_in_wg = tid % 128;

  typename Traits::TiledMmaQK mma_qk;  // one warpgroup
  typename Traits::TiledMmaPV mma_pv;  // two warpgroups, split along the 512 output columns
  auto thr_qk = mma_qk.get_thread_slice(tid_in_wg);
  auto thr_pv = mma_pv.get_thread_slice(tid);

  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (64, 256) per WG
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});    // (64, 64)
  // Thread (warp w, lane 4g + c) holds rows r0 = 16 w + g and r0 + 8 of every accumulator; element
  // e is in row r0 + 8 ((e >> 1) & 1), column 8 (e >> 2) + 2c + (e & 1).
  const int r0 = get<0>(tScS(0)), c = tid % 4;
  const float k_scale = *p.k_scale;

  // ---- Q [64 rows, 576] into ss.q as e4m3, each row times e4m3_row_scale, or 1 / *p.q_scale when
  // given (the factor recorded in ss.q_scale).
  // Thread t loads 16-byte chunks t % 4, t % 4 + 4, ... of row t / 4 (rows past the request: zeros).
  auto load_q = [&](const Segment& s) {
    constexpr int kChunks = kHeadDimK / 8, kThreadsPerRow = 256 / kBlockM, kPerThread = kChunks / kThreadsPerRow;
    const int thread = mla_common::opaque(tid), r = thread / kThreadsPerRow, first = thread % kThreadsPerRow;
    const int row = m_block * kBlockM + r;
    const bool valid = row < s.seqlen_q * p.num_heads_q;
    const QueryRow qr = QueryRow::of(p, valid ? row : 0);
    const auto q = QRow<Element>::at(p, s, qr.token, qr.head);
    uint4 chunk[kPerThread];
    float row_max = 0.f;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int d0 = (first + i * kThreadsPerRow) * 8;
      chunk[i] = valid ? *reinterpret_cast<const uint4*>((d0 < kHeadDimV ? q.nope : q.pe) + d0) : make_uint4(0, 0, 0, 0);
      const Element* v = reinterpret_cast<const Element*>(&chunk[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) row_max = fmaxf(row_max, fabsf(float(v[k])));
    }
    for (int x = 1; x < kThreadsPerRow; x *= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffff, row_max, x));
    const float scale = p.q_scale != nullptr ? 1.f / *p.q_scale : e4m3_row_scale(row_max);
    if (first == 0) ss.q_scale[r] = scale;
    const uint32_t q_base = mla_common::smem_addr(ss.q);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int d0 = (first + i * kThreadsPerRow) * 8;
      const Element* v = reinterpret_cast<const Element*>(&chunk[i]);
      const uint32_t lo = e4m3x4_from_floats(float(v[0]) * scale, float(v[1]) * scale, float(v[2]) * scale, float(v[3]) * scale);
      const uint32_t hi = e4m3x4_from_floats(float(v[4]) * scale, float(v[5]) * scale, float(v[6]) * scale, float(v[7]) * scale);
      const int col = d0 % kTmaColumns;  // 8 values: half of a 16-byte chunk
      mla_common::st_shared_8(q_base + (d0 / kTmaColumns) * kFp8SlabBytes + fp8_slab_offset(r, col / 16) + col % 16, lo, hi);
    }
  };

  int iteration = 0;
  Segment seg;
  for (bool have = range.next_segment(p, range.begin_b, m_block, seg); have;
       have = range.next_segment(p, seg.b + 1, m_block, seg)) {
    const int row_base = m_block * kBlockM;
    load_q(seg);
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<int(Fp8MmaBarrier::kQReady), 256>();
    // Score scale of this thread's two rows, log2 units (the Q row's factor undone here).
    float score_scale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) score_scale[i] = p.scale_log2 * k_scale / ss.q_scale[r0 + 8 * i];

    const int last_key[2] = {last_visible_key(p, seg, row_base + r0), last_visible_key(p, seg, row_base + r0 + 8)};
    const int lowest_last_key = last_visible_key(p, seg, 0);
    float row_max[2] = {-INFINITY, -INFINITY};  // running max, log2 units; equal in both WGs
    float row_sum[2] = {0.f, 0.f};              // this WG's share of the denominator
    clear(tOrO);

    // S = Q K^T of the block in `stage`, one WGMMA commit group per slab as it lands. Key rows past
    // the sequence end hold stale bytes (even NaN): their scores are masked in the softmax.
    auto issue_qk = [&](int stage, uint32_t phase) {
      mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
      issue_qk_slabs<typename Traits::SmemLayoutQ, typename Traits::SmemLayoutK>(
          mma_qk, thr_qk, tSrS, reinterpret_cast<typename Traits::Fp8*>(ss.q),
          reinterpret_cast<typename Traits::Fp8*>(ss.k[mla_common::warp_uniform(stage)]), ss.kv_full[stage], phase, 0, kSlabs);
    };
    auto release_stage = [&](int it) {
      if (kEveryThreadReleases || tid_in_wg == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[it % Traits::kStages]);
    };

    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) {
      const int stage = iteration % Traits::kStages, vt_buffer = iteration % Traits::kVtBuffers;
      const uint32_t phase = (iteration / Traits::kStages) & 1;
      const int owner = (blk - seg.blk_lo) & 1;
      const int valid_keys = max(seg.seqlen_k - blk * kBlockN, 0);
      float rescale[2];
      if (owner == warpgroup) {
        issue_qk(stage, phase);
        warpgroup_wait<0>();  // S, and this WG's PV of the previous block
        if (blk > seg.blk_lo) release_stage(iteration - 1);
        warpgroup_fence_operand(tSrS);

        // -- Online softmax in log2 units over the 64 keys of the block.
        float base[2];
        owner_softmax_step(tSrS, tScS, blk * kBlockN, last_key, is_full_block(blk, lowest_last_key), score_scale,
                           /*max_slack=*/0.f, row_max, row_sum, base, rescale);  // P * kPScale fits e4m3 only if P <= 1
        // The other WG must be done reading the previous P before it is overwritten.
        if (blk > seg.blk_lo) named_barrier_sync<int(Fp8MmaBarrier::kPFree0), 256>(warpgroup);
        // P times kPScale as e4m3. Elements 8q + 2i (+1) and 8q + 4 + 2i (+1) are keys 16q + 2c (+1)
        // and 16q + 8 + 2c (+1) of row r0 + 8i: logical columns 16c + 4q ... + 3, so a row's 16
        // values are one 16-byte store.
        const uint32_t p_base = mla_common::smem_addr(ss.p);
        const int p_row = mla_common::opaque(r0), p_chunk = mla_common::opaque(c);  // not hoisted (spills)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          uint32_t words[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float prob[4];
#pragma unroll
            for (int b = 0; b < 4; ++b) prob[b] = exp2f(fmaf(tSrS(8 * q + 4 * (b / 2) + 2 * i + b % 2), score_scale[i], -base[i]));
            row_sum[i] += (prob[0] + prob[1]) + (prob[2] + prob[3]);
            words[q] = e4m3x4_from_floats(prob[0] * kPScale, prob[1] * kPScale, prob[2] * kPScale, prob[3] * kPScale);
          }
          mla_common::st_shared_16(p_base + fp8_slab_offset(p_row + 8 * i, p_chunk),
                                   make_uint4(words[0], words[1], words[2], words[3]));
        }
        __syncwarp();  // the quad's other lanes read row_max as the previous block's non-owner
        if (c == 0) {
          ss.row_max[r0] = row_max[0];
          ss.row_max[r0 + 8] = row_max[1];
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync<int(Fp8MmaBarrier::kPReady0), 256>(warpgroup);
      } else {
        // -- V^T of this block, while the owner computes S and this WG's previous PV runs. (This WG
        // owns the next block; issuing that block's S here, ahead of its PV of this block in the
        // WGMMA queue, delays the PV: measured slower. So was the producer warpgroup transposing
        // instead, most at batch 1.)
        transpose_v<Traits>(ss, stage, phase, vt_buffer, tid_in_wg, valid_keys);
        warpgroup_wait<0>();  // this WG's PV of the previous block: it no longer reads P or that stage
        if (blk > seg.blk_lo) release_stage(iteration - 1);
        if (blk > seg.blk_lo) named_barrier_sync<int(Fp8MmaBarrier::kPFree0), 256>(owner);
        named_barrier_sync<int(Fp8MmaBarrier::kPReady0), 256>(owner);  // also: V^T is visible to both
        adopt_row_max(ss.row_max, r0, row_max, row_sum, rescale);
      }

      // ---- O[:, own 256 columns] = O * rescale + P V.
      using Fp8 = typename Traits::Fp8;
      rescale_and_issue_pv<typename Traits::SmemLayoutP, typename Traits::SmemLayoutVt>(
          mma_pv, thr_pv, tOrO, rescale, reinterpret_cast<Fp8*>(ss.p), reinterpret_cast<Fp8*>(ss.vt[mla_common::warp_uniform(vt_buffer)]));
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);

    // ---- Epilogue: total denominator over both warpgroups' blocks, then normalise and store.
    float sums[2];  // (its barrier also means: every QK is done, ss.q is free)
    total_row_sums<int(Fp8MmaBarrier::kRowSum)>(ss.row_sum, warpgroup, r0, row_sum, sums);
    if (seg.blk_lo < seg.blk_hi) {
      // Warpgroup 0 stages its rows in the Q buffer, warpgroup 1 in the last block's K stage (every
      // MMA is done: kRowSum); then that stage is released.
      const int last_stage = (iteration - 1) % Traits::kStages;
      auto warpgroup_sync = [&] { named_barrier_sync<int(Fp8MmaBarrier::kStaged0), 128>(warpgroup); };
      racecheck_acquire_stage<Traits>(ss, iteration - 1);
      store_output_columns_staged<Element>(p, seg, m_block, r0, row_max, sums, k_scale / kPScale,
                                           /*write_lse=*/warpgroup == 0,
                                           mla_common::smem_addr(warpgroup == 0 ? ss.q : ss.k[last_stage]),
                                           tid_in_wg, 256 * warpgroup, tOrO, warpgroup_sync);
      // The stage's next bytes come by TMA (the async proxy), ordered after these stores.
      cutlass::arch::fence_view_async_shared();
      warpgroup_sync();
      release_stage(iteration - 1);
      // Warpgroup 0's rows are read out of the Q buffer before the next segment's Q overwrites it.
      named_barrier_sync<int(Fp8MmaBarrier::kRowSum), 256>();
    } else {  // no key block was loaded: no stage to stage through
      store_empty_output_tile<Element>(p, seg, m_block);
    }
  }
}

// The kernel's policy for the shared shell (shared/kernel_shell.cuh).
template <typename Traits>
struct Fp8MmaKernel : KvRingKernel<Traits> {
  template <bool kGather>
  __device__ __forceinline__ static void consume(const DecodeParams& p, const DecodeTma&,
                                                 typename Traits::SharedStorage& ss, const PartRange& range, int) {
    consume_fp8mma_tiles<Traits>(p, ss, range, blockIdx.x);
  }
};

template <typename Element>
cudaError_t run_mla_decode_fp8mma(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  return launch_split_and_combine<Fp8MmaKernel<Fp8MmaTraits<Element>>>(params, tma, stream);
}

}  // namespace mla_decode
