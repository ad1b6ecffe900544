// KV-cache write and gather kernels. Memory-bound copies: one thread per 8-element chunk of a
// 576-wide cache row (72 chunks: 64 of kv_c, 8 of k_pe), so consecutive threads touch consecutive
// 16-byte pieces of one row; blocks stride over (row, chunk). fp32 only for conversions; same-type
// copies move raw bits.
#pragma once
#include <algorithm>
#include <type_traits>

#include "common/vec8.cuh"
#include "kv_cache/kv_cache.h"

namespace mla_kv_cache {

constexpr int kThreads = 256;
constexpr int kChunksLatent = kDimLatent / 8;
constexpr int kChunksRow = kDimRow / 8;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // beyond this, blocks loop

using mla_common::Vec8;
using Fp8 = __nv_fp8_e4m3;

// Calls f(row, chunk) for every 8-value chunk of num_rows 576-wide rows, blocks striding over them.
template <typename F>
__device__ __forceinline__ void for_each_row_chunk(int64_t num_rows, F&& f) {
  const int64_t n = num_rows * kChunksRow;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / kChunksRow;
    f(r, int(i - r * kChunksRow));
  }
}

template <typename Tin, typename Tcache>
__global__ void __launch_bounds__(kThreads) write_kernel(const __grid_constant__ WriteParams p) {
  constexpr bool kQuantize = !std::is_same_v<Tin, Tcache>;
  static_assert(!kQuantize || std::is_same_v<Tcache, Fp8>);
  const float scale = kQuantize ? __ldg(p.k_scale) : 1.f;
  for_each_row_chunk(p.num_tokens, [&](int64_t t, int c) {
    const Tin* src = c < kChunksLatent
                         ? static_cast<const Tin*>(p.kv_c) + t * p.kv_c_stride + c * 8
                         : static_cast<const Tin*>(p.k_pe) + t * p.k_pe_stride + (c - kChunksLatent) * 8;
    const auto raw = Vec8<Tin>::load(src);  // issued together with the slot load (one memory latency)
    const int64_t slot = __ldg(p.slot_mapping + t * p.slot_stride);
    if (slot < 0 || slot >= p.num_slots) return;  // padding token; a slot past the cache is never written
    const int64_t page = slot / p.page_size;
    Tcache* dst = static_cast<Tcache*>(p.cache) + page * p.page_stride + (slot - page * p.page_size) * p.token_stride +
                  c * 8;
    if constexpr (!kQuantize) {
      Vec8<Tcache>::store(dst, raw);
    } else {
      float f[8];
      Vec8<Tin>::to_float(raw, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = __fdiv_rn(f[e], scale);  // IEEE division, as on the CPU
      Vec8<Fp8>::store(dst, Vec8<Fp8>::from_float(f));
    }
  });
}

// Row r < cu[batch] is token r - cu[b] of the request b with cu[b] <= r < cu[b + 1] (binary search:
// zero-length requests are skipped over). Returns its cache row, or nullptr for rows past the batch
// and for page ids outside the cache (garbage in: zeros out, never an out-of-bounds read).
template <typename Tcache>
__device__ __forceinline__ const Tcache* find_row(const GatherParams& p, int64_t r, int total) {
  if (r >= total) return nullptr;
  int lo = 0, hi = p.batch;  // invariant: cu[lo] <= r < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(p.cu_seqlens + mid) <= r) lo = mid;
    else hi = mid;
  }
  // Subtracted in 64 bits: cu[lo] is unchecked (r - INT_MIN overflows an int). A valid position is at
  // most r, so the rest stays in 32 bits.
  const int64_t pos64 = r - __ldg(p.cu_seqlens + lo);
  if (pos64 < 0 || pos64 > INT32_MAX) return nullptr;
  const int pos = int(pos64);
  const int j = pos / p.page_size;
  if (j >= p.max_pages) return nullptr;
  const int page = __ldg(p.block_table + lo * p.block_table_stride + j);
  if (page < 0 || page >= p.num_pages) return nullptr;
  return static_cast<const Tcache*>(p.cache) + page * p.page_stride + (pos - j * p.page_size) * p.token_stride;
}

template <typename Tcache, typename Tout>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ GatherParams p) {
  constexpr bool kDequantize = std::is_same_v<Tcache, Fp8>;
  const float scale = kDequantize ? __ldg(p.k_scale) : 1.f;
  const int total = __ldg(p.cu_seqlens + p.batch);
  for_each_row_chunk(p.num_tokens, [&](int64_t r, int c) {
    Tout* dst = static_cast<Tout*>(p.out) + r * kDimRow + c * 8;
    const Tcache* row = find_row<Tcache>(p, r, total);
    if (row == nullptr) {
      const float zero[8] = {};
      Vec8<Tout>::store(dst, Vec8<Tout>::from_float(zero));
      return;
    }
    const auto raw = Vec8<Tcache>::load(row + c * 8);
    if constexpr (std::is_same_v<Tcache, Tout>) {
      Vec8<Tout>::store(dst, raw);
    } else {
      float f[8];
      Vec8<Tcache>::to_float(raw, f);
      if constexpr (kDequantize) {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] *= scale;
      }
      Vec8<Tout>::store(dst, Vec8<Tout>::from_float(f));
    }
  });
}

inline int num_blocks(int64_t items) {
  return int(std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
}

}  // namespace mla_kv_cache
