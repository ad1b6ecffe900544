// The end of a 64-row output tile (rows64, seesaw, fp8mma): normalise, write the LSE, and store the
// rows (final output, or a partial for the combine kernel) through shared memory. The narrow kernel
// normalises its own way, with the same denominator_with_sink.
#pragma once
#include <cute/tensor.hpp>
#include <cstdint>

#include "common/device_utils.cuh"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/shared/packed_pair.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// The denominator of final row `row` of a request (head row % h_q): its sum of 2^(score - row_max)
// (log2 units: row_max + log2(total) = lse / ln 2), plus the sink's 2^(attn_sink[h] log2(e) - row_max)
// when the call has one.
__device__ __forceinline__ float denominator_with_sink(const DecodeParams& p, int row, float row_max, float total) {
  if (!p.attn_sink) return total;
  return total + exp2f(fmaf(p.attn_sink[QueryRow::of(p, row).head], float(M_LOG2E), -row_max));
}

// Where the rows of a finished 64-row output tile go: the final output of the request, or a partial
// (rows in q's dtype + fp32 LSE) for combine/combine_kernel.cuh when the request is split.
struct OutputTile {
  const DecodeParams& p;
  Segment seg;  // by value: a reference to the caller's local put it on the stack
  int m_block;
  bool is_partial;
  int slot;  // workspace slot of the partial

  __device__ static OutputTile of(const DecodeParams& p, const Segment& seg, int m_block) {
    const int slot = partial_slot(p, seg);
    return {p, seg, m_block, slot >= 0, slot};
  }
  __device__ bool has_row(int r) const { return m_block * kBlockM + r < seg.seqlen_q * p.num_heads_q; }
  __device__ int64_t partial_index(int r) const { return (int64_t(slot) * p.num_q_tiles + m_block) * kBlockM + r; }
  // Row r, from column `col` on: a partial row or a final row of out.
  template <typename Element>
  __device__ Element* row_ptr(int r, int col) const {
    if (is_partial) return static_cast<Element*>(p.partial_out) + partial_index(r) * kHeadDimV + col;
    const QueryRow q = QueryRow::of(p, m_block * kBlockM + r);
    return static_cast<Element*>(p.out) + seg.b * p.out_batch_stride + (seg.first_token + q.token) * p.out_token_stride +
           q.head * p.out_head_stride + col;
  }
  // 1 / denominator (times out_scale, an fp8 cache's k_scale) of a row with running max row_max (log2
  // units) and denominator total (a final row's with the sink, denominator_with_sink); writes the row's
  // LSE (natural log; +inf final or -inf partial for a row with no visible key) when write_lse.
  __device__ float finish_row(int r, float row_max, float total, float out_scale, bool write_lse) const {
    const bool empty = total == 0.f;  // no visible key in this split
    if (write_lse && has_row(r)) {
      const float lse = empty ? (is_partial ? -INFINITY : INFINITY) : (row_max + __log2f(total)) * float(M_LN2);
      if (is_partial) {
        p.partial_lse[partial_index(r)] = lse;
      } else {
        const QueryRow q = QueryRow::of(p, m_block * kBlockM + r);
        p.lse[seg.b * p.lse_batch_stride + (seg.first_token + q.token) * p.lse_token_stride + q.head * p.lse_head_stride] = lse;
      }
    }
    if (empty) return 0.f;
    return out_scale / (is_partial ? total : denominator_with_sink(p, m_block * kBlockM + r, row_max, total));
  }
};

// The output of a segment without key blocks (a request with no keys): zero rows, LSE +inf. Such a
// request is never split. By all 256 math threads, 16-byte stores.
template <typename Element>
__device__ __forceinline__ void store_empty_output_tile(const DecodeParams& p, const Segment& seg, int m_block) {
  const OutputTile tile = OutputTile::of(p, seg, m_block);
  constexpr int kChunksPerRow = kHeadDimV * int(sizeof(Element)) / 16;
  // From an opaque thread index: otherwise derived at the segment's start and spilled across its blocks.
  for (int i = mla_common::opaque(int(threadIdx.x)); i < kBlockM * kChunksPerRow; i += 256) {
    const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
    if (!tile.has_row(r)) continue;
    if (chunk == 0) tile.finish_row(r, -INFINITY, 0.f, 1.f, /*write_lse=*/true);
    reinterpret_cast<uint4*>(tile.row_ptr<Element>(r, 0))[chunk] = make_uint4(0, 0, 0, 0);
  }
}

