"""What the kernels do with the values only validation checks (validate=False, the GPU default):
lengths past the block table and out-of-range cu_seqlens give wrong rows at worst, never an access
outside the tensors, a hang or a lost CUDA context."""
import pytest
import torch
from cases import make_decode_case, make_overlong_decode_case, make_prefill_case, scramble_cu_seqlens
from conftest import FP8, check_decode, check_unit_scale, decode_kernels_for, run_decode, to_device
from fp8_cases import to_fp8_case

import mla_attn
from mla_attn.metadata import SCHEDULE_COLUMN


pytestmark = pytest.mark.gpu

GUARD = 4  # rows of sentinel on either side of an output


def guarded(shape, dtype, fill):
    """A tensor of `shape` inside a buffer with GUARD sentinel rows before and after it."""
    buf = torch.full((shape[0] + 2 * GUARD, *shape[1:]), fill, dtype=dtype, device="cuda")
    return buf, buf[GUARD:-GUARD]


def assert_guards_intact(buf, fill):
    assert (buf[:GUARD] == fill).all() and (buf[-GUARD:] == fill).all(), "a kernel wrote outside its output"


OVERLONG = [(torch.bfloat16, 1, 16, 64), (torch.bfloat16, 2, 128, 64), (torch.bfloat16, 1, 128, 16),
            (FP8, 1, 16, 64), (FP8, 2, 16, 64), (FP8, 1, 128, 64), (torch.bfloat16, 1, 16, 24)]


@pytest.mark.parametrize("cache_dtype,s_q,h_q,page_size,kernel",
                         [(*c, k) for c in OVERLONG for k in decode_kernels_for(c[0], c[1] * c[2])])
def test_lengths_past_the_block_table(cache_dtype, s_q, h_q, page_size, kernel):
    """Every kernel attends to what the table holds (the reference at the clamped lengths), including
    the seesaw kernels that zero a tail block's rows from its key count and a length of INT32_MAX
    (whose schedule spreads ~2^25 blocks over the parts: all but the first few pieces must be empty)."""
    overlong, clamped = make_overlong_decode_case(s_q, h_q, page_size, seed=h_q + s_q)
    if cache_dtype == FP8:
        overlong = to_fp8_case(overlong)
        clamped = {**clamped, "kv_cache": overlong["kv_cache"], "k_scale": overlong["k_scale"]}
    overlong, clamped = to_device(overlong), to_device(clamped)
    out, lse = run_decode(overlong, True, validate=False, _kernel=kernel)
    torch.cuda.synchronize()
    check_decode(clamped, True, out, lse, kernel)


@pytest.mark.parametrize("cache_dtype,h_q,kernel", [(d, h, k) for d in (torch.bfloat16, FP8) for h in (16, 128)
                                                   for k in decode_kernels_for(d, h)])
def test_decode_with_a_schedule_for_longer_lengths(cache_dtype, h_q, kernel):
    """Metadata reused after the lengths shrank (a caller's bug: it must be made again): a part that
    starts in one request and ends in a later one then ends at a block past the later one's keys. Wrong
    numbers, but no kernel walks blocks without keys (the seesaw kernels zeroed a tail block's rows from
    a negative key count, outside their tile) or writes outside out, and the context survives: the same
    call with a fresh schedule is then right."""
    g = torch.Generator().manual_seed(h_q)
    lens = torch.randint(200, 3001, (64,), generator=g).tolist()
    c = make_decode_case(lens, 1, h_q, 64, seed=5)
    if cache_dtype == FP8:
        c = to_fp8_case(c)
    c = to_device(c)
    stale = mla_attn.get_decode_metadata(c["cache_seqlens"], h_q, s_q=1)
    rows = stale.tile_sched[:stale.num_sm_parts].cpu()
    col = SCHEDULE_COLUMN
    crossing = (rows[:, col.last_request] > rows[:, col.first_request]) & (rows[:, col.last_end_block] > 2)
    assert crossing.any(), "the case must have a part that ends past the shrunk lengths in a later request"
    shrunk = {**c, "cache_seqlens": torch.full_like(c["cache_seqlens"], 70)}
    out_buf, out = guarded(c["q"].shape[:-1] + (512,), c["q"].dtype, 3.0)
    run_decode(shrunk, True, metadata=stale, out=out, _kernel=kernel)
    torch.cuda.synchronize()
    assert_guards_intact(out_buf, 3.0)
    out, lse = run_decode(shrunk, True, _kernel=kernel)
    check_decode(shrunk, True, out, lse, kernel)


