// Split-KV paged MLA decode for few query rows (<= 32 per request), sm_90a: an fp8 (e4m3) or a
// 16-bit cache.
//
// Same grid, schedule, producer and partials as rows64/kernel.cuh (one q-tile: blockIdx.x = 0), but
// the MMAs are transposed, so that N = kRows instead of 64 padded rows (2-4x less MMA work, and a Q
// tile of 18-36 KB instead of 72 KB):
//   S^T [64 keys, kRows]  = K [64 keys, 576] . Q^T     A = K, B = Q (smem)
//   O^T [512, kRows]     += V^T [512, 64 keys] . P^T   A = V^T, B = P^T (smem)
// 16-bit cache: A is the stage itself (V^T seen MN-major); two 72 KB stages. fp8 cache: the fp8 tile
// never needs a 16-bit copy in shared memory: each math thread loads its A fragments from it (LDS
// for K, ldmatrix.trans for V^T), converts them to fp16 in registers (exact; the MMAs run in fp16
// for bf16 q too, see narrow/traits.h), and issues register-A WGMMAs; shared memory holds 5 fp8 stages.
// Gathered rows at 16 rows (fp8 and 16-bit; and every ds_mla_fp8 call) arrive whole by bulk copy into
// staging rows (row-staged, narrow/traits.h), which the math threads load the same register-A
// fragments from (a 16-bit row's as they are).
//
// Warpgroup roles (W = Traits::kMathWarpgroups, 2 or 3 (16 rows, batch > 1); (W + 1) x 128 threads):
//   WG W  producer: its 4 warps issue the TMA copies (shared/kv_producer.cuh), slabs w, w + 4, w + 8;
//         fp8 tiles by row groups (all nine slabs of 16 keys per copy, <= 4 per tile): warp 0.
//   WG 0..W-1 math: KV tiles go round-robin between them by global tile index, and each keeps its
//         own softmax state and full O^T [512, kRows]: no hand-off per tile. At the end of a request
//         the states are merged through shared memory (the Q buffer) into warpgroups 0 and 1, which
//         store half of the output dims each.
//
// Operand layouts of the fp8 path (64 x N x 16 WGMMA, thread = (warp w, lane = 4g + c)):
//   A (K): row 16w + g (+8), k = 2c, 2c + 1 (+8). A thread loads 16 contiguous bytes of a row per
//     slab, so logical k of the MMA is a permuted dim: within a slab, logical 16t + 2c + 8h + e is
//     dim 16c + 4t + 2h + e. Q is stored with the same permutation (q_column), so S is exact.
//   A (V^T): ldmatrix.trans of 8 keys x 16 dims gives a thread bytes (key 2c, dim 2g), (2c, 2g + 1),
//     (2c + 1, 2g), (2c + 1, 2g + 1): permuted to keys 2c, 2c + 1 of dims 2g and of 2g + 1.
//     Accumulator row 16w + g (+8) of m-tile m is dim 64m + 16w + 2g (+1), so the epilogue stores
//     adjacent dim pairs. Keys stay in order, so P^T needs no permutation.
//   C: row 16w + g (+8), column 8n + 2c (+1): a thread holds 2 keys x kRows / 4 query rows.
// ds_mla_fp8 (row-staged, narrow/traits.h): the same fragments from the staging rows (16 bytes of a
//   slab's 64-byte piece of the row; ldmatrix.trans rows = the keys' rows), converted pairs scaled by
//   their row's power-of-two scale in fp16 (HMUL2; exact for the scales 2^-13 to 2^7, as the 64-row
//   kernel's converter). At 16 rows K's pairs are not scaled: each 128-column group accumulates S^T in
//   an fp32 accumulator of its own, which the keys' scales multiply after the chain. The rope slab is
//   bf16: a thread loads its 16 dims (32 bytes) and converts them to fp16. V^T pairs hold two keys, so
//   their scales come as f16x2 pairs from a table that the warpgroup builds per tile (v_scales). Rows
//   not copied are zeroed and their keys masked.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/narrow/traits.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/epilogue.cuh"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/launch.cuh"
#include "mla_decode/shared/row_copies.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {
using namespace cute;
using mla_common::named_barrier_sync;

// Column of the permuted Q tile that holds dim d (even) of a query row; d + 1 follows it.
__device__ __forceinline__ int q_column(int d) {
  const int r = d % kTmaColumns;
  return d - r + ((r / 4) % 4) * 16 + (r / 16) * 2 + ((r / 2) % 2) * 8;
}

