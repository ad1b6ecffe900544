// Packed pairs of 16-bit values (two in a 32-bit word) to and from floats: the P fragments, the
// output rows and the combine kernel's partial rows; and the largest |value| of Q rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>
#include <cstdint>
#include <type_traits>

namespace mla_decode {

// Two floats -> a packed pair of Element (cutlass::bfloat16_t or cutlass::half_t), first lowest.
template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  }
  return bits;
}
// The inverse: a packed pair of Element -> two floats.
template <typename Element>
__device__ __forceinline__ float2 unpack_pair(uint32_t bits) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

// The largest |x| of the eight 16-bit floats (bf16 or fp16) of `chunk` and of `acc`, as bit patterns,
// one per 16-bit half: with the sign cleared, 16-bit float bit patterns order as their values, so two
// values are compared per instruction (abs_max_value takes the larger half).
__device__ __forceinline__ uint32_t abs_max_bits(uint32_t acc, uint4 chunk) {
  constexpr uint32_t kAbs = 0x7fff7fffu;
  return __vimax3_u16x2(acc, __vimax3_u16x2(chunk.x & kAbs, chunk.y & kAbs, chunk.z & kAbs), chunk.w & kAbs);
}
// The value of the larger of abs_max_bits's two halves.
template <typename Element>
__device__ __forceinline__ float abs_max_value(uint32_t bits) {
  const uint32_t larger = max(bits & 0xffffu, bits >> 16);
  return unpack_pair<Element>(larger).x;
}

}  // namespace mla_decode
