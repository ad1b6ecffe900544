// The online softmax of the 64-row kernels (rows64, seesaw, fp8mma) over a 64 x 64 accumulator
// fragment of raw scores: block max, running max, the owner / non-owner steps, the denominators.
#pragma once
#include <cute/tensor.hpp>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"

namespace mla_decode {

// Row max of a 64 x 64 block of raw scores (element e: row r0 + 8 ((e >> 1) & 1), key key_of(e)),
// in log2 units: times the row's score scale, which is > 0 and so commutes with the max. Keys past
// the row's last visible key, and keys whose bit in `loaded` is clear, become -inf in S (a select, so
// the stale, even NaN, scores of keys never loaded vanish); a block no row masks (`full_block`: all
// but the last one or two of a request) skips the compare and select. `loaded` is the block's key
// mask shifted to this thread's first column (2 (lane % 4)): element e's key is then bit
// 8 (e >> 2) + (e & 1), a shift by a constant. S itself stays unscaled: the caller's
// P = exp2(S scale - base) is one FFMA and an EX2 per score (measured faster than scaling S first,
// most at long contexts).
template <typename TensorS, typename KeyOf>
__device__ __forceinline__ void block_max_of_scores(TensorS& tSrS, KeyOf&& key_of, const int (&last_key)[2],
                                                    bool full_block, const float (&scale)[2], float (&block_max)[2],
                                                    uint64_t loaded = ~0ull) {
  static_assert(int(decltype(cute::size(tSrS))::value) == 32, "a 64 x 64 accumulator fragment");
  block_max[0] = block_max[1] = -INFINITY;
  if (full_block && (loaded | 0xfcfcfcfcfcfcfcfcull) == ~0ull) {  // this thread's 16 keys all loaded
    // Four chains per row of 4 elements, then a tree: 6 dependent FMNMX on the softmax's path
    // instead of 16 (the compiler keeps a chain of fmaxf in order).
    float chain[2][4];
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      float& c = chain[(e >> 1) & 1][(e >> 2) & 3];
      c = (e < 16 && (e & 1) == 0) ? tSrS(e) : fmaxf(c, tSrS(e));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) block_max[i] = fmaxf(fmaxf(chain[i][0], chain[i][1]), fmaxf(chain[i][2], chain[i][3]));
  } else {
#pragma unroll
    for (int e = 0; e < int(cute::size(tSrS)); ++e) {
      const int i = (e >> 1) & 1;
      const bool was_loaded = (loaded >> (8 * (e >> 2) + (e & 1))) & 1;
      const float s = key_of(e) <= last_key[i] && was_loaded ? tSrS(e) : -INFINITY;
      tSrS(e) = s;
      block_max[i] = fmaxf(block_max[i], s);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 1));
    block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffff, block_max[i], 2));
    block_max[i] *= scale[i];
  }
}

// The running row max (log2 units) after a block whose row max is block_max: it moves only when the
// block's max exceeds it by more than `slack` (FlashAttention-4's conditional rescale). P =
// exp2(S - running max) then stays below 2^slack, and while the max holds the factor that rescales
// O and the denominator is exactly 1, so the 128 multiplies per thread are skipped (with the exact
// max they ran on a large share of the blocks). kMaxSlack = 8: P <= 256, exact range in
// bf16/fp16, far from fp32 overflow in the sums. 0 is the exact max (P quantised to e4m3 after a
// fixed scale needs P <= 1).
constexpr float kMaxSlack = 8.f;
__device__ __forceinline__ float next_running_max(float running, float block_max, float slack) {
  return block_max > running + slack ? block_max : running;
}

// The block owner's online-softmax step over its 64 x 64 raw scores (the 64-row kernels,
// rows64/kernel.cuh and fp8mma/kernel.cuh): the block max as above (tScS: the elements' (row, key)
// coordinates in the block), then the running max (next_running_max, `max_slack`) and this
// warpgroup's denominator move to it. Returns per row the base that P = exp2(S score_scale - base)
// subtracts (0 for a fully masked row, keeping exp2 finite) and the factor that rescales O. `loaded`:
// the block's keys that hold data (bit k: key k of the block; the row-staged forms skip some).
template <typename TensorS, typename TensorC>
__device__ __forceinline__ void owner_softmax_step(TensorS& tSrS, const TensorC& tScS, int key0, const int (&last_key)[2],
                                                   bool full_block, const float (&score_scale)[2], float max_slack,
                                                   float (&row_max)[2], float (&row_sum)[2], float (&base)[2],
                                                   float (&rescale)[2], uint64_t loaded = ~0ull) {
  float block_max[2];
  block_max_of_scores(tSrS, [&](int e) { return key0 + int(cute::get<1>(tScS(e))); }, last_key, full_block,
                      score_scale, block_max, loaded >> (2 * (threadIdx.x % 4)));
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float new_max = next_running_max(row_max[i], block_max[i], max_slack);
    base[i] = new_max == -INFINITY ? 0.f : new_max;
    rescale[i] = exp2f(row_max[i] - base[i]);
    row_max[i] = new_max;
    row_sum[i] *= rescale[i];
  }
}

// The non-owner's side of that step: it adopts the owner's new running max of rows r0 and r0 + 8
// (shared_max, written before the P hand-off).
__device__ __forceinline__ void adopt_row_max(const float* shared_max, int r0, float (&row_max)[2], float (&row_sum)[2],
                                              float (&rescale)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float new_max = shared_max[r0 + 8 * i];
    rescale[i] = exp2f(row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
    row_max[i] = new_max;
    row_sum[i] *= rescale[i];
  }
}

// Sum over the 4 lanes of a quad (the threads that share a row of an accumulator).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 1);
  return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// The denominators of rows r0 and r0 + 8 over both math warpgroups' blocks, through shared memory
// (row_sums[warpgroup][row]); barrier kBarrier (both warpgroups) separates the writes from the reads.
template <int kBarrier>
__device__ __forceinline__ void total_row_sums(float (&row_sums)[2][kBlockM], int warpgroup, int r0,
                                               const float (&row_sum)[2], float (&sums)[2]) {
  const float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  __syncwarp();  // the quad's other lanes read row_sums in the previous epilogue
  if (threadIdx.x % 4 == 0) {
    row_sums[warpgroup][r0] = total[0];
    row_sums[warpgroup][r0 + 8] = total[1];
  }
  mla_common::named_barrier_sync<kBarrier, 256>();
#pragma unroll
  for (int i = 0; i < 2; ++i) sums[i] = row_sums[0][r0 + 8 * i] + row_sums[1][r0 + 8 * i];
}

}  // namespace mla_decode
