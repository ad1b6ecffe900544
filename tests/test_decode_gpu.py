"""mla_decode on the GPU against the float32 reference, on adversarial inputs (tests/cases.py):
NaN in every cache slot past each length and in unused pages, permuted block tables with huge and
negative ids in unused tails, zero-length requests, odd head counts, varlen causal queries."""
import itertools
import subprocess
import sys

import pytest
import torch
from cases import DECODE_CASES, make_decode_case
from conftest import (FP8, capture_decode_step, check_unit_scale, decode_case, decode_case_params,
                      decode_kernels_for, decode_reference, poisoned_past_lengths, run_decode, to_device)

import mla_attn
from mla_attn.metadata import DECODE_KERNELS, DecodeMetadata, ScheduleRow, device_num_sms, schedule_cpu

pytestmark = pytest.mark.gpu


def with_kernels(params, rows_of, cache_dtype=torch.bfloat16):
    """params extended by a kernel: None (the dispatch) and every kernel that runs rows_of(*param) rows."""
    return [(*p, k) for p in params for k in [None] + decode_kernels_for(cache_dtype, rows_of(*p))]




@pytest.mark.parametrize("lens,s_q,h_q,page_size,varlen,split_pe,kernel,dtype,causal",
                         decode_case_params(DECODE_CASES, torch.bfloat16))
def test_decode_matches_reference(lens, s_q, h_q, page_size, varlen, split_pe, kernel, dtype, causal):
    case = decode_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype)
    out, lse = run_decode(case, causal, _kernel=kernel)
    check_unit_scale(case, causal, out, lse)


@pytest.mark.parametrize("batch,kernel", with_kernels([(1,), (17,), (64,)], lambda batch: 32))
def test_ragged_batches(batch, kernel):
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(0, 3000, (batch,), generator=g).tolist()
    case = to_device(make_decode_case(lens, 2, 16, 16, seed=batch))
    out, lse = run_decode(case, True, _kernel=kernel)
    check_unit_scale(case, True, out, lse)


