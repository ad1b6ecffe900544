"""Public prefill API (varlen, un-absorbed MLA: q/k head dim 192, v head dim 128), plus the fakes and
CPU implementations of the prefill ops defined in csrc/bindings/ops_prefill.cpp.

Static checks (shapes, dtypes, devices, strides) read tensor metadata only. Value checks of
cu_seqlens (host sync on GPU) run for CPU tensors, and for GPU tensors with validate=True or
MLA_ATTN_VALIDATE=1, as for decode.
"""
import torch

from .decode import _check_layout, _want_value_checks
from .reference import mla_prefill_ref

D_QK, D_V, D_NOPE = 192, 128, 128
D_PE = D_QK - D_NOPE
_FLOATS = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------- fakes
@torch.library.register_fake("mla_attn::mla_prefill")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *, k_pe=None):
    return q.new_empty(q.shape[:-1] + (D_V,)), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("mla_attn::mla_prefill_out")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out, lse, *,
      k_pe=None):
    return None


# ----------------------------------------------------------------------------------------- CPU kernels
def _prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, k_pe):
    group = q.shape[1] // k.shape[1]  # q head h reads k/v head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if k_pe is not None:
        k_pe = k_pe.expand(k.shape[0], k.shape[1], D_PE)
    out, lse = mla_prefill_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
                               k_pe=k_pe)
    return out.to(q.dtype), lse.float()


@torch.library.register_kernel("mla_attn::mla_prefill", "cpu")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *, k_pe=None):
    return _prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, k_pe)


@torch.library.register_kernel("mla_attn::mla_prefill_out", "cpu")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out, lse, *,
      k_pe=None):
    o, l = _prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, k_pe)
    out.copy_(o)
    lse.copy_(l)


# ------------------------------------------------------------------------------------------ validation
def _check_static(q, k, v, cu_seqlens_q, cu_seqlens_k, k_pe, out):
    if q.dtype not in _FLOATS:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    want_k = D_NOPE if k_pe is not None else D_QK
    for name, t, dim in (("q", q, D_QK), ("k", k, want_k), ("v", v, D_V), ("k_pe", k_pe, D_PE), ("out", out, D_V)):
        if t is None:
            continue
        if t.dim() != 3 or t.shape[-1] != dim:
            extra = " (k_nope, since k_pe is given)" if name == "k" and k_pe is not None else ""
            raise ValueError(f"{name}{extra} must be [T, h, {dim}], got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        _check_layout(name, t)
    h_q, (t_k, h_k) = q.shape[1], k.shape[:2]
    if h_q % h_k:
        raise ValueError(f"h_q = {h_q} must be a multiple of h_k = {h_k}")
    if tuple(v.shape[:2]) != (t_k, h_k):
        raise ValueError(f"v must be [{t_k}, {h_k}, {D_V}] like k, got {tuple(v.shape)}")
    if k_pe is not None and tuple(k_pe.shape[:2]) != (t_k, 1):
        raise ValueError(f"k_pe must be [{t_k}, 1, {D_PE}] (shared by all heads), got {tuple(k_pe.shape)}")
    if out is not None and tuple(out.shape) != (q.shape[0], h_q, D_V):
        raise ValueError(f"out must be [{q.shape[0]}, {h_q}, {D_V}], got {tuple(out.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be int32 [B + 1], got {cu.dtype} {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must both be [B + 1]")


def _check_values(cu, total, max_len, name):
    c = cu.tolist()
    if c[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {c[0]}")
    lens = [b - a for a, b in zip(c, c[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing, got {c}")
    if c[-1] > total:
        raise ValueError(f"{name}[-1] = {c[-1]} exceeds the {total} rows of the packed tensor")
    if lens and max(lens) > max_len:
        raise ValueError(f"a request has {max(lens)} rows > max_seqlen ({max_len}) given for {name}")


def mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                causal, return_lse=False, out=None, k_pe=None, validate=None):
    """Varlen MLA prefill attention (FlashAttention-style packed layout).

    q [T_q, h_q, 192]; k [T_k, h_k, 192], or k = k_nope [T_k, h_k, 128] with k_pe [T_k, 1, 64] shared by all
    heads (read in place: the head-broadcast concatenation is never built); v [T_k, h_k, 128]; h_q % h_k == 0.
    cu_seqlens_q/k int32 [B + 1]; max_seqlen_q/k bound the per-request lengths (host ints: no sync).
    Causal masking is bottom-right aligned: query i of a request with L_q queries and L_k keys sees keys
    [0, L_k - L_q + i]. Returns out [T_q, h_q, 128] in q's dtype, plus lse fp32 [T_q, h_q] (natural log,
    +inf for rows that see no key, whose out is 0) if return_lse.
    """
    if softmax_scale is None:
        raise ValueError("softmax_scale is required (DeepSeek: (qk_nope + qk_rope)^-0.5 * mscale^2)")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    _check_static(q, k, v, cu_seqlens_q, cu_seqlens_k, k_pe, out)
    if _want_value_checks(validate, q.device):
        _check_values(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        _check_values(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale),
            bool(causal))
    if out is None:
        out, lse = torch.ops.mla_attn.mla_prefill(*args, k_pe=k_pe)
    else:
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        torch.ops.mla_attn.mla_prefill_out(*args, out, lse, k_pe=k_pe)
    return (out, lse) if return_lse else out
