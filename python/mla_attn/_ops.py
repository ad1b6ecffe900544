"""Fake (shape-only) kernels and CPU kernels of every op of the mla_attn library, all registered here.
The schemas are in csrc/bindings/ops*.cpp, the CUDA kernels in csrc/bindings/*_api.cpp.

Fakes let torch.compile / export trace the ops without running them; output shapes depend on input
shapes only. The CPU kernels run the pure-PyTorch reference (reference.py), so the ops work (slowly)
without a GPU; they run the same static checks (_validation.py) as the public wrappers, so a direct
torch.ops.mla_attn.* call on CPU tensors fails with the wrappers' exceptions and messages. Values that
only validation checks (lengths, page ids, slots) are read as the CUDA kernels read them: clamped.
"""
import functools
import inspect
import math
from typing import Optional

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the mla_attn schemas)
from . import _validation as check
from ._constants import D_PE, D_QK, D_V, FP8, PREFILL_D_PE, PREFILL_D_V
from .kv_cache import dequantize_ds_mla_fp8, quantize_ds_mla_fp8, quantize_fp8
from .metadata import metadata_shapes, schedule_cpu
from .reference import merge_attn_states_ref, mla_decode_ref, mla_prefill_ref


def _register(op: str, *, fake, cpu) -> None:
    torch.library.register_fake(f"mla_attn::{op}")(_on_one_device(fake))
    torch.library.register_kernel(f"mla_attn::{op}", "cpu")(cpu)


def _on_one_device(fake):
    """A fake kernel also runs for a real call with one of its tensors on the meta device (the others
    on the CPU): that call must fail as with two real devices, not return outputs never computed or
    leave out= and the cache unwritten."""
    signature = inspect.signature(fake)

    @functools.wraps(fake)
    def checked(*args, **kwargs):
        tensors = [(name, value) for name, value in signature.bind(*args, **kwargs).arguments.items()
                   if isinstance(value, Tensor)]
        for name, t in tensors[1:]:
            check.check_device(name, t, *tensors[0])
        return fake(*args, **kwargs)
    return checked


# -------------------------------------------------------------------------------------------- decode
def _metadata_fake(cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, causal, num_sm_parts, num_sms, *,
                   deterministic=False):
    sched_shape, splits_shape = metadata_shapes(cache_seqlens.shape[0], num_sms)
    return (cache_seqlens.new_empty(sched_shape, dtype=torch.int32),
            cache_seqlens.new_empty(splits_shape, dtype=torch.int32))


def _metadata_cpu(cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, causal, num_sm_parts, num_sms, *,
                  deterministic=False):
    check.check_decode_metadata_args(cache_seqlens, num_heads_q, None, cu_seqlens_q, max_seqlen_q)
    check.check_num_sm_parts(num_sm_parts, num_sms)
    return schedule_cpu(cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, num_sm_parts, num_sms,
                        deterministic)


def _decode_fake(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                 tile_sched, req_splits, num_sm_parts, *, k_scale=None, q_scale=None, deterministic=False,
                 fp8_mma=False, split_kernel=None, kv_slots=False, skip_invalid_slots=False, attn_sink=None):
    return q.new_empty(q.shape[:-1] + (D_V,)), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _decode_out_fake(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale,
                     causal, tile_sched, req_splits, num_sm_parts, out, lse, *, k_scale=None, q_scale=None,
                     deterministic=False, fp8_mma=False, split_kernel=None, kv_slots=False,
                     skip_invalid_slots=False, attn_sink=None):
    return None


