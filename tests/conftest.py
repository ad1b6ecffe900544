"""Markers (gpu, slow) and what several test files share: the device fixture, decode cases on the GPU
with their references and tolerances, the walk of a decode schedule, and which decode kernels can run
a case."""
import functools
import os

import pytest
import torch
from cases import check_unit_scale_error, make_decode_case, to_device  # noqa: F401 (to_device: tests import it)
from fp8_cases import dequantized, to_fp8_case

import mla_attn
from mla_attn.metadata import ScheduleRow
from mla_attn.reference import mla_decode_ref

FP8 = torch.float8_e4m3fn


# Under pytest-xdist every worker would start torch's CPU pool with a thread per core, so n workers ran
# n x cores threads over the float64 references and the CPU ops: the cores are split between them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _has_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an sm_90 (Hopper) GPU; skipped otherwise")
    config.addinivalue_line("markers", "slow: starts other processes (torchrun); deselect with -m 'not slow'")


def pytest_collection_modifyitems(config, items):
    if _has_hopper():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test on the CPU ops and (gpu-marked) on the CUDA kernels."""
    return request.param


# ---------------------------------------------------------------------------------------- decode
def decode_kernels_for(cache_dtype, rows):
    """The decode kernels that run a call with this cache dtype and rows = max_seqlen_q * h_q: the
    tests' own statement of the rule mla_decode(_kernel=) enforces."""
    if cache_dtype == torch.uint8:  # ds_mla_fp8 rows: the 64-row kernel and the narrow kernel's form
        runs = (("narrow16", rows <= 16), ("narrow32", rows <= 32), ("rows64", True))
        return [kernel for kernel, ok in runs if ok]
    fp8 = cache_dtype == FP8
    runs = {
        "narrow16": rows <= 16,
        "narrow16_3wg": fp8 and rows <= 16,
        "narrow32": fp8 and rows <= 32,
        "rows64": True,
        "seesaw": not fp8,
        "seesaw_steady": not fp8,
        "fp8mma": fp8,
        "rows64_seesaw": not fp8,
    }
    return [kernel for kernel, ok in runs.items() if ok]


def decode_case_params(cases, cache_dtype):
    """pytest params (lens, s_q, h_q, page_size, varlen, split_pe, kernel, dtype, causal) for cases
    (lens, s_q, h_q, page_size, varlen, split_pe): the dispatch (kernel None) in both dtypes, causal and
    not; every kernel that can run the case once, in a (dtype, causal) that turns with the case and
    the kernel, so that each kernel meets every combination over the cases."""
    combos = [(dtype, causal) for dtype in (torch.bfloat16, torch.float16) for causal in (True, False)]
    params = []
    for i, case in enumerate(cases):
        params += [pytest.param(*case, None, dtype, causal) for dtype, causal in combos]
        params += [pytest.param(*case, kernel, *combos[(i + j) % len(combos)])
                   for j, kernel in enumerate(decode_kernels_for(cache_dtype, case[1] * case[2]))]
    return params


@functools.lru_cache(maxsize=2)
def _shared_decode_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype, fp8):
    case = make_decode_case(list(lens), s_q, h_q, page_size, varlen=varlen, split_pe=split_pe, dtype=dtype,
                            seed=len(lens) * 1000 + s_q * 10 + h_q)
    return {**to_device(to_fp8_case(case) if fp8 else case), "references": {}}


def decode_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype, *, fp8=False):
    """make_decode_case on the GPU (FP8 cache when fp8), seeded by its shape. Consecutive tests of one
    case share its tensors and its references: they must not modify them."""
    return dict(_shared_decode_case(tuple(lens), s_q, h_q, page_size, varlen, split_pe, dtype, fp8))


def run_decode(case, causal, **kw):
    """mla_decode on a case (k_scale when it has one), returning (out, lse)."""
    c = case
    if c["cu_seqlens_q"] is not None:
        kw["max_seqlen_q"] = c["max_seqlen_q"]
    return mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                               cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"], k_scale=c.get("k_scale"),
                               softmax_scale=c["softmax_scale"], causal=causal, return_lse=True, **kw)


def decode_reference(case, causal, dtype=torch.float32):
    """The reference in `dtype` (on the dequantized cache for an FP8 case); kept in the case's
    "references" when it has them (decode_case)."""
    memo = case.get("references", {})
    if (causal, dtype) not in memo:
        c = dequantized(case) if "k_scale" in case or case["kv_cache"].dtype == torch.uint8 else case
        memo[causal, dtype] = mla_decode_ref(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                                             cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"],
                                             softmax_scale=c["softmax_scale"], causal=causal, dtype=dtype)
    return memo[causal, dtype]


