// CuTe types and the shared-memory map of the narrow decode kernel (narrow_kernel.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "mla_decode/config.h"
#include "mla_decode/fp8_tile.cuh"

namespace mla_decode {
using namespace cute;

// kRows: query rows of a request padded to the N of the MMAs (16 or 32). The MMAs are transposed,
// S^T = K Q^T and O^T = V^T P^T, so the 64-row M side is keys / output dims, and a few query rows
// cost only their share of the tensor cores.
template <typename Element_, int kRows_>
struct NarrowTraits {
  using Element = Element_;  // q and out
  // The MMAs run in fp16 whatever q's type: e4m3 converts to fp16 in one instruction (to bf16 it
  // takes four), every e4m3 value is exact in fp16, and a bf16 Q row is stored as fp16 times a power
  // of two that brings its largest value to [2^14, 2^15) (narrow_kernel.cuh: load_q).
  using MmaElement = cutlass::half_t;
  static constexpr bool kFp8Kv = true;
  static constexpr int kRows = kRows_;
  static constexpr int kStages = kNarrowStages;
  static_assert(kRows == 16 || kRows == 32, "N of the MMAs");

  // Q [kRows, 576] with its columns permuted within each 64-column slab (narrow_kernel.cuh:
  // q_column), K-major, 128-byte swizzle: the B operand of S^T.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                             Shape<Int<kRows>, Int<kHeadDimK>>{}));
  // P^T as [kRows, 64 keys], K-major: the B operand of O^T; one per math warpgroup.
  using SmemLayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<MmaElement>{},
                                              Shape<Int<kRows>, Int<kBlockN>>{}));
  // 64 x kRows x 16, A (K or V^T) from registers, B from shared memory.
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>>()));

  struct SharedStorage {
    alignas(1024) MmaElement q[cosize_v<SmemLayoutQ>];  // also the O hand-off buffer of the epilogue
    alignas(1024) MmaElement pt[kNumMathWarpgroups][cosize_v<SmemLayoutPt>];
    alignas(1024) uint8_t kv[kStages][kBlockN * kHeadDimK];  // fp8 tiles as TMA stages them
    float col_stat[kNumMathWarpgroups][4][kRows];  // per warp: block max of a column (epilogue: sum)
    float run_max[kNumMathWarpgroups][kRows];      // each warpgroup's running max per query row (log2)
    int last_key[kRows];                           // last visible key of each query row (causal)
    float score_scale[kRows];  // softmax_scale log2(e) k_scale / (the power of two Q row r was stored times)
    uint64_t kv_full[kStages][kSlabs];
    uint64_t kv_empty[kStages];  // the 4 warps of the warpgroup that consumed the tile are done
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map exceeds the sm_90 limit");
  static_assert(kRows * 1024 <= int(sizeof(MmaElement)) * kRows * kHeadDimK, "O hand-off fits in sQ");

  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    return ss.kv[stage] + slab * kFp8SlabBytes + row * kTmaColumns;
  }
};

// Named barriers of the narrow kernel (id 0 is __syncthreads).
enum class NarrowBarrier : int {
  kQReady = 1,      // Q landed (cp.async) and is fenced for WGMMA; both math warpgroups
  kWarpgroup0 = 2,  // hand-offs inside one math warpgroup (column max, P^T, zeroed tail)
  kWarpgroup1 = 3,
  // Epilogue hand-offs between the two math warpgroups, one barrier each.
  kMergeStats = 4,  // both warpgroups' (max, sum) per query row are in shared memory
  kMergeRound0 = 5, // warpgroup 1's O of dims [0, 256) is in the hand-off buffer
  kMergeRound1 = 6, // warpgroup 0's O of dims [256, 512) is in the hand-off buffer
  kMergeDone = 7,   // the hand-off buffer (sQ) is free for the next request's Q
};

}  // namespace mla_decode