@pytest.mark.parametrize("parts", [1, 2, 33])
@pytest.mark.parametrize("h_q,kernel", [(h, k) for h in (16, 128) for k in decode_kernels_for(torch.bfloat16, h)])
def test_decode_op_with_fewer_parts_than_its_schedule(h_q, kernel, parts):
    """torch.ops.mla_attn.mla_decode given a num_sm_parts below the schedule's (a caller's bug): the op
    allocates 2 (parts - 1) workspace slots, fewer than the schedule's split requests use. Wrong
    numbers, but no access outside the workspace (none at all with one part), and the context
    survives: the call with its own num_sm_parts is then right."""
    c = to_device(make_decode_case([3200, 3200, 40000], 1, h_q, 64, seed=9))
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], h_q, s_q=1)
    assert md.num_sm_parts > parts and (md.req_splits[:, 0] > 1).any()
    args = (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], None, 1, c["softmax_scale"],
            True, md.tile_sched, md.req_splits)
    torch.ops.mla_attn.mla_decode(*args, parts, split_kernel=kernel)
    torch.cuda.synchronize()
    out, lse = torch.ops.mla_attn.mla_decode(*args, md.num_sm_parts, split_kernel=kernel)
    check_decode(c, True, out, lse, kernel)


@pytest.mark.parametrize("h_q,kernel", [(h, k) for h in (16, 128) for k in decode_kernels_for(torch.bfloat16, h)])
def test_decode_op_with_a_larger_batchs_tile_sched(h_q, kernel):
    """torch.ops.mla_attn.mla_decode given the tile_sched of a larger batch beside its own req_splits (a
    caller's bug no shape shows: tile_sched is [num_sms, 8] for any batch): parts that name requests past
    the batch read none of them, and the context survives."""
    lens = [3200, 3200, 40000]
    c = to_device(make_decode_case(lens, 1, h_q, 64, seed=9))
    larger = mla_attn.get_decode_metadata(torch.tensor(lens + [9000] * 3, dtype=torch.int32, device="cuda"), h_q, s_q=1)
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], h_q, s_q=1)
    assert (larger.tile_sched[:larger.num_sm_parts, SCHEDULE_COLUMN.last_request] >= len(lens)).any()
    args = (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], None, 1, c["softmax_scale"], True)
    torch.ops.mla_attn.mla_decode(*args, larger.tile_sched, md.req_splits, larger.num_sm_parts, split_kernel=kernel)
    torch.cuda.synchronize()
    out, lse = torch.ops.mla_attn.mla_decode(*args, md.tile_sched, md.req_splits, md.num_sm_parts, split_kernel=kernel)
    check_decode(c, True, out, lse, kernel)


@pytest.mark.parametrize("h_q,s_q,kernel", [(h, s, k) for h, s in [(16, 1), (8, 4), (128, 2)]
                                             for k in decode_kernels_for(torch.bfloat16, h * s)])
def test_decode_cu_seqlens_q_out_of_range(h_q, s_q, kernel):
    """Spans past q's tokens, negative, decreasing, longer than max_seqlen_q: the kernels write only
    inside out and lse (the sentinels around them stay), and the context survives (the same call with the right
    offsets is then correct)."""
    c = to_device(make_decode_case([300, 70, 0, 129, 64, 5], s_q, h_q, 64, varlen=True, seed=3))
    total = c["q"].shape[0]
    bad = scramble_cu_seqlens(c["cu_seqlens_q"], total)
    out_buf, out = guarded((total, h_q, 512), c["q"].dtype, 3.0)
    lse_buf, lse = guarded((total, h_q), torch.float32, 3.0)
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], h_q, cu_seqlens_q=bad, max_seqlen_q=s_q)
    torch.ops.mla_attn.mla_decode_out(c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], bad,
                                      s_q, c["softmax_scale"], True, md.tile_sched, md.req_splits, md.num_sm_parts,
                                      out, lse, split_kernel=kernel)
    torch.cuda.synchronize()
    assert_guards_intact(out_buf, 3.0)
    assert_guards_intact(lse_buf, 3.0)
    out, lse = run_decode(c, True, _kernel=kernel)
    check_unit_scale(c, True, out, lse)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_cu_seqlens_out_of_range(causal):
    c = to_device(make_prefill_case([200, 5, 64, 90, 30, 7], [300, 0, 64, 128, 31, 9], 2))
    t_q = c["q"].shape[0]
    bad_q = scramble_cu_seqlens(c["cu_seqlens_q"], t_q)
    bad_k = scramble_cu_seqlens(c["cu_seqlens_k"], c["k"].shape[0])
    out_buf, out = guarded((t_q, 2, 128), c["q"].dtype, 3.0)
    lse_buf, lse = guarded((t_q, 2), torch.float32, 3.0)
    torch.ops.mla_attn.mla_prefill_out(c["q"], c["k"], c["v"], bad_q, bad_k, c["max_seqlen_q"], c["max_seqlen_k"],
                                       c["softmax_scale"], causal, out, lse)
    torch.cuda.synchronize()
    assert_guards_intact(out_buf, 3.0)
    assert_guards_intact(lse_buf, 3.0)
