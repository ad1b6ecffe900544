// LSE merge kernel. Memory-bound: every input row is read once with 16-byte streaming loads, the
// output row written once; math in fp32.
//
// Grid mapping: a group of G = min(32, pow2ceil(d / 8 / kUnroll)) consecutive threads owns one row (G
// divides the warp, so a group never straddles warps); lane l of the group handles the 8-element
// chunks l, l + G, ..., kUnroll of them per batch of loads (so small d still keeps kUnroll 16-byte
// loads per input in flight per thread). Blocks stride over the rows. Every lane computes the row's
// LSE and weights itself from the (broadcast) LSE loads: no shuffles, no shared memory. An empty
// input's (LSE +-inf) values never enter the sum, so garbage (NaN) there cannot leak.
#pragma once
#include <algorithm>

#include "common/vec8.cuh"
#include "merge/merge.h"

namespace mla_merge {

constexpr int kThreads = 256;
constexpr int kUnroll = 2;  // chunks in flight per lane and input
constexpr float kLog2e = 1.4426950408889634f;

struct RowOffsets {
  int64_t in_out[2], in_lse[2], out, lse;
};

template <bool kPair>
__device__ __forceinline__ RowOffsets row_offsets(const MergeParams& p, int64_t row) {
  RowOffsets o = {};
#pragma unroll
  for (int i = kMaxRowDims - 1; i >= 0; --i) {
    if (i >= p.rank) continue;
    int64_t ix = row;  // dim 0 takes what is left
    if (i > 0) {
      ix = row % p.row_size[i];
      row /= p.row_size[i];
    }
#pragma unroll
    for (int k = 0; k < (kPair ? 2 : 1); ++k) {
      o.in_out[k] += ix * p.in_out_stride[k].s[i];
      o.in_lse[k] += ix * p.in_lse_stride[k].s[i];
    }
    o.out += ix * p.out_stride.s[i];
    o.lse += ix * p.lse_stride.s[i];
  }
  return o;
}

template <typename T>
__device__ __forceinline__ void zero_row(T* out, float* lse, int lane, int group, int num_chunks) {
  using V = mla_common::Vec8<T>;
  const float zero[8] = {};
  for (int c = lane; c < num_chunks; c += group) V::store(out + c * 8, V::from_float(zero));
  if (lane == 0) *lse = INFINITY;
}

// Chunks c0, c0 + group, ... (kUnroll of them, those < num_chunks) of one input row.
template <typename T>
__device__ __forceinline__ void load_batch(const T* src, int c0, int group, int num_chunks,
                                           typename mla_common::Vec8<T>::Raw (&raw)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (c0 + u * group < num_chunks) raw[u] = mla_common::Vec8<T>::load(src + (c0 + u * group) * 8);
  }
}

