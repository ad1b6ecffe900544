"""Paged latent KV cache: write new tokens (with optional FP8 quantisation) and gather them back.

Cache row = [kv_c (512) | k_pe (64)]; kv_cache [num_pages, page_size, 576] or [num_pages, page_size, 1,
576] in the model dtype, or float8_e4m3fn with a per-tensor scale k_scale (fp32 [1]):
stored = e4m3(clamp(x / k_scale, -448, 448)) rounded to nearest, read back as stored * k_scale.

This module registers the fakes and CPU kernels (the reference) of the ops declared in
csrc/bindings/ops_kv_cache.cpp, and the public wrappers. Static checks read metadata only; value checks
(slot and page ranges, cu_seqlens) follow mla_decode's policy: always on CPU, on GPU only with
validate=True or MLA_ATTN_VALIDATE=1 (they sync).
"""
import torch

from . import _C  # noqa: F401  (registers the schemas)
from .decode import D_PE, FP8, _check_int32, _check_layout, _want_value_checks, check_k_scale
from .reference import D_QK, D_V

FP8_MAX = 448.0  # largest finite e4m3 value: quantisation saturates here
_FLOATS = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _rows(kv_cache):
    """[num_pages, page_size, 576] view of either cache layout."""
    return kv_cache if kv_cache.dim() == 3 else kv_cache[:, :, 0]


def _gather_dtype(cache_dtype, out_dtype):
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if cache_dtype == FP8 else cache_dtype


