// ds_mla_fp8 KV-cache write (quantise) and gather (dequantise): DeepSeek-V3.2's 656-byte rows
// (kv_cache.h has the byte offsets). The encoding is python/mla_attn/kv_cache.py's quantize_ds_mla_fp8,
// bit for bit for finite inputs:
//   scale of a 128-value tile = max(amax / 448, 1e-4) rounded up to a power of two (fp32 division),
//   latent byte = e4m3_rn(x / scale), rope = bf16_rn(k_pe).
// With a power-of-two scale x / scale is exact and |x / scale| <= 448, so e4m3's round-to-nearest-even
// is the only rounding and saturation never triggers. Under -ftz (fast math) a division whose result
// would be an fp32 subnormal gives a signed zero instead; both are below e4m3's smallest subnormal
// (2^-9), so the stored byte is the same signed zero.
#pragma once
#include <cstdint>

#include "kv_cache/kv_cache_kernel.cuh"

namespace mla_kv_cache {

constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kDsLanesPerTile = kDsTile / 16;  // each lane quantises 16 latent values
static_assert(kDimLatent == 32 * 16 && kDimRope == 8 * 8, "one warp per token: 16 latent values per lane, "
              "8 rope values on each of lanes 0-7");

using Bf16 = __nv_bfloat16;

// max that keeps a NaN (fmaxf drops it): a NaN in a tile gives a NaN scale, as torch's amax does.
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// The tile's scale from its amax (see the header): the smallest power of two >= y, by carrying a
// full mantissa into the exponent; inf and NaN stay (they poison the tile, as on the CPU).
__device__ __forceinline__ float ds_tile_scale(float amax) {
  float y = __fdiv_rn(amax, 448.f);
  y = y < 1e-4f ? 1e-4f : y;  // NaN compares false and stays
  if (!isfinite(y)) return y;
  return __uint_as_float((__float_as_uint(y) + 0x7fffffu) & 0x7f800000u);
}

// One warp per token (tokens strided over warps): lane l quantises latent values [16 l, 16 l + 16), so
// tile k is lanes 8k..8k+7 and its amax is three shuffles; lane 0 writes the four scales in one 16-byte
// store; lanes 0-7 also copy one 8-value rope chunk each. A skipped slot is warp-uniform.
template <typename Tin>
__global__ void __launch_bounds__(kThreads) write_ds_mla_fp8_kernel(const __grid_constant__ WriteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_stride = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); t < p.num_tokens; t += warp_stride) {
    const Tin* src = static_cast<const Tin*>(p.kv_c) + t * p.kv_c_stride + lane * 16;
    const auto raw_lo = Vec8<Tin>::load(src);  // issued with the slot and rope loads (one memory latency)
    const auto raw_hi = Vec8<Tin>::load(src + 8);
    typename Vec8<Tin>::Raw raw_pe = {};
    if (lane < 8) raw_pe = Vec8<Tin>::load(static_cast<const Tin*>(p.k_pe) + t * p.k_pe_stride + lane * 8);
    const int64_t slot = __ldg(p.slot_mapping + t * p.slot_stride);
    if (slot < 0 || slot >= p.num_slots) continue;  // padding token; a slot past the cache is never written
    const int64_t page = slot / p.page_size;
    uint8_t* row = static_cast<uint8_t*>(p.cache) + page * p.page_stride + (slot - page * p.page_size) * p.token_stride;

    float lo[8], hi[8];
    Vec8<Tin>::to_float(raw_lo, lo);
    Vec8<Tin>::to_float(raw_hi, hi);
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = max_keep_nan(max_keep_nan(amax, fabsf(lo[e])), fabsf(hi[e]));
#pragma unroll
    for (int offset = kDsLanesPerTile / 2; offset > 0; offset >>= 1) {
      amax = max_keep_nan(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float scale = ds_tile_scale(amax);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      lo[e] = __fdiv_rn(lo[e], scale);  // exact (power of two); IEEE division as on the CPU
      hi[e] = __fdiv_rn(hi[e], scale);
    }
    const uint2 q_lo = Vec8<Fp8>::from_float(lo), q_hi = Vec8<Fp8>::from_float(hi);
    *reinterpret_cast<uint4*>(row + lane * 16) = make_uint4(q_lo.x, q_lo.y, q_hi.x, q_hi.y);

    float4 scales;
    scales.x = __shfl_sync(0xffffffffu, scale, 0 * kDsLanesPerTile);
    scales.y = __shfl_sync(0xffffffffu, scale, 1 * kDsLanesPerTile);
    scales.z = __shfl_sync(0xffffffffu, scale, 2 * kDsLanesPerTile);
    scales.w = __shfl_sync(0xffffffffu, scale, 3 * kDsLanesPerTile);
    if (lane == 0) *reinterpret_cast<float4*>(row + kDsScaleOffset) = scales;

    if (lane < 8) {
      Bf16* dst = reinterpret_cast<Bf16*>(row + kDsRopeOffset) + lane * 8;
      if constexpr (std::is_same_v<Tin, Bf16>) {
        Vec8<Bf16>::store(dst, raw_pe);
      } else {
        float f[8];
        Vec8<Tin>::to_float(raw_pe, f);  // fp16 -> fp32 is exact, so this is one bf16 rounding
        Vec8<Bf16>::store(dst, Vec8<Bf16>::from_float(f));
      }
    }
  }
}

// One thread per 8-value chunk of a 576-wide output row, as gather_kernel: chunks 0-63 are e4m3 bytes
// times their tile's scale (fp32 product, exact for power-of-two scales), chunks 64-71 the bf16 rope.
template <typename Tout>
__global__ void __launch_bounds__(kThreads) gather_ds_mla_fp8_kernel(const __grid_constant__ GatherParams p) {
  const int total = __ldg(p.cu_seqlens + p.batch);
  for_each_row_chunk(p.num_tokens, [&](int64_t r, int c) {
    Tout* dst = static_cast<Tout*>(p.out) + r * kDimRow + c * 8;
    const uint8_t* row = find_row<uint8_t>(p, r, total);
    float f[8] = {};
    if (row != nullptr && c < kChunksLatent) {
      const auto raw = Vec8<Fp8>::load(reinterpret_cast<const Fp8*>(row + c * 8));
      const float scale = *reinterpret_cast<const float*>(row + kDsScaleOffset + 4 * (c * 8 / kDsTile));
      Vec8<Fp8>::to_float(raw, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(f[e], scale);
    } else if (row != nullptr) {
      const auto raw = Vec8<Bf16>::load(reinterpret_cast<const Bf16*>(row + kDsRopeOffset) + (c - kChunksLatent) * 8);
      if constexpr (std::is_same_v<Tout, Bf16>) {
        Vec8<Bf16>::store(dst, raw);
        return;
      } else {
        Vec8<Bf16>::to_float(raw, f);
      }
    }
    Vec8<Tout>::store(dst, Vec8<Tout>::from_float(f));  // rows past the batch / bad pages: zeros
  });
}

}  // namespace mla_kv_cache
