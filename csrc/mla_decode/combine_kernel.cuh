// Merges the fp32 partials of split requests by their LSE into the final out / lse.
//
// Grid (batch, max_rows): one CTA of 128 threads per query row; each thread owns 4 of the 512
// columns. The split weights exp(lse_s - lse) are computed once per row into shared memory, so the
// column loop issues independent loads (latency-bound otherwise: small batches have up to
// num_sm_parts splits per row). Launched with programmatic dependent launch right behind the split
// kernel; griddepcontrol.wait makes the partials visible (plain loads, never __ldg, because the
// predecessor wrote them).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"

namespace mla_decode {

constexpr int kCombineThreads = kHeadDimV / 4;
constexpr int kMaxSplits = 1024;  // >= num_sm_parts (at most the SM count)

template <typename Element>
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(__grid_constant__ const DecodeParams p) {
  __shared__ float weights[kMaxSplits];
  __shared__ float reduce[kCombineThreads / 32];
  mla_common::grid_dependency_wait();
  const int b = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
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
  auto block_reduce = [&](float v, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xffffffff, v, o);
      v = is_max ? fmaxf(v, other) : v + other;
    }
    if (tid % 32 == 0) reduce[tid / 32] = v;
    __syncthreads();
    float r = reduce[0];
#pragma unroll
    for (int w = 1; w < kCombineThreads / 32; ++w) r = is_max ? fmaxf(r, reduce[w]) : r + reduce[w];
    __syncthreads();
    return r;
  };

  float max_lse = -INFINITY;
  for (int s = tid; s < num_splits; s += kCombineThreads) {
    weights[s] = p.partial_lse[partial_row(s)];
    max_lse = fmaxf(max_lse, weights[s]);
  }
  max_lse = block_reduce(max_lse, true);
  const bool empty = max_lse == -INFINITY;  // no split saw a key
  float sum = 0.f;
  for (int s = tid; s < num_splits; s += kCombineThreads) {
    weights[s] = empty ? 0.f : expf(weights[s] - max_lse);  // exp(-inf) = 0 for empty splits
    sum += weights[s];
  }
  sum = block_reduce(sum, false);
  const float inv_sum = empty ? 0.f : 1.f / sum;

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = 0; s < num_splits; ++s) {
    const float w = weights[s] * inv_sum;
    if (w == 0.f) continue;  // empty split: its partial may be anything
    const float4 v = reinterpret_cast<const float4*>(p.partial_out + partial_row(s) * kHeadDimV)[tid];
    acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
  }
  const int t = row / p.num_heads_q, h = row % p.num_heads_q;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                 (first_token + t) * p.out_token_stride + h * p.out_head_stride + 4 * tid;
  out[0] = Element(acc.x); out[1] = Element(acc.y); out[2] = Element(acc.z); out[3] = Element(acc.w);
  if (tid == 0) {
    p.lse[b * p.lse_batch_stride + (first_token + t) * p.lse_token_stride + h * p.lse_head_stride] =
        empty ? INFINITY : max_lse + logf(sum);
  }
}

}  // namespace mla_decode
