"""Public decode API: input validation, scheduler metadata, dispatch to torch.ops.mla_attn.

Validation is split in two:
  * static checks (ranks, shapes, dtypes, devices, strides) read only tensor metadata, so they never
    sync with the device and are safe under CUDA graphs and torch.compile;
  * value checks (lengths, cu_seqlens, page ids) need the data. They always run for CPU tensors, and
    for GPU tensors only with validate=True or MLA_ATTN_VALIDATE=1, because they force a host sync.
    validate=False disables them everywhere. They are skipped while torch.compile traces.
"""
import math
import os

import torch

from .metadata import DecodeMetadata, device_num_sms, num_sm_parts
from .reference import D_QK, D_V

D_PE = D_QK - D_V
MAX_HEADS_Q = 128
MAX_SEQLEN_Q = 512
PAGE_SIZE_MIN, PAGE_SIZE_MAX, PAGE_SIZE_ALIGN = 16, 256, 16
ALIGN_BYTES = 16  # TMA: every non-unit stride must be a multiple of 16 bytes
_FLOATS = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn  # the FP8 cache format (e4m3, per-tensor k_scale)


def _check_layout(name, t):
    """Last dim contiguous; other strides 16-byte aligned (size-1 dims are ignored: never stepped)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride(-1) == 1), got strides {t.stride()}")
    for d in range(t.dim() - 1):
        if t.shape[d] > 1 and (t.stride(d) * t.element_size()) % ALIGN_BYTES:
            raise ValueError(f"{name}: stride({d}) = {t.stride(d)} elements is not a multiple of "
                             f"{ALIGN_BYTES} bytes (strides {t.stride()})")


def _check_int32(name, t, dim):
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous, got strides {t.stride()}")


def check_k_scale(kv_cache, k_scale):
    """k_scale: required with (and only valid with) a float8_e4m3fn cache; float32 [1] on its device."""
    if kv_cache.dtype == FP8:
        if k_scale is None:
            raise ValueError("a float8_e4m3fn kv_cache needs k_scale (float32 tensor of shape [1])")
        if not isinstance(k_scale, torch.Tensor) or k_scale.dtype != torch.float32 or k_scale.shape != (1,):
            got = f"{k_scale.dtype} {tuple(k_scale.shape)}" if isinstance(k_scale, torch.Tensor) else type(k_scale).__name__
            raise ValueError(f"k_scale must be a float32 tensor of shape [1] (a tensor keeps CUDA graphs and "
                             f"torch.compile working), got {got}")
        if k_scale.device != kv_cache.device:
            raise ValueError(f"k_scale is on {k_scale.device} but kv_cache is on {kv_cache.device}")
    elif k_scale is not None:
        raise ValueError(f"k_scale is only valid with a float8_e4m3fn kv_cache, got {kv_cache.dtype}")


def _check_static(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, out):
    """Metadata-only checks. Returns (batch, max_seqlen_q)."""
    if q.dtype not in _FLOATS:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    if kv_cache.dtype not in (q.dtype, FP8):
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype} or be float8_e4m3fn")
    want_q = D_QK if q_pe is None else D_V
    if q.dim() not in (3, 4) or q.shape[-1] != want_q:
        raise ValueError(f"q must be [B, s_q, h_q, {want_q}] or varlen [T, h_q, {want_q}]"
                         f"{'' if q_pe is None else ' (with q_pe)'}, got shape {tuple(q.shape)}")
    if q_pe is not None:
        if q_pe.dtype != q.dtype:
            raise TypeError(f"q_pe dtype {q_pe.dtype} must match q dtype {q.dtype}")
        if q_pe.shape != q.shape[:-1] + (D_PE,):
            raise ValueError(f"q_pe must have shape {tuple(q.shape[:-1]) + (D_PE,)}, got {tuple(q_pe.shape)}")
    if kv_cache.dim() not in (3, 4) or kv_cache.shape[-1] != D_QK or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"kv_cache must be [num_pages, page_size, {D_QK}] or [num_pages, page_size, 1, {D_QK}], "
                         f"got shape {tuple(kv_cache.shape)}")
    page_size = kv_cache.shape[1]
    if not (PAGE_SIZE_MIN <= page_size <= PAGE_SIZE_MAX and page_size % PAGE_SIZE_ALIGN == 0):
        raise ValueError(f"page_size must be a multiple of {PAGE_SIZE_ALIGN} in [{PAGE_SIZE_MIN}, {PAGE_SIZE_MAX}], "
                         f"got {page_size}")
    _check_int32("block_table", block_table, 2)
    _check_int32("cache_seqlens", cache_seqlens, 1)
    batch = cache_seqlens.shape[0]
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but cache_seqlens has {batch} requests")

    if q.dim() == 3:
        if cu_seqlens_q is None:
            raise ValueError("3-D (varlen) q needs cu_seqlens_q and max_seqlen_q")
        _check_int32("cu_seqlens_q", cu_seqlens_q, 1)
        if cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
        if max_seqlen_q is None:
            raise ValueError("cu_seqlens_q given without max_seqlen_q (needed to size the grid without a sync)")
    else:
        if cu_seqlens_q is not None:
            raise ValueError("cu_seqlens_q is only valid with 3-D (varlen) q; 4-D q has s_q tokens per request")
        if q.shape[0] != batch:
            raise ValueError(f"q has batch {q.shape[0]} but cache_seqlens has {batch} requests")
        if max_seqlen_q is not None and max_seqlen_q != q.shape[1]:
            raise ValueError(f"max_seqlen_q={max_seqlen_q} does not match q.shape[1]={q.shape[1]}")
        max_seqlen_q = q.shape[1]
    h_q = q.shape[-2]
    if not 1 <= h_q <= MAX_HEADS_Q:
        raise ValueError(f"num_heads_q must be in [1, {MAX_HEADS_Q}], got {h_q}")
    if not 1 <= max_seqlen_q <= MAX_SEQLEN_Q:
        raise ValueError(f"max_seqlen_q (tokens per request) must be in [1, {MAX_SEQLEN_Q}], got {max_seqlen_q}")

    tensors = {"q": q, "q_pe": q_pe, "kv_cache": kv_cache, "block_table": block_table,
               "cache_seqlens": cache_seqlens, "cu_seqlens_q": cu_seqlens_q, "out": out}
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
    for name in ("q", "q_pe", "kv_cache"):
        if tensors[name] is not None:
            _check_layout(name, tensors[name])
    if out is not None:
        if out.dtype != q.dtype:
            raise TypeError(f"out dtype {out.dtype} must match q dtype {q.dtype}")
        if out.shape != q.shape[:-1] + (D_V,):
            raise ValueError(f"out must have shape {tuple(q.shape[:-1]) + (D_V,)}, got {tuple(out.shape)}")
        _check_layout("out", out)
    return batch, max_seqlen_q


def _check_metadata(md, batch, max_seqlen_q, h_q, causal, deterministic, device):
    if not isinstance(md, DecodeMetadata):
        raise TypeError(f"metadata must be a DecodeMetadata from get_decode_metadata, got {type(md).__name__}")
    for field, want in (("num_heads_q", h_q), ("max_seqlen_q", max_seqlen_q), ("causal", causal),
                        ("deterministic", deterministic)):
        if getattr(md, field) != want:
            raise ValueError(f"metadata was computed for {field}={getattr(md, field)} but this call has {want}")
    if md.req_splits.shape[0] != batch:
        raise ValueError(f"metadata was computed for batch {md.req_splits.shape[0]} but this call has {batch}")
    if md.tile_sched.device != device or md.req_splits.device != device:
        raise ValueError(f"metadata is on {md.tile_sched.device} but q is on {device}")
    for name, t, cols in (("tile_sched", md.tile_sched, 8), ("req_splits", md.req_splits, 2)):
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != cols or not t.is_contiguous():
            raise ValueError(f"metadata.{name} must be a contiguous int32 [N, {cols}] tensor, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _want_value_checks(validate, device):
    if validate is not None:
        return validate
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or os.environ.get("MLA_ATTN_VALIDATE", "0") == "1"


def _check_values(kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, num_tokens, k_scale=None):
    """Data-dependent checks (host sync on GPU)."""
    if k_scale is not None:
        ks = float(k_scale)
        if not (math.isfinite(ks) and ks > 0):  # the kernels fold it into the score scale, which must be > 0
            raise ValueError(f"k_scale must be finite and > 0, got {ks}")
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    lens = cache_seqlens.tolist()
    cap = block_table.shape[1] * page_size
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} is negative")
        if n > cap:
            raise ValueError(f"cache_seqlens[{b}] = {n} exceeds block_table capacity {block_table.shape[1]} pages "
                             f"x page_size {page_size} = {cap}")
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_q[0] must be 0, got {cu[0]}")
        if cu[-1] != num_tokens:
            raise ValueError(f"cu_seqlens_q[-1] = {cu[-1]} must equal the number of q tokens {num_tokens}")
        sizes = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
        for b, s in enumerate(sizes):
            if s < 0:
                raise ValueError(f"cu_seqlens_q must be non-decreasing (cu_seqlens_q[{b}:{b + 2}] = {cu[b:b + 2]})")
        for b, s in enumerate(sizes):
            if s > max_seqlen_q:
                raise ValueError(f"request {b} has {s} q tokens > max_seqlen_q={max_seqlen_q}")
    # only pages that hold keys are ever read; the tail of each row may be garbage
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size \
        < cache_seqlens[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page id in [0, {num_pages}) "
                         f"(request {b} uses its first {-(-lens[b] // page_size)} pages)")


def get_decode_metadata(cache_seqlens, num_heads_q, *, s_q=None, cu_seqlens_q=None, max_seqlen_q=None,
                        causal=True, deterministic=False):
    """Split-KV schedule for mla_decode; computed on cache_seqlens' device without a host sync.

    Uniform batches pass s_q (tokens per request); varlen batches pass cu_seqlens_q and max_seqlen_q.
    Reuse the result across layers/steps that share cache_seqlens, heads, query lengths and causal;
    it holds values of cache_seqlens (the first request of each part's length, read at the split
    kernel's start), so recompute it (in the CUDA graph, if captured) whenever they change.
    deterministic=True never splits a request across CTAs, so each row's result is bit-identical
    whatever else is in the batch (batch invariance), at the cost of load balance for long requests.
    """
    if cu_seqlens_q is None:
        if s_q is None:
            s_q = max_seqlen_q
        elif max_seqlen_q is not None and max_seqlen_q != s_q:
            raise ValueError(f"s_q={s_q} and max_seqlen_q={max_seqlen_q} disagree")
        if s_q is None:
            raise ValueError("get_decode_metadata needs s_q (uniform batch) or cu_seqlens_q + max_seqlen_q")
        max_seqlen_q = s_q
    elif max_seqlen_q is None:
        raise ValueError("cu_seqlens_q given without max_seqlen_q")
    if not 1 <= num_heads_q <= MAX_HEADS_Q:
        raise ValueError(f"num_heads_q must be in [1, {MAX_HEADS_Q}], got {num_heads_q}")
    if not 1 <= max_seqlen_q <= MAX_SEQLEN_Q:
        raise ValueError(f"max_seqlen_q must be in [1, {MAX_SEQLEN_Q}], got {max_seqlen_q}")
    num_sms = device_num_sms(cache_seqlens.device)
    parts = num_sm_parts(num_sms, max_seqlen_q, num_heads_q)
    tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(
        cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, causal, parts, num_sms,
        deterministic=deterministic)
    return DecodeMetadata(tile_sched, req_splits, parts, max_seqlen_q, num_heads_q, causal, deterministic)


def mla_decode(q, kv_cache, block_table, cache_seqlens, *, cu_seqlens_q=None, max_seqlen_q=None, q_pe=None,
               softmax_scale=None, causal=True, return_lse=False, metadata=None, out=None, validate=None,
               deterministic=False, k_scale=None, fp8_mma=False):
    """Absorbed MLA decode attention over a paged latent KV cache.

    q [B, s_q, h_q, 576] (or 512 + q_pe [.., 64]), or varlen [T, h_q, 576|512] with cu_seqlens_q [B+1] and
    max_seqlen_q. kv_cache [num_pages, page_size(, 1), 576] in q's dtype, or float8_e4m3fn with k_scale
    (float32 tensor [1]: value = stored * k_scale, as mla_attn.write_kv_cache stores it); block_table int32
    [B, max_pages]; cache_seqlens int32 [B]. Causal masking is bottom-right aligned.
    Returns out [.., h_q, 512] in q's dtype, plus lse fp32 [.., h_q] if return_lse.
    deterministic=True: batch-invariant results (see get_decode_metadata); metadata, when given, must
    have been computed with the same flag.
    fp8_mma=True (float8_e4m3fn cache only): with more than 16 query rows per request
    (max_seqlen_q * h_q > 16), or any with deterministic=True, the MMAs run in e4m3: each Q row is
    rounded to e4m3 (times a power of two) and so are the probabilities. That is 1.2-1.9x faster at
    h_q 128, where the kernel is bound by its MMAs (faster than a bf16 cache there too), and up to
    1.5x at 17-32 rows, but costs about 3 % relative error against the reference on the dequantized
    cache (0.17 % without), the size of the error the FP8 cache itself adds, and LSE within ~0.1.
    16 rows or fewer stream the cache and keep 16-bit MMAs.
    """
    if softmax_scale is None:
        raise ValueError("softmax_scale is required (MLA absorbs the projection, so 1/sqrt(576) is not "
                         "the right default)")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    batch, max_seqlen_q = _check_static(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q,
                                        max_seqlen_q, out)
    check_k_scale(kv_cache, k_scale)
    if fp8_mma and kv_cache.dtype != FP8:
        raise ValueError(f"fp8_mma=True needs a float8_e4m3fn kv_cache, got {kv_cache.dtype}")
    h_q = q.shape[-2]
    if metadata is None:
        metadata = get_decode_metadata(cache_seqlens, h_q, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                       causal=causal, deterministic=deterministic)
    else:
        _check_metadata(metadata, batch, max_seqlen_q, h_q, causal, deterministic, q.device)
    if _want_value_checks(validate, q.device):
        _check_values(kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, q.shape[0], k_scale)

    args = (q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, float(softmax_scale),
            causal, metadata.tile_sched, metadata.req_splits, metadata.num_sm_parts)
    if out is None:
        out, lse = torch.ops.mla_attn.mla_decode(*args, k_scale=k_scale, deterministic=deterministic,
                                                 fp8_mma=fp8_mma)
    else:
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        torch.ops.mla_attn.mla_decode_out(*args, out, lse, k_scale=k_scale, deterministic=deterministic,
                                          fp8_mma=fp8_mma)
    return (out, lse) if return_lse else out