def quantize_fp8(x, k_scale):
    """The cache's FP8 encoding of x: saturating round-to-nearest e4m3 of x / k_scale (in fp32)."""
    return (x.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# ---------------------------------------------------------------------------------------------- fakes
@torch.library.register_fake("mla_attn::write_kv_cache")
def _(kv_c, k_pe, kv_cache, slot_mapping, *, k_scale=None):
    return None


@torch.library.register_fake("mla_attn::gather_kv_cache")
def _(kv_cache, block_table, cu_seqlens, num_tokens, *, k_scale=None, out_dtype=None):
    return kv_cache.new_empty((num_tokens, D_QK), dtype=_gather_dtype(kv_cache.dtype, out_dtype))


# ----------------------------------------------------------------------------------------- CPU kernels
@torch.library.register_kernel("mla_attn::write_kv_cache", "cpu")
def _(kv_c, k_pe, kv_cache, slot_mapping, *, k_scale=None):
    rows = torch.cat([kv_c, k_pe.reshape(kv_c.shape[0], D_PE)], dim=-1)
    if k_scale is not None:
        rows = quantize_fp8(rows, k_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page_size = kv_cache.shape[1]
    _rows(kv_cache)[slots // page_size, slots % page_size] = rows[keep]


@torch.library.register_kernel("mla_attn::gather_kv_cache", "cpu")
def _(kv_cache, block_table, cu_seqlens, num_tokens, *, k_scale=None, out_dtype=None):
    cache = _rows(kv_cache)
    page_size = cache.shape[1]
    cu = cu_seqlens.long()
    rows = torch.arange(num_tokens)
    valid = rows < cu[-1]
    req = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, max(cu.numel() - 2, 0))[valid]
    pos = rows[valid] - cu[req]
    pages = block_table[req, pos // page_size].long()
    vals = cache[pages, pos % page_size].float()
    if k_scale is not None:
        vals = vals * k_scale
    dtype = _gather_dtype(kv_cache.dtype, out_dtype)
    out = torch.zeros(num_tokens, D_QK, dtype=dtype)
    out[valid] = vals.to(dtype)
    return out


# ------------------------------------------------------------------------------------------ validation
def _check_cache(kv_cache, k_scale, device):
    if kv_cache.dtype not in _FLOATS + (FP8,):
        raise TypeError(f"kv_cache must be bfloat16, float16 or float8_e4m3fn, got {kv_cache.dtype}")
    if kv_cache.dim() not in (3, 4) or kv_cache.shape[-1] != D_QK or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"kv_cache must be [num_pages, page_size, {D_QK}] or [num_pages, page_size, 1, {D_QK}], "
                         f"got shape {tuple(kv_cache.shape)}")
    if kv_cache.shape[1] < 1:
        raise ValueError("kv_cache page_size must be >= 1")
    if kv_cache.device != device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but the other inputs are on {device}")
    _check_layout("kv_cache", kv_cache)
    check_k_scale(kv_cache, k_scale)


def _check_write(kv_c, k_pe, kv_cache, slot_mapping, k_scale):
    if kv_c.dtype not in _FLOATS:
        raise TypeError(f"kv_c must be bfloat16 or float16, got {kv_c.dtype}")
    if kv_c.dim() != 2 or kv_c.shape[1] != D_V:
        raise ValueError(f"kv_c must be [T, {D_V}], got shape {tuple(kv_c.shape)}")
    T = kv_c.shape[0]
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe dtype {k_pe.dtype} must match kv_c dtype {kv_c.dtype}")
    if k_pe.shape not in ((T, D_PE), (T, 1, D_PE)):
        raise ValueError(f"k_pe must be [T, {D_PE}] or [T, 1, {D_PE}] with T = {T}, got shape {tuple(k_pe.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping must have shape [T] = [{T}], got {tuple(slot_mapping.shape)}")
    for name, t in (("k_pe", k_pe), ("slot_mapping", slot_mapping)):
        if t.device != kv_c.device:
            raise ValueError(f"{name} is on {t.device} but kv_c is on {kv_c.device}; all inputs must share a device")
    _check_cache(kv_cache, k_scale, kv_c.device)
    if kv_cache.dtype not in (kv_c.dtype, FP8):
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must be kv_c's dtype {kv_c.dtype} or float8_e4m3fn")
    _check_layout("kv_c", kv_c)
    _check_layout("k_pe", k_pe)


def _check_gather(kv_cache, block_table, cu_seqlens, num_tokens, k_scale, out_dtype):
    _check_int32("block_table", block_table, 2)
    _check_int32("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.shape[0] != block_table.shape[0] + 1:
        raise ValueError(f"cu_seqlens must have B + 1 = {block_table.shape[0] + 1} entries (block_table has "
                         f"{block_table.shape[0]} rows), got {cu_seqlens.shape[0]}")
    if cu_seqlens.device != block_table.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but block_table is on {block_table.device}")
    _check_cache(kv_cache, k_scale, block_table.device)
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be None, bfloat16, float16 or float32, got {out_dtype}")


def _check_write_values(kv_cache, slot_mapping):
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    bad = slot_mapping >= num_slots
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise ValueError(f"slot_mapping[{t}] = {int(slot_mapping[t])} is past the cache's num_pages x page_size = "
                         f"{num_slots} slots")


def _check_gather_values(kv_cache, block_table, cu_seqlens):
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu[0]}")
    cap = block_table.shape[1] * page_size
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing (cu_seqlens[{b}:{b + 2}] = {cu[b:b + 2]})")
        if n > cap:
            raise ValueError(f"request {b} has {n} tokens, more than block_table's {block_table.shape[1]} pages "
                             f"x page_size {page_size} = {cap}")
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < lens[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page id in [0, {num_pages})")


# ---------------------------------------------------------------------------------------------- public
def write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, *, k_scale=None, validate=None):
    """Write T tokens into the paged latent cache, in place: row slot_mapping[t] gets [kv_c[t], k_pe[t]].

    kv_c [T, 512], k_pe [T, 64] or [T, 1, 64] (bf16/fp16); kv_cache [num_pages, page_size(, 1), 576] of
    kv_c's dtype, or float8_e4m3fn with k_scale (fp32 [1]). slot_mapping int64 [T]: slot = page *
    page_size + offset; slot < 0 skips the token. Valid slots must be distinct. Last dims contiguous,
    other strides free (16-byte aligned).
    """
    _check_write(kv_c, k_pe, kv_cache, slot_mapping, k_scale)
    if _want_value_checks(validate, kv_c.device):
        _check_write_values(kv_cache, slot_mapping)
    torch.ops.mla_attn.write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale=k_scale)


def gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, *, k_scale=None, out_dtype=None,
                    validate=None):
    """Gather the cached rows of B requests into a dense [num_tokens, 576] tensor.

    block_table int32 [B, max_pages]; cu_seqlens int32 [B+1]: row cu[b] + i is token i of request b;
    rows >= cu[B] are zero. num_tokens (host int, usually >= cu[B]) fixes the output shape without a
    sync. out_dtype defaults to the cache dtype (bfloat16 for an fp8 cache, dequantised x * k_scale).
    """
    _check_gather(kv_cache, block_table, cu_seqlens, num_tokens, k_scale, out_dtype)
    if _want_value_checks(validate, kv_cache.device):
        _check_gather_values(kv_cache, block_table, cu_seqlens)
    return torch.ops.mla_attn.gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, k_scale=k_scale,
                                              out_dtype=out_dtype)