// kRowGroups: the fp8 TMA tiles arrive by 16-key row groups (Traits::kRowGroupTiles; not where the
// 32-row kernel gathers), one kv_full barrier per stage.
template <typename Traits, bool kRowGroups>
__device__ void consume_narrow_tiles(const DecodeParams& p, typename Traits::SharedStorage& ss,
                                     const PartRange& range, int warpgroup) {
  using Element = typename Traits::Element;
  using MmaElement = typename Traits::MmaElement;
  constexpr int kRows = Traits::kRows;
  constexpr int kCols = kRows / 4;  // query rows (C columns) per thread
  constexpr int kSteps = kTmaColumns / 16;  // k16 steps per slab (QK) and per 64-key tile (PV)
  constexpr int kMTiles = kHeadDimV / 64;
  constexpr int kMathWarpgroups = Traits::kMathWarpgroups, kMathThreads = Traits::kMathThreads;
  constexpr int kAheadK = Traits::kAheadK, kAheadV = Traits::kAheadV;
  constexpr bool kRowStaged = Traits::kRowStaged, kDs = Traits::kDsMlaFp8, kRegisterA = Traits::kRegisterA;
  constexpr bool k16BitRows = kRowStaged && !Traits::kFp8Kv;  // 16-bit rows, loaded as they are
  constexpr int kRowStride = Traits::kRowStride;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  mma_pv.accumulate_ = GMMA::ScaleOut::One;
  auto thr = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Traits::SmemLayoutQ{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.pt[warpgroup]), typename Traits::SmemLayoutPt{});
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockN>, Int<kRows>>{});    // (MMA, 1, 1)
  // ds_mla_fp8 at 16 rows: S^T of each 128-column group (two slabs) in its own accumulator, scaled by
  // the keys' group scales in fp32 after the chain (tSrS then takes the rope slab), so no K pair is
  // scaled. At 32 rows the four accumulators spilled (and ptxas serialised the WGMMAs): K pairs are
  // scaled in fp16 there, as V^T pairs.
  constexpr bool kGroupAccumulators = kDs && kRows == 16;
  decltype(tSrS) tSrS_group[kGroupAccumulators ? mla_common::kDsNumTiles : 1];
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kHeadDimV>, Int<kRows>>{});  // (MMA, 8, 1)
  // fp8: A operands, two slabs (QK) or two m-tiles (PV) deep: the next is converted while the WGMMAs
  // of the previous run. Register j of k-step t is element pair (2j, 2j + 1) of A(_, 0, t).
  Tensor tA = make_tensor<MmaElement>(Shape<Shape<_2, _2, _2>, _1, Int<2 * kSteps>>{});
  uint32_t* a_regs = reinterpret_cast<uint32_t*>(raw_pointer_cast(tA.data()));
  // Element e of a C fragment: key row 16w + g + 8 * ((e >> 1) & 1), column col_of(col_index(e)).
  auto col_index = [](int e) { return (e >> 2) * 2 + (e & 1); };
  auto col_of = [&](int j) { return 8 * (j / 2) + 2 * c + (j % 2); };
  // Immediate barrier ids under predicates: a register id would stay live across the tile loop.
  auto warpgroup_sync = [&] {
    constexpr int kId0 = int(NarrowBarrier::kWarpgroup0);
    if (warpgroup == 0) named_barrier_sync<kId0, 128>();
    else if (kMathWarpgroups == 2 || warpgroup == 1) named_barrier_sync<kId0 + 1, 128>();
    else named_barrier_sync<kId0 + 2, 128>();
  };

  // ---- Q [kRows, 576] into sQ (rows past the request are zero). The T threads of a row (lanes of
  // one warp) load its 16-byte chunks t, t + T, ... fp8: as fp16 into the permuted layout, a bf16
  // row scaled by fp16_row_scale, undone in the row's score scale (ss.score_scale).
  auto load_q = [&](const Segment& s) {
    // The first 256 math threads load it (a power of two per row, for the shuffles below).
    constexpr int kChunks = kHeadDimK / 8, kThreadsPerRow = 256 / kRows;
    constexpr int kChunksPerThread = (kChunks + kThreadsPerRow - 1) / kThreadsPerRow;
    if (threadIdx.x >= 256) return;
    // Opaque thread index: otherwise the row's addresses are hoisted out of the request loop and
    // held (spilled) across the whole tile loop. k_scale is read here, in flight with Q, and kept in
    // shared memory for the epilogue rather than in a register across the tile loop.
    const int thread = mla_common::opaque(int(threadIdx.x));
    const float k_scale = Traits::kFp8Kv && !kDs ? *mla_common::opaque(p.k_scale) : 1.f;
    const int row = thread / kThreadsPerRow, first = thread % kThreadsPerRow;
    const bool valid = row < s.seqlen_q * p.num_heads_q;
    const QueryRow r = QueryRow::of(p, valid ? row : 0);
    const auto q = QRow<Element>::at(p, s, r.token, r.head);
    uint4 chunk[kChunksPerThread];
    float row_max = 0.f;
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int d0 = (first + i * kThreadsPerRow) * 8;
      chunk[i] = make_uint4(0, 0, 0, 0);
      if (valid && d0 < kHeadDimK) chunk[i] = *reinterpret_cast<const uint4*>((d0 < kHeadDimV ? q.nope : q.pe) + d0);
      if constexpr (!std::is_same_v<Element, MmaElement>) {
        const Element* v = reinterpret_cast<const Element*>(&chunk[i]);
        for (int k = 0; k < 8; ++k) row_max = fmaxf(row_max, fabsf(float(v[k])));
      }
    }
    float scale = 1.f;
    if constexpr (!std::is_same_v<Element, MmaElement>) {
      for (int x = 1; x < kThreadsPerRow; x *= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffff, row_max, x));
      scale = fp16_row_scale(row_max);
    }
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int d0 = (first + i * kThreadsPerRow) * 8;
      if (d0 >= kHeadDimK) continue;
      if constexpr (!kRegisterA) {
        *reinterpret_cast<uint4*>(&sQ(row, d0)) = chunk[i];
        continue;
      }
      const uint32_t w[4] = {chunk[i].x, chunk[i].y, chunk[i].z, chunk[i].w};
      for (int k = 0; k < 4; ++k) {
        uint32_t pair = w[k];
        if constexpr (!std::is_same_v<Element, MmaElement>) pair = scaled_f16x2(w[k], scale);
        *reinterpret_cast<uint32_t*>(&sQ(row, q_column(d0 + 2 * k))) = pair;
      }
    }
    if (first == 0) {  // per-row softmax constants (read per tile: registers are scarce at kRows 32)
      ss.score_scale[row] = p.scale_log2 * k_scale / scale;
      ss.last_key[row] = p.causal ? min(s.seqlen_k - s.seqlen_q + r.token, s.seqlen_k - 1) : s.seqlen_k - 1;
      for (int w = 0; w < kMathWarpgroups; ++w) ss.run_max[w][row] = -INFINITY;
      if (row == 0) ss.k_scale = k_scale;
    }
  };

  int iteration = 0;
  Segment seg;
  for (int b = range.begin_b; range.next_segment(p, b, 0, seg); b = seg.b + 1) {
    load_q(seg);
    const int rows_in_request = seg.seqlen_q * p.num_heads_q;
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<int(NarrowBarrier::kQReady), kMathThreads>();

    float col_sum[kCols];  // this thread's share of each of its query rows' softmax sum
#pragma unroll
    for (int j = 0; j < kCols; ++j) col_sum[j] = 0.f;
    clear(tOrO);

    for (int blk = seg.blk_lo; blk < seg.blk_hi; ++blk, ++iteration) {
      if (iteration % kMathWarpgroups != warpgroup) continue;
      const int stage = iteration % Traits::kStages;
      const uint32_t phase = (iteration / Traits::kStages) & 1;
      // The warpgroups take tiles in turn, so where the stages do not divide among them the stage's
      // previous use is another's: until the producer has begun this fill, a parity wait below could
      // pass on that older phase.
      if constexpr (kRecordsStageFills<Traits>) wait_for_stage_fill<Traits>(ss, stage, iteration);
      uint8_t* tile = reinterpret_cast<uint8_t*>(ss.kv[stage]);
      const uint32_t tile_addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
      // -- Tail tile: zero the key rows past the sequence end (never loaded, or slots past L), so
      // that 0-probability keys cannot inject NaN/Inf through P V.
      const int valid_keys = max(seg.seqlen_k - blk * kBlockN, 0);
      if constexpr (kRowStaged) {
        // Row-staged: the block's rows landed at once; those not copied (past the sequence end, or
        // invalid slots) are zeroed, and their keys masked in the softmax.
        cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][0], phase);
        const uint64_t copied = ss.key_copied[stage];
        if (copied != ~0ull || kRacecheckBuild) {
          constexpr int kChunksPerRow = kRowStride / 16;
          // Opaque thread index, not unrolled: the loop's first addresses were hoisted out and spilled.
#pragma unroll 1
          for (int i = mla_common::opaque(tid); i < kBlockN * kChunksPerRow; i += 128) {
            const int row = i / kChunksPerRow;
            if (!((copied >> row) & 1)) {
              mla_common::st_shared_zero16(tile + Traits::staged_slot(row) * kRowStride + (i % kChunksPerRow) * 16);
            }
          }
          cutlass::arch::fence_view_async_shared();  // before the bulk copies (async proxy) reuse the stage
          warpgroup_sync();
        }
      } else if (valid_keys < kBlockN) {
        for (int slab = 0; slab < (kRowGroups ? 1 : kSlabs); ++slab) {
          cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
        }
        constexpr int kChunksPerSlabRow = Traits::kSlabRowBytes / 16, kChunksPerRow = kSlabs * kChunksPerSlabRow;
        for (int i = tid; i < (kBlockN - valid_keys) * kChunksPerRow; i += 128) {
          const int row = valid_keys + i / kChunksPerRow, chunk = i % kChunksPerRow;
          const int slab = chunk / kChunksPerSlabRow, slab_chunk = chunk % kChunksPerSlabRow;
          if constexpr (Traits::kFp8Kv) {
            mla_common::st_shared_zero16(tile + fp8_tile_offset<kRowGroups>(slab, row, slab_chunk));
          } else {
            mla_common::st_shared_zero16(tile + slab * Traits::kSlabBytes + row * Traits::kSlabRowBytes + slab_chunk * 16);
          }
        }
        cutlass::arch::fence_view_async_shared();  // before TMA (async proxy) reuses the stage
        warpgroup_sync();
      }

      // fp8: the raw V^T fragments of m-tile m (2 ldmatrix.x4.trans: 4 k-steps of A).
      uint32_t raw_v[kMTiles][2][4];
      // Row-staged: this thread's row of key rows 16 warp + g (+ 8), and its ldmatrix rows of V^T, from an
      // opaque thread index at each use: hoisted out of the loops or held across them, these offsets
      // were spilled.
      auto k_row_addr = [&] {
        const int t = mla_common::opaque(tid);
        return tile_addr + Traits::staged_slot(16 * (t / 32) + t % 32 / 4) * kRowStride;
      };
      // 16-bit rows: per k-step one ldmatrix.x4.trans, lanes 8i ... 8i + 7 giving keys 16 step + 8 (i / 2)
      // + (lane % 8) at dims 16 warp + 8 (i % 2) of the m-tile: A registers 0-3 as they are.
      uint32_t raw_v16[kMTiles][kSteps][4];
      auto load_v = [&](int m) {
        if constexpr (k16BitRows) {
#pragma unroll
          for (int step = 0; step < kSteps; ++step) {
            const int t = mla_common::opaque(tid), l = t % 32;
            const int key = 16 * step + 8 * (l / 16) + l % 8, dim = 64 * m + 16 * (t / 32) + 8 * ((l / 8) % 2);
            mla_common::ldsm_x4_trans(tile_addr + Traits::staged_slot(key) * kRowStride + 2 * dim, raw_v16[m][step]);
          }
        } else {
#pragma unroll
          for (int pair = 0; pair < 2; ++pair) {  // k-steps 2 pair, 2 pair + 1: keys 32 pair + lane
            uint32_t addr;
            if constexpr (kRowStaged) {
              const int t = mla_common::opaque(tid);
              addr = tile_addr + Traits::staged_slot(32 * pair + t % 32) * kRowStride + m * kTmaColumns + t / 32 * 16;
            } else {
              addr = tile_addr + fp8_tile_offset<kRowGroups>(m, 32 * pair + lane, warp);
            }
            mla_common::ldsm_x4_trans(addr, raw_v[m][pair]);
          }
        }
      };
      // ds_mla_fp8: the tile's V^T scale pairs into this warpgroup's table: thread (group tid / 32, word j)
      // writes the pair of keys 16 step + 8 half + 2 c and + 1 for (c, step, half) = (j / 8, j / 2 % 4, j % 2),
      // so that a PV thread reads its 8 pairs of a group as two 16-byte words. Loaded at the first
      // slab, once this warpgroup's previous PV groups are done.
      const uint32_t v_scale_table = mla_common::smem_addr(ss.v_scales) +
                                     4 * mla_common::kDsNumTiles * 32 * (2 * warpgroup + (iteration / kMathWarpgroups) % 2);
      auto build_v_scale_table = [&] {
        const int t = mla_common::opaque(tid), group = t / 32, j = t % 32;
        const int key = 16 * ((j / 2) % 4) + 8 * (j % 2) + 2 * (j / 8);  // even: key + 1 is 4 slots on
        const uint8_t* scale0 = tile + Traits::staged_slot(key) * kRowStride + mla_common::kDsScaleOffset + 4 * group;
        const __half2 pair = __floats2half2_rn(*reinterpret_cast<const float*>(scale0),
                                               *reinterpret_cast<const float*>(scale0 + 4 * kRowStride));
        mla_common::st_shared_4(v_scale_table + 4 * (group * 32 + j), *reinterpret_cast<const uint32_t*>(&pair));
      };
      float4 k_group_scale[2];  // group accumulators
      if constexpr (kRegisterA) {
        // -- S^T = K Q^T: per slab, 16 bytes of rows 16w + g and 16w + g + 8 -> 4 k-steps of A. The raw
        // bytes are loaded kAheadK slabs before their conversion, so LDS latency is off the chain.
        // 16-bit rows: 32 bytes of each row per slab, as the ds_mla_fp8 rope below.
        uint4 raw_k[kSlabs][2];
        uint4 raw_k16[kSlabs][2][2];
        uint4 raw_rope[2][2];  // ds_mla_fp8: this thread's 16 bf16 rope values of each of its rows
        auto load_rope = [&] {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t rope = k_row_addr() + half * 8 * kRowStride + mla_common::kDsRopeOffset + 32 * c;
            raw_rope[half][0] = mla_common::ld_shared_16(rope);
            raw_rope[half][1] = mla_common::ld_shared_16(rope + 16);
          }
        };
        // One slab ahead (kAheadK 1: few registers), the rope is loaded where it is converted instead.
        constexpr bool kRopeAhead = kAheadK > 1;
        auto load_k = [&](int slab) {
          if constexpr (kRowStaged) {
            // Returns at once (the tile has landed), but keeps ptxas from moving these loads into the
            // previous slab's WGMMA stage, where they made it serialise the chain (C7515).
            cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][0], phase);
            if constexpr (k16BitRows) {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const uint32_t words = k_row_addr() + half * 8 * kRowStride + slab * 2 * kTmaColumns + 32 * c;
                raw_k16[slab][half][0] = mla_common::ld_shared_16(words);
                raw_k16[slab][half][1] = mla_common::ld_shared_16(words + 16);
              }
            } else if (kDs && slab == kSlabs - 1) {
              if (kRopeAhead) load_rope();
            } else {
              raw_k[slab][0] = mla_common::ld_shared_16(k_row_addr() + slab * kTmaColumns + 16 * c);
              raw_k[slab][1] = mla_common::ld_shared_16(k_row_addr() + 8 * kRowStride + slab * kTmaColumns + 16 * c);
            }
            return;
          }
          // Row groups: one barrier for the tile, so only slab 0's wait waits; the later ones return at
          // once but keep these loads in place, as in the row-staged form above.
          cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][kRowGroups ? 0 : slab], phase);
          raw_k[slab][0] = mla_common::ld_shared_16(tile_addr + fp8_tile_offset<kRowGroups>(slab, 16 * warp + g, c));
          raw_k[slab][1] = mla_common::ld_shared_16(tile_addr + fp8_tile_offset<kRowGroups>(slab, 16 * warp + g + 8, c));
        };
