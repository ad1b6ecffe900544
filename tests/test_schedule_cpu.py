"""The split-KV scheduler's whole-request partition (metadata.py: whole_request_capacity), on the CPU
twin; test_decode_gpu.py checks the device kernel against it bit for bit. The schedule's row layout:
the same fields in C++ and Python. The device kernel's chain formulation of a walk against the twin."""
import re
from pathlib import Path

import torch
from conftest import schedule_segments

from mla_attn.metadata import (BLOCK_N, FIXED_COST, MIN_SEARCHED_PIECE, NO_SPLIT_SLACK, SCHEDULE_COLUMN,
                               SCHEDULE_ROW_FIELDS, ScheduleRow, _split_walk_fits, metadata_shapes, schedule_cpu,
                               split_payload, whole_request_capacity)

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def test_schedule_row_fields_match_the_cuda_struct():
    (header,) = CSRC.glob("**/schedule_row.h")  # wherever the decode sources keep it
    body = re.search(r"struct ScheduleRow \{(.*?)\};", header.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    assert tuple(re.findall(r"\bint\s+(\w+)\s*;", body)) == SCHEDULE_ROW_FIELDS
    assert re.fullmatch(r"(\s*int\s+\w+\s*;)*\s*", body), "only int32 fields"
    assert metadata_shapes(3, 132)[0] == (132, len(SCHEDULE_ROW_FIELDS)) == (132, 8)
    assert SCHEDULE_COLUMN.split_list == SCHEDULE_ROW_FIELDS.index("split_list")


def _part_costs(tile_sched, parts, n):
    costs = [0] * parts
    for _, lo, hi, _, p in schedule_segments(tile_sched, parts, n):
        costs[p] += hi - lo + FIXED_COST
    return costs


def test_uniform_batch_is_not_split():
    # 128 requests of 16 blocks over 66 parts: whole requests cost 21, two per part is 42, a split
    # part 41 + 5. Without the rule every part boundary cut a request (130 fp32 partials).
    lens = torch.full((128,), 1024, dtype=torch.int32)
    ts, rs = schedule_cpu(lens, None, 1, 128, 66, 132)
    assert rs[:, 0].tolist() == [1] * 128
    assert split_payload([16] * 128, 66) == 42
    assert max(_part_costs(ts, 66, [16] * 128)) == 42 == whole_request_capacity([16] * 128, 66, 42)


def test_few_requests_are_still_split():
    # 32 requests over 132 parts: a whole request (21) is twice a fair part (4 + 5).
    ts, rs = schedule_cpu(torch.full((32,), 1024, dtype=torch.int32), None, 1, 16, 132, 132)
    assert rs[:, 0].max() > 1
    assert whole_request_capacity([16] * 32, 132, split_payload([16] * 32, 132)) is None


def test_split_payload_is_the_smallest_that_fits():
    # 32 x 16 blocks over 132 parts: total 672, ceil(672 / 132) = 6. At 9 every request is cut into
    # four 4-block pieces (128 parts busy); at the upper end (11) the pieces had 6 blocks, 96 parts.
    ts, rs = schedule_cpu(torch.full((32,), 1024, dtype=torch.int32), None, 1, 16, 132, 132)
    assert split_payload([16] * 32, 132) == 9
    costs = _part_costs(ts, 132, [16] * 32)
    assert max(costs) == 9 and sum(c > 0 for c in costs) == 128 and rs[:, 0].tolist() == [4] * 32
    g = torch.Generator().manual_seed(1)
    searched = 0
    for _ in range(300):
        B = int(torch.randint(1, 300, (1,), generator=g))
        parts = int(torch.randint(1, 133, (1,), generator=g))
        lens = torch.randint(0, int(torch.randint(1, 20000, (1,), generator=g)), (B,), generator=g, dtype=torch.int32)
        n = [-(-l // BLOCK_N) for l in lens.tolist()]
        payload = split_payload(n, parts)
        base = -(-(sum(n) + FIXED_COST * B) // parts)
        assert base <= payload <= base + FIXED_COST
        ts, rs = schedule_cpu(lens, None, 1, 16, parts, 132)
        if rs[:, 0].max() > 1 and payload < base + FIXED_COST:
            # a searched cost fits: no part, the last included, costs more; one less would not fit
            searched += 1
            assert max(_part_costs(ts, parts, n)) <= payload
            if payload > max(base, MIN_SEARCHED_PIECE + FIXED_COST):
                assert not _split_walk_fits(n, parts, payload - 1)
    assert searched > 50, "the sample exercises the search"


def test_whole_request_partition_is_tight():
    g = torch.Generator().manual_seed(0)
    taken = 0
    for _ in range(400):
        B = int(torch.randint(1, 400, (1,), generator=g))
        parts = int(torch.randint(1, 133, (1,), generator=g))
        low = int(torch.randint(0, 10000, (1,), generator=g))  # ragged or nearly uniform batches
        high = low + int(torch.randint(1, 10000, (1,), generator=g)) // int(torch.randint(1, 100, (1,), generator=g))
        lens = torch.randint(low, high + 1, (B,), generator=g, dtype=torch.int32)
        n = [-(-l // BLOCK_N) for l in lens.tolist()]
        payload = split_payload(n, parts)
        capacity = whole_request_capacity(n, parts, payload)
        ts, rs = schedule_cpu(lens, None, 1, 16, parts, 132)
        if capacity is None:
            continue
        taken += 1
        assert rs[:, 0].tolist() == [1] * B, "no request is cut"
        costs = _part_costs(ts, parts, n)
        assert max(costs) <= capacity <= payload + NO_SPLIT_SLACK
        assert sum(costs) == sum(n) + FIXED_COST * B, "every request in exactly one part"
        # capacity is the smallest that fits: one less needs more parts.
        if capacity > max(max(n) + FIXED_COST, -(-sum(k + FIXED_COST for k in n) // parts)):
            assert whole_request_capacity(n, parts, capacity - 1 - NO_SPLIT_SLACK) is None
    assert taken > 20, "the sample exercises the rule"


def _chain_walk(num_blocks, parts, C, whole):
    """The device kernel's formulation of a walk (sched_meta.cu: walk_parts): a chain over request
    starts, where node r (a part starting at S_r) yields the next request start the walk lands on and
    the parts until then. Returns the first `parts` part starts (total past the last) and whether the
    walk took every request within them."""
    S = [0]
    for k in num_blocks:
        S.append(S[-1] + k + FIXED_COST)
    B, total, piece = len(num_blocks), S[-1], C - FIXED_COST

    def next_node(r):
        if whole:
            if S[r] + C >= total:
                return B, 1
            holder = max(b for b in range(B) if S[b] <= S[r] + C)
            return max(holder, r + 1), 1
        for e in range(r + 1, B):  # the first request start a cut lands within FIXED_COST before
            d = S[e] - S[r]
            j = max(1, -(-(d - FIXED_COST) // piece))
            if j * piece <= d - 1:
                return e, j
        return B, max(1, -(-(total - FIXED_COST - S[r]) // piece))

    starts, node, placed = [], 0, 0
    while node < B and placed < parts:
        nxt, count = next_node(node)
        starts += [S[node] + j * piece for j in range(count)]
        placed, node = placed + count, nxt
    return (starts + [total] * parts)[:parts], node == B and placed <= parts


def test_chain_walk_matches_the_contract():
    """The device scheduler walks chains over request starts; on random batches that formulation gives
    the contract's fits (every split candidate) and the chosen schedule's part starts."""
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        B = int(torch.randint(1, 40, (1,), generator=g))
        P = int(torch.randint(1, 70, (1,), generator=g))
        top = [8, 300, 5000][trial % 3]
        lens = torch.randint(0, top, (B,), generator=g, dtype=torch.int32)
        n = [-(-int(x) // BLOCK_N) for x in lens]
        base = -(-(sum(n) + B * FIXED_COST) // P)
        for C in range(max(FIXED_COST + 1, base), base + FIXED_COST + 1):
            assert _chain_walk(n, P, C, False)[1] == _split_walk_fits(n, P, C), (n, P, C)
        payload = split_payload(n, P)
        capacity = whole_request_capacity(n, P, payload)
        C, whole = (capacity, True) if capacity is not None else (payload, False)
        tile_sched, _ = schedule_cpu(lens, None, 1, 16, P, 132)
        S = [0]
        for k in n:
            S.append(S[-1] + k + FIXED_COST)
        expected = [S[r.first_request] + r.first_block if r.last_request >= r.first_request else S[-1]
                    for r in (ScheduleRow(*row) for row in tile_sched[:P].tolist())]
        assert _chain_walk(n, P, C, whole)[0] == expected, (n, P, C, whole)
