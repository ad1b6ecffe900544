// Which split kernel runs a decode call: the default choice and which kernels can run a case at
// all (for the `kernel=` override of the ops). Host-only plain C++: the bindings include it.
// Measurements behind the thresholds: BENCHMARKS.md.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include "mla_decode/config.h"

namespace mla_decode {

enum class DecodeKernel {
  kNarrow16,      // transposed MMAs, N = 16 rows; 2 math warpgroups (narrow/)
  kNarrow16x3,    // the same with 3 math warpgroups (fp8 cache)
  kNarrow32,      // transposed MMAs, N = 32 rows (fp8 cache)
  kRows64,        // 64-row q-tiles (rows64/)
  kSeesaw,        // 64-row q-tiles, two warpgroups on a pair of KV blocks (seesaw/)
  kSeesawSteady,  // the same with the steady loop for long segments
  kFp8Mma,        // 64-row q-tiles, e4m3 MMAs (fp8mma/)
  kRows64Seesaw,  // per CTA: the seesaw kernel (steady loop) on a long part, else the 64-row kernel (rows64_seesaw/)
};

// The names of the `kernel=` option (python/mla_attn/metadata.py: DECODE_KERNELS mirrors them).
struct DecodeKernelName {
  DecodeKernel kernel;
  std::string_view name;
};
inline constexpr std::array<DecodeKernelName, 8> kDecodeKernelNames = {{
    {DecodeKernel::kNarrow16, "narrow16"},
    {DecodeKernel::kNarrow16x3, "narrow16_3wg"},
    {DecodeKernel::kNarrow32, "narrow32"},
    {DecodeKernel::kRows64, "rows64"},
    {DecodeKernel::kSeesaw, "seesaw"},
    {DecodeKernel::kSeesawSteady, "seesaw_steady"},
    {DecodeKernel::kFp8Mma, "fp8mma"},
    {DecodeKernel::kRows64Seesaw, "rows64_seesaw"},
}};

// nullopt for a name that is not a kernel's.
constexpr std::optional<DecodeKernel> parse_decode_kernel(std::string_view name) {
  for (const auto& entry : kDecodeKernelNames) {
    if (entry.name == name) return entry.kernel;
  }
  return std::nullopt;
}

struct DecodeProblem {
  bool fp8_cache;        // float8_e4m3fn cache; else the cache has q's 16-bit type
  bool ds_mla_fp8_cache;  // DeepSeek-V3.2's uint8 rows of 656 bytes (kv_format "ds_mla_fp8")
  int64_t max_seqlen_q;  // query tokens of the longest request
  int64_t heads_q;
  int64_t batch;
  bool deterministic;  // a request's result must not depend on the rest of the batch
  bool fp8_mma;        // e4m3 MMAs allowed (opt-in)
  bool gathered_rows;  // keys gathered row by row (slot lists, or pages not a multiple of 16)

