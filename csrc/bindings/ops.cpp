// Op schemas of the mla_attn library (decode family). Other families add theirs with
// TORCH_LIBRARY_FRAGMENT in ops_<family>.cpp.
//
// Every op has a functional form returning fresh tensors and an `_out` form that writes into
// caller-provided tensors (mutable args, returns nothing), because custom ops may not return an
// alias of an input. Keyword-only arguments after `*` are where later features (FP8 scale,
// deterministic split policy) are added without breaking callers.
//
// CUDA kernels are registered in decode_api.cpp; CPU implementations (the reference) and the fake
// (meta) kernels are registered from Python in python/mla_attn/_ops.py.
#include <torch/library.h>

TORCH_LIBRARY(mla_attn, m) {
  // Split-KV work partition for mla_decode, computed on the device (no host sync).
  //   cache_seqlens int32 [B]; cu_seqlens_q int32 [B+1] or None (then every request has max_seqlen_q
  //   tokens). Returns tile_sched int32 [num_sms, 8] (rows >= num_sm_parts unused) and
  //   req_splits int32 [B, 2] = (number of splits, first partial-workspace slot).
  //   deterministic: parts end only at request boundaries (no request is split), so a request's
  //   result does not depend on the rest of the batch.
  m.def(
      "get_decode_metadata(Tensor cache_seqlens, Tensor? cu_seqlens_q, int max_seqlen_q, "
      "int num_heads_q, bool causal, int num_sm_parts, int num_sms, *, bool deterministic=False) "
      "-> (Tensor, Tensor)");

  // Absorbed MLA decode over a paged latent cache.
  //   q        [B, s_q, h_q, 576|512] or varlen [T, h_q, 576|512] (with cu_seqlens_q)
  //   q_pe     None, or [.., h_q, 64] when q holds only the 512 latent dims
  //   kv_cache [num_pages, page_size, 576] or [num_pages, page_size, 1, 576], page_size 1..256, in q's
  //            dtype or float8_e4m3fn (with k_scale); or uint8 [num_pages, page_size(, 1), 656], DeepSeek-V3.2's
  //            rows with their own scales (kv_format "ds_mla_fp8"; rows copied one by one, by rows64, narrow16 or narrow32)
  //   returns  out [.., h_q, 512] (q's dtype), lse fp32 [.., h_q] (natural log, +inf = no key)
  //   deterministic: the kernel is chosen by h_q alone (metadata computed with deterministic=True)
  //   fp8_mma: with a float8_e4m3fn cache and > 16 query rows per request (any when deterministic),
  //            the MMAs run in e4m3 (Q and P rounded to e4m3)
  //   split_kernel: private (tests, benchmarks): forces the split kernel by name instead of the
  //            default choice (csrc/mla_decode/dispatch.h); an unknown name, or a kernel that cannot run the
  //            case, raises ValueError
  //   kv_slots: block_table [B, max_keys] lists one cache slot (page * page_size + row in page) per
  //            key instead of one page per page_size keys: the first cache_seqlens[b] entries of
  //            row b are request b's keys, each in [0, num_pages * page_size) (mla_sparse_decode
  //            compacts its top-k indices into this form). The schedule may be made for max_keys keys
  //            per request (shapes only): each request's blocks end at its cache_seqlens[b]
  //   skip_invalid_slots: with kv_slots and a ds_mla_fp8 cache: entries outside [0, num_pages * page_size)
  //            are skipped instead of required valid (mla_sparse_decode passes its top-k rows as they are)
  //   attn_sink: fp32 [h_q] (natural log): out of head h scaled by exp(lse) / (exp(lse) + exp(attn_sink[h]))
  //            (lse itself unchanged; +inf gives 0, -inf no effect), applied where the final rows are
  //            normalised (the split kernels' epilogues, the combine)
  // mla_decode_out writes out and lse in place; lse may be None: the op then allocates the LSE the
  // kernels write in C++ and keeps it (a caller that does not read it makes no tensor for it).
  m.def(
      "mla_decode(Tensor q, Tensor? q_pe, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, "
      "Tensor? cu_seqlens_q, int max_seqlen_q, float softmax_scale, bool causal, "
      "Tensor tile_sched, Tensor req_splits, int num_sm_parts, *, Tensor? k_scale=None, Tensor? q_scale=None, "
      "bool deterministic=False, "
      "bool fp8_mma=False, str? split_kernel=None, bool kv_slots=False, bool skip_invalid_slots=False, "
      "Tensor? attn_sink=None) -> (Tensor, Tensor)");
  m.def(
      "mla_decode_out(Tensor q, Tensor? q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor cache_seqlens, Tensor? cu_seqlens_q, int max_seqlen_q, float softmax_scale, "
      "bool causal, Tensor tile_sched, Tensor req_splits, int num_sm_parts, Tensor(a!) out, "
      "Tensor(b!)? lse, *, Tensor? k_scale=None, Tensor? q_scale=None, bool deterministic=False, bool fp8_mma=False, "
      "str? split_kernel=None, bool kv_slots=False, bool skip_invalid_slots=False, Tensor? attn_sink=None) -> ()");
}
