// LSE merge of partial attentions: params and launcher (declarations only; the kernel is in
// merge_kernel.cuh). Semantics: csrc/bindings/ops_merge.cpp.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace mla_merge {

constexpr int kMaxRowDims = 4;  // leading (row) dims left after merging the mergeable ones

// Element strides of one tensor over the leading dims.
struct RowStrides {
  int64_t s[kMaxRowDims];
};

// Row r (row-major over row_size[0, rank)) of every tensor starts at its base + idx(r) . strides;
// the last dim (d elements, a multiple of 8) is contiguous and 16-byte aligned.
struct MergeParams {
  int rank;
  int64_t row_size[kMaxRowDims];
  int64_t num_rows;
  int d;
  // Pair form (pair = true): inputs 0 and 1 are in_out[k] / in_lse[k] with strides in_*_stride[k].
  // n-way form: input k is in_out[0] + k * out_n_stride, in_lse[0] + k * lse_n_stride, strides [0].
  bool pair;
  int num_inputs;
  const void* in_out[2];    // [..., d]
  const float* in_lse[2];   // [...]
  RowStrides in_out_stride[2], in_lse_stride[2];
  int64_t out_n_stride, lse_n_stride;
  void* out;                // [..., d], the inputs' dtype
  float* lse;               // [...]
  RowStrides out_stride, lse_stride;
};

// dtype: bf16, fp16 or fp32 (inputs and out).
cudaError_t run_merge(const MergeParams& params, mla_common::Dtype dtype, cudaStream_t stream);

}  // namespace mla_merge
