"""Every error path of every op, straight through torch.ops.mla_attn.* (bypassing the wrappers).

GPU part: one case per TORCH_CHECK of csrc/bindings/{checks.h, decode_api.cpp, kv_cache_api.cpp,
merge_api.cpp, prefill_api.cpp, sparse_api.cpp} that an input can reach, matched on its message (TORCH_CHECK raises
RuntimeError). The cases run one after another in one process, and test_gpu_errors_back_to_back
raises them all again in a row: a build once crashed (SIGSEGV) on the second error raised in a
process. Not reachable from inputs, so not here: check_sm90 on an sm_90 GPU, the dtype-dispatch and
"built without" errors behind earlier dtype checks, TMA descriptor failures, compact_sparse_indices' limit
of 2^31 - 1 rows (gigabytes of indices; its topk limit has a test of its own, on 8 GiB).
CPU part: the CPU kernels run the wrappers' checks (_validation.py): the same cases raise TypeError
(kind: dtype, device, Python type) or ValueError (shape, layout, value), with the wrappers' messages;
then the wrappers' checks that only they make.
"""
import math

import numpy as np
import pytest
import torch
from cases import make_decode_case, make_prefill_case
from conftest import to_device

import mla_attn
from mla_attn.distributed import cp_mla_decode, cp_slice, cp_token_slot

FP8 = torch.float8_e4m3fn
R, V, T = RuntimeError, ValueError, TypeError


# ------------------------------------------------------------------------------------------- inputs
def invoke(op_name, named):
    """torch.ops.mla_attn.<op_name> with its arguments by name (positional or keyword-only as the schema says)."""
    op = getattr(torch.ops.mla_attn, op_name).default
    args, kwargs = [], {}
    for a in op._schema.arguments:
        if a.name in named:
            if a.kwarg_only:
                kwargs[a.name] = named[a.name]
            else:
                args.append(named[a.name])
    return op(*args, **kwargs)


def shifted(t):
    """t's values one element into a buffer: the base address is not 16-byte aligned."""
    buf = torch.zeros(t.numel() + 8, dtype=t.dtype, device=t.device)
    view = buf[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def padded(t):
    """t with each last-dim row padded by one element: outer strides not multiples of 16 bytes."""
    buf = torch.zeros(t.shape[:-1] + (t.shape[-1] + 1,), dtype=t.dtype, device=t.device)
    buf[..., :-1] = t
    return buf[..., :-1]


def _second_storage(t):
    """t's memory under a storage of its own (DLPack builds one, as an engine handing a buffer over
    would): torch's storage-based overlap check does not see the two as one memory."""
    alias = torch.from_dlpack(t.detach())
    assert alias.data_ptr() == t.data_ptr() and alias.untyped_storage()._cdata != t.untyped_storage()._cdata
    return alias


def one_row_on(t, second_storage=False):
    """A view of t's storage one row further on: it shares all but one of t's rows (the storage must go on).
    second_storage: the view is taken of t's whole storage reached through a storage of its own."""
    base = t
    if second_storage:
        whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0,
                                                                    (t.untyped_storage().nbytes() // t.element_size(),))
        base = _second_storage(whole)
    return torch.as_strided(base, t.shape, t.stride(), t.storage_offset() + t.stride(0))


def output_over(a, name, output, second_storage=False):
    """Input `name` made contiguous and output `output` shaped as before over its first bytes (the input
    must be at least as large); with second_storage, through a storage of its own."""
    t = a[name].contiguous()
    like = a[output]
    over = _second_storage(t) if second_storage else t
    return {name: t, output: over.reshape(-1).view(torch.uint8)[:like.numel() * like.element_size()]
            .view(like.dtype).view(like.shape)}


def page_257(cache):
    """A cache of one page of 257 rows, like `cache` otherwise: past the largest page size."""
    return torch.zeros((1, 257) + tuple(cache.shape[2:]), dtype=cache.dtype, device=cache.device)


SINK_MESSAGE = r"attn_sink must be a contiguous float32 tensor of shape \[h_q\] on q's device"


def sink(a, *, heads=None, dtype=torch.float32, step=1):
    """An attn_sink for the decode inputs `a`: [heads (h_q)] of dtype, every step-th value of a buffer."""
    heads = a["q"].shape[-2] if heads is None else heads
    return torch.zeros(heads * step, dtype=dtype, device=a["q"].device)[::step]


def strided_last(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def inputs(device):
    """Valid arguments of every op, by op name, on `device`."""
    c = to_device(make_decode_case([20, 3], 2, 4, 16), device)
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], 4, s_q=2)
    decode = dict(q=c["q"], q_pe=None, kv_cache=c["kv_cache"], block_table=c["block_table"],
                  cache_seqlens=c["cache_seqlens"], cu_seqlens_q=None, max_seqlen_q=2, softmax_scale=0.1,
                  causal=True, tile_sched=md.tile_sched, req_splits=md.req_splits, num_sm_parts=md.num_sm_parts)
    cv = to_device(make_decode_case([20, 3], 2, 4, 16, varlen=True), device)
    decode_varlen = dict(decode, q=cv["q"], cu_seqlens_q=cv["cu_seqlens_q"])
    decode_out = dict(decode, out=torch.empty(2, 2, 4, 512, dtype=torch.bfloat16, device=device),
                      lse=torch.empty(2, 2, 4, device=device))
    scale = torch.tensor([0.5], device=device)
    decode_fp8 = dict(decode, kv_cache=c["kv_cache"].to(FP8), k_scale=scale)
    decode_ds = dict(decode, kv_cache=torch.zeros(c["kv_cache"].shape[:-1] + (656,), dtype=torch.uint8, device=device))
    metadata = dict(cache_seqlens=c["cache_seqlens"], cu_seqlens_q=None, max_seqlen_q=2, num_heads_q=4, causal=True,
                    num_sm_parts=md.num_sm_parts, num_sms=md.tile_sched.shape[0])

    x = torch.randn(6, 576, device=device).bfloat16()
    cache = torch.zeros(3, 16, 576, dtype=torch.bfloat16, device=device)
    write = dict(kv_c=x[:, :512], k_pe=x[:, 512:], kv_cache=cache,
                 slot_mapping=torch.arange(6, dtype=torch.int64, device=device))
    gather = dict(kv_cache=cache, block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=device),
                  cu_seqlens=torch.tensor([0, 20, 23], dtype=torch.int32, device=device), num_tokens=25)
    ds_cache = torch.zeros(3, 16, 656, dtype=torch.uint8, device=device)  # ds_mla_fp8 rows
    write_ds, gather_ds = dict(write, kv_cache=ds_cache), dict(gather, kv_cache=ds_cache)

    o = torch.randn(2, 5, 3, 16, device=device).bfloat16()
    lse = torch.randn(2, 5, 3, device=device)
    merge = dict(out_a=o[0], lse_a=lse[0], out_b=o[1], lse_b=lse[1])
    merge_out = dict(merge, out=torch.empty_like(o[0]), lse=torch.empty_like(lse[0]))
    merge_n = dict(outs=o, lses=lse)

    p = to_device(make_prefill_case([5, 3], [7, 3], 4, split_pe=True, pad=0), device)
    prefill = dict(q=p["q"], k=p["k"], v=p["v"], cu_seqlens_q=p["cu_seqlens_q"], cu_seqlens_k=p["cu_seqlens_k"],
                   max_seqlen_q=5, max_seqlen_k=7, softmax_scale=0.1, causal=True, k_pe=p["k_pe"])
    prefill_out = dict(prefill, out=torch.empty(8, 4, 128, dtype=torch.bfloat16, device=device),
                       lse=torch.empty(8, 4, device=device))
    g = torch.Generator().manual_seed(0)
    compact = dict(indices=torch.randint(-1, 60, (3, 40), generator=g, dtype=torch.int32).to(device),
                   topk_length=torch.tensor([40, 0, 7], dtype=torch.int32, device=device), num_slots=48)
    return dict(compact_sparse_indices=compact,
                mla_decode=decode, mla_decode_varlen=decode_varlen, mla_decode_out=decode_out,
                mla_decode_fp8=decode_fp8, mla_decode_ds=decode_ds, get_decode_metadata=metadata, write_kv_cache=write,
                gather_kv_cache=gather, write_kv_cache_ds=write_ds, gather_kv_cache_ds=gather_ds, merge_attn_states=merge, merge_attn_states_out=merge_out,
                merge_attn_states_n=merge_n, mla_prefill=prefill, mla_prefill_out=prefill_out)


def raise_case(base, case):
    """Calls the case's op on its base inputs with the case's changes (a function of those inputs)."""
    key, change, *_ = case
    named = dict(base[key])
    named.update(change(named))
    invoke(key.split("_varlen")[0].split("_fp8")[0].split("_ds")[0], named)


