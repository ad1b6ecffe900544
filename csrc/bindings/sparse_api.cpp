// CUDA implementation of the sparse-attention ops: checks, params, launch. The Python wrappers
// (python/mla_attn/sparse.py) check first with readable messages; these checks are the last line for
// callers of torch.ops.mla_attn.* directly. None of them syncs with the host.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "bindings/checks.h"
#include "sparse/compact_indices.h"

namespace {
using at::Tensor;

std::tuple<Tensor, Tensor> compact_sparse_indices_cuda(const Tensor& indices, const std::optional<Tensor>& topk_length,
                                                       int64_t num_slots) {
  mla_bindings::check_i32(indices, "indices", indices);
  TORCH_CHECK(indices.dim() == 2 && indices.size(1) >= 1, "mla_attn: indices must be [R, topk] with topk >= 1, got ",
              indices.sizes());
  const int64_t rows = indices.size(0);
  // one CTA per row (grid.x)
  TORCH_CHECK(rows <= std::numeric_limits<int>::max(), "mla_attn: indices has too many rows (at most 2^31 - 1)");
  // positions in a row are int, walked in tiles whose end must fit too
  constexpr int64_t kMaxTopk = std::numeric_limits<int>::max() - mla_sparse::kCompactTile;
  TORCH_CHECK(indices.size(1) <= kMaxTopk, "mla_attn: topk must be at most ", kMaxTopk, ", got ", indices.size(1));
  if (topk_length.has_value()) {
    mla_bindings::check_i32(*topk_length, "topk_length", indices);
    TORCH_CHECK(topk_length->dim() == 1 && topk_length->size(0) == rows, "mla_attn: topk_length must be [R] = [",
                rows, "], got ", topk_length->sizes());
  }
  TORCH_CHECK(num_slots >= 0, "mla_attn: num_slots must be >= 0, got ", num_slots);
  Tensor slots = at::empty({rows, indices.size(1)}, indices.options());
  Tensor counts = at::empty({rows}, indices.options());
  if (rows == 0) return {slots, counts};
  mla_bindings::check_sm90(indices, "sparse index compaction");

  mla_sparse::CompactParams p = {};
  p.indices = indices.data_ptr<int>();
  p.indices_stride = indices.stride(0);
  p.topk_length = topk_length.has_value() ? topk_length->data_ptr<int>() : nullptr;
  p.topk_length_stride = topk_length.has_value() ? topk_length->stride(0) : 0;
  p.rows = rows;
  p.topk = int(indices.size(1));
  p.num_slots = num_slots;
  p.slots = slots.data_ptr<int>();
  p.counts = counts.data_ptr<int>();
  const c10::cuda::CUDAGuard guard(indices.device());
  C10_CUDA_CHECK(mla_sparse::run_compact_sparse_indices(p, at::cuda::getCurrentCUDAStream()));
  return {slots, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_attn, CUDA, m) { m.impl("compact_sparse_indices", &compact_sparse_indices_cuda); }