#pragma unroll
        for (int slab = 0; slab < kAheadK; ++slab) load_k(slab);
        mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(tSrS);
#pragma unroll
        for (int slab = 0; slab < kSlabs; ++slab) {
          if (kAheadK > 0 && slab + kAheadK < kSlabs) load_k(slab + kAheadK);
          // This A buffer was read two commit groups ago. Slab 0 also waits for the previous PV: a
          // register-A WGMMA chain that starts with PV groups in flight makes ptxas serialize it.
          if (slab == 0) warpgroup_wait<0>(); else warpgroup_wait<1>();
          if (kAheadK == 0) load_k(slab);
          if (kDs && slab == 0) build_v_scale_table();
          const int buf = (slab % 2) * kSteps;
          // 16-bit words of a row, 32 bytes per thread: word w holds dims 16 c + 2 w, + 1; k-step t takes
          // words 2t, 2t + 1 (the permutation of the fp8 fragments, so Q is stored alike).
          auto words_to_a = [&](const uint4 (&words)[2][2], auto&& cvt) {
#pragma unroll
            for (int t = 0; t < kSteps; ++t) {
              uint32_t* a = a_regs + 4 * (buf + t);
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const uint4 w = words[half][t / 2];
                a[half] = cvt(t % 2 ? w.z : w.x);
                a[half + 2] = cvt(t % 2 ? w.w : w.y);
              }
              for (int i = 0; i < 4; ++i) warpgroup_fence_operand(a[i]);
            }
          };
          if constexpr (k16BitRows) {
            words_to_a(raw_k16[slab], [](uint32_t w) { return w; });
          } else if (kDs && slab == kSlabs - 1) {  // bf16 rope -> fp16
            if (!kRopeAhead) load_rope();
            words_to_a(raw_rope, [](uint32_t w) { return bf16x2_to_f16x2(w); });
          } else {
            const uint4 lo = raw_k[slab][0], hi = raw_k[slab][1];
            const uint32_t row0[4] = {lo.x, lo.y, lo.z, lo.w}, row8[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int t = 0; t < kSteps; ++t) {
              uint32_t* a = a_regs + 4 * (buf + t);
              e4m3x4_to_f16x2(row0[t], a[0], a[2]);
              e4m3x4_to_f16x2(row8[t], a[1], a[3]);
              // ds_mla_fp8 at 32 rows: the scales of this thread's rows 16 warp + g and + 8 for this
              // slab's group, loaded per slab: held across the QK chain, they spilled.
              if constexpr (kDs && !kGroupAccumulators) {
                const uint32_t scale_addr = k_row_addr() + mla_common::kDsScaleOffset + 4 * (slab / 2);
                const __half2 scale = __floats2half2_rn(mla_common::ld_shared_f32(scale_addr),
                                                        mla_common::ld_shared_f32(scale_addr + 8 * kRowStride));
                for (int i = 0; i < 4; ++i) a[i] = hmul2_bits(a[i], i % 2 ? __high2half2(scale) : __low2half2(scale));
              }
              for (int i = 0; i < 4; ++i) warpgroup_fence_operand(a[i]);  // converted before the arrive
            }
          }
          Tensor tSrQ = thr.partition_fragment_B(make_tensor(make_smem_ptr(ss.q), typename Traits::SmemLayoutQ{}));
          // Group accumulators: a group's chain starts at its first slab; the rope slab's in tSrS.
          const bool group_slab = kGroupAccumulators && slab < kSlabs - 1;
          if (group_slab && slab % 2 == 0) mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
          auto& acc = group_slab ? tSrS_group[kGroupAccumulators ? slab / 2 : 0] : tSrS;
          warpgroup_arrive();
