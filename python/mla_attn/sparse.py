"""Public sparse-attention API (DeepSeek-V3.2 top-k attention): mla_sparse_decode, mla_sparse_prefill and
get_sparse_decode_metadata, built on the kv_slots form of the torch.ops.mla_attn.mla_decode op.

Each query token has its own list of top-k cache slots (from the caller's indexer), so each token is a
"request" of one query token for the dense decode kernel:
  1. get_decode_metadata schedules R one-token requests of topk keys each (causal=False): shapes only,
     so get_sparse_decode_metadata makes it once per step for every layer, and a call without it reuses
     the schedule of an earlier call of the same shapes (_ScheduleCache);
  2. compact_sparse_indices writes each row's valid indices (position < topk_length, 0 <= index <
     num_slots) in order to the front of a [R, topk] slot list, and their count, on every call; not for
     a ds_mla_fp8 cache, whose kernel takes the index rows as they are and skips invalid slots itself,
     nor when the caller promises (indices_valid=True) that every index a row counts is a cache slot;
  3. torch.ops.mla_attn.mla_decode(kv_slots=True) gathers the listed cache rows (DeepSeek-V3.2's
     ds_mla_fp8 rows too: the kernels dequantise them to fp16), each row's blocks ending at its count;
  4. an attention sink, if given, enters the denominators where the kernels normalise (epilogue, combine).
Every step runs on the device without a host sync, so the whole call is CUDA-graph capturable and
traceable by torch.compile. Arguments are checked by _validation (static checks always; value checks on
CPU tensors, or with validate=True / MLA_ATTN_VALIDATE=1).
"""
import collections
import math
from typing import Optional, Union

import torch
from torch import Tensor

from . import _validation as check
from ._constants import D_V, MAX_SCHEDULED_REQUESTS
from .decode import get_decode_metadata
from .metadata import SparseDecodeMetadata

def _row_lengths(topk_length: Optional[Tensor], indices: Tensor) -> Optional[Tensor]:
    """topk_length per row of the [R, topk] view of indices: a batched call's per-request lengths are
    repeated over the request's s_q tokens."""
    if topk_length is None:
        return None
    if indices.dim() == 3:
        batch, s_q = indices.shape[:2]
        topk_length = topk_length[:, None].expand(batch, s_q).reshape(batch * s_q)
    return topk_length.contiguous()


def _sparse_schedule(rows: int, topk: int, num_heads_q: int, device: torch.device) -> SparseDecodeMetadata:
    lengths = torch.full((rows,), topk, dtype=torch.int32, device=device)
    return SparseDecodeMetadata(get_decode_metadata(lengths, num_heads_q, s_q=1, causal=False), rows, topk, lengths)


