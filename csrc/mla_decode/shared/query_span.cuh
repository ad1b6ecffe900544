// Where request b's query tokens lie in q, out and lse.
#pragma once
#include "mla_decode/params.h"

namespace mla_decode {

// Tokens [first, first + count) of q's token dimension. cu_seqlens_q is checked on the GPU only under
// validation (its values need a host sync), so the kernels clamp it: offsets into [0, num_q_tokens],
// counts to max_seqlen_q (what the grid and the workspace are sized for). Bad offsets then give wrong
// rows, never an access outside q, out, lse or the partials.
struct QuerySpan {
  int first, count;

  __device__ __forceinline__ static QuerySpan of(const DecodeParams& p, int b) {
    if (!p.cu_seqlens_q) return {0, p.max_seqlen_q};
    const int first = min(max(p.cu_seqlens_q[b], 0), p.num_q_tokens);
    const int end = min(max(p.cu_seqlens_q[b + 1], first), p.num_q_tokens);
    return {first, min(end - first, p.max_seqlen_q)};
  }
};

// Query row `row` of a request, token-major: token row / h_q, head row % h_q, by the host-made divisor
// (an integer division is tens of instructions at each of a kernel's sites, code a cold call fetches).
struct QueryRow {
  int token, head;

  __device__ __forceinline__ static QueryRow of(const DecodeParams& p, int row) {
    const int token = FastDivisor{p.num_heads_q, p.heads_multiplier, p.heads_shift}.divide(row);
    return {token, row - token * p.num_heads_q};
  }
};

}  // namespace mla_decode
