// Merges the partials of split requests (rows in q's dtype or fp32: Partial; fp32 LSE) by their LSE
// into the final out / lse.
//
// At most num_sm_parts - 1 requests are split (one per part boundary): with more requests than that
// the grid covers the scheduler's list of split requests instead of the batch (a CTA for every row of
// many unsplit requests took long just to start and exit).
// Grid (requests, ceil(max_rows / rows per CTA), chunks), 4 warps, kWarpsPerRow of them per query
// row and chunk of 512 / chunks columns. With >= 2048 rows in those requests each warp merges a row
// of its own, with no barrier (at h_q 128 a CTA per row took two waves of CTAs); with fewer, a
// row's splits are spread over the 4 warps of a CTA (one row
// per CTA), and the launcher picks chunks so that a batch of few rows still spreads over the SMs.
// The row's warps write its split weights exp(lse_s - lse) to shared memory; lanes form groups of
// kThreadsPerSplit (a split's chunk, 16-byte loads of 8 values, coalesced), each group sums splits g, g + groups,
// ..., and the groups' sums are added by shuffles (and across warps through shared memory).
// Launched with programmatic dependent launch right behind the split kernel; griddepcontrol.wait
// makes the partials visible (plain loads, never __ldg, because the predecessor wrote them).
// CTAs without a row to merge return before that wait.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/shared/packed_pair.cuh"
#include "mla_decode/params.h"
#include "mla_decode/shared/query_span.cuh"

namespace mla_decode {

constexpr int kCombineWarps = 4;
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kCombineMaxChunks = 32;  // 16 columns (2 lanes) per split row at most

// Column chunks per row: enough (row, chunk) pairs for ~4 CTAs per SM when the batch has few rows
// (a power of 2).
inline int combine_chunks(int requests, int max_rows) {
  int chunks = 1;
  while (chunks < kCombineMaxChunks && int64_t(requests) * max_rows * chunks < 512) chunks *= 2;
  return chunks;
}
// A warp per row once that still makes >= 512 CTAs; otherwise the 4 warps of a CTA share a row.
inline int combine_warps_per_row(int requests, int max_rows) {
  return int64_t(requests) * max_rows >= 512 * kCombineWarps ? 1 : kCombineWarps;
}

template <typename Element, typename Partial, int kChunks, int kWarpsPerRow>
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(__grid_constant__ const DecodeParams p) {
  static_assert(std::is_same_v<Partial, Element> || std::is_same_v<Partial, float>, "partials: q's dtype or fp32");
  // A split's chunk is kUnits units of 8 columns (16 bytes of 16-bit partial, 32 of fp32), summed by kThreadsPerSplit
  // lanes with kPerThread units each; kSplitsPerPass splits are in flight per pass over the row's warps.
  constexpr int kUnits = kHeadDimV / 8 / kChunks;
  constexpr int kThreadsPerSplit = kUnits < 32 ? kUnits : 32;
  constexpr int kGroupsPerWarp = 32 / kThreadsPerSplit;
  constexpr int kPerThread = kUnits / kThreadsPerSplit, kSplitsPerPass = kWarpsPerRow * kGroupsPerWarp;
  constexpr int kRowsPerCta = kCombineWarps / kWarpsPerRow;
  __shared__ float row_weights[kRowsPerCta][kMaxSmParts];  // a request has at most num_sm_parts splits
  __shared__ float row_reduce_buffer[kWarpsPerRow > 1 ? kCombineWarps : 1];
  __shared__ float warp_sums[kWarpsPerRow > 1 ? kCombineWarps : 1][kUnits][8];
  // Which row this CTA merges, if any, from what was written before the split kernel started (the
  // metadata, cu_seqlens_q): a CTA with nothing to merge exits without waiting for the split kernel
  // (as FlashMLA's combine does), so a batch with few or no split requests ends sooner.
  // blockIdx.x: the request, or with fewer CTAs than requests the entry of the split list
  // (ScheduleRow::split_list: b + 1 of the x-th split request, 0 past the last).
  const int b = int(gridDim.x) == p.batch ? int(blockIdx.x) : p.tile_sched[blockIdx.x].split_list - 1;
  if (b < 0 || b >= p.batch) return;
  const int chunk = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.y * kRowsPerCta + warp / kWarpsPerRow;
  // Written directly by the split kernel when not split; clamped into the workspace as partial_slot.
  const int slots = split_partial_slots(p.num_sm_parts), slot0 = min(max(p.req_splits[2 * b + 1], 0), slots - 1);
  const int num_splits = min(p.req_splits[2 * b], min(slots - slot0, kMaxSmParts));
  if (num_splits <= 1) return;
  const QuerySpan span = QuerySpan::of(p, b);
  const int first_token = span.first, seqlen_q = span.count;
  if (row >= seqlen_q * p.num_heads_q) return;
  mla_common::grid_dependency_wait();  // the split kernel's partials are visible from here on

  const int m_block = row / kBlockM, row_in_tile = row % kBlockM;
  auto partial_row = [&](int split) {
    return (int64_t(slot0 + split) * p.num_q_tiles + m_block) * kBlockM + row_in_tile;
  };
  // Max or sum over the row's warps (for several, the CTA is one row: block-wide barriers).
  auto row_reduce = [&](float v, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xffffffff, v, o);
      v = is_max ? fmaxf(v, other) : v + other;
    }
    if constexpr (kWarpsPerRow > 1) {
      if (lane == 0) row_reduce_buffer[warp] = v;
      __syncthreads();
      v = row_reduce_buffer[0];
#pragma unroll
      for (int w = 1; w < kWarpsPerRow; ++w) v = is_max ? fmaxf(v, row_reduce_buffer[w]) : v + row_reduce_buffer[w];
      __syncthreads();
    }
    return v;
  };

  // The row's warps load the split LSEs once between them, several loads per lane in flight (one
  // split per SM at batch 1; each warp loading all of them was slower there).
  float* weights = row_weights[warp / kWarpsPerRow];
  const int row_lane = (warp % kWarpsPerRow) * 32 + lane;
  constexpr int kRowThreads = 32 * kWarpsPerRow, kLseInFlight = 4;
  float max_lse = -INFINITY;
  for (int s0 = row_lane; s0 < num_splits; s0 += kRowThreads * kLseInFlight) {
    float lse[kLseInFlight];
#pragma unroll
    for (int i = 0; i < kLseInFlight; ++i) {
      const int s = s0 + kRowThreads * i;
      lse[i] = s < num_splits ? p.partial_lse[partial_row(s)] : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kLseInFlight; ++i) {
      if (s0 + kRowThreads * i < num_splits) weights[s0 + kRowThreads * i] = lse[i];
      max_lse = fmaxf(max_lse, lse[i]);
    }
  }
  max_lse = row_reduce(max_lse, true);
  const bool empty = max_lse == -INFINITY;  // no split saw a key
  float sum = 0.f;
  for (int s = row_lane; s < num_splits; s += kRowThreads) {
    weights[s] = empty ? 0.f : expf(weights[s] - max_lse);  // 0 for empty splits (lse -inf)
    sum += weights[s];
  }
  sum = row_reduce(sum, false);  // its barrier (or this one) orders the weight writes before the reads below
  __syncwarp();
  // With a sink: e^lse / (e^lse + e^sink) folded in, e^lse = sum e^max_lse (denominator_with_sink in
  // natural-log units).
  const float inv_sum = empty ? 0.f : 1.f / (p.attn_sink ? sum + expf(p.attn_sink[QueryRow::of(p, row).head] - max_lse) : sum);

  // An empty split's partial is 0 (it wrote O * 0), so every split can be summed unconditionally.
  const int lane_in_split = lane % kThreadsPerSplit;
  const int first_split = (warp % kWarpsPerRow) * kGroupsPerWarp + lane / kThreadsPerSplit;
  float acc[kPerThread][8] = {};
