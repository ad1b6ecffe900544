// Packed pairs of 16-bit values (two in a 32-bit word) to and from floats: the P fragments, the
// output rows and the combine kernel's partial rows.
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

}  // namespace mla_decode