#pragma unroll
          for (int t = 0; t < kSteps; ++t) {
            cute::gemm(mma_qk, tA(_, 0, buf + t), tSrQ(_, 0, slab * kSteps + t), acc(_, 0, 0));
            mma_qk.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          if (kGroupAccumulators && slab == kSlabs - 2) mma_qk.accumulate_ = GMMA::ScaleOut::Zero;  // the rope's chain
        }
        // Group accumulators: the group scales of this thread's key rows 16 warp + g and + 8.
        if constexpr (kGroupAccumulators) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint4 bits = mla_common::ld_shared_16(k_row_addr() + half * 8 * kRowStride + mla_common::kDsScaleOffset);
            k_group_scale[half] = make_float4(__uint_as_float(bits.x), __uint_as_float(bits.y),
                                              __uint_as_float(bits.z), __uint_as_float(bits.w));
          }
        }
        // The first V^T fragments do not depend on P: load them under the softmax.
#pragma unroll
        for (int m = 0; m < kAheadV && m < kMTiles; ++m) load_v(m);
      } else {
        // -- S^T = K Q^T straight from the stage, a slab's 4 k-steps as soon as it lands.
        Tensor tSrK = thr.partition_fragment_A(make_tensor(make_smem_ptr(ss.kv[stage]), typename Traits::SmemLayoutK{}));
        Tensor tSrQ16 = thr.partition_fragment_B(sQ);
        mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(tSrS);
#pragma unroll
        for (int slab = 0; slab < kSlabs; ++slab) {
          cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
          warpgroup_arrive();
#pragma unroll
          for (int t = 0; t < kSteps; ++t) {
            cute::gemm(mma_qk, tSrK(_, _, slab * kSteps + t), tSrQ16(_, _, slab * kSteps + t), tSrS);
            mma_qk.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
        }
      }
      warpgroup_wait<0>();  // S, and this warpgroup's previous PV (P^T and O are free)
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tOrO);  // the rescale below must not move above the wait
      if constexpr (kGroupAccumulators) {  // S = rope + sum over the groups of scale x group (powers of two: exact)
#pragma unroll
        for (int group = 0; group < mla_common::kDsNumTiles; ++group) warpgroup_fence_operand(tSrS_group[group]);
#pragma unroll
        for (int e = 0; e < size(tSrS); ++e) {
          const float4 scale = k_group_scale[(e >> 1) & 1];
          tSrS(e) = fmaf(scale.x, tSrS_group[0](e), fmaf(scale.y, tSrS_group[1](e),
                         fmaf(scale.z, tSrS_group[2](e), fmaf(scale.w, tSrS_group[3](e), tSrS(e)))));
        }
      }

      // -- Online softmax over the 64 keys of the tile, per query row (column).
      const int key_row = blk * kBlockN + 16 * warp + g;
      float tile_max[kCols], score_scale[kCols];
      int last_key[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        score_scale[j] = ss.score_scale[col_of(j)];
        last_key[j] = ss.last_key[col_of(j)];
      }
