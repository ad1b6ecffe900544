// Decode geometry: numbers, and the block count of a length.
#pragma once

namespace mla_decode {

constexpr int kHeadDimK = 576;       // 512 latent + 64 rope; K = all of it
constexpr int kHeadDimV = 512;       // V = the first 512 columns of the K tile
constexpr int kBlockM = 64;          // query rows ((token, head) pairs) per tile
constexpr int kBlockN = 64;          // keys per KV block
constexpr int kStages = 2;           // KV blocks in flight (2 x 72 KB + 72 KB of Q fill shared memory)
constexpr int kNumMathWarpgroups = 2;
constexpr int kNumThreads = (kNumMathWarpgroups + 1) * 128;  // + one producer warpgroup
constexpr int kProducerWarps = 4;
constexpr int kMathRegisters = 232;  // 2 x 128 x 232 + 128 x 40 <= 64K registers
constexpr int kProducerRegisters = 40;
// Seesaw kernel (16-bit cache, seesaw/kernel.cuh). Its math warpgroups hold O (128 registers), S
// (32) and P (16): 232 / 40 compiles without spills (240 / 24 spilled, in the math warpgroups).
constexpr int kSeesawMathRegisters = 232;
constexpr int kSeesawProducerRegisters = 40;
// 16-bit cache, one q-tile per request (rows64_seesaw): a CTA whose part holds this many KV blocks or
// more runs the seesaw kernel, a shorter one the 64-row kernel. Forced on whole calls, the seesaw
// kernel's time over the 64-row kernel's was 1.06-1.08 at 62 blocks per part, 0.95-0.99 at 124.
constexpr int kLongPartBlocks = 96;
// Narrow kernel (<= 32 query rows per request with an fp8 cache, <= 16 with a 16-bit one;
// narrow/kernel.cuh): Q (<= 36 KB) and P^T leave room for 5 fp8 stages (16-bit: two 72 KB stages);
// its producer only issues TMA. Its math warpgroups and their registers depend on the rows (narrow/traits.h).
constexpr int kNarrowMaxRows = 32;
constexpr int kNarrowStages = 5;
constexpr int kNarrowProducerRegisters = 24;
constexpr int kTmaColumns = 64;      // one 128-byte swizzle atom of bf16/fp16
constexpr int kSlabs = kHeadDimK / kTmaColumns;  // a K tile arrives as 9 slabs, each with a barrier
// The narrow kernel's fp8 TMA tiles arrive by row groups instead: all nine slabs of 16 keys per copy.
constexpr int kFp8GroupRows = 16;
constexpr int kMaxSmParts = 1024;    // bound on num_sm_parts (split count of a request)
constexpr int kFixedSplitCost = 5;   // scheduler: cost of a split in blocks (metadata.py: FIXED_COST)
constexpr int kNoSplitSlack = 2;     // scheduler: whole requests if no worse by this (metadata.py: NO_SPLIT_SLACK)
constexpr int kMinSearchedPiece = 2;  // scheduler: smallest pieces its cost search tries (metadata.py: MIN_SEARCHED_PIECE)

// KV blocks of a length (0 for a length <= 0), rounded up in unsigned arithmetic: (L + 63) / 64 in int
// overflows for lengths within 63 of INT32_MAX, which unchecked lengths may be.
constexpr int num_kv_blocks(int seqlen) { return seqlen > 0 ? int((unsigned(seqlen) + kBlockN - 1) / kBlockN) : 0; }

// Workspace slots for split requests' partials (per q-tile): each of the parts - 1 part boundaries cuts
// at most one request, so at most 2 (parts - 1) pieces belong to split requests.
constexpr int split_partial_slots(int num_sm_parts) { return 2 * (num_sm_parts - 1); }

static_assert(kHeadDimK % kTmaColumns == 0, "K head dim must be whole swizzle atoms");
static_assert(kHeadDimV == kNumMathWarpgroups * 256, "each math warpgroup owns 256 output columns");
static_assert(kBlockN % 16 == 0 && kBlockM == 64, "one WGMMA M-tile per warpgroup");

}  // namespace mla_decode