#pragma unroll 4
  for (int s = first_split; s < num_splits; s += kSplitsPerPass) {
    const float w = weights[s] * inv_sum;
    if constexpr (std::is_same_v<Partial, float>) {  // a unit of 8 columns is two float4
      const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.partial_out) +
                                                          partial_row(s) * kHeadDimV) + 2 * chunk * kUnits;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int unit = lane_in_split + kThreadsPerSplit * j;
        const float4 lo = src[2 * unit], hi = src[2 * unit + 1];
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[j][c] += w * v[c];
      }
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const Element*>(p.partial_out) +
                                                        partial_row(s) * kHeadDimV) + chunk * kUnits;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const uint4 v = src[lane_in_split + kThreadsPerSplit * j];
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 pair = unpack_pair<Element>(words[q]);
          acc[j][2 * q] += w * pair.x;
          acc[j][2 * q + 1] += w * pair.y;
        }
      }
    }
  }
#pragma unroll
  for (int o = kThreadsPerSplit; o < 32; o *= 2) {  // add the split groups' sums
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[j][c] += __shfl_xor_sync(0xffffffff, acc[j][c], o);
    }
  }
  if constexpr (kWarpsPerRow > 1) {  // the CTA is one row: add the warps' sums
    if (lane < kThreadsPerSplit) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
#pragma unroll
        for (int c = 0; c < 8; ++c) warp_sums[warp][lane + kThreadsPerSplit * j][c] = acc[j][c];
      }
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
#pragma unroll
      for (int w = 1; w < kWarpsPerRow; ++w) {
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[j][c] += warp_sums[w][lane_in_split + kThreadsPerSplit * j][c];
      }
    }
  }
  if (first_split != 0) return;
  const QueryRow q = QueryRow::of(p, row);
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + (first_token + q.token) * p.out_token_stride +
                 q.head * p.out_head_stride + 8 * chunk * kUnits;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    uint4 packed;
    packed.x = pack_pair<Element>(acc[j][0], acc[j][1]);
    packed.y = pack_pair<Element>(acc[j][2], acc[j][3]);
    packed.z = pack_pair<Element>(acc[j][4], acc[j][5]);
    packed.w = pack_pair<Element>(acc[j][6], acc[j][7]);
    reinterpret_cast<uint4*>(out)[lane_in_split + kThreadsPerSplit * j] = packed;
  }
  if (chunk == 0 && lane == 0) {
    p.lse[b * p.lse_batch_stride + (first_token + q.token) * p.lse_token_stride + q.head * p.lse_head_stride] =
        empty ? INFINITY : max_lse + logf(sum);
  }
}

}  // namespace mla_decode
