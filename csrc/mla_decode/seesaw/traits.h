// CuTe types and the shared-memory map of the seesaw decode kernel (seesaw/kernel.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "mla_decode/config.h"

namespace mla_decode {
using namespace cute;

template <typename Element_>
struct SeesawTraits {
  using Element = Element_;      // cutlass::bfloat16_t or cutlass::half_t: q, the cache and out
  using MmaElement = Element_;
  static constexpr bool kFp8Kv = false;
  static constexpr int kStages = 2;  // the two blocks of a pair
  static constexpr int kMathThreads = 256;
  static constexpr int kThreads = kMathThreads + 128;  // + the producer warpgroup

  // Q [64 rows, 576] and a K tile [64 keys, 576], K-major, 128-byte swizzle: 64-column slab s is a
  // contiguous 8 KB [64, 64] tile at element 4096 s, exactly what one TMA box of 64 columns writes.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  // One 64 x 64 slab (the rope columns of Q or K) and a P tile [64 rows, 64 keys]: same layout.
  using SmemLayoutSlab = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                Shape<Int<kBlockM>, Int<kTmaColumns>>{}));
  static constexpr int kSlabElements = kBlockM * kTmaColumns;
  // V^T [512 dims, 64 keys]: the first 512 columns of the K tile seen MN-major; warpgroup w reads
  // dims [256 w, 256 w + 256) (slabs 4w ... 4w + 3).
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Step<_2, _1>{}));

  // S = Q K^T of one block (one warpgroup).
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, _64>>()));
  // O[:, 256 columns] += P V: P from registers (own block) or shared memory (the other's block).
  using TiledMmaPVLocal = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDimV / 2>, _64>,
                           GMMA::Major::K, GMMA::Major::MN>()));
  using TiledMmaPVRemote = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDimV / 2>, _64>,
                           GMMA::Major::K, GMMA::Major::MN>()));
  // A fragment (P) of a 64 x 64 operand from registers: ((2, 2, 2), 1, 4).
  // Element e of a 64 x 64 accumulator fragment is element e here (FA3 / FlashMLA's identity).
  using FragmentALayout = Layout<Shape<Shape<_2, _2, _2>, _1, _4>, Stride<Stride<_1, _2, _4>, _0, _8>>;

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];
    // Once a block's QK^T is done its rope slab (8) holds the block's P for the other warpgroup:
    // the map has no room for separate P tiles, and only the block's QK owner reads that slab.
    alignas(1024) Element k[kStages][cosize_v<SmemLayoutK>];
    float max_a[kBlockM];                      // row max after the pair's first block (warpgroup 0)
    float max_b[kBlockM];                      // ... and after its second (warpgroup 1)
    float row_sum[2][kBlockM];                 // per-warpgroup softmax denominators (epilogue)
    uint64_t kv_full[kStages][kSlabs];         // TMA bytes of one 64-column slab have landed
    uint64_t q_full;                           // the Q tile landed (TMA; DecodeTma::q_by_tma)
    uint64_t kv_empty[kStages][2];             // warpgroup w is done with its V half (and, as a
                                               // reader of the block's P, with the rope slab)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "shared memory map exceeds the sm_90 limit");

  // P of the block in `stage` (its rope slab).
  __device__ static Element* p_tile(SharedStorage& ss, int stage) { return ss.k[stage] + (kSlabs - 1) * kSlabElements; }
  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    return ss.k[stage] + slab * kSlabElements + row * kTmaColumns;
  }
};

// Named barriers of the seesaw kernel (id 0 is __syncthreads), all over both math warpgroups, in
// the order each pair meets them: kMaxA, [kTailZeroed], kMaxB, [kTailZeroed], kPReady,
// [kRemoteIssued]. Every hand-off is a bar.sync on both sides, in the same sequence in both
// warpgroups: racecheck mis-orders bar.arrive hand-offs and barrier sequences that differ between
// the warpgroups (scripts/racecheck_probe.cu); docs/decode.md weighs the bar.arrive variant.
enum class SeesawBarrier : int {
  kQReady = 1,      // Q landed (cp.async, or TMA on q_full) and is fenced for WGMMA
  kMaxA = 2,        // max_a is written (WG 0 -> 1)
  kMaxB = 3,        // max_b is written (WG 1 -> 0)
  kPReady = 4,      // both blocks' P are in their rope slabs
  kRowSum = 5,      // both partial denominators are in row_sum
  kTailZeroed = 6,  // both warpgroups zeroed their V half of a tail block (and fenced it)
  kStaged0 = 7,     // (+ warpgroup, 128 threads) its output rows are in shared memory / copied out
  kStagingRead = 9, // both warpgroups' output copies have read the last block's stage
  kRemoteIssued = 10,  // WG 1 issued P_a V_a[:, half 1]; WG 0's P_b V_b[:, half 0] queues behind it
};

}  // namespace mla_decode
