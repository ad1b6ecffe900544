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
//         (kv_producer.cuh). FP8 caches: each row lands whole by bulk copy in the upper part of the
//         stage, one kv_full per stage (row_copies.cuh; ds_mla_fp8, DeepSeek-V3.2's 656-byte rows,
//         with its scales and rope).
//   WG 0,1 math: KV blocks alternate between them (FP8: both first convert a block's tile in place
//         to 16 bit, Fp8SlabConverter). The owner of a block computes S = Q K^T for all 64 keys, the
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
#include "mla_decode/rows64/traits.h"
#include "mla_decode/shared/causal_mask.cuh"
#include "mla_decode/shared/epilogue.cuh"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/launch.cuh"
#include "mla_decode/shared/mma_issue.cuh"
#include "mla_decode/shared/online_softmax.cuh"
#include "mla_decode/shared/packed_pair.cuh"
#include "mla_decode/shared/q_load.cuh"
#include "mla_decode/shared/row_copies.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {
using namespace cute;
using mla_common::named_barrier_sync;

// fp8 cache: both math warpgroups convert a block's staged e4m3 rows to the fp16 tile the WGMMAs
// read, in two slab groups; the owner issues the first group's QK^T before converting the second (the
// WGMMAs run while it converts). Math thread t converts 16-byte chunk t % 4 of row t / 4 in every slab
// (columns 16 (t % 4) ... + 15 of the slab); rows the producer did not copy (key_copied: past the
// sequence end, or skipped slots) become zeros, so no tail zeroing is needed. e4m3 values are exact in fp16; a
// per-tensor scale is applied to the scores and the output. ds_mla_fp8: each 128-column group of a
// row is multiplied by its power-of-two scale in fp16, exact for the scales 2^-13 (the quantiser's
// smallest) to 2^7 (|values| up to 57344; larger overflow fp16), and the bf16 rope slab becomes fp16
// in place (exact within fp16's range).
//
// In place: the 16-bit slabs below the staging first ({0-3}; ds_mla_fp8 {0-2}), then every other
// staged byte is read before the rest are written ({4-8}; ds_mla_fp8 {3-7, rope}). A barrier over both
// warpgroups follows each group, which also makes the group visible to the WGMMAs.
template <typename Traits>
struct Fp8SlabConverter {
  static_assert(std::is_same_v<typename Traits::MmaElement, cutlass::half_t>, "e4m3 converts to the fp16 tile");
  static_assert(kBlockN * 4 == 2 * 128, "four math threads per key row");
  static constexpr int k16BitSlabBytes = Traits::k16BitSlabBytes;
  static_assert(k16BitSlabBytes == 8192, "a 16-bit slab is 8 KB");