@pytest.mark.parametrize("kernel", [None] + decode_kernels_for(torch.bfloat16, 16))
def test_long_context(kernel):
    case = to_device(make_decode_case([40000, 33000], 1, 16, 64, kv_4d=True, seed=7))
    out, lse = run_decode(case, True, _kernel=kernel)
    check_unit_scale(case, True, out, lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q,kernel", with_kernels([(128, 1), (128, 2), (64, 1), (16, 1)], lambda h, s: h * s))
def test_scores_growing_along_the_context(h_q, s_q, kernel, dtype):
    """Keys scaled by a ramp from 0.1 to 8 along each request: the running row max moves by more
    than the kernels' slack (kMaxSlack, shared/online_softmax.cuh: O is rescaled) several times and by less
    (P above 1) in between."""
    lens, page = [5000, 2100], 64
    case = make_decode_case(lens, s_q, h_q, page, seed=11, dtype=dtype)
    for b, L in enumerate(lens):
        for j in range(-(-L // page)):
            t = torch.arange(j * page, (j + 1) * page, dtype=torch.float32)
            ramp = 0.1 * 80.0 ** (t / L)
            page_id = case["block_table"][b, j]
            case["kv_cache"][page_id] = (case["kv_cache"][page_id].float() * ramp[:, None]).to(dtype)
    case = to_device(case)
    out, lse = run_decode(case, s_q > 1, _kernel=kernel)
    check_unit_scale(case, s_q > 1, out, lse)


@pytest.mark.parametrize("batch", [4, 64])
@pytest.mark.parametrize("h_q,s_q,page_size,causal,kernel",
                         with_kernels([(128, 1, 64, True), (128, 2, 16, True), (128, 4, 64, False), (80, 2, 32, True)],
                                      lambda h, s, *_: h * s))
def test_long_segments(h_q, s_q, page_size, causal, kernel, batch):
    """Schedules of 1, 3 and 5 parts, so that segments run 32+ blocks, with split points at either
    parity of the block index. Batch 64 (60 empty requests): 128+ q-tiles of work, the seesaw kernel
    with the steady loop (decode_api.cpp: kSteadyMinQTiles) and its hand-over to the general loop at
    masked, tail and last pairs; batch 4: the kernel without it."""
    lens = [6000, 4099, 2112, 3333] + [0] * (batch - 4)
    case = to_device(make_decode_case(lens, s_q, h_q, page_size, seed=h_q + s_q + page_size))
    num_sms = device_num_sms("cuda")
    for parts in (1, 3, 5):
        tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(
            case["cache_seqlens"], None, s_q, h_q, causal, parts, num_sms)
        md = DecodeMetadata(tile_sched, req_splits, parts, s_q, h_q, causal)
        out, lse = run_decode(case, causal, metadata=md, _kernel=kernel)
        check_unit_scale(case, causal, out, lse)


@pytest.mark.parametrize("h_q,s_q,kernel", with_kernels([(128, 1), (16, 2), (64, 4)], lambda h, s: h * s))
def test_flashmla_tolerances(h_q, s_q, kernel):
    """FlashMLA-style data (randn/10 clamped to +-1) under FlashMLA's own tolerances."""
    case = to_device(make_decode_case([4096, 1000, 77], s_q, h_q, 64, seed=h_q + s_q))
    case["kv_cache"] = (case["kv_cache"].float() / 10).clamp(-1, 1).to(torch.bfloat16)  # NaN stays NaN
    case["q"] = (case["q"].float() / 10).clamp(-1, 1).to(torch.bfloat16)
    out, lse = run_decode(case, True, _kernel=kernel)
    ref_out, ref_lse = decode_reference(case, True)
    o, r = out.float(), ref_out
    ok = ((o - r).abs() <= 8e-4) | ((o - r).abs() <= 2.01 / 128 * r.abs())
    assert ok.all(), f"{(~ok).sum().item()} elements out of tolerance"
    cos_diff = 1 - 2 * (o.double() * r.double()).sum() / ((o.double() ** 2).sum() + (r.double() ** 2).sum())
    assert cos_diff <= 5e-6, f"cosine distance {cos_diff.item():.2e}"
    okl = ((lse - ref_lse).abs() <= 1e-6) | ((lse - ref_lse).abs() <= 8.01 / 65536 * ref_lse.abs())
    assert okl.all(), f"lse max err {(lse - ref_lse).abs().max().item():.3e}"


# 128: Q tiles by TMA (seesaw kernel), through the strided view
@pytest.mark.parametrize("h_q,kernel", with_kernels([(16,), (128,)], lambda h: 2 * h))
def test_out_given_and_strided_q(h_q, kernel):
    case = to_device(make_decode_case([1023, 77], 2, h_q, 64, seed=3))
    big = torch.randn(2, 2, h_q, 640, device="cuda", dtype=torch.bfloat16)  # padded rows: strided q
    big[..., :576] = case["q"]
    case["q"] = big[..., :576]
    out = torch.full((2, 2, h_q, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    got, lse = run_decode(case, True, out=out, _kernel=kernel)
    assert got.data_ptr() == out.data_ptr()
    check_unit_scale(case, True, out, lse)


# out whose rows are not back to back (a view of wider rows): every kernel stores through out's strides
# and leaves the columns past 512 alone.
@pytest.mark.parametrize("h_q,kernel", with_kernels([(16,), (128,)], lambda h: 2 * h))
def test_out_rows_strided(h_q, kernel):
    case = to_device(make_decode_case([1023, 77], 2, h_q, 64, seed=4))
    wide = torch.full((2, 2, h_q, 544), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = wide[..., :512]
    got, lse = run_decode(case, True, out=out, _kernel=kernel)
    assert got.data_ptr() == out.data_ptr()
    check_unit_scale(case, True, out, lse)
    assert wide[..., 512:].isnan().all(), "a store reached past a row's 512 columns"


@pytest.mark.parametrize("kernel", [None] + decode_kernels_for(torch.bfloat16, 128))
def test_q_broadcast_over_batch(kernel):
    # One query for every request (batch stride 0): at h_q 128 the seesaw kernel's Q maps refuse a
    # broadcast dimension, and the cp.async load reads the shared rows.
    case = to_device(make_decode_case([300, 1000, 64], 1, 128, 64, seed=5))
    case["q"] = case["q"][:1].expand(3, -1, -1, -1)
    out, lse = run_decode(case, True, _kernel=kernel)
    check_unit_scale(case, True, out, lse)


def _flashmla_cos_diff(out, ref):
    """FlashMLA's cosine difference (tests/kernelkit/compare.py): 1 - 2<a, b> / (|a|^2 + |b|^2), float64."""
    a, b = out.double(), ref.double()
    return 1 - 2 * (a * b).sum().item() / (a * a + b * b).sum().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_flashmla_accuracy_bar_many_splits(dtype, seed):
    """FlashMLA's dense-decoding bar (out: every element within 8e-4 or 2/128 relative, cosine
    difference < 5e-6, against a float32 reference rounded to q's dtype; lse within 8/65536 relative)
    where 16-bit partials broke it: one request of one query row and 4096 keys, split into ~64 parts,
    q and cache ~ N(0, 0.01) clamped (nearly uniform attention: each split's output is ~8x the final
    one, so a partial's rounding counts 8x). Its data recipe, on paged, NaN-poisoned storage."""
    g = torch.Generator().manual_seed(seed)
    L, page = 4096, 64
    q = (torch.randn(1, 1, 1, 576, generator=g) / 10).clamp(-1, 1).to(dtype)
    pages = L // page + 2
    kv = (torch.randn(pages, page, 576, generator=g) / 10).clamp(-1, 1).to(dtype)
    table = torch.randperm(pages, generator=g)[: L // page].int()[None]
    kv[~torch.isin(torch.arange(pages), table.long())] = float("nan")
    lens = torch.tensor([L], dtype=torch.int32)
    scale = 576**-0.5
    k = kv[table[0].long()].reshape(L, 576).float()
    scores = (q.reshape(1, 576).float() @ k.T) * scale
    ref, ref_lse = (torch.softmax(scores, dim=-1) @ k[:, :512]).to(dtype), torch.logsumexp(scores, dim=-1)
    md = mla_attn.get_decode_metadata(lens.cuda(), 1, s_q=1, causal=False)
    assert md.req_splits[0, 0].item() > 32, "the case must split the request into many parts"
    out, lse = mla_attn.mla_decode(q.cuda(), kv.cuda(), table.cuda(), lens.cuda(), softmax_scale=scale, causal=False,
                                   metadata=md, return_lse=True)
    out, lse = out.cpu().reshape(1, 512), lse.cpu().reshape(1)
    err = (out.float() - ref.float()).abs()
    assert ((err < 8e-4) | (err / (ref.float().abs() + 1e-6) < 2.01 / 128)).all()
    assert _flashmla_cos_diff(out, ref) < 5e-6
    lse_err = (lse - ref_lse).abs()
    assert ((lse_err <= 1e-6) | (lse_err <= 8.01 / 65536 * ref_lse.abs())).all(), f"lse err {lse_err.max():.3e}"


@pytest.mark.parametrize("lens,s_q,h_q", [([3000, 0, 77, 1024], 1, 16), ([5000, 129, 0], 2, 128), ([40000], 1, 128),
                                          ([700] * 300, 1, 64)])
def test_decode_op_attn_sink_every_kernel(lens, s_q, h_q):
    """attn_sink through the decode op on paged caches read by TMA, every kernel that runs the case, split
    requests (batch 1, long: the combine) and whole ones (batch 300: the split kernels' epilogues): the
    output is the output without a sink times exp(lse) / (exp(lse) + exp(sink)), lse is unchanged and
    a request without keys stays 0. Outputs NaN-poisoned before each call."""
    c = dict(to_device(make_decode_case(lens, s_q, h_q, 64, seed=11)), references={})  # the reference once
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], h_q, s_q=s_q)
    args = (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], None, s_q, c["softmax_scale"],
            False, md.tile_sched, md.req_splits, md.num_sm_parts)
    sink = torch.linspace(-4.0, 12.0, h_q, device="cuda")
    sink[0], sink[-1] = float("inf"), -float("inf")
    for kernel in decode_kernels_for(torch.bfloat16, s_q * h_q):
        outs = []
        for attn_sink in (None, sink):
            out = torch.full(c["q"].shape[:-1] + (512,), float("nan"), dtype=c["q"].dtype, device="cuda")
            lse = torch.full(c["q"].shape[:-1], float("nan"), device="cuda")
            torch.ops.mla_attn.mla_decode_out(*args, out, lse, split_kernel=kernel, attn_sink=attn_sink)
            outs.append((out, lse))
        (out, lse), (got, got_lse) = outs
        check_unit_scale(c, False, out, lse)  # the output the sink's is derived from
        assert torch.equal(got_lse, lse), kernel
        assert not got[..., 0, :].any() and torch.equal(got[..., -1, :], out[..., -1, :]), kernel
        keys = torch.isfinite(lse)
        factor = torch.where(keys, 1.0 / (1.0 + torch.exp(sink - lse.masked_fill(~keys, 0.0))), 0.0)
        want = out.float() * factor[..., None]
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert torch.isfinite(got).all() and rel < 5e-3, (kernel, rel)
        assert not got[~keys].any(), kernel


@pytest.mark.parametrize("lens,s_q,h_q", [([3000, 0, 77, 1024], 1, 16), ([5000, 129, 0], 2, 128), ([700] * 300, 1, 64)])
def test_decode_out_without_lse_every_kernel(lens, s_q, h_q):
    """mla_decode_out with lse=None (the op keeps the LSE to itself) writes the out it writes with an lse,
    bit for bit, for every kernel that runs the case, split requests and whole ones; so does mla_decode's
    out= without return_lse, which passes None. Outputs NaN-poisoned before each call."""
    c = dict(to_device(make_decode_case(lens, s_q, h_q, 64, seed=12)), references={})  # the reference once
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], h_q, s_q=s_q)
    args = (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], None, s_q, c["softmax_scale"],
            True, md.tile_sched, md.req_splits, md.num_sm_parts)
    poisoned = lambda: torch.full(c["q"].shape[:-1] + (512,), float("nan"), dtype=c["q"].dtype, device="cuda")
    for kernel in decode_kernels_for(torch.bfloat16, s_q * h_q):
        out, got = poisoned(), poisoned()
        lse = torch.full(c["q"].shape[:-1], float("nan"), device="cuda")
        torch.ops.mla_attn.mla_decode_out(*args, out, lse, split_kernel=kernel)
        torch.ops.mla_attn.mla_decode_out(*args, got, None, split_kernel=kernel)
        check_unit_scale(c, True, out, lse)
        assert torch.isfinite(out).all() and torch.equal(got, out), kernel
    want, want_lse = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], q_pe=c["q_pe"],
                                         softmax_scale=c["softmax_scale"], metadata=md, return_lse=True)
    for return_lse in (False, True):  # None to the op; an lse from the wrapper
        got = poisoned()
        result = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], q_pe=c["q_pe"],
                                     softmax_scale=c["softmax_scale"], metadata=md, out=got, return_lse=return_lse)
        assert (result[0] if return_lse else result) is got and torch.equal(got, want)
        assert not return_lse or torch.equal(result[1], want_lse)


