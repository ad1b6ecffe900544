// Merges the fp32 partials of split requests by their LSE into the final out / lse.
//
// Grid (batch, max_rows, chunks): one CTA of 4 warps per query row and chunk of 512 / chunks
// columns; the launcher picks chunks so that a batch of few rows still spreads over the SMs (with one
// CTA per row, batch 1 merged in 10-20 us). The split weights exp(lse_s - lse) go to shared memory
// first; then each warp (or group of threads, for a narrow chunk) sums the chunk of splits w,
// w + splits per pass, ... (coalesced float4 loads, several splits in flight), and those sums are
// added through shared memory. Launched with programmatic dependent launch right behind the split
// kernel; griddepcontrol.wait makes the partials visible (plain loads, never __ldg, because the
// predecessor wrote them).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"

namespace mla_decode {

constexpr int kCombineWarps = 4;
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kCombineMaxChunks = 32;  // 16 columns (4 threads) per split row at most

// Column chunks per row: enough CTAs for ~4 per SM when the batch has few rows (a power of 2).
inline int combine_chunks(int batch, int max_rows) {
  int chunks = 1;
  while (chunks < kCombineMaxChunks && int64_t(batch) * max_rows * chunks < 512) chunks *= 2;
  return chunks;
}

template <typename Element, int kChunks>
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(__grid_constant__ const DecodeParams p) {
  // A split's chunk is kColumns float4 columns, summed by kThreadsPerSplit threads (a warp at most)
  // with kPerThread columns each; kSplitsPerPass splits are in flight per pass over the threads.
  constexpr int kColumns = kHeadDimV / 4 / kChunks;
  constexpr int kThreadsPerSplit = kColumns < 32 ? kColumns : 32;
  constexpr int kPerThread = kColumns / kThreadsPerSplit, kSplitsPerPass = kCombineThreads / kThreadsPerSplit;
  __shared__ float weights[kMaxSmParts];  // a request has at most num_sm_parts splits
  __shared__ float reduce[kCombineWarps];
  __shared__ float4 sums[kSplitsPerPass][kColumns];
  mla_common::grid_dependency_wait();
  const int b = blockIdx.x, row = blockIdx.y, chunk = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
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
    if (lane == 0) reduce[warp] = v;
    __syncthreads();
    float r = reduce[0];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) r = is_max ? fmaxf(r, reduce[w]) : r + reduce[w];
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
    weights[s] = empty ? 0.f : expf(weights[s] - max_lse);  // 0 for empty splits (lse -inf)
    sum += weights[s];
  }
  sum = block_reduce(sum, false);  // also orders the weight writes before the reads below
  const float inv_sum = empty ? 0.f : 1.f / sum;

  // An empty split's partial is 0 (it wrote O * 0), so every split can be summed unconditionally.
  const int lane_in_split = tid % kThreadsPerSplit, first_split = tid / kThreadsPerSplit;
  float4 acc[kPerThread] = {};
#pragma unroll 4
  for (int s = first_split; s < num_splits; s += kSplitsPerPass) {
    const float w = weights[s] * inv_sum;
    const float4* src = reinterpret_cast<const float4*>(p.partial_out + partial_row(s) * kHeadDimV) + chunk * kColumns;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const float4 v = src[lane_in_split + kThreadsPerSplit * j];
      acc[j].x += w * v.x; acc[j].y += w * v.y; acc[j].z += w * v.z; acc[j].w += w * v.w;
    }
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) sums[first_split][lane_in_split + kThreadsPerSplit * j] = acc[j];
  __syncthreads();
  if (tid >= kColumns) return;
  float4 total = sums[0][tid];
#pragma unroll
  for (int k = 1; k < kSplitsPerPass; ++k) {
    const float4 v = sums[k][tid];
    total.x += v.x; total.y += v.y; total.z += v.z; total.w += v.w;
  }
  const int t = row / p.num_heads_q, h = row % p.num_heads_q;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                 (first_token + t) * p.out_token_stride + h * p.out_head_stride + 4 * (chunk * kColumns + tid);
  out[0] = Element(total.x); out[1] = Element(total.y); out[2] = Element(total.z); out[3] = Element(total.w);
  if (chunk == 0 && tid == 0) {
    p.lse[b * p.lse_batch_stride + (first_token + t) * p.lse_token_stride + h * p.lse_head_stride] =
        empty ? INFINITY : max_lse + logf(sum);
  }
}

}  // namespace mla_decode