def on(device):
    return lambda t: t.to(device)


def columns_on(t, by):
    """t's values in the first columns of a buffer twice as wide, and a view of that buffer `by` columns
    on: two views that are not dense and share part of their memory."""
    buf = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
    buf[..., :t.shape[-1]] = t
    return buf[..., :t.shape[-1]], buf[..., by:by + t.shape[-1]]


# Outputs over part of an input through views that are not dense, whose overlap torch's own test does
# not judge; the same on the CPU and the CUDA ops.
NON_DENSE_OVERLAPS = [
    ("mla_decode_out", lambda a: dict(out=a["q"][..., :512]), V, r"out shares memory with q"),
    ("mla_decode_out", lambda a: dict(out=a["kv_cache"].reshape(-1, 576)[:16, :512].view(2, 2, 4, 512)), V,
     r"out shares memory with kv_cache"),
    ("mla_prefill_out", lambda a: dict(out=a["q"][..., :128]), V, r"out shares memory with q"),
    ("merge_attn_states_out", lambda a: dict(zip(("out_a", "out"), columns_on(a["out_a"], 8))), V,
     r"out shares part of out_a's memory"),
    ("write_kv_cache", lambda a: dict(kv_c=a["kv_cache"].view(-1, 576)[40:46, :512]), V,
     r"kv_cache shares memory with kv_c"),
    ("write_kv_cache", lambda a: dict(k_pe=a["kv_cache"].view(-1)[:6 * 64].view(6, 64)), V,
     r"kv_cache shares memory with k_pe"),
]


