// Merges the fp32 partials of split requests by their LSE into the final out / lse.
//
// Grid (batch, ceil(max_rows / 8)), one warp per query row; each lane owns 16 of the 512 columns.
// Launched with programmatic dependent launch right behind the split kernel: the prologue overlaps
// its tail, and griddepcontrol.wait makes the partials visible (they are read with plain loads,
// never __ldg, because the predecessor wrote them).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"

namespace mla_decode {

template <typename Element>
__global__ void __launch_bounds__(kCombineRowsPerCta * 32)
    mla_combine_kernel(__grid_constant__ const DecodeParams p) {
  mla_common::grid_dependency_wait();
  const int b = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.y * kCombineRowsPerCta + threadIdx.x / 32;
  const int num_splits = p.req_splits[2 * b];
  if (num_splits <= 1) return;  // written directly by the split kernel
  const int first_token = p.cu_seqlens_q ? p.cu_seqlens_q[b] : 0;
  const int seqlen_q = p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] - first_token : p.max_seqlen_q;
  if (row >= seqlen_q * p.num_heads_q) return;

  const int slot0 = p.req_splits[2 * b + 1];
  const int m_block = row / kBlockM, row_in_tile = row % kBlockM;
  auto partial_row = [&](int split) {
    return (int64_t(slot0 + split) * p.num_q_tiles + m_block) * kBlockM + row_in_tile;
  };

  float max_lse = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) max_lse = fmaxf(max_lse, p.partial_lse[partial_row(s)]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, o));
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int s = lane; s < num_splits; s += 32) sum += expf(p.partial_lse[partial_row(s)] - max_lse);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
  const bool empty = max_lse == -INFINITY;
  const float lse = empty ? INFINITY : max_lse + logf(sum);

  float acc[16] = {};
  if (!empty) {
    for (int s = 0; s < num_splits; ++s) {
      const float lse_s = p.partial_lse[partial_row(s)];
      if (lse_s == -INFINITY) continue;
      const float w = expf(lse_s - lse);
      const float4* src = reinterpret_cast<const float4*>(p.partial_out + partial_row(s) * kHeadDimV);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 v = src[lane + 32 * j];
        acc[4 * j + 0] += w * v.x;
        acc[4 * j + 1] += w * v.y;
        acc[4 * j + 2] += w * v.z;
        acc[4 * j + 3] += w * v.w;
      }
    }
  }
  const int t = row / p.num_heads_q, h = row % p.num_heads_q;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                 (first_token + t) * p.out_token_stride + h * p.out_head_stride;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = 4 * (lane + 32 * j);
#pragma unroll
    for (int c = 0; c < 4; ++c) out[col + c] = Element(acc[4 * j + c]);
  }
  if (lane == 0) {
    p.lse[b * p.lse_batch_stride + (first_token + t) * p.lse_token_stride + h * p.lse_head_stride] = lse;
  }
}

}  // namespace mla_decode
