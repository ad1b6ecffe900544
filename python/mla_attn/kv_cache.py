"""Paged latent KV cache: write new tokens (with optional FP8 quantisation) and gather them back.

Three cache formats (kv_format=; None infers it from the cache's dtype, a mismatch is a ValueError):
  * "model": kv_cache [num_pages, page_size(, 1), 576] in kv_c's dtype, row = [kv_c (512) | k_pe (64)].
  * "fp8": the same shape in float8_e4m3fn with a per-tensor scale k_scale (fp32 [1]):
    stored = e4m3(clamp(x / k_scale, -448, 448)) rounded to nearest, read back as stored * k_scale.
  * "ds_mla_fp8": DeepSeek-V3.2's layout (FlashMLA's FP8 sparse decode reads it): kv_cache uint8
    [num_pages, page_size(, 1), 656], one 656-byte row per token = 512 e4m3 latent values | 4 fp32
    scales, one per 128 latent values | 64 bf16 RoPE values. quantize_ds_mla_fp8 defines the encoding.

The public wrappers of the ops declared in csrc/bindings/ops_kv_cache.cpp. Static checks read metadata
only; value checks (slot and page ranges, cu_seqlens) follow mla_decode's policy: always on CPU, on GPU
only with validate=True or MLA_ATTN_VALIDATE=1 (they sync).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _validation as check
from ._constants import (D_PE, D_QK, D_V, DS_MIN_SCALE_INV, DS_NUM_TILES, DS_ROPE_OFFSET, DS_ROW_BYTES,
                         DS_SCALE_OFFSET, DS_TILE, FP8, FP8_MAX)


def quantize_fp8(x: Tensor, k_scale: Tensor) -> Tensor:
    """The cache's FP8 encoding of x: saturating round-to-nearest e4m3 of x / k_scale (in fp32)."""
    return (x.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _pow2_ceil(y: Tensor) -> Tensor:
    """The smallest power of two >= y (fp32, y normal and > 0); inf and NaN stay. Exact: adding a mantissa
    of all ones carries into the exponent unless the mantissa is already zero (y a power of two). The
    CUDA kernel does the same; a float log2 would need its rounding to be right just above 2^k."""
    bits = y.view(torch.int32)
    up = ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(y.isfinite(), up, y)


def ds_mla_fp8_scales(kv_c: Tensor) -> Tensor:
    """The per-tile scales of quantize_ds_mla_fp8: kv_c [T, 512] -> fp32 [T, 4]. A tile's scale is
    max(amax / 448, 1e-4) rounded up to a power of two (amax of its 128 values, division in fp32), so
    amax / scale <= 448 and the e4m3 conversion never saturates; all-zero tiles get 2^-13. A NaN in a
    tile makes its scale NaN (and an inf, inf): the tile reads back as NaN / 0, never as finite garbage."""
    amax = kv_c.reshape(-1, DS_NUM_TILES, DS_TILE).float().abs().amax(-1)
    return _pow2_ceil((amax / FP8_MAX).clamp_min(DS_MIN_SCALE_INV))


def quantize_ds_mla_fp8(kv_c: Tensor, k_pe: Tensor) -> Tensor:
    """DeepSeek-V3.2's FP8 cache rows: kv_c [T, 512], k_pe [T, 64] or [T, 1, 64] (bf16/fp16) -> uint8
    [T, 656] = [e4m3(kv_c / scale) (512 bytes) | scale per 128 values (4 x fp32) | bf16(k_pe) (128 bytes)].

    The scales are powers of two (ds_mla_fp8_scales), so kv_c / scale is exact and the only rounding is
    e4m3's round-to-nearest-even. k_pe is stored as bf16 whatever the input dtype (fp16 is rounded to
    nearest). Byte order: little-endian, as on the GPU. The CPU and CUDA write ops produce these bytes,
    bit for bit, for finite inputs.
    """
    check.check_new_tokens(kv_c, k_pe)
    T = kv_c.shape[0]
    scale = ds_mla_fp8_scales(kv_c)  # [T, 4]
    x = kv_c.reshape(T, DS_NUM_TILES, DS_TILE).float() / scale[..., None]
    latent = x.clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(T, D_V).view(torch.uint8)
    rope = k_pe.reshape(T, D_PE).to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([latent, scale.contiguous().view(torch.uint8), rope], dim=-1)


def dequantize_ds_mla_fp8(rows: Tensor) -> Tensor:
    """uint8 [..., 656] ds_mla_fp8 rows -> fp32 [..., 576]: [e4m3 latent * its tile's scale | k_pe].
    With power-of-two scales the products are exact (and exact in bf16 too), except that bf16's largest
    values (|x| > 255 * 2^120) come back as inf (their e4m3 256 times the scale 2^120 is 2^128); the rope
    part is the stored bf16 exactly."""
    check.check_ds_mla_fp8_rows(rows)
    lead = rows.shape[:-1]
    if rows.numel() == 0:  # contiguous() keeps an empty view's strides, which the fp32 / bf16 views below refuse
        return rows.new_zeros(*lead, D_QK, dtype=torch.float32)
    latent = rows[..., :D_V].contiguous().view(FP8).float().reshape(*lead, DS_NUM_TILES, DS_TILE)
    scale = rows[..., DS_SCALE_OFFSET:DS_ROPE_OFFSET].contiguous().view(torch.float32)
    rope = rows[..., DS_ROPE_OFFSET:DS_ROW_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat([(latent * scale[..., None]).reshape(*lead, D_V), rope], dim=-1)


def write_kv_cache(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, *,
                   k_scale: Optional[Tensor] = None, kv_format: Optional[str] = None,
                   validate: Optional[bool] = None) -> None:
    """Write T tokens into the paged latent cache, in place: row slot_mapping[t] gets [kv_c[t], k_pe[t]]
    in the cache's format (module docstring).

    kv_c [T, 512], k_pe [T, 64] or [T, 1, 64] (bf16/fp16); kv_cache [num_pages, page_size(, 1), 576] of
    kv_c's dtype ("model"), or float8_e4m3fn with k_scale (fp32 [1], "fp8"), or uint8 [num_pages,
    page_size(, 1), 656] ("ds_mla_fp8": per-128-value power-of-two scales in the rows, no k_scale).
    kv_format None infers the format from the cache; a given one must match it. slot_mapping int64 [T]:
    slot = page * page_size + offset; slot < 0 skips the token. Valid slots must be distinct. Last dims
    contiguous, other strides free (16-byte aligned); page_size 1..256 (what decode takes).
    """
    check.memoized(_write_static_checks, kv_c, k_pe, kv_cache, slot_mapping, k_scale, kv_format, validate)
    if check.want_value_checks(validate, kv_c.device):
        check.check_write_values(kv_cache, slot_mapping, k_scale)
    torch.ops.mla_attn.write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale=k_scale, kv_format=kv_format)


def _write_static_checks(kv_c, k_pe, kv_cache, slot_mapping, k_scale, kv_format, validate) -> None:
    check.check_write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale, kv_format)
    check.check_flags(validate=validate)


def gather_kv_cache(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, num_tokens: int, *,
                    k_scale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                    kv_format: Optional[str] = None, validate: Optional[bool] = None) -> Tensor:
    """Gather the cached rows of B requests into a dense [num_tokens, 576] tensor.

    block_table int32 [B, max_pages]; cu_seqlens int32 [B+1]: row cu[b] + i is token i of request b;
    rows >= cu[B] are zero. num_tokens (host int) fixes the output shape without a sync; below cu[B] the
    result is the first num_tokens rows. out_dtype defaults to the cache dtype, bfloat16 for the FP8
    formats (dequantised: x * k_scale for "fp8", e4m3 * tile scale | the bf16 rope values for
    "ds_mla_fp8"). kv_format as in write_kv_cache.
    """
    check.check_gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, k_scale, out_dtype, kv_format)
    check.check_flags(validate=validate)
    if check.want_value_checks(validate, kv_cache.device):
        check.check_gather_values(kv_cache, block_table, cu_seqlens, k_scale)
    return torch.ops.mla_attn.gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, k_scale=k_scale,
                                              out_dtype=out_dtype, kv_format=kv_format)