# ------------------------------------------------------------------------------------------ GPU cases
# (inputs key, changes, exception, message pattern); one per reachable TORCH_CHECK
GPU_CASES = [
    # decode_api.cpp: mla_decode_cuda_impl
    ("mla_decode", lambda a: dict(softmax_scale=math.inf), R, r"softmax_scale must be a finite number > 0 .*got inf"),
    ("mla_decode", lambda a: dict(softmax_scale=0.0), R, r"softmax_scale must be a finite number > 0"),
    ("mla_decode", lambda a: dict(softmax_scale=1e39), R,  # finite, but not as a float32
     r"softmax_scale must be a finite number > 0 \(also as float32 times log2\(e\)\), got 1e\+39"),
    ("mla_decode", lambda a: dict(softmax_scale=5e-324), R, r"softmax_scale must be a finite number > 0 \(also as"),
    ("mla_decode_varlen", lambda a: dict(q=a["q"][None]), R, r"q must be \[B, s_q, h_q, D\] or, with cu_seqlens_q"),
    ("mla_decode", lambda a: dict(q=a["q"][0]), R, r"q must be \[B, s_q, h_q, D\] or, with cu_seqlens_q"),
    # a 0-dim q crashed the host (the out shape was taken from q's last dim)
    ("mla_decode", lambda a: dict(q=a["q"][0, 0, 0, 0]), R, r"q must be \[B, s_q, h_q, D\] or, with cu_seqlens_q"),
    ("mla_decode_out", lambda a: dict(q=a["q"][0, 0, 0, 0]), R, r"q must be \[B, s_q, h_q, D\] or, with cu_seqlens_q"),
    ("mla_decode_out", lambda a: dict(out=a["out"][0, 0, 0, 0]), R, r"out must be \[.., h_q, 512\] of q's dtype"),
    ("mla_decode", lambda a: dict(q=a["q"].float()), R, r"q must be bf16 or fp16"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"].half()), R, r"kv_cache dtype must equal q dtype"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"].to(FP8)), R,
     r"k_scale is required with, and only valid with, a float8_e4m3fn kv_cache"),
    ("mla_decode", lambda a: dict(fp8_mma=True), R, r"fp8_mma needs a float8_e4m3fn kv_cache"),
    ("mla_decode_ds", lambda a: dict(k_scale=torch.ones(1, device="cuda")), R,
     r"k_scale is required with, and only valid with, a float8_e4m3fn kv_cache"),
    ("mla_decode_ds", lambda a: dict(kv_cache=a["kv_cache"][..., :576]), R,
     r"kv_cache last dim must be 656 \(ds_mla_fp8\), contiguous"),
    ("mla_decode", lambda a: dict(kv_slots=True, skip_invalid_slots=True), V,
     r"skip_invalid_slots needs kv_slots and a ds_mla_fp8 cache"),
    ("mla_decode_ds", lambda a: dict(skip_invalid_slots=True), V,
     r"skip_invalid_slots needs kv_slots and a ds_mla_fp8 cache"),
    ("mla_decode_ds", lambda a: dict(split_kernel="fp8mma"), V,
     r"decode kernel 'fp8mma' cannot run this case: a ds_mla_fp8 cache is read by rows64, and by "
     r"narrow16 / narrow32 at up to 16 / 32 query rows per request"),
    ("mla_decode_fp8", lambda a: dict(k_scale=a["k_scale"].double()), R,
     r"k_scale must be a float32 tensor of shape \[1\] on q's device"),
    ("mla_decode_fp8", lambda a: dict(k_scale=a["k_scale"].cpu()), R, r"k_scale must be a float32 tensor"),
    ("mla_decode_fp8", lambda a: dict(k_scale=a["k_scale"].view(1, 1)), R,
     r"k_scale must be a float32 tensor of shape \[1\]"),
    ("mla_decode_fp8", lambda a: dict(fp8_mma=True, q_scale=a["k_scale"].view(())), R,
     r"q_scale must be a float32 tensor of shape \[1\]"),
    ("mla_decode_fp8", lambda a: dict(q_scale=a["k_scale"]), R, r"q_scale is only valid with fp8_mma=True"),
    ("mla_decode_fp8", lambda a: dict(fp8_mma=True, q_scale=a["k_scale"].double()), R,
     r"q_scale must be a float32 tensor of shape \[1\] on q's device"),
    ("mla_decode", lambda a: dict(q=a["q"][..., :512]), R, r"q last dim must be 576, or 512 with q_pe given"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"][:, :, None].expand(-1, -1, 2, -1)), R,
     r"kv_cache must be \[pages, page_size, 576\] or \[pages, page_size, 1, 576\]"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"][..., :512]), R, r"kv_cache last dim must be 576, contiguous"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"][:, :0]), R, r"page_size must be in \[1, 256\], got 0"),
    ("mla_decode", lambda a: dict(kv_cache=page_257(a["kv_cache"])), R, r"page_size must be in \[1, 256\], got 257"),
    ("mla_decode", lambda a: dict(block_table=a["block_table"][0]), R, r"block_table must be \[B, max_pages\]"),
    ("mla_decode", lambda a: dict(attn_sink=sink(a, dtype=torch.float64)), R, SINK_MESSAGE),
    ("mla_decode", lambda a: dict(attn_sink=sink(a, heads=a["q"].shape[-2] + 1)), R, SINK_MESSAGE),
    ("mla_decode", lambda a: dict(attn_sink=sink(a, step=2)), R, SINK_MESSAGE),
    ("mla_decode", lambda a: dict(attn_sink=sink(a).cpu()), R, SINK_MESSAGE),
    # page ids are clamped to num_pages - 1 (a slot list over no page is empty: test_sparse_gpu.py)
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"][:0]), R, r"kv_cache must hold at least one page, got 0"),
    ("mla_decode_ds", lambda a: dict(kv_cache=a["kv_cache"][:0]), R, r"kv_cache must hold at least one page, got 0"),
    ("mla_decode", lambda a: dict(q=strided_last(a["q"])), R, r"q and q_pe must be contiguous in the last dim"),
    ("mla_decode", lambda a: dict(q=shifted(a["q"])), R, r"mla_attn: q must be 16-byte aligned"),
    ("mla_decode", lambda a: dict(q=padded(a["q"])), R, r"mla_attn: q stride\(1\) must be a multiple of 16 bytes"),
    ("mla_decode", lambda a: dict(q=a["q"][..., :512].contiguous(), q_pe=shifted(a["q"][..., 512:])), R,
     r"q_pe must be 16-byte aligned"),
    ("mla_decode", lambda a: dict(kv_cache=shifted(a["kv_cache"])), R, r"kv_cache must be 16-byte aligned"),
    ("mla_decode_out", lambda a: dict(out=shifted(a["out"])), R, r"out must be 16-byte aligned"),
    ("mla_decode", lambda a: dict(block_table=a["block_table"].cpu()), R, r"all tensors must be on cuda"),
    ("mla_decode", lambda a: dict(block_table=a["block_table"].long()), R, r"block_table must be int32"),
    ("mla_decode", lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), R, r"cache_seqlens must be int32"),
    # rank-2 lengths were read flat
    ("mla_decode", lambda a: dict(cache_seqlens=a["cache_seqlens"][:, None]), R, r"cache_seqlens must be \[B\], got \[2, 1\]"),
    ("mla_decode", lambda a: dict(cache_seqlens=a["cache_seqlens"][0]), R, r"cache_seqlens must be \[B\], got \[\]"),
    ("mla_decode", lambda a: dict(tile_sched=a["tile_sched"].long()), R, r"tile_sched must be int32"),
    ("mla_decode", lambda a: dict(tile_sched=a["tile_sched"].cpu()), R, r"tile_sched must be on cuda"),
    ("mla_decode", lambda a: dict(req_splits=a["req_splits"].long()), R, r"req_splits must be int32"),
    ("mla_decode", lambda a: dict(block_table=strided_last(a["block_table"])), R,
     r"block_table must be contiguous in its last dim"),
    ("mla_decode", lambda a: dict(block_table=a["block_table"][:1]), R, r"block_table must be \[B, max_pages\]"),
    ("mla_decode", lambda a: dict(tile_sched=a["tile_sched"][:, :7]), R,
     r"metadata must be contiguous tile_sched \[num_sms, 8\] and req_splits \[B, 2\]"),
    ("mla_decode", lambda a: dict(req_splits=torch.cat([a["req_splits"]] * 2)), R,
     r"metadata was made for another batch size"),
    ("mla_decode_varlen", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), R, r"cu_seqlens_q must be int32"),
    ("mla_decode_varlen", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][:2]), R, r"cu_seqlens_q must be \[B \+ 1\], got \[2\]"),
    ("mla_decode_varlen", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][None]), R,
     r"cu_seqlens_q must be \[B \+ 1\], got \[1, 3\]"),
    ("mla_decode", lambda a: dict(max_seqlen_q=3), R, r"q must be \[B, s_q, h_q, D\](?! or)"),
    ("mla_decode", lambda a: dict(q=torch.zeros(2, 2, 129, 576, dtype=torch.bfloat16, device="cuda")), R,
     r"h_q must be in \[1, 128\]"),
    ("mla_decode_varlen", lambda a: dict(max_seqlen_q=0), R, r"max_seqlen_q must be in \[1, 512\]"),
    ("mla_decode_varlen", lambda a: dict(max_seqlen_q=513), R, r"max_seqlen_q must be in \[1, 512\]"),
    ("mla_decode", lambda a: dict(num_sm_parts=0), R, r"num_sm_parts out of range"),
    # decode_api.cpp: mla_decode_out_cuda, get_decode_metadata_cuda
    ("mla_decode_out", lambda a: dict(out=a["out"].float()), R, r"out must be \[.., h_q, 512\] of q's dtype"),
    ("mla_decode_out", lambda a: dict(lse=a["lse"].double()), R, r"lse must be float32"),
    ("mla_decode_out", lambda a: dict(out=a["out"][:1]), R,
     r"out must be \[.., h_q, 512\] and lse \[.., h_q\] with q's leading dims"),
    ("mla_decode_out", lambda a: dict(lse=a["lse"][:, :1]), R,
     r"out must be \[.., h_q, 512\] and lse \[.., h_q\] with q's leading dims"),
    # outputs with two elements at one address: stride 0, and heads 256 elements apart in 512-wide rows
    ("mla_decode_out", lambda a: dict(out=a["out"][:, :, :1].expand(-1, -1, 4, -1)), R, r"out: elements overlap in memory"),
    ("mla_decode_out", lambda a: dict(out=torch.empty(2 * 2 * 4 * 256 + 256, dtype=torch.bfloat16, device="cuda")
                                      .as_strided((2, 2, 4, 512), (2048, 1024, 256, 1))), R,
     r"out: elements overlap in memory"),
    ("mla_decode_out", lambda a: dict(lse=a["lse"][:, :, :1].expand(-1, -1, 4)), R, r"lse: elements overlap in memory"),
    # outputs over inputs, which other CTAs still read
    ("mla_decode_out", lambda a: output_over(a, "kv_cache", "out"), V, r"out shares memory with kv_cache"),
    ("mla_decode_out", lambda a: output_over(a, "q", "lse"), V, r"lse shares memory with q"),
    ("mla_decode_out", lambda a: output_over(a, "out", "lse"), V, r"lse shares memory with out"),
    # the same memory under a second storage (DLPack), which torch's own overlap check does not see
    ("mla_decode_out", lambda a: output_over(a, "q", "lse", second_storage=True), V, r"lse shares memory with q"),
    # one non-dense tensor as input and output (q a slice of the 576-wide rows, q_pe the rest): torch's
    # check sees it, the byte ranges (dense tensors only) do not
    ("mla_decode_out", lambda a: (lambda q: dict(q=q, q_pe=a["q"][..., 512:], out=q))(a["q"][..., :512]), V,
     r"out shares memory with q"),
    ("mla_decode", lambda a: dict(q=a["q"][..., :512].contiguous(), q_pe=a["q"][..., 512:].half()), R,
     r"q_pe must be \[.., h_q, 64\] of q's dtype with q's leading dims"),
    ("mla_decode", lambda a: dict(q=a["q"][..., :512].contiguous(), q_pe=a["q"][:1, ..., 512:].contiguous()), R,
     r"q_pe must be \[.., h_q, 64\] of q's dtype with q's leading dims"),
    ("mla_decode", lambda a: dict(q=a["q"][..., :512].contiguous(), q_pe=a["q"][..., 512:].cpu()), R,
     r"all tensors must be on cuda"),
    ("get_decode_metadata", lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), R, r"cache_seqlens must be int32"),
    ("get_decode_metadata", lambda a: dict(cache_seqlens=a["cache_seqlens"][:, None]), R,
     r"cache_seqlens must be \[B\], got \[2, 1\]"),
    ("get_decode_metadata", lambda a: dict(num_sm_parts=0), R, r"need 1 <= num_sm_parts <= num_sms <= 1024"),
    ("get_decode_metadata", lambda a: dict(num_sms=2**31), R, r"need 1 <= num_sm_parts <= num_sms <= 1024"),
    ("get_decode_metadata", lambda a: dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), R,
     r"cu_seqlens_q must be on cuda"),
    ("get_decode_metadata", lambda a: dict(cache_seqlens=torch.zeros(50001, dtype=torch.int32, device="cuda")), R,
     r"get_decode_metadata supports at most 50000 requests"),
    # kv_cache_api.cpp: check_cache (through gather, which checks the cache first)
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].float()), R,
     r"kv_cache must be bfloat16, float16, float8_e4m3fn or uint8 \(ds_mla_fp8\), got Float"),
    ("gather_kv_cache_ds", lambda a: dict(kv_format="fp8_ds_mla"), V,
     r"unknown kv_format 'fp8_ds_mla'; the formats are model, fp8, ds_mla_fp8"),
    ("write_kv_cache", lambda a: dict(kv_format="ds_mla_fp8"), V,
     r"kv_format='ds_mla_fp8' needs a uint8 kv_cache, got BFloat16"),
    ("gather_kv_cache_ds", lambda a: dict(kv_cache=a["kv_cache"][..., :576]), R,
     r"kv_cache must be \[num_pages, page_size, 656\] or \[num_pages, page_size, 1, 656\], contiguous"),
    ("gather_kv_cache_ds", lambda a: dict(kv_cache=shifted(a["kv_cache"])), R, r"kv_cache must be 16-byte aligned"),
    ("gather_kv_cache_ds", lambda a: dict(k_scale=torch.ones(1, device="cuda")), V,
     r"k_scale is not used with a ds_mla_fp8 kv_cache \(its scales are in the rows\)"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"][..., :512]), R,
     r"kv_cache must be \[num_pages, page_size, 576\] or \[num_pages, page_size, 1, 576\], contiguous"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"][:, :0]), R, r"page_size must be in \[1, 256\], got 0"),
    ("gather_kv_cache", lambda a: dict(kv_cache=page_257(a["kv_cache"])), R, r"page_size must be in \[1, 256\], got 257"),
    ("write_kv_cache", lambda a: dict(kv_cache=page_257(a["kv_cache"])), R, r"page_size must be in \[1, 256\], got 257"),
    ("gather_kv_cache", lambda a: dict(kv_cache=shifted(a["kv_cache"])), R, r"kv_cache must be 16-byte aligned"),
    ("gather_kv_cache", lambda a: dict(kv_cache=padded(a["kv_cache"])), R,
     r"kv_cache stride\(1\) must be a multiple of 16 bytes"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].cpu()), R, r"all tensors must be on cuda:\d+, got one on cpu"),
    ("gather_kv_cache", lambda a: dict(k_scale=torch.ones(1, device="cuda")), R,
     r"k_scale is only valid with a float8_e4m3fn kv_cache"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].to(FP8)), R,
     r"a float8_e4m3fn kv_cache needs k_scale \(float32, shape \[1\]\)"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].to(FP8), k_scale=torch.ones(2, device="cuda")), R,
     r"k_scale must be a float32 tensor of shape \[1\]"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].to(FP8), k_scale=torch.ones((), device="cuda")), R,
     r"k_scale must be a float32 tensor of shape \[1\]"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].to(FP8), k_scale=torch.ones(1)), R,
     r"all tensors must be on cuda:\d+, got one on cpu"),
    # kv_cache_api.cpp: write_kv_cache_cuda
    ("write_kv_cache", lambda a: dict(kv_c=a["kv_c"].float()), R, r"kv_c must be bfloat16 or float16, got Float"),
    ("write_kv_cache", lambda a: dict(kv_c=a["kv_c"][:, :256]), R, r"kv_c must be \[T, 512\], contiguous"),
    ("write_kv_cache", lambda a: dict(k_pe=a["k_pe"].half()), R, r"k_pe must have kv_c's dtype"),
    ("write_kv_cache", lambda a: dict(k_pe=a["k_pe"][:5]), R, r"k_pe must be \[T, 64\] or \[T, 1, 64\]"),
    ("write_kv_cache", lambda a: dict(kv_cache=a["kv_cache"][:1].expand(a["kv_cache"].shape)), R,
     r"kv_cache: elements overlap in memory"),
    ("write_kv_cache", lambda a: dict(slot_mapping=a["slot_mapping"].int()), R, r"slot_mapping must be int64 \[T\]"),
    ("write_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].half()), R,
     r"kv_cache must have kv_c's dtype or be float8_e4m3fn or uint8 \(ds_mla_fp8\)"),
    ("write_kv_cache_ds", lambda a: dict(kv_format="fp8"), V, r"kv_format='fp8' needs a float8_e4m3fn kv_cache, got Byte"),
    ("write_kv_cache", lambda a: dict(slot_mapping=a["slot_mapping"].cpu()), R, r"all tensors must be on cuda"),
    ("write_kv_cache", lambda a: dict(kv_c=shifted(a["kv_c"])), R, r"kv_c must be 16-byte aligned"),
    ("write_kv_cache", lambda a: dict(k_pe=shifted(a["k_pe"])), R, r"k_pe must be 16-byte aligned"),
    # kv_cache_api.cpp: gather_kv_cache_cuda
    ("gather_kv_cache", lambda a: dict(block_table=a["block_table"].long()), R, r"block_table must be int32"),
    ("gather_kv_cache", lambda a: dict(cu_seqlens=a["cu_seqlens"].long()), R, r"cu_seqlens must be int32"),
    ("gather_kv_cache", lambda a: dict(cu_seqlens=a["cu_seqlens"].cpu()), R, r"cu_seqlens must be on cuda"),
    ("gather_kv_cache", lambda a: dict(block_table=strided_last(a["block_table"])), R,
     r"block_table must be contiguous in its last dim"),
    ("gather_kv_cache", lambda a: dict(block_table=a["block_table"][0]), R, r"block_table must be \[B, max_pages\]"),
    ("gather_kv_cache", lambda a: dict(cu_seqlens=a["cu_seqlens"][:2]), R, r"cu_seqlens must be \[B \+ 1\]"),
    ("gather_kv_cache", lambda a: dict(num_tokens=-1), R, r"num_tokens must be >= 0"),
    ("gather_kv_cache", lambda a: dict(kv_cache=torch.zeros(1, 1, 576, dtype=torch.bfloat16, device="cuda")
                                       .expand(2**32, 1, 576)), R,  # 2^32 pages: 0 as an int
     r"kv_cache must have at most 2\^31 - 1 pages of at most 2\^31 - 1 rows"),
    ("gather_kv_cache", lambda a: dict(kv_cache=torch.zeros(1, 1, 576, dtype=torch.bfloat16, device="cuda")
                                       .expand(1, 2**32, 576)), R, r"page_size must be in \[1, 256\], got 4294967296"),
    ("gather_kv_cache", lambda a: dict(out_dtype=torch.int8), R, r"out_dtype must be bfloat16, float16 or float32"),
    # merge_api.cpp
    ("merge_attn_states", lambda a: dict(out_a=a["out_a"].double()), R,
     r"out_a must be bfloat16, float16 or float32, got Double"),
    ("merge_attn_states", lambda a: dict(out_b=a["out_b"].half()), R, r"out_b must have dtype BFloat16"),
    ("merge_attn_states", lambda a: dict(out_a=a["out_a"][..., :12], out_b=a["out_b"][..., :12]), R,
     r"out_a must be \[..., d\] with d a positive multiple of 8"),
    ("merge_attn_states", lambda a: dict(out_a=a["out_a"][..., :1].expand(*a["out_a"].shape[:-1], 2**31),
                                         out_b=a["out_b"][..., :1].expand(*a["out_b"].shape[:-1], 2**31)), R,
     r"out_a must be \[..., d\] with d a positive multiple of 8 below 2\^31"),
    ("merge_attn_states", lambda a: dict(out_a=strided_last(a["out_a"])), R, r"out_a must be contiguous in its last dim"),
    ("merge_attn_states", lambda a: dict(out_a=shifted(a["out_a"])), R, r"out_a must be 16-byte aligned"),
    ("merge_attn_states", lambda a: dict(out_a=padded(a["out_a"])), R, r"out_a stride\(0\) must be a multiple of 16 bytes"),
    ("merge_attn_states", lambda a: dict(out_b=a["out_b"][:3]), R, r"out_b must have out_a's shape"),
    ("merge_attn_states", lambda a: dict(lse_a=a["lse_a"].double()), R, r"lse_a must be float32, got Double"),
    ("merge_attn_states", lambda a: dict(lse_b=a["lse_b"][:3]), R, r"lse_b must have shape \[5, 3\]"),
    ("merge_attn_states", lambda a: dict(lse_a=a["lse_a"].cpu()), R, r"all tensors must be on cuda"),
    ("merge_attn_states", lambda a: dict(  # every other row of every leading dim: no two dims merge
        out_a=torch.zeros(4, 4, 4, 4, 6, 16, dtype=torch.bfloat16, device="cuda")[::2, ::2, ::2, ::2, ::2],
        out_b=torch.zeros(2, 2, 2, 2, 3, 16, dtype=torch.bfloat16, device="cuda"),
        lse_a=torch.zeros(2, 2, 2, 2, 3, device="cuda"), lse_b=torch.zeros(2, 2, 2, 2, 3, device="cuda")), V,
     r"merge supports at most 4 leading dims"),
    ("merge_attn_states_out", lambda a: dict(out=a["out"].half()), R, r"out must have dtype BFloat16"),
    ("merge_attn_states_out", lambda a: dict(lse=a["lse"].double()), R, r"lse must be float32"),
    ("merge_attn_states_out", lambda a: dict(out=a["out"][:1].expand(5, -1, -1)), R, r"out: elements overlap in memory"),
    ("merge_attn_states_out", lambda a: dict(lse=a["lse"][:1].expand(5, -1)), R, r"lse: elements overlap in memory"),
    # a view one row on races with the rows it shares (out = out_a itself is allowed: test_merge.py)
    ("merge_attn_states_out", lambda a: dict(out=one_row_on(a["out_a"])), V, r"out shares part of out_a's memory"),
    ("merge_attn_states_out", lambda a: dict(lse=one_row_on(a["lse_a"])), V, r"lse shares part of lse_a's memory"),
    ("merge_attn_states_out", lambda a: dict(out=one_row_on(a["out_a"], second_storage=True)), V,
     r"out shares part of out_a's memory"),
    ("merge_attn_states_out", lambda a: dict(  # 4 rows each: out is out_b's rows 1..4
        out_a=a["out_a"][:4], lse_a=a["lse_a"][:4], out_b=a["out_b"][:4], lse_b=a["lse_b"][:4],
        out=one_row_on(a["out_b"][:4]), lse=a["lse"][:4]), V, r"out shares part of out_b's memory"),
    ("merge_attn_states_out", lambda a: dict(lse=a["out"].view(torch.float32).view(-1)[:15].view(5, 3)), V,
     r"out and lse share memory"),
    ("merge_attn_states_n", lambda a: dict(outs=a["outs"][0, 0, 0], lses=a["lses"][0, 0, 0]), R,
     r"outs must be \[n, ..., d\]"),
    ("merge_attn_states_n", lambda a: dict(lses=a["lses"].double()), R, r"lses must be float32"),
    ("merge_attn_states_n", lambda a: dict(outs=a["outs"][:1].expand(2**31, *a["outs"].shape[1:]),
                                           lses=a["lses"][:1].expand(2**31, *a["lses"].shape[1:])), R,
     r"outs must hold at most 2\^31 - 1 inputs"),
    # prefill_api.cpp
    ("mla_prefill", lambda a: dict(q=a["q"][0]), R, r"q must be \[T_q, h_q, 192\]"),
    ("mla_prefill", lambda a: dict(q=a["q"].float()), R, r"q must be bf16 or fp16"),
    ("mla_prefill", lambda a: dict(q=a["q"][..., :128]), R, r"q must be \[T, h, 192\], got"),
    ("mla_prefill", lambda a: dict(k=a["k"][..., :64]), R, r"k \(k_nope with k_pe\) must be \[T, h, 128\]"),
    ("mla_prefill", lambda a: dict(v=a["v"].half()), R, r"v dtype must equal q's"),
    ("mla_prefill", lambda a: dict(v=strided_last(a["v"])), R, r"v must be contiguous in its last dim"),
    ("mla_prefill", lambda a: dict(v=a["v"].cpu()), R, r"v must be on cuda"),
    ("mla_prefill", lambda a: dict(q=shifted(a["q"].contiguous())), R, r"q must be 16-byte aligned"),
    ("mla_prefill", lambda a: dict(k=a["k"][:, :3], v=a["v"][:, :3]), R, r"h_q \(4\) must be a multiple of h_k \(3\)"),
    ("mla_prefill", lambda a: dict(v=a["v"][:5]), R, r"v must be \[T_k, h_k, 128\] like k"),
    ("mla_prefill_out", lambda a: dict(out=a["out"][:5]), R, r"out must be \[T_q, h_q, 128\]"),
    ("mla_prefill_out", lambda a: dict(lse=a["lse"].double()), R, r"lse must be float32 \[T_q, h_q\]"),
    ("mla_prefill_out", lambda a: dict(lse=a["lse"].cpu()), R, r"lse must be on cuda"),  # was written through
    ("mla_prefill_out", lambda a: dict(out=a["out"][:1].expand(8, -1, -1)), R, r"out: elements overlap in memory"),
    ("mla_prefill_out", lambda a: dict(lse=a["lse"][:, :1].expand(-1, 4)), R, r"lse: elements overlap in memory"),
    ("mla_prefill_out", lambda a: output_over(a, "q", "out"), V, r"out shares memory with q"),
    ("mla_prefill_out", lambda a: output_over(a, "v", "lse"), V, r"lse shares memory with v"),
    ("mla_prefill_out", lambda a: output_over(a, "out", "lse"), V, r"lse shares memory with out"),
    ("mla_prefill_out", lambda a: output_over(a, "q", "out", second_storage=True), V, r"out shares memory with q"),
    ("mla_prefill", lambda a: dict(k_pe=a["k_pe"][..., :32]), R, r"k_pe must be \[T, h, 64\]"),
    ("mla_prefill", lambda a: dict(k_pe=a["k_pe"].expand(-1, 2, -1)), R, r"k_pe must be \[T_k, 1, 64\]"),
    ("mla_prefill", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), R, r"cu_seqlens_q must be int32"),
    ("mla_prefill", lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"].cpu()), R, r"cu_seqlens_k must be on cuda"),
    ("mla_prefill", lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"][:2]), R,
     r"cu_seqlens_q and cu_seqlens_k must both be \[B \+ 1\]"),
    ("mla_prefill", lambda a: dict(max_seqlen_q=-1), R, r"max_seqlen_q must be in \[0, 2147483520\], got -1"),
    # the kernel's tile rows (num_m_blocks * 128) are ints
    ("mla_prefill", lambda a: dict(max_seqlen_q=2147483521), R, r"max_seqlen_q must be in \[0, 2147483520\]"),
    ("mla_prefill", lambda a: dict(max_seqlen_q=2**40), R, r"max_seqlen_q must be in \[0, 2147483520\]"),
    ("mla_prefill", lambda a: dict(softmax_scale=-1.0), R, r"softmax_scale must be a finite number > 0"),
    ("mla_prefill", lambda a: dict(softmax_scale=math.inf), R, r"softmax_scale must be a finite number > 0"),
    ("mla_prefill", lambda a: dict(softmax_scale=1e39), R, r"softmax_scale must be a finite number > 0 .*got 1e\+39"),
    ("mla_prefill", lambda a: dict(cu_seqlens_q=torch.zeros(65537, dtype=torch.int32, device="cuda"),
                                   cu_seqlens_k=torch.zeros(65537, dtype=torch.int32, device="cuda")), R,
     r"at most 65535 requests and heads"),
    # sparse_api.cpp
    ("compact_sparse_indices", lambda a: dict(indices=a["indices"].long()), R, r"indices must be int32"),
    ("compact_sparse_indices", lambda a: dict(indices=strided_last(a["indices"])), R,
     r"indices must be contiguous in its last dim"),
    ("compact_sparse_indices", lambda a: dict(indices=a["indices"][0]), R,
     r"indices must be \[R, topk\] with topk >= 1"),
    ("compact_sparse_indices", lambda a: dict(indices=a["indices"][:, :0]), R,
     r"indices must be \[R, topk\] with topk >= 1, got \[3, 0\]"),
    ("compact_sparse_indices", lambda a: dict(topk_length=a["topk_length"].long()), R, r"topk_length must be int32"),
    ("compact_sparse_indices", lambda a: dict(topk_length=a["topk_length"].cpu()), R, r"topk_length must be on cuda"),
    ("compact_sparse_indices", lambda a: dict(topk_length=a["topk_length"][:1]), R,
     r"topk_length must be \[R\] = \[3\], got \[1\]"),
    ("compact_sparse_indices", lambda a: dict(num_slots=-1), R, r"num_slots must be >= 0, got -1"),
] + NON_DENSE_OVERLAPS


