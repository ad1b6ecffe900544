// What the 64-row decode kernels (decode_kernel.cuh, seesaw_kernel.cuh) share around their main
// loops: the Q tile load, the causal bound of a row, and the store of a finished output tile.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <type_traits>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/schedule.cuh"

namespace mla_decode {

// Two floats -> a packed pair of Element (cutlass::bfloat16_t or cutlass::half_t), first lowest.
template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  }
  return bits;
}
// The inverse: a packed pair of Element -> two floats.
template <typename Element>
__device__ __forceinline__ float2 unpack_pair(uint32_t bits) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}
// Q tile of q-tile blockIdx.x in segment `s`: 16-byte cp.async copies into the swizzled layout, all in
// flight at once (rows past the request are zero-filled), by math threads 0..255. Thread t copies
// chunks t % 4, t % 4 + 4, ... of row t / 4, so the row's address math is done once. Completion:
// cp_async_wait_all, then a fence and a barrier over the math threads.
template <typename Element, typename SmemLayoutQ, typename SmemElement>
__device__ __forceinline__ void issue_q_tile_load(const DecodeParams& p, const Segment& s, SmemElement* q_smem) {
  constexpr int kChunks = kHeadDimK / 8, kThreadsPerRow = 256 / kBlockM;
  cute::Tensor sQ = cute::make_tensor(cute::make_smem_ptr(q_smem), SmemLayoutQ{});
  // An opaque thread index: otherwise the compiler hoists the 18 swizzled offsets out of the loop
  // over requests and holds them across it.
  const int thread = mla_common::opaque(int(threadIdx.x)), r = thread / kThreadsPerRow, row = int(blockIdx.x) * kBlockM + r;
  const bool valid = row < s.seqlen_q * p.num_heads_q;
  const auto q = QRow<Element>::at(p, s, valid ? row / p.num_heads_q : 0, valid ? row % p.num_heads_q : 0);
#pragma unroll
  for (int c = thread % kThreadsPerRow; c < kChunks; c += kThreadsPerRow) {
    const Element* src = (c < kHeadDimV / 8 ? q.nope : q.pe) + c * 8;
    mla_common::cp_async_16(&sQ(r, c * 8), valid ? src : p.q_nope, valid);
  }
}

// How the seesaw kernel's Q tiles arrive: by TMA where DecodeTma::q_by_tma (h_q a multiple of 64:
// a tile is heads [h0, h0 + 64) of one token, all rows valid), 9 slab copies issued by math thread 0
// completing `q_full`; otherwise by cp.async from all math threads (rows past the request
// zero-filled). Measured (H200): h_q 128 at batch 1 1-4 % faster by TMA. The 64-row kernel keeps
// its plain cp.async load: with this loader its batch-1 cells ran 3-6 % slower, TMA or not.
struct QTileLoader {
  const DecodeParams& p;
  const DecodeTma& tma;
  uint64_t* q_full;
  uint32_t phase = 0;

  template <typename Element, typename SmemLayoutQ, typename SmemElement>
  __device__ void issue(const Segment& s, SmemElement* q_smem) const {
    if (!tma.q_by_tma) return issue_q_tile_load<Element, SmemLayoutQ>(p, s, q_smem);
    if (threadIdx.x != 0) return;
    const int row0 = int(blockIdx.x) * kBlockM, token = s.first_token + row0 / p.num_heads_q, h0 = row0 % p.num_heads_q;
    const int batch = p.cu_seqlens_q ? 0 : s.b;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(q_full, kBlockM * kHeadDimK * sizeof(Element));
#pragma unroll
    for (int slab = 0; slab < kSlabs; ++slab) {
      const bool pe = slab == kSlabs - 1;
      cute::SM90_TMA_LOAD_4D::copy(pe ? &tma.q_pe : &tma.q_nope, q_full, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                   q_smem + slab * kBlockM * kTmaColumns, pe ? 0 : slab * kTmaColumns, h0, token, batch);
    }
  }
  // The tile issued last is in shared memory (for this thread; a fence and a barrier over the math
  // threads make it visible to WGMMA and to the other threads).
  __device__ void wait() {
    if (!tma.q_by_tma) return mla_common::cp_async_wait_all();
    cutlass::arch::ClusterTransactionBarrier::wait(q_full, phase);
    phase ^= 1;
  }
};

