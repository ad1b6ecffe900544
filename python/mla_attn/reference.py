"""Pure-PyTorch reference for mla_attn: the single correctness oracle (and the CPU implementation).

Conventions (shared with the CUDA kernels, see the contract):
  * causal masking is bottom-right aligned: query token i of a request with s queries and L keys sees
    keys [0, L - s + i];
  * lse is the natural log of sum_j exp(scale * q.k_j);
  * a row that sees no key has out 0 and lse +inf.
Everything is computed in `dtype` (float32 or float64) and returned in that dtype; callers cast.
Host syncs (.tolist()) are fine here: this is an oracle, not a graph-safe op.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from ._constants import D_V


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """q [s, h, d]; k [L, hk, d]; v [L, hk, dv] with hk in {1, h} -> out [s, h, dv], lse [s, h]."""
    s, h, _ = q.shape
    n_keys = k.shape[0]
    k = k.expand(n_keys, h, k.shape[-1])
    v = v.expand(n_keys, h, v.shape[-1])
    scores = torch.einsum("shd,lhd->hsl", q, k) * scale
    if causal:
        # key j visible to query i iff j <= L - s + i (bottom-right aligned)
        i = torch.arange(s, device=q.device)[:, None]
        j = torch.arange(n_keys, device=q.device)[None, :]
        scores = scores.masked_fill(j > n_keys - s + i, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, s]; -inf for rows with no visible key
    empty = lse == float("-inf")
    # exp(-inf - -inf) is NaN on empty rows: zero them explicitly
    p = torch.exp(scores - lse[..., None]).masked_fill(empty[..., None], 0.0)
    out = torch.einsum("hsl,lhv->shv", p, v)
    lse = lse.masked_fill(empty, float("inf"))
    return out, lse.transpose(0, 1)


def mla_decode_ref(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, *,
                   cu_seqlens_q: Optional[Tensor] = None, q_pe: Optional[Tensor] = None, softmax_scale: float,
                   causal: bool, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode over a paged latent cache.

    q [B, s, h, 576] (or [B, s, h, 512] + q_pe [.., 64]); varlen: q [T, h, 576|512] + cu_seqlens_q [B+1].
    kv_cache [num_pages, page_size, 576] or [num_pages, page_size, 1, 576]; block_table [B, max_pages];
    cache_seqlens [B]. Returns out [.., h, 512], lse [.., h] in `dtype`.
    Only pages < ceil(L/page_size) and slots < L are read, so garbage elsewhere cannot leak.
    """
    if q_pe is not None:
        q = torch.cat([q, q_pe], dim=-1)
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    kv = kv_cache.reshape(num_pages, page_size, kv_cache.shape[-1])
    lens = cache_seqlens.tolist()
    if cu_seqlens_q is None:
        rows = [(b, slice(None)) for b in range(q.shape[0])]
    else:
        cu = cu_seqlens_q.tolist()
        rows = [(slice(cu[b], cu[b + 1]),) for b in range(len(lens))]
    out = torch.zeros(q.shape[:-1] + (D_V,), dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("inf"), dtype=dtype, device=q.device)
    for b, idx in enumerate(rows):
        n_keys = max(lens[b], 0)
        pages = block_table[b, : math.ceil(n_keys / page_size)].long()
        k = kv[pages].reshape(-1, kv.shape[-1])[:n_keys].to(dtype)[:, None, :]  # [L, 1, 576]
        qb = q[idx].to(dtype)  # [s, h, 576]
        o, l = _attend(qb, k, k[..., :D_V], softmax_scale, causal)
        out[idx] = o
        lse[idx] = l
    return out, lse


