"""Merging partial attentions by their LSE (chunked prefill, context-parallel decode).

A partial attention over a key set is (out [..., d], lse fp32 [...]), lse the natural-log LSE. The
merge over disjoint key sets is exact: lse = log(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) out_k,
in fp32, stored in the inputs' dtype. An lse of +inf (this library) or -inf (vLLM) marks an empty
partial whose out is never read; if every partial is empty the result is out 0, lse +inf.

This module registers the fakes and CPU kernels (the reference) of the ops declared in
csrc/bindings/ops_merge.cpp, and the public wrappers. The wrappers check metadata only (no host sync).
"""
import torch

from . import _C  # noqa: F401  (registers the schemas)
from .decode import _check_layout
from .reference import merge_attn_states_ref

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
D_ALIGN = 8  # d % 8 == 0: whole 16-byte vectors for every dtype


# ---------------------------------------------------------------------------------------------- fakes
@torch.library.register_fake("mla_attn::merge_attn_states")
def _(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


@torch.library.register_fake("mla_attn::merge_attn_states_out")
def _(out_a, lse_a, out_b, lse_b, out, lse):
    return None


@torch.library.register_fake("mla_attn::merge_attn_states_n")
def _(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


# ----------------------------------------------------------------------------------------- CPU kernels
def _merge_cpu(outs, lses, dtype):
    out, lse = merge_attn_states_ref(outs.float(), lses.float())
    return out.to(dtype), lse


@torch.library.register_kernel("mla_attn::merge_attn_states", "cpu")
def _(out_a, lse_a, out_b, lse_b):
    return _merge_cpu(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]), out_a.dtype)


@torch.library.register_kernel("mla_attn::merge_attn_states_out", "cpu")
def _(out_a, lse_a, out_b, lse_b, out, lse):
    o, l = _merge_cpu(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]), out.dtype)
    out.copy_(o)
    lse.copy_(l)


@torch.library.register_kernel("mla_attn::merge_attn_states_n", "cpu")
def _(outs, lses):
    return _merge_cpu(outs, lses, outs.dtype)


# ------------------------------------------------------------------------------------------ validation
def _check_out(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if t.dim() < 1 or t.shape[-1] == 0 or t.shape[-1] % D_ALIGN:
        raise ValueError(f"{name} must be [..., d] with d a positive multiple of {D_ALIGN}, "
                         f"got shape {tuple(t.shape)}")
    _check_layout(name, t)


def _check_lse(name, t, shape, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (out's shape without d), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the outs are on {device}; all inputs must share a device")


def _check_pair(name, t, like):
    _check_out(name, t)
    if t.dtype != like.dtype:
        raise TypeError(f"{name} dtype {t.dtype} must match out_a dtype {like.dtype}")
    if t.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must match out_a shape {tuple(like.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but out_a is on {like.device}; all inputs must share a device")


# ---------------------------------------------------------------------------------------------- public
def merge_attn_states(out_a, lse_a, out_b, lse_b, *, out=None):
    """Merge two partial attentions over disjoint key sets.

    out_a, out_b [..., d] (bf16/fp16/fp32, same dtype and shape; d % 8 == 0; last dim contiguous,
    other strides free but 16-byte aligned); lse_a, lse_b fp32 [...] (natural log, +-inf = empty).
    Returns (out [..., d] in the inputs' dtype, lse fp32 [...]); with out= the result is written
    there (it must not overlap the inputs) and returned.
    """
    _check_out("out_a", out_a)
    _check_pair("out_b", out_b, out_a)
    _check_lse("lse_a", lse_a, out_a.shape[:-1], out_a.device)
    _check_lse("lse_b", lse_b, out_a.shape[:-1], out_a.device)
    if out is None:
        return torch.ops.mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b)
    _check_pair("out", out, out_a)
    lse = torch.empty(out_a.shape[:-1], dtype=torch.float32, device=out_a.device)
    torch.ops.mla_attn.merge_attn_states_out(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


def merge_attn_states_n(outs, lses):
    """Merge n partial attentions: outs [n, ..., d], lses fp32 [n, ...] -> (out [..., d], lse [...]).

    Same rules as merge_attn_states; n = 0 gives out 0, lse +inf.
    """
    _check_out("outs", outs)
    if outs.dim() < 2:
        raise ValueError(f"outs must be [n, ..., d], got shape {tuple(outs.shape)}")
    _check_lse("lses", lses, outs.shape[:-1], outs.device)
    return torch.ops.mla_attn.merge_attn_states_n(outs, lses)
