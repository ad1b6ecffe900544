// Op schemas of the paged latent KV-cache family (python/mla_attn/kv_cache.py holds the fakes, CPU
// kernels and the public wrappers; kv_cache_api.cpp the CUDA kernels).
//
// Cache row = [kv_c (512) | k_pe (64)] = 576 values; kv_cache [num_pages, page_size(, 1), 576] in the
// model dtype ("model"), or float8_e4m3fn with a per-tensor k_scale (fp32 [1]): stored =
// sat_e4m3(x / k_scale) ("fp8"); or uint8 [num_pages, page_size(, 1), 656] ("ds_mla_fp8", DeepSeek-V3.2:
// 512 e4m3 | 4 fp32 power-of-two scales, one per 128 latent values | 64 bf16 rope; no k_scale).
// kv_format=None infers the format from the cache dtype; a given one must match it (ValueError).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(mla_attn, m) {
  //   kv_c [T, 512], k_pe [T, 64] or [T, 1, 64]; slot_mapping int64 [T]: slot = page * page_size +
  //   offset, slot < 0 = skip (padding token).
  m.def(
      "write_kv_cache(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, *, "
      "Tensor? k_scale=None, str? kv_format=None) -> ()");
  //   block_table int32 [B, max_pages], cu_seqlens int32 [B+1]. Row cu[b] + i of the result is
  //   token i of request b; rows >= cu[B] are zero. Returns [num_tokens, 576] of out_dtype (default
  //   the cache dtype; bfloat16 for the FP8 formats, dequantised x * k_scale or e4m3 * tile scale).
  m.def(
      "gather_kv_cache(Tensor kv_cache, Tensor block_table, Tensor cu_seqlens, int num_tokens, *, "
      "Tensor? k_scale=None, ScalarType? out_dtype=None, str? kv_format=None) -> Tensor");
}
