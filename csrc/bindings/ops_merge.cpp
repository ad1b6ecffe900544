// Op schemas of the LSE merge family (python/mla_attn/merge.py holds the fakes, CPU kernels and the
// public wrappers; merge_api.cpp the CUDA kernels).
//
// A partial attention is (out [..., d], lse fp32 [...]) over a set of keys; merging partials over
// disjoint key sets gives the attention over their union. lse is the natural-log LSE; an lse of +inf
// or -inf marks an empty partial (its out is never read); all empty -> out 0, lse +inf.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(mla_attn, m) {
  //   out_a, out_b [..., d] (bf16/fp16/fp32, same dtype; d % 8 == 0; last dim contiguous)
  //   lse_a, lse_b fp32 [...]; returns out [..., d] (inputs' dtype), lse fp32 [...]
  m.def("merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.def(
      "merge_attn_states_out(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, Tensor(a!) out, "
      "Tensor(b!) lse) -> ()");
  //   outs [n, ..., d], lses fp32 [n, ...] -> out [..., d], lse [...]
  m.def("merge_attn_states_n(Tensor outs, Tensor lses) -> (Tensor, Tensor)");
}
