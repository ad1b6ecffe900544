// The only host/device contract of the prefill kernel: a plain struct, element strides in int64.
#pragma once
#include <cuda.h>  // CUtensorMap (type only)
#include <cstdint>

namespace mla_prefill {

struct PrefillParams {
  // Packed varlen tensors: request b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and k/v rows
  // [cu_seqlens_k[b], cu_seqlens_k[b+1]). q, k, v are read through TMA (PrefillTma) only.
  void* out;   // [T_q, h_q, 128], q's dtype
  float* lse;  // [T_q, h_q] fp32, natural log; +inf for rows that see no key
  int64_t out_token_stride, out_head_stride;
  int64_t lse_token_stride, lse_head_stride;
  const int* cu_seqlens_q;  // [batch + 1]
  const int* cu_seqlens_k;  // [batch + 1]
  int total_q, total_k;                 // T_q, T_k: the packed rows (cu_seqlens are clamped to them)
  int batch, num_heads_q, num_heads_k;  // q head h reads k/v head h / (num_heads_q / num_heads_k)
  int num_m_blocks;                     // ceil(max_seqlen_q / kBlockM)
  float scale_log2;                     // softmax_scale * log2(e)
  bool causal;                          // bottom-right aligned: q row i sees keys <= i + L_k - L_q
};

struct PrefillTma {
  // All 3-D (dim, token, head), box (64, 128, 1), 128-byte swizzle.
  CUtensorMap q;     // (192, T_q, h_q)
  CUtensorMap k;     // (192, T_k, h_k), or k_nope (128, T_k, h_k) when k_pe is separate
  CUtensorMap k_pe;  // (64, T_k, 1) when separate; otherwise a copy of k
  CUtensorMap v;     // (128, T_k, h_k)
  int k_pe_column;   // column of the rope slab in the k_pe map: 128 (same tensor) or 0 (separate)
  bool k_pe_shared;  // separate k_pe: one head for all (coordinate 0)
};

}  // namespace mla_prefill
