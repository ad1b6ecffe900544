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
  using Element = Element_;  // q, out, P, and the converted K / V operands (registers)
  static constexpr bool kFp8Kv = true;
  static constexpr int kRows = kRows_;
  static constexpr int kStages = kNarrowStages;
  static_assert(kRows == 16 || kRows == 32, "N of the MMAs");

  // Q [kRows, 576] with its columns permuted within each 64-column slab (narrow_kernel.cuh:
  // q_column), K-major, 128-byte swizzle: the B operand of S^T.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kRows>, Int<kHeadDimK>>{}));
  // P^T as [kRows, 64 keys], K-major: the B operand of O^T; one per math warpgroup.
  using SmemLayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<Int<kRows>, Int<kBlockN>>{}));
  // 64 x kRows x 16, A (K or V^T) from registers, B from shared memory.
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kRows>, _16>>()));

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];  // also the O hand-off buffer of the epilogue
    alignas(1024) Element pt[kNumMathWarpgroups][cosize_v<SmemLayoutPt>];
    alignas(1024) uint8_t kv[kStages][kBlockN * kHeadDimK];  // fp8 tiles as TMA stages them
    float col_stat[kNumMathWarpgroups][4][kRows];  // per warp: block max of a column (epilogue: sum)
    float wg_max[kNumMathWarpgroups][kRows];       // epilogue: each warpgroup's running max
    uint64_t kv_full[kStages][kSlabs];
    uint64_t kv_empty[kStages];  // the 4 warps of the warpgroup that consumed the tile are done
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map exceeds the sm_90 limit");
  static_assert(kRows * 1024 <= int(sizeof(Element)) * kRows * kHeadDimK, "O hand-off fits in sQ");

  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    return ss.kv[stage] + slab * kFp8SlabBytes + row * kTmaColumns;
  }
};

// Named barriers of the narrow kernel (id 0 is __syncthreads).
enum class NarrowBarrier : int {
  kQReady = 1,      // Q landed (cp.async) and is fenced for WGMMA; both math warpgroups
  kWarpgroup0 = 2,  // hand-offs inside one math warpgroup (column max, P^T, zeroed tail)
  kWarpgroup1 = 3,
  kMerge = 4,       // epilogue hand-offs between the two math warpgroups
};

}  // namespace mla_decode
