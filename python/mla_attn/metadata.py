"""Split-KV sizing and the CPU twin of the decode scheduler.

Everything that decides output/workspace shapes lives here so torch.compile fakes can compute it.
schedule_cpu must stay bit-identical to the device scheduler kernel (contract: "Split-KV scheduler").
"""
import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

BLOCK_M = 64  # query rows (token x head) per tile
BLOCK_N = 64  # keys per KV block
FIXED_COST = 5  # per-segment overhead, in blocks, charged by the scheduler
# A partition of whole requests is taken when its largest part costs at most this many blocks more
# than a split part: a split also writes partials and needs the combine kernel, and splitting every
# request of a large batch writes tens of MB of them (docs/design-decisions.md).
NO_SPLIT_SLACK = 2
# split_payload searches no lower than pieces of this many blocks (unless its upper end is lower):
# one-block pieces carry a split's fixed costs for one block of work (docs/design-decisions.md).
MIN_SEARCHED_PIECE = 2
CPU_NUM_SMS = 132  # H200: CPU schedules mirror what the GPU would do
# The split kernels the private `split_kernel=` option of the decode ops can force; mirrors
# kDecodeKernelNames in csrc/mla_decode/dispatch.h.
DECODE_KERNELS = ("narrow16", "narrow16_3wg", "narrow32", "rows64", "seesaw", "seesaw_steady", "fp8mma",
                  "rows64_seesaw")


class ScheduleRow(NamedTuple):
    """One row of tile_sched: the work of one part. Mirrors struct ScheduleRow in
    csrc/mla_decode/schedule_row.h (same fields, same order; a test compares them)."""
    first_request: int  # the part's first request (0 for a part with no request)
    first_block: int  # its first KV block
    last_request: int  # the part's last request; below first_request when it has none
    last_end_block: int  # KV block after the last request's last block in this part
    first_split: int  # split index of the first request's piece
    first_seqlen: int  # cache_seqlens of the first request (0 for no request)
    split_list: int  # row i: b + 1 of the i-th split request, for the combine kernel; 0 past the last
    reserved: int  # 0


SCHEDULE_ROW_FIELDS = ScheduleRow._fields
SCHEDULE_COLUMN = ScheduleRow(*range(len(SCHEDULE_ROW_FIELDS)))  # tile_sched[:, SCHEDULE_COLUMN.split_list]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_q_tiles(max_seqlen_q: int, h_q: int) -> int:
    return _cdiv(max_seqlen_q * h_q, BLOCK_M)