#pragma unroll
      for (int j = 0; j < kCols; ++j) tile_max[j] = -INFINITY;
      // Row-staged: bit h, whether key key_row + 8 h was copied (read now: held from the tile's start,
      // it would cost registers across the QK chain).
      uint32_t copied = 3;
      if constexpr (kRowStaged) {
        const uint64_t mask = ss.key_copied[stage] >> (16 * warp + g);
        copied = uint32_t(mask & 1) | uint32_t((mask >> 7) & 2);
      }
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) {
        const int j = col_index(e);
        const int half = (e >> 1) & 1;
        const bool visible = key_row + 8 * half <= last_key[j] && ((copied >> half) & 1);
        const float s = visible ? tSrS(e) * score_scale[j] : -INFINITY;
        tSrS(e) = s;
        tile_max[j] = fmaxf(tile_max[j], s);
      }
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        for (int x = 4; x < 32; x *= 2) tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffff, tile_max[j], x));
        if (g == 0) ss.col_stat[warpgroup][warp][col_of(j)] = tile_max[j];
      }
      warpgroup_sync();
      float base[kCols], rescale[kCols], new_max[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const float old_max = ss.run_max[warpgroup][col_of(j)];
        new_max[j] = old_max;
        for (int w = 0; w < 4; ++w) new_max[j] = fmaxf(new_max[j], ss.col_stat[warpgroup][w][col_of(j)]);
        base[j] = new_max[j] == -INFINITY ? 0.f : new_max[j];  // fully masked so far: keep exp2 finite
        rescale[j] = exp2f(old_max - base[j]);
        col_sum[j] *= rescale[j];
      }
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) {
        const int j = col_index(e);
        const float prob = exp2f(tSrS(e) - base[j]);
        col_sum[j] += prob;
        const MmaElement p16(prob);
        mla_common::st_shared_2(&sPt(col_of(j), 16 * warp + g + 8 * ((e >> 1) & 1)), p16.raw());
      }
      bool any_rescale = false;
