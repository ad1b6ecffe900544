// Split-KV scheduler, on the device so that mla_decode stays CUDA-graph safe (no host sync).
// The algorithm is specified once in python/mla_attn/metadata.py (schedule_cpu); this kernel must
// produce the same tensors bit for bit (tests compare them).
#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/decode.h"

namespace mla_decode {

constexpr int kMetadataThreads = 256;

// One CTA: all threads stage the per-request block counts in shared memory and sum their cost;
// a few threads test the part costs of the split walk (metadata.py: split_payload), then those of
// a whole-request partition (whole_request_capacity), one each; thread 0 then walks the requests
// (inherently sequential) without reading global memory.
// deterministic: a part never cuts a request; a part that is still empty takes its next request
// whole, however long, so every request is summed by one CTA in key order, whatever the batch.
__global__ void __launch_bounds__(kMetadataThreads)
    decode_metadata_kernel(const int* cache_seqlens, int batch, int num_sm_parts, int num_sms,
                           bool deterministic, ScheduleRow* tile_sched, int* req_splits) {
  extern __shared__ int num_blocks[];  // [batch]
  __shared__ long long warp_totals[kMetadataThreads / 32];
  __shared__ int warp_max_cost[kMetadataThreads / 32];
  __shared__ int split_cost, whole_capacity;
  const int tid = threadIdx.x;
  long long total = 0;
  int max_cost = 0;
  for (int b = tid; b < batch; b += kMetadataThreads) {
    num_blocks[b] = mla_common::ceil_div(max(cache_seqlens[b], 0), kBlockN);
    total += num_blocks[b] + kFixedSplitCost;
    max_cost = max(max_cost, num_blocks[b] + kFixedSplitCost);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    total += __shfl_xor_sync(0xffffffff, total, o);
    max_cost = max(max_cost, __shfl_xor_sync(0xffffffff, max_cost, o));
  }
  if (tid % 32 == 0) {
    warp_totals[tid / 32] = total;
    warp_max_cost[tid / 32] = max_cost;
  }
  if (tid == 0) split_cost = whole_capacity = INT_MAX;
  for (int part = num_sm_parts + tid; part < num_sms; part += kMetadataThreads) {
    tile_sched[part] = ScheduleRow{.last_request = -1};  // no request; the rest 0
  }
  __syncthreads();
  total = 0;
  max_cost = 0;
  for (int w = 0; w < kMetadataThreads / 32; ++w) {
    total += warp_totals[w];
    max_cost = max(max_cost, warp_max_cost[w]);
  }
  // Part cost of the split walk (metadata.py: split_payload): thread t tests lo + t below the upper
  // end; deterministic walks take the upper end.
  const long long base = (total + num_sm_parts - 1) / num_sm_parts, upper = base + kFixedSplitCost;
  const long long search_lo = max(base, min((long long)(kMinSearchedPiece + kFixedSplitCost), upper));
  if (search_lo + tid < upper && !deterministic) {
    const long long candidate = search_lo + tid;
    int b = 0, blk = 0;
    for (int part = 0; part < num_sm_parts && b < batch; ++part) {
      long long remain = candidate;
      while (b < batch) {
        const int rest = num_blocks[b] - blk;
        if (rest + kFixedSplitCost <= remain) {
          remain -= rest + kFixedSplitCost;
          ++b; blk = 0;
        } else {
          blk += int(max(remain - kFixedSplitCost, 0ll));
          break;
        }
      }
    }
    if (b >= batch) atomicMin(&split_cost, int(candidate));
  }
  __syncthreads();
  long long payload = min((long long)split_cost, upper);
  // Thread t tests capacity lo + t: do whole requests, taken in order, fit in num_sm_parts parts?
  const long long lo = max((long long)max_cost, (total + num_sm_parts - 1) / num_sm_parts);
  const long long capacity = lo + tid;
  static_assert(kFixedSplitCost + kNoSplitSlack < kMetadataThreads, "one thread per candidate cost");
  if (batch > 0 && capacity <= payload + kNoSplitSlack) {
    int parts = 1;
    long long load = 0;
    for (int b = 0; b < batch && parts <= num_sm_parts; ++b) {
      const int cost = num_blocks[b] + kFixedSplitCost;
      if (load + cost > capacity) { ++parts; load = 0; }
      load += cost;
    }
    if (parts <= num_sm_parts) atomicMin(&whole_capacity, int(capacity));
  }
  __syncthreads();
  if (tid == 0) {
    if (whole_capacity != INT_MAX) {  // no request is cut: the walk below with that payload never splits
      payload = whole_capacity;
      deterministic = true;
    }
    int b = 0, blk = 0, split = 0, slot = 0, split_requests = 0;
    for (int part = 0; part < num_sm_parts; ++part) {
      ScheduleRow& row = tile_sched[part];
      row.first_request = b < batch ? b : 0; row.first_block = b < batch ? blk : 0;
      row.first_split = b < batch ? split : 0;
      row.first_seqlen = 0; row.split_list = 0; row.reserved = 0;
      const int first_b = b;
      int last_b = b < batch ? b - 1 : -1, last_hi = 0;
      long long remain = payload;
      while (b < batch) {
        const int n = num_blocks[b];
        const int rest = n - blk;
        if (rest + kFixedSplitCost <= remain || part == num_sm_parts - 1 ||
            (deterministic && last_b < first_b)) {
          remain -= rest + kFixedSplitCost;
          const int num_splits = split + 1;
          req_splits[2 * b] = num_splits;
          req_splits[2 * b + 1] = slot;
          if (num_splits > 1) {
            slot += num_splits;
            // The split list (metadata.py): a split request ends in a part after its i-th boundary,
            // so row i has been initialised by then.
            tile_sched[split_requests++].split_list = b + 1;
          }
          last_b = b; last_hi = n;
          ++b; blk = 0; split = 0;
        } else {
          const long long take = deterministic ? 0 : remain - kFixedSplitCost;
          if (take > 0) { last_b = b; last_hi = blk + int(take); blk += int(take); ++split; }
          break;
        }
      }
      row.last_request = last_b; row.last_end_block = last_hi;
    }
  }
  __syncthreads();  // thread 0's rows are visible to the block
  // The length of each part's first request rides along in the schedule: at the split kernel's
  // start a CTA needs it for its first Q and K addresses, and reading cache_seqlens there was one
  // more dependent global load before them.
  for (int part = tid; part < num_sm_parts; part += kMetadataThreads) {
    ScheduleRow& row = tile_sched[part];
    row.first_seqlen = row.last_request >= row.first_request ? cache_seqlens[row.first_request] : 0;
  }
}

cudaError_t run_decode_metadata(const int* cache_seqlens, int batch, int num_sm_parts, int num_sms,
                                bool deterministic, ScheduleRow* tile_sched, int* req_splits,
                                cudaStream_t stream) {
  const int smem = batch * int(sizeof(int));
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(decode_metadata_kernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  decode_metadata_kernel<<<1, kMetadataThreads, smem, stream>>>(
      cache_seqlens, batch, num_sm_parts, num_sms, deterministic, tile_sched, req_splits);
  return cudaGetLastError();
}

}  // namespace mla_decode
