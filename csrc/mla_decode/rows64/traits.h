// CuTe types of the rows64 kernel (rows64/kernel.cuh, 64 query rows per tile): WGMMA atoms, swizzled
// shared-memory layouts, and the struct that *is* the shared-memory map.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <type_traits>

#include "common/device_utils.cuh"
#include "common/ds_mla_fp8_layout.h"
#include "mla_decode/config.h"
#include "mla_decode/shared/fp8_dequant.cuh"

namespace mla_decode {
using namespace cute;

template <typename Element_, bool kFp8Kv_, bool kDsMlaFp8_ = false>
struct Rows64Traits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t: q and out
  // fp8 (e4m3) cache: each K tile arrives as e4m3 rows in the upper part of its stage buffer and is
  // converted in place to the 16-bit tile (by the math warpgroups).
  static constexpr bool kFp8Kv = kFp8Kv_;
  // DeepSeek-V3.2's cache (common/ds_mla_fp8_layout.h; implies kFp8Kv and kRowStaged): per-128-column
  // power-of-two scales beside the e4m3 values, the rope in bf16.
  static constexpr bool kDsMlaFp8 = kDsMlaFp8_;
  // Every fp8 form: each key row arrives whole by bulk copy (shared/row_copies.cuh; no TMA map) into
  // staging rows and is converted in place to the fp16 tile (Fp8SlabConverter), at every page size (faster
  // than TMA boxes of 9 e4m3 slabs even where the keys come in runs of one page: docs/design-decisions.md).
  static constexpr bool kRowStaged = kFp8Kv;
  static_assert(kFp8Kv || !kDsMlaFp8, "ds_mla_fp8 rows are e4m3");
  static constexpr bool kGatherOnly = kRowStaged;
  // The type of the Q, K and P tiles in smem and of the MMAs: q's type, or fp16 with an fp8 cache
  // (e4m3 -> fp16 is one cvt per pair, -> bf16 four; a bf16 Q row is stored scaled, fp16_row_scale).
  using MmaElement = std::conditional_t<kFp8Kv, cutlass::half_t, Element>;
  static constexpr bool kScaledQ = !std::is_same_v<Element, MmaElement>;
  static constexpr int kThreads = kNumThreads;
  // Declared before SharedStorage uses it: a later member declaration would change what kStages
  // means inside the class, which GCC 13+ rejects ([basic.scope.class]).
  static constexpr int kStages = mla_decode::kStages;
  // Q tile [64 rows, 576] and K tile [64 keys, 576], K-major (head dim contiguous), 128-byte
  // swizzle: each 64-column slab is 64 rows x 128 B = 8 KB, which is exactly what one TMA box of
  // 64 columns writes, so TMA and WGMMA agree on the layout.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                             Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                             Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  // V^T [512 dims, 64 keys] is the same bytes as the first 512 columns of the K tile, seen
  // MN-major (atoms of 64 dims x 8 keys, keys iterated first): V is never loaded twice.
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<MmaElement>{},
                                              Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Step<_2, _1>{}));
  // P [64 rows, 64 keys]: written by the block's owner warpgroup, read by both for PV.
  using SmemLayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                             Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // S = Q K^T: the warpgroup that owns a KV block computes all 64 x 64 scores.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<MmaElement, MmaElement, float, Shape<Int<kBlockM>, Int<kBlockN>, _64>>()));
  // O += P V: warpgroup w owns output columns [256w, 256w + 256).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<MmaElement, MmaElement, float, Shape<Int<kBlockM>, Int<kHeadDimV / 2>, _64>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kNumMathWarpgroups>, _1>>{}));

  struct SharedStorage {
    alignas(1024) MmaElement q[cosize_v<SmemLayoutQ>];
    alignas(1024) MmaElement k[kStages][cosize_v<SmemLayoutK>];
    alignas(1024) MmaElement p[cosize_v<SmemLayoutP>];
    float q_scale[kBlockM];                      // kScaledQ: the power of two Q row r is stored times
    float row_max[kBlockM];                      // running row max after the block in sP
    float row_sum[kNumMathWarpgroups][kBlockM];  // per-warpgroup softmax denominators (epilogue)
    uint64_t kv_full[kStages][kSlabs];           // TMA bytes of one 64-column slab have landed (fp8: [0], the block's rows)
    uint64_t kv_empty[kStages];                  // both math warpgroups are done with a K tile
    uint64_t key_copied[kStages];                // row-staged forms: bit k, key k of the block was copied
  };
  // Row staging (kRowStaged): key row r's staged bytes at kRowStagingOffset + r * kRowStagingStride:
  // an e4m3 row's 576 values, or a ds_mla_fp8 row's 512 e4m3 values and 4 scales (528 bytes, as in the
  // cache), whose 64 bf16 rope values land unswizzled at kDsRopeSlabOffset + r * 128, in the 16-bit rope
  // slab. The stride puts the 64-byte pieces of rows r and r + 1 in the two halves of the 128-byte bank
  // window (a quarter-warp of the converter reads such a pair). The staging ends where the stage (or the
  // ds_mla_fp8 rope slab) does; 16-bit slabs below it are written before the rest is read.
  static constexpr int k16BitSlabBytes = kBlockN * kTmaColumns * int(sizeof(MmaElement));
  static constexpr int kRowStagingStride = 576;
  static constexpr int kDsRopeSlabOffset = (kSlabs - 1) * k16BitSlabBytes;
  static constexpr int kStagedSlabs = kDsMlaFp8 ? kHeadDimV / kTmaColumns : kSlabs;  // 64-column e4m3 slabs of a row
  static constexpr int kRowStagingOffset = (kDsMlaFp8 ? kDsRopeSlabOffset : kSlabs * k16BitSlabBytes) -
                                           kBlockN * kRowStagingStride;
  static constexpr int kSlabsBelowStaging = kRowStagingOffset / k16BitSlabBytes;
  static_assert(kRowStagingStride % 128 == 64 && kRowStagingStride >= kHeadDimK && kRowStagingOffset % 16 == 0,
                "staging rows: 16-byte aligned, bank-spread, room for a row");
  // The producer's copies of a row (shared/row_copies.cuh): its staged bytes (e4m3 values, and the
  // ds_mla_fp8 scales) and the ds_mla_fp8 rope, each where the converter reads it.
  static constexpr uint32_t kStagedBytes = kDsMlaFp8 ? mla_common::kDsRopeOffset : kHeadDimK;
  static constexpr uint32_t kRopeBytes = kDsMlaFp8 ? mla_common::kDsRowBytes - kStagedBytes : 0;
  static constexpr int kCacheElementBytes = 1;  // cache_row_offset counts elements: bytes of an fp8 cache
  __device__ static uint32_t staged_row_addr(SharedStorage& ss, int stage, int row) {
    return mla_common::smem_addr(ss.k[stage]) + kRowStagingOffset + row * kRowStagingStride;
  }
  __device__ static uint32_t rope_row_addr(SharedStorage& ss, int stage, int row) {
    return mla_common::smem_addr(ss.k[stage]) + kDsRopeSlabOffset + row * 128;
  }
  // Where the producer's copy of rows [row, row + rows_per_copy) of a slab lands (16-bit cache).
  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    static_assert(!kFp8Kv, "the fp8 forms copy whole rows (shared/row_copies.cuh)");
    Tensor sK = make_tensor(make_smem_ptr(ss.k[stage]), SmemLayoutK{});
    return &sK(row, slab * kTmaColumns);
  }
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map (+ the launchers' 1024-byte alignment slack) exceeds the sm_90 limit");
};

// Named barriers (id 0 is __syncthreads). Each guards one hand-off between the math warpgroups.
// Hand-offs between the math warpgroups are full bar.sync on both sides (a bar.arrive producer side
// would save little: the other side is already waiting). "0"/"1" variants belong to the warpgroup
// that owns the block.
enum class Rows64Barrier : int {
  kQReady = 1,       // Q tile landed (cp.async) and is fenced for WGMMA
  kPReady0 = 2,      // owner wrote P and row_max of its block (fenced for WGMMA)
  kPReady1 = 3,
  kPFree0 = 4,       // the non-owner is done reading the previous P (its PV completed)
  kPFree1 = 5,
  kRowSum = 6,       // both partial denominators are in row_sum
  kTailZeroed = 7,   // the key rows past the sequence end are zeroed and fenced for WGMMA
  kFp8Converted = 8,  // fp8 cache: a converted slab group is fenced for WGMMA (and, in place, its
                      // staged bytes are read before a later slab overwrites them)
  kStaged0 = 9,      // (+ warpgroup, 128 threads) its output rows are in shared memory / copied out
  kQLanded = 11,     // kScaledQ: every math thread's cp.async chunks of the Q tile have landed
};

}  // namespace mla_decode
