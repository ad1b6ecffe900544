// compact_sparse_indices: per row of top-k indices, the valid ones (0 <= idx < num_slots, position <
// topk_length) moved in order to the front of the row, -1 after them, and their count. The output is
// the block_table / cache_seqlens pair of a kv_slots decode call: each row is one "request" whose keys
// are the listed cache slots.
//
// Grid: one CTA per row (rows are short, about 2048 indices, and many: one per query token), so a row
// needs no inter-CTA communication and the whole op is one launch without a host sync.
// A CTA walks its row in tiles of kThreads * kItems indices. Each thread owns kItems consecutive
// positions (its count of valid ones is an exclusive scan away from where it writes), the warps scan
// their threads' counts with shuffles, and the first warp scans the warp totals. The order of the valid indices is kept, so the dense kernel sums keys in the caller's order.
#include "sparse/compact_indices.h"

namespace mla_sparse {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 8;  // positions per thread and tile: a 2048-index row is one tile
constexpr int kTile = kThreads * kItems;
static_assert(kTile == kCompactTile, "the bindings bound topk by kCompactTile");
static_assert(kWarps <= 32, "the warp totals are scanned by one warp");

// Inclusive scan of v over the lanes of a warp.
__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

__global__ void __launch_bounds__(kThreads) compact_kernel(const __grid_constant__ CompactParams p) {
  __shared__ int warp_offsets[kWarps];  // per tile: valid indices of the warps before each warp
  __shared__ int tile_total;
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int* in = p.indices + row * p.indices_stride;
  int* out = p.slots + row * int64_t(p.topk);
  int length = p.topk;
  if (p.topk_length != nullptr) {
    // Out-of-range lengths are clamped here (the value checks reject them when asked to).
    length = min(max(p.topk_length[row * p.topk_length_stride], 0), p.topk);
  }

  int written = 0;  // valid indices of the tiles before this one (uniform over the CTA)
  for (int base = 0; base < length; base += kTile) {
    const int first = base + threadIdx.x * kItems;
    int idx[kItems];
    bool valid[kItems];
    int mine = 0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int pos = first + k;
      idx[k] = pos < length ? in[pos] : -1;
      valid[k] = pos < length && idx[k] >= 0 && idx[k] < p.num_slots;
      mine += valid[k];
    }
    const int incl = warp_inclusive_scan(mine, lane);
    if (lane == 31) warp_offsets[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int t = lane < kWarps ? warp_offsets[lane] : 0;
      const int t_incl = warp_inclusive_scan(t, lane);
      if (lane < kWarps) warp_offsets[lane] = t_incl - t;
      if (lane == kWarps - 1) tile_total = t_incl;
    }
    __syncthreads();
    int at = written + warp_offsets[warp] + incl - mine;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (valid[k]) out[at++] = idx[k];
    }
    written += tile_total;
    __syncthreads();  // the next tile rewrites warp_offsets and tile_total
  }
  // The tail is defined (-1) so that the result depends on the inputs only; the decode kernel reads
  // the first counts[row] entries alone.
  for (int j = written + threadIdx.x; j < p.topk; j += kThreads) out[j] = -1;
  if (threadIdx.x == 0) p.counts[row] = written;
}

}  // namespace

cudaError_t run_compact_sparse_indices(const CompactParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  compact_kernel<<<dim3(unsigned(params.rows)), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mla_sparse
