// The producer warpgroup of rows64 with an fp8 cache: it loads each K tile as e4m3 bytes (TMA boxes,
// or the cp.async row gather; shared/kv_producer.cuh) into the upper part of its stage and converts
// it there to the fp16 tile the WGMMAs read, so that the math warpgroups only wait for slabs and
// multiply. The conversion of block i runs while the math warpgroups work on block i - 1, and block
// i + 1's loads are issued right after it (see produce_converted_kv_tiles).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cuda_fp16.h>
#include <type_traits>

#include "common/device_utils.cuh"
#include "common/ds_mla_fp8_layout.h"
#include "mla_decode/config.h"
#include "mla_decode/params.h"
#include "mla_decode/rows64/traits.h"
#include "mla_decode/shared/fp8_dequant.cuh"
#include "mla_decode/shared/kv_producer.cuh"
#include "mla_decode/shared/schedule.cuh"

namespace mla_decode {

// Converts a staged e4m3 tile in place. Producer thread t (0..127) converts 16-byte chunks t and
// t + 128 of every slab (key rows t / 4 and 32 + t / 4, columns 16 (t % 4) ... + 15); rows past the
// sequence end become zeros (never loaded, or slots past L), so no tail zeroing is needed. e4m3
// values are exact in fp16; a per-tensor scale is applied to the scores and the output.
// ds_mla_fp8: each 128-column group of a row is multiplied by its power-of-two scale in fp16, exact
// for the scales 2^-13 (the quantiser's smallest) to 2^7 (|values| up to 57344; larger overflow
// fp16), and the bf16 rope slab becomes fp16 in place (exact within fp16's range).
//
// In place: 16-bit slab s overwrites the staged bytes of slabs 2s - kFp8Slabs and 2s - kFp8Slabs + 1
// (if >= 0), so a barrier over the producer warpgroup separates every read of those from the writes
// of s: slabs are converted in the groups {0-3} {4, 5} {6} {7, and slab 8 read} {8 written} (e4m3
// cache: 9 staged slabs), or {0-3, with the row scales} {4, 5} {6, and slab 7 read} {7 written, rope}
// (ds_mla_fp8: 8). After each group every thread fences its writes for WGMMA and arrives on the
// group's kv_converted barriers, which the math warpgroups wait on.
template <typename Traits>
struct Fp8TileConverter {
  static_assert(std::is_same_v<typename Traits::MmaElement, cutlass::half_t>, "e4m3 converts to the fp16 tile");
  static_assert(kFp8SlabBytes / 16 == 256, "two 16-byte chunks of a slab per producer thread");
  static constexpr int k16BitSlabBytes = kBlockN * kTmaColumns * int(sizeof(typename Traits::MmaElement));
  static_assert(k16BitSlabBytes == 8192, "a 16-bit slab is 8 KB");

  // Chunk `chunk` (0..255) of staged slab `slab`.
  __device__ __forceinline__ static uint4 read(uint32_t tile_addr, int slab, int chunk) {
    return mla_common::ld_shared_16(tile_addr + Traits::kFp8StagingOffset + slab * kFp8SlabBytes +
                                    fp8_slab_offset(chunk / 4, chunk % 4));
  }
  // Byte offset, within any 16-bit slab ([64 rows][128 B], 128-byte swizzle: 16-byte chunk c of row r
  // at c ^ (r % 8)), of the first of the two 16-byte chunks that staged chunk `chunk` becomes (key
  // row chunk / 4, columns 16 (chunk % 4) ... + 15); the second is at this offset ^ 16.
  __device__ __forceinline__ static uint32_t write_offset(int chunk) {
    const int row = chunk / 4, pair = (chunk % 4) * 2;
    return row * 128 + ((pair ^ (row % 8)) << 4);
  }
  // Writes a staged chunk, converted (times `scale` with kScaled), to 16-bit slab `slab` (zeros for
  // rows past the sequence end: the e4m3 bytes are zeroed before the conversion, 4 selects, not 8).
  template <bool kScaled = false>
  __device__ __forceinline__ static void write(uint32_t tile_addr, uint32_t offset, int slab, bool zero, uint4 in,
                                               __half2 scale = {}) {
    const uint32_t slab_addr = tile_addr + slab * k16BitSlabBytes;
    if (zero) in = make_uint4(0, 0, 0, 0);
    const uint32_t words[4] = {in.x, in.y, in.z, in.w};
    uint32_t out[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) e4m3x4_to_f16x2(words[w], out[2 * w], out[2 * w + 1]);
    if constexpr (kScaled) {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = hmul2_bits(out[i], scale);
    }
    mla_common::st_shared_16(slab_addr + offset, make_uint4(out[0], out[1], out[2], out[3]));
    mla_common::st_shared_16(slab_addr + (offset ^ 16), make_uint4(out[4], out[5], out[6], out[7]));
  }
  // ds_mla_fp8: a chunk's 16 rope values, bf16 -> fp16 where they landed (bytes no other thread
  // reads or writes: no barrier before).
  __device__ __forceinline__ static void convert_rope(uint32_t tile_addr, uint32_t offset, bool zero) {
    const uint32_t slab_addr = tile_addr + Traits::kDsRopeSlabOffset;
#pragma unroll
    for (uint32_t half : {0u, 16u}) {
      const uint4 in = zero ? make_uint4(0, 0, 0, 0) : mla_common::ld_shared_16(slab_addr + (offset ^ half));
      mla_common::st_shared_16(slab_addr + (offset ^ half), make_uint4(bf16x2_to_f16x2(in.x), bf16x2_to_f16x2(in.y),
                                                                     bf16x2_to_f16x2(in.z), bf16x2_to_f16x2(in.w)));
    }
  }
  // ds_mla_fp8: the 4 scales of the row of `chunk` as f16x2 pairs. They sit in 16-bit slab 0 where
  // rows 8k ... 8k + 7 keep theirs in row 8k (Traits::ds_scales_offset), rows that only the warp
  // converting them writes (thread t: rows t / 4 and 32 + t / 4): its __syncwarp orders the reads.
  __device__ __forceinline__ static void read_scales(uint32_t tile_addr, int chunk, __half2 (&scales)[4]) {
    const uint4 raw = mla_common::ld_shared_16(tile_addr + Traits::ds_scales_offset(chunk / 4));
    scales[0] = __float2half2_rn(__uint_as_float(raw.x));
    scales[1] = __float2half2_rn(__uint_as_float(raw.y));
    scales[2] = __float2half2_rn(__uint_as_float(raw.z));
    scales[3] = __float2half2_rn(__uint_as_float(raw.w));
  }

