// Prefill geometry: numbers only.
#pragma once

namespace mla_prefill {

constexpr int kHeadDimQK = 192;      // 128 "nope" + 64 rope
constexpr int kHeadDimV = 128;
constexpr int kHeadDimNope = 128;    // with a separate k_pe, K = [k_nope (128) | k_pe (64)]
constexpr int kBlockM = 128;         // query rows per tile: 64 per math warpgroup
constexpr int kBlockN = 128;         // keys per KV block
constexpr int kStages = 2;           // K and V blocks in flight (2 x (48 + 32) KB + 48 KB of Q)
constexpr int kNumMathWarpgroups = 2;
constexpr int kNumThreads = (kNumMathWarpgroups + 1) * 128;  // + one producer warpgroup
constexpr int kMathRegisters = 240;  // 2 x 128 x 240 + 128 x 24 <= 64K registers
constexpr int kProducerRegisters = 24;
constexpr int kTmaColumns = 64;      // one 128-byte swizzle atom of bf16/fp16
constexpr int kSlabsQK = kHeadDimQK / kTmaColumns;
constexpr int kSlabsV = kHeadDimV / kTmaColumns;

static_assert(kHeadDimQK % kTmaColumns == 0 && kHeadDimV % kTmaColumns == 0, "whole swizzle atoms");
static_assert(kHeadDimNope % kTmaColumns == 0, "k_nope / k_pe boundary on a slab boundary");
static_assert(kBlockM == kNumMathWarpgroups * 64, "one 64-row WGMMA M-tile per math warpgroup");
static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "WGMMA N");

}  // namespace mla_prefill
