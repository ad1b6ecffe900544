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
// Each walk is a chain over request starts (walk_parts): a part starting at a request start fixes
// every part up to the next one the walk lands on, so 32 request starts are resolved at once and
// pointer doubling follows the chain through them. Every output follows from the part starts in
// parallel.
#include <climits>
#include <cstddef>
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

// Walk positions in 32 bits where the batch's total cost is below this: a walk forms cuts up to
// (kMaxSmParts + 32) pieces past a request start, each piece at most the total. Half the instructions
// of 64-bit positions, and the 14 walks share one SM's issue slots.
constexpr long long kMaxNarrowTotal = INT_MAX / (kMaxSmParts + 64);

// The number of entries of the ascending a[0, n) that are <= v.
template <typename Pos>
__device__ __forceinline__ int count_le(const Pos* a, int n, Pos v) {
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

// A walk as a chain over request starts (nodes). A part that starts at S_r starts the next part
// at S_r + piece while no request start lies in (cut, cut + kFixedSplitCost], cut = S_r + j piece
// being its j-th cut (j >= 1); the first request e that one does catches the walk: the next part
// starts at S_e. Node r thus gives next(r) (e, or batch when the walk ends first) and parts(r) (j,
// or the parts until y = cut + kFixedSplitCost reaches total). A whole-request walk has one part
// per node: next(r) = max(r + 1, the request holding S_r + C). Request starts are kFixedSplitCost
// or more apart, so a cut catches at most one; and e catches at the smallest j >= 1 with j piece in
// [d - kFixedSplitCost, d - 1], d = S_e - S_r, which never decreases with e: the first e that can be
// caught is the one that is.
struct WalkNode {
  int next;   // the next node on the chain (batch: the walk ends); -1 while unknown
  int parts;  // parts from S_r to S_next, at most kMaxSmParts + 1 (more cannot fit)
};

// ceil(a / piece) for 0 <= a < the walk's total, on a node's dependent chain. In 32 bits (positions
// below kMaxNarrowTotal) a multiply-high by ceil(2^(31 + l) / piece), l = ceil(log2 piece), exact for
// dividends below 2^31 (the round-up method of CUTLASS's FastDivmod; its multiplier is formed here
// from the FP64 quotient, not by a 64-bit integer division at the head of every walk). In 64 bits the
// FP64 reciprocal and one correction step (a < 2^52). An integer division is a subroutine of ~20
// dependent instructions.
template <typename Pos>
struct PieceDivider;

template <>
struct PieceDivider<int> {
  int piece;
  unsigned multiplier;
  int shift;
  __device__ explicit PieceDivider(int piece_) : piece(piece_), multiplier(0), shift(0) {
    if (piece <= 1) return;  // piece 1 divides by copying; a whole-request walk (piece 0) never divides
    const int l = 32 - __clz(piece - 1);
    const unsigned long long num = 1ull << (31 + l);
    unsigned long long m = (unsigned long long)(double(num) / double(piece));  // within one of the ceiling
    if (m * piece < num) ++m;
    if ((m - 1) * piece >= num) --m;
    multiplier = unsigned(m);
    shift = l - 1;
  }
  __device__ int ceil_div(int a) const {
    const unsigned n = unsigned(a + piece - 1);
    return piece == 1 ? a : int(__umulhi(n, multiplier) >> shift);
  }
};

template <>
struct PieceDivider<long long> {
  double inv_piece;
  long long piece;
  __device__ explicit PieceDivider(long long piece_) : inv_piece(1.0 / double(max(piece_, 1ll))), piece(piece_) {}
  __device__ long long ceil_div(long long a) const {
    long long j = (long long)(double(a) * inv_piece);
    if (j * piece < a) ++j;
    if ((j - 1) * piece >= a) --j;
    return j;
  }
};

// Split walk: whether e catches a walk at node r (S_r = s_r), and at which part count.
template <typename Pos>
__device__ __forceinline__ bool catches(Pos s_r, Pos s_e, const PieceDivider<Pos>& piece, int& parts) {
  const Pos d = s_e - s_r, a = d - kFixedSplitCost;
  const Pos j = a > piece.piece ? piece.ceil_div(a) : Pos(1);
  parts = int(min(j, Pos(kMaxSmParts + 1)));
  return j * piece.piece <= d - 1;
}

template <typename Pos>
__device__ __forceinline__ int parts_until_end(Pos s_r, Pos total, const PieceDivider<Pos>& piece) {
  const Pos a = total - kFixedSplitCost - s_r;  // the first j with s_r + j piece + F >= total
  return a <= piece.piece ? 1 : int(min(piece.ceil_div(a), Pos(kMaxSmParts + 1)));
}

// Node r of a walk of part cost C (piece = C - kFixedSplitCost on a split walk), as one lane sees
// it in a window: a split node looks for its catch among the next kNodeScan requests only and
// stays unknown (next -1) past them.
constexpr int kNodeScan = 8;
// A window whose chain stops before this lane did not pay for itself: the walk goes on without.
constexpr int kMinWindowAdvance = 4;
template <typename Pos>
__device__ __forceinline__ WalkNode window_node(const Pos* incl, int batch, Pos total, Pos C, bool whole,
                                                const PieceDivider<Pos>& piece, int r) {
  const Pos s_r = r > 0 ? incl[r - 1] : 0;
  const int scan_end = min(batch, r + 1 + kNodeScan);
  if (whole) {  // the request holding S_r + C: in a dense window one of the next few, else searched
    const Pos v = s_r + C;
    if (v >= total) return {batch, 1};
    // The next kNodeScan request starts are compared at once (one load latency, not up to kNodeScan
    // in turn), the first above v taken. The split scan below stays a loop that stops at its catch:
    // unrolled, its kNodeScan catch tests cost the 14 walks' shared issue slots more than they saved.
    int holder = -1;
#pragma unroll
    for (int k = kNodeScan - 1; k >= 0; --k) {
      const int e = r + 1 + k;
      if (e < scan_end && incl[e - 1] > v) holder = e - 1;
    }
    return {max(holder >= 0 ? holder : count_le(incl, batch, v), r + 1), 1};
  }
  for (int e = r + 1; e < scan_end; ++e) {
    int parts;
    if (catches(s_r, incl[e - 1], piece, parts)) return {e, parts};
  }
  if (scan_end == batch) return {batch, parts_until_end(s_r, total, piece)};
  return {-1, 0};
}

// Node r resolved by the whole warp. Whole-request walk: the request holding S_r + C, looked for
// among the next 32 requests, then by a search. Split walk: the catch among the next 32 requests,
// else lane l takes the part count j = j0 + l + 1 (cut S_r + j piece) and checks whether that part
// stops the run: it reaches total, or the first request start above its cut lies within
// kFixedSplitCost (the catch).
template <typename Pos>
__device__ __forceinline__ WalkNode warp_node(const Pos* incl, int batch, Pos total, Pos C, bool whole,
                                              const PieceDivider<Pos>& piece, int r) {
  const int lane = threadIdx.x % 32;
  const Pos s_r = r > 0 ? incl[r - 1] : 0;
  if (whole) {
    const Pos v = s_r + C;
    if (v >= total) return {batch, 1};
    const int e = r + 1 + lane;  // S_e > v first: request e - 1 holds v (S_batch = total > v)
    const unsigned hits = __ballot_sync(kFullMask, e <= batch && incl[e - 1] > v);
    const int holder = hits ? r + __ffs(hits) - 1 : count_le(incl, batch, v);
    return {max(holder, r + 1), 1};
  }
  {  // a catch among the next 32 requests comes before the run ends
    const int e = r + 1 + lane;
    int parts = 0;
    const unsigned hits = __ballot_sync(kFullMask, e < batch && catches(s_r, incl[e - 1], piece, parts));
    if (hits) {
      const int l = __ffs(hits) - 1;
      return {r + 1 + l, __shfl_sync(kFullMask, parts, l)};
    }
  }
  for (int j0 = 0; j0 <= kMaxSmParts; j0 += 32) {
    const int j = j0 + lane + 1;
    const Pos cut = s_r + j * piece.piece, y = cut + kFixedSplitCost;
    const int above = count_le(incl, batch, cut) + 1;  // the first request start above the cut
    const bool ends = y >= total;
    const unsigned stops = __ballot_sync(kFullMask, ends || (above < batch && incl[above - 1] <= y));
    if (stops) {
      const int l = __ffs(stops) - 1;
      return {__shfl_sync(kFullMask, ends ? batch : above, l), j0 + l + 1};
    }
  }
  return {batch, kMaxSmParts + 1};  // more parts than any walk places
}

// One warp walks parts of cost C from request 0 and writes the first num_sm_parts part starts to
// starts[] (total past the last part); returns whether the walk took every request within them.
// may_give_up: the caller needs the starts only if the walk fits, so it stops as soon as it cannot: a
// part moves its start by at most C (a split walk's cuts by C - kFixedSplitCost; a whole-request capacity
// walk's C is at least every request's cost), so from x with `placed` parts behind, total - x >
// (num_sm_parts - placed) C leaves too few parts. A walk that does not fit then gives up the issue
// slots it shares with the others early (most do, a few parts in) instead of walking num_sm_parts
// parts. Not the upper end's walk: its starts serve even when it does not fit, and as a whole-request
// walk (deterministic) its C may be below a request's cost, so a part can move by more than C.
// The warp resolves the chain's node and writes its parts; where the chain moved by few requests
// (dense: many nodes to come close together) it then takes the next 32 nodes at once: each lane
// computes its node, pointer doubling over the window gives every lane the last chain node at or
// before it and the parts before that, and the chain leaves the window at its last node there
// (resolved by the warp next if the lane could not). Windows stop once one moves the chain by few nodes.
template <typename Pos>
__device__ __forceinline__ bool walk_parts(const Pos* incl, int batch, Pos total, int num_sm_parts, Pos C, bool whole,
                                           bool may_give_up, long long* starts) {
  const int lane = threadIdx.x % 32;
  const Pos piece = whole ? 0 : C - kFixedSplitCost;
  const PieceDivider<Pos> divider(piece);
  int node = 0, placed = 0;  // the chain's current node and the parts before it
  bool windows = true;  // off once a window moved the chain by few nodes (catches too far apart)
  while (node < batch && placed < num_sm_parts) {
    const Pos s_head = node > 0 ? incl[node - 1] : 0;
    if (may_give_up && total - s_head > (long long)(num_sm_parts - placed) * C) return false;
    const WalkNode head = warp_node(incl, batch, total, C, whole, divider, node);
    for (int j = lane; j < min(head.parts, num_sm_parts - placed); j += 32) starts[placed + j] = s_head + j * piece;
    placed += head.parts;
    const bool dense = head.next - node <= kNodeScan;
    node = head.next;
    if (!windows || !dense || node >= batch || placed >= num_sm_parts) continue;

    const int r = node + lane;
    WalkNode w = r < batch ? window_node(incl, batch, total, C, whole, divider, r) : WalkNode{batch, 0};
    // jump[k] / jump_parts[k]: the lane 2^k chain steps ahead within the window (itself once the
    // chain leaves the window or reaches an unknown node there) and the parts over those steps.
    int jump[5], jump_parts[5];
    const bool inside = w.next >= 0 && w.next < node + 32 && w.next < batch;
    jump[0] = inside ? w.next - node : lane;
    jump_parts[0] = inside ? w.parts : 0;
#pragma unroll
    for (int k = 1; k < 5; ++k) {
      jump[k] = __shfl_sync(kFullMask, jump[k - 1], jump[k - 1]);
      jump_parts[k] = jump_parts[k - 1] + __shfl_sync(kFullMask, jump_parts[k - 1], jump[k - 1]);
    }
    int at = 0, before = 0;  // the last chain node at or before this lane, the parts before it
#pragma unroll
    for (int k = 4; k >= 0; --k) {
      const int to = __shfl_sync(kFullMask, jump[k], at);
      const int add = __shfl_sync(kFullMask, jump_parts[k], at);
      if (to <= lane) {
        at = to;
        before += add;
      }
    }
    const bool on_chain = at == lane;
    const int last = 31 - __clz(__ballot_sync(kFullMask, on_chain && jump[0] == lane));
    const bool last_known = __shfl_sync(kFullMask, w.next, last) >= 0;
    // Each known chain node writes its parts' starts (a long run: the warp).
    const Pos s_r = r > 0 && r <= batch ? incl[r - 1] : 0;
    const int first_part = placed + before;
    const int own = on_chain && (lane < last || last_known) ? max(0, min(w.parts, num_sm_parts - first_part)) : 0;
    if (own <= 4) {
      for (int j = 0; j < own; ++j) starts[first_part + j] = s_r + j * piece;
    }
    for (unsigned long_runs = __ballot_sync(kFullMask, own > 4); long_runs; long_runs &= long_runs - 1) {
      const int l = __ffs(long_runs) - 1;
      const int p0 = __shfl_sync(kFullMask, first_part, l), n = __shfl_sync(kFullMask, own, l);
      const Pos s = __shfl_sync(kFullMask, s_r, l);
      for (int j = lane; j < n; j += 32) starts[p0 + j] = s + j * piece;
    }
    placed = __shfl_sync(kFullMask, first_part + (last_known ? w.parts : 0), last);
    windows = last >= kMinWindowAdvance;
    node = last_known ? __shfl_sync(kFullMask, w.next, last) : node + last;
  }
  for (int q = placed + lane; q < num_sm_parts; q += 32) starts[q] = total;
  return node == batch && placed <= num_sm_parts;
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
  long long* incl = prefix_in_smem ? smem + kNumWalks * P + P
                                   : reinterpret_cast<long long*>(req_splits);  // [batch]: S_b+1
  int* incl32 = reinterpret_cast<int*>(incl + batch);  // [batch]: incl in 32 bits (prefix_in_smem only)
  __shared__ long long warp_sums[kMetadataWarps];
  __shared__ int warp_ints[kMetadataWarps];
  __shared__ unsigned walks_that_fit;  // bit k: walk k fits
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) walks_that_fit = 0;  // before the first barrier; the walks set bits after another
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
    if (b < batch) {
      incl[b] = total + sum;
      if (prefix_in_smem) incl32[b] = int(total + sum);  // used only if the total is below kMaxNarrowTotal
    }
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
    const bool may_give_up = warp != kUpperWalk;  // the upper end's starts serve even when it does not fit
    bool fits = false;
    if (C >= 0) {
      fits = prefix_in_smem && total <= kMaxNarrowTotal
                 ? walk_parts<int>(incl32, batch, int(total), P, int(C), whole, may_give_up, starts)
                 : walk_parts<long long>(incl, batch, total, P, C, whole, may_give_up, starts);
    }
    if (lane == 0 && fits) atomicOr(&walks_that_fit, 1u << warp);
  }
  __syncthreads();
  // The smallest split cost that fits, else the upper end; then the smallest whole-request capacity
  // that fits, if within kNoSplitSlack of it (no request is cut; a larger capacity is further off).
  const unsigned fit = walks_that_fit;
  const unsigned split_fit = fit & ((1u << kSplitWalks) - 1);
  const unsigned capacity_fit = (fit >> kFirstCapacityWalk) & ((1u << kCapacityWalks) - 1);
  int chosen = split_fit ? __ffs(split_fit) - 1 : kUpperWalk;
  const long long payload = split_fit ? search_lo + chosen : upper;
  if (capacity_fit && capacity_lo + (__ffs(capacity_fit) - 1) <= payload + kNoSplitSlack) {
    chosen = kFirstCapacityWalk + __ffs(capacity_fit) - 1;
  }
  const long long* x = walk_starts + chosen * P;  // ascending; total once the requests run out

  // 3. Per part: the request holding its start, and whether the start cuts it (a piece after the
  // first): a prefix over parts of (cut starts) + (cut starts that begin a split request) << 16.
  // The request's length, which its row needs, is loaded here: its latency passes under the scan.
  int first_seqlen = 0;  // of part tid, where P <= kMetadataThreads
  for (int chunk = 0; chunk < P; chunk += kMetadataThreads) {
    const int p = chunk + tid;
    int packed = 0;
    if (p < P && x[p] < total) {
      const int b = count_le(incl, batch, x[p]);
      part_request[p] = b;
      if (chunk == 0) first_seqlen = cache_seqlens[b];
      if (x[p] > S(b)) packed = 1 + (p > 0 && x[p - 1] > S(b) ? 0 : 1 << 16);
    }
    int chunk_total;
    const int sum = block_inclusive_scan<int>(packed, warp_ints, &chunk_total);
    if (p < P) {
      const int scan = sum + (chunk > 0 ? part_scan[chunk - 1] : 0);
      part_scan[p] = scan;
      // The split list: row i names the i-th split request. Written here, its field alone (write_row
      // leaves it to this store), so that no barrier waits for it.
      if (packed >> 16) tile_sched[(scan >> 16) - 1].split_list = part_request[p] + 1;
    }
    __syncthreads();  // the next chunk reads this chunk's last entry
  }
  const int num_split_requests = part_scan[P - 1] >> 16;

  // 4. The rows: a part ends where the next starts (the last part takes the rest).
  auto write_row = [&](int p) {
    ScheduleRow row{.last_request = -1};  // no request; the rest 0
    if (x[p] < total) {
      const int b = part_request[p];
      const long long first = S(b);
      row.first_request = b;
      row.first_block = int(x[p] - first);
      // pieces of b in earlier parts: parts starting after S_b, this one included
      row.first_split = x[p] > first ? p + 1 - count_le(x, P, first) : 0;
      row.first_seqlen = P <= kMetadataThreads ? first_seqlen : cache_seqlens[b];  // for the split kernel's first addresses
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
    static_assert(offsetof(ScheduleRow, split_list) == 6 * sizeof(int), "the fields written around split_list");
    if (p < num_split_requests) {  // all but split_list, which phase 3 wrote
      int* fields = reinterpret_cast<int*>(tile_sched + p);
      *reinterpret_cast<int4*>(fields) = make_int4(row.first_request, row.first_block, row.last_request, row.last_end_block);
      *reinterpret_cast<int2*>(fields + 4) = make_int2(row.first_split, row.first_seqlen);
      fields[7] = row.reserved;
    } else {
      tile_sched[p] = row;
    }
  };
  // 5. req_splits: request b has 1 + (cut starts in it) pieces; its slot counts the pieces of the
  // split requests before it: (cut starts before S_b) + (split requests before it).
  auto request_splits = [&](int b) {
    const int before = count_le(x, P, S(b) - 1), upto = count_le(x, P, incl[b] - 1);
    const int scan_before = before > 0 ? part_scan[before - 1] : 0;
    const int scan_upto = upto > 0 ? part_scan[upto - 1] : 0;
    return make_int2(1 + (scan_upto & 0xffff) - (scan_before & 0xffff), (scan_before & 0xffff) + (scan_before >> 16));
  };
  if (prefix_in_smem && P + batch <= kMetadataThreads) {  // rows and requests at once, a thread each
    if (tid < P) {
      write_row(tid);
    } else if (tid < P + batch) {
      const int2 splits = request_splits(tid - P);
      req_splits[2 * (tid - P)] = splits.x;
      req_splits[2 * (tid - P) + 1] = splits.y;
    }
    return;
  }
  // One after the other where they take more than a round (rows and requests in a shared loop, with
  // its barrier, measured slower at batch 512). Where req_splits holds the prefix sums, the rows read
  // them first, then chunks go from the last: chunk k reads incl[k * T - 1, (k + 1) * T) and writes
  // over incl[k * T, (k + 1) * T) only.
  for (int p = tid; p < P; p += kMetadataThreads) write_row(p);
  __syncthreads();
  for (int chunk = (batch - 1) / kMetadataThreads * kMetadataThreads; chunk >= 0; chunk -= kMetadataThreads) {
    const int b = chunk + tid;
    const int2 splits = b < batch ? request_splits(b) : make_int2(0, 0);
    if (!prefix_in_smem) __syncthreads();  // req_splits holds incl: every read of this chunk first
    if (b < batch) {
      req_splits[2 * b] = splits.x;
      req_splits[2 * b + 1] = splits.y;
    }
  }
}

cudaError_t run_decode_metadata(const int* cache_seqlens, int batch, int num_sm_parts, int num_sms,
                                bool deterministic, ScheduleRow* tile_sched, int* req_splits,
                                cudaStream_t stream) {
  int smem = (kNumWalks + 1) * num_sm_parts * int(sizeof(long long));  // walk starts; part_request, part_scan
  // The prefix sums in 64 and in 32 bits.
  const int prefix_bytes = batch * int(sizeof(long long) + sizeof(int));
  const bool prefix_in_smem = smem + prefix_bytes <= kMetadataSmemLimit;
  if (prefix_in_smem) smem += prefix_bytes;
  // Every call, as the split kernels do: the kernel's static shared memory counts against the default
  // 48 KB too, so a threshold on the dynamic bytes alone let a launch just under it fail.
  const cudaError_t attr =
      cudaFuncSetAttribute(decode_metadata_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  decode_metadata_kernel<<<1, kMetadataThreads, smem, stream>>>(
      cache_seqlens, batch, num_sm_parts, num_sms, deterministic, tile_sched, req_splits, prefix_in_smem);
  return cudaGetLastError();
}

}  // namespace mla_decode
