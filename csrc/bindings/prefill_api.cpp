// CUDA implementations of the prefill ops: input checks, TMA descriptors, launch. No host syncs:
// the grid is sized from max_seqlen_q, and per-request lengths are read by the kernel.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "bindings/checks.h"
#include "common/tma_desc.h"
#include "mla_prefill/config.h"
#include "mla_prefill/prefill.h"

namespace {
using at::Tensor;
using namespace mla_bindings;
using namespace mla_prefill;

// 3-D map (dim, token, head) of a [T, h, d] tensor whose last dim is contiguous, box (64, 128, 1).
void encode_3d(CUtensorMap* map, const Tensor& t, int64_t dim, bool bf16, const char* name) {
  const uint64_t dims[3] = {uint64_t(dim), uint64_t(t.size(0)), uint64_t(t.size(1))};
  // A token or head dim of extent 1 may carry any stride: encode_tma packs it.
  const uint64_t strides[2] = {uint64_t(t.stride(0) * t.element_size()), uint64_t(t.stride(1) * t.element_size())};
  const uint32_t box[3] = {uint32_t(kTmaColumns), uint32_t(kBlockM), 1};
  static_assert(kBlockM == kBlockN, "one box shape serves Q, K and V");
  const char* err = mla_common::encode_tma(map, bf16 ? mla_common::TmaElement::kBf16 : mla_common::TmaElement::kFp16, 3,
                                           t.data_ptr(), dims, strides, box);
  TORCH_CHECK(err == nullptr, "mla_attn: ", name, ": ", err ? err : "");
}

void check_packed(const Tensor& t, const char* name, int64_t dim, const Tensor& q) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == dim, "mla_attn: ", name, " must be [T, h, ", dim, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "mla_attn: ", name, " dtype must equal q's (", q.scalar_type(), ")");
  TORCH_CHECK(t.stride(2) == 1, "mla_attn: ", name, " must be contiguous in its last dim");
  TORCH_CHECK(t.device() == q.device(), "mla_attn: ", name, " must be on ", q.device());
  check_aligned(t, name, 16);
}