def test_mla_decode_attn_sink_is_the_ops():
    c = to_device(make_decode_case([300, 5, 2000], 2, 16, 64, seed=5))
    sink = torch.linspace(-2.0, 10.0, 16, device="cuda")
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], 16, s_q=2)
    got = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], q_pe=c["q_pe"],
                              softmax_scale=c["softmax_scale"], metadata=md, attn_sink=sink, return_lse=True)
    want = torch.ops.mla_attn.mla_decode(c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], None,
                                         2, c["softmax_scale"], True, md.tile_sched, md.req_splits, md.num_sm_parts,
                                         attn_sink=sink)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_metadata_matches_cpu_schedule():
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randint(0, 20000, (batch,), generator=g, dtype=torch.int32), h_q, s_q)
             for batch, h_q, s_q in [(1, 128, 1), (37, 16, 2), (128, 128, 1), (5, 8, 64)]]
    # Batches that take the whole-request partition (metadata.py: whole_request_capacity).
    cases += [(torch.full((128,), 1024, dtype=torch.int32), 128, 1),
              (torch.randint(900, 1100, (264,), generator=g, dtype=torch.int32), 16, 1),
              (torch.randint(900, 1100, (300,), generator=g, dtype=torch.int32), 16, 1)]
    for (lens, h_q, s_q), det in itertools.product(cases, (False, True)):
        md = mla_attn.get_decode_metadata(lens.cuda(), h_q, s_q=s_q, causal=True, deterministic=det)
        tile_cpu, splits_cpu = schedule_cpu(lens, None, s_q, h_q, md.num_sm_parts, md.tile_sched.shape[0], det)
        assert torch.equal(md.tile_sched.cpu(), tile_cpu)
        assert torch.equal(md.req_splits.cpu(), splits_cpu)