def mla_prefill_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                    softmax_scale: float, causal: bool, k_pe: Optional[Tensor] = None,
                    dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Varlen MHA-style MLA prefill.

    q [Tq, h, 192]; k [Tk, h, 192] or k [Tk, h, 128] + k_pe [Tk, 1, 64] (shared across heads);
    v [Tk, h, 128]. Returns out [Tq, h, dv], lse [Tq, h] in `dtype`.
    """
    if k_pe is not None:
        k = torch.cat([k, k_pe.expand(k.shape[0], k.shape[1], k_pe.shape[-1])], dim=-1)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("inf"), dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, l = _attend(q[qs].to(dtype), k[ks].to(dtype), v[ks].to(dtype), softmax_scale, causal)
        out[qs] = o
        lse[qs] = l
    return out, lse


def merge_attn_states_ref(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Exact merge of n partial attentions over disjoint key sets.

    outs [n, ..., d], lses [n, ...]. An infinite lse (either sign) marks an empty part; if all parts
    are empty the result is out 0, lse +inf.
    """
    empty = torch.isinf(lses)
    lses = lses.masked_fill(empty, float("-inf"))
    lse = torch.logsumexp(lses, dim=0)
    none = lse == float("-inf")
    w = torch.exp(lses - lse).masked_fill(empty | none, 0.0)
    # empty parts may hold garbage (even NaN) in out: never multiply it in
    out = (w[..., None] * outs.masked_fill(empty[..., None], 0.0)).sum(0)
    return out, lse.masked_fill(none, float("inf"))


def mla_sparse_ref(q: Tensor, kv_cache: Tensor, indices: Tensor, *, softmax_scale: float, q_pe: Optional[Tensor] = None,
                   topk_length: Optional[Tensor] = None, attn_sink: Optional[Tensor] = None,
                   k_scale: Optional[Tensor] = None, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Sparse (top-k) MLA attention, DeepSeek-V3.2: each query token attends to its own list of cache slots.

    q [B, s_q, h, 576] with indices [B, s_q, topk] and topk_length [B] (per request), or token-major
    q [T, h, 576] with indices [T, topk] and topk_length [T]; q may hold 512 dims plus q_pe [.., 64].
    kv_cache [num_pages, page_size(, 1), 576] (float8_e4m3fn: value = stored * k_scale). Index i of a
    row counts iff its position is below the row's topk_length and 0 <= i < num_pages * page_size
    (slot = page * page_size + row in page); repeated indices count once per occurrence.
    attn_sink [h] (optional) scales out by exp(lse) / (exp(lse) + exp(sink)); lse is returned
    without it. A row with no valid index: out 0, lse +inf.
    Returns out [.., h, 512], lse [.., h] in `dtype`. Loops over rows: an oracle, not a fast path.
    """
    if q_pe is not None:
        q = torch.cat([q, q_pe], dim=-1)
    h, d = q.shape[-2], q.shape[-1]
    batched = q.dim() == 4
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    kv = kv_cache.reshape(num_slots, kv_cache.shape[-1]).to(dtype)
    if k_scale is not None:
        kv = kv * float(k_scale)
    q_rows = q.reshape(-1, h, d)
    idx_rows = indices.reshape(-1, indices.shape[-1]).tolist()
    topk = indices.shape[-1]
    if topk_length is None:
        lengths = [topk] * len(idx_rows)
    else:
        per = topk_length.tolist()
        s_q = q.shape[1] if batched else 1  # batched: one length per request, for each of its tokens
        lengths = [per[r // s_q] for r in range(len(idx_rows))]
    sink = None if attn_sink is None else attn_sink.to(device=q.device, dtype=dtype)
    out = torch.zeros(len(idx_rows), h, D_V, dtype=dtype, device=q.device)
    lse = torch.full((len(idx_rows), h), float("inf"), dtype=dtype, device=q.device)
    for r, row in enumerate(idx_rows):
        keys = [i for i in row[:max(lengths[r], 0)] if 0 <= i < num_slots]
        if not keys:
            continue  # no key: out 0, lse +inf (with or without a sink)
        k = kv[torch.tensor(keys, device=kv.device)]  # [n, 576]
        scores = (q_rows[r].to(dtype) @ k.T) * softmax_scale  # [h, n]
        m = scores.max(dim=-1, keepdim=True).values
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True)
        out[r] = (p / denom) @ k[:, :D_V]
        lse[r] = (m + torch.log(denom)).squeeze(-1)
        if sink is not None:
            # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse)): a sink of -inf gives 1,
            # +inf gives 0 (lse is finite here, so sink - lse is never inf - inf)
            out[r] *= (1.0 / (1.0 + torch.exp(sink - lse[r])))[:, None]
    return out.reshape(q.shape[:-1] + (D_V,)), lse.reshape(q.shape[:-1])
