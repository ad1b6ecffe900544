// DeepSeek-V3.2's FP8 latent cache row (kv_format "ds_mla_fp8"): one 656-byte row per token, written
// and gathered by csrc/kv_cache, read directly by the decode kernel's row gather (rows64). Plain C++.
#pragma once

namespace mla_common {

constexpr int kDsDimLatent = 512;                                  // kv_c
constexpr int kDsDimRope = 64;                                     // k_pe
constexpr int kDsTile = 128;                                       // latent values per scale
constexpr int kDsNumTiles = kDsDimLatent / kDsTile;                // 4 fp32 scales, powers of two
constexpr int kDsScaleOffset = kDsDimLatent;                       // [0, 512): e4m3 latent values
constexpr int kDsRopeOffset = kDsScaleOffset + 4 * kDsNumTiles;    // [512, 528): the scales
constexpr int kDsRowBytes = kDsRopeOffset + 2 * kDsDimRope;        // [528, 656): bf16 rope values
static_assert(kDsRowBytes == 656 && kDsRopeOffset % 16 == 0 && kDsRowBytes % 16 == 0,
              "16-byte pieces of a row stay 16-byte aligned");

}  // namespace mla_common
