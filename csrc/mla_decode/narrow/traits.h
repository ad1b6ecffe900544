// CuTe types and the shared-memory map of the narrow decode kernel (narrow/kernel.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cstdint>
#include <type_traits>

#include "common/device_utils.cuh"
#include "common/ds_mla_fp8_layout.h"
#include "mla_decode/config.h"
#include "mla_decode/shared/fp8_dequant.cuh"

namespace mla_decode {
using namespace cute;

// kRows: query rows of a request padded to the N of the MMAs (16 or 32). The MMAs are transposed,
// S^T = K Q^T and O^T = V^T P^T, so the 64-row M side is keys / output dims, and a few query rows
// cost only their share of the tensor cores.
// kFp8Kv: an e4m3 cache, whose A operands are converted in registers (register-A WGMMAs); a 16-bit
// cache's TMA form feeds K and V^T to the WGMMAs straight from the stage (shared-memory A: V^T is the
// stage seen MN-major, as B of the 64-row kernel's PV).
// kMathWarpgroups: each math warpgroup runs its own tiles' dependent chain (QK -> softmax -> PV),
// and a chain is latency-bound. fp8: two warpgroups have registers to load 4 K slabs and all V^T
// fragments of a tile ahead (16 rows; O^T takes 64 registers) or one K slab (32 rows: 128); at 16
// rows three fit (3 x 128 x 160 + 128 x 24 <= 64K), loading 1 K slab and 2 V^T m-tiles ahead: more
// tiles in flight, but each takes longer (dispatch: decode_api.cpp). 16-bit: two stages fit, one
// per warpgroup.
// kRowStaged: each key row arrives whole by bulk copy (shared/row_copies.cuh) into a staging row of
// the stage, and the math threads load their A fragments from there (register-A WGMMAs, a 16-bit
// cache too): at 16 rows, the form for rows that are gathered (page sizes not a multiple of 16, slot
// lists), where TMA boxes of 16+ rows cannot serve; its TMA form then never gathers. At 32 rows
// (registers for one K slab ahead) the e4m3 form spilled in ptxas: that kernel gathers by cp.async.
// kDsMlaFp8: DeepSeek-V3.2's cache (common/ds_mla_fp8_layout.h; row-staged): per-128-column
// power-of-two scales and 64 bf16 rope values beside the 512 e4m3 values of a row.
template <typename Element_, int kRows_, int kMathWarpgroups_, bool kFp8Kv_, bool kRowStaged_ = false,
          bool kDsMlaFp8_ = false>
struct NarrowTraits {
  using Element = Element_;  // q and out
  static constexpr bool kFp8Kv = kFp8Kv_;
  static constexpr bool kRowStaged = kRowStaged_;
  static constexpr bool kDsMlaFp8 = kDsMlaFp8_;
  static_assert(kRowStaged || !kDsMlaFp8, "ds_mla_fp8 rows are row-staged");
  static constexpr bool kGatherOnly = kRowStaged;  // no TMA map (shared/launch.cuh)
  // fp8 TMA form: a tile arrives by 16-key row groups, all nine slabs of a group in one copy (at most 4
  // copies per tile at any page size against 36 slab copies at page 16; one kv_full barrier per stage;
  // shared/fp8_dequant.cuh: fp8_tile_offset). The 32-row kernel's cp.async gather stages slabs.
  static constexpr bool kRowGroupTiles = kFp8Kv && !kRowStaged;
  static_assert(!kRowGroupTiles || kBlockN * kHeadDimK == (kBlockN / kFp8GroupRows) * kFp8GroupBytes,
                "a tile is whole row groups");
  static_assert(kFp8GroupSlabBytes % 512 == 0, "each row group's slab starts a 64-byte swizzle pattern");
  static constexpr bool kTmaOnly = !kRowStaged && kRows_ == 16;
  // A operands loaded into registers by the math threads (fp8: converted there) rather than read by
  // the WGMMAs from the stage.
  static constexpr bool kRegisterA = kFp8Kv || kRowStaged;
  // fp8: the MMAs run in fp16 whatever q's type: e4m3 converts to fp16 in one instruction (to bf16
  // it takes four), every e4m3 value is exact in fp16, and a bf16 Q row is stored as fp16 times a
  // power of two that brings its largest value to [2^14, 2^15) (narrow/kernel.cuh: load_q).
  using MmaElement = std::conditional_t<kFp8Kv, cutlass::half_t, Element>;
  using KvElement = std::conditional_t<kFp8Kv, uint8_t, Element>;  // of a stage, as TMA writes it
  static constexpr int kRows = kRows_;
  // 16-bit: two 72 KB stages (73 KB row-staged; a third would not fit beside Q and P^T). Row-staged fp8:
  // 37 KB (e4m3) or 41 KB (ds_mla_fp8) stages, as many as fit.
  static constexpr int kStages = !kFp8Kv ? 2 : kDsMlaFp8 ? 4 : kNarrowStages;
  static_assert(kRows == 16 || kRows == 32, "N of the MMAs");
  static constexpr int kMathWarpgroups = kMathWarpgroups_;
  // Tile i goes to warpgroup i % kMathWarpgroups and stage i % kStages: unless the stages divide among
  // the warpgroups, a stage's uses go to different ones (kv_producer.cuh, record_stage_fill).
  static constexpr bool kStagesChangeHands = kStages % kMathWarpgroups != 0;
  static_assert(kMathWarpgroups == 2 || (kMathWarpgroups == 3 && kRows == 16 && kFp8Kv), "O^T must fit in registers");
  static constexpr int kMathThreads = kMathWarpgroups * 128;
  static constexpr int kThreads = kMathThreads + 128;  // + the producer warpgroup
  static constexpr int kMathRegisters = kMathWarpgroups == 3 ? 160 : 240;
  // setmaxnreg only moves registers within what the launch gave the CTA (kLaunchRegisters per
  // thread): a split that asks for more never completes its setmaxnreg.inc (a hang, not an error).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kMathWarpgroups * kMathRegisters + kNarrowProducerRegisters <= (kMathWarpgroups + 1) * kLaunchRegisters,
                "the register split exceeds the launch's allocation");
  // fp8: K slabs (QK) / V^T m-tiles (PV) whose raw fragments are loaded ahead of their conversion,
  // as far as registers allow without spills. The V^T ones do not depend on P, so they load under
  // the softmax. (All 9 K slabs ahead makes ptxas serialize the QK chain.)
  // 16-bit row-staged: a slab's K fragments and an m-tile's V^T fragments are twice as many registers;
  // K's are loaded after the wait that frees their A buffer (kAheadK 0): loaded any earlier, they are
  // the WGMMAs' own input registers (no conversion in between) and ptxas serialises the QK chain (C7513).
  static constexpr int kAheadK = !kFp8Kv ? 0 : kRows == 32 ? 1 : kMathWarpgroups == 2 ? 4 : 1;
  static constexpr int kAheadV = !kFp8Kv ? 2 : kRows == 32 ? 0 : kMathWarpgroups == 2 ? kHeadDimV / 64 : 2;