#pragma unroll
      for (int j = 0; j < kCols; ++j) any_rescale |= rescale[j] != 1.f;
      if (__any_sync(0xffffffff, any_rescale)) {
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
          for (int e = 0; e < size<0>(tOrO); ++e) tOrO(e, m, 0) *= rescale[col_index(e)];
        }
      }
      cutlass::arch::fence_view_async_shared();  // P^T -> WGMMA
      warpgroup_sync();                          // also: every warp has read col_stat and run_max
      if (warp == 0 && g == 0) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) ss.run_max[warpgroup][col_of(j)] = new_max[j];
      }

      if constexpr (kRegisterA) {
        // -- O^T += V^T P^T, per m-tile (64 dims).
        Tensor tOrPt = thr.partition_fragment_B(sPt);
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
          if (m + kAheadV < kMTiles) load_v(m + kAheadV);
          if (m == kMTiles - 1) {  // every byte of the tile has been loaded: hand the stage back
            __syncwarp();
            if (kEveryThreadReleases || lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[stage]);
          }
          warpgroup_wait<1>();  // the WGMMAs that read this A buffer (two groups ago) are done
          const int buf = (m % 2) * kSteps;
          // ds_mla_fp8: the scale pairs of this thread's keys in the m-tile's 128-column group, word
          // 2 step + h for keys 16 step + 8 h + 2 c and + 1, 16 bytes per two k-steps.
          const uint32_t v_scale_words = v_scale_table + 4 * ((m / 2) * 32 + 8 * c);
          uint4 w;
#pragma unroll
          for (int step = 0; step < kSteps; ++step) {
            uint32_t* a = a_regs + 4 * (buf + step);
            if constexpr (k16BitRows) {
              for (int i = 0; i < 4; ++i) a[i] = raw_v16[m][step][i];
              for (int i = 0; i < 4; ++i) warpgroup_fence_operand(a[i]);
              continue;
            }
            // raw_v[m][step / 2][2 (step % 2)]: keys 0-7 of the k-step, [.. + 1]: keys 8-15.
            const uint32_t* r = raw_v[m][step / 2] + 2 * (step % 2);
            e4m3x4_to_f16x2(__byte_perm(r[0], 0, 0x3120), a[0], a[1]);
            e4m3x4_to_f16x2(__byte_perm(r[1], 0, 0x3120), a[2], a[3]);
            if constexpr (kDs) {
              if (step % 2 == 0) w = mla_common::ld_shared_16(v_scale_words + 8 * step);
              const uint32_t pair0 = step % 2 ? w.z : w.x, pair1 = step % 2 ? w.w : w.y;
              a[0] = hmul2_bits(a[0], *reinterpret_cast<const __half2*>(&pair0));
              a[1] = hmul2_bits(a[1], *reinterpret_cast<const __half2*>(&pair0));
              a[2] = hmul2_bits(a[2], *reinterpret_cast<const __half2*>(&pair1));
              a[3] = hmul2_bits(a[3], *reinterpret_cast<const __half2*>(&pair1));
            }
            for (int i = 0; i < 4; ++i) warpgroup_fence_operand(a[i]);
          }
          warpgroup_fence_operand(tOrO);
          warpgroup_arrive();
#pragma unroll
          for (int t = 0; t < kSteps; ++t) cute::gemm(mma_pv, tA(_, 0, buf + t), tOrPt(_, 0, t), tOrO(_, m, 0));
          warpgroup_commit_batch();
        }
      } else {
        // -- O^T += V^T P^T, V^T straight from the stage; then the stage goes back to the producer.
        Tensor tOrVt = thr_pv.partition_fragment_A(make_tensor(make_smem_ptr(ss.kv[stage]), typename Traits::SmemLayoutVt{}));
        Tensor tOrPt16 = thr_pv.partition_fragment_B(sPt);
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
          for (int t = 0; t < kSteps; ++t) cute::gemm(mma_pv, tOrVt(_, m, t), tOrPt16(_, 0, t), tOrO(_, m, 0));
        }
        warpgroup_commit_batch();
        warpgroup_wait<0>();  // the stage and P^T are read
        warpgroup_fence_operand(tOrO);
        __syncwarp();
        if (kEveryThreadReleases || lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty[stage]);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
