// Launchers of the decode kernels (declarations only: the bindings never parse CuTe).
#pragma once
#include <cuda_runtime.h>
#include "common/tma_desc.h"
#include "mla_decode/params.h"

namespace cutlass {  // element types of the instantiations, declared so the bindings need no CUTLASS
struct bfloat16_t;
struct half_t;
}  // namespace cutlass

namespace mla_decode {

// n / divisor by a multiply-high (FastDivisor, params.h), for divisor >= 1.
FastDivisor make_fast_divisor(int divisor);

// Builds the TMA descriptor for the paged cache (element: the cache's type; rows_only: a kernel that
// gathers every row, the 64-row kernel's fp8 forms; row_groups: boxes of 16 keys x all 576 fp8 columns,
// the narrow kernel's fp8 form); returns an error message or nullptr.
const char* make_kv_tma(const DecodeParams& params, mla_common::TmaElement element, bool rows_only, bool row_groups,
                        DecodeTma* tma);

// Builds the Q maps of `tma` (q of [num_batches, num_tokens, h_q, ..], 16-bit elements) for the
// seesaw kernel; returns whether they could be made (h_q a multiple of 64, TMA-compatible strides),
// which the caller stores in tma->q_by_tma.
bool make_q_tma(const DecodeParams& params, int64_t num_tokens, int64_t num_batches, mla_common::TmaElement element,
                DecodeTma* tma);

// Split kernel + (when any request is split) the combine kernel, chained with PDL. Element is q's
// (and out's) type; kFp8Kv: the cache is float8_e4m3fn (dequantized in shared memory, p.k_scale).
template <typename Element, bool kFp8Kv>
cudaError_t run_mla_decode(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// The same (the 64-row kernel) for DeepSeek-V3.2's cache, uint8 rows of 656 bytes (kv_format
// "ds_mla_fp8": 512 e4m3 values, 4 power-of-two fp32 scales, 64 bf16 rope values), dequantized
// exactly to fp16 in shared memory; its rows are always gathered (DecodeTma::gather).
template <typename Element>
cudaError_t run_mla_decode_ds_mla_fp8(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// The same for an fp8 cache with fp8 MMAs: Q and P rounded to e4m3 too (fp8mma/kernel.cuh).
template <typename Element>
cudaError_t run_mla_decode_fp8mma(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// The same for a 16-bit cache with the seesaw kernel: the two math warpgroups take a pair of KV
// blocks at once, one's softmax overlapping the other's MMAs (seesaw/kernel.cuh). kSteadyLoop: long
// segments run their unmasked pairs in a loop without the masking, tail and last-pair code.
template <typename Element, bool kSteadyLoop>
cudaError_t run_mla_decode_seesaw(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// The same for a 16-bit cache with one q-tile per request: each CTA runs the seesaw kernel (steady loop)
// where its part of the schedule holds kLongPartBlocks or more KV blocks, else the 64-row kernel
// (rows64_seesaw/kernel.cuh). TMA boxes only (not DecodeTma::gather).
template <typename Element>
cudaError_t run_mla_decode_rows64_seesaw(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// The same for at most kRows (16 or 32) query rows per request (max_seqlen_q x heads): the narrow
// kernel, whose MMAs have N = kRows, with kMathWarpgroups (2, or 3 at 16 rows with an fp8 cache)
// consuming tiles (narrow/kernel.cuh, narrow/traits.h). kFp8Kv as above; at 16 rows gathered rows
// (DecodeTma::gather) are copied whole into staging rows instead of by cp.async.
template <typename Element, int kRows, int kMathWarpgroups, bool kFp8Kv>
cudaError_t run_mla_decode_narrow(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// The narrow kernel (two math warpgroups) for the ds_mla_fp8 cache: rows copied whole, converted in
// registers with their scales; always gathered (DecodeTma::gather).
template <typename Element, int kRows>
cudaError_t run_mla_decode_narrow_ds_mla_fp8(const DecodeParams& params, const DecodeTma& tma, cudaStream_t stream);

// One-CTA scheduler kernel: fills tile_sched [num_sms] and req_splits [batch, 2] (8-byte aligned: a
// large batch keeps its prefix sums there until the values are written). The partition depends on
// the KV lengths only; query lengths and heads enter through num_sm_parts. With `deterministic`,
// parts end only at request boundaries (no request is split).
cudaError_t run_decode_metadata(const int* cache_seqlens, int batch, int num_sm_parts, int num_sms,
                                bool deterministic, ScheduleRow* tile_sched, int* req_splits,
                                cudaStream_t stream);

}  // namespace mla_decode