  // Converts the tile of block `iteration` (its stage and phase) with `valid_keys` key rows.
  __device__ static void convert_tile(typename Traits::SharedStorage& ss, int iteration, int valid_keys) {
    const int stage = mla_common::warp_uniform(iteration % Traits::kStages);
    const uint32_t phase = (iteration / Traits::kStages) & 1;
    const int thread = threadIdx.x % 128;
    const int chunks[2] = {thread, thread + 128};
    const uint32_t tile_addr = mla_common::smem_addr(ss.k[stage]);
    const uint32_t offsets[2] = {write_offset(chunks[0]), write_offset(chunks[1])};
    const bool zero[2] = {chunks[0] / 4 >= valid_keys, chunks[1] / 4 >= valid_keys};
    auto wait = [&](int first_slab, int end_slab) {
#pragma unroll
      for (int slab = first_slab; slab < end_slab; ++slab) cutlass::arch::ClusterBarrier::wait(&ss.kv_full[stage][slab], phase);
    };
    // This thread's writes of slabs [first_slab, end_slab) are fenced for WGMMA and announced; then
    // the warpgroup's reads of the staged bytes the next group overwrites are done.
    auto publish = [&](int first_slab, int end_slab, bool sync = true) {
      cutlass::arch::fence_view_async_shared();
#pragma unroll
      for (int slab = first_slab; slab < end_slab; ++slab) cutlass::arch::ClusterBarrier::arrive(&ss.kv_converted[stage][slab]);
      if (sync) mla_common::named_barrier_sync<int(Rows64Barrier::kFp8StagingRead), 128>();
    };
    if constexpr (Traits::kDsMlaFp8) {
      static_assert(mla_common::kDsTile == 2 * kTmaColumns, "one scale per two slabs");
      __half2 scales[2][4];
      wait(0, 4);  // slab 0's barrier also covers the scales
      read_scales(tile_addr, chunks[0], scales[0]);
      read_scales(tile_addr, chunks[1], scales[1]);
      __syncwarp();  // this warp's rows' scales are read before it writes over them (slab 0)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        uint4 staged[4];
#pragma unroll
        for (int slab = 0; slab < 4; ++slab) staged[slab] = read(tile_addr, slab, chunks[c]);
#pragma unroll
        for (int slab = 0; slab < 4; ++slab) write<true>(tile_addr, offsets[c], slab, zero[c], staged[slab], scales[c][slab / 2]);
      }
      publish(0, 4);
      wait(4, 6);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint4 staged[2] = {read(tile_addr, 4, chunks[c]), read(tile_addr, 5, chunks[c])};
        write<true>(tile_addr, offsets[c], 4, zero[c], staged[0], scales[c][2]);
        write<true>(tile_addr, offsets[c], 5, zero[c], staged[1], scales[c][2]);
      }
      publish(4, 6);
      wait(6, 8);
      uint4 slab7[2];  // 16-bit slab 7 overwrites staged slabs 6 and 7: read both before the barrier
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        slab7[c] = read(tile_addr, 7, chunks[c]);
        write<true>(tile_addr, offsets[c], 6, zero[c], read(tile_addr, 6, chunks[c]), scales[c][3]);
      }
      publish(6, 7);
#pragma unroll
      for (int c = 0; c < 2; ++c) write<true>(tile_addr, offsets[c], 7, zero[c], slab7[c], scales[c][3]);
      wait(kSlabs - 1, kSlabs);
#pragma unroll
      for (int c = 0; c < 2; ++c) convert_rope(tile_addr, offsets[c], zero[c]);
      publish(7, 9, /*sync=*/false);
    } else {
      wait(0, 4);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        uint4 staged[4];
#pragma unroll
        for (int slab = 0; slab < 4; ++slab) staged[slab] = read(tile_addr, slab, chunks[c]);
#pragma unroll
        for (int slab = 0; slab < 4; ++slab) write(tile_addr, offsets[c], slab, zero[c], staged[slab]);
      }
      publish(0, 4);
      wait(4, 6);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint4 staged[2] = {read(tile_addr, 4, chunks[c]), read(tile_addr, 5, chunks[c])};
        write(tile_addr, offsets[c], 4, zero[c], staged[0]);
        write(tile_addr, offsets[c], 5, zero[c], staged[1]);
      }
      publish(4, 6);
      wait(6, 7);