def test_metadata_matches_cpu_schedule_extremes():
    """The device scheduler against the CPU twin at part counts 1..num_sms, lengths at the 64-key
    block edges and up to INT32_MAX (costs past 2^31, one long request among short ones), total costs
    on either side of the bound below which the walks run in 32 bits (sched_meta.cu: kMaxNarrowTotal),
    and batches whose prefix sums need more than 48 KiB of shared memory (12000) or live in req_splits
    (50000); negative lengths; up to 1024 parts."""
    g = torch.Generator().manual_seed(3)
    num_sms = device_num_sms("cuda")
    edges = torch.tensor([0, 1, 63, 64, 65, 2**31 - 65, 2**31 - 64, 2**31 - 1], dtype=torch.int32)
    one_long = torch.randint(0, 300, (127,), generator=g, dtype=torch.int32)
    one_long[5] = 10**7
    cases = [(torch.zeros(0, dtype=torch.int32), (1, num_sms)),
             (edges[torch.randint(0, 8, (128,), generator=g)], (1, 2, 3, 66, num_sms)),
             (torch.full((2,), 2**31 - 1, dtype=torch.int32), (1, 2, num_sms)),
             (one_long, (1, 7, 64, num_sms)),
             (torch.full((1000,), 4096, dtype=torch.int32), (1, 100, num_sms)),
             (torch.randint(0, 9000, (12000,), generator=g, dtype=torch.int32), (1, num_sms)),
             (torch.randint(0, 9000, (50000,), generator=g, dtype=torch.int32), (2, num_sms))]
    cases += [(torch.randint(0, 20000, (batch,), generator=g, dtype=torch.int32), range(1, num_sms + 1))
              for batch in (1, 33)]
    narrow_total = (2**31 - 1) // (1024 + 64)  # requests cost their blocks + 5
    half = (narrow_total - 10) // 2
    cases += [(torch.tensor([64 * half, 64 * (narrow_total - 10 - half) + extra], dtype=torch.int32), (1, 2, 66, num_sms))
              for extra in (0, 1)]
    # Short requests (a split walk meets a request start every few parts) and a mixed batch of 128;
    # uniform batches, where a walk lands on a request start every part, every few requests or
    # hardly ever (sparse decode's one-token rows of 2048 keys among them).
    cases += [(torch.randint(0, 200, (300,), generator=g, dtype=torch.int32), range(1, num_sms + 1, 7)),
              (torch.randint(0, 5000, (128,), generator=g, dtype=torch.int32), range(1, num_sms + 1, 5))]
    cases += [(torch.full((batch,), length, dtype=torch.int32), range(1, num_sms + 1, 3))
              for batch, length in ((128, 1024), (128, 2048), (256, 2048), (128, 16384), (700, 64))]
    # Negative lengths (no keys; value checks are off on the GPU by default).
    cases += [(torch.tensor([-5, 100, -2**31, 0, 3000], dtype=torch.int32), (1, 2, num_sms))]
    # More parts than this GPU's SMs, up to the bound (kMaxSmParts): the part scan in chunks of 512 threads.
    wide = [(lens, parts, 1024) for lens, parts in
            ((torch.randint(0, 20000, (300,), generator=g, dtype=torch.int32), (513, 1024)),
             (torch.randint(0, 20000, (2000,), generator=g, dtype=torch.int32), (1, 600, 1024)))]
    for (lens, parts_list, sms), det in itertools.product([c + (num_sms,) for c in cases] + wide, (False, True)):
        for parts in parts_list:
            tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(lens.cuda(), None, 1, 16, True, parts,
                                                                            sms, deterministic=det)
            tile_cpu, splits_cpu = schedule_cpu(lens, None, 1, 16, parts, sms, det)
            assert torch.equal(tile_sched.cpu(), tile_cpu), (len(lens), parts, sms, det)
            assert torch.equal(req_splits.cpu(), splits_cpu), (len(lens), parts, sms, det)


