// CuTe types and the shared-memory map of the fp8-MMA decode kernel (fp8mma/kernel.cuh): an e4m3
// cache whose tiles feed e4m3 WGMMAs as they land, with Q and P quantised to e4m3 too.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>
#include <cstdint>

#include "mla_decode/config.h"
#include "mla_decode/shared/epilogue.cuh"
#include "mla_decode/shared/fp8_dequant.cuh"

namespace mla_decode {
using namespace cute;

template <typename Element_>
struct Fp8MmaTraits {
  using Element = Element_;  // q and out (bf16 or fp16)
  using Fp8 = cutlass::float_e4m3_t;
  using MmaElement = Fp8;
  static constexpr bool kFp8Kv = true;
  // K tiles in flight: 3 x 36 KB. V^T needs only 2 buffers (block i's is written once both
  // warpgroups' PV of block i - 2 is done, which the P hand-offs already order).
  static constexpr int kStages = 3;
  static constexpr int kVtBuffers = 2;
  static constexpr int kThreads = kNumThreads;

  // Every operand is e4m3 and K-major (fp8 WGMMAs read no MN-major operand), 64-byte swizzle: a
  // 64-column slab is [64 rows][64 B], exactly what one TMA box of the cache writes (shared/fp8_dequant.cuh).
  // Q [64 rows, 576] and K [64 keys, 576]: A and B of S = Q K^T.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Fp8>{}, Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Fp8>{}, Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  // V^T [512 dims, 64 keys] (B of O = P V), transposed from the K tile by the block's non-owner, and
  // P [64 rows, 64 keys] (A). Both store key 16q + 8h + 2c + e (q < 4; c < 4; h, e < 2) in logical
  // column 16c + 4q + 2h + e: the order in which two ldmatrix.trans hand a thread c the keys of a
  // dim (fp8mma/kernel.cuh: transpose_v), and in which the accumulator of S holds a row's keys
  // (8n + 2c + e of thread c), so that each side writes a row's 16 bytes at once.
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Fp8>{}, Shape<Int<kHeadDimV>, Int<kBlockN>>{}));
  using SmemLayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Fp8>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // S = Q K^T: the warpgroup that owns a KV block computes all 64 x 64 scores (64 x 64 x 32 atoms).
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Fp8, Fp8, float, Shape<Int<kBlockM>, Int<kBlockN>, _64>>()));
  // O += P V: warpgroup w owns output columns [256w, 256w + 256).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Fp8, Fp8, float, Shape<Int<kBlockM>, Int<kHeadDimV / 2>, _64>>(),
      Layout<Shape<_1, Int<kNumMathWarpgroups>, _1>>{}));

  // The epilogue stages warpgroup 0's output rows in the Q buffer and warpgroup 1's in the last
  // block's K stage (both free by then).
  static_assert(kStagingBytes <= kBlockM * kHeadDimK && kStagingBytes <= kBlockN * kHeadDimK, "output staging");

  struct SharedStorage {
    alignas(1024) uint8_t q[kBlockM * kHeadDimK];
    alignas(1024) uint8_t k[kStages][kBlockN * kHeadDimK];  // K tiles as TMA writes them
    alignas(1024) uint8_t vt[kVtBuffers][kHeadDimV * kBlockN];
    alignas(1024) uint8_t p[kBlockM * kBlockN];
    float q_scale[kBlockM];                      // the power of two Q row r was stored times
    float row_max[kBlockM];                      // running row max after the block in p
    float row_sum[kNumMathWarpgroups][kBlockM];  // per-warpgroup softmax denominators (epilogue)
    uint64_t kv_full[kStages][kSlabs];           // TMA bytes of one 64-column slab have landed
    uint64_t kv_empty[kStages];                  // both math warpgroups are done with a stage
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory map exceeds the sm_90 limit");

  // Where the producer's copy of rows [row, row + rows_per_copy) of a slab lands.
  __device__ static void* kv_copy_dst(SharedStorage& ss, int stage, int slab, int row) {
    return ss.k[stage] + slab * kFp8SlabBytes + row * kTmaColumns;
  }
};

// Named barriers (id 0 is __syncthreads), as in the rows64 kernel: each guards one hand-off between
// the math warpgroups, a full bar.sync on both sides. "0"/"1" variants belong to the warpgroup that
// owns the block.
enum class Fp8MmaBarrier : int {
  kQReady = 1,   // Q is quantised into shared memory and fenced for WGMMA
  kPReady0 = 2,  // owner wrote P and row_max of its block, the non-owner V^T (fenced for WGMMA)
  kPReady1 = 3,
  kPFree0 = 4,   // the non-owner is done reading the previous P (its PV completed)
  kPFree1 = 5,
  kRowSum = 6,   // both partial denominators are in row_sum
  kStaged0 = 7,  // (+ warpgroup, 128 threads) its output rows are in shared memory / copied out
};

}  // namespace mla_decode
