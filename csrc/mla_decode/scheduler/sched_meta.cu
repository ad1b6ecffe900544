// Split-KV scheduler, on the device so that mla_decode stays CUDA-graph safe (no host sync).
// The algorithm is specified once in python/mla_attn/metadata.py (schedule_cpu); this kernel must
// produce the same tensors bit for bit (tests compare them).
//
// Cost space: request b costs c_b = blocks + kFixedSplitCost and spans [S_b, S_b+1) of the prefix
// sums S (S_0 = 0, S_batch = total); block k of it sits at S_b + k. A part starts at a position x
// (request b, block x - S_b; never in a request's last kFixedSplitCost positions) and ends where
// the next one starts. With part cost C, the walk of schedule_cpu moves the start x to:
//   total                              if x + C >= total (it takes everything), else, with e the
//                                      request holding y = x + C (S_e <= y < S_e+1):
//   max(y - kFixedSplitCost, S_e)      splitting: whole pieces up to S_e, then e cut after
//                                      y - kFixedSplitCost - S_e blocks when that is positive (a
//                                      cut piece pays the fixed cost again, hence the shift);
//   S_max(b+1, e)                      whole requests (x = S_b): requests up to e, at least one.
// A split walk moves x by piece = C - kFixedSplitCost while no part ends at a request start; a part
// that does (S_e in (y - kFixedSplitCost, y]) moves every later start by S_e - (y - kFixedSplitCost),
// 1 to kFixedSplitCost. So a warp places 32 parts per round (fewer only where the walk ends), stops
// or not (walk_split_parts): lane l takes part p + l at x + l piece + shift, shift being what the
// stops before it added; each stop costs a ballot, not a search.
// A whole walk moves from request to request, so a warp finds the next request of 32 consecutive
// ones at once and follows the chain through them (walk_whole_parts). Every output follows from the
// part starts in parallel.
#include <climits>
#include "mla_decode/config.h"
#include "mla_decode/decode.h"

