// Paged latent KV cache: write and gather (declarations only; kernels in kv_cache_kernel.cuh).
// Semantics: csrc/bindings/ops_kv_cache.cpp.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/ds_mla_fp8_layout.h"
#include "common/dtype.h"

namespace mla_kv_cache {

constexpr int kDimLatent = 512;  // kv_c
constexpr int kDimRope = 64;     // k_pe
constexpr int kDimRow = kDimLatent + kDimRope;

// ds_mla_fp8 (DeepSeek-V3.2): one 656-byte row per token (common/ds_mla_fp8_layout.h).
using mla_common::kDsNumTiles;
using mla_common::kDsRopeOffset;
using mla_common::kDsRowBytes;
using mla_common::kDsScaleOffset;
using mla_common::kDsTile;

// All strides in elements; every row (and the 8-element chunks in it) is 16-byte aligned
// (8-byte for fp8).
struct WriteParams {
  const void* kv_c;             // [T, 512]
  int64_t kv_c_stride;
  const void* k_pe;             // [T, 64]
  int64_t k_pe_stride;
  const int64_t* slot_mapping;  // [T]: page * page_size + offset; < 0 skips the token
  int64_t slot_stride;
  void* cache;                  // [num_pages, page_size, 576] (ds_mla_fp8: uint8 [.., 656])
  int64_t page_stride, token_stride;
  int64_t num_tokens, page_size, num_slots;  // num_slots = num_pages * page_size
  const float* k_scale;         // [1], fp8 cache only: stored = e4m3(x / k_scale)
};

struct GatherParams {
  const void* cache;            // [num_pages, page_size, 576] (ds_mla_fp8: uint8 [.., 656])
  int64_t page_stride, token_stride;
  int num_pages, page_size;
  const int* block_table;       // [batch, max_pages]
  int64_t block_table_stride;
  int max_pages;
  const int* cu_seqlens;        // [batch + 1], contiguous
  int batch;
  void* out;                    // [num_tokens, 576], contiguous
  int64_t num_tokens;
  const float* k_scale;         // [1], fp8 cache only: out = stored * k_scale
};

// in: bf16/fp16; cache: in, or fp8.
cudaError_t run_write_kv_cache(const WriteParams& params, mla_common::Dtype in, mla_common::Dtype cache,
                               cudaStream_t stream);
// cache: bf16/fp16/fp8; out: bf16/fp16/fp32.
cudaError_t run_gather_kv_cache(const GatherParams& params, mla_common::Dtype cache, mla_common::Dtype out,
                                cudaStream_t stream);

// ds_mla_fp8 cache (k_scale unused). Write: in bf16/fp16. Gather: out bf16/fp16/fp32.
cudaError_t run_write_ds_mla_fp8(const WriteParams& params, mla_common::Dtype in, cudaStream_t stream);
cudaError_t run_gather_ds_mla_fp8(const GatherParams& params, mla_common::Dtype out, cudaStream_t stream);

}  // namespace mla_kv_cache