class _ScheduleCache:
    """The schedules of mla_sparse_decode calls made without metadata=, by (R, topk, h_q, device): they
    depend on these shapes alone, so a call reuses the schedule an earlier call made instead of running
    the fill and scheduler kernels again (their cost per call: docs/design-decisions.md).

    - An entry is used on the stream that made it; on another stream outside a CUDA-graph capture after
      waiting for it there (its tensors then also record that stream, for the allocator); in a capture
      on another stream only once a lookup outside a capture found it complete (a capture cannot wait
      for work outside it, nor query an event), else the capture schedules in its graph.
    - Nothing made during a capture is kept (the graph's memory pool owns it); an entry a capture used
      is never evicted, since the graph reads its tensors on every replay.
    - Under torch.compile tracing the schedule is made in the graph, as before.
    """
    MAX_EVICTABLE = 64

    class Entry:
        def __init__(self, metadata: SparseDecodeMetadata, stream: torch.cuda.Stream):
            self.metadata, self.stream_id = metadata, stream.stream_id
            self.done = torch.cuda.Event()
            self.done.record(stream)
            self.complete = False  # known finished (an event query outside a capture)
            self.pinned = False  # a CUDA graph reads it

    def __init__(self):
        self.entries = collections.OrderedDict()

    def get(self, rows: int, topk: int, num_heads_q: int, device: torch.device) -> SparseDecodeMetadata:
        if device.type != "cuda" or torch.compiler.is_compiling():
            return _sparse_schedule(rows, topk, num_heads_q, device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (rows, topk, num_heads_q, index)
        stream = torch.cuda.current_stream(index)
        capturing = torch.cuda.is_current_stream_capturing()
        entry = self.entries.get(key)
        if entry is not None:
            if not capturing and not entry.complete:
                entry.complete = entry.done.query()
            if entry.stream_id != stream.stream_id and not entry.complete:
                if capturing:
                    return _sparse_schedule(rows, topk, num_heads_q, device)
                stream.wait_event(entry.done)
            if entry.stream_id != stream.stream_id and not capturing:  # (pinned below when capturing)
                for t in (entry.metadata.decode.tile_sched, entry.metadata.decode.req_splits, entry.metadata.lengths):
                    t.record_stream(stream)
            entry.pinned = entry.pinned or capturing
            self.entries.move_to_end(key)
            return entry.metadata
        metadata = _sparse_schedule(rows, topk, num_heads_q, device)
        if not capturing:
            self.entries[key] = self.Entry(metadata, stream)
            evictable = [k for k, e in self.entries.items() if not e.pinned]
            for k in evictable[:max(0, len(evictable) - self.MAX_EVICTABLE)]:
                del self.entries[k]
        return metadata


_schedules = _ScheduleCache()


def get_sparse_decode_metadata(indices: Tensor, num_heads_q: int) -> SparseDecodeMetadata:
    """The split-KV schedule of mla_sparse_decode, computed on the device without a host sync. It depends
    on shapes alone (the query tokens R and topk of indices, h_q), as FlashMLA's metadata does: make it once
    per step and pass it as metadata= to every layer's call, whatever its indices and topk_length.

    indices int32 [B, s_q, topk] or [T, topk] (only its shape and device are read), at most
    MAX_SCHEDULED_REQUESTS (50000) query tokens: a call with more takes metadata=None and schedules them
    in pieces.
    """
    check.check_int("num_heads_q", num_heads_q, 1, check.MAX_HEADS_Q)
    check.check_tensor("indices", indices)
    if indices.dim() not in (2, 3):
        raise ValueError(f"indices must be [B, s_q, topk] or [T, topk], got shape {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    if indices.shape[-1] < 1:
        raise ValueError(f"indices must have topk >= 1 slots per row, got shape {tuple(indices.shape)}")
    rows = math.prod(indices.shape[:-1])
    if rows > MAX_SCHEDULED_REQUESTS:
        raise ValueError(f"one schedule takes at most {MAX_SCHEDULED_REQUESTS} query tokens, got {rows}; call "
                         "mla_sparse_decode without metadata=, which then schedules them in pieces")
    return _sparse_schedule(rows, indices.shape[-1], num_heads_q, indices.device)


def mla_sparse_decode(q: Tensor, kv_cache: Tensor, indices: Tensor, *, softmax_scale: float,
                      q_pe: Optional[Tensor] = None, topk_length: Optional[Tensor] = None,
                      attn_sink: Optional[Tensor] = None, k_scale: Optional[Tensor] = None, return_lse: bool = False,
                      out: Optional[Tensor] = None, metadata: Optional[SparseDecodeMetadata] = None,
                      validate: Optional[bool] = None, indices_valid: bool = False,
                      _kernel: Optional[str] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Sparse (top-k) absorbed MLA attention over a paged latent cache (DeepSeek-V3.2).

    q [B, s_q, h_q, 576] or token-major [T, h_q, 576], bf16/fp16 (or 512 dims + q_pe [.., 64]); h_q 1..128.
    kv_cache [num_pages, page_size(, 1), 576], page_size 1..256, in q's dtype or float8_e4m3fn with
    k_scale (float32 [1]: value = stored * k_scale); or DeepSeek-V3.2's FP8 layout, uint8 [num_pages,
    page_size(, 1), 656] with its scales in the rows (kv_format "ds_mla_fp8" of write_kv_cache; rows back
    to back), no k_scale, whose gathered rows the kernels (rows64; narrow16 at h_q <= 16, narrow32 at
    h_q <= 32 from 128 index rows) dequantise to fp16: exactly for |latent values| up to 57344 (scale
    <= 2^7) and rope values within fp16's range; larger values overflow.
    indices int32 [B, s_q, topk] (or [T, topk]), topk >= 1: the cache slots (page * page_size + row in
    page) each query token attends to. An index of -1, or any slot outside the cache, is skipped; a
    repeated index counts once per occurrence. topk_length int32 [B] (one per request, for each of its
    tokens) or [T] (token-major: one per token): only the first topk_length indices of a row count
    (values in [0, topk]).
    indices_valid: the caller's promise that every index a row counts (its first topk_length; all topk
    without topk_length, so an indexer's -1 tail needs topk_length; its tails differ per token, so pass
    token-major [T, topk] indices with topk_length [T]) is a slot in the cache. The call then
    reads the rows as they are instead of compacting them first (one kernel less per call; a ds_mla_fp8
    cache is never compacted, and skips invalid slots either way). Value checks verify the promise.
    Unchecked, a counted index outside a 16-bit or e4m3 cache reads the slot it clamps to (-1: slot 0,
    past the end: the last slot), whatever that slot holds (NaN if never written), without a fault.
    attn_sink float32 [h_q] (optional): out is scaled by exp(lse) / (exp(lse) + exp(sink)) (+inf: out 0,
    -inf: no effect); the returned lse is the attention's own.
    Returns out [.., h_q, 512] in q's dtype, plus lse float32 [.., h_q] (natural log) if return_lse.
    A token with no valid index gets out 0 and lse +inf, with or without a sink.
    metadata: get_sparse_decode_metadata(indices, h_q), made once per step (shapes only); when omitted,
    the schedule an earlier call of the same R, topk and h_q made on this device is reused (made and
    kept on the first such call outside a CUDA-graph capture); above MAX_SCHEDULED_REQUESTS (50000) query
    tokens (a long prefill) the call runs in pieces of at most that many, each with its own schedule,
    so metadata must be None there. _kernel (private, for tests and benchmarks): the split kernel to run
    (metadata.DECODE_KERNELS); the call is a decode of max_seqlen_q 1, so rows = h_q.
    """
    rows = check.memoized(_static_checks, q, q_pe, kv_cache, indices, topk_length, attn_sink, out, k_scale,
                          metadata, softmax_scale, return_lse, validate, indices_valid, _kernel)
    check.check_apart("out", out, {"q": q, "q_pe": q_pe, "kv_cache": kv_cache, "indices": indices,
                                   "topk_length": topk_length, "attn_sink": attn_sink})
    h_q, topk = q.shape[-2], indices.shape[-1]
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    row_lengths = _row_lengths(topk_length, indices)
    if check.want_value_checks(validate, q.device):
        check.check_topk_length_values(topk_length, topk)
        check.check_scale_value("k_scale", k_scale)
        if indices_valid:
            check.check_counted_indices_in_cache(indices, topk_length, num_slots)
    # A ds_mla_fp8 cache is read by kernels that copy each key row by themselves (rows64, narrow) and skip
    # the invalid slots (score -inf, zero row): the index rows go as they are. The other kernels need
    # every listed slot valid: the valid indices are compacted to the front of each row first, unless
    # the caller vouches for them.
    skip_invalid = kv_cache.dtype == torch.uint8
    index_rows = indices if indices.dim() == 2 else indices.reshape(rows, topk)
    if skip_invalid or indices_valid:  # the op takes index rows at any row stride
        slots, counts = index_rows, row_lengths  # None: each schedule's lengths
    else:
        slots, counts = torch.ops.mla_attn.compact_sparse_indices(index_rows, row_lengths, num_slots)

    # Each query token is a request of one token: [R, 1, h_q, D] views (reshape copies a batched q only
    # when its batch and token strides do not merge).
    q_rows = q.reshape(rows, 1, h_q, q.shape[-1])
    q_pe_rows = None if q_pe is None else q_pe.reshape(rows, 1, h_q, q_pe.shape[-1])
    kw = dict(k_scale=k_scale, split_kernel=_kernel, kv_slots=True, skip_invalid_slots=skip_invalid,
              attn_sink=None if attn_sink is None else attn_sink.contiguous())

    def attend(r0: int, r1: int, md: SparseDecodeMetadata, out_rows: Optional[Tensor],
               lse_rows: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """Rows [r0, r1) under the schedule md made for them; into out_rows / lse_rows when given (into
        out_rows alone, no lse, where the caller does not want it back)."""
        def piece(t: Optional[Tensor]) -> Optional[Tensor]:
            return t if t is None or (r0, r1) == (0, rows) else t[r0:r1]  # (a slice costs a dispatch)
        piece_counts = md.lengths if counts is None else piece(counts)
        args = (piece(q_rows), piece(q_pe_rows), kv_cache, piece(slots), piece_counts, None, 1,
                float(softmax_scale), False, md.decode.tile_sched, md.decode.req_splits, md.decode.num_sm_parts)
        if out_rows is None:
            return torch.ops.mla_attn.mla_decode(*args, **kw)
        if lse_rows is None and return_lse:
            lse_rows = torch.empty(r1 - r0, 1, h_q, dtype=torch.float32, device=q.device)
        torch.ops.mla_attn.mla_decode_out(*args, out_rows, lse_rows, **kw)
        return out_rows, lse_rows

    out_rows = None if out is None else out.view(rows, 1, h_q, D_V)
    if metadata is not None or rows <= MAX_SCHEDULED_REQUESTS:
        md = metadata if metadata is not None else _schedules.get(rows, topk, h_q, q.device)
        out_rows, lse = attend(0, rows, md, out_rows, None)
    else:
        # More query tokens than one schedule takes (a long prefill): pieces, each scheduled on its own.
        if out_rows is None:
            out_rows = torch.empty(rows, 1, h_q, D_V, dtype=q.dtype, device=q.device)
        lse = torch.empty(rows, 1, h_q, dtype=torch.float32, device=q.device) if return_lse else None
        for r0 in range(0, rows, MAX_SCHEDULED_REQUESTS):
            r1 = min(rows, r0 + MAX_SCHEDULED_REQUESTS)
            attend(r0, r1, _schedules.get(r1 - r0, topk, h_q, q.device), out_rows[r0:r1],
                   None if lse is None else lse[r0:r1])
    out = out_rows.view(q.shape[:-1] + (D_V,)) if out is None else out
    return (out, lse.view(q.shape[:-1])) if return_lse else out


def _static_checks(q, q_pe, kv_cache, indices, topk_length, attn_sink, out, k_scale, metadata, softmax_scale,
                   return_lse, validate, indices_valid, kernel) -> int:
    """mla_sparse_decode's static checks (all but out's overlap with the inputs). Returns the query tokens R."""
    check.check_softmax_scale(softmax_scale)
    check.check_flags(return_lse=return_lse, validate=validate, indices_valid=indices_valid)
    rows = check.check_sparse_decode(q, q_pe, kv_cache, indices, topk_length, attn_sink, out)
    check.check_decode_options(q, kv_cache, k_scale, False, kernel, 1)
    if metadata is not None:
        check.check_sparse_metadata(metadata, indices, q)
    return rows


def mla_sparse_prefill(q: Tensor, kv: Tensor, indices: Tensor, *, softmax_scale: float,
                       topk_length: Optional[Tensor] = None, attn_sink: Optional[Tensor] = None,
                       return_lse: bool = False, out: Optional[Tensor] = None, validate: Optional[bool] = None,
                       indices_valid: bool = False,
                       _kernel: Optional[str] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Sparse (top-k) absorbed MLA attention over gathered latent rows (DeepSeek-V3.2 prefill).

    q [T, h_q, 576] bf16/fp16; kv [S, 576] or [S, 1, 576] in q's dtype: the latent rows an engine
    gathers from its cache (e.g. with gather_kv_cache); indices int32 [T, topk]: rows of kv, -1 or
    >= S skipped; topk_length int32 [T] (optional); attn_sink float32 [h_q] (optional) and indices_valid,
    as in mla_sparse_decode. Returns out [T, h_q, 512], plus lse float32 [T, h_q] if return_lse.
    Runs mla_sparse_decode with kv as a cache of S pages of one row.
    """
    check.check_sparse_prefill(q, kv)
    kv_cache = kv[:, None] if kv.dim() == 2 else kv  # [S, 1, 576]: slot = row of kv
    return mla_sparse_decode(q, kv_cache, indices, softmax_scale=softmax_scale, topk_length=topk_length,
                             attn_sink=attn_sink, return_lse=return_lse, out=out, validate=validate,
                             indices_valid=indices_valid, _kernel=_kernel)
