// CuTe types and the shared-memory map of the narrow decode kernel (narrow/kernel.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cstdint>
#include <type_traits>

#include "mla_decode/config.h"
#include "mla_decode/shared/fp8_dequant.cuh"

namespace mla_decode {
using namespace cute;

// kRows: query rows of a request padded to the N of the MMAs (16 or 32). The MMAs are transposed,
// S^T = K Q^T and O^T = V^T P^T, so the 64-row M side is keys / output dims, and a few query rows
// cost only their share of the tensor cores.
// kFp8Kv: an e4m3 cache, whose A operands are converted in registers (register-A WGMMAs); a 16-bit
// cache feeds K and V^T to the WGMMAs straight from the stage (shared-memory A: V^T is the stage seen
// MN-major, as B of the 64-row kernel's PV).
// kMathWarpgroups: each math warpgroup runs its own tiles' dependent chain (QK -> softmax -> PV),
// and a chain is latency-bound. fp8: two warpgroups have registers to load 4 K slabs and all V^T
// fragments of a tile ahead (16 rows; O^T takes 64 registers) or one K slab (32 rows: 128); at 16
// rows three fit (3 x 128 x 160 + 128 x 24 <= 64K), loading 1 K slab and 2 V^T m-tiles ahead: more
// tiles in flight, but each takes longer (dispatch: decode_api.cpp). 16-bit: two stages fit, one
// per warpgroup.
template <typename Element_, int kRows_, int kMathWarpgroups_, bool kFp8Kv_>
struct NarrowTraits {
  using Element = Element_;  // q and out
  static constexpr bool kFp8Kv = kFp8Kv_;
  // fp8: the MMAs run in fp16 whatever q's type: e4m3 converts to fp16 in one instruction (to bf16
  // it takes four), every e4m3 value is exact in fp16, and a bf16 Q row is stored as fp16 times a
  // power of two that brings its largest value to [2^14, 2^15) (narrow/kernel.cuh: load_q).
  using MmaElement = std::conditional_t<kFp8Kv, cutlass::half_t, Element>;
  using KvElement = std::conditional_t<kFp8Kv, uint8_t, Element>;  // of a stage, as TMA writes it
  static constexpr int kRows = kRows_;
  // 16-bit: two 72 KB stages (a third would not fit beside Q and P^T).
  static constexpr int kStages = kFp8Kv ? kNarrowStages : 2;
  static_assert(kRows == 16 || kRows == 32, "N of the MMAs");
  static constexpr int kMathWarpgroups = kMathWarpgroups_;
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
  static constexpr int kAheadK = kRows == 32 ? 1 : kMathWarpgroups == 2 ? 4 : 1;
  static constexpr int kAheadV = kRows == 32 ? 0 : kMathWarpgroups == 2 ? kHeadDimV / 64 : 2;

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
  // 64 x kRows x 16. fp8: A (K or V^T) from registers; 16-bit: from the stage (V^T MN-major). B from
  // shared memory.
  using TiledMmaQK = std::conditional_t<
      kFp8Kv, decltype(make_tiled_mma(GMMA::rs_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>>())),
      decltype(make_tiled_mma(GMMA::ss_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>>()))>;
  using TiledMmaPV = std::conditional_t<
      kFp8Kv, TiledMmaQK,
      decltype(make_tiled_mma(GMMA::ss_op_selector<MmaElement, MmaElement, float, Shape<_64, Int<kRows>, _16>,
                                                   GMMA::Major::MN, GMMA::Major::K>()))>;
  static constexpr int kSlabBytes = kBlockN * kTmaColumns * int(sizeof(KvElement));  // of a stage
  static constexpr int kSlabRowBytes = kTmaColumns * int(sizeof(KvElement));

  struct SharedStorage {
    alignas(1024) MmaElement q[cosize_v<SmemLayoutQ>];  // also the O hand-off buffer of the epilogue
    alignas(1024) MmaElement pt[kMathWarpgroups][cosize_v<SmemLayoutPt>];
    alignas(1024) KvElement kv[kStages][kBlockN * kHeadDimK];  // tiles as TMA stages them
    float col_stat[kMathWarpgroups][4][kRows];     // per warp: block max of a column (epilogue: sum)
    float run_max[kMathWarpgroups][kRows];         // each warpgroup's running max per query row (log2)
    int last_key[kRows];                           // last visible key of each query row (causal)
    float score_scale[kRows];  // softmax_scale log2(e) k_scale / (the power of two Q row r was stored times)
    float k_scale;                                 // *params.k_scale, 1 for a 16-bit cache (epilogue)
    uint64_t kv_full[kStages][kSlabs];
    uint64_t kv_empty[kStages];  // the 4 warps of the warpgroup that consumed the tile are done
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map exceeds the sm_90 limit");
  static_assert(kRows * 1024 <= int(sizeof(MmaElement)) * kRows * kHeadDimK, "O hand-off fits in sQ");

  // Rows start at multiples of 16, where the 128-byte swizzle leaves a row in place.
  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    return reinterpret_cast<uint8_t*>(ss.kv[stage]) + slab * kSlabBytes + row * kSlabRowBytes;
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
