"""mla_decode with every kind of page size on every kernel that runs the case: multiples of 16 (TMA
copies of 16-64 rows) and the rest down to SGLang's 1 (rows gathered: by cp.async, or whole by bulk copy
in the 64-row kernel's fp8 forms), 16-bit and FP8 and ds_mla_fp8 caches, against the
float32 reference. NaN sits in every slot past each length and in unused pages
(tests/cases.py), so a row gathered from a wrong page or offset shows."""
import pytest
import torch
from cases import make_decode_case
from conftest import (FP8, capture_decode_step, check_decode, decode_kernels_for, poisoned_past_lengths, run_decode,
                      to_device)
from fp8_cases import to_ds_case, to_fp8_case

from mla_attn.metadata import DecodeMetadata, device_num_sms

pytestmark = pytest.mark.gpu

PAGE_SIZES = [1, 3, 8, 16, 24, 32, 64, 100, 128, 256]
# Lengths that end mid-page and mid-block for every page size above, an empty request, and one long
# enough to be split across CTAs.
LENS = [1, 77, 0, 1000, 4097]


def _params(page_sizes=PAGE_SIZES):
    params = []
    for page_size in page_sizes:
        for cache_dtype in (torch.bfloat16, FP8, torch.uint8):
            for h_q, s_q in ((16, 1), (64, 2)):
                for kernel in [None] + decode_kernels_for(cache_dtype, h_q * s_q):
                    if kernel == "rows64_seesaw" and page_size % 16:
                        continue  # runs as rows64 on gathered rows (dispatch.h: decode_kernel_that_runs)
                    name = {torch.bfloat16: "bf16", FP8: "fp8", torch.uint8: "ds_mla_fp8"}[cache_dtype]
                    params.append(pytest.param(page_size, cache_dtype, h_q, s_q, kernel,
                                               id=f"ps{page_size}-{name}-h{h_q}s{s_q}-{kernel}"))
    return params


@pytest.mark.parametrize("page_size,cache_dtype,h_q,s_q,kernel", _params())
def test_page_size(page_size, cache_dtype, h_q, s_q, kernel):
    case = make_decode_case(LENS, s_q, h_q, page_size, kv_4d=page_size % 2 == 1, seed=page_size + h_q)
    if cache_dtype == FP8:
        case = to_fp8_case(case)
    elif cache_dtype == torch.uint8:
        case = to_ds_case(case)
    case = to_device(case)
    out, lse = run_decode(case, True, _kernel=kernel)
    check_decode(case, True, out, lse, kernel)


@pytest.mark.parametrize("page_size,cache_dtype,h_q,s_q,kernel", _params([1, 24, 64, 256]))
def test_page_size_long_segments(page_size, cache_dtype, h_q, s_q, kernel):
    """Segments of hundreds of blocks (schedules of 1 and 3 parts): each stage ring turns over many
    times and the seesaw kernel runs its steady loop, at gathered and TMA page sizes alike."""
    case = make_decode_case([40000, 77], s_q, h_q, page_size, seed=page_size + h_q + 1)
    if cache_dtype == FP8:
        case = to_fp8_case(case)
    elif cache_dtype == torch.uint8:
        case = to_ds_case(case)
    case = to_device(case)
    num_sms = device_num_sms("cuda")
    for parts in (1, 3):
        tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(
            case["cache_seqlens"], None, s_q, h_q, True, parts, num_sms)
        md = DecodeMetadata(tile_sched, req_splits, parts, s_q, h_q, True)
        out, lse = run_decode(case, True, metadata=md, _kernel=kernel)
        check_decode(case, True, out, lse, kernel)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8, torch.uint8], ids=["bf16", "fp8", "ds_mla_fp8"])
@pytest.mark.parametrize("page_size", [3, 64])
def test_one_page_cache_with_any_page_stride(page_size, cache_dtype):
    """A cache of one page may carry any page stride (torch never steps a dim of extent 1), here one
    that is not a multiple of 16 bytes, and an odd head stride in the 4-D form: the TMA map (page 64,
    bf16 and FP8) took the page stride as given and was refused. Every kernel reads the page (page 3
    and ds_mla_fp8 rows are gathered without a map: they only guard against a regression)."""
    case = make_decode_case([max(page_size - 1, 1), page_size // 2 + 1], 1, 16, page_size, kv_4d=True, seed=page_size)
    if cache_dtype == FP8:
        case = to_fp8_case(case)
    elif cache_dtype == torch.uint8:
        case = to_ds_case(case)
    case = to_device(case)
    page = int(case["block_table"][0, 0])
    one = case["kv_cache"][page:page + 1].contiguous()
    block_table = case["block_table"].clone()
    block_table[:, 0] = 0  # both requests read request 0's page (request 1 is the shorter)
    ref_case = dict(case, kv_cache=one, block_table=block_table)
    stride = list(one.stride())
    stride[0] += 1
    if one.dim() == 4:
        stride[2] = 7
    odd = dict(ref_case, kv_cache=one.as_strided(one.shape, stride))
    for kernel in [None] + decode_kernels_for(cache_dtype, 16):
        out, lse = run_decode(odd, True, _kernel=kernel)
        check_decode(ref_case, True, out, lse, kernel)


def _graph_params():
    params = []
    for page_size in (1, 24, 64):
        for cache_dtype, name, convert in ((torch.bfloat16, "bf16", None), (FP8, "fp8", to_fp8_case),
                                           (torch.uint8, "ds_mla_fp8", to_ds_case)):
            for kernel in [None] + decode_kernels_for(cache_dtype, 128):
                if kernel == "rows64_seesaw" and page_size % 16:
                    continue  # runs as rows64 on gathered rows
                params.append(pytest.param(page_size, convert, kernel, id=f"ps{page_size}-{name}-{kernel}"))
    return params


@pytest.mark.parametrize("page_size,convert,kernel", _graph_params())
def test_cuda_graph_replay_with_new_tables(page_size, convert, kernel):
    """A captured decode (metadata included) replays with the cache's pages moved (a new block table
    and cache contents) and new lengths, NaN in every slot past them; every kernel, every cache format."""
    case = make_decode_case([300, 2000, 5], 1, 128, page_size, seed=page_size)
    case = to_device(convert(case) if convert else case)
    static = dict(case, kv_cache=case["kv_cache"].clone(), block_table=case["block_table"].clone(),
                  cache_seqlens=case["cache_seqlens"].clone())
    out = torch.empty(3, 1, 128, 512, device="cuda", dtype=torch.bfloat16)
    graph, lse = capture_decode_step(static, out, _kernel=kernel)
    g = torch.Generator().manual_seed(page_size)
    for lens in ([300, 2000, 5], [299, 0, 1]):  # never past a request's written slots (NaN there)
        num_pages = case["kv_cache"].shape[0]
        perm = torch.randperm(num_pages, generator=g).to("cuda")
        moved = torch.empty_like(case["kv_cache"])
        moved[perm] = case["kv_cache"]  # page j now lives at perm[j]
        table = case["block_table"].long()
        inside = (table >= 0) & (table < num_pages)
        table = torch.where(inside, perm[table.clamp(0, num_pages - 1)], table)
        new = dict(case, kv_cache=poisoned_past_lengths(moved, table, lens), block_table=table.to(torch.int32),
                   cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
        for key in ("kv_cache", "block_table", "cache_seqlens"):
            static[key].copy_(new[key])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_decode(new, True, out, lse, kernel)
