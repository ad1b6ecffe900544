// What the 64-row decode kernels (decode_kernel.cuh, seesaw_kernel.cuh) share around their main
// loops: the Q tile load, the causal bound of a row, and the store of a finished output tile.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <type_traits>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/schedule.cuh"

namespace mla_decode {

// Two floats -> a packed pair of Element (cutlass::bfloat16_t or cutlass::half_t), first lowest.
template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  }
  return bits;
}
// Q tile of q-tile blockIdx.x in segment `s`: 16-byte cp.async copies into the swizzled layout, all in
// flight at once (rows past the request are zero-filled), by math threads 0..255. Thread t copies
// chunks t % 4, t % 4 + 4, ... of row t / 4, so the row's address math is done once. Completion:
// cp_async_wait_all, then a fence and a barrier over the math threads.
template <typename Element, typename SmemLayoutQ, typename SmemElement>
__device__ __forceinline__ void issue_q_tile_load(const DecodeParams& p, const Segment& s, SmemElement* q_smem) {
  constexpr int kChunks = kHeadDimK / 8, kThreadsPerRow = 256 / kBlockM;
  cute::Tensor sQ = cute::make_tensor(cute::make_smem_ptr(q_smem), SmemLayoutQ{});
  // An opaque thread index: otherwise the compiler hoists the 18 swizzled offsets out of the loop
  // over requests and holds them across it.
  const int thread = mla_common::opaque(int(threadIdx.x)), r = thread / kThreadsPerRow, row = int(blockIdx.x) * kBlockM + r;
  const bool valid = row < s.seqlen_q * p.num_heads_q;
  const auto q = QRow<Element>::at(p, s, valid ? row / p.num_heads_q : 0, valid ? row % p.num_heads_q : 0);
#pragma unroll
  for (int c = thread % kThreadsPerRow; c < kChunks; c += kThreadsPerRow) {
    const Element* src = (c < kHeadDimV / 8 ? q.nope : q.pe) + c * 8;
    mla_common::cp_async_16(&sQ(r, c * 8), valid ? src : p.q_nope, valid);
  }
}

// Last key (inclusive) query row `row` of the segment's request sees: bottom-right causal alignment.
__device__ __forceinline__ int last_visible_key(const DecodeParams& p, const Segment& seg, int row) {
  const int t = row / p.num_heads_q;
  return p.causal ? min(seg.seqlen_k - seg.seqlen_q + t, seg.seqlen_k - 1) : seg.seqlen_k - 1;
}

// Sum over the 4 lanes of a quad (the threads that share a row of an accumulator).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 1);
  return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// Normalises and stores this thread's part of a finished 64-row output tile: rows r0 and r0 + 8
// (element e of tOrO is in row r0 + 8 ((e >> 1) & 1), column col_of(e); e, e + 1 are adjacent
// columns), with running max row_max (log2 units) and denominator row_total. The final row of the
// request, or an fp32 partial + LSE for combine_kernel.cuh when the request is split. out_scale
// multiplies every value (an fp8 cache's k_scale). LSE: natural log, +inf (final) or -inf (partial)
// for a row with no visible key; written by the threads with write_lse and lane % 4 == 0.
template <typename Element, typename TensorO, typename ColumnOf>
__device__ __forceinline__ void store_output_tile(const DecodeParams& p, const Segment& seg, int m_block, int r0,
                                                  const float (&row_max)[2], const float (&row_total)[2],
                                                  float out_scale, bool write_lse, const TensorO& tOrO,
                                                  ColumnOf&& col_of) {
  const int rows_in_request = seg.seqlen_q * p.num_heads_q;
  const bool is_partial = p.req_splits[2 * seg.b] > 1;
  const int slot = p.req_splits[2 * seg.b + 1] + seg.split;
  float inv_sum[2];
  float* partial_row[2];
  Element* out_row[2];
  bool row_valid[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i, row = m_block * kBlockM + r;
    const float total = row_total[i];
    const bool empty = total == 0.f;  // no visible key in this split
    inv_sum[i] = empty ? 0.f : out_scale / total;
    const float lse = empty ? (is_partial ? -INFINITY : INFINITY) : (row_max[i] + __log2f(total)) * float(M_LN2);
    row_valid[i] = row < rows_in_request;
    const int t = row / p.num_heads_q, h = row % p.num_heads_q;
    const int64_t partial_index = (int64_t(slot) * p.num_q_tiles + m_block) * kBlockM + r;
    partial_row[i] = p.partial_out + partial_index * kHeadDimV;
    out_row[i] = static_cast<Element*>(p.out) + seg.b * p.out_batch_stride + (seg.first_token + t) * p.out_token_stride +
                 h * p.out_head_stride;
    if (row_valid[i] && write_lse && threadIdx.x % 4 == 0) {
      if (is_partial) {
        p.partial_lse[partial_index] = lse;
      } else {
        p.lse[seg.b * p.lse_batch_stride + (seg.first_token + t) * p.lse_token_stride + h * p.lse_head_stride] = lse;
      }
    }
  }
#pragma unroll
  for (int e = 0; e < cute::size(tOrO); e += 2) {
    const int i = (e >> 1) & 1;
    if (!row_valid[i]) continue;
    const int col = col_of(e);
    const float v0 = tOrO(e) * inv_sum[i], v1 = tOrO(e + 1) * inv_sum[i];
    if (is_partial) {
      *reinterpret_cast<float2*>(partial_row[i] + col) = make_float2(v0, v1);
    } else {
      const Element pair[2] = {Element(v0), Element(v1)};  // 4-byte aligned: strides are 16-byte multiples
      *reinterpret_cast<uint32_t*>(out_row[i] + col) = *reinterpret_cast<const uint32_t*>(pair);
    }
  }
}

}  // namespace mla_decode
