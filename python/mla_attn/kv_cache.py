"""Paged latent KV cache: write new tokens (with optional FP8 quantisation) and gather them back.

Cache row = [kv_c (512) | k_pe (64)]; kv_cache [num_pages, page_size, 576] or [num_pages, page_size, 1,
576] in the model dtype, or float8_e4m3fn with a per-tensor scale k_scale (fp32 [1]):
stored = e4m3(clamp(x / k_scale, -448, 448)) rounded to nearest, read back as stored * k_scale.

The public wrappers of the ops declared in csrc/bindings/ops_kv_cache.cpp. Static checks read metadata
only; value checks (slot and page ranges, cu_seqlens) follow mla_decode's policy: always on CPU, on GPU
only with validate=True or MLA_ATTN_VALIDATE=1 (they sync).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _validation as check
from ._constants import FP8, FP8_MAX


def quantize_fp8(x: Tensor, k_scale: Tensor) -> Tensor:
    """The cache's FP8 encoding of x: saturating round-to-nearest e4m3 of x / k_scale (in fp32)."""
    return (x.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv_cache(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, *,
                   k_scale: Optional[Tensor] = None, validate: Optional[bool] = None) -> None:
    """Write T tokens into the paged latent cache, in place: row slot_mapping[t] gets [kv_c[t], k_pe[t]].

    kv_c [T, 512], k_pe [T, 64] or [T, 1, 64] (bf16/fp16); kv_cache [num_pages, page_size(, 1), 576] of
    kv_c's dtype, or float8_e4m3fn with k_scale (fp32 [1]). slot_mapping int64 [T]: slot = page *
    page_size + offset; slot < 0 skips the token. Valid slots must be distinct. Last dims contiguous,
    other strides free (16-byte aligned).
    """
    check.check_write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale)
    if check.want_value_checks(validate, kv_c.device):
        check.check_write_values(kv_cache, slot_mapping)
    torch.ops.mla_attn.write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale=k_scale)


def gather_kv_cache(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, num_tokens: int, *,
                    k_scale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                    validate: Optional[bool] = None) -> Tensor:
    """Gather the cached rows of B requests into a dense [num_tokens, 576] tensor.

    block_table int32 [B, max_pages]; cu_seqlens int32 [B+1]: row cu[b] + i is token i of request b;
    rows >= cu[B] are zero. num_tokens (host int, usually >= cu[B]) fixes the output shape without a
    sync. out_dtype defaults to the cache dtype (bfloat16 for an fp8 cache, dequantised x * k_scale).
    """
    check.check_gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, k_scale, out_dtype)
    if check.want_value_checks(validate, kv_cache.device):
        check.check_gather_values(kv_cache, block_table, cu_seqlens)
    return torch.ops.mla_attn.gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, k_scale=k_scale,
                                              out_dtype=out_dtype)