  constexpr int64_t rows() const { return max_seqlen_q * heads_q; }  // query rows of the longest request
  constexpr int64_t q_tiles() const { return (rows() + kBlockM - 1) / kBlockM; }  // per request
  constexpr int64_t q_tiles_of_work() const { return batch * q_tiles(); }
};

// Rows the narrow kernels hold: the N of their transposed MMAs.
constexpr int kNarrow16Rows = 16;
constexpr int kNarrow32Rows = kNarrowMaxRows;
// fp8 cache. The narrow kernel converts the cache in registers. 16 rows with three math warpgroups
// keep more tiles in flight but each tile takes longer: from batch 2 only. 32 rows have few
// registers to load ahead: slower than the 64-row kernel for a single request.
constexpr int64_t kNarrow16x3MinBatch = 2;
constexpr int64_t kNarrow32MinBatch = 2;
// ds_mla_fp8 cache, 32 rows: against the 64-row kernel, sparse top-k 2048 at h_q 32, 0.86x at 32 index
// rows, 0.98x at 64, 1.14x at 128, 1.17x at 256.
constexpr int64_t kNarrow32DsMinBatch = 128;
// 16-bit cache. The seesaw kernel overlaps one warpgroup's softmax with the other's MMAs, which pays
// where the MMAs bound the time: where a request's rows fill two or more q-tiles, which share each
// KV tile (at one q-tile it pays only with long contexts, which the host does not see), and
// from 5 q-tiles of work (with less, its larger code costs more than the overlap gains when the code
// is not in L2). Its steady loop pays in segments of 32+ blocks but its code costs every call when
// not in L2; lengths are on the device, so it is taken from 128 q-tiles of work, where such segments
// are likely. At one q-tile, rows64_seesaw: each CTA chooses by the length of its part
// (kLongPartBlocks), unless `deterministic` (a request's path would depend on the parts around it).
constexpr int64_t kSeesawMinQTilesPerRequest = 2;
constexpr int64_t kSeesawMinQTiles = 5;
constexpr int64_t kSteadyMinQTiles = 128;

// The default kernel. Few query rows take a narrow kernel, whose MMAs have N = rows instead of 64
// padded rows; never with `deterministic`, since rows depend on the batch's max_seqlen_q: the choice
// then depends on h_q alone (and a seesaw kernel always takes the steady loop, so that a request's
// path depends on its length alone).
constexpr DecodeKernel choose_decode_kernel(const DecodeProblem& p) {
  const int64_t rows = p.rows();
  const bool narrow16 = !p.deterministic && rows <= kNarrow16Rows;
  // ds_mla_fp8 rows: the 64-row kernel, or the narrow kernel's form for it (two math warpgroups: a
  // third ran no faster, sparse top-k 2048 at h_q 16, batch 32 and 128).
  if (p.ds_mla_fp8_cache) {
    if (narrow16) return DecodeKernel::kNarrow16;
    const bool narrow32 = !p.deterministic && rows <= kNarrow32Rows && p.batch >= kNarrow32DsMinBatch;
    return narrow32 ? DecodeKernel::kNarrow32 : DecodeKernel::kRows64;
  }
  if (!p.fp8_cache) {
    if (narrow16) return DecodeKernel::kNarrow16;  // 32 rows measured slower than the 64-row kernel
    // Gathered rows (by cp.async, which bounds the time): the 64-row kernel, 1.22-1.26x the seesaw
    // kernel with both copying whole rows by four warps (h_q 128 pages 1 / 8; sparse top-k 2048, bf16,
    // h_q 128 s1 / s2 at batch 32 and 128): it hands a stage back after the next block's first QK
    // group, the seesaw kernel once both V halves are done. Batch-independent, so `deterministic`
    // takes it too.
    if (p.gathered_rows) return DecodeKernel::kRows64;
    const int64_t head_tiles = (p.heads_q + kBlockM - 1) / kBlockM;
    const bool seesaw = p.deterministic
                            ? head_tiles >= kSeesawMinQTilesPerRequest
                            : p.q_tiles() >= kSeesawMinQTilesPerRequest && p.q_tiles_of_work() >= kSeesawMinQTiles;
    if (!seesaw) {
      return p.q_tiles() == 1 && !p.deterministic ? DecodeKernel::kRows64Seesaw : DecodeKernel::kRows64;
    }
    return p.deterministic || p.q_tiles_of_work() >= kSteadyMinQTiles ? DecodeKernel::kSeesawSteady
                                                                       : DecodeKernel::kSeesaw;
  }
  if (narrow16) return p.batch >= kNarrow16x3MinBatch ? DecodeKernel::kNarrow16x3 : DecodeKernel::kNarrow16;
  // e4m3 MMAs (opt-in; Q and P rounded to e4m3) above 16 rows: at 16 rows or fewer the narrow kernel
  // streams the cache and stays.
  if (p.fp8_mma) return DecodeKernel::kFp8Mma;
  const bool narrow32 = !p.deterministic && rows <= kNarrow32Rows;
  return narrow32 && p.batch >= kNarrow32MinBatch ? DecodeKernel::kNarrow32 : DecodeKernel::kRows64;
}

// The kernel a forced one runs as: rows64_seesaw takes TMA boxes only, and with it a request's path
// depends on the parts around it, so gathered rows and `deterministic` run its 64-row kernel alone.
constexpr DecodeKernel decode_kernel_that_runs(DecodeKernel kernel, const DecodeProblem& p) {
  const bool rows64_only = p.gathered_rows || p.deterministic;
  return kernel == DecodeKernel::kRows64Seesaw && rows64_only ? DecodeKernel::kRows64 : kernel;
}

// Split partials in fp32 instead of q's dtype. A 16-bit partial rounds its split's normalised output
// once more; over a request cut into many splits with near-uniform attention those roundings add up to
// about the output's own rounding error (FlashMLA's dense-decoding tests failed their cosine bar by it
// at h_q 1, bf16). fp32 doubles the partials' bytes, so only for requests of at most 8 rows, whose fp32
// partials are no larger than those of a 16-row request in 16 bits; only the narrow kernels run those.
constexpr int64_t kFp32PartialsMaxRows = 8;
constexpr bool decode_partials_fp32(DecodeKernel kernel, const DecodeProblem& p) {
  const bool narrow = kernel == DecodeKernel::kNarrow16 || kernel == DecodeKernel::kNarrow16x3 ||
                      kernel == DecodeKernel::kNarrow32;
  return narrow && p.rows() <= kFp32PartialsMaxRows;
}

// What a kernel needs to run a case at all (for messages): its instantiations and the rows its
// MMAs hold. A ds_mla_fp8 cache is read by rows64, narrow16 and narrow32 only.
constexpr std::string_view decode_kernel_requirement(DecodeKernel kernel) {
  switch (kernel) {
    case DecodeKernel::kNarrow16: return "at most 16 query rows per request (max_seqlen_q x h_q)";
    case DecodeKernel::kNarrow16x3: return "a float8_e4m3fn cache and at most 16 query rows per request (max_seqlen_q x h_q)";
    case DecodeKernel::kNarrow32: return "a float8_e4m3fn cache and at most 32 query rows per request (max_seqlen_q x h_q)";
    case DecodeKernel::kRows64: return "nothing";
    case DecodeKernel::kSeesaw:
    case DecodeKernel::kSeesawSteady:
    case DecodeKernel::kRows64Seesaw: return "a 16-bit (bf16/fp16) cache";
    case DecodeKernel::kFp8Mma: return "a float8_e4m3fn cache";
  }
  return "?";
}

constexpr bool decode_kernel_supports(DecodeKernel kernel, const DecodeProblem& p) {
  if (p.ds_mla_fp8_cache) {
    return kernel == DecodeKernel::kRows64 || (kernel == DecodeKernel::kNarrow16 && p.rows() <= kNarrow16Rows) ||
           (kernel == DecodeKernel::kNarrow32 && p.rows() <= kNarrow32Rows);
  }
  switch (kernel) {
    case DecodeKernel::kNarrow16: return p.rows() <= kNarrow16Rows;
    case DecodeKernel::kNarrow16x3: return p.fp8_cache && p.rows() <= kNarrow16Rows;
    case DecodeKernel::kNarrow32: return p.fp8_cache && p.rows() <= kNarrow32Rows;
    case DecodeKernel::kRows64: return true;
    case DecodeKernel::kSeesaw:
    case DecodeKernel::kSeesawSteady:
    case DecodeKernel::kRows64Seesaw: return !p.fp8_cache;
    case DecodeKernel::kFp8Mma: return p.fp8_cache;
  }
  return false;
}

// Whether the kernel takes its Q tiles by TMA where the maps can be made (make_q_tma: a q-tile is 64
// heads of one token, so h_q a multiple of 64): the seesaw kernels above 64 heads only (the 64-row
// kernel ran slower with that loader).
constexpr bool decode_kernel_wants_q_by_tma(DecodeKernel kernel, const DecodeProblem& p) {
  return (kernel == DecodeKernel::kSeesaw || kernel == DecodeKernel::kSeesawSteady) && p.heads_q > kBlockM;
}

}  // namespace mla_decode