def _ids(cases):
    return [f"{c[0]}-{i}" for i, c in enumerate(cases)]


@pytest.fixture(scope="module")
def gpu_inputs():
    return inputs("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids(GPU_CASES))
def test_gpu_error(gpu_inputs, case):
    with pytest.raises(case[2], match=case[3]):
        raise_case(gpu_inputs, case)


@pytest.mark.gpu
def test_gpu_topk_past_the_tile_limit():
    """compact_sparse_indices walks a row's int positions in tiles of 2048: a topk past 2^31 - 1 - 2048
    is refused (8 GiB of indices, never read)."""
    if torch.cuda.mem_get_info()[0] < 9 * 2**30:
        pytest.skip("needs 9 GiB of free GPU memory")
    indices = torch.empty(1, 2**31 - 2048, dtype=torch.int32, device="cuda")
    try:
        with pytest.raises(RuntimeError, match=r"topk must be at most 2147481599, got 2147481600"):
            torch.ops.mla_attn.compact_sparse_indices(indices, None, 16)
    finally:
        del indices
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_errors_back_to_back(gpu_inputs):
    """Every case again, in a row, then a valid call: the process survives them all."""
    for case in GPU_CASES:
        with pytest.raises(case[2], match=case[3]):
            raise_case(gpu_inputs, case)
    out, _ = invoke("mla_decode", gpu_inputs["mla_decode"])
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_gpu_wrappers_leave_overlap_to_the_op(gpu_inputs):
    """The public wrappers do not check out= against the inputs themselves: on CUDA the binding does,
    raising the ValueError and message they raised; the inputs under out stay unwritten."""
    d, p, m = gpu_inputs["mla_decode_out"], gpu_inputs["mla_prefill_out"], gpu_inputs["merge_attn_states_out"]
    d, p = {**d, **output_over(d, "q", "out")}, {**p, **output_over(p, "v", "out")}
    before = [t.clone() for t in (d["q"], p["v"], m["out_a"])]
    with pytest.raises(ValueError, match="out shares memory with q"):
        mla_attn.mla_decode(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], softmax_scale=0.1,
                            out=d["out"])
    with pytest.raises(ValueError, match="out shares memory with v"):
        mla_attn.mla_prefill(p["q"], p["k"], p["v"], p["cu_seqlens_q"], p["cu_seqlens_k"], 5, 7, softmax_scale=0.1,
                             causal=True, k_pe=p["k_pe"], out=p["out"])
    with pytest.raises(ValueError, match="out shares part of out_a's memory"):
        mla_attn.merge_attn_states(m["out_a"], m["lse_a"], m["out_b"], m["lse_b"], out=one_row_on(m["out_a"]))
    torch.cuda.synchronize()
    assert all(torch.equal(t, b) for t, b in zip((d["q"], p["v"], m["out_a"]), before))