#ifdef MLA_ATTN_RACECHECK
    {
      // Only for compute-sanitizer (a build with MLA_ATTN_RACECHECK=1, scripts/sanitize.sh): its
      // racecheck orders the hand-offs below correctly only if all math warpgroups have run their
      // warpgroup-local barriers equally often (scripts/racecheck_probe.cu), which the kernel does not
      // need: each catches up with the one that ran most in this request (2 per tile, 1 more for a
      // tail tile; row-staged: 3 per tile, the zeroing's sync always taken in this build).
      const int num_blocks = seg.blk_hi - seg.blk_lo, it0 = iteration - num_blocks;
      const int first_tail = max(seg.blk_lo, seg.seqlen_k / kBlockN);  // tiles with valid_keys < kBlockN
      auto owned_below = [](int x, int w) { return (x + kMathWarpgroups - 1 - w) / kMathWarpgroups; };  // x >= 0
      auto count_own = [&](int first, int count, int w) { return max(owned_below(first + count, w) - owned_below(first, w), 0); };
      auto local_syncs = [&](int w) {
        if constexpr (kRowStaged) return 3 * count_own(it0, num_blocks, w);
        return 2 * count_own(it0, num_blocks, w) +
               count_own(it0 + first_tail - seg.blk_lo, seg.blk_hi - first_tail, w);
      };
      int most = 0;
      for (int w = 0; w < kMathWarpgroups; ++w) most = max(most, local_syncs(w));
      for (int i = local_syncs(warpgroup); i < most; ++i) warpgroup_sync();
    }
#endif

    // ---- Epilogue: merge the warpgroups' states, (M, L) per query row, then O through sQ
    // (every QK of the request is done: all warpgroups passed their last wait).
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      for (int x = 4; x < 32; x *= 2) col_sum[j] += __shfl_xor_sync(0xffffffff, col_sum[j], x);
      if (g == 0) ss.col_stat[warpgroup][warp][col_of(j)] = col_sum[j];
    }
    named_barrier_sync<int(NarrowBarrier::kMergeStats), kMathThreads>();
    const int slot = partial_slot(p, seg);
    const bool is_partial = slot >= 0;
    // The merged (max, sum) of query row `col` over the warpgroups' states in shared memory.
    struct RowMerge {
      float max_all, total, own_factor;  // own_factor: 2^(this warpgroup's max - max_all)
    };
    auto merge_row = [&](int col) {
      RowMerge r{-INFINITY, 0.f, 0.f};
      float wg_sum[kMathWarpgroups], wg_max[kMathWarpgroups];
      for (int w = 0; w < kMathWarpgroups; ++w) {
        wg_max[w] = ss.run_max[w][col];
        wg_sum[w] = ss.col_stat[w][0][col] + ss.col_stat[w][1][col] + ss.col_stat[w][2][col] + ss.col_stat[w][3][col];
        r.max_all = fmaxf(r.max_all, wg_max[w]);
      }
      for (int w = 0; w < kMathWarpgroups; ++w) {
        const float factor = wg_max[w] == -INFINITY ? 0.f : exp2f(wg_max[w] - r.max_all);
        r.total += factor * wg_sum[w];
        if (w == warpgroup) r.own_factor = factor;
      }
      return r;
    };
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int col = col_of(j);
      const RowMerge r = merge_row(col);
      // This warpgroup's share of the normalised output: O_w 2^(m_w - m) k_scale / sum (+ the sink's
      // term); 0 where no key of the split is visible to the row.
      const float denominator = is_partial ? r.total : denominator_with_sink(p, col, r.max_all, r.total);
      const float own_factor = r.total == 0.f ? 0.f : r.own_factor * ss.k_scale / denominator;
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int e = 0; e < size<0>(tOrO); ++e) {
          if (col_index(e) == j) tOrO(e, m, 0) *= own_factor;
        }
      }
    }
    // The LSE of each query row, by the four threads that hold a warp's columns: a loop, not unrolled
    // like the scaling above (which indexes registers by column). This epilogue runs once per request
    // as straight-line code, and its instruction fetch, not its arithmetic, is what a warp waits on
    // (docs/design-decisions.md). Before the hand-offs' barriers: past them, the other warpgroup may
    // start the next request, whose load_q resets run_max.
    if (warpgroup == 0 && warp == 0 && g == 0) {
#pragma unroll 1
      for (int j = 0; j < kCols; ++j) {
        const int col = col_of(j);
        if (col >= rows_in_request) continue;
        const RowMerge r = merge_row(col);
        const float lse = r.total == 0.f ? (is_partial ? -INFINITY : INFINITY) : (r.max_all + __log2f(r.total)) * float(M_LN2);
        const QueryRow q = QueryRow::of(p, col);
        if (is_partial) {
          p.partial_lse[int64_t(slot) * p.num_q_tiles * kBlockM + col] = lse;
        } else {
          p.lse[seg.b * p.lse_batch_stride + (seg.first_token + q.token) * p.lse_token_stride + q.head * p.lse_head_stride] = lse;
        }
      }
    }
    // Warpgroup r (0, 1) collects m-tiles [4r, 4r + 4) of O^T: hand-off i (r = 0 first, then r = 1)
    // passes them from writer w != r to reader r (thread t to thread t) through one buffer. A barrier
    // over all math threads follows each write, and each read unless the next writer is this reader.
    float* handoff = reinterpret_cast<float*>(ss.q);
    constexpr int kHalf = kMTiles / 2, kHandoffs = 2 * (kMathWarpgroups - 1);
    auto reader = [](int i) { return i / (kMathWarpgroups - 1); };
    auto writer = [&](int i) { const int k = i % (kMathWarpgroups - 1); return k + (k >= reader(i)); };
