"""Merging partial attentions by their LSE (chunked prefill, context-parallel decode).

A partial attention over a key set is (out [..., d], lse fp32 [...]), lse the natural-log LSE. The
merge over disjoint key sets is exact: lse = log(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) out_k,
in fp32, stored in the inputs' dtype. An lse of +inf (this library) or -inf (vLLM) marks an empty
partial whose out is never read; if every partial is empty the result is out 0, lse +inf.

The public wrappers of the ops declared in csrc/bindings/ops_merge.cpp; they check metadata only (no
host sync).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _validation as check


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                      out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets.

    out_a, out_b [..., d] (bf16/fp16/fp32, same dtype and shape; d % 8 == 0; last dim contiguous,
    other strides free but 16-byte aligned); lse_a, lse_b fp32 [...] (natural log, +-inf = empty).
    Returns (out [..., d] in the inputs' dtype, lse fp32 [...]); with out= the result is written
    there (it must not overlap the inputs) and returned.
    """
    check.memoized(check.check_merge, out_a, lse_a, out_b, lse_b, out)
    if out is None:
        return torch.ops.mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b)
    lse = torch.empty(out_a.shape[:-1], dtype=torch.float32, device=out_a.device)
    torch.ops.mla_attn.merge_attn_states_out(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


def merge_attn_states_n(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge n partial attentions: outs [n, ..., d], lses fp32 [n, ...] -> (out [..., d], lse [...]).

    Same rules as merge_attn_states; n = 0 gives out 0, lse +inf.
    """
    check.memoized(check.check_merge_n, outs, lses)
    return torch.ops.mla_attn.merge_attn_states_n(outs, lses)
