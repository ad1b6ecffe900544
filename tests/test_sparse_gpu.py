"""Sparse (top-k) attention on the GPU against the float64 reference, on adversarial cases
(tests/sparse_cases.py: NaN in every cache slot no valid index names, -1 / out-of-range / repeated
indices, topk_length 0..topk, sinks finite and infinite), every eligible decode kernel, outputs poisoned
before each run; the compaction kernel against the CPU op; CUDA graphs, torch.compile, opcheck."""
import functools

import pytest
import torch
from cases import to_device
from conftest import FP8MMA_LSE_ABS, FP8MMA_REL_L2, FP8MMA_ROW_REL, decode_kernels_for, leave_nan_blocks
from sparse_cases import FP8, check_sparse, make_sparse_case, run_sparse, sparse_reference, valid_first

import mla_attn

pytestmark = pytest.mark.gpu


@functools.lru_cache(maxsize=2)
def _shared_case(*key):
    lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, fp8 = key
    case = make_sparse_case(lead, h_q, topk, page_size, dtype=dtype, lengths=lengths, sink=sink, split_pe=split_pe,
                            kv_4d=kv_4d, fp8=fp8, seed=sum(lead) * 7 + h_q + topk)
    return to_device(case, "cuda")


def sparse_case(*key):
    """make_sparse_case on the GPU; consecutive tests of one case share its tensors (never modified)."""
    return dict(_shared_case(*key))


def poisoned_out(case):
    q = case["q"]
    return torch.full(q.shape[:-1] + (512,), float("nan"), dtype=q.dtype, device=q.device)


def check_fp8_mma(case, out, lse):
    """The fp8mma kernel rounds Q and P to e4m3: the decode FP8-MMA tests' bounds (conftest)."""
    ref_out, ref_lse = sparse_reference(case)
    assert torch.isfinite(out).all()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and not out[empty].any()
    diff = out.double() - ref_out
    assert (diff.norm() / ref_out.norm()).item() <= FP8MMA_REL_L2
    seen = ~empty & (ref_out.norm(dim=-1) > 0)
    assert (diff[seen].norm(dim=-1) / ref_out[seen].norm(dim=-1)).max().item() <= FP8MMA_ROW_REL
    assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() <= FP8MMA_LSE_ABS