  // Byte offset, within any 16-bit slab ([64 rows][128 B], 128-byte swizzle: 16-byte chunk c of row r
  // at c ^ (r % 8)), of the first of the two 16-byte chunks this thread writes (key row tid / 4,
  // columns 16 (tid % 4) ... + 15); the second is at this offset ^ 16. The same in every slab, so a
  // slab's two stores are these offsets plus an immediate: computed once per tile, not per slab.
  __device__ __forceinline__ static uint32_t write_offset(int tid) {
    const int row = tid / 4, chunk = (tid % 4) * 2;
    return row * 128 + ((chunk ^ (row % 8)) << 4);
  }
  // Writes this thread's chunk, converted (times `scale` with kScaled), to the 16-bit slab `slab` of
  // the tile at tile_addr (zeros for a row not copied: the e4m3 bytes are zeroed before the
  // conversion, 4 selects, not 8).
  template <bool kScaled = false>
  __device__ __forceinline__ static void write(uint32_t tile_addr, uint32_t offset, int slab, bool zero, uint4 in,
                                               __half2 scale = {}) {
    const uint32_t slab_addr = tile_addr + slab * k16BitSlabBytes;
    if (zero) in = make_uint4(0, 0, 0, 0);
    const uint32_t words[4] = {in.x, in.y, in.z, in.w};
    uint32_t out[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) e4m3x4_to_f16x2(words[w], out[2 * w], out[2 * w + 1]);
    if constexpr (kScaled) {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = hmul2_bits(out[i], scale);
    }
    mla_common::st_shared_16(slab_addr + offset, make_uint4(out[0], out[1], out[2], out[3]));
    mla_common::st_shared_16(slab_addr + (offset ^ 16), make_uint4(out[4], out[5], out[6], out[7]));
  }
  // ds_mla_fp8: this thread's 16 rope values, bf16 -> fp16, from where they landed (unswizzled: bytes
  // 32 (tid % 4) ... + 31 of the row) to where the WGMMAs read them (swizzled: `offset`, `offset` ^ 16).
  // Only the row's 4 threads, lanes of one warp, read and write that row.
  __device__ __forceinline__ static void convert_rope(uint32_t tile_addr, uint32_t offset, bool zero, int tid) {
    const uint32_t slab_addr = tile_addr + Traits::kDsRopeSlabOffset;
    const uint32_t landed = slab_addr + (tid / 4) * 128 + (tid % 4) * 32;
    uint4 in[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) in[i] = zero ? make_uint4(0, 0, 0, 0) : mla_common::ld_shared_16(landed + 16 * i);
    __syncwarp();  // the row's other threads have read their bytes before this one writes over them
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mla_common::st_shared_16(slab_addr + (offset ^ (16 * i)),
                               make_uint4(bf16x2_to_f16x2(in[i].x), bf16x2_to_f16x2(in[i].y), bf16x2_to_f16x2(in[i].z),
                                          bf16x2_to_f16x2(in[i].w)));
    }
  }
  // Converts the tile of `stage` once its rows have landed, calling on_group(first_slab, end_slab) after
  // each group is visible to WGMMA. A group's slabs are all read, then all written, so that their loads
  // are in flight together.
  template <typename OnGroup>
  __device__ __forceinline__ static void convert_tile(typename Traits::SharedStorage& ss, int stage, uint32_t phase,
                                                          int tid, OnGroup&& on_group) {
    auto publish = [&](int first_slab, int end_slab) {
      cutlass::arch::fence_view_async_shared();
      mla_common::named_barrier_sync<int(Rows64Barrier::kFp8Converted), 256>();
      on_group(first_slab, end_slab);
    };
    // The tile's base from a warp-uniform stage, this thread's offset in a slab, its row's zeroing.
    const uint32_t tile_addr = mla_common::smem_addr(ss.k[mla_common::warp_uniform(stage)]);
    const uint32_t offset = write_offset(tid);
    uint4 staged[4];
    constexpr bool kScaled = Traits::kDsMlaFp8;
    cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][0], phase);  // the whole block, and key_copied
    const uint64_t copied = ss.key_copied[stage];
    const bool zero = !((copied >> (tid / 4)) & 1);
    const uint32_t staged_row = tile_addr + Traits::kRowStagingOffset + (tid / 4) * Traits::kRowStagingStride;
    auto read_slab = [&](int slab) { return mla_common::ld_shared_16(staged_row + slab * kTmaColumns + (tid % 4) * 16); };
    // ds_mla_fp8: the row's scales, zero for a row not copied (stale ones could be inf or NaN).
    __half2 scales[4] = {};
    if constexpr (kScaled) {
      const uint4 raw = zero ? make_uint4(0, 0, 0, 0) : mla_common::ld_shared_16(staged_row + mla_common::kDsScaleOffset);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) scales[i] = __float2half2_rn(__uint_as_float(words[i]));
      static_assert(mla_common::kDsTile == 2 * kTmaColumns, "one scale per two slabs");
    }
    auto scale_of = [&](int slab) { return scales[(slab / 2) % 4]; };
    constexpr int kFirst = Traits::kSlabsBelowStaging, kRest = Traits::kStagedSlabs - kFirst;
    static_assert(kFirst <= 4 && kRest == 5, "the registers below");
#pragma unroll
    for (int slab = 0; slab < kFirst; ++slab) staged[slab] = read_slab(slab);