def _decode(q: Tensor, q_pe: Optional[Tensor], kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
           cu_seqlens_q: Optional[Tensor], max_seqlen_q: int, softmax_scale: float, causal: bool,
           tile_sched: Tensor, req_splits: Tensor, num_sm_parts: int, out: Optional[Tensor], lse: Optional[Tensor],
           k_scale: Optional[Tensor], q_scale: Optional[Tensor], fp8_mma: bool, kernel: Optional[str],
           kv_slots: bool, skip_invalid_slots: bool, attn_sink: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The decode op on CPU tensors: checks, then the float32 reference (out, lse). With kv_slots the
    table lists cache slots: the reference reads the cache as pages of one slot (skip_invalid_slots:
    the valid ones of each row's first cache_seqlens, compacted first). attn_sink scales out as the
    CUDA kernels do (ops.cpp)."""
    check.check_softmax_scale(softmax_scale)
    batch, max_seqlen_q = check.check_decode(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q,
                                             max_seqlen_q, out, kv_slots)
    check.check_decode_options(q, kv_cache, k_scale, fp8_mma, kernel, max_seqlen_q, q_scale)
    check.check_schedule(tile_sched, req_splits, num_sm_parts, batch, q)
    check.check_skip_invalid_slots(skip_invalid_slots, kv_slots, kv_cache)
    check.check_attn_sink(attn_sink, q.shape[-2], q)
    if lse is not None:
        check.check_lse_out("lse", lse, q.shape[:-1], "q", q)
    check.check_decode_outputs(out, lse, q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, tile_sched,
                               req_splits, k_scale, q_scale, attn_sink)
    if skip_invalid_slots:
        block_table, cache_seqlens = torch.ops.mla_attn.compact_sparse_indices(
            block_table, cache_seqlens, kv_cache.shape[0] * kv_cache.shape[1])
    if k_scale is not None:  # FP8 cache: the reference runs on the dequantized values
        kv_cache = kv_cache.float() * k_scale.float()
    elif kv_cache.dtype == torch.uint8:  # ds_mla_fp8 rows
        kv_cache = dequantize_ds_mla_fp8(kv_cache)
    if kv_slots:
        kv_cache = _rows(kv_cache).reshape(-1, 1, D_QK)
    # Values only validation checks (validate=False skips it), read as the CUDA kernels read them
    # (shared/schedule.cuh, kv_producer.cuh): lengths clamped to what the block table holds, page ids
    # (slots) into the cache. Bad values give wrong numbers, never an error; valid ones are unchanged.
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    max_keys = min(block_table.shape[1] * page_size, check.INT32_MAX) if num_pages else 0
    cache_seqlens = cache_seqlens.clamp(0, max_keys)
    block_table = block_table.clamp(0, max(num_pages - 1, 0))
    # The reference needs no schedule: the split-KV partition only changes the summation order. It
    # computes in float32 whatever fp8_mma, q_scale and kernel say (they trade the GPU kernels' accuracy for speed).
    out, lse = mla_decode_ref(q, kv_cache, block_table, cache_seqlens, cu_seqlens_q=cu_seqlens_q, q_pe=q_pe,
                              softmax_scale=softmax_scale, causal=causal)
    if attn_sink is not None:
        # out *= exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); a row without keys (lse +inf)
        # keeps out 0 (its factor set to 0 rather than sigmoid(inf - inf) = NaN).
        out = out * torch.sigmoid(lse - attn_sink.float()).masked_fill(lse == math.inf, 0.0).unsqueeze(-1)
    return out, lse


def _decode_cpu(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                tile_sched, req_splits, num_sm_parts, *, k_scale=None, q_scale=None, deterministic=False,
                fp8_mma=False, split_kernel=None, kv_slots=False, skip_invalid_slots=False, attn_sink=None):
    out, lse = _decode(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale,
                       causal, tile_sched, req_splits, num_sm_parts, None, None, k_scale, q_scale, fp8_mma, split_kernel,
                       kv_slots, skip_invalid_slots, attn_sink)
    return out.to(q.dtype), lse


def _decode_out_cpu(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                    tile_sched, req_splits, num_sm_parts, out, lse, *, k_scale=None, q_scale=None,
                    deterministic=False, fp8_mma=False, split_kernel=None, kv_slots=False,
                    skip_invalid_slots=False, attn_sink=None):
    check.check_tensor("out", out)
    if lse is not None:  # None: the op keeps the LSE to itself (ops.cpp)
        check.check_tensor("lse", lse)
    o, l = _decode(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale,
                   causal, tile_sched, req_splits, num_sm_parts, out, lse, k_scale, q_scale, fp8_mma, split_kernel,
                   kv_slots, skip_invalid_slots, attn_sink)
    out.copy_(o)
    if lse is not None:
        lse.copy_(l)


_register("get_decode_metadata", fake=_metadata_fake, cpu=_metadata_cpu)
_register("mla_decode", fake=_decode_fake, cpu=_decode_cpu)
_register("mla_decode_out", fake=_decode_out_fake, cpu=_decode_out_cpu)


# ------------------------------------------------------------------------------------------- prefill
def _prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *,
                  k_pe=None):
    return q.new_empty(q.shape[:-1] + (PREFILL_D_V,)), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _prefill_out_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out,
                      lse, *, k_pe=None):
    return None


def prefill_cpu(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, softmax_scale: float,
                causal: bool, k_pe: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The prefill math of the CPU op (float32 reference; grouped k/v heads expanded), without checks.
    Returns out in q's dtype and lse float32; runs on any device."""
    group = q.shape[1] // k.shape[1]  # q head h reads k/v head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if k_pe is not None:
        k_pe = k_pe.expand(k.shape[0], k.shape[1], PREFILL_D_PE)
    out, lse = mla_prefill_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
                               k_pe=k_pe)
    return out.to(q.dtype), lse.float()


def _prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *,
                 k_pe=None):
    check.check_softmax_scale(softmax_scale)
    check.check_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k_pe, None)
    return prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, k_pe)