#pragma unroll
      for (int c = 0; c < 2; ++c) write(tile_addr, offsets[c], 6, zero[c], read(tile_addr, 6, chunks[c]));
      publish(6, 7);
      wait(7, 9);
      uint4 slab8[2];  // 16-bit slab 8 overwrites staged slabs 7 and 8: read both before the barrier
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        slab8[c] = read(tile_addr, 8, chunks[c]);
        write(tile_addr, offsets[c], 7, zero[c], read(tile_addr, 7, chunks[c]));
      }
      publish(7, 8);
#pragma unroll
      for (int c = 0; c < 2; ++c) write(tile_addr, offsets[c], 8, zero[c], slab8[c]);
      publish(8, 9, /*sync=*/false);
    }
  }
};

// The producer warpgroup's loop: for block i, plan its loads (the block-table or slot reads), convert
// block i - 1 (its loads were issued an iteration ago), wait until the math warpgroups free block
// i's stage (they release block i - 2 once block i - 1's first slabs are converted, so the
// conversion must come first), then issue block i's loads, warp w taking slabs w, w + 4, w + 8. The
// last block is converted after the loop. A new block's loads are thus in flight while the math
// warpgroups work on the block before it.
template <typename Traits, bool kGather>
__device__ void produce_converted_kv_tiles(const DecodeParams& p, const DecodeTma& tma,
                                           typename Traits::SharedStorage& ss, const PartRange& range, int m_block) {
  const int warp = mla_common::warp_uniform((threadIdx.x % 128) / 32), lane = threadIdx.x % 32;
  int loaded = -1, loaded_valid_keys = 0;  // the block whose loads were issued last, not yet converted
  for_each_scheduled_block(p, range, m_block, [&](const Segment& seg, const int* pages, int blk, int iteration) {
    const int stage = iteration % Traits::kStages;
    auto wait_free = [&] {
      if (iteration >= Traits::kStages) {
        cutlass::arch::ClusterBarrier::wait(&ss.kv_empty[stage], ((iteration / Traits::kStages) - 1) & 1);
      }
    };
    if constexpr (kGather) {
      const auto rows = GatheredRows<Traits>::plan(p, tma, pages, seg, blk, lane);
      if (loaded >= 0) Fp8TileConverter<Traits>::convert_tile(ss, loaded, loaded_valid_keys);
      wait_free();
      rows.copy(p, ss, stage, warp, 4, kSlabs, lane);
    } else {
      const auto copies = BlockCopies<Traits>::plan(p, tma, pages, seg, blk, lane);
      if (loaded >= 0) Fp8TileConverter<Traits>::convert_tile(ss, loaded, loaded_valid_keys);
      wait_free();
      for (int slab = warp; slab < kSlabs; slab += 4) copies.expect(ss, stage, slab, lane);
      for (int slab = warp; slab < kSlabs; slab += 4) copies.copy(tma, ss, stage, slab, lane);
    }
    loaded = iteration;
    loaded_valid_keys = min(max(seg.seqlen_k - blk * kBlockN, 0), kBlockN);
  });
  if (loaded >= 0) Fp8TileConverter<Traits>::convert_tile(ss, loaded, loaded_valid_keys);
}

}  // namespace mla_decode
