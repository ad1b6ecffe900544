// The 16-bit Q tile of a 64-row kernel (rows64, and seesaw when Q cannot come by TMA): cp.async
// copies into the swizzled shared-memory layout.
#pragma once
#include <cute/tensor.hpp>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

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
  const QueryRow qr = QueryRow::of(p, valid ? row : 0);
  const auto q = QRow<Element>::at(p, s, qr.token, qr.head);
#pragma unroll
  for (int c = thread % kThreadsPerRow; c < kChunks; c += kThreadsPerRow) {
    const Element* src = (c < kHeadDimV / 8 ? q.nope : q.pe) + c * 8;
    mla_common::cp_async_16(&sQ(r, c * 8), valid ? src : p.q_nope, valid);
  }
}

}  // namespace mla_decode
