// Op schemas of the sparse attention family (DeepSeek-V3.2 top-k attention; python/mla_attn/sparse.py
// holds the public wrappers, python/mla_attn/_ops.py the fakes and CPU kernels, sparse_api.cpp the
// CUDA kernel). The attention itself runs on mla_decode with kv_slots=True; this family adds the step
// that turns each query token's top-k index list into a kv_slots table row.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(mla_attn, m) {
  //   indices     int32 [R, topk], topk >= 1: cache slots (page * page_size + row in page); any value
  //               is allowed: -1 and slots outside [0, num_slots) are skipped
  //   topk_length None, or int32 [R]: only the first topk_length[r] positions of row r count
  //               (clamped to [0, topk])
  //   returns     slots int32 [R, topk]: row r's valid indices in their order, then -1;
  //               counts int32 [R]: how many of them (a kv_slots block_table / cache_seqlens pair)
  m.def(
      "compact_sparse_indices(Tensor indices, Tensor? topk_length, int num_slots) -> (Tensor, Tensor)");
}