def _prefill_out_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out,
                     lse, *, k_pe=None):
    check.check_tensor("out", out)
    check.check_softmax_scale(softmax_scale)
    check.check_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k_pe, out)
    check.check_lse_out("lse", lse, q.shape[:-1], "q", q)
    check.check_prefill_outputs(out, lse, q, k, v, k_pe, cu_seqlens_q, cu_seqlens_k)
    o, l = prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, k_pe)
    out.copy_(o)
    lse.copy_(l)


_register("mla_prefill", fake=_prefill_fake, cpu=_prefill_cpu)
_register("mla_prefill_out", fake=_prefill_out_fake, cpu=_prefill_out_cpu)


# --------------------------------------------------------------------------------------------- merge
def _merge_ref(outs: Tensor, lses: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    out, lse = merge_attn_states_ref(outs.float(), lses.float())
    return out.to(dtype), lse


def _merge_fake(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _merge_out_fake(out_a, lse_a, out_b, lse_b, out, lse):
    return None


def _merge_n_fake(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


def _merge_cpu(out_a, lse_a, out_b, lse_b):
    check.check_merge(out_a, lse_a, out_b, lse_b)
    return _merge_ref(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]), out_a.dtype)


def _merge_out_cpu(out_a, lse_a, out_b, lse_b, out, lse):
    check.check_tensor("out", out)
    check.check_tensor("lse", lse)
    check.check_merge(out_a, lse_a, out_b, lse_b, out, lse)
    check.check_merge_outputs(out_a, lse_a, out_b, lse_b, out, lse)
    o, l = _merge_ref(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]), out.dtype)
    out.copy_(o)
    lse.copy_(l)


def _merge_n_cpu(outs, lses):
    check.check_merge_n(outs, lses)
    return _merge_ref(outs, lses, outs.dtype)


_register("merge_attn_states", fake=_merge_fake, cpu=_merge_cpu)
_register("merge_attn_states_out", fake=_merge_out_fake, cpu=_merge_out_cpu)
_register("merge_attn_states_n", fake=_merge_n_fake, cpu=_merge_n_cpu)


# ------------------------------------------------------------------------------------------ KV cache
def _rows(kv_cache: Tensor) -> Tensor:
    """[num_pages, page_size, row] view of either cache shape (row: 576 values, or 656 ds_mla_fp8 bytes)."""
    return kv_cache if kv_cache.dim() == 3 else kv_cache[:, :, 0]