# ------------------------------------------------------------------------------------------ CPU cases
# The CPU kernels: the wrappers' checks, so kind -> TypeError, shape / layout / value -> ValueError.
# (Tensors on two devices need two devices: the wrappers' tests cover them with the meta device.)
CPU_CASES = [
    ("mla_decode", lambda a: dict(softmax_scale=math.inf), V, r"softmax_scale must be a finite number > 0 .*got inf"),
    ("mla_decode", lambda a: dict(q=a["q"].float()), T, r"q must be bfloat16 or float16"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"].half()), T, r"kv_cache dtype torch.float16 must match q"),
    ("mla_decode", lambda a: dict(block_table=a["block_table"].long()), T, r"block_table must be int32"),
    ("mla_decode", lambda a: dict(q=a["q"][..., :512]), V, r"q must be \[B, s_q, h_q, 576\]"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"][:, :0]), V, r"page_size must be in \[1, 256\]"),
    ("mla_decode", lambda a: dict(kv_cache=page_257(a["kv_cache"])), V, r"page_size must be in \[1, 256\], got 257"),
    ("mla_decode", lambda a: dict(attn_sink=sink(a, step=2)), V, r"attn_sink must be contiguous, got stride 2"),
    ("write_kv_cache", lambda a: dict(kv_cache=page_257(a["kv_cache"])), V, r"page_size must be in \[1, 256\], got 257"),
    ("gather_kv_cache", lambda a: dict(kv_cache=page_257(a["kv_cache"])), V, r"page_size must be in \[1, 256\], got 257"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"][:0]), V, r"kv_cache must hold at least one page, got 0"),
    ("mla_decode", lambda a: dict(q=padded(a["q"])), V, r"q: stride\(1\) = 2308 elements is not a multiple of 16"),
    ("mla_decode", lambda a: dict(block_table=a["block_table"][:1]), V, r"block_table has 1 rows but cache_seqlens has 2"),
    ("mla_decode", lambda a: dict(fp8_mma=True), V, r"fp8_mma=True needs a float8_e4m3fn kv_cache"),
    ("mla_decode_ds", lambda a: dict(k_scale=torch.ones(1)), V, r"k_scale is not used with a ds_mla_fp8 kv_cache"),
    ("mla_decode_ds", lambda a: dict(kv_cache=a["kv_cache"][..., :576]), V, r"kv_cache must be \[num_pages, page_size, 656\]"),
    ("mla_decode", lambda a: dict(kv_slots=True, skip_invalid_slots=True), V,
     r"skip_invalid_slots needs kv_slots and a ds_mla_fp8 \(uint8\) kv_cache"),
    ("mla_decode_ds", lambda a: dict(skip_invalid_slots=True), V, r"skip_invalid_slots needs kv_slots"),
    ("mla_decode_ds", lambda a: dict(split_kernel="seesaw"), V,
     r"decode kernel 'seesaw' cannot read a ds_mla_fp8 kv_cache; narrow16, narrow32, rows64 do"),
    ("mla_decode", lambda a: dict(tile_sched=a["tile_sched"].long()), T, r"metadata.tile_sched must be a contiguous int32"),
    ("mla_decode", lambda a: dict(req_splits=torch.cat([a["req_splits"]] * 2)), V, r"metadata was computed for batch 4"),
    ("mla_decode", lambda a: dict(num_sm_parts=0), V, r"num_sm_parts=0 must be in \[1, num_sms=132\]"),
    ("mla_decode_fp8", lambda a: dict(k_scale=a["k_scale"].double()), T, r"k_scale must be a float32 tensor"),
    ("mla_decode_fp8", lambda a: dict(k_scale=a["k_scale"].expand(2)), V, r"k_scale must be a float32 tensor"),
    ("mla_decode_fp8", lambda a: dict(k_scale=None), V, r"a float8_e4m3fn kv_cache needs k_scale"),
    ("mla_decode_fp8", lambda a: dict(q_scale=a["k_scale"]), V, r"q_scale is only valid with fp8_mma=True"),
    ("mla_decode_varlen", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][:2]), V, r"cu_seqlens_q must have batch \+ 1"),
    ("mla_decode_out", lambda a: dict(out=a["out"].float()), T, r"out dtype torch.float32 must match q dtype"),
    ("mla_decode_out", lambda a: dict(lse=a["lse"].double()), T, r"lse must be float32"),
    ("get_decode_metadata", lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), T, r"cache_seqlens must be int32"),
    ("get_decode_metadata", lambda a: dict(num_sm_parts=0), V, r"num_sm_parts=0 must be in \[1, num_sms=132\]"),
    ("get_decode_metadata", lambda a: dict(num_sms=2**31), V, r"num_sms must be in \[1, 1024\], got 2147483648"),
    ("write_kv_cache", lambda a: dict(kv_c=a["kv_c"].float()), T, r"kv_c must be bfloat16 or float16"),
    ("write_kv_cache", lambda a: dict(slot_mapping=a["slot_mapping"].int()), T, r"slot_mapping must be int64"),
    ("write_kv_cache", lambda a: dict(k_pe=a["k_pe"][:5]), V, r"k_pe must be \[T, 64\] or \[T, 1, 64\]"),
    ("write_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].to(FP8)), V, r"float8_e4m3fn kv_cache needs k_scale"),
    ("gather_kv_cache", lambda a: dict(block_table=a["block_table"].long()), T, r"block_table must be int32"),
    ("gather_kv_cache", lambda a: dict(cu_seqlens=a["cu_seqlens"][:2]), V, r"cu_seqlens must have B \+ 1 = 3 entries"),
    ("gather_kv_cache", lambda a: dict(num_tokens=-1), V, r"num_tokens must be in \[0, 2147483647\], got -1"),
    ("gather_kv_cache", lambda a: dict(out_dtype=torch.int8), T, r"out_dtype must be None, bfloat16"),
    ("gather_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].float()), T,
     r"kv_cache must be bfloat16, float16, float8_e4m3fn or uint8 \(ds_mla_fp8\), got torch.float32"),
    ("write_kv_cache", lambda a: dict(kv_format="ds_mla_fp8"), V, r"kv_format='ds_mla_fp8' needs a uint8 kv_cache"),
    ("write_kv_cache_ds", lambda a: dict(kv_format="fp8"), V, r"kv_format='fp8' needs a float8_e4m3fn kv_cache"),
    ("write_kv_cache_ds", lambda a: dict(k_scale=torch.ones(1)), V, r"k_scale is not used with a ds_mla_fp8 kv_cache"),
    ("gather_kv_cache_ds", lambda a: dict(kv_format="fp8_ds_mla"), V, r"unknown kv_format 'fp8_ds_mla'"),
    ("gather_kv_cache_ds", lambda a: dict(kv_cache=a["kv_cache"][..., :576]), V,
     r"kv_cache must be \[num_pages, page_size, 656\] or \[num_pages, page_size, 1, 656\] \(ds_mla_fp8"),
    ("merge_attn_states", lambda a: dict(out_a=a["out_a"].double()), T, r"out_a must be bfloat16, float16 or float32"),
    ("merge_attn_states", lambda a: dict(out_b=a["out_b"][:3]), V, r"out_b shape \(3, 3, 16\) must match out_a"),
    ("merge_attn_states_out", lambda a: dict(lse=a["lse"][:2]), V, r"lse must have shape \(5, 3\)"),
    ("merge_attn_states_out", lambda a: dict(out=one_row_on(a["out_a"])), V, r"out shares part of out_a's memory"),
    ("merge_attn_states_out", lambda a: dict(lse=one_row_on(a["lse_a"])), V, r"lse shares part of lse_a's memory"),
    ("merge_attn_states_out", lambda a: dict(out=one_row_on(a["out_a"], second_storage=True)), V,
     r"out shares part of out_a's memory"),
    ("merge_attn_states_n", lambda a: dict(lses=a["lses"].double()), T, r"lses must be float32"),
    ("mla_prefill", lambda a: dict(softmax_scale=math.inf), V, r"softmax_scale must be a finite number > 0 .*got inf"),
    ("mla_prefill", lambda a: dict(v=a["v"].half()), T, r"v dtype torch.float16 must match q dtype"),
    ("mla_prefill", lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"].long()), T, r"cu_seqlens_k must be int32"),
    ("mla_prefill", lambda a: dict(k=a["k"][:, :3], v=a["v"][:, :3]), V, r"h_q = 4 must be a multiple of h_k = 3"),
    ("mla_prefill", lambda a: dict(max_seqlen_q=-1), V, r"max_seqlen_q must be in \[0, 2147483520\], got -1"),
    ("mla_prefill", lambda a: dict(max_seqlen_q=2**31 - 1), V, r"max_seqlen_q must be in \[0, 2147483520\]"),
    ("mla_prefill_out", lambda a: dict(out=a["out"][:5]), V, r"out must be \[8, 4, 128\]"),
    ("mla_prefill_out", lambda a: output_over(a, "q", "out"), V, r"out shares memory with q"),
    ("mla_prefill_out", lambda a: output_over(a, "out", "lse"), V, r"lse shares memory with out"),
    ("mla_decode_out", lambda a: output_over(a, "kv_cache", "out"), V, r"out shares memory with kv_cache"),
    ("mla_decode_out", lambda a: output_over(a, "q", "lse"), V, r"lse shares memory with q"),
    ("mla_decode_out", lambda a: output_over(a, "q", "lse", second_storage=True), V, r"lse shares memory with q"),
    ("mla_prefill_out", lambda a: output_over(a, "q", "out", second_storage=True), V, r"out shares memory with q"),
    ("compact_sparse_indices", lambda a: dict(indices=a["indices"].long()), T, r"indices must be int32"),
    ("compact_sparse_indices", lambda a: dict(indices=a["indices"][0]), V, r"indices must be 2-D"),
    ("compact_sparse_indices", lambda a: dict(indices=a["indices"][:, :0]), V,
     r"indices must be \[R, topk\] with topk >= 1"),
    ("compact_sparse_indices", lambda a: dict(topk_length=a["topk_length"].long()), T, r"topk_length must be int32"),
    ("compact_sparse_indices", lambda a: dict(topk_length=a["topk_length"][:1]), V,
     r"topk_length must be \[R\] = \[3\]"),
    ("compact_sparse_indices", lambda a: dict(num_slots=-1), V, r"num_slots must be in \[0, 2147483647\], got -1"),
    # a scale that float32 rounds to 0 (the kernels' scale * log2(e)): scores all 0
    ("mla_decode", lambda a: dict(softmax_scale=5e-324), V, r"softmax_scale must be a finite number > 0 \(also as float32"),
    ("get_decode_metadata", lambda a: dict(num_heads_q=0), V, r"num_heads_q must be in \[1, 128\], got 0"),
    ("get_decode_metadata", lambda a: dict(max_seqlen_q=0), V, r"max_seqlen_q must be in \[1, .*\], got 0"),
    # outputs of the in-place ops: a tensor each, no two elements at one address, on the inputs' device
    # (one on the meta device sent the call to the fake kernel, which returned with nothing written)
    ("mla_decode_out", lambda a: dict(out=None), T, r"out must be a tensor, got NoneType"),
    ("mla_decode_out", lambda a: dict(lse=a["lse"][:1].expand(a["lse"].shape)), V, r"lse: elements overlap in memory"),
    ("mla_decode_out", lambda a: dict(lse=a["lse"].to("meta")), T, r"lse is on meta but q is on cpu"),
    ("mla_decode_out", lambda a: dict(block_table=a["block_table"].to("meta")), T, r"block_table is on meta but q"),
    ("mla_decode", lambda a: dict(kv_cache=a["kv_cache"].to("meta")), T, r"kv_cache is on meta but q is on cpu"),
    ("mla_prefill_out", lambda a: dict(lse=None), T, r"lse must be a tensor, got NoneType"),
    ("mla_prefill_out", lambda a: dict(lse=a["lse"][:1].expand(a["lse"].shape)), V, r"lse: elements overlap in memory"),
    ("mla_prefill_out", lambda a: dict(out=a["out"].to("meta")), T, r"out is on meta but q is on cpu"),
    ("mla_prefill_out", lambda a: dict(k=a["k"].to("meta")), T, r"k is on meta but q is on cpu"),
    ("merge_attn_states_out", lambda a: dict(out=None), T, r"out must be a tensor, got NoneType"),
    ("merge_attn_states_out", lambda a: dict(lse=a["lse"].to("meta")), T, r"lse is on meta but out_a is on cpu"),
    ("merge_attn_states_out", lambda a: dict(out_b=a["out_b"].to("meta")), T, r"out_b is on meta but out_a"),
    ("write_kv_cache", lambda a: dict(kv_cache=a["kv_cache"].to("meta")), T, r"kv_cache is on meta but kv_c is on cpu"),
    ("write_kv_cache", lambda a: dict(slot_mapping=a["slot_mapping"].to("meta")), T, r"slot_mapping is on meta"),
    ("write_kv_cache", lambda a: dict(kv_cache=a["kv_cache"][:1].expand(a["kv_cache"].shape)), V,
     r"kv_cache: elements overlap in memory"),
] + NON_DENSE_OVERLAPS


@pytest.fixture(scope="module")
def cpu_inputs():
    return inputs("cpu")


@pytest.mark.parametrize("case", CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_kernel_error(cpu_inputs, case):
    with pytest.raises(case[2], match=case[3]):
        raise_case(cpu_inputs, case)


def test_cpu_valid_inputs_pass(cpu_inputs):
    """The base inputs of the cases are valid: each case fails for its own change only."""
    for key in cpu_inputs:
        raise_case(cpu_inputs, (key, lambda a: {}))


# The wrappers' own checks (arguments the ops do not take) and the exception rule on them.
def _decode_call(**kw):
    c = make_decode_case([20, 3], 2, 16, 16)  # 32 query rows per request
    kw = {"softmax_scale": 0.1, **kw}
    return lambda: mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], **kw)


WRAPPER_CASES = [
    ("softmax_scale None", _decode_call(softmax_scale=None), V, r"softmax_scale is required"),
    ("softmax_scale str", _decode_call(softmax_scale="0.1"), T, r"softmax_scale must be a number, got str"),
    ("metadata tuple", _decode_call(metadata=(1, 2)), T, r"metadata must be a DecodeMetadata"),
    ("unknown kernel", _decode_call(_kernel="narrow64"), V, r"unknown decode kernel 'narrow64'"),
    ("kernel not str", _decode_call(_kernel=3), T, r"kernel must be a str or None, got int"),
    ("kernel rows", _decode_call(_kernel="narrow16"), V, r"runs at most 16 query rows per request .* got 32"),
    ("kernel cache", _decode_call(_kernel="fp8mma"), V, r"'fp8mma' needs a float8_e4m3fn kv_cache"),
    ("metadata heads", lambda: mla_attn.get_decode_metadata(torch.zeros(2, dtype=torch.int32), 129, s_q=1), V,
     r"num_heads_q must be in \[1, 128\], got 129"),
    ("metadata lens dtype", lambda: mla_attn.get_decode_metadata(torch.zeros(2), 16, s_q=1), T,
     r"cache_seqlens must be int32"),
    ("prefill scale inf", lambda: mla_attn.mla_prefill(*_prefill_args(), softmax_scale=math.inf, causal=True), V,
     r"softmax_scale must be a finite number > 0"),
    ("prefill cu dtype", lambda: mla_attn.mla_prefill(*_prefill_args(cu_k=torch.int64), softmax_scale=0.1,
                                                      causal=True), T, r"cu_seqlens_k must be int32"),
    ("cp q shape", lambda: cp_mla_decode(torch.zeros(2, 2, 4, 576), None, None, None, softmax_scale=0.1), V,
     r"cp_mla_decode needs q \[B, 1, h_q, D\]"),
    ("cp rank", lambda: cp_slice(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16, 2, 2), V,
     r"rank 2 is not in \[0, world_size=2\)"),
    ("layer dims", lambda: mla_attn.MLAAttention(mla_attn.MLAConfig(hidden_size=64, num_heads=2, kv_lora_rank=256)), V,
     r"mla_attn kernels need kv_lora_rank=512, got 256"),
    ("batch table dtype", lambda: mla_attn.MLABatch.build([1], [3], torch.zeros(1, 1, dtype=torch.int64), 16, "cpu"),
     T, r"block_table tensor must be int32"),
    ("batch table strided",
     lambda: mla_attn.MLABatch.build([1], [3], strided_last(torch.zeros(2, 2, dtype=torch.int32)), 16, "cpu"), V,
     r"block_table tensor must be contiguous in its last dim"),
    # found by fuzzing the wrappers on CPU: each raised another exception type (or nothing) before
    ("softmax_scale huge int", _decode_call(softmax_scale=10**400), V, r"softmax_scale must be a finite number > 0"),
    ("softmax_scale huge negative int", _decode_call(softmax_scale=-10**400), V,
     r"softmax_scale must be a finite number > 0"),
    ("softmax_scale past float32", _decode_call(softmax_scale=1e300), V, r"softmax_scale must be a finite number > 0"),
    ("causal str", _decode_call(causal="yes"), T, r"causal must be a bool, got str"),
    ("validate str", _decode_call(validate=""), T, r"validate must be a bool or None, got str"),
    ("metadata flag", lambda: mla_attn.get_decode_metadata(torch.zeros(2, dtype=torch.int32), 16, s_q=1,
                                                           deterministic=1.0), T, r"deterministic must be a bool"),
    ("metadata cu length", lambda: mla_attn.get_decode_metadata(torch.zeros(2, dtype=torch.int32), 16,
                                                                cu_seqlens_q=torch.zeros(2, dtype=torch.int32),
                                                                max_seqlen_q=1), V,
     r"cu_seqlens_q must have batch \+ 1 = 3 entries, got 2"),
    ("prefill k None", lambda: mla_attn.mla_prefill(_prefill_args()[0], None, *_prefill_args()[2:], softmax_scale=0.1,
                                                    causal=True), T, r"k must be a tensor, got NoneType"),
    ("prefill max_seqlen int64", lambda: mla_attn.mla_prefill(*_prefill_args()[:5], 2**63, 7, softmax_scale=0.1,
                                                              causal=True), V,
     r"max_seqlen_q must be in \[0, 2147483520\]"),
    ("prefill requests", lambda: mla_attn.mla_prefill(*_prefill_args()[:3], torch.zeros(65537, dtype=torch.int32),
                                                      torch.zeros(65537, dtype=torch.int32), 5, 7, softmax_scale=0.1,
                                                      causal=True), V, r"at most 65535 requests and heads"),
    ("decode cache slots", lambda: mla_attn.mla_decode(
        torch.zeros(1, 1, 4, 576, dtype=torch.bfloat16), torch.zeros(1, 64, 576, dtype=torch.bfloat16).expand(2**25, -1, -1),
        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), softmax_scale=0.1), V,
     r"fewer than 2\^31 slots"),
    ("sparse topk 0", lambda: mla_attn.get_sparse_decode_metadata(torch.zeros(2, 0, dtype=torch.int32), 16), V,
     r"topk >= 1"),
    ("quantize kv_c", lambda: mla_attn.quantize_ds_mla_fp8(torch.zeros(2, 511, dtype=torch.bfloat16),
                                                          torch.zeros(2, 64, dtype=torch.bfloat16)), V,
     r"kv_c must be \[T, 512\]"),
    ("quantize None", lambda: mla_attn.quantize_ds_mla_fp8(None, torch.zeros(2, 64)), T, r"kv_c must be a tensor"),
    ("dequantize dtype", lambda: mla_attn.dequantize_ds_mla_fp8(torch.zeros(2, 656)), T, r"rows must be uint8"),
    ("dequantize shape", lambda: mla_attn.dequantize_ds_mla_fp8(torch.zeros(2, 600, dtype=torch.uint8)), V,
     r"rows must be \[..., 656\]"),
    ("cp page size", lambda: cp_token_slot(5, 0, 2), V, r"page_size must be in \[1, 2147483647\], got 0"),
    ("cp table rank", lambda: cp_slice(torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16, 2, 0),
     V, r"block_table must be 2-D"),
    ("batch lens float", lambda: mla_attn.MLABatch.build([float("inf")], [0], [[0]], 16, "cpu"), T,
     r"query_lens\[0\] must be an int, got float"),
    ("batch page size", lambda: mla_attn.MLABatch.build([1], [0], [[0]], 4.0, "cpu"), T, r"page_size must be an int"),
    ("batch page id", lambda: mla_attn.MLABatch.build([1], [0], [[2**31]], 16, "cpu"), V,
     r"block_table\[0\]: page ids must be in \[0, 2147483647\]"),
    ("batch used page id", lambda: mla_attn.MLABatch.build([1], [0], [[-1]], 16, "cpu"), V,
     r"block_table\[0\]: page ids must be in"),
    ("batch tensor page id", lambda: mla_attn.MLABatch.build([12, 9], [0, 0], torch.tensor([[-1, 1], [2, 3]],
                                                                                         dtype=torch.int32), 8, "cpu"),
     V, r"block_table\[0, 0\] = -1 is not a page id"),
    ("batch device", lambda: mla_attn.MLABatch.build([1], [0], [[0]], 16, "x"), V, r"device='x' is not a device"),
    ("batch device type", lambda: mla_attn.MLABatch.build([1], [0], [[0]], 16, 1.5), T,
     r"device must be a torch.device, str or int"),
    ("batch meta lens", lambda: mla_attn.MLABatch.build(torch.ones(1, dtype=torch.int32, device="meta"), [0], [[0]],
                                                        16, "cpu"), T, r"query_lens is a meta tensor"),
    ("metadata s_q varlen", lambda: mla_attn.get_decode_metadata(
        torch.zeros(2, dtype=torch.int32), 16, s_q=7, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        max_seqlen_q=1), V, r"s_q is for a uniform batch"),
    ("max_seqlen_q bool", _decode_call(max_seqlen_q=True), T, r"max_seqlen_q must be an int, got bool"),
    ("sparse prefill q dtype", lambda: mla_attn.mla_sparse_prefill(
        torch.zeros(3, 4, 576), torch.zeros(8, 576, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.int32),
        softmax_scale=0.1), T, r"q must be bfloat16 or float16, got torch.float32"),
    ("sparse prefill kv layout", lambda: mla_attn.mla_sparse_prefill(
        torch.zeros(3, 4, 576, dtype=torch.bfloat16), torch.zeros(8, 577, dtype=torch.bfloat16)[:, :576],
        torch.zeros(3, 4, dtype=torch.int32), softmax_scale=0.1), V, r"kv: stride\(0\) = 577 elements"),
    ("batch copy_", lambda: mla_attn.MLABatch.build([1], [0], [[0]], 16, "cpu").copy_(None), T,
     r"copy_ takes an MLABatch, got NoneType"),
    ("layer batch", lambda: _layer_call(batch=None), T, r"batch must be an MLABatch"),
    ("layer tokens", lambda: _layer_call(rows=3), V, r"hidden_states must be \[T, hidden_size\] = \[4, 128\]"),
    ("layer dtype", lambda: _layer_call(dtype=torch.float32), T, r"hidden_states dtype torch.float32 must be"),
    ("layer fp8_mma", lambda: _layer_call(fp8_mma=1), T, r"fp8_mma must be a bool"),
    ("layer topk_length", lambda: _layer_call(topk_length=torch.ones(4, dtype=torch.int32)), V,
     r"topk_length, indices_valid and sparse_metadata are options of sparse attention: they need indices"),
    ("layer indices_valid", lambda: _layer_call(indices_valid=True), V,
     r"topk_length, indices_valid and sparse_metadata are options of sparse attention: they need indices"),
    ("layer indices_valid int", lambda: _layer_call(indices_valid=1), T, r"indices_valid must be a bool, got int"),
    ("cp group", lambda: cp_mla_decode(torch.zeros(2, 1, 4, 576), None, None, None, softmax_scale=0.1, group="x"), T,
     r"group must be a torch.distributed ProcessGroup or None"),
    ("cp positions float", lambda: cp_token_slot(1.5, 16, 3), T, r"positions must be an int, an integer tensor or array"),
    ("cp positions negative", lambda: cp_token_slot(torch.tensor([3, -5]), 16, 3), V, r"positions must be >= 0"),
    ("cp positions numpy", lambda: cp_token_slot(np.array([3, -5]), 16, 3), V, r"positions must be >= 0"),
    ("cp lengths", lambda: cp_slice(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([-5, 10], dtype=torch.int32),
                                    16, 2, 0), V, r"cache_seqlens\[0\] = -5 is negative"),
]