def capture_graph(fn):
    """A CUDA graph of fn(), captured after a warm-up call on a side stream (allocator, lazy inits).
    Returns (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def capture_decode_step(case, out, **kw):
    """A CUDA graph of one causal decode step of a uniform case (get_decode_metadata on its
    cache_seqlens, then mla_decode(**kw) into out): replays read the case's tensors as they are then.
    Returns (graph, lse)."""
    def step():
        md = mla_attn.get_decode_metadata(case["cache_seqlens"], case["q"].shape[-2], s_q=case["q"].shape[1],
                                          causal=True)
        return run_decode(case, True, metadata=md, out=out, **kw)

    graph, (_, lse) = capture_graph(step)
    return graph, lse


def poisoned_past_lengths(kv_cache, block_table, lens):
    """A copy of a paged cache with NaN in every slot of request b's pages at or past lens[b]: what a
    replay with shorter lengths must not read (the keys the longer lengths left there)."""
    kv = kv_cache.clone()
    num_pages, page_size = kv.shape[0], kv.shape[1]
    table = block_table.long()
    keys = torch.arange(table.shape[1] * page_size, device=kv.device)
    # e4m3 has no NaN scalar to assign from, nor have ds_mla_fp8 rows: all-ones bytes are NaN in e4m3,
    # float32 (the group scales) and bf16 (the rope part) alike
    slots, nan = (kv.view(torch.uint8), 0xFF) if kv.dtype in (FP8, torch.uint8) else (kv, float("nan"))
    for b, n in enumerate(lens):
        pages = table[b, keys[n:] // page_size]
        mine = (pages >= 0) & (pages < num_pages)
        slots[pages[mine], keys[n:][mine] % page_size] = nan
    return kv


def leave_nan_blocks(*blocks):
    """Leaves freed blocks of NaN, one per (shape, dtype), in CUDA's caching allocator, where the outputs of
    those sizes an op allocates next land: a row the op leaves unwritten then reads NaN, not zeros."""
    for shape, dtype in blocks:
        torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _check_empty_rows(ref_lse, out, lse):
    assert torch.isfinite(out).all(), "non-finite output"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all(), "+inf lse exactly on empty rows"
    assert not out[empty].any(), "rows without a visible key must be 0"
    return ~empty


def check_unit_scale(case, causal, out, lse, column_scale=1.0):
    """Unit-scale data: out within check_unit_scale_error of the reference; lse within 1e-3.
    column_scale: the scale of each output column where they differ, errors compared divided by it."""
    ref_out, ref_lse = decode_reference(case, causal)
    low_out, _ = decode_reference(case, causal, dtype=case["q"].dtype)
    seen = _check_empty_rows(ref_lse, out, lse)
    check_unit_scale_error(out / column_scale, ref_out / column_scale, low_out.float() / column_scale)
    lse_err = (lse[seen] - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
    assert lse_err <= 1e-3, f"lse max err {lse_err:.3e}"


# The e4m3-MMA kernel (fp8mma) rounds Q and P to e4m3 (3 mantissa bits): about 3 % of the output's
# norm (measured on these cases, H200: relative L2 error up to 3.4 %, every row within 6.8 %; LSE within
# 0.08) where 16-bit MMAs give 0.17 %, the size of the error the FP8 cache itself adds. The bounds are
# 1.5-1.8x the measured worst; a wrong key order in P or V^T, a missed mask or a NaN read gives O(1).
FP8MMA_REL_L2 = 0.05   # relative L2 error of the whole output
FP8MMA_ROW_REL = 0.12  # relative L2 error of each row with a visible key
FP8MMA_LSE_ABS = 0.12  # natural log


def check_fp8_mma(case, causal, out, lse):
    ref_out, ref_lse = decode_reference(case, causal)
    seen = _check_empty_rows(ref_lse, out, lse)
    diff = out.float() - ref_out
    rel = (diff.norm() / ref_out.norm()).item() if ref_out.norm() > 0 else 0.0
    assert rel <= FP8MMA_REL_L2, f"relative L2 error {rel:.3e}"
    if seen.any():
        row_rel = (diff[seen].norm(dim=-1) / ref_out[seen].norm(dim=-1)).max().item()
        assert row_rel <= FP8MMA_ROW_REL, f"worst row relative error {row_rel:.3e}"
        lse_err = (lse[seen] - ref_lse[seen]).abs().max().item()
        assert lse_err <= FP8MMA_LSE_ABS, f"lse max err {lse_err:.3e}"


def check_decode(case, causal, out, lse, kernel):
    """Each kernel's tolerance: fp8mma its own, every other kernel check_unit_scale."""
    (check_fp8_mma if kernel == "fp8mma" else check_unit_scale)(case, causal, out, lse)


def ragged_lengths(seed, max_batch, zero_every):
    """Seeded KV lengths of 1 to max_batch - 1 requests in [0, 9000), every zero_every-th one empty."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 9000, (int(torch.randint(1, max_batch, (1,), generator=g)),), generator=g,
                         dtype=torch.int32)
    lens[::zero_every] = 0
    return lens


def schedule_segments(tile_sched, parts, num_blocks):
    """(request, first block, end block, split index, part) of every segment, as the kernel walks
    tile_sched's first `parts` rows; num_blocks: KV blocks per request."""
    segments = []
    for p in range(parts):
        r = ScheduleRow(*tile_sched[p].tolist())
        for b in range(r.first_request, r.last_request + 1):
            segments.append((b, r.first_block if b == r.first_request else 0,
                             r.last_end_block if b == r.last_request else num_blocks[b],
                             r.first_split if b == r.first_request else 0, p))
    return segments