# ----------------------------------------------------------------------------------------- compaction
@pytest.mark.parametrize("rows,topk", [(1, 1), (37, 7), (300, 2048), (5, 2049), (3, 6000), (0, 16)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_compact_matches_cpu(rows, topk, with_lengths):
    """Exact equality with the CPU op, over 1 to 3 tiles of the kernel (2048 indices each), with
    indices rows of a wider buffer (row stride > topk) and lengths outside [0, topk] (clamped)."""
    g = torch.Generator().manual_seed(rows + topk)
    wide = torch.randint(-2, 5000, (rows, topk + 5), generator=g, dtype=torch.int32)
    wide[:, ::3] = 2**31 - 1
    idx = wide[:, :topk]
    lengths = torch.randint(-3, topk + 4, (rows,), generator=g, dtype=torch.int32) if with_lengths else None
    want = torch.ops.mla_attn.compact_sparse_indices(idx, lengths, 4000)
    got = torch.ops.mla_attn.compact_sparse_indices(idx.cuda(), None if lengths is None else lengths.cuda(), 4000)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_compact_opcheck():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, 3000, (9, 2100), generator=g, dtype=torch.int32).cuda()
    lengths = torch.tensor([0, 2100, 5, 2049, 1, 700, 2048, 3, 2099], dtype=torch.int32, device="cuda")
    for ln in (None, lengths):
        torch.library.opcheck(torch.ops.mla_attn.compact_sparse_indices.default, (idx, ln, 2500))


# ------------------------------------------------------------------------------------------ attention
CASES = [  # (lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, fp8=False)
    ((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False),
    ((37,), 1, 300, 1, torch.float16, True, None, False, False),
    ((2, 1), 128, 2048, 16, torch.bfloat16, False, "mixed", True, True),
    ((9,), 64, 1000, 16, torch.float16, True, "+inf", False, False),
    ((3, 2), 32, 777, 64, torch.bfloat16, True, "-inf", False, False),
    ((64,), 128, 2048, 64, torch.bfloat16, True, None, False, False),
    ((5,), 3, 33, 1, torch.bfloat16, False, "finite", True, False),
    ((2, 3), 16, 1, 16, torch.float16, False, None, False, False),
    ((6,), 128, 4100, 1, torch.float16, True, "finite", False, True),
    # many one-block rows: most are not split, so the split kernels' epilogues apply the sink themselves
    ((300,), 128, 64, 16, torch.bfloat16, True, "finite", False, False),
    ((400,), 16, 100, 1, torch.float16, True, "mixed", False, False),
]
PARAMS = [pytest.param(*c, kernel) for c in CASES for kernel in [None] + decode_kernels_for(torch.bfloat16, c[1])]


@pytest.mark.parametrize("lead,h_q,topk,page_size,dtype,lengths,sink,split_pe,kv_4d,kernel", PARAMS)
def test_sparse_decode_matches_reference(lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, kernel):
    case = sparse_case(lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, False)
    out = poisoned_out(case)
    got, lse = run_sparse(case, out=out, _kernel=kernel)
    assert got.data_ptr() == out.data_ptr()
    check_sparse(case, out, lse)


@pytest.mark.parametrize("lead,h_q,topk,page_size,dtype,lengths,sink,split_pe,kv_4d,kernel", PARAMS)
def test_indices_valid_skips_the_compaction(lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, kernel):
    """indices_valid=True on rows whose valid indices come first, counted by topk_length (per request of a
    batched case, per token of a token-major one): the garbage past each count (NaN slots among it) is
    never read; bit-identical to the compacting call, which hands the kernel the same slots and counts."""
    case = valid_first(sparse_case(lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, False),
                       batched=True)
    out = poisoned_out(case)
    _, lse = run_sparse(case, out=out, indices_valid=True, _kernel=kernel)
    check_sparse(case, out, lse)
    want, want_lse = run_sparse(case, _kernel=kernel)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


FP8_CASES = [((4, 2), 16, 2048, 64, True, "finite"), ((7,), 64, 1500, 1, True, None),
             ((2, 2), 128, 2048, 16, False, "mixed")]
FP8_PARAMS = [pytest.param(*c, kernel) for c in FP8_CASES for kernel in [None] + decode_kernels_for(FP8, c[1])]


@pytest.mark.parametrize("lead,h_q,topk,page_size,lengths,sink,kernel", FP8_PARAMS)
def test_sparse_decode_fp8_cache(lead, h_q, topk, page_size, lengths, sink, kernel):
    """float8_e4m3fn cache with k_scale: the reference runs on the dequantized cache."""
    case = sparse_case(lead, h_q, topk, page_size, torch.bfloat16, lengths, sink, False, False, True)
    assert case["kv_cache"].dtype == FP8
    out = poisoned_out(case)
    _, lse = run_sparse(case, out=out, _kernel=kernel)
    # the e4m3-MMA kernel has its own bounds; the dispatch keeps 16-bit MMAs (fp8_mma is not offered here)
    (check_fp8_mma if kernel == "fp8mma" else check_sparse)(case, out, lse)


@pytest.mark.parametrize("lead,h_q,topk,page_size,lengths,sink,kernel", FP8_PARAMS)
def test_indices_valid_fp8_cache(lead, h_q, topk, page_size, lengths, sink, kernel):
    """indices_valid=True over a float8_e4m3fn cache (its own row copies in the 64-row kernel): token-major
    valid-first rows, bit-identical to the compacting call."""
    case = valid_first(sparse_case(lead, h_q, topk, page_size, torch.bfloat16, lengths, sink, False, False, True))
    out = poisoned_out(case)
    _, lse = run_sparse(case, out=out, indices_valid=True, _kernel=kernel)
    (check_fp8_mma if kernel == "fp8mma" else check_sparse)(case, out, lse)
    want, want_lse = run_sparse(case, _kernel=kernel)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


DS_CASES = [((4, 2), 16, 2048, 64, True, "finite"), ((7,), 128, 1500, 1, True, None), ((3,), 64, 70, 24, False, "mixed"),
            ((3, 2), 128, 2048, 64, True, "finite"), ((5,), 100, 333, 16, False, None), ((6,), 32, 777, 1, True, "-inf"),
            ((2, 3), 24, 2100, 16, False, None)]
DS_PARAMS = [pytest.param(*c, kernel) for c in DS_CASES for kernel in [None] + decode_kernels_for(torch.uint8, c[1])]


@pytest.mark.parametrize("lead,h_q,topk,page_size,lengths,sink,kernel", DS_PARAMS)
def test_sparse_decode_ds_mla_fp8_cache(lead, h_q, topk, page_size, lengths, sink, kernel):
    """DeepSeek-V3.2's 656-byte rows (uint8), gathered and dequantised by the 64-row kernel or the
    narrow kernels (up to 32 heads); the reference reads the dequantised cache. CUDA-graph replay gives
    the same result."""
    case = to_device(make_sparse_case(lead, h_q, topk, page_size, lengths=lengths, sink=sink, ds_fp8=True,
                                      seed=topk + h_q), "cuda")
    assert case["kv_cache"].dtype == torch.uint8
    out = poisoned_out(case)
    _, lse = run_sparse(case, out=out, _kernel=kernel)
    check_sparse(case, out, lse)
    graph_out = poisoned_out(case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_sparse(case, out=graph_out, _kernel=kernel)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out)


DS_MORE_CASES = [((5,), 1, 300, 1, torch.float16, True), ((2, 2), 8, 640, 16, torch.bfloat16, True),
                 ((3,), 128, 500, 3, torch.float16, False), ((4,), 32, 900, 64, torch.float16, True)]
DS_MORE_PARAMS = [pytest.param(*c, kernel) for c in DS_MORE_CASES
                  for kernel in [None] + decode_kernels_for(torch.uint8, c[1])]


@pytest.mark.parametrize("lead,h_q,topk,page_size,dtype,split_pe,kernel", DS_MORE_PARAMS)
def test_sparse_decode_ds_mla_fp8_cache_fp16_and_split_q(lead, h_q, topk, page_size, dtype, split_pe, kernel):
    """A ds_mla_fp8 cache under fp16 queries, q_pe given apart, and 1 or 8 heads."""
    case = to_device(make_sparse_case(lead, h_q, topk, page_size, dtype=dtype, lengths=True, sink="finite",
                                      split_pe=split_pe, ds_fp8=True, seed=topk + h_q), "cuda")
    out = poisoned_out(case)
    _, lse = run_sparse(case, out=out, _kernel=kernel)
    check_sparse(case, out, lse)


@pytest.mark.parametrize("kind", ["bf16", "ds_fp8"])
def test_opcheck_of_a_sparse_call(kind, schedule_cache):  # empty: the call makes its schedule
    from test_sparse_cpu import opcheck_sparse_call
    opcheck_sparse_call(kind, "cuda")


def test_functional_form_and_no_lse():
    case = sparse_case((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False, False)
    out, lse = run_sparse(case)
    check_sparse(case, out, lse)
    only = mla_attn.mla_sparse_decode(case["q"], case["kv_cache"], case["indices"],
                                      softmax_scale=case["softmax_scale"], topk_length=case["topk_length"],
                                      attn_sink=case["attn_sink"])
    assert torch.equal(only, out)


HUGE_LENGTHS = [2**31 - 1, 2**31 - 40, 2**31 - 63, 2**31 - 64, 100, 101, 5000]


@pytest.mark.parametrize("cache,kernel", [("ds_mla_fp8", k) for k in [None] + decode_kernels_for(torch.uint8, 16)] +
                         [("bf16", k) for k in [None] + decode_kernels_for(torch.bfloat16, 16)])
def test_unchecked_topk_length_past_topk_is_clamped(cache, kernel):
    """topk_length above topk, up to INT32_MAX, unchecked: the row's length is clamped to topk. A
    ds_mla_fp8 cache, and any cache with indices_valid=True, take the lengths as they are (no
    compaction clamps them); a length within 63 of INT32_MAX overflowed the kernels' block count and
    dropped the row's keys wherever the row was not the last of its schedule part (100 of the 200 rows
    here). With indices_valid every counted index must be a slot: the invalid ones of rows 1.. are
    replaced by a valid slot (a repeat counts each time, in the reference too); row 0 (nothing valid)
    gets length 0."""
    case = make_sparse_case((200,), 16, 100, 16, ds_fp8=cache == "ds_mla_fp8", seed=21)
    if cache == "bf16":
        idx = case["indices"]
        valid = (idx >= 0) & (idx < case["kv_cache"].shape[0] * case["kv_cache"].shape[1])
        valid[0] = True  # row 0 keeps its invalid indices (length 0)
        case["indices"] = torch.where(valid, idx, idx[1:][valid[1:]][0])
    lengths = torch.tensor(HUGE_LENGTHS, dtype=torch.int32).repeat(200 // len(HUGE_LENGTHS) + 1)[:200]
    lengths[0] = 0
    case = to_device({**case, "topk_length": lengths.clamp(max=100)}, "cuda")  # what the kernels should see
    out = poisoned_out(case)
    _, lse = run_sparse({**case, "topk_length": lengths.cuda()}, out=out, validate=False,
                        indices_valid=cache == "bf16", _kernel=kernel)
    check_sparse(case, out, lse)


def test_all_rows_empty():
    case = sparse_case((37,), 1, 300, 1, torch.float16, True, None, False, False, False)
    case["indices"] = torch.where(case["indices"] >= 0, -1, case["indices"])  # nothing valid anywhere
    case["attn_sink"] = torch.full((1,), float("inf"), device="cuda")
    out = poisoned_out(case)
    _, lse = run_sparse(case, out=out)
    assert not out.any() and torch.isinf(lse).all() and (lse > 0).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "ds_mla_fp8"])
def test_raw_kv_slots_over_a_cache_of_no_page(cache_dtype):
    """torch.ops.mla_attn.mla_decode(kv_slots=True) over a cache of no page: every request is empty (out 0,
    lse +inf) whatever its length and slots, on every kernel (slots were clamped to -1 before)."""
    h_q = 16
    lens = torch.tensor([5, 64, 1], dtype=torch.int32, device="cuda")
    slots = torch.arange(3 * 64, dtype=torch.int32, device="cuda").view(3, 64)
    q = torch.randn(3, 1, h_q, 576, device="cuda").bfloat16()
    kv = torch.empty(0, 64, 656 if cache_dtype == torch.uint8 else 576, dtype=cache_dtype, device="cuda")
    md = mla_attn.get_decode_metadata(lens, h_q, s_q=1, causal=False)
    for kernel in [None] + decode_kernels_for(cache_dtype, h_q):
        for skip in (False, True) if cache_dtype == torch.uint8 else (False,):
            leave_nan_blocks(((3, 1, h_q, 512), torch.bfloat16), ((3, 1, h_q), torch.float32))
            out, lse = torch.ops.mla_attn.mla_decode(q, None, kv, slots, lens, None, 1, 0.1, False, md.tile_sched,
                                                     md.req_splits, md.num_sm_parts, kv_slots=True,
                                                     skip_invalid_slots=skip, split_kernel=kernel)
            torch.cuda.synchronize()
            assert not out.any() and torch.isinf(lse).all() and (lse > 0).all(), (kernel, skip)


@pytest.mark.parametrize("kernel", [None] + decode_kernels_for(torch.bfloat16, 64))
def test_sparse_prefill_matches_reference(kernel):
    """Prefill: indices into gathered rows kv [S, 576]; the case's page-size-1 cache is that kv."""
    case = sparse_case((50,), 64, 2048, 1, torch.bfloat16, True, "finite", False, False, False)
    kv = case["kv_cache"][:, 0]
    out = poisoned_out(case)
    _, lse = mla_attn.mla_sparse_prefill(case["q"], kv, case["indices"], softmax_scale=case["softmax_scale"],
                                         topk_length=case["topk_length"], attn_sink=case["attn_sink"],
                                         return_lse=True, out=out, _kernel=kernel)
    check_sparse(case, out, lse)


def test_value_checks_on_request():
    case = sparse_case((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False, False)
    bad = case["topk_length"].clone()
    bad[0] = 2049
    with pytest.raises(ValueError, match=r"topk_length\[0\] = 2049 is not in \[0, topk=2048\]"):
        run_sparse({**case, "topk_length": bad}, validate=True)
    run_sparse({**case, "topk_length": bad})  # unchecked by default on the GPU (no host sync): clamped
    counted = valid_first(case)
    with pytest.raises(ValueError, match=r"indices_valid=True, but indices\[0, 0\] = -1 is not a cache slot"):
        run_sparse({**counted, "topk_length": None}, indices_valid=True, validate=True)
    # unchecked: the kernels clamp a slot outside the cache into it (a wrong key, no fault); the
    # synchronize raises if a kernel faulted
    run_sparse({**counted, "topk_length": None}, indices_valid=True)
    torch.cuda.synchronize()


def _replacement_indices(case, seed):
    """New indices and lengths of the case's shapes that name only slots holding data (not NaN)."""
    g = torch.Generator().manual_seed(seed)
    cache = case["kv_cache"].reshape(-1, 576)
    good = (~torch.isnan(cache[:, 0].float())).nonzero()[:, 0].int().cpu()
    idx = good[torch.randint(0, good.numel(), case["indices"].shape, generator=g)]
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    idx.view(-1, idx.shape[-1])[0] = -1  # row 0 stays empty
    lengths = torch.randint(0, idx.shape[-1] + 1, case["topk_length"].shape, generator=g, dtype=torch.int32)
    return idx.cuda(), lengths.cuda()


@pytest.mark.parametrize("indices_valid", [False, True])
def test_cuda_graph_replay_with_new_indices(indices_valid):
    """Replays with new indices and lengths; indices_valid: each index set valid-first (valid_first)."""
    case = sparse_case((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False, False)
    if indices_valid:
        case = valid_first(case, batched=True)
    static = dict(case, indices=case["indices"].clone(), topk_length=case["topk_length"].clone())
    out = poisoned_out(case)

    md = mla_attn.get_sparse_decode_metadata(static["indices"], 16)  # once: it depends on shapes only

    def step():
        return run_sparse(static, out=out, metadata=md, indices_valid=indices_valid)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = step()
    for seed in (1, 2, None):  # two new index sets, then the original again
        idx, lengths = (case["indices"], case["topk_length"]) if seed is None else _replacement_indices(case, seed)
        if indices_valid and seed is not None:
            counted = valid_first({**case, "indices": idx, "topk_length": lengths}, batched=True)
            idx, lengths = counted["indices"], counted["topk_length"]
        static["indices"].copy_(idx)
        static["topk_length"].copy_(lengths)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_sparse({**case, "indices": idx, "topk_length": lengths}, out, lse)


def test_torch_compile_fullgraph():
    case = sparse_case((3, 2), 32, 777, 64, torch.bfloat16, True, "-inf", False, False, False)
    case["attn_sink"] = torch.linspace(-3, 12, 32, device="cuda")

    def f(q, kv, idx, lengths, sink):
        return mla_attn.mla_sparse_decode(q, kv, idx, softmax_scale=case["softmax_scale"], topk_length=lengths,
                                          attn_sink=sink, return_lse=True)

    args = (case["q"], case["kv_cache"], case["indices"], case["topk_length"], case["attn_sink"])
    torch._dynamo.reset()
    out, lse = torch.compile(f, fullgraph=True)(*args)
    check_sparse(case, out, lse)
    eager_out, eager_lse = f(*args)
    assert torch.equal(lse, eager_lse)
    assert torch.equal(out, eager_out)  # the same kernels on the same schedule, the sink inside them


# --------------------------------------------------------------- schedules of calls without metadata=
def _schedule_equal(a, b):
    return (torch.equal(a.decode.tile_sched, b.decode.tile_sched) and torch.equal(a.decode.req_splits, b.decode.req_splits)
            and torch.equal(a.lengths, b.lengths))


@pytest.fixture
def schedule_cache(monkeypatch):
    """mla_attn.sparse's schedule cache, emptied for the test (and bounded to 2 evictable entries)."""
    from mla_attn import sparse
    cache = sparse._ScheduleCache()
    cache.MAX_EVICTABLE = 2
    monkeypatch.setattr(sparse, "_schedules", cache)
    return cache


def test_calls_without_metadata_reuse_the_schedule(schedule_cache):
    case = sparse_case((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False, False)
    out1, lse1 = run_sparse(case, out=poisoned_out(case))
    assert len(schedule_cache.entries) == 1
    entry, = schedule_cache.entries.values()
    assert not entry.pinned and _schedule_equal(entry.metadata, mla_attn.get_sparse_decode_metadata(case["indices"], 16))
    out2, lse2 = run_sparse(case, out=poisoned_out(case))
    assert len(schedule_cache.entries) == 1 and next(iter(schedule_cache.entries.values())) is entry
    check_sparse(case, out2, lse2)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def test_schedule_cache_across_streams_and_bounded(schedule_cache):
    case = sparse_case((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False, False)
    run_sparse(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the entry was made on the default stream: waited for here
        out, lse = run_sparse(case, out=poisoned_out(case))
    torch.cuda.current_stream().wait_stream(side)
    check_sparse(case, out, lse)
    for h_q in (32, 64, 128):  # three more shapes: only the two newest stay
        run_sparse(dict(case, q=case["q"][..., :1, :].expand(4, 2, h_q, 576).contiguous(), attn_sink=None))
    assert [key[2] for key in schedule_cache.entries] == [64, 128]


def test_schedule_cache_and_cuda_graphs(schedule_cache):
    """A capture keeps nothing it made (its memory pool owns it), uses the entries made on its own stream
    and, from other streams, those a lookup outside it found complete (it can neither wait for nor query
    work outside it), and pins what it used (its replays read it)."""
    case = sparse_case((4, 2), 16, 2048, 64, torch.bfloat16, True, "finite", False, False, False)

    def heads(h_q):  # the case with h_q heads (all copies of head 0), no sink
        return dict(case, q=case["q"][..., :1, :].expand(4, 2, h_q, 576).contiguous(), attn_sink=None)

    other = dict(case, q=case["q"][:3], indices=case["indices"][:3], topk_length=case["topk_length"][:3])
    schedule_cache.MAX_EVICTABLE = 3
    wide, tall = heads(64), heads(32)
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        run_sparse(case)  # made on the capture's stream
    run_sparse(wide)  # made on another stream, never seen complete
    run_sparse(tall)
    torch.cuda.synchronize()
    run_sparse(tall)  # seen complete
    torch.cuda.synchronize()
    calls = (case, other, wide, tall)
    outs = [poisoned_out(c) for c in calls]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        lses = [run_sparse(c, out=o)[1] for c, o in zip(calls, outs)]
    assert [(key[2], e.pinned) for key, e in schedule_cache.entries.items()] == [(64, False), (16, True), (32, True)]
    for h_q in (128, 8, 4):  # the fourth evictable entry evicts the oldest, passing over the pinned ones
        run_sparse(heads(h_q))
    assert [key[2] for key in schedule_cache.entries] == [16, 32, 128, 8, 4]
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for c, o, lse in zip(calls, outs, lses):
        check_sparse(c, o, lse)


@pytest.mark.parametrize("heads,page_size,vouch", [(16, 64, False), (128, 16, False), (128, 16, True)])
def test_layer_sparse_with_every_key_is_dense_attention(heads, page_size, vouch):
    """MLAAttention(indices=) naming every causal key: the un-absorbed oracle's result (test_layer's
    GPU scenario and bound); vouch: with topk_length and indices_valid=True."""
    import dataclasses

    from layer_oracle import init_weights, run_scenario
    from test_layer import CONFIGS, STEPS_GPU, check_close
    from test_sparse_cpu import with_all_keys_indexer
    cfg = dataclasses.replace(CONFIGS["q_lora"], num_heads=heads, hidden_size=1024)
    layer = mla_attn.MLAAttention(cfg, dtype=torch.bfloat16)
    init_weights(layer, seed=2)
    layer.cuda()
    with_all_keys_indexer(layer, vouch=vouch)

    def check(i, batch, got, want, lowp):
        check_close(i, batch, got, want, lowp, factor=2)

    run_scenario(layer, STEPS_GPU, page_size=page_size, num_pages=4 * 8192 // page_size, device="cuda",
                 decode_threshold=64, check=check, hidden_seed=heads)
