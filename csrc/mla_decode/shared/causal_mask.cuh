// The causal bound of a query row and whether a KV block needs masking at all.
#pragma once
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// Last key (inclusive) query row `row` of the segment's request sees: bottom-right causal alignment.
__device__ __forceinline__ int last_visible_key(const DecodeParams& p, const Segment& seg, int row) {
  const int t = QueryRow::of(p, row).token;
  return p.causal ? min(seg.seqlen_k - seg.seqlen_q + t, seg.seqlen_k - 1) : seg.seqlen_k - 1;
}

// True when block `blk` holds no key past any row's last visible key (lowest_last_key: that of the
// request's first query token, which sees the fewest keys).
__device__ __forceinline__ bool is_full_block(int blk, int lowest_last_key) {
  return (blk + 1) * kBlockN - 1 <= lowest_last_key;
}

}  // namespace mla_decode
