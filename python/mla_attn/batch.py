"""Per-step batch metadata for MLAAttention, built on the host once per step and shared by all layers.

Requests are ordered decodes first, then prefills, as serving engines reorder them: a request is a
"decode" when its new tokens fit the absorbed decode kernel (query_len <= decode_threshold) and goes
through mla_decode over the paged latent cache; longer ones are prefills (MHA-style mla_prefill over
up-projected K/V, plus their cached context when they are later chunks of a chunked prefill).
Everything data-dependent that the forward pass needs as a Python value (token counts, maxima) is a
host field here, so the forward never syncs with the device.
"""
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Optional, Union

import torch

from . import _validation as check
from .decode import get_decode_metadata
from .metadata import DecodeMetadata


def _cumsum0(xs: list[int]) -> list[int]:
    return [0] + list(accumulate(xs))


@dataclass(frozen=True)
class MLABatch:
    """One step's batch as every MLAAttention layer of the step reads it (see the module docstring)."""
    # host: routing and sizes
    num_decodes: int              # decode requests (pads included), first in the batch
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    max_decode_query_len: int     # >= 1 (mla_decode's max_seqlen_q)
    max_prefill_query_len: int
    max_context_len: int          # over prefills: cached tokens before this step's chunk
    num_context_tokens: int       # over prefills: rows gather_kv_cache returns
    page_size: int
    deterministic: bool           # batch-invariant decode schedule
    # keys of the longest request, new tokens included (positions are below it); per step: copy_ takes
    # the new batch's value rather than comparing it
    max_seq_len: int = field(metadata={"per_step": True})
    # device, token-major over the whole batch
    positions: torch.Tensor       # int64 [T]
    slot_mapping: torch.Tensor    # int64 [T]: page * page_size + offset; -1 = pad token, not written
    # device, decode requests
    decode_block_table: torch.Tensor     # int32 [B_d, max_pages]
    decode_seq_lens: torch.Tensor        # int32 [B_d]: keys incl. the new tokens (0 for pads)
    decode_cu_seqlens_q: torch.Tensor    # int32 [B_d + 1]
    decode_metadata: Optional[DecodeMetadata]  # None: mla_decode computes it (e.g. inside a CUDA graph)
    # device, prefill requests (token offsets relative to the first prefill token)
    prefill_block_table: torch.Tensor    # int32 [B_p, max_pages]
    prefill_cu_seqlens_q: torch.Tensor   # int32 [B_p + 1]
    prefill_cu_context_lens: torch.Tensor  # int32 [B_p + 1]

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Sequence[int],
              block_table: Union[Sequence[Sequence[int]], torch.Tensor], page_size: int, device: torch.device | str,
              decode_threshold: int = 512, *, num_heads: Optional[int] = None, deterministic: bool = False,
              pad_to: Optional[int] = None) -> "MLABatch":
        """query_lens / context_lens: host ints per request (new tokens; tokens already cached).
        block_table: per-request page lists, or an int32 tensor [>= B, max_pages] (what engines keep
        on the device; its width is kept, which CUDA graphs need).
        num_heads: compute the decode schedule here, once for all layers (else per layer call).
        pad_to: append dummy decode requests (1 token, no key, never written) up to this many requests,
        for a CUDA graph captured at a fixed batch size; decode-only batches.
        """
        query_lens = check.host_ints("query_lens", query_lens)
        context_lens = check.host_ints("context_lens", context_lens)
        page_size = check.host_int("page_size", page_size)
        decode_threshold = check.host_int("decode_threshold", decode_threshold)
        pad_to = None if pad_to is None else check.host_int("pad_to", pad_to)
        device = check.as_device("device", device)
        check.check_batch(query_lens, context_lens, block_table, page_size, decode_threshold, pad_to, deterministic,
                          device)
        if num_heads is not None:
            check.check_int("num_heads", num_heads, 1, check.MAX_HEADS_Q)
        B = len(query_lens)
        num_decodes = sum(q <= decode_threshold for q in query_lens)
        num_pads = 0 if pad_to is None else pad_to - B
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        if isinstance(block_table, torch.Tensor):
            table = block_table[:B].to(device)
        else:
            width = max((len(p) for p in block_table), default=0)
            table = torch.tensor([list(p) + [0] * (width - len(p)) for p in block_table],
                                 dtype=torch.int32).reshape(B, width).to(device)
        if num_pads:
            table = torch.cat([table, table.new_zeros(num_pads, table.shape[1])])

        # new tokens: their positions and cache slots (pads: position 0, slot -1)
        req = [b for b in range(B) for _ in range(query_lens[b])]
        pos = [context_lens[b] + i for b in range(B) for i in range(query_lens[b])]
        positions = torch.tensor(pos + [0] * num_pads, dtype=torch.int64, device=device)
        slot_mapping = torch.cat([
            table[torch.tensor(req, dtype=torch.int64, device=device), positions[: len(pos)] // page_size].long()
            * page_size + positions[: len(pos)] % page_size,
            positions.new_full((num_pads,), -1)])

        d_q = query_lens[:num_decodes] + [1] * num_pads
        d_seq = seq_lens[:num_decodes] + [0] * num_pads
        p_q, p_ctx = query_lens[num_decodes:], context_lens[num_decodes:]
        i32 = dict(dtype=torch.int32, device=device)
        decode_seq_lens = torch.tensor(d_seq, **i32)
        decode_cu = torch.tensor(_cumsum0(d_q), **i32)
        max_decode_q = max(d_q + [1])
        metadata = None
        if num_heads is not None and d_q:
            metadata = get_decode_metadata(decode_seq_lens, num_heads, cu_seqlens_q=decode_cu,
                                           max_seqlen_q=max_decode_q, causal=True, deterministic=deterministic)
        return cls(
            num_decodes=len(d_q), num_decode_tokens=sum(d_q), num_prefills=len(p_q), num_prefill_tokens=sum(p_q),
            max_decode_query_len=max_decode_q, max_prefill_query_len=max(p_q, default=0),
            max_context_len=max(p_ctx, default=0), num_context_tokens=sum(p_ctx), page_size=page_size,
            deterministic=deterministic, max_seq_len=max(seq_lens, default=0), positions=positions,
            slot_mapping=slot_mapping,
            decode_block_table=table[: len(d_q)], decode_seq_lens=decode_seq_lens, decode_cu_seqlens_q=decode_cu,
            decode_metadata=metadata, prefill_block_table=table[len(d_q):],
            prefill_cu_seqlens_q=torch.tensor(_cumsum0(p_q), **i32),
            prefill_cu_context_lens=torch.tensor(_cumsum0(p_ctx), **i32))

    def copy_(self, other: "MLABatch") -> "MLABatch":
        """Copy other's device tensors into this batch's (in place), e.g. into the static batch a CUDA
        graph was captured with. Host fields (sizes, routing) must be equal: they shape the graph."""
        if not isinstance(other, MLABatch):
            raise TypeError(f"copy_ takes an MLABatch, got {type(other).__name__}")
        for f in fields(self):
            if f.metadata.get("per_step"):  # the step's own value, whatever the graph was captured with
                object.__setattr__(self, f.name, getattr(other, f.name))
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, torch.Tensor):
                if mine.shape != theirs.shape:
                    raise ValueError(f"{f.name}: shape {tuple(theirs.shape)} != captured {tuple(mine.shape)}")
                mine.copy_(theirs)
            elif isinstance(mine, DecodeMetadata) or isinstance(theirs, DecodeMetadata):
                raise ValueError("copy_ is for batches without precomputed decode_metadata (build with "
                                 "num_heads=None: the metadata is then computed inside the graph)")
            elif mine != theirs:
                raise ValueError(f"{f.name}: {theirs} != captured {mine}")
        return self