def _layer_call(batch="build", rows=None, dtype=torch.bfloat16, **kw):
    """One decode step of a small layer (2 requests, 4 new tokens), with one argument changed."""
    layer = mla_attn.MLAAttention(mla_attn.MLAConfig(hidden_size=128, num_heads=2, q_lora_rank=48), dtype=torch.bfloat16)
    kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    if batch == "build":
        batch = mla_attn.MLABatch.build([1, 3], [5, 0], [[0, 1], [2, 3]], 16, "cpu", decode_threshold=1)
    x = torch.zeros(4 if rows is None else rows, 128, dtype=dtype)
    return layer(x, kv, batch, **kw)


def _prefill_args(cu_k=torch.int32):
    c = make_prefill_case([5, 3], [7, 3], 4, pad=0)
    return c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"].to(cu_k), 5, 7


@pytest.mark.parametrize("name,fn,exc,match", WRAPPER_CASES, ids=[c[0] for c in WRAPPER_CASES])
def test_wrapper_error(name, fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_dequantize_empty_strided_rows():
    """An empty view of wider rows (found by the fuzz: torch's byte-to-float view refused its strides)."""
    rows = torch.zeros(0, 658, dtype=torch.uint8)[:, :656]
    out = mla_attn.dequantize_ds_mla_fp8(rows)
    assert out.shape == (0, 576) and out.dtype == torch.float32