#pragma unroll
    for (int i = 0; i < kHandoffs; ++i) {
      const int r = reader(i);
      if (warpgroup == writer(i)) {
#pragma unroll
        for (int m = 0; m < kHalf; ++m) {
#pragma unroll
          for (int e = 0; e < size<0>(tOrO); ++e) {
            handoff[(m * size<0>(tOrO) + e) * 128 + tid] = tOrO(e, r * kHalf + m, 0);
          }
        }
      }
      named_barrier_sync<int(NarrowBarrier::kMerge), kMathThreads>();
      if (warpgroup == r) {
#pragma unroll
        for (int m = 0; m < kHalf; ++m) {
#pragma unroll
          for (int e = 0; e < size<0>(tOrO); ++e) {
            tOrO(e, r * kHalf + m, 0) += handoff[(m * size<0>(tOrO) + e) * 128 + tid];
          }
        }
      }
      // After the last read the buffer is sQ again, for the next request's Q.
      if (i + 1 == kHandoffs || writer(i + 1) != r) named_barrier_sync<int(NarrowBarrier::kMerge), kMathThreads>();
    }

    // ---- Store this warpgroup's dims [256 wg, 256 wg + 256). The parts of the rows' addresses that
    // do not depend on the row come first (straight-line code per row, fetched on a cold call).
    Element* const out_request = static_cast<Element*>(p.out) + seg.b * p.out_batch_stride + seg.first_token * p.out_token_stride;
    const int64_t partial_first_row = int64_t(slot) * p.num_q_tiles * kBlockM;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int row = mla_common::opaque(col_of(j));  // opaque: its address is not hoisted and held
      if (row >= rows_in_request) continue;
      const QueryRow q = QueryRow::of(p, row);
      // A partial row in q's dtype, or in fp32 (p.partials_fp32): the same offset in elements.
      const int64_t partial_offset = (partial_first_row + row) * kHeadDimV;
      Element* partial_row = static_cast<Element*>(p.partial_out) + partial_offset;
      float* partial_row_fp32 = static_cast<float*>(p.partial_out) + partial_offset;
      Element* out_row = out_request + q.token * p.out_token_stride + q.head * p.out_head_stride;
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        if (m / kHalf != warpgroup) continue;  // static m: O stays in registers
        // Elements e (row half 0) and e + 2 (row half 1) of column j. fp8: dims d and d + 1 (the
        // ldmatrix.trans order); 16-bit: accumulator rows in order, dims d and d + 8.
        const int e = (j / 2) * 4 + (j % 2);
        const float v0 = tOrO(e, m, 0), v1 = tOrO(e + 2, m, 0);
        const int dim = Traits::kFp8Kv ? 64 * m + 16 * warp + 2 * g : 64 * m + 16 * warp + g;
        const int dim1 = dim + (Traits::kFp8Kv ? 1 : 8);
        if (is_partial && p.partials_fp32) {
          partial_row_fp32[dim] = v0;
          partial_row_fp32[dim1] = v1;
        } else if constexpr (Traits::kFp8Kv) {
          const Element pair[2] = {Element(v0), Element(v1)};
          *reinterpret_cast<uint32_t*>((is_partial ? partial_row : out_row) + dim) = *reinterpret_cast<const uint32_t*>(pair);
        } else {
          Element* dst = is_partial ? partial_row : out_row;
          dst[dim] = Element(v0);
          dst[dim1] = Element(v1);
        }
      }
    }
  }
}

// The kernel's policy for the shared shell (shared/kernel_shell.cuh). One q-tile: m_block 0.
template <typename Traits_>
struct NarrowKernel {
  using Traits = Traits_;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kThreads = Traits::kThreads, kMathWarpgroups = Traits::kMathWarpgroups;
  static constexpr int kMathRegisters = Traits::kMathRegisters, kProducerRegisters = kNarrowProducerRegisters;

  // kv_empty: the 4 warps of the warpgroup that consumed a tile arrive (racecheck builds: its 128
  // threads, each after its own reads of the stage: racecheck does not order the other lanes' reads
  // before lane 0's arrival through __syncwarp, and reported the next fill's bulk copies and zeroing
  // of row-staged tiles as racing them); kv_fill: no fill yet (-1). Row-staged: whole rows by bulk copy
  // (shared/row_copies.cuh).
  static constexpr int kReleaseArrivals = kEveryThreadReleases ? 128 : 4;
  template <bool kGather>
  __device__ __forceinline__ static void init_barriers(SharedStorage& ss) {
    if constexpr (Traits::kRowStaged) init_row_ring<Traits>(ss, kReleaseArrivals);
    else init_kv_ring<Traits, kGather>(ss, kReleaseArrivals);
    if (threadIdx.x < Traits::kStages) ss.kv_fill[threadIdx.x] = -1;
  }
  template <bool kGather>
  __device__ __forceinline__ static void produce(const DecodeParams& p, const DecodeTma& tma, SharedStorage& ss,
                                                 const PartRange& range, int warp) {
    if constexpr (Traits::kRowStaged) produce_staged_rows<Traits>(p, tma, ss, range, warp);
    else produce_kv_tiles<Traits, kGather>(p, tma, ss, range, 0, warp);
  }
  template <bool kGather>
  __device__ __forceinline__ static void consume(const DecodeParams& p, const DecodeTma&, SharedStorage& ss,
                                                 const PartRange& range, int warpgroup) {
    consume_narrow_tiles<Traits, Traits::kRowGroupTiles && !kGather>(p, ss, range, warpgroup);
  }
};

// 16 rows: TMA boxes where the keys come in runs of 16 rows of a page, else (DecodeTma::gather) the
// row-staged form.
template <typename Element, int kRows, int kMathWarpgroups, bool kFp8Kv>
cudaError_t run_mla_decode_narrow(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  if constexpr (kRows == 16) {
    if (tma.gather) {
      return launch_split_and_combine<NarrowKernel<NarrowTraits<Element, kRows, kMathWarpgroups, kFp8Kv, true>>,
                                      /*kMayStoreFp32Partials=*/true>(params, tma, stream);
    }
  }
  return launch_split_and_combine<NarrowKernel<NarrowTraits<Element, kRows, kMathWarpgroups, kFp8Kv>>,
                                  /*kMayStoreFp32Partials=*/true>(params, tma, stream);
}

template <typename Element, int kRows>
cudaError_t run_mla_decode_narrow_ds_mla_fp8(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream) {
  return launch_split_and_combine<NarrowKernel<NarrowTraits<Element, kRows, 2, true, true, true>>,
                                  /*kMayStoreFp32Partials=*/true>(params, tma, stream);
}

}  // namespace mla_decode