// Output staging: a warpgroup's 64 x 256 output columns (16-bit: 512 bytes of a row) pass through
// shared memory, rows kStagingPitch bytes apart (padded so that the fragment writes are free of bank
// conflicts).
constexpr int kStagingPitch = 512 + 16;                    // bytes
constexpr int kStagingBytes = kBlockM * kStagingPitch;     // per warpgroup

// Fragments -> `staging` by stmatrix (16 instructions a thread instead of 64 4-byte stores), then the
// warpgroup copies the rows out, a warp per row and 16 bytes per lane (coalesced stores; one 512-byte
// bulk copy per row, or one per tile, measured slower: the TMA unit takes them one after another).
// Pair q = e / 2 of tOrO (element e in row r0 + 8 ((e >> 1) & 1), column 8 (e >> 2) + 2 (lane % 4) +
// (e & 1)) is 8-column chunk q / 2 of row half q % 2; stmatrix i of a row half stores chunks 4i..4i+3,
// lanes 8j..8j+7 addressing the rows of chunk 4i + j (the padded pitch spreads them over the banks).
template <typename Element, typename TensorO, typename Sync>
__device__ __forceinline__ void stage_output_columns(const OutputTile& tile, uint32_t staging, int tid_in_wg,
                                                     const float (&inv_sum)[2], int col_base, const TensorO& tOrO,
                                                     Sync&& sync) {
  static_assert(sizeof(Element) == 2, "rows of 256 16-bit values: one 512-byte round");
  constexpr int kPairs = int(decltype(cute::size(tOrO))::value) / 2;
  static_assert(kPairs % 8 == 0, "whole stmatrix.x4 groups");
  const int lane = tid_in_wg % 32, warp = tid_in_wg / 32;
  const uint32_t lane_addr = staging + (16 * warp + lane % 8) * kStagingPitch + (lane / 8) * 16;
  auto pair = [&](int q) {
    const int e = 2 * q, h = q & 1;
    return pack_pair<Element>(tOrO(e) * inv_sum[h], tOrO(e + 1) * inv_sum[h]);
  };
#pragma unroll
  for (int i = 0; i < kPairs / 8; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mla_common::stsm_x4(lane_addr + h * 8 * kStagingPitch + i * 64, pair(8 * i + h), pair(8 * i + 2 + h),
                          pair(8 * i + 4 + h), pair(8 * i + 6 + h));
    }
  }
  sync();
  // Unrolled 4 deep: fully unrolled, the 16 row addresses were computed up front and spilled.
#pragma unroll 4
  for (int r = warp; r < kBlockM; r += 4) {
    if (!tile.has_row(r)) break;  // the tile's rows are a prefix
    const uint4 v = mla_common::ld_shared_16(staging + r * kStagingPitch + lane * 16);
    reinterpret_cast<uint4*>(tile.row_ptr<Element>(r, col_base))[lane] = v;
  }
}

// Normalises and stores a finished 64-row output tile held by a warpgroup: its 256 output columns
// [col_base, col_base + 256), this thread's rows r0 and r0 + 8 (element e of tOrO is in row
// r0 + 8 ((e >> 1) & 1), column col_base + 8 (e >> 2) + 2 (lane % 4) + (e & 1)), with running max
// row_max (log2 units) and denominator row_total; out_scale multiplies every value (an fp8 cache's
// k_scale). The final rows of the request, or partial rows + LSE for combine/combine_kernel.cuh when the
// request is split, both in q's dtype. The LSE (natural log; +inf final or -inf partial for a row
// with no visible key) is written by the threads with write_lse and lane % 4 == 0. Through shared
// memory (`staging`, kStagingBytes the warpgroup owns): stores straight from the accumulator touch 8
// rows per instruction and were much slower. sync() is a barrier over the warpgroup. On return
// other threads may still read `staging`: synchronise before reusing it.
template <typename Element, typename TensorO, typename Sync>
__device__ __forceinline__ void store_output_columns_staged(const DecodeParams& p, const Segment& seg, int m_block,
                                                            int r0, const float (&row_max)[2],
                                                            const float (&row_total)[2], float out_scale,
                                                            bool write_lse, uint32_t staging, int tid_in_wg,
                                                            int col_base, const TensorO& tOrO, Sync&& sync) {
  const OutputTile tile = OutputTile::of(p, seg, m_block);
  float inv_sum[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    inv_sum[i] = tile.finish_row(r0 + 8 * i, row_max[i], row_total[i], out_scale, write_lse && threadIdx.x % 4 == 0);
  }
  stage_output_columns<Element>(tile, staging, tid_in_wg, inv_sum, col_base, tOrO, sync);
}

}  // namespace mla_decode