#pragma unroll
    for (int slab = 0; slab < kFirst; ++slab) write<kScaled>(tile_addr, offset, slab, zero, staged[slab], scale_of(slab));
    uint4 rest[kRest];
#pragma unroll
    for (int i = 0; i < kRest; ++i) rest[i] = read_slab(kFirst + i);
    publish(0, kFirst);  // also: every thread has read the staging, which the slabs above overwrite
#pragma unroll
    for (int i = 0; i < kRest; ++i) write<kScaled>(tile_addr, offset, kFirst + i, zero, rest[i], scale_of(kFirst + i));
    if constexpr (Traits::kDsMlaFp8) convert_rope(tile_addr, offset, zero, tid);
    publish(kFirst, kSlabs);
  }
};

// The math warpgroups. KV blocks of a segment alternate between them: the owner of a block
// computes its full S = Q K^T (64 x 64), the online-softmax step and P, and publishes P and the new
// row max in shared memory; both warpgroups then rescale their half of O and add P V for their 256
// columns. (The softmax is not overlapped with MMAs yet: docs/decode.md, "Limits".)
// kGather: the producer gathers the rows by cp.async (shared/kv_producer.cuh: GatheredRows); gathered:
// DecodeTma::gather, the same fact as a run-time value (see release_early).
template <typename Traits, bool kGather>
__device__ void consume_kv_tiles(const DecodeParams& p, bool gathered, typename Traits::SharedStorage& ss,
                                 const PartRange& range, int m_block) {
  using Element = typename Traits::Element;
  using MmaElement = typename Traits::MmaElement;
  // Row-staged forms: their row copies bound the kernel at every head count, so each warpgroup hands the
  // previous block's stage back as soon as its PV of it completes, before it waits for the next
  // block: that block's loads are then in flight while the current one's still land (a 16-bit cache
  // measured no faster so, and slower at h_q 64).
  constexpr bool kReleaseFirst = Traits::kRowStaged;
  const int tid = threadIdx.x;          // 0..255 over the two math warpgroups
  const int warpgroup = mla_common::warp_uniform(tid / 128);
  const int tid_in_wg = tid % 128;
  static_assert(2 * kStagingBytes <= int(sizeof(MmaElement)) * cosize_v<typename Traits::SmemLayoutK>,
                "the epilogue stages both warpgroups' output in one K stage");

  typename Traits::TiledMmaQK mma_qk;   // one warpgroup
  typename Traits::TiledMmaPV mma_pv;   // two warpgroups, split along the 512 output columns
  auto thr_qk = mma_qk.get_thread_slice(tid_in_wg);
  auto thr_pv = mma_pv.get_thread_slice(tid);

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
  auto release_stage = [&](int stage) {
    if (kEveryThreadReleases || tid_in_wg == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[stage]);
  };

  // ---- kScaledQ (bf16 q, fp8 cache): the tile's query rows are rescaled in place from bf16 to fp16
  // times fp16_row_scale of the row, the factor recorded in ss.q_scale. Eight adjacent lanes share a
  // row, 32 rows a pass, and only passes that hold query rows run (the rest of the tile was zero-filled:
  // the same bits in fp16, factor 1). Each thread holds its 9 chunks of the row in registers between the
  // max (abs_max_bits) and the conversion, so that its loads are in flight together.
  auto scale_q_rows = [&](int query_rows) {
    constexpr int kThreadsPerRow = 8, kRowsPerPass = 256 / kThreadsPerRow, kChunksPerThread = kHeadDimK / 8 / kThreadsPerRow;
    static_assert(kTmaColumns == 8 * kThreadsPerRow, "16-byte chunk (thread % 8) of a row in each 64-column slab");
    constexpr int kSlabBytes = kBlockM * kTmaColumns * int(sizeof(MmaElement));
    named_barrier_sync<int(Rows64Barrier::kQLanded), 256>();  // every thread's cp.async chunks have landed
    const int thread = threadIdx.x, chunk = thread % kThreadsPerRow;
#pragma unroll 1
    for (int r = thread / kThreadsPerRow; r < kBlockM; r += kRowsPerPass) {
      if (r - thread / kThreadsPerRow >= query_rows) {  // warp-uniform: the pass holds no query row
        if (chunk == 0) ss.q_scale[r] = 1.f;
        continue;
      }
      // Chunk `chunk` of the row in slab i (128-byte swizzle: 16-byte chunk c of row r at c ^ (r % 8)).
      const uint32_t row_addr = mla_common::smem_addr(ss.q) + r * 128 + ((chunk ^ (r % 8)) << 4);
      uint4 raw[kChunksPerThread];
      uint32_t max_bits = 0;
#pragma unroll
      for (int i = 0; i < kChunksPerThread; ++i) {
        raw[i] = mla_common::ld_shared_16(row_addr + i * kSlabBytes);
        max_bits = abs_max_bits(max_bits, raw[i]);
      }
      for (int x = 1; x < kThreadsPerRow; x *= 2) max_bits = __vmaxu2(max_bits, __shfl_xor_sync(0xffffffff, max_bits, x));
      const float scale = fp16_row_scale(abs_max_value<Element>(max_bits));
      if (chunk == 0) ss.q_scale[r] = scale;
#pragma unroll
      for (int i = 0; i < kChunksPerThread; ++i) {
        mla_common::st_shared_16(row_addr + i * kSlabBytes,
                                 make_uint4(scaled_f16x2(raw[i].x, scale), scaled_f16x2(raw[i].y, scale),
                                            scaled_f16x2(raw[i].z, scale), scaled_f16x2(raw[i].w, scale)));
      }
    }
  };

  int iteration = 0;
  Segment seg;
  bool have_segment = range.next_segment(p, range.begin_b, m_block, seg);
  if (have_segment) issue_q_tile_load<Element, typename Traits::SmemLayoutQ>(p, seg, ss.q);
  while (have_segment) {
    const int row_base = m_block * kBlockM;
    mla_common::cp_async_wait_all();
    if constexpr (Traits::kScaledQ) scale_q_rows(seg.seqlen_q * p.num_heads_q - row_base);
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
        for (int slab = 0; slab < kSlabs; ++slab) cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
        constexpr int kChunks = kHeadDimK / 8;
        for (int i = tid; i < (kBlockN - valid_keys) * kChunks; i += 256) {
          mla_common::st_shared_zero16(&sK(valid_keys + i / kChunks, i % kChunks * 8));
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync<int(Rows64Barrier::kTailZeroed), 256>();
      }
      if (owner == warpgroup) {
        // -- S = Q K^T, one WGMMA commit group per slab group, each issued as soon as its slabs
        // have landed (16-bit cache) or been converted (fp8); a barrier wait inside a group makes
        // the compiler serialize the MMAs.
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
        // released it before its P V). Where the CTA's loads bound it (one q-tile; rows gathered by
        // cp.async, whose refill outlasts a block's MMAs), release right after the first QK group, so
        // that the next block's load starts while the rest of QK^T runs (TMA boxes with two q-tiles:
        // measured slower so; fp8: its first converted group). kReleaseFirst: before this block's
        // slabs are waited for. Known true at compile time, the early release made ptxas serialise
        // every WGMMA (C7514), hence the run-time flag.
        const bool release_early = !kReleaseFirst && ((kGather && gathered) || p.num_q_tiles == 1);
        auto release_previous_stage = [&] {
          if (blk > seg.blk_lo) release_stage((iteration - 1) % kStages);
        };
        if constexpr (kReleaseFirst) {
          warpgroup_wait<0>();  // this WG's PV of the previous block
          release_previous_stage();
        }
        if constexpr (Traits::kFp8Kv) {
          Fp8SlabConverter<Traits>::convert_tile(ss, stage, phase, tid, [&](int first_slab, int end_slab) {
            issue_qk(first_slab, end_slab);
            if (first_slab == 0 && release_early) {
              warpgroup_wait<1>();  // the PV group issued before this first QK group
              release_previous_stage();
            }
          });
        } else {
#pragma unroll
          for (int slab = 0; slab < kSlabs; ++slab) {
            cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
            issue_qk(slab, slab + 1);
            if (slab == 0 && release_early) {
              warpgroup_wait<1>();  // the PV group issued before this first QK group
              release_previous_stage();
            }
          }
        }
        warpgroup_wait<0>();  // S, and this WG's PV of the previous block
        if (!kReleaseFirst && !release_early) release_previous_stage();
        warpgroup_fence_operand(tSrS);

        // -- Online softmax in log2 units over the 64 keys of the block.
        float base[2];
        // fp8: the keys the producer copied; the others are masked. Read here, not kept from the
        // conversion: held across the QK^T issue, the mask made ptxas spill.
        const uint64_t copied = Traits::kRowStaged ? ss.key_copied[stage] : ~0ull;
        owner_softmax_step(tSrS, tScS, blk * kBlockN, last_key, is_full_block(blk, lowest_last_key), score_scale,
                           kMaxSlack, row_max, row_sum, base, rescale, copied);
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
        // fp8: help convert the block before kPFree, which the owner reaches only after its QK^T
        // (while this WG's previous PV runs; kReleaseFirst: after it, the stage released).
        auto release_previous_stage = [&] {
          warpgroup_wait<0>();  // this WG's PV of the previous block: it no longer reads P
          if (blk > seg.blk_lo) release_stage((iteration - 1) % kStages);
        };
        if constexpr (kReleaseFirst) release_previous_stage();
        if constexpr (Traits::kFp8Kv) {
          Fp8SlabConverter<Traits>::convert_tile(ss, stage, phase, tid, [](int, int) {});
        }
        if constexpr (!kReleaseFirst) release_previous_stage();
        if (blk > seg.blk_lo) named_barrier_sync<int(Rows64Barrier::kPFree0), 256>(owner);
        // V of this block is observed through the owner's hand-off, and directly here (16-bit
        // cache; an fp8 tile was converted above).
        if constexpr (!Traits::kFp8Kv) {
          for (int slab = 0; slab < kHeadDimV / kTmaColumns; ++slab) {
            cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
          }
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
    // the Q tile is free: the next segment's Q load overlaps this epilogue.
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
      // The stage's next bytes come by TMA or bulk copy: the async proxy, ordered after these stores.
      cutlass::arch::fence_view_async_shared();
      warpgroup_sync();
      release_stage(last_stage);
    } else {  // no key block was loaded: no stage to stage through
      store_empty_output_tile<Element>(p, seg, m_block);
    }
    seg = next;
    have_segment = have_next;
  }
}

// The kernel's policy for the shared shell (shared/kernel_shell.cuh); the row-staged forms have their own
// producer (shared/row_copies.cuh).
template <typename Traits>
struct Rows64Kernel : KvRingKernel<Traits> {
  template <bool kGather>
  __device__ __forceinline__ static void init_barriers(typename Traits::SharedStorage& ss) {
    if constexpr (Traits::kRowStaged) init_row_ring<Traits>(ss, kNumMathWarpgroups * kStageReleaseArrivals);
    else KvRingKernel<Traits>::template init_barriers<kGather>(ss);
  }
  template <bool kGather>
  __device__ __forceinline__ static void produce(const DecodeParams& p, const DecodeTma& tma,
                                                 typename Traits::SharedStorage& ss, const PartRange& range, int warp) {
    if constexpr (Traits::kRowStaged) produce_staged_rows<Traits>(p, tma, ss, range, warp);
    else KvRingKernel<Traits>::template produce<kGather>(p, tma, ss, range, warp);
  }
  template <bool kGather>
  __device__ __forceinline__ static void consume(const DecodeParams& p, const DecodeTma& tma,
                                                 typename Traits::SharedStorage& ss, const PartRange& range, int) {
    consume_kv_tiles<Traits, kGather>(p, tma.gather, ss, range, blockIdx.x);
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