namespace mla_decode {

// 16 warps: every walk the schedule may need (kNumWalks) runs on a warp of its own, at once.
constexpr int kMetadataThreads = 512;
constexpr int kMetadataWarps = kMetadataThreads / 32;
// split_payload's candidates [lo, base + kFixedSplitCost) with lo >= base; the upper end's walk
// (deterministic: whole requests); whole_request_capacity's candidates [max(max cost, base),
// base + kFixedSplitCost + kNoSplitSlack].
constexpr int kSplitWalks = kFixedSplitCost;
constexpr int kUpperWalk = kSplitWalks;
constexpr int kFirstCapacityWalk = kUpperWalk + 1;
constexpr int kCapacityWalks = kFixedSplitCost + kNoSplitSlack + 1;
constexpr int kNumWalks = kFirstCapacityWalk + kCapacityWalks;
static_assert(kNumWalks <= kMetadataWarps, "one warp per walk");
static_assert(kMaxSmParts < (1 << 15), "part counts pack two to an int in the part scan");
// Dynamic shared memory the kernel asks for at most; the prefix sums move to global memory (req_splits,
// before its values are written) when the batch would need more. Below the 227 KiB of an sm_90 CTA.
constexpr int kMetadataSmemLimit = 200 * 1024;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int num_kv_blocks(int seqlen) {  // without overflow up to INT_MAX
  return seqlen > 0 ? int((unsigned(seqlen) + kBlockN - 1) / kBlockN) : 0;
}

// The number of entries of the ascending a[0, n) that are <= v.
__device__ __forceinline__ int count_le(const long long* a, int n, long long v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a[mid] <= v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Inclusive prefix sum of v over the CTA (all threads call it); *total: the sum over the CTA.
template <typename T>
__device__ __forceinline__ T block_inclusive_scan(T v, T* warp_sums, T* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const T u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  T before = 0, sum = 0;
  for (int w = 0; w < kMetadataWarps; ++w) {
    if (w < warp) before += warp_sums[w];
    sum += warp_sums[w];
  }
  __syncthreads();  // warp_sums is rewritten by the next call
  *total = sum;
  return before + v;
}

// The first request start above v (total if none): t = incl[k] = S_k+1, k moving forward only.
__device__ __forceinline__ void first_start_above(const long long* incl, int batch, long long total,
                                                  long long v, int& k, long long& t) {
  while (k < batch && t <= v) {
    ++k;
    t = k < batch ? incl[k] : total;
  }
}

// One round of a split walk from x: lane l places part l (of at most max_parts) at starts[l]. Part l
// starts at x + l piece + shift and ends at y = cut + kFixedSplitCost, cut = x + (l + 1) piece + shift:
// the next part starts at cut, or at the request start in (cut, y] if there is one (the part stops
// there; S_e <= y < S_e+1 and y - kFixedSplitCost < S_e), or takes the rest (y >= total). shift, 0
// at first, grows by 1 to kFixedSplitCost at each stop, so each lane keeps the first request start
// above its cut (t) and moves it forward when the shift grows (past one start at most). Each stop
// costs a ballot and a shuffle, not a search. Returns the parts placed; x becomes the next start.
__device__ __forceinline__ int split_round(const long long* incl, int batch, long long total, long long C,
                                           int max_parts, long long& x, long long* starts) {
  const int lane = threadIdx.x % 32;
  const long long piece = C - kFixedSplitCost;  // >= 1: C > kFixedSplitCost on every split walk
  const long long cut0 = x + (lane + 1) * piece;  // this lane's cut before any shift
  int k = count_le(incl, batch, cut0);
  long long t = k < batch ? incl[k] : total;
  const int last = min(31, max_parts - 1);  // the last lane that may place a part
  long long shift = 0, start = 0;
  int placed = 0;
  for (int first = 0;;) {  // lanes [first, last] have the current shift
    const bool live = lane >= first && lane <= last;
    const long long cut = cut0 + shift, y = cut + kFixedSplitCost;
    if (live) first_start_above(incl, batch, total, cut, k, t);
    const unsigned stopping = __ballot_sync(kFullMask, live && (y >= total || t <= y));
    const int stop = stopping ? __ffs(stopping) - 1 : last + 1;  // lanes [first, stop) end at their cut
    if (live && lane <= stop) start = cut - piece;
    if (stop > last) {
      placed = last + 1;
      x += placed * piece + shift;
      break;
    }
    const long long next = __shfl_sync(kFullMask, y >= total ? total : t, stop);
    first = stop + 1;
    if (next == total || first > last) {
      placed = first;
      x = next;
      break;
    }
    shift = next - (x + first * piece);  // part `first` starts at the request start `next`
  }
  if (lane < placed) starts[lane] = start;
  return placed;
}

// One warp walks num_sm_parts parts of cost C and writes the part starts to starts[0, num_sm_parts)
// (total for a part with no request); returns whether the parts took every request (schedule_cpu's
// last part, which takes the rest, walked like the others). incl[b] = S_b+1.
__device__ __forceinline__ bool walk_split_parts(const long long* incl, int batch, long long total,
                                                 int num_sm_parts, long long C, long long* starts) {
  const int lane = threadIdx.x % 32;
  long long x = 0;
  int p = 0;
  while (p < num_sm_parts && x < total) p += split_round(incl, batch, total, C, num_sm_parts - p, x, starts + p);
  for (int q = p + lane; q < num_sm_parts; q += 32) starts[q] = total;
  return x == total;
}

// Whole requests: a part starting at request r ends before next(r) = max(e, r + 1), e the request
// holding S_r + C (batch: it takes the rest). Lane l holds next(b + l); the chain from b is followed
// by shuffles while it stays among those 32 requests.
__device__ __forceinline__ bool walk_whole_parts(const long long* incl, int batch, long long total,
                                                 int num_sm_parts, long long C, long long* starts) {
  const int lane = threadIdx.x % 32;
  int b = 0, p = 0;
  while (p < num_sm_parts && b < batch) {
    const int r = b + lane;
    const long long s_r = r > 0 && r <= batch ? incl[r - 1] : 0;
    int next = batch;
    if (r < batch && s_r + C < total) next = max(count_le(incl, batch, s_r + C), r + 1);
    for (int cur = 0;;) {
      if (lane == cur) starts[p] = s_r;
      ++p;
      const int n = __shfl_sync(kFullMask, next, cur);
      if (n < batch && n - b < 32 && p < num_sm_parts) {
        cur = n - b;
      } else {
        b = n;
        break;
      }
    }
  }
  for (int q = p + lane; q < num_sm_parts; q += 32) starts[q] = total;
  return b == batch;
}

// deterministic: a part never cuts a request; a part that is still empty takes its next request
// whole, however long, so every request is summed by one CTA in key order, whatever the batch.
// prefix_in_smem: the prefix sums fit in shared memory; otherwise req_splits holds them until its
// values are written (8-byte aligned, 8 bytes per request).
// One CTA per launch: (kMetadataThreads, 1) lets ptxas use the registers it needs (no spills).
__global__ void __launch_bounds__(kMetadataThreads, 1)
    decode_metadata_kernel(const int* cache_seqlens, int batch, int num_sm_parts, int num_sms,
                           bool deterministic, ScheduleRow* tile_sched, int* req_splits,
                           bool prefix_in_smem) {
  extern __shared__ long long smem[];
  const int P = num_sm_parts;
  long long* walk_starts = smem;                                  // [kNumWalks][P]
  int* part_request = reinterpret_cast<int*>(smem + kNumWalks * P);  // [P]
  int* part_scan = part_request + P;                              // [P]
  int* split_requests = part_scan + P;                            // [P]
  long long* incl = prefix_in_smem ? smem + kNumWalks * P + (3 * P + 1) / 2
                                   : reinterpret_cast<long long*>(req_splits);  // [batch]: S_b+1
  __shared__ long long warp_sums[kMetadataWarps];
  __shared__ int warp_ints[kMetadataWarps];
  __shared__ bool walk_fits[kNumWalks];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const auto S = [incl](int b) { return b > 0 ? incl[b - 1] : 0ll; };

  // 1. Prefix sums of the request costs, kMetadataThreads requests at a time.
  long long total = 0;
  int max_cost = 0;
  for (int chunk = 0; chunk < batch; chunk += kMetadataThreads) {
    const int b = chunk + tid;
    const int cost = b < batch ? num_kv_blocks(cache_seqlens[b]) + kFixedSplitCost : 0;
    max_cost = max(max_cost, cost);
    long long chunk_total;
    const long long sum = block_inclusive_scan<long long>(cost, warp_sums, &chunk_total);
    if (b < batch) incl[b] = total + sum;
    total += chunk_total;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) max_cost = max(max_cost, __shfl_xor_sync(kFullMask, max_cost, o));
  if (lane == 0) warp_ints[warp] = max_cost;
  for (int part = num_sm_parts + tid; part < num_sms; part += kMetadataThreads) {
    tile_sched[part] = ScheduleRow{.last_request = -1};  // no request; the rest 0
  }
  __syncthreads();
  for (int w = 0; w < kMetadataWarps; ++w) max_cost = max(max_cost, warp_ints[w]);

  // 2. The walks, a warp each (metadata.py: split_payload, whole_request_capacity, schedule_cpu).
  const long long base = (total + P - 1) / P, upper = base + kFixedSplitCost;
  const long long search_lo = max(base, min((long long)(kMinSearchedPiece + kFixedSplitCost), upper));
  const long long capacity_lo = max((long long)max_cost, base);
  if (warp < kNumWalks) {
    long long C = -1;
    bool whole = true;
    if (warp < kSplitWalks) {
      if (!deterministic && search_lo + warp < upper) C = search_lo + warp;
      whole = false;
    } else if (warp == kUpperWalk) {
      C = upper;
      whole = deterministic;
    } else if (batch > 0 && capacity_lo + (warp - kFirstCapacityWalk) <= upper + kNoSplitSlack) {
      C = capacity_lo + (warp - kFirstCapacityWalk);
    }
    long long* starts = walk_starts + warp * P;
    bool fits = false;
    if (C >= 0) {
      fits = whole ? walk_whole_parts(incl, batch, total, P, C, starts) : walk_split_parts(incl, batch, total, P, C, starts);
    }
    if (lane == 0) walk_fits[warp] = fits;
  }
  __syncthreads();
  // The smallest split cost that fits, else the upper end; then the smallest whole-request capacity
  // that fits within kNoSplitSlack of it (no request is cut), if any.
  int chosen = kUpperWalk;
  long long payload = upper;
  for (int k = 0; k < kSplitWalks; ++k) {
    if (walk_fits[k]) {
      chosen = k;
      payload = search_lo + k;
      break;
    }
  }
  for (int k = 0; k < kCapacityWalks; ++k) {
    if (walk_fits[kFirstCapacityWalk + k] && capacity_lo + k <= payload + kNoSplitSlack) {
      chosen = kFirstCapacityWalk + k;
      break;
    }
  }
  const long long* x = walk_starts + chosen * P;  // ascending; total once the requests run out

  // 3. Per part: the request holding its start, and whether the start cuts it (a piece after the
  // first): a prefix over parts of (cut starts) + (cut starts that begin a split request) << 16.
  for (int chunk = 0; chunk < P; chunk += kMetadataThreads) {
    const int p = chunk + tid;
    int packed = 0;
    if (p < P && x[p] < total) {
      const int b = count_le(incl, batch, x[p]);
      part_request[p] = b;
      if (x[p] > S(b)) packed = 1 + (p > 0 && x[p - 1] > S(b) ? 0 : 1 << 16);
    }
    int chunk_total;
    const int sum = block_inclusive_scan<int>(packed, warp_ints, &chunk_total);
    if (p < P) part_scan[p] = sum + (chunk > 0 ? part_scan[chunk - 1] : 0);
    __syncthreads();  // the next chunk reads this chunk's last entry
  }
  // The split list: row i names the i-th split request.
  for (int p = tid; p < P; p += kMetadataThreads) {
    const int splits = part_scan[p] >> 16;
    if (splits != (p > 0 ? part_scan[p - 1] >> 16 : 0)) split_requests[splits - 1] = part_request[p] + 1;
  }
  __syncthreads();
  const int num_split_requests = part_scan[P - 1] >> 16;

  // 4. The rows: a part ends where the next starts (the last part takes the rest).
  for (int p = tid; p < P; p += kMetadataThreads) {
    ScheduleRow row{.last_request = -1};  // no request; the rest 0
    row.split_list = p < num_split_requests ? split_requests[p] : 0;
    if (x[p] < total) {
      const int b = part_request[p];
      const long long first = S(b);
      row.first_request = b;
      row.first_block = int(x[p] - first);
      // pieces of b in earlier parts: parts starting after S_b, this one included
      row.first_split = x[p] > first ? p + 1 - count_le(x, P, first) : 0;
      row.first_seqlen = cache_seqlens[b];  // the split kernel's first addresses need it
      const long long end = p == P - 1 ? total : x[p + 1];
      const int e = count_le(incl, batch, end);
      if (end > S(e)) {  // e is cut: this part has its first end - S_e blocks
        row.last_request = e;
        row.last_end_block = int(end - S(e));
      } else {
        row.last_request = e - 1;
        row.last_end_block = int(S(e) - S(e - 1) - kFixedSplitCost);
      }
    }
    tile_sched[p] = row;
  }
  __syncthreads();  // the rows' reads of incl are done before req_splits (which may hold it) is written

  // 5. req_splits: request b has 1 + (cut starts in it) pieces; its slot counts the pieces of the
  // split requests before it: (cut starts before S_b) + (split requests before it). Chunks from the
  // last: chunk k reads incl[k * T - 1, (k + 1) * T) and writes over incl[k * T, (k + 1) * T) only.
  for (int chunk = (batch - 1) / kMetadataThreads * kMetadataThreads; chunk >= 0; chunk -= kMetadataThreads) {
    const int b = chunk + tid;
    int num_splits = 0, slot = 0;
    if (b < batch) {
      const int before = count_le(x, P, S(b) - 1), upto = count_le(x, P, incl[b] - 1);
      const int scan_before = before > 0 ? part_scan[before - 1] : 0;
      const int scan_upto = upto > 0 ? part_scan[upto - 1] : 0;
      num_splits = 1 + (scan_upto & 0xffff) - (scan_before & 0xffff);
      slot = (scan_before & 0xffff) + (scan_before >> 16);
    }
    __syncthreads();
    if (b < batch) {
      req_splits[2 * b] = num_splits;
      req_splits[2 * b + 1] = slot;
    }
  }
}

cudaError_t run_decode_metadata(const int* cache_seqlens, int batch, int num_sm_parts, int num_sms,
                                bool deterministic, ScheduleRow* tile_sched, int* req_splits,
                                cudaStream_t stream) {
  int smem = (kNumWalks * num_sm_parts + (3 * num_sm_parts + 1) / 2) * int(sizeof(long long));
  const bool prefix_in_smem = smem + batch * int(sizeof(long long)) <= kMetadataSmemLimit;
  if (prefix_in_smem) smem += batch * int(sizeof(long long));
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(decode_metadata_kernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  decode_metadata_kernel<<<1, kMetadataThreads, smem, stream>>>(
      cache_seqlens, batch, num_sm_parts, num_sms, deterministic, tile_sched, req_splits, prefix_in_smem);
  return cudaGetLastError();
}

}  // namespace mla_decode
