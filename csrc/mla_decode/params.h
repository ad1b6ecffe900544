// The only host/device contract of the decode kernels: a plain struct, element strides in int64.
#pragma once
#include <cuda.h>  // CUtensorMap (type only; the driver entry point is fetched at run time)
#include <cstdint>

#include "mla_decode/schedule_row.h"

namespace mla_decode {

// n / divisor = __umulhi(n, multiplier) >> shift, exact for 0 <= n < 2^31 (divisor >= 2; made by
// make_fast_divisor in tma_maps.cu): a division by a run-time divisor is ~40 instructions otherwise.
struct FastDivisor {
  int divisor;
  uint32_t multiplier, shift;
#ifdef __CUDACC__
  __device__ __forceinline__ int divide(int n) const {
    return divisor == 1 ? n : int(__umulhi(uint32_t(n), multiplier) >> shift);
  }
#endif
};

struct DecodeParams {
  // Queries, split into the latent part and the rope part (views of one tensor or two tensors).
  // Row (request b, token t, head h) of q, out and lse lives at
  //   b * batch_stride + (first_token(b) + t) * token_stride + h * head_stride,
  // first_token(b) = cu_seqlens_q ? cu_seqlens_q[b] : 0 (varlen tensors have batch_stride 0), clamped
  // into q's tokens (shared/query_span.cuh).
  const void* q_nope;  // [.., h_q, 512]
  const void* q_pe;    // [.., h_q, 64]
  int64_t q_nope_batch_stride, q_nope_token_stride, q_nope_head_stride;
  int64_t q_pe_batch_stride, q_pe_token_stride, q_pe_head_stride;

  void* out;   // [.., h_q, 512], q's dtype
  float* lse;  // [.., h_q] fp32, natural log
  int64_t out_batch_stride, out_token_stride, out_head_stride;
  int64_t lse_batch_stride, lse_token_stride, lse_head_stride;

  // [batch, max_pages]: page ids, one per page_size keys; or, with kv_slots, one cache slot
  // (page * page_size + row in page) per key: a sparse key list (mla_sparse_decode) whose first
  // cache_seqlens[b] entries are all in [0, num_pages * page_size).
  const int* block_table;
  int64_t block_table_stride;
  bool kv_slots;
  // With kv_slots (the 64-row kernel's row-staged forms only): entries outside [0, num_pages *
  // page_size) are keys to skip (score -inf, zero row) rather than required valid, so that sparse top-k
  // index rows go to the kernel as they are, without a compaction pass.
  bool skip_invalid_slots;
  const int* cache_seqlens;  // [batch]
  const int* cu_seqlens_q;   // [batch + 1] or nullptr (uniform: every request has max_seqlen_q tokens)

  // Paged cache [num_pages, page_size, 576]: read by TMA (DecodeTma::kv) where the keys come in runs
  // of 16 rows of one page, else gathered row by row (DecodeTma::gather). An fp8 (e4m3) cache holds
  // stored values; the real value is stored * k_scale[0] (k_scale is nullptr for a 16-bit cache).
  // A ds_mla_fp8 cache is uint8 [num_pages, page_size, 656] (strides in bytes), always gathered.
  const void* kv;
  const float* k_scale;
  // fp8mma kernel: Q enters its MMAs as e4m3(q / q_scale[0]) when given (vLLM's FP8 path takes a
  // per-tensor scale so); nullptr: each row times its own power of two (e4m3_row_scale).
  const float* q_scale;
  int64_t kv_page_stride, kv_token_stride;
  int num_pages, page_size, max_pages;
  int max_keys;  // keys a block-table row can hold: max_pages x page_size, or max_pages with kv_slots

  int batch, num_heads_q, max_seqlen_q;
  float scale_log2;  // softmax_scale * log2(e)
  bool causal;
  // num_heads_q's FastDivisor (a request's query row -> token, head: shared/query_span.cuh), in the
  // padding after `causal`: beside num_heads_q in the parameter bank, and no member after them moves.
  // At the struct's end (a bank line of their own, read as each CTA starts) cold h_q 128 batch-1
  // calls read 0.98x (docs/design-decisions.md).
  uint8_t heads_shift;
  uint32_t heads_multiplier;

  // Split-KV schedule (see python/mla_attn/metadata.py) and the workspace for split partials: rows
  // normalised by their own denominator in q's dtype (as FlashInfer stores them; half the bytes of
  // fp32 to write and to merge), LSE in fp32.
  const ScheduleRow* tile_sched;  // [num_sms]
  const int* req_splits;  // [batch, 2]: num_splits, first workspace slot
  int num_sm_parts, num_q_tiles;
  void* partial_out;   // [slots * num_q_tiles * 64, 512], q's dtype, or fp32 with partials_fp32
  bool partials_fp32;  // dispatch.h: decode_partials_fp32
  float* partial_lse;  // [slots * num_q_tiles * 64]

  // [h_q] fp32 (natural log) or nullptr: final rows of head h are normalised by sum + e^(attn_sink[h] - max)
  // instead of sum, i.e. scaled by e^lse / (e^lse + e^attn_sink[h]); the lse written is unchanged. Late,
  // so that the other members keep their offsets in the kernels' parameter bank.
  const float* attn_sink;
  int num_q_tokens;  // with cu_seqlens_q: q's (and out's, lse's) token count, T; shared/query_span.cuh
};

struct DecodeTma {
  // TMA copies of runs of rows_per_copy rows of one page: page_size a multiple of 16, no kv_slots.
  // Otherwise (gather) the producer warps copy each key row by cp.async into the same swizzled
  // stage layout (shared/kv_producer.cuh).
  bool gather;
  bool row_groups;  // kv is the row-group map (below); the launch checks that the kernel reads that form
  // 3-D (576, page_size, num_pages), box (64, rows_per_copy, 1), 128-byte swizzle (fp8: 64-byte); the narrow
  // kernel's fp8 form: 4-D (64, page_size, 9 slabs, num_pages), box (64, 16, 9, 1), 64-byte swizzle.
  CUtensorMap kv;
  int rows_per_copy_log2;  // rows_per_copy = gcd(page_size, 64): 16, 32 or 64; row groups: 16
  FastDivisor page_size;   // key -> (page index, row in page); a slot -> (page, row) with kv_slots
  // Q tiles by TMA (seesaw kernel, h_q a multiple of 64: a q-tile is 64 heads of one token): 4-D
  // (dims, h_q, tokens, batch) maps of q_nope (512 dims) and q_pe (64), box (64, 64, 1, 1), 128-byte
  // swizzle. q_by_tma is false otherwise (then cp.async); the other kernels load Q by cp.async.
  CUtensorMap q_nope, q_pe;
  bool q_by_tma;
};

}  // namespace mla_decode