// Last key (inclusive) query row `row` of the segment's request sees: bottom-right causal alignment.
__device__ __forceinline__ int last_visible_key(const DecodeParams& p, const Segment& seg, int row) {
  const int t = row / p.num_heads_q;
  return p.causal ? min(seg.seqlen_k - seg.seqlen_q + t, seg.seqlen_k - 1) : seg.seqlen_k - 1;
}

// S = Q K^T of the K tile at k_smem, slabs [first_slab, end_slab): one WGMMA commit group per slab,
// each issued once the slab has landed (kv_full[slab] at `phase`); the k-steps accumulate into tSrS
// after the first (callers start a tile with ScaleOut::Zero). Pass a warp-uniform k_smem
// (mla_common::warp_uniform): its descriptors are then built on the uniform datapath.
// kPollSlabs: poll the slab barriers (mla_common::poll_wait) instead of suspending in try_wait.
// Measured (H200, same call): the seesaw kernel x1.0075 on h_q 128 cells, the e4m3-MMA kernel
// x0.984 (there the polling warps take issue slots from the other warpgroup's work).
template <typename SmemLayoutQ, typename SmemLayoutK, bool kPollSlabs = false, typename Mma, typename ThrMma,
          typename TensorS, typename T>
__device__ __forceinline__ void issue_qk_slabs(Mma& mma, const ThrMma& thr, TensorS& tSrS, T* q_smem, T* k_smem,
                                               const uint64_t* kv_full, uint32_t phase, int first_slab, int end_slab) {
  using namespace cute;
  Tensor tSrQ = thr.partition_fragment_A(make_tensor(make_smem_ptr(q_smem), SmemLayoutQ{}));
  Tensor tSrK = thr.partition_fragment_B(make_tensor(make_smem_ptr(k_smem), SmemLayoutK{}));
  constexpr int kStepsPerSlab = int(decltype(size<2>(tSrQ))::value) / kSlabs;
#pragma unroll
  for (int slab = first_slab; slab < end_slab; ++slab) {
    if constexpr (kPollSlabs) {
      mla_common::poll_wait(&kv_full[slab], phase);
    } else {
      cutlass::arch::ClusterBarrier::wait(&kv_full[slab], phase);
    }
    warpgroup_arrive();
#pragma unroll
    for (int k = slab * kStepsPerSlab; k < (slab + 1) * kStepsPerSlab; ++k) {
      gemm(mma, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  }
}

// O[:, this warpgroup's columns] = O * rescale + P V, no PV of the warpgroup in flight: the
// rescale is skipped while every factor of the warp is 1 (the running max settled: 128 multiplies
// saved), then one commit group of PV WGMMAs with P (A) and V (B) from shared memory. Element e of
// the accumulator is in row r0 + 8 ((e >> 1) & 1).
template <typename SmemLayoutP, typename SmemLayoutV, typename Mma, typename ThrMma, typename TensorO, typename T>
__device__ __forceinline__ void rescale_and_issue_pv(Mma& mma, const ThrMma& thr, TensorO& tOrO, const float (&rescale)[2],
                                                     T* p_smem, T* v_smem) {
  using namespace cute;
  if (__any_sync(0xffffffff, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
    for (int e = 0; e < int(size(tOrO)); ++e) tOrO(e) *= rescale[(e >> 1) & 1];
  }
  Tensor tOrP = thr.partition_fragment_A(make_tensor(make_smem_ptr(p_smem), SmemLayoutP{}));
  Tensor tOrV = thr.partition_fragment_B(make_tensor(make_smem_ptr(v_smem), SmemLayoutV{}));
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < size<2>(tOrP); ++k) gemm(mma, tOrP(_, _, k), tOrV(_, _, k), tOrO);
  warpgroup_commit_batch();
}

// Row max of a 64 x 64 block of raw scores (element e: row r0 + 8 ((e >> 1) & 1), key key_of(e)),
// in log2 units: times the row's score scale, which is > 0 and so commutes with the max. Keys past
// the row's last visible key become -inf in S (a select, so the stale, even NaN, scores of keys never
// loaded vanish); a block no row masks (`full_block`: all but the last one or two of a request)
// skips the compare and select. S itself stays unscaled: the caller's P = exp2(S scale - base) is
// one FFMA and an EX2 per score (h_q 128, seesaw kernel: x1.014, up to x1.037 at b128 L16384).
template <typename TensorS, typename KeyOf>
__device__ __forceinline__ void block_max_of_scores(TensorS& tSrS, KeyOf&& key_of, const int (&last_key)[2],
                                                    bool full_block, const float (&scale)[2], float (&block_max)[2]) {
  static_assert(int(decltype(cute::size(tSrS))::value) == 32, "a 64 x 64 accumulator fragment");
  block_max[0] = block_max[1] = -INFINITY;
  if (full_block) {
    // Four chains per row of 4 elements, then a tree: 6 dependent FMNMX on the softmax's path
    // instead of 16 (the compiler keeps a chain of fmaxf in order).
    float chain[2][4];
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      float& c = chain[(e >> 1) & 1][(e >> 2) & 3];
      c = (e < 16 && (e & 1) == 0) ? tSrS(e) : fmaxf(c, tSrS(e));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) block_max[i] = fmaxf(fmaxf(chain[i][0], chain[i][1]), fmaxf(chain[i][2], chain[i][3]));
  } else {
#pragma unroll
    for (int e = 0; e < int(cute::size(tSrS)); ++e) {
      const int i = (e >> 1) & 1;
      const float s = key_of(e) <= last_key[i] ? tSrS(e) : -INFINITY;
      tSrS(e) = s;
      block_max[i] = fmaxf(block_max[i], s);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 1));
    block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 2));
    block_max[i] *= scale[i];
  }
}

