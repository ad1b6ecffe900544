// One row of the split-KV schedule tile_sched (int32 [num_sms, 8]): the work of one part (a
// persistent CTA column). Written by the scheduler kernel (sched_meta.cu) and its CPU twin
// (python/mla_attn/metadata.py: ScheduleRow, same field names in the same order; a test compares
// them), read by the split kernels (schedule.cuh) and the combine kernel. Plain C++: the bindings
// include it too.
#pragma once

namespace mla_decode {

struct ScheduleRow {
  int first_request;   // the part's first request (0 for a part with no request)
  int first_block;     // its first KV block
  int last_request;    // the part's last request; below first_request when it has none
  int last_end_block;  // KV block after the last request's last block in this part
  int first_split;     // split index of the first request's piece
  int first_seqlen;    // cache_seqlens of the first request (0 for no request): the kernels' first
                       // addresses need it, and reading it from the schedule is one dependent load less
  int split_list;      // row i: b + 1 of the i-th split request, for the combine kernel; 0 past the last
  int reserved;        // 0
};

constexpr int kScheduleRowInts = 8;
static_assert(sizeof(ScheduleRow) == kScheduleRowInts * sizeof(int), "tile_sched rows are 8 int32");

}  // namespace mla_decode