void mla_prefill_cuda_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_k, int64_t max_seqlen_q, double softmax_scale, bool causal,
                           Tensor& out, Tensor& lse, const std::optional<Tensor>& k_pe) {
  check_sm90(q, "prefill");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "mla_attn: q must be bf16 or fp16");
  check_packed(q, "q", kHeadDimQK, q);
  check_packed(k, k_pe.has_value() ? "k (k_nope with k_pe)" : "k", k_pe.has_value() ? kHeadDimNope : kHeadDimQK, q);
  check_packed(v, "v", kHeadDimV, q);
  check_packed(out, "out", kHeadDimV, q);
  const int64_t heads_q = q.size(1), heads_k = k.size(1), tokens_k = k.size(0);
  TORCH_CHECK(heads_q >= 1 && heads_k >= 1 && heads_q % heads_k == 0, "mla_attn: h_q (", heads_q,
              ") must be a multiple of h_k (", heads_k, ")");
  TORCH_CHECK(v.size(0) == tokens_k && v.size(1) == heads_k, "mla_attn: v must be [T_k, h_k, 128] like k");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == heads_q, "mla_attn: out must be [T_q, h_q, 128]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == heads_q,
              "mla_attn: lse must be float32 [T_q, h_q]");
  TORCH_CHECK(lse.device() == q.device(), "mla_attn: lse must be on ", q.device());
  check_no_internal_overlap(out, "out");
  check_no_internal_overlap(lse, "lse");
  for (const auto& [t, name] : {std::pair{&out, "out"}, std::pair{&lse, "lse"}}) {
    check_apart(*t, name, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {maybe(k_pe), "k_pe"}, {&cu_seqlens_q, "cu_seqlens_q"},
                           {&cu_seqlens_k, "cu_seqlens_k"}});
  }
  check_apart(lse, "lse", {{&out, "out"}});
  if (k_pe.has_value()) {
    check_packed(*k_pe, "k_pe", kHeadDimQK - kHeadDimNope, q);
    TORCH_CHECK(k_pe->size(0) == tokens_k && k_pe->size(1) == 1, "mla_attn: k_pe must be [T_k, 1, 64]");
  }
  check_i32(cu_seqlens_q, "cu_seqlens_q", q);
  check_i32(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 1 && cu_seqlens_k.sizes() == cu_seqlens_q.sizes(),
              "mla_attn: cu_seqlens_q and cu_seqlens_k must both be [B + 1]");
  // The kernel's first query row of a tile, (num_m_blocks - 1) * kBlockM, and its end are ints.
  constexpr int64_t kMaxSeqlenQ = int64_t(INT32_MAX) / kBlockM * kBlockM;
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= kMaxSeqlenQ, "mla_attn: max_seqlen_q must be in [0, ", kMaxSeqlenQ,
              "], got ", max_seqlen_q);
  check_softmax_scale(softmax_scale);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK(batch <= 65535 && heads_q <= 65535, "mla_attn: at most 65535 requests and heads");
  if (batch == 0 || max_seqlen_q == 0 || q.size(0) == 0) return;
  if (tokens_k == 0) {  // no key anywhere: every row is empty (TMA cannot map an empty tensor)
    out.zero_();
    lse.fill_(INFINITY);
    return;
  }

  const c10::cuda::CUDAGuard guard(q.device());
  PrefillParams p = {};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.lse_token_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  p.total_q = int(std::min<int64_t>(q.size(0), INT32_MAX));
  p.total_k = int(std::min<int64_t>(tokens_k, INT32_MAX));
  p.batch = int(batch);
  p.num_heads_q = int(heads_q);
  p.num_heads_k = int(heads_k);
  p.num_m_blocks = int((max_seqlen_q + kBlockM - 1) / kBlockM);
  p.scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;

  const bool bf16 = q.scalar_type() == at::kBFloat16;
  PrefillTma tma;
  encode_3d(&tma.q, q, kHeadDimQK, bf16, "q");
  encode_3d(&tma.k, k, k.size(2), bf16, "k");
  encode_3d(&tma.v, v, kHeadDimV, bf16, "v");
  if (k_pe.has_value()) {
    encode_3d(&tma.k_pe, *k_pe, kHeadDimQK - kHeadDimNope, bf16, "k_pe");
    tma.k_pe_column = 0;
    tma.k_pe_shared = true;
  } else {
    tma.k_pe = tma.k;
    tma.k_pe_column = kHeadDimNope;
    tma.k_pe_shared = false;
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK((dispatch_half_type<cutlass::bfloat16_t, cutlass::half_t>(
      q.scalar_type(), "prefill", [&]<typename Element>() { return run_mla_prefill<Element>(p, tma, stream); })));
}

std::tuple<Tensor, Tensor> mla_prefill_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                            int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                            bool causal, const std::optional<Tensor>& k_pe) {
  (void)max_seqlen_k;  // kept for API symmetry with FA-style varlen calls; the kernel reads cu_seqlens_k
  TORCH_CHECK(q.dim() == 3, "mla_attn: q must be [T_q, h_q, 192]");
  Tensor out = at::empty({q.size(0), q.size(1), kHeadDimV}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  mla_prefill_cuda_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, out, lse, k_pe);
  return {out, lse};
}

void mla_prefill_out_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                          const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                          double softmax_scale, bool causal, Tensor out, Tensor lse,
                          const std::optional<Tensor>& k_pe) {
  (void)max_seqlen_k;
  mla_prefill_cuda_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, out, lse, k_pe);
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_attn, CUDA, m) {
  m.impl("mla_prefill", &mla_prefill_cuda);
  m.impl("mla_prefill_out", &mla_prefill_out_cuda);
}