// True when block `blk` holds no key past any row's last visible key (lowest_last_key: that of the
// request's first query token, which sees the fewest keys).
__device__ __forceinline__ bool is_full_block(int blk, int lowest_last_key) {
  return (blk + 1) * kBlockN - 1 <= lowest_last_key;
}

// The running row max (log2 units) after a block whose row max is block_max: it moves only when the
// block's max exceeds it by more than `slack` (FlashAttention-4's conditional rescale). P =
// exp2(S - running max) then stays below 2^slack, and while the max holds the factor that rescales
// O and the denominator is exactly 1, so the 128 multiplies per thread are skipped; with the exact
// max they ran on about 40 % of h_q 128 blocks (random data). kMaxSlack = 8: P <= 256, exact range in
// bf16/fp16, far from fp32 overflow in the sums. 0 is the exact max (P quantised to e4m3 after a
// fixed scale needs P <= 1).
constexpr float kMaxSlack = 8.f;
__device__ __forceinline__ float next_running_max(float running, float block_max, float slack) {
  return block_max > running + slack ? block_max : running;
}

// The block owner's online-softmax step over its 64 x 64 raw scores (the 64-row kernels,
// decode_kernel.cuh and fp8mma_kernel.cuh): the block max as above (tScS: the elements' (row, key)
// coordinates in the block), then the running max (next_running_max, `max_slack`) and this
// warpgroup's denominator move to it. Returns per row the base that P = exp2(S score_scale - base)
// subtracts (0 for a fully masked row, keeping exp2 finite) and the factor that rescales O.
template <typename TensorS, typename TensorC>
__device__ __forceinline__ void owner_softmax_step(TensorS& tSrS, const TensorC& tScS, int key0, const int (&last_key)[2],
                                                   bool full_block, const float (&score_scale)[2], float max_slack,
                                                   float (&row_max)[2], float (&row_sum)[2], float (&base)[2],
                                                   float (&rescale)[2]) {
  float block_max[2];
  block_max_of_scores(tSrS, [&](int e) { return key0 + int(cute::get<1>(tScS(e))); }, last_key, full_block,
                      score_scale, block_max);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float new_max = next_running_max(row_max[i], block_max[i], max_slack);
    base[i] = new_max == -INFINITY ? 0.f : new_max;
    rescale[i] = exp2f(row_max[i] - base[i]);
    row_max[i] = new_max;
    row_sum[i] *= rescale[i];
  }
}

// The non-owner's side of that step: it adopts the owner's new running max of rows r0 and r0 + 8
// (shared_max, written before the P hand-off).
__device__ __forceinline__ void adopt_row_max(const float* shared_max, int r0, float (&row_max)[2], float (&row_sum)[2],
                                              float (&rescale)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float new_max = shared_max[r0 + 8 * i];
    rescale[i] = exp2f(row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
    row_max[i] = new_max;
    row_sum[i] *= rescale[i];
  }
}