  // Q [kRows, 576], K-major, 128-byte swizzle: the B operand of S^T. fp8: its columns are permuted
  // within each 64-column slab as the A fragments loaded from the fp8 tile (narrow/kernel.cuh: q_column).
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                             Shape<Int<kRows>, Int<kHeadDimK>>{}));
  // P^T as [kRows, 64 keys], K-major: the B operand of O^T; one per math warpgroup.
  using SmemLayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                              Shape<Int<kRows>, Int<kBlockN>>{}));
  // 16-bit stage: K [64 keys, 576] as TMA writes it (9 slabs of 64 rows x 128 B), and V^T [512, 64
  // keys] = the same bytes seen MN-major (rows64/traits.h).
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                             Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<MmaElement>{},
                                              Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Step<_2, _1>{}));
  // 64 x kRows x 16. kRegisterA: A (K or V^T) from registers; a 16-bit TMA form: from the stage (V^T
  // MN-major). B from shared memory.
  using TiledMmaQK = std::conditional_t<
      kRegisterA, decltype(make_tiled_mma(GMMA::rs_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>>())),
      decltype(make_tiled_mma(GMMA::ss_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>>()))>;
  using TiledMmaPV = std::conditional_t<
      kRegisterA, TiledMmaQK,
      decltype(make_tiled_mma(GMMA::ss_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>,
                                                   GMMA::Major::MN, GMMA::Major::K>()))>;
  static constexpr int kSlabBytes = kBlockN * kTmaColumns * int(sizeof(KvElement));  // of a stage
  static constexpr int kSlabRowBytes = kTmaColumns * int(sizeof(KvElement));
  // Row staging (kRowStaged): key row r of a block lands whole (576, 656 or 1152 bytes) at slot
  // staged_slot(r) of the stage. The stride is an odd number of 16-byte units (592 = 37 x 16, 656 =
  // 41 x 16, 1168 = 73 x 16), so 8 consecutive slots take 8 distinct 16-byte bank groups and slots 4
  // apart groups 4 apart; the slot order (bit 0 of r moved to bit 2) gives the 8 keys an ldmatrix of V^T reads at
  // once (r ... r + 7, r % 8 = 0) 8 distinct groups, and puts rows r and r + 1 (r even), which a
  // quarter-warp's 16-byte K loads read 64 bytes each of, 64 bytes apart: both conflict-free.
  static constexpr int kRowStride = kDsMlaFp8 ? mla_common::kDsRowBytes : kHeadDimK * int(sizeof(KvElement)) + 16;
  static_assert(kRowStride % 16 == 0 && (kRowStride / 16) % 2 == 1, "bank groups of the staging slots");
  static constexpr int kStageBytes = kRowStaged ? kBlockN * kRowStride : kBlockN * kHeadDimK * int(sizeof(KvElement));
  __device__ static constexpr int staged_slot(int row) { return (row & ~7) | ((row & 1) << 2) | ((row >> 1) & 3); }
  // The producer's one copy per row (shared/row_copies.cuh).
  static constexpr uint32_t kStagedBytes = kRowStride - (kDsMlaFp8 ? 0 : 16), kRopeBytes = 0;
  static constexpr int kCacheElementBytes = int(sizeof(KvElement));  // cache_row_offset counts elements
  // ds_mla_fp8: per math warpgroup, two tiles' V^T scales as f16x2 pairs in the order a thread reads
  // them (narrow/kernel.cuh); one word where unused.
  static constexpr int kVScaleWords = kDsMlaFp8 ? kMathWarpgroups * 2 * mla_common::kDsNumTiles * 32 : 1;

  struct SharedStorage {
    alignas(1024) MmaElement q[cosize_v<SmemLayoutQ>];  // also the O hand-off buffer of the epilogue
    alignas(1024) MmaElement pt[kMathWarpgroups][cosize_v<SmemLayoutPt>];
    alignas(1024) KvElement kv[kStages][kStageBytes / sizeof(KvElement)];  // tiles as TMA or the row copies stage them
    uint32_t v_scales[kVScaleWords];
    float col_stat[kMathWarpgroups][4][kRows];     // per warp: block max of a column (epilogue: sum)
    float run_max[kMathWarpgroups][kRows];         // each warpgroup's running max per query row (log2)
    int last_key[kRows];                           // last visible key of each query row (causal)
    float score_scale[kRows];  // softmax_scale log2(e) k_scale / (the power of two Q row r was stored times)
    float k_scale;                                 // *params.k_scale, 1 for a 16-bit cache (epilogue)
    uint64_t kv_full[kStages][kSlabs];  // row-group tiles: [stage][0] only
    uint64_t kv_empty[kStages];  // the 4 warps of the warpgroup that consumed the tile are done
    uint64_t key_copied[kStages];  // row-staged: bit k, key k of the block was copied
    int kv_fill[kStages];  // kStagesChangeHands: the iteration the producer last began to fill the stage with
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map exceeds the sm_90 limit");
  static_assert(kRows * 1024 <= int(sizeof(MmaElement)) * kRows * kHeadDimK, "O hand-off fits in sQ");

  // Rows start at multiples of 16, where the 128-byte swizzle leaves a row in place.
  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    return reinterpret_cast<uint8_t*>(ss.kv[stage]) + slab * kSlabBytes + row * kSlabRowBytes;
  }
  __device__ static uint32_t staged_row_addr(SharedStorage& ss, int stage, int row) {
    return mla_common::smem_addr(ss.kv[stage]) + staged_slot(row) * kRowStride;
  }
};

// Named barriers of the narrow kernel (id 0 is __syncthreads).
enum class NarrowBarrier : int {
  kQReady = 1,      // Q is in shared memory and fenced for WGMMA; all math warpgroups
  kWarpgroup0 = 2,  // hand-offs inside one math warpgroup (column max, P^T, zeroed tail): 2, 3, 4
  // Epilogue hand-offs between the math warpgroups, all of them.
  kMergeStats = 5,  // every warpgroup's (max, sum) per query row is in shared memory
  kMerge = 6,       // around each use of the O hand-off buffer (sQ)
};

}  // namespace mla_decode
