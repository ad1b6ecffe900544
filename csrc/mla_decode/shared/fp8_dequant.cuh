// An fp8 (e4m3) K tile as TMA stages it, the conversion of its values to fp16, and the power of two
// a 16-bit Q row is stored times for fp16 MMAs (rows64 and narrow with an fp8 cache; fp8mma reads
// the staged layout only).
//
// Slab s (64 of the 576 columns) of a staged tile is [64 rows][64 B] at s * kFp8SlabBytes; the TMA
// map's 64-byte swizzle stores 16-byte chunk k of row r at chunk k ^ ((r >> 1) & 3), so that 8
// consecutive rows at one logical chunk (an ldmatrix of V^T) and 8 rows x 4 chunks (LDS of K) hit
// distinct banks. Needs each slab 512-byte aligned. The narrow kernel's TMA tiles are laid out by 16-key
// row groups instead (fp8_tile_offset).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "mla_decode/config.h"

namespace mla_decode {

constexpr int kFp8SlabBytes = kBlockN * kTmaColumns;  // 64 rows x 64 one-byte columns

// Byte offset of 16-byte chunk `chunk` (0..3) of row `row` within a staged slab.
__device__ __forceinline__ int fp8_slab_offset(int row, int chunk) {
  return row * kTmaColumns + ((chunk ^ ((row >> 1) & 3)) << 4);
}

// A tile staged by 16-key row groups (the narrow kernel's TMA form, one copy per group: shared/
// kv_producer.cuh): group g = row / 16 at g * kFp8GroupBytes holds slab s as [16 rows][64 B] at
// s * kFp8GroupSlabBytes. Each such piece starts on 1024 bytes, so the 64-byte swizzle puts a chunk
// where fp8_slab_offset does.
constexpr int kFp8GroupSlabBytes = kFp8GroupRows * kTmaColumns;
constexpr int kFp8GroupBytes = kSlabs * kFp8GroupSlabBytes;

// Byte offset of 16-byte chunk `chunk` of slab `slab` of key row `row` in a staged fp8 tile: by slabs,
// or by row groups (kRowGroups).
template <bool kRowGroups>
__device__ __forceinline__ int fp8_tile_offset(int slab, int row, int chunk) {
  if constexpr (kRowGroups) {
    return (row / kFp8GroupRows) * kFp8GroupBytes + slab * kFp8GroupSlabBytes + fp8_slab_offset(row % kFp8GroupRows, chunk);
  } else {
    return slab * kFp8SlabBytes + fp8_slab_offset(row, chunk);
  }
}

// Four e4m3 values (first lowest) -> f16x2 of values 0, 1 (`lo`) and of values 2, 3 (`hi`). Exact.
// Each cvt reads one 16-bit half of the source register in place (F2FP ... R.H1): splitting the
// word with mov.b32 instead of a shift or mask costs no instruction.
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(four_bytes));
}

// f16x2 bits times `scale` (HMUL2).
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t f16x2, __half2 scale) {
  const __half2 product = __hmul2(*reinterpret_cast<const __half2*>(&f16x2), scale);
  return *reinterpret_cast<const uint32_t*>(&product);
}

// bf16x2 bits -> f16x2 bits, rounded to nearest (exact within fp16's normal range).
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t bf16x2) {
  const __half2 h = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bf16x2)));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The power of two a 16-bit Q row whose largest |value| is row_max (>= 0) is stored times as fp16,
// so that the MMAs run in fp16 (e4m3 -> fp16 is one cvt per pair; -> bf16 takes four): it brings
// row_max to [2^14, 2^15), which keeps every value above 2^-28 of it exact. 1 for a zero row.
__device__ __forceinline__ float fp16_row_scale(float row_max) {
  const int exponent = (__float_as_int(row_max) >> 23) - 127;  // floor(log2(row_max))
  return row_max > 0.f ? __int_as_float((min(14 - exponent, 100) + 127) << 23) : 1.f;
}

// Two bf16 Q values (first lowest) -> f16x2 of each times `scale` (fp16_row_scale): a bf16 is the
// high half of an fp32, the product is exact, and the cvt to fp16 rounds once.
__device__ __forceinline__ uint32_t scaled_f16x2(uint32_t pair, float scale) {
  const __half2 h = __floats2half2_rn(__uint_as_float(pair << 16) * scale, __uint_as_float(pair & 0xffff0000u) * scale);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace mla_decode
