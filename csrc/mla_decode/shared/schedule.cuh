// Walking one persistent CTA's share of the split-KV schedule. Used identically by the producer
// (to issue loads) and the math warpgroups (to consume them), so both see the same block sequence.
#pragma once
#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/query_span.cuh"

namespace mla_decode {

// One request's piece of work for this CTA: KV blocks [blk_lo, blk_hi) of request b for q-tile m.
struct Segment {
  int b, blk_lo, blk_hi, split;
  int seqlen_k;     // keys of the request, clamped to what the block table can hold
  int seqlen_q;     // new tokens of the request
  int first_token;  // cu_seqlens_q[b] (varlen, clamped: QuerySpan) or 0
};

// The workspace slot of a segment's partial when its request is split, else -1 (it writes the final
// output). The schedule is data: one made for another call (a torch.ops call with another num_sm_parts,
// or metadata of other shapes) is clamped into the split_partial_slots the op allocated, giving
// wrong numbers but no access outside them.
__device__ __forceinline__ int partial_slot(const DecodeParams& p, const Segment& seg) {
  if (p.req_splits[2 * seg.b] <= 1 || p.num_sm_parts <= 1) return -1;
  return min(max(p.req_splits[2 * seg.b + 1] + seg.split, 0), split_partial_slots(p.num_sm_parts) - 1);
}

// Query row (t, h) of a segment, t < seqlen_q: its latent part, and its rope part offset by -512 so that
// dim d of the 576-dim row is (d < 512 ? nope : pe)[d].
template <typename Element>
struct QRow {
  const Element* nope;
  const Element* pe;

  __device__ static QRow at(const DecodeParams& p, const Segment& s, int t, int h) {
    const int64_t token = s.first_token + t;
    return {static_cast<const Element*>(p.q_nope) + s.b * p.q_nope_batch_stride + token * p.q_nope_token_stride +
                h * p.q_nope_head_stride,
            static_cast<const Element*>(p.q_pe) + s.b * p.q_pe_batch_stride + token * p.q_pe_token_stride +
                h * p.q_pe_head_stride - kHeadDimV};
  }
};

struct PartRange {
  int begin_b, begin_blk, last_b, last_hi, begin_split;
  int begin_seqlen;  // cache_seqlens[begin_b], from the schedule: one dependent load less at the start

  __device__ static PartRange load(const DecodeParams& p, int part) {
    const ScheduleRow& row = p.tile_sched[part];
    // Clamped to the batch: a schedule made for a larger batch (a caller's bug the op cannot see, as
    // tile_sched's shape does not depend on the batch) then reads no request past it.
    return {row.first_request, row.first_block, min(row.last_request, p.batch - 1), row.last_end_block,
            row.first_split, row.first_seqlen};
  }

  // KV blocks of the part, without those of the requests strictly between its first and last (a lower
  // bound: long parts hold one or two requests).
  __device__ int blocks_at_least() const {
    if (last_b < begin_b) return 0;
    if (last_b == begin_b) return last_hi - begin_blk;
    return num_kv_blocks(begin_seqlen) - begin_blk + last_hi;
  }

  // Fills `seg` for request b; returns false when this CTA's q-tile has no rows in request b.
  __device__ bool segment(const DecodeParams& p, int b, int m_block, Segment& seg) const {
    seg.b = b;
    const QuerySpan span = QuerySpan::of(p, b);
    seg.first_token = span.first;
    seg.seqlen_q = span.count;
    if (m_block * kBlockM >= seg.seqlen_q * p.num_heads_q) return false;
    const int seqlen = b == begin_b && !p.kv_slots ? begin_seqlen : p.cache_seqlens[b];
    seg.seqlen_k = min(max(seqlen, 0), p.max_keys);
    seg.blk_lo = b == begin_b ? begin_blk : 0;
    seg.blk_hi = b == last_b ? last_hi : num_kv_blocks(seqlen);
    if (p.kv_slots || seqlen != seg.seqlen_k || b == last_b) {
      // The schedule counts the blocks of the length as given. Slot lists (sparse top-k) are scheduled
      // for max_keys keys each, from shapes alone, while a row holds fewer valid slots; a dense length
      // past what the block table holds (unchecked on the GPU) is clamped; a part's last request ends
      // at a block of the schedule's length, which is stale when the lengths changed after it was made
      // (its first request takes its length from the schedule too). Either way the blocks end at the
      // clamped count, and a piece past it is empty (its partial has LSE -inf): no kernel may walk
      // blocks without keys (the seesaw kernels zero a tail block's rows from its key count). A branch,
      // not an unconditional min: the min costs registers in the narrow kernels.
      seg.blk_hi = min(seg.blk_hi, num_kv_blocks(seg.seqlen_k));
      seg.blk_lo = min(seg.blk_lo, seg.blk_hi);
    }
    seg.split = b == begin_b ? begin_split : 0;
    return true;
  }

  // The first request from from_b on in which this CTA's q-tile has rows; false past last_b.
  __device__ bool next_segment(const DecodeParams& p, int from_b, int m_block, Segment& seg) const {
    for (int b = from_b; b <= last_b; ++b) {
      if (segment(p, b, m_block, seg)) return true;
    }
    return false;
  }
};

}  // namespace mla_decode