def _part_blocks_at_least(tile_sched, parts):
    """Each part's KV blocks as rows64_seesaw's CTAs count them (schedule.cuh: blocks_at_least)."""
    counts = []
    for p in range(parts):
        r = ScheduleRow(*tile_sched[p].tolist())
        if r.last_request < r.first_request:
            counts.append(0)
        elif r.last_request == r.first_request:
            counts.append(r.last_end_block - r.first_block)
        else:
            counts.append(-(-r.first_seqlen // 64) - r.first_block + r.last_end_block)
    return counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows64_seesaw_runs_each_body_by_part(dtype):
    """rows64_seesaw chooses per CTA: parts of 96 KV blocks or more (config.h: kLongPartBlocks) run the
    seesaw kernel, shorter ones the 64-row kernel. h_q 32, s_q 2 (one q-tile), causal and not, against
    the reference: whole requests over 5 parts (both bodies in one launch); three requests over 3 parts,
    the middle part short by its count (its first and last pieces) so that requests 0 and 2 are each
    split between a seesaw part and a 64-row part, whose partials the combine merges; 9 short parts."""
    num_sms = device_num_sms("cuda")
    for lens, parts, det, kinds in (([13000, 300, 7000, 64, 9000, 1, 2500], 5, True, [True, False, True, False, True]),
                                    ([20000, 12000, 20000], 3, False, [True, False, True]),
                                    ([13000, 300, 7000, 64, 9000, 1, 2500], 9, False, [False] * 9)):
        c = to_device(make_decode_case(lens, 2, 32, 64, dtype=dtype, seed=21))
        tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(c["cache_seqlens"], None, 2, 32, True, parts,
                                                                        num_sms, deterministic=det)
        assert [n >= 96 for n in _part_blocks_at_least(tile_sched.cpu(), parts)] == kinds
        assert det or (req_splits[:, 0] > 1).any()
        for causal in (True, False):
            md = DecodeMetadata(tile_sched, req_splits, parts, 2, 32, causal)
            out, lse = run_decode(c, causal, metadata=md, _kernel="rows64_seesaw")
            check_unit_scale(c, causal, out, lse)


def test_metadata_matches_cpu_schedule_random_batches():
    """The device scheduler against the CPU twin on random batches: lengths drawn per batch from a
    mixture (short, uniform, long, one dominant request, many empty), batches up to 1100 requests,
    random part counts, both modes."""
    g = torch.Generator().manual_seed(11)
    num_sms = device_num_sms("cuda")

    def draw(n, kind):
        if kind == 0:  # short: a walk meets a request start every part
            return torch.randint(0, 400, (n,), generator=g)
        if kind == 1:  # wide
            return torch.randint(1, 20000, (n,), generator=g)
        if kind == 2:  # near-uniform: catches hardly ever or every few requests
            base = int(torch.randint(64, 70000, (1,), generator=g))
            return base + torch.randint(-64, 65, (n,), generator=g)
        if kind == 3:  # one dominant request
            lens = torch.randint(0, 3000, (n,), generator=g)
            lens[int(torch.randint(0, n, (1,), generator=g))] = 2_000_000
            return lens
        return torch.randint(0, 2, (n,), generator=g) * torch.randint(0, 9000, (n,), generator=g)  # half empty

    for i in range(240):
        n = int(torch.randint(1, 1100, (1,), generator=g)) if i % 3 else int(torch.randint(1, 300, (1,), generator=g))
        lens = draw(n, i % 5).clamp(0, 2**31 - 1).to(torch.int32)
        parts = int(torch.randint(1, num_sms + 1, (1,), generator=g)) if i % 2 else num_sms
        det = i % 4 == 3
        tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(lens.cuda(), None, 1, 16, True, parts, num_sms,
                                                                        deterministic=det)
        tile_cpu, splits_cpu = schedule_cpu(lens, None, 1, 16, parts, num_sms, det)
        assert torch.equal(tile_sched.cpu(), tile_cpu), (i, n, parts, det)
        assert torch.equal(req_splits.cpu(), splits_cpu), (i, n, parts, det)


# Run in a fresh process: a launch earlier in the process that raised the kernel's shared-memory limit
# would hide a call that needs the raise (the limit counts static shared memory as well).
_FRESH_METADATA_SWEEP = """
import torch, mla_attn
from mla_attn.metadata import device_num_sms, schedule_cpu
num_sms = device_num_sms("cuda")
for parts in (num_sms, 1):
    for i, batch in enumerate(range(3500, 7000, 3)):  # the prefix sums cross 48 KiB of shared memory in here
        lens = torch.full((batch,), 2048, dtype=torch.int32)
        tile, splits = torch.ops.mla_attn.get_decode_metadata(lens.cuda(), None, 1, 64, False, parts, num_sms)
        if i % 4 == 0:  # every 12th batch against the CPU twin
            tile_cpu, splits_cpu = schedule_cpu(lens, None, 1, 64, parts, num_sms, False)
            assert torch.equal(tile.cpu(), tile_cpu) and torch.equal(splits.cpu(), splits_cpu), (parts, batch)
torch.cuda.synchronize()
print("ok")
"""


def test_metadata_shared_memory_limit_in_fresh_process():
    r = subprocess.run([sys.executable, "-c", _FRESH_METADATA_SWEEP], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_more_requests_than_part_boundaries():
    # h_q 128, s_q 4: 8 q-tiles, 16 parts; 24 requests, 11 of them split. The combine kernel's grid
    # then covers the scheduler's split list (tile_sched column 6) instead of the batch.
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 3000, (24,), generator=g, dtype=torch.int32)
    lens[3] = 9000
    case = to_device(make_decode_case(lens.tolist(), 4, 128, 64, seed=13))
    md = mla_attn.get_decode_metadata(case["cache_seqlens"], 128, s_q=4, causal=True)
    num_splits = md.req_splits[:, 0].cpu()
    assert md.num_sm_parts - 1 < 24 and (num_splits > 1).sum() > 1
    out, lse = run_decode(case, True, metadata=md)
    check_unit_scale(case, True, out, lse)


@pytest.mark.parametrize("lens", [[1024] * 128, [3000, 200, 5000, 64, 1, 777, 4099, 1500, 9000, 20] * 3])
def test_next_kernel_sees_the_output(lens):
    # Combine CTAs with nothing to merge exit without waiting for the split kernel (programmatic
    # dependent launch); the next kernel in the stream must still see every output row. 128 equal
    # requests are not split at all (no combine CTA waits); the ragged batch splits some.
    case = to_device(make_decode_case(lens, 1, 128, 64, seed=23))
    md = mla_attn.get_decode_metadata(case["cache_seqlens"], 128, s_q=1, causal=True)
    out = torch.empty(len(lens), 1, 128, 512, device="cuda", dtype=case["q"].dtype)
    ref, _ = run_decode(case, True, metadata=md, out=out)
    ref = ref.clone()
    torch.cuda.synchronize()
    mismatches = []
    for _ in range(30):
        out.fill_(float("nan"))
        run_decode(case, True, metadata=md, out=out)
        mismatches.append((out != ref).any())  # same stream, no host sync in between
    assert not torch.stack(mismatches).any()


def test_two_runs_bit_identical():
    case = to_device(make_decode_case([5000, 3000, 20], 2, 64, 32, seed=11))
    a = run_decode(case, True)
    b = run_decode(case, True, out=torch.full_like(a[0], float("nan")))  # a run that writes nothing shows
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cuda_graph_replay_with_new_lengths():
    case = to_device(make_decode_case([3000, 2000, 1000, 100], 1, 16, 64, seed=5))
    lens = case["cache_seqlens"]
    out = torch.empty(4, 1, 16, 512, device="cuda", dtype=torch.bfloat16)
    graph, lse = capture_decode_step(case, out)
    written = case["kv_cache"].clone()
    for new in ([100, 2000, 999, 1], [0, 64, 65, 99]):  # never longer than the pages allocated
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        case["kv_cache"].copy_(poisoned_past_lengths(written, case["block_table"], new))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_unit_scale(case, True, out, lse)


INELIGIBLE = [(dtype, s_q, h_q, kernel) for dtype in (torch.bfloat16, FP8) for s_q, h_q in ((1, 16), (2, 16), (1, 128))
              for kernel in DECODE_KERNELS if kernel not in decode_kernels_for(dtype, s_q * h_q)]


@pytest.mark.parametrize("cache_dtype,s_q,h_q,kernel", INELIGIBLE + [(torch.bfloat16, 1, 16, "narrow64"),
                                                                    (FP8, 1, 16, "")])
def test_kernel_that_cannot_run_the_call_raises(cache_dtype, s_q, h_q, kernel):
    """Through the wrapper (its own check) and straight through the op (decode_api.cpp's)."""
    case = decode_case([300, 20], s_q, h_q, 64, False, False, torch.bfloat16, fp8=cache_dtype == FP8)
    with pytest.raises(ValueError, match=repr(kernel)):
        run_decode(case, True, _kernel=kernel)
    md = mla_attn.get_decode_metadata(case["cache_seqlens"], h_q, s_q=s_q)
    with pytest.raises(ValueError, match=f"decode kernel {kernel!r}"):
        torch.ops.mla_attn.mla_decode(case["q"], None, case["kv_cache"], case["block_table"], case["cache_seqlens"],
                                      None, s_q, case["softmax_scale"], True, md.tile_sched, md.req_splits,
                                      md.num_sm_parts, k_scale=case.get("k_scale"), split_kernel=kernel)
