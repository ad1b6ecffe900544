"""Public prefill API (varlen, un-absorbed MLA: q/k head dim 192, v head dim 128).

Arguments are checked by _validation: static checks (shapes, dtypes, devices, strides) read tensor
metadata only; value checks of cu_seqlens (host sync on GPU) run for CPU tensors, and for GPU tensors
with validate=True or MLA_ATTN_VALIDATE=1, as for decode.
"""
from typing import Optional, Union

import torch
from torch import Tensor

from . import _validation as check


def mla_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, *, softmax_scale: Optional[float] = None, causal: bool,
                return_lse: bool = False, out: Optional[Tensor] = None, k_pe: Optional[Tensor] = None,
                validate: Optional[bool] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Varlen MLA prefill attention (FlashAttention-style packed layout).

    q [T_q, h_q, 192]; k [T_k, h_k, 192], or k = k_nope [T_k, h_k, 128] with k_pe [T_k, 1, 64] shared by all
    heads (read in place: the head-broadcast concatenation is never built); v [T_k, h_k, 128]; h_q % h_k == 0.
    cu_seqlens_q/k int32 [B + 1]; max_seqlen_q/k bound the per-request lengths (host ints: no sync).
    Causal masking is bottom-right aligned: query i of a request with L_q queries and L_k keys sees keys
    [0, L_k - L_q + i]. Returns out [T_q, h_q, 128] in q's dtype, plus lse fp32 [T_q, h_q] (natural log,
    +inf for rows that see no key, whose out is 0) if return_lse. Rows past cu_seqlens_q[B] (padding) are
    not written: unspecified in a new out and lse.
    """
    check.memoized(_static_checks, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   causal, return_lse, out, k_pe, validate)
    if check.want_value_checks(validate, q.device):
        check.check_prefill_values(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        check.check_prefill_values(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), bool(causal))
    if out is None:
        out, lse = torch.ops.mla_attn.mla_prefill(*args, k_pe=k_pe)
    else:
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        torch.ops.mla_attn.mla_prefill_out(*args, out, lse, k_pe=k_pe)
    return (out, lse) if return_lse else out


def _static_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, return_lse,
                   out, k_pe, validate) -> None:
    """mla_prefill's static checks (all but out's overlap with the inputs: the op checks it on every call)."""
    check.check_softmax_scale(softmax_scale)
    check.check_flags(causal=causal, return_lse=return_lse, validate=validate)
    check.check_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k_pe, out)