// Sum over the 4 lanes of a quad (the threads that share a row of an accumulator).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 1);
  return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// The denominators of rows r0 and r0 + 8 over both math warpgroups' blocks, through shared memory
// (row_sums[warpgroup][row]); barrier kBarrier (both warpgroups) separates the writes from the reads.
template <int kBarrier>
__device__ __forceinline__ void total_row_sums(float (&row_sums)[2][kBlockM], int warpgroup, int r0,
                                               const float (&row_sum)[2], float (&sums)[2]) {
  const float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  __syncwarp();  // the quad's other lanes read row_sums in the previous epilogue
  if (threadIdx.x % 4 == 0) {
    row_sums[warpgroup][r0] = total[0];
    row_sums[warpgroup][r0 + 8] = total[1];
  }
  mla_common::named_barrier_sync<kBarrier, 256>();
#pragma unroll
  for (int i = 0; i < 2; ++i) sums[i] = row_sums[0][r0 + 8 * i] + row_sums[1][r0 + 8 * i];
}

// Where the rows of a finished 64-row output tile go: the final output of the request, or a partial
// (rows in q's dtype + fp32 LSE) for combine_kernel.cuh when the request is split.
struct OutputTile {
  const DecodeParams& p;
  Segment seg;  // by value: a reference to the caller's local put it on the stack
  int m_block;
  bool is_partial;
  int slot;  // workspace slot of the partial

  __device__ static OutputTile of(const DecodeParams& p, const Segment& seg, int m_block) {
    return {p, seg, m_block, p.req_splits[2 * seg.b] > 1, p.req_splits[2 * seg.b + 1] + seg.split};
  }
  __device__ bool has_row(int r) const { return m_block * kBlockM + r < seg.seqlen_q * p.num_heads_q; }
  __device__ int64_t partial_index(int r) const { return (int64_t(slot) * p.num_q_tiles + m_block) * kBlockM + r; }
  // Row r, from column `col` on: a partial row or a final row of out.
  template <typename Element>
  __device__ Element* row_ptr(int r, int col) const {
    if (is_partial) return static_cast<Element*>(p.partial_out) + partial_index(r) * kHeadDimV + col;
    const int row = m_block * kBlockM + r, t = row / p.num_heads_q, h = row % p.num_heads_q;
    return static_cast<Element*>(p.out) + seg.b * p.out_batch_stride + (seg.first_token + t) * p.out_token_stride +
           h * p.out_head_stride + col;
  }
  // 1 / denominator (times out_scale, an fp8 cache's k_scale) of a row with running max row_max (log2
  // units) and denominator total; writes the row's LSE (natural log; +inf final or -inf partial for a
  // row with no visible key) when write_lse.
  __device__ float finish_row(int r, float row_max, float total, float out_scale, bool write_lse) const {
    const bool empty = total == 0.f;  // no visible key in this split
    if (write_lse && has_row(r)) {
      const float lse = empty ? (is_partial ? -INFINITY : INFINITY) : (row_max + __log2f(total)) * float(M_LN2);
      if (is_partial) {
        p.partial_lse[partial_index(r)] = lse;
      } else {
        const int row = m_block * kBlockM + r, t = row / p.num_heads_q, h = row % p.num_heads_q;
        p.lse[seg.b * p.lse_batch_stride + (seg.first_token + t) * p.lse_token_stride + h * p.lse_head_stride] = lse;
      }
    }
    return empty ? 0.f : out_scale / total;
  }
};

// The output of a segment without key blocks (a request with no keys): zero rows, LSE +inf. Such a
// request is never split. By all 256 math threads, 16-byte stores.
template <typename Element>
__device__ __forceinline__ void store_empty_output_tile(const DecodeParams& p, const Segment& seg, int m_block) {
  const OutputTile tile = OutputTile::of(p, seg, m_block);
  constexpr int kChunksPerRow = kHeadDimV * int(sizeof(Element)) / 16;
  // From an opaque thread index: otherwise derived at the segment's start and spilled across its blocks.
  for (int i = mla_common::opaque(int(threadIdx.x)); i < kBlockM * kChunksPerRow; i += 256) {
    const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
    if (!tile.has_row(r)) continue;
    if (chunk == 0) tile.finish_row(r, -INFINITY, 0.f, 1.f, /*write_lse=*/true);
    reinterpret_cast<uint4*>(tile.row_ptr<Element>(r, 0))[chunk] = make_uint4(0, 0, 0, 0);
  }
}