def num_sm_parts(num_sms: int, max_seqlen_q: int, h_q: int) -> int:
    return max(1, num_sms // num_q_tiles(max_seqlen_q, h_q))


def metadata_shapes(batch: int, num_sms: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (tile_sched, req_splits)."""
    return (num_sms, len(SCHEDULE_ROW_FIELDS)), (batch, 2)


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_num_sms(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


class DecodeMetadata(NamedTuple):
    """The split-KV schedule of mla_decode (from get_decode_metadata) and what it was computed for."""
    tile_sched: torch.Tensor  # int32 [num_sms, 8]: ScheduleRow rows
    req_splits: torch.Tensor  # int32 [B, 2] = (num_splits, first workspace slot)
    num_sm_parts: int
    max_seqlen_q: int
    num_heads_q: int
    causal: bool
    deterministic: bool = False  # schedule never splits a request (batch-invariant results)


_EMPTY_PART = ScheduleRow(0, 0, -1, 0, 0, 0, 0, 0)


def _split_walk_fits(num_blocks: list[int], num_sm_parts: int, payload: int) -> bool:
    """Whether the split walk (schedule_cpu, not deterministic), filling each part up to payload, takes
    every request within num_sm_parts parts without the last part taking the rest."""
    b = blk = 0
    for _ in range(num_sm_parts):
        remain = payload
        while b < len(num_blocks):
            rest = num_blocks[b] - blk
            if rest + FIXED_COST <= remain:
                remain -= rest + FIXED_COST
                b, blk = b + 1, 0
            else:
                blk += max(remain - FIXED_COST, 0)
                break
    return b >= len(num_blocks)


def split_payload(num_blocks: list[int], num_sm_parts: int) -> int:
    """Part cost of the split walk: the smallest C in [lo, ceil(T / P) + FIXED_COST) (T: blocks +
    FIXED_COST per request; lo = ceil(T / P), raised to MIN_SEARCHED_PIECE + FIXED_COST if that is
    below the upper end) at which it fits in num_sm_parts parts (_split_walk_fits), else the upper end
    (the last part takes the rest). The upper end alone left parts idle: 32 requests of 16 blocks over
    132 parts took 6-block pieces on 96 parts (C = 11), where C = 9 gives 4-block pieces on 128. The
    device walks each candidate on a warp of its own."""
    base = _cdiv(sum(num_blocks) + len(num_blocks) * FIXED_COST, num_sm_parts)
    upper = base + FIXED_COST
    lo = max(base, min(MIN_SEARCHED_PIECE + FIXED_COST, upper))
    return next((c for c in range(lo, upper) if _split_walk_fits(num_blocks, num_sm_parts, c)), upper)


def whole_request_capacity(num_blocks: list[int], num_sm_parts: int, payload: int) -> Optional[int]:
    """The smallest part cost C <= payload (the split walk's) + NO_SPLIT_SLACK at which whole requests,
    taken in order while a part's cost stays <= C, fit in num_sm_parts parts; None if there is none
    (then requests are split). A request costs its blocks + FIXED_COST. The device walks each candidate C on a warp
    of its own (at most FIXED_COST + NO_SPLIT_SLACK + 1 of them)."""
    costs = [k + FIXED_COST for k in num_blocks]
    if not costs:
        return None
    lo = max(max(costs), _cdiv(sum(costs), num_sm_parts))
    for capacity in range(lo, payload + NO_SPLIT_SLACK + 1):
        parts, load = 1, 0
        for c in costs:
            if load + c > capacity:
                parts, load = parts + 1, 0
            load += c
        if parts <= num_sm_parts:
            return capacity
    return None


def schedule_cpu(cache_seqlens: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int, num_heads_q: int,
                 num_sm_parts: int, num_sms: int, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """The contract's sequential walk. Returns (tile_sched int32 [num_sms, 8], req_splits int32 [B, 2]).
    A tile_sched row is a ScheduleRow; a part with no request is (0, 0, -1, 0, 0, 0, split list, 0).
    Split list: split_list of row i is b + 1 of the i-th request that is split (for the combine
    kernel), 0 past the last.

    The partition depends only on KV lengths (every q tile of a request walks the same KV blocks),
    so cu_seqlens_q / max_seqlen_q / num_heads_q are accepted for signature parity but unused.
    When whole requests balance nearly as well as split ones (whole_request_capacity), no request is
    split, deterministic or not.
    deterministic: a part never cuts a request (an empty part takes its next request whole, however
    long), so each request is summed by one CTA in key order and its result does not depend on the
    batch; the price is load balance when one request dominates.
    Needs 1 <= num_sm_parts <= num_sms (the CPU op checks it).
    """
    lens = cache_seqlens.tolist()
    n = [_cdiv(max(int(l), 0), BLOCK_N) for l in lens]
    B, P = len(n), num_sm_parts
    # deterministic: the upper end of split_payload (the search simulates the splitting walk).
    payload = _cdiv(sum(n) + B * FIXED_COST, P) + FIXED_COST if deterministic else split_payload(n, P)
    capacity = whole_request_capacity(n, P, payload)
    if capacity is not None:  # no request is cut: the walk below with that payload never splits
        payload, deterministic = capacity, True
    sched = [_EMPTY_PART] * num_sms
    num_splits = [0] * B
    b = blk = k = 0
    for p in range(P):
        if b >= B:
            continue
        begin = (b, blk, k)
        remain, last_b, last_hi = payload, b - 1, 0
        while b < B:
            rest = n[b] - blk
            if rest + FIXED_COST <= remain or p == P - 1 or (deterministic and last_b < begin[0]):
                remain -= rest + FIXED_COST
                num_splits[b], last_b, last_hi = k + 1, b, n[b]
                b, blk, k = b + 1, 0, 0
            else:
                take = 0 if deterministic else remain - FIXED_COST
                if take > 0:
                    last_b, last_hi = b, blk + take
                    blk, k = blk + take, k + 1
                break
        first_len = int(lens[begin[0]]) if last_b >= begin[0] else 0  # the kernel's first addresses need it
        sched[p] = ScheduleRow(begin[0], begin[1], last_b, last_hi, begin[2], first_len, 0, 0)
    slots, slot = [], 0
    for s in num_splits:
        slots.append(slot)
        slot += s if s > 1 else 0
    # split_list lists the split requests (b + 1, in order; at most P - 1 of them, one per part
    # boundary) for the combine kernel, which then needs no CTA per request that was not split.
    for i, b in enumerate(b for b in range(B) if num_splits[b] > 1):
        sched[i] = sched[i]._replace(split_list=b + 1)
    tile_sched = torch.tensor(sched, dtype=torch.int32).reshape(num_sms, len(SCHEDULE_ROW_FIELDS))
    req_splits = torch.tensor(list(zip(num_splits, slots)), dtype=torch.int32).reshape(B, 2)
    return tile_sched, req_splits


class SparseDecodeMetadata(NamedTuple):
    """The split-KV schedule of mla_sparse_decode (get_sparse_decode_metadata): R query tokens of topk
    slots each, made from shapes alone, so one schedule serves every call (layer) of a step with the same
    R, topk and h_q, whatever its indices. A row with fewer valid indices ends its work early."""
    decode: DecodeMetadata  # the schedule of mla_decode over R requests of topk keys each
    rows: int  # R, the query tokens
    topk: int
    lengths: torch.Tensor  # int32 [R], all topk: the row lengths of a call without topk_length