// Pair form. The first batch of both inputs is loaded before the LSEs arrive, so the two memory
// latencies overlap; an empty input's chunks are loaded (they are in bounds) but never used.
template <typename T>
__device__ __forceinline__ void merge_pair_row(const MergeParams& p, const RowOffsets& o, int lane, int group) {
  using V = mla_common::Vec8<T>;
  const int num_chunks = p.d / 8;
  const T* a = static_cast<const T*>(p.in_out[0]) + o.in_out[0];
  const T* b = static_cast<const T*>(p.in_out[1]) + o.in_out[1];
  T* out = static_cast<T*>(p.out) + o.out;
  typename V::Raw ra[kUnroll], rb[kUnroll];
  load_batch(a, lane, group, num_chunks, ra);
  load_batch(b, lane, group, num_chunks, rb);
  const float la = p.in_lse[0][o.in_lse[0]], lb = p.in_lse[1][o.in_lse[1]];
  const bool empty_a = mla_common::is_inf(la), empty_b = mla_common::is_inf(lb);
  if (empty_a && empty_b) return zero_row(out, p.lse + o.lse, lane, group, num_chunks);
  const float m = empty_a ? lb : empty_b ? la : fmaxf(la, lb);
  const float xa = empty_a ? 0.f : exp2f((la - m) * kLog2e);
  const float xb = empty_b ? 0.f : exp2f((lb - m) * kLog2e);
  const float sum = xa + xb;  // in [1, 2]
  const float wa = xa / sum, wb = xb / sum;
  for (int c0 = lane; c0 < num_chunks; c0 += group * kUnroll) {
    if (c0 != lane) {
      load_batch(a, c0, group, num_chunks, ra);
      load_batch(b, c0, group, num_chunks, rb);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c0 + u * group >= num_chunks) continue;
      float acc[8] = {}, f[8];
      if (!empty_a) {
        V::to_float(ra[u], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = wa * f[e];
      }
      if (!empty_b) {
        V::to_float(rb[u], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(wb, f[e], acc[e]);
      }
      V::store(out + (c0 + u * group) * 8, V::from_float(acc));
    }
  }
  if (lane == 0) p.lse[o.lse] = m + logf(sum);
}

// n-way form: the LSE pass first (max, then the sum of exp relative to it), then the weighted sum;
// empty inputs are skipped, four inputs' loads in flight at a time.
template <typename T>
__device__ __forceinline__ void merge_n_row(const MergeParams& p, const RowOffsets& o, int lane, int group) {
  using V = mla_common::Vec8<T>;
  const int num_chunks = p.d / 8;
  const float* lses = p.in_lse[0] + o.in_lse[0];
  const T* outs = static_cast<const T*>(p.in_out[0]) + o.in_out[0];
  T* out = static_cast<T*>(p.out) + o.out;
  float m = -INFINITY;
  for (int k = 0; k < p.num_inputs; ++k) {
    const float l = lses[k * p.lse_n_stride];
    if (!mla_common::is_inf(l)) m = fmaxf(m, l);
  }
  if (m == -INFINITY) return zero_row(out, p.lse + o.lse, lane, group, num_chunks);
  float sum = 0.f;
  for (int k = 0; k < p.num_inputs; ++k) {
    const float l = lses[k * p.lse_n_stride];
    if (!mla_common::is_inf(l)) sum += exp2f((l - m) * kLog2e);
  }
  const float inv_sum = 1.f / sum;  // sum >= 1: the max term is 1
  for (int c0 = lane; c0 < num_chunks; c0 += group * kUnroll) {
    float acc[kUnroll][8] = {};
#pragma unroll 4
    for (int k = 0; k < p.num_inputs; ++k) {
      const float l = lses[k * p.lse_n_stride];
      if (mla_common::is_inf(l)) continue;
      const float w = exp2f((l - m) * kLog2e) * inv_sum;
      typename V::Raw raw[kUnroll];
      load_batch(outs + k * p.out_n_stride, c0, group, num_chunks, raw);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u * group >= num_chunks) continue;
        float f[8];
        V::to_float(raw[u], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = fmaf(w, f[e], acc[u][e]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c0 + u * group < num_chunks) V::store(out + (c0 + u * group) * 8, V::from_float(acc[u]));
    }
  }
  if (lane == 0) p.lse[o.lse] = m + logf(sum);
}

template <typename T, bool kPair>
__global__ void __launch_bounds__(kThreads) merge_kernel(const __grid_constant__ MergeParams p, int group_log2) {
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int rows_per_block = kThreads >> group_log2;
  for (int64_t row = int64_t(blockIdx.x) * rows_per_block + (threadIdx.x >> group_log2); row < p.num_rows;
       row += int64_t(gridDim.x) * rows_per_block) {
    const RowOffsets o = row_offsets<kPair>(p, row);
    if constexpr (kPair) merge_pair_row<T>(p, o, lane, group);
    else merge_n_row<T>(p, o, lane, group);
  }
}

template <typename T>
cudaError_t launch_merge(const MergeParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  const int num_chunks = p.d / 8;
  int group_log2 = 0;  // G = min(32, pow2ceil(num_chunks / kUnroll)): every lane has kUnroll chunks in flight
  while ((1 << group_log2) * kUnroll < num_chunks && group_log2 < 5) ++group_log2;
  const int64_t rows_per_block = kThreads >> group_log2;
  // Enough blocks to fill the GPU many times over; huge row counts loop (grid-stride).
  const int64_t blocks = std::min<int64_t>((p.num_rows + rows_per_block - 1) / rows_per_block, int64_t(1) << 20);
  if (p.pair) {
    merge_kernel<T, true><<<int(blocks), kThreads, 0, stream>>>(p, group_log2);
  } else {
    merge_kernel<T, false><<<int(blocks), kThreads, 0, stream>>>(p, group_log2);
  }
  return cudaGetLastError();
}

}  // namespace mla_merge
