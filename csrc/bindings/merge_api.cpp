// CUDA implementations of the merge ops: checks, row layout, launch. The Python wrappers
// (python/mla_attn/merge.py) check first with readable messages; these checks are the last line for
// callers of torch.ops.mla_attn.* directly. None of them syncs with the host.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "bindings/checks.h"
#include "merge/merge.h"

namespace {
using at::IntArrayRef;
using at::Tensor;
using mla_merge::kMaxRowDims;
using mla_merge::MergeParams;
using mla_merge::RowStrides;

void check_outs(const Tensor& t, const char* name, const Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat,
              "mla_attn: ", name, " must be bfloat16, float16 or float32, got ", t.scalar_type());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "mla_attn: ", name, " must have dtype ", like.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) > 0 && t.size(-1) % 8 == 0 && t.size(-1) <= INT32_MAX, "mla_attn: ", name,
              " must be [..., d] with d a positive multiple of 8 below 2^31, got ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, "mla_attn: ", name, " must be contiguous in its last dim");
  mla_bindings::check_aligned(t, name, 16);
}

void check_lse(const Tensor& t, const char* name, IntArrayRef shape) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "mla_attn: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "mla_attn: ", name, " must have shape ", shape, ", got ", t.sizes());
}

// An output may be an input itself (same start, sizes and strides; a size-1 dim's stride is never
// stepped): each thread reads its chunk of the inputs before writing it. Any other overlap races: a
// view one row on reads rows another thread has written. A ValueError, as checks.h's check_apart.
void check_output_overlap(const Tensor& out, const char* name, const Tensor& in, const char* in_name) {
  bool same = out.data_ptr() == in.data_ptr() && out.sizes() == in.sizes();
  for (int64_t d = 0; same && d < out.dim(); ++d) same = out.size(d) == 1 || out.stride(d) == in.stride(d);
  TORCH_CHECK_VALUE(same || !mla_bindings::share_an_address(out, in), "mla_attn: ", name, " shares part of ", in_name,
                    "'s memory; an output may be an input, or apart from it");
}

// The leading (row) dims shared by several tensors, each with its own strides: size-1 dims dropped
// and neighbours merged where every tensor allows it, so contiguous tensors come out 1-D.
struct RowLayout {
  int rank = 0;
  int64_t size[kMaxRowDims] = {};
  std::vector<RowStrides> strides;
};

RowLayout row_layout(IntArrayRef lead, const std::vector<IntArrayRef>& strides) {
  std::vector<int64_t> size;
  std::vector<std::vector<int64_t>> st(strides.size());
  for (size_t i = 0; i < lead.size(); ++i) {
    if (lead[i] == 1) continue;
    bool merge = !size.empty();
    for (size_t k = 0; merge && k < st.size(); ++k) merge = st[k].back() == strides[k][i] * lead[i];
    if (merge) size.back() *= lead[i];
    else size.push_back(lead[i]);
    for (size_t k = 0; k < st.size(); ++k) {
      if (merge) st[k].back() = strides[k][i];
      else st[k].push_back(strides[k][i]);
    }
  }
  TORCH_CHECK_VALUE(size.size() <= size_t(kMaxRowDims), "mla_attn: merge supports at most ", kMaxRowDims,
                    " leading dims after merging the contiguous ones; make the inputs contiguous");
  RowLayout r;
  r.rank = int(size.size());
  for (int i = 0; i < r.rank; ++i) r.size[i] = size[i];
  for (const auto& s : st) {
    RowStrides rs = {};
    for (int i = 0; i < r.rank; ++i) rs.s[i] = s[i];
    r.strides.push_back(rs);
  }
  return r;
}

IntArrayRef lead_of(const Tensor& t, int64_t skip = 0) { return t.strides().slice(skip, t.dim() - 1 - skip); }

// Fills the shared part of the params (rows, d, outputs) and launches; the caller set the inputs.
// rows.strides ends with out's and lse's.
void launch(MergeParams& p, const RowLayout& rows, const Tensor& like, Tensor& out, Tensor& lse) {
  p.rank = rows.rank;
  p.num_rows = 1;
  for (int i = 0; i < rows.rank; ++i) {
    p.row_size[i] = rows.size[i];
    p.num_rows *= rows.size[i];
  }
  p.d = int(like.size(-1));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.out_stride = rows.strides[rows.strides.size() - 2];
  p.lse_stride = rows.strides.back();
  if (p.num_rows == 0) return;
  mla_bindings::check_sm90(like, "merge");
  const c10::cuda::CUDAGuard guard(like.device());
  C10_CUDA_CHECK(mla_merge::run_merge(p, mla_bindings::kernel_dtype(like.scalar_type(), "merge"),
                                      at::cuda::getCurrentCUDAStream()));
}

