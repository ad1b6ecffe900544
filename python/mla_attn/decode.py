"""Public decode API: scheduler metadata and mla_decode, dispatched to torch.ops.mla_attn.

Arguments are checked by _validation (static checks always, without a host sync; value checks on CPU
tensors, or with validate=True / MLA_ATTN_VALIDATE=1).
"""
from typing import Optional, Union

import torch
from torch import Tensor

from . import _validation as check
from .metadata import DecodeMetadata, device_num_sms, num_sm_parts


def get_decode_metadata(cache_seqlens: Tensor, num_heads_q: int, *, s_q: Optional[int] = None,
                        cu_seqlens_q: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                        causal: bool = True, deterministic: bool = False) -> DecodeMetadata:
    """Split-KV schedule for mla_decode; computed on cache_seqlens' device without a host sync.

    Uniform batches pass s_q (tokens per request); varlen batches pass cu_seqlens_q and max_seqlen_q.
    Reuse the result across layers/steps that share cache_seqlens, heads, query lengths and causal;
    it holds values of cache_seqlens (the first request of each part's length, read at the split
    kernel's start), so recompute it (in the CUDA graph, if captured) whenever they change.
    deterministic=True never splits a request across CTAs, so each row's result is bit-identical
    whatever else is in the batch (batch invariance), at the cost of load balance for long requests.
    """
    check.check_flags(causal=causal, deterministic=deterministic)
    max_seqlen_q = check.check_decode_metadata_args(cache_seqlens, num_heads_q, s_q, cu_seqlens_q, max_seqlen_q)
    num_sms = device_num_sms(cache_seqlens.device)
    parts = num_sm_parts(num_sms, max_seqlen_q, num_heads_q)
    tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(
        cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, causal, parts, num_sms,
        deterministic=deterministic)
    return DecodeMetadata(tile_sched, req_splits, parts, max_seqlen_q, num_heads_q, causal, deterministic)


def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, *,
               cu_seqlens_q: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
               q_pe: Optional[Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = True,
               return_lse: bool = False, metadata: Optional[DecodeMetadata] = None, out: Optional[Tensor] = None,
               validate: Optional[bool] = None, deterministic: bool = False, k_scale: Optional[Tensor] = None,
               fp8_mma: bool = False, q_scale: Optional[Tensor] = None, attn_sink: Optional[Tensor] = None,
               _kernel: Optional[str] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Absorbed MLA decode attention over a paged latent KV cache.

    q [B, s_q, h_q, 576] (or 512 + q_pe [.., 64]), or varlen [T, h_q, 576|512] with cu_seqlens_q [B+1] and
    max_seqlen_q. kv_cache [num_pages, page_size(, 1), 576] in q's dtype, or float8_e4m3fn with k_scale
    (float32 tensor [1]: value = stored * k_scale, as mla_attn.write_kv_cache stores it), or uint8
    [num_pages, page_size(, 1), 656] in DeepSeek-V3.2's ds_mla_fp8 layout (no k_scale; the kernels copy
    its rows one by one and dequantise them to fp16, mla_sparse_decode's path); block_table int32
    [B, max_pages]; cache_seqlens int32 [B]. Causal masking is bottom-right aligned.
    Returns out [.., h_q, 512] in q's dtype, plus lse fp32 [.., h_q] if return_lse.
    deterministic=True: batch-invariant results (see get_decode_metadata); metadata, when given, must
    have been computed with the same flag.
    fp8_mma=True (float8_e4m3fn cache only): with more than 16 query rows per request
    (max_seqlen_q * h_q > 16), or any with deterministic=True, the MMAs run in e4m3: each Q row is
    rounded to e4m3 (times a power of two) and so are the probabilities: faster where the kernel is
    bound by its MMAs (h_q 64-128), at several times the relative error against the reference on the
    dequantized cache (figures: BENCHMARKS.md). 16 rows or fewer stream the cache and keep 16-bit MMAs.
    q_scale (fp8_mma=True only; float32 tensor [1], read on the device): where the MMAs run in e4m3, Q
    enters them as e4m3(q / q_scale) (saturated at +-448) for every row, and the scores are rescaled by
    q_scale * k_scale, as vLLM's FP8 decode path takes a per-tensor Q scale; without it each row gets its
    own power-of-two scale (more precise).
    attn_sink (float32 [h_q], optional): a sink logit per head, as mla_sparse_decode's: out is scaled by
    exp(lse) / (exp(lse) + exp(sink)) (+inf: out 0, -inf: no effect); lse is the attention's own.
    _kernel (private, for tests and benchmarks): run this split kernel (metadata.DECODE_KERNELS)
    instead of the one the dispatch chooses; ValueError if it cannot run the call. rows64_seesaw
    reads TMA boxes only and runs its 64-row half alone (rows64) where rows are gathered (page sizes
    not a multiple of 16) or with deterministic=True.
    """
    max_seqlen_q = check.memoized(
        _static_checks, q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale,
        causal, return_lse, metadata, out, validate, deterministic, k_scale, fp8_mma, q_scale, attn_sink, _kernel)
    if metadata is None:
        metadata = get_decode_metadata(cache_seqlens, q.shape[-2], cu_seqlens_q=cu_seqlens_q,
                                       max_seqlen_q=max_seqlen_q, causal=causal, deterministic=deterministic)
    if check.want_value_checks(validate, q.device):
        check.check_decode_values(kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, q.shape[0],
                                  k_scale, q_scale)

    args = (q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, float(softmax_scale),
            causal, metadata.tile_sched, metadata.req_splits, metadata.num_sm_parts)
    kw = dict(k_scale=k_scale, q_scale=q_scale, deterministic=deterministic, fp8_mma=fp8_mma, split_kernel=_kernel,
              attn_sink=None if attn_sink is None else attn_sink.contiguous())
    if out is None:
        out, lse = torch.ops.mla_attn.mla_decode(*args, **kw)
    else:  # no lse from Python where the caller does not want it back: the op makes its own
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if return_lse else None
        torch.ops.mla_attn.mla_decode_out(*args, out, lse, **kw)
    return (out, lse) if return_lse else out


def _static_checks(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                   return_lse, metadata, out, validate, deterministic, k_scale, fp8_mma, q_scale, attn_sink,
                   kernel) -> int:
    """mla_decode's static checks (all but out's overlap with the inputs: the op checks it on every call).
    Returns max_seqlen_q."""
    check.check_softmax_scale(softmax_scale)
    check.check_flags(causal=causal, return_lse=return_lse, validate=validate, deterministic=deterministic,
                      fp8_mma=fp8_mma)
    batch, max_seqlen_q = check.check_decode(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q,
                                             max_seqlen_q, out)
    check.check_decode_options(q, kv_cache, k_scale, fp8_mma, kernel, max_seqlen_q, q_scale)
    check.check_attn_sink(attn_sink, q.shape[-2], q)
    if metadata is not None:
        check.check_metadata(metadata, batch, max_seqlen_q, causal, deterministic, q)
    return max_seqlen_q
