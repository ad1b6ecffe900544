// Eight consecutive elements of one type <-> eight floats, moved with 16-byte accesses (8 bytes for
// fp8, two 16-byte accesses for fp32). Loads are streaming (ld.global.cs): the memory-bound kernels
// read every input once. fp8 is e4m3 with saturating round-to-nearest (the KV-cache encoding).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common/dtype.h"

namespace mla_common {

struct alignas(16) Bits32 {  // 32 bytes: eight fp32
  uint4 lo, hi;
};

template <typename T>
struct Vec8;

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ void from_float2(float2 x, __nv_bfloat162& y) { y = __float22bfloat162_rn(x); }
__device__ __forceinline__ void from_float2(float2 x, __half2& y) { y = __float22half2_rn(x); }

// bf16 / fp16 (T2: the pair type): one 16-byte access, float conversion in pairs.
template <typename T, typename T2>
struct Vec8Half {
  using Raw = uint4;
  static __device__ __forceinline__ Raw load(const T* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }
  static __device__ __forceinline__ void store(T* p, const Raw& v) { *reinterpret_cast<uint4*>(p) = v; }
  static __device__ __forceinline__ void to_float(const Raw& v, float (&f)[8]) {
    const T2* h = reinterpret_cast<const T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = to_float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ Raw from_float(const float (&f)[8]) {
    Raw v;
    T2* h = reinterpret_cast<T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) from_float2(make_float2(f[2 * i], f[2 * i + 1]), h[i]);
    return v;
  }
};

template <>
struct Vec8<__nv_bfloat16> : Vec8Half<__nv_bfloat16, __nv_bfloat162> {};
template <>
struct Vec8<__half> : Vec8Half<__half, __half2> {};

template <>
struct Vec8<float> {
  using Raw = Bits32;
  static __device__ __forceinline__ Raw load(const float* p) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    return {__ldcs(q), __ldcs(q + 1)};
  }
  static __device__ __forceinline__ void store(float* p, const Raw& v) {
    uint4* q = reinterpret_cast<uint4*>(p);
    q[0] = v.lo;
    q[1] = v.hi;
  }
  static __device__ __forceinline__ void to_float(const Raw& v, float (&f)[8]) {
    const float* x = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = x[i];
  }
  static __device__ __forceinline__ Raw from_float(const float (&f)[8]) {
    Raw v;
    float* x = reinterpret_cast<float*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = f[i];
    return v;
  }
};

template <>
struct Vec8<__nv_fp8_e4m3> {
  using Raw = uint2;
  static __device__ __forceinline__ Raw load(const __nv_fp8_e4m3* p) {
    return __ldcs(reinterpret_cast<const uint2*>(p));
  }
  static __device__ __forceinline__ void store(__nv_fp8_e4m3* p, const Raw& v) {
    *reinterpret_cast<uint2*>(p) = v;
  }
  static __device__ __forceinline__ void to_float(const Raw& v, float (&f)[8]) {  // exact
    const __nv_fp8x2_storage_t* s = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(s[i], __NV_E4M3)));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ Raw from_float(const float (&f)[8]) {  // saturating, nearest
    Raw v;
    __nv_fp8x2_storage_t* s = reinterpret_cast<__nv_fp8x2_storage_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[i] = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * i], f[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    }
    return v;
  }
};

// Calls f(T{}) with the element type named by d.
template <typename F>
__host__ cudaError_t with_type(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kBf16: return f(__nv_bfloat16{});
    case Dtype::kFp16: return f(__half{});
    case Dtype::kFp32: return f(float{});
    case Dtype::kFp8E4m3: return f(__nv_fp8_e4m3{});
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ bool is_inf(float x) { return (__float_as_uint(x) & 0x7fffffffu) == 0x7f800000u; }

}  // namespace mla_common