void merge_pair(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b, const Tensor& lse_b, Tensor& out,
                Tensor& lse) {
  check_outs(out_a, "out_a", out_a);
  for (const auto& [t, name] : {std::pair{out_b, "out_b"}, std::pair{out, "out"}}) {
    check_outs(t, name, out_a);
    TORCH_CHECK(t.sizes() == out_a.sizes(), "mla_attn: ", name, " must have out_a's shape ", out_a.sizes());
  }
  const IntArrayRef lead = out_a.sizes().slice(0, out_a.dim() - 1);
  for (const auto& [t, name] : {std::pair{lse_a, "lse_a"}, std::pair{lse_b, "lse_b"}, std::pair{lse, "lse"}}) {
    check_lse(t, name, lead);
  }
  mla_bindings::check_same_device({lse_a, out_b, lse_b, out, lse}, out_a);
  mla_bindings::check_no_internal_overlap(out, "out");
  mla_bindings::check_no_internal_overlap(lse, "lse");
  for (const auto& [o, o_name] : {std::pair{out, "out"}, std::pair{lse, "lse"}}) {
    for (const auto& [i, i_name] :
         {std::pair{out_a, "out_a"}, std::pair{lse_a, "lse_a"}, std::pair{out_b, "out_b"}, std::pair{lse_b, "lse_b"}}) {
      check_output_overlap(o, o_name, i, i_name);
    }
  }
  TORCH_CHECK_VALUE(!mla_bindings::share_an_address(out, lse), "mla_attn: out and lse share memory");
  const RowLayout rows = row_layout(
      lead, {lead_of(out_a), lead_of(out_b), lse_a.strides(), lse_b.strides(), lead_of(out), lse.strides()});
  MergeParams p = {};
  p.pair = true;
  p.num_inputs = 2;
  p.in_out[0] = out_a.data_ptr();
  p.in_out[1] = out_b.data_ptr();
  p.in_lse[0] = lse_a.data_ptr<float>();
  p.in_lse[1] = lse_b.data_ptr<float>();
  p.in_out_stride[0] = rows.strides[0];
  p.in_out_stride[1] = rows.strides[1];
  p.in_lse_stride[0] = rows.strides[2];
  p.in_lse_stride[1] = rows.strides[3];
  launch(p, rows, out_a, out, lse);
}

std::tuple<Tensor, Tensor> merge_attn_states_cuda(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b,
                                                  const Tensor& lse_b) {
  check_outs(out_a, "out_a", out_a);  // before allocating by its shape: a d past the bound is refused, not allocated
  Tensor out = at::empty_like(out_a, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty(out_a.sizes().slice(0, out_a.dim() - 1), out_a.options().dtype(at::kFloat));
  merge_pair(out_a, lse_a, out_b, lse_b, out, lse);
  return {out, lse};
}

void merge_attn_states_out_cuda(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b, const Tensor& lse_b,
                                Tensor out, Tensor lse) {
  merge_pair(out_a, lse_a, out_b, lse_b, out, lse);
}

std::tuple<Tensor, Tensor> merge_attn_states_n_cuda(const Tensor& outs, const Tensor& lses) {
  check_outs(outs, "outs", outs);
  TORCH_CHECK(outs.dim() >= 2, "mla_attn: outs must be [n, ..., d], got ", outs.sizes());
  // The kernel counts inputs in an int (an expanded outs may claim more).
  TORCH_CHECK(outs.size(0) <= INT32_MAX, "mla_attn: outs must hold at most 2^31 - 1 inputs, got ", outs.size(0));
  check_lse(lses, "lses", outs.sizes().slice(0, outs.dim() - 1));
  mla_bindings::check_same_device({lses}, outs);
  const IntArrayRef lead = outs.sizes().slice(1, outs.dim() - 2);
  Tensor out = at::empty(outs.sizes().slice(1), outs.options());
  Tensor lse = at::empty(lead, outs.options().dtype(at::kFloat));
  const RowLayout rows =
      row_layout(lead, {lead_of(outs, 1), lses.strides().slice(1), lead_of(out), lse.strides()});
  MergeParams p = {};
  p.pair = false;
  p.num_inputs = int(outs.size(0));
  p.in_out[0] = outs.data_ptr();
  p.in_lse[0] = lses.data_ptr<float>();
  p.in_out_stride[0] = rows.strides[0];
  p.in_lse_stride[0] = rows.strides[1];
  p.out_n_stride = outs.stride(0);
  p.lse_n_stride = lses.stride(0);
  launch(p, rows, outs, out, lse);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_attn, CUDA, m) {
  m.impl("merge_attn_states", &merge_attn_states_cuda);
  m.impl("merge_attn_states_out", &merge_attn_states_out_cuda);
  m.impl("merge_attn_states_n", &merge_attn_states_n_cuda);
}
