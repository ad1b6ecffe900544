"""Context-parallel (CP) decode: every rank holds a slice of every request's KV pages.

Layout: the pages of a request are dealt round-robin, page j (keys [j*P, (j+1)*P) for page size P) to
rank j % W. Round-robin rather than contiguous chunks because
  * it balances any length to within one page per request, without knowing final lengths up front;
  * a growing request appends its next page to the next rank in turn: nothing ever moves;
  * a rank's slice is an ordinary paged cache (local page i = global page i*W + rank), so mla_decode
    runs on it unchanged.
A decode step runs mla_decode on the local slice, all-gathers (out, lse) and merges the W partial
attentions by LSE. Partial attentions over disjoint key sets merge exactly, so the result matches one
mla_decode over the whole cache up to rounding.
"""
from typing import NamedTuple, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _validation as check
from ._constants import D_V
from .decode import mla_decode
from .merge import merge_attn_states_n
from .metadata import DecodeMetadata

Position = TypeVar("Position", int, Tensor)

# all_gather_single is the newer name of all_gather_into_tensor (deprecated from torch 2.14)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CPSlice(NamedTuple):
    """One rank's slice of a batch's pages (from cp_slice)."""
    block_table: torch.Tensor  # int32 [B, ceil((max_pages - rank) / W)]: the rank's pages, in order
    cache_seqlens: torch.Tensor  # int32 [B]: keys of each request held by the rank (0 allowed)


def cp_slice(block_table: Tensor, cache_seqlens: Tensor, page_size: int, world_size: int, rank: int) -> CPSlice:
    """Rank `rank`'s slice of full requests (block_table int32 [B, max_pages], cache_seqlens int32 [B]).

    Pure tensor ops on the inputs' device (no host sync). The returned block table holds the page ids
    of the input table; an engine that numbers pages per rank keeps the same positions.
    """
    check.check_cp_layout(page_size, world_size, rank)
    check.check_cp_requests(block_table, cache_seqlens)
    if check.want_value_checks(None, block_table.device):
        check.check_seqlens_values(block_table, cache_seqlens, page_size)
    pages = block_table[:, rank::world_size].contiguous()
    first_key = (rank + world_size * torch.arange(pages.shape[1], device=block_table.device)) * page_size
    keys = (cache_seqlens[:, None] - first_key).clamp(0, page_size)  # keys in each local page
    return CPSlice(pages, keys.sum(1, dtype=torch.int32))


def cp_token_slot(positions: Position, page_size: int, world_size: int) -> tuple[Position, Position]:
    """Where key position t of a request lives: (rank, local position in that rank's slice).

    The KV of position t is written to local page local // page_size of the rank's block-table row,
    slot local % page_size. Works elementwise on tensors and on ints.
    """
    check.check_cp_layout(page_size, world_size)
    check.check_cp_positions(positions)
    page = positions // page_size
    return page % world_size, (page // world_size) * page_size + positions % page_size


# The LSE (fp32) travels in the tail of each out row, so one collective moves both. The row is
# padded to 520 elements to keep 16-byte aligned rows (mla_decode's `out` stride rule).
_ROW = D_V + 8


def _lse_lanes(rows: Tensor) -> Tensor:
    """fp32 view [..] of elements [512, 512 + 4/itemsize) of rows [.., _ROW] (16-bit dtypes)."""
    return rows[..., D_V:D_V + 4 // rows.element_size()].view(torch.float32)[..., 0]


def cp_mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, *, softmax_scale: float,
                  group: Optional[dist.ProcessGroup] = None, q_pe: Optional[Tensor] = None,
                  metadata: Optional[DecodeMetadata] = None, return_lse: bool = False,
                  validate: Optional[bool] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """One decode step with the KV cache split over the ranks of `group` (default: the world).

    q [B, 1, h_q, 576] (or 512 + q_pe [B, 1, h_q, 64]) is the same on every rank; kv_cache,
    block_table and cache_seqlens describe this rank's slice (see cp_slice). metadata, when given,
    comes from get_decode_metadata(cache_seqlens, h_q, s_q=1, causal=False) on the local lengths.
    Returns out [B, 1, h_q, 512] in q's dtype (and lse fp32 [B, 1, h_q]), identical on every rank.
    Cost: local decode over ~1/W of the keys, one all-gather of W*B*h_q*520 elements, one merge.
    No host sync: capturable in a CUDA graph with NCCL.
    """
    check.check_cp_query(q)
    check.check_flags(return_lse=return_lse, validate=validate)
    check.check_cp_group(group)
    world = dist.get_world_size(group)
    local = q.new_empty(q.shape[:-1] + (_ROW,))
    # one new token sees every key, so causal=False is the same attention
    _, lse = mla_decode(q, kv_cache, block_table, cache_seqlens, q_pe=q_pe, softmax_scale=softmax_scale,
                        causal=False, return_lse=True, metadata=metadata, out=local[..., :D_V],
                        validate=validate)
    _lse_lanes(local).copy_(lse)
    gathered = local.new_empty((world * local.shape[0],) + local.shape[1:])  # concatenated: gloo has no stacked form
    _all_gather(gathered, local, group=group)
    gathered = gathered.view((world,) + local.shape)
    # a rank with no keys of a request contributes lse +inf: merge_attn_states_n skips it
    out, lse = merge_attn_states_n(gathered[..., :D_V], _lse_lanes(gathered))
    return (out, lse) if return_lse else out