def _gather_dtype(cache_dtype: torch.dtype, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if cache_dtype in (FP8, torch.uint8) else cache_dtype


def _write_fake(kv_c, k_pe, kv_cache, slot_mapping, *, k_scale=None, kv_format=None):
    return None


def _gather_fake(kv_cache, block_table, cu_seqlens, num_tokens, *, k_scale=None, out_dtype=None, kv_format=None):
    return kv_cache.new_empty((num_tokens, D_QK), dtype=_gather_dtype(kv_cache.dtype, out_dtype))


def _write_cpu(kv_c, k_pe, kv_cache, slot_mapping, *, k_scale=None, kv_format=None):
    fmt = check.check_write_kv_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale, kv_format)
    check.check_apart("kv_cache", kv_cache,
                      {"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slot_mapping, "k_scale": k_scale})
    keep = (slot_mapping >= 0) & (slot_mapping < kv_cache.shape[0] * kv_cache.shape[1])  # as the CUDA kernel
    slots = slot_mapping[keep]
    page_size = kv_cache.shape[1]
    if fmt == "ds_mla_fp8":
        rows = quantize_ds_mla_fp8(kv_c[keep], k_pe[keep])
    else:
        rows = torch.cat([kv_c[keep], k_pe[keep].reshape(-1, D_PE)], dim=-1)
        if k_scale is not None:
            rows = quantize_fp8(rows, k_scale)
    _rows(kv_cache)[slots // page_size, slots % page_size] = rows


def _gather_cpu(kv_cache, block_table, cu_seqlens, num_tokens, *, k_scale=None, out_dtype=None, kv_format=None):
    fmt = check.check_gather_kv_cache(kv_cache, block_table, cu_seqlens, num_tokens, k_scale, out_dtype, kv_format)
    cache = _rows(kv_cache)
    page_size = cache.shape[1]
    cu = cu_seqlens.long()
    rows = torch.arange(num_tokens)
    rows = rows[rows < cu[-1]]
    req = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, max(cu.numel() - 2, 0))
    pos = rows - cu[req]
    # As the CUDA kernel: a row past its table, or naming a page outside the cache, stays zero.
    in_table = pos // page_size < block_table.shape[1]
    rows, req, pos = rows[in_table], req[in_table], pos[in_table]
    pages = block_table[req, pos // page_size].long()
    on_page = (pages >= 0) & (pages < cache.shape[0])
    rows, pages, pos = rows[on_page], pages[on_page], pos[on_page]
    # Indexed as bytes: older torch (2.6) has no CPU index kernel for float8_e4m3fn.
    vals = cache.view(torch.uint8)[pages, pos % page_size].view(cache.dtype) if cache.element_size() == 1 \
        else cache[pages, pos % page_size]
    if fmt == "ds_mla_fp8":
        vals = dequantize_ds_mla_fp8(vals)
    else:
        vals = vals.float()
        if k_scale is not None:
            vals = vals * k_scale
    dtype = _gather_dtype(kv_cache.dtype, out_dtype)
    out = torch.zeros(num_tokens, D_QK, dtype=dtype)
    out[rows] = vals.to(dtype)
    return out


_register("write_kv_cache", fake=_write_fake, cpu=_write_cpu)
_register("gather_kv_cache", fake=_gather_fake, cpu=_gather_cpu)


# -------------------------------------------------------------------------------------------- sparse
def _compact_fake(indices, topk_length, num_slots):
    return indices.new_empty(indices.shape), indices.new_empty(indices.shape[:1])


def _compact_cpu(indices, topk_length, num_slots):
    """The CUDA kernel's rule: position < topk_length (clamped to [0, topk]) and 0 <= index < num_slots;
    the valid indices keep their order (a stable sort of the invalid ones to the back), -1 fills the rest."""
    check.check_compact_sparse_indices(indices, topk_length, num_slots)
    rows, topk = indices.shape
    pos = torch.arange(topk)
    length = torch.full((rows,), topk) if topk_length is None else topk_length.long().clamp(0, topk)
    valid = (pos[None, :] < length[:, None]) & (indices >= 0) & (indices < num_slots)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    counts = valid.sum(dim=1, dtype=torch.int32)
    slots = indices.gather(1, order).masked_fill(pos[None, :] >= counts[:, None], -1)
    return slots, counts


_register("compact_sparse_indices", fake=_compact_fake, cpu=_compact_cpu)
