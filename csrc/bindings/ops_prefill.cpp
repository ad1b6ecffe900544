// Op schemas of the prefill family (the library itself is defined in ops.cpp).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(mla_attn, m) {
  // Varlen (un-absorbed) MLA prefill attention.
  //   q [T_q, h_q, 192]; k [T_k, h_k, 192], or k_nope [T_k, h_k, 128] with k_pe [T_k, 1, 64] shared by
  //   all heads; v [T_k, h_k, 128]; h_q % h_k == 0; cu_seqlens_q/k int32 [B + 1].
  //   returns out [T_q, h_q, 128] (q's dtype), lse fp32 [T_q, h_q] (natural log, +inf = no key).
  //   Causal masking is bottom-right aligned per request.
  m.def(
      "mla_prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, bool causal, *, Tensor? k_pe=None) -> (Tensor, Tensor)");
  m.def(
      "mla_prefill_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, Tensor(a!) out, Tensor(b!) lse, *, "
      "Tensor? k_pe=None) -> ()");
}
