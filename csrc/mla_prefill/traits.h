// CuTe types of the prefill kernel: WGMMA atoms, swizzled shared-memory layouts, and the struct that
// *is* the shared-memory map.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "mla_prefill/config.h"

namespace mla_prefill {
using namespace cute;

template <typename Element_>
struct PrefillTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  // Q [128 rows, 192], K [128 keys, 192], V [128 keys, 128]: K-major (head dim contiguous) with the
  // 128-byte swizzle, so each 64-column slab (128 rows x 128 B = 16 KB) is what one TMA box writes.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDimQK>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDimQK>>{}));
  using SmemLayoutV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  // V^T [128 dims, 128 keys]: the same bytes as V seen MN-major, the B operand of O += P V.
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Step<_2, _1>{}));

  // Both MMAs are tiled over the two math warpgroups along M: warpgroup w owns rows [64w, 64w + 64)
  // of the tile, its S and its O, so the warpgroups never exchange data.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, _64>>(),
      Layout<Shape<Int<kNumMathWarpgroups>, _1, _1>>{}));
  // P comes from registers (the softmax output), V^T from shared memory.
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDimV>, _64>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMathWarpgroups>, _1, _1>>{}));

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];
    alignas(1024) Element k[kStages][cosize_v<SmemLayoutK>];
    alignas(1024) Element v[kStages][cosize_v<SmemLayoutV>];
    uint64_t q_full;
    uint64_t k_full[kStages];   // TMA bytes of a K block have landed
    uint64_t v_full[kStages];
    uint64_t k_empty[kStages];  // both math warpgroups' S = Q K^T on the stage completed
    uint64_t v_empty[kStages];  // both math warpgroups' O += P V on the stage completed
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map exceeds the sm_90 limit");
};

// Named barriers (id 0 is __syncthreads).
enum class PrefillBarrier : int {
  kVTailZeroed = 1,  // V rows past the request's last key are zeroed and fenced for WGMMA
};

}  // namespace mla_prefill