// Output staging: a warpgroup's 64 x 256 output columns (16-bit: 512 bytes of a row) pass through
// shared memory, rows kStagingPitch bytes apart (padded so that the fragment writes are free of bank
// conflicts).
constexpr int kStagingPitch = 512 + 16;                    // bytes
constexpr int kStagingBytes = kBlockM * kStagingPitch;     // per warpgroup

// Fragments -> `staging`, then the warpgroup copies the rows out, a warp per row and 16 bytes per
// lane (coalesced stores; one 512-byte bulk copy per row instead was up to 1 us slower at batch 1).
template <typename Element, typename TensorO, typename Sync>
__device__ __forceinline__ void stage_output_columns(const OutputTile& tile, uint32_t staging, int tid_in_wg, int r0,
                                                     const float (&inv_sum)[2], int col_base, const TensorO& tOrO,
                                                     Sync&& sync) {
  static_assert(sizeof(Element) == 2, "rows of 256 16-bit values: one 512-byte round");
  constexpr int kPairs = int(decltype(cute::size(tOrO))::value) / 2;
  // Element e is in column 8 (e >> 2) + 2 (lane % 4) + (e & 1) of the 256.
  const uint32_t thread_addr = staging + r0 * kStagingPitch + (tid_in_wg % 4) * 4;
  const int lane = tid_in_wg % 32, warp = tid_in_wg / 32;
#pragma unroll
  for (int pair = 0; pair < kPairs; ++pair) {
    const int e = 2 * pair, i = (e >> 1) & 1;
    const uint32_t addr = thread_addr + i * 8 * kStagingPitch + 16 * (e >> 2);
    mla_common::st_shared_4(addr, pack_pair<Element>(tOrO(e) * inv_sum[i], tOrO(e + 1) * inv_sum[i]));
  }
  sync();
  // Unrolled 4 deep: fully unrolled, the 16 row addresses were computed up front and spilled.
#pragma unroll 4
  for (int r = warp; r < kBlockM; r += 4) {
    if (!tile.has_row(r)) break;  // the tile's rows are a prefix
    const uint4 v = mla_common::ld_shared_16(staging + r * kStagingPitch + lane * 16);
    reinterpret_cast<uint4*>(tile.row_ptr<Element>(r, col_base))[lane] = v;
  }
}

// Normalises and stores a finished 64-row output tile held by a warpgroup: its 256 output columns
// [col_base, col_base + 256), this thread's rows r0 and r0 + 8 (element e of tOrO is in row
// r0 + 8 ((e >> 1) & 1), column col_base + 8 (e >> 2) + 2 (lane % 4) + (e & 1)), with running max
// row_max (log2 units) and denominator row_total; out_scale multiplies every value (an fp8 cache's
// k_scale). The final rows of the request, or partial rows + LSE for combine_kernel.cuh when the
// request is split, both in q's dtype. The LSE (natural log; +inf final or -inf partial for a row
// with no visible key) is written by the threads with write_lse and lane % 4 == 0. Through shared
// memory (`staging`, kStagingBytes the warpgroup owns): stores straight from the accumulator touch 8
// rows per instruction and took ~6 us per tile. sync() is a barrier over the warpgroup. On return
// other threads may still read `staging`: synchronise before reusing it.
template <typename Element, typename TensorO, typename Sync>
__device__ __forceinline__ void store_output_columns_staged(const DecodeParams& p, const Segment& seg, int m_block,
                                                            int r0, const float (&row_max)[2],
                                                            const float (&row_total)[2], float out_scale,
                                                            bool write_lse, uint32_t staging, int tid_in_wg,
                                                            int col_base, const TensorO& tOrO, Sync&& sync) {
  const OutputTile tile = OutputTile::of(p, seg, m_block);
  float inv_sum[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    inv_sum[i] = tile.finish_row(r0 + 8 * i, row_max[i], row_total[i], out_scale, write_lse && threadIdx.x % 4 == 0);
  }
  stage_output_columns<Element>(tile, staging, tid_in_wg, r0, inv_sum, col_base, tOrO, sync);
}

}  // namespace mla_decode
