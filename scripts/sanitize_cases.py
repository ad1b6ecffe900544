"""A small subset of calls for compute-sanitizer (scripts/sanitize.sh), small enough to run under
memcheck and racecheck in seconds. Decode: split and unsplit requests, tail blocks, empty requests,
varlen causal, page sizes 16, 32 and 64 (TMA) and 1 and 24 (cp.async gather), q_pe split, each with a 16-bit, an FP8 and a
ds_mla_fp8 cache and through
every split kernel that can run it. Prefill: partial and causal-diagonal blocks, empty
rows, k_pe split. Then an LSE merge and a KV-cache write + gather round trip. Sparse top-k decode with
invalid indices and lengths (rows ending before their scheduled pieces, empty rows) over a 16-bit, an
FP8 and a ds_mla_fp8 cache, with the schedule made once for two index sets. Last, values only validation
refuses: lengths past the block table through every 16-bit kernel, out-of-range cu_seqlens in decode
and prefill, a decode op given fewer parts than its schedule or a larger batch's tile_sched."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import mla_attn  # noqa: E402
from cases import (make_decode_case, make_overlong_decode_case, make_prefill_case, scramble_cu_seqlens,  # noqa: E402
                   to_device)
from conftest import decode_kernels_for  # noqa: E402
from fp8_cases import dequantized, to_ds_case, to_fp8_case  # noqa: E402
from sparse_cases import check_sparse, make_sparse_case, run_sparse, valid_first  # noqa: E402
from mla_attn._ops import prefill_cpu  # noqa: E402
from mla_attn.metadata import DecodeMetadata, device_num_sms  # noqa: E402
from mla_attn.reference import mla_decode_ref  # noqa: E402

CASES = [
    # (lens, s_q, h_q, page_size, varlen, split_pe)
    ([700], 1, 16, 64, False, False),          # one request split over many CTAs -> combine (16 rows: narrow kernel)
    ([113, 0, 1023], 2, 8, 16, False, True),   # empty request, tail blocks, page 16, q_pe split (narrow; fp8: 3 WGs)
    ([300, 65], 7, 32, 32, True, False),        # varlen causal (16-bit: 224 rows, the seesaw kernel, Q by cp.async)
    ([200], 1, 128, 64, False, False),         # two q tiles, batch 1 (16-bit cache: the 64-row kernel)
    ([130, 300, 0], 2, 128, 64, True, True),   # Q tiles by TMA (h_q 128), several requests per CTA, varlen
    ([130, 0, 1000], 3, 96, 16, True, True),   # seesaw: odd block counts (a pair without b), tails, page 16, varlen
    ([500, 70], 2, 16, 32, False, False),       # 32 rows: the fp8 narrow kernel with N = 32
    ([70, 0, 129], 1, 16, 1, False, False),     # page 1: rows gathered by cp.async (narrow kernels)
    ([300, 65], 2, 64, 24, True, False),         # page 24 (gathered), varlen causal, two q tiles
]


PREFILL_CASES = [
    # (lens_q, lens_k, h_q, split_pe, causal)
    ([200, 5, 64], [300, 0, 64], 2, True, True),
    ([130], [130], 1, False, False),
]


def check_prefill():
    for lens_q, lens_k, h, split_pe, causal in PREFILL_CASES:
        c = to_device(make_prefill_case(lens_q, lens_k, h, split_pe=split_pe))
        out = mla_attn.mla_prefill(c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], c["max_seqlen_q"],
                                   c["max_seqlen_k"], softmax_scale=c["softmax_scale"], causal=causal,
                                   k_pe=c["k_pe"])
        q, k, v, k_pe = (None if t is None else t.float() for t in (c["q"], c["k"], c["v"], c["k_pe"]))
        ref, _ = prefill_cpu(q, k, v, c["cu_seqlens_q"], c["cu_seqlens_k"], c["softmax_scale"], causal, k_pe)
        t_q = int(c["cu_seqlens_q"][-1])
        err = (out[:t_q].float() - ref[:t_q]).abs().max().item()
        print(f"prefill lens_q={lens_q} lens_k={lens_k}: max |err| {err:.2e}", flush=True)
        assert err < 3e-2, err


def check_merge_and_cache():
    outs = torch.randn(3, 50, 4, 128, device="cuda", dtype=torch.bfloat16)
    lses = torch.randn(3, 50, 4, device="cuda")
    lses[0, :7] = float("inf")
    out, lse = mla_attn.merge_attn_states_n(outs, lses)
    ref, _ = mla_attn.reference.merge_attn_states_ref(outs.float(), lses)
    assert (out.float() - ref).abs().max().item() < 2e-2
    kv_cache = torch.full((6, 16, 576), float("nan"), device="cuda", dtype=torch.bfloat16)
    kv_c = torch.randn(20, 512, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(20, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(6 * 16, device="cuda")[:20]
    slots[3] = -1  # padding token: skipped
    mla_attn.write_kv_cache(kv_c, k_pe, kv_cache, slots)
    pages = (slots[slots >= 0] // 16).unique()
    assert torch.isfinite(kv_cache[slots[slots >= 0] // 16, slots[slots >= 0] % 16]).all() and len(pages) > 0
    block_table = torch.arange(6, device="cuda", dtype=torch.int32)[None]
    cu = torch.tensor([0, 96], device="cuda", dtype=torch.int32)
    got = mla_attn.gather_kv_cache(kv_cache, block_table, cu, 100)
    assert got.shape == (100, 576) and not got[96:].any()
    print("merge, write_kv_cache, gather_kv_cache: ok", flush=True)


def check_decode():
    """Every case through every split kernel that can run it (mla_decode's private _kernel), with a
    16-bit, an FP8 and a ds_mla_fp8 cache."""
    worst = {False: 0.0, True: 0.0}  # by e4m3 MMAs
    for (lens, s_q, h_q, page, varlen, split_pe), fmt in [(c, f) for c in CASES for f in ("16-bit", "fp8", "ds")]:
        c = to_device(make_decode_case(lens, s_q, h_q, page, varlen=varlen, split_pe=split_pe))
        c = to_fp8_case(c) if fmt == "fp8" else {**(to_ds_case(c) if fmt == "ds" else c), "k_scale": None}
        kw = dict(max_seqlen_q=c["max_seqlen_q"]) if varlen else {}
        r = c if fmt == "16-bit" else dequantized(c)
        ref, _ = mla_decode_ref(r["q"], r["kv_cache"], r["block_table"], r["cache_seqlens"],
                                cu_seqlens_q=r["cu_seqlens_q"], q_pe=r["q_pe"],
                                softmax_scale=r["softmax_scale"], causal=True)
        for kernel in decode_kernels_for(c["kv_cache"].dtype, s_q * h_q):
            out = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                                      cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"], k_scale=c["k_scale"],
                                      softmax_scale=c["softmax_scale"], causal=True, _kernel=kernel, **kw)
            err = (out.float() - ref).abs().max().item()
            worst[kernel == "fp8mma"] = max(worst[kernel == "fp8mma"], err)
            print(f"lens={lens} s_q={s_q} h_q={h_q} page={page} cache={fmt} {kernel}: max |err| {err:.2e}",
                  flush=True)
    # Whole requests of 40 and 33 blocks per CTA (deterministic): the seesaw kernel's steady loop.
    c = to_device(make_decode_case([2500, 2111], 2, 128, 64))
    out = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                              softmax_scale=c["softmax_scale"], causal=True, deterministic=True)
    ref, _ = mla_decode_ref(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                            softmax_scale=c["softmax_scale"], causal=True)
    err = (out.float() - ref).abs().max().item()
    worst[False] = max(worst[False], err)
    print(f"steady loop (lens [2500, 2111], h_q 128, s_q 2, deterministic): max |err| {err:.2e}", flush=True)
    # rows64_seesaw over 3 parts: the seesaw body on the first and last (275 blocks), the 64-row body on
    # the middle one (77 by its count), requests 0 and 2 split between the two bodies (the combine).
    c = to_device(make_decode_case([20000, 12000, 20000], 2, 32, 64))
    tile_sched, req_splits = torch.ops.mla_attn.get_decode_metadata(c["cache_seqlens"], None, 2, 32, True, 3,
                                                                    device_num_sms("cuda"))
    out = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], softmax_scale=c["softmax_scale"],
                              causal=True, metadata=DecodeMetadata(tile_sched, req_splits, 3, 2, 32, True),
                              _kernel="rows64_seesaw")
    ref, _ = mla_decode_ref(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                            softmax_scale=c["softmax_scale"], causal=True)
    err = (out.float() - ref).abs().max().item()
    worst[False] = max(worst[False], err)
    print(f"rows64_seesaw, long and short parts (lens [20000, 12000, 20000], h_q 32, s_q 2): max |err| {err:.2e}",
          flush=True)
    assert worst[False] < 3e-2 and worst[True] < 0.2, worst  # e4m3 Q and P: tests/test_decode_fp8_mma_gpu.py


SPARSE_CASES = [  # (lead, h_q, topk, page_size, cache)
    ((2, 2), 16, 700, 64, "16-bit"),
    ((3,), 128, 300, 1, "ds"),
    ((4,), 16, 700, 64, "ds"),  # the narrow kernel's ds_mla_fp8 form: 16 rows
    ((4,), 32, 500, 1, "ds"),   # 32 rows
    ((2,), 64, 2048, 24, "fp8"),
]


def check_sparse_decode():
    for lead, h_q, topk, page, fmt in SPARSE_CASES:
        md = None
        for seed in (0, 1):  # one schedule (shapes only) for two index sets, the second with a sink
            case = to_device(make_sparse_case(lead, h_q, topk, page, lengths=True, fp8=fmt == "fp8",
                                              ds_fp8=fmt == "ds", sink="finite" if seed else None, seed=seed),
                             "cuda")
            md = md or mla_attn.get_sparse_decode_metadata(case["indices"], h_q)
            out, lse = run_sparse(case, metadata=md)
            check_sparse(case, out, lse)  # against float64; raises on a mismatch
            print(f"sparse lead={lead} h_q={h_q} topk={topk} page={page} cache={fmt} seed={seed}: ok", flush=True)


def check_unchecked_values():
    """validate=False with values the kernels must survive (tests/test_unchecked_values_gpu.py)."""
    overlong, _ = make_overlong_decode_case(2, 64, 64)
    overlong = to_device(overlong)
    for kernel in decode_kernels_for(torch.bfloat16, 128):
        mla_attn.mla_decode(overlong["q"], overlong["kv_cache"], overlong["block_table"], overlong["cache_seqlens"],
                            softmax_scale=overlong["softmax_scale"], causal=True, validate=False, _kernel=kernel)
    c = to_device(make_decode_case([300, 70, 0, 129, 64], 2, 64, 64, varlen=True))
    bad = scramble_cu_seqlens(c["cu_seqlens_q"], c["q"].shape[0])
    for kernel in decode_kernels_for(torch.bfloat16, 128):
        mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], cu_seqlens_q=bad,
                            max_seqlen_q=2, softmax_scale=c["softmax_scale"], causal=True, validate=False,
                            _kernel=kernel)
    p = to_device(make_prefill_case([200, 5, 64, 90], [300, 0, 64, 128], 2))
    mla_attn.mla_prefill(p["q"], p["k"], p["v"], scramble_cu_seqlens(p["cu_seqlens_q"], p["q"].shape[0]),
                         scramble_cu_seqlens(p["cu_seqlens_k"], p["k"].shape[0]), p["max_seqlen_q"], p["max_seqlen_k"],
                         softmax_scale=p["softmax_scale"], causal=True, validate=False)
    # indices_valid=True with every index counted, the garbage tails (-1, past the cache) included: clamped
    for fmt in ("bf16", "fp8"):
        case = make_sparse_case((4,), 128, 300, 1, lengths=True, fp8=fmt == "fp8", seed=3)
        case = to_device(dict(valid_first(case), topk_length=None), "cuda")
        for kernel in decode_kernels_for(case["kv_cache"].dtype, 128):
            run_sparse(case, indices_valid=True, validate=False, _kernel=kernel)
    # torch.ops decode with fewer parts than its schedule (slots clamped into the smaller workspace) and with a
    # larger batch's tile_sched (requests clamped to the batch)
    c = to_device(make_decode_case([3200, 3200, 40000], 1, 16, 64, seed=9))
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], 16, s_q=1)
    larger = mla_attn.get_decode_metadata(c["cache_seqlens"].new_tensor([3200, 3200, 40000] + [9000] * 3), 16, s_q=1)
    args = (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], None, 1, c["softmax_scale"], True)
    for kernel in decode_kernels_for(torch.bfloat16, 16):
        for tile_sched, parts in ((md.tile_sched, 1), (md.tile_sched, 2), (larger.tile_sched, larger.num_sm_parts)):
            torch.ops.mla_attn.mla_decode(*args, tile_sched, md.req_splits, parts, split_kernel=kernel)
    torch.cuda.synchronize()
    print("lengths past the block table, out-of-range cu_seqlens, unchecked sparse slots, schedules of another call:"
          " ran", flush=True)


def main():
    check_prefill()
    check_merge_and_cache()
    check_decode()
    check_sparse_decode()
    check_unchecked_values()


if __name__ == "__main__":
    main()
