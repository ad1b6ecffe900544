"""Paged latent KV cache write/gather: the CPU ops vs per-token loop oracles, write-then-gather round
trips (FP8 within e4m3 rounding), opcheck, torch.compile, input errors, and (gpu-marked) the CUDA
kernels bit-exact against the CPU ops on NaN-poisoned caches."""
import math

import pytest
import torch
from cases import HUGE_ID, write_layout
from conftest import leave_nan_blocks

import mla_attn
from mla_attn.kv_cache import FP8

OPS = torch.ops.mla_attn
D_C, D_PE, D = 512, 64, 576
NAN = float("nan")


# ------------------------------------------------------------------------------------------------ data
def make_cache(num_pages, page_size, dtype, *, kv_4d=False, padded=False, device="cpu", fill=NAN):
    """Poisoned cache; padded: one spare row per page, so the page stride is not page_size * 576."""
    cache = torch.full((num_pages, page_size + padded, D), fill).to(dtype).to(device)[:, :page_size]
    return cache[:, :, None] if kv_4d else cache


def make_tokens(T, dtype, *, pe_3d=False, fused=True, device="cpu", seed=0):
    """kv_c [T, 512] and k_pe [T, 64] | [T, 1, 64]; fused: both are views of one [T, 576] row (row
    stride 576, as split from the kv_a projection). Includes values that saturate and underflow fp8."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * 2
    x[:, ::97] *= 300.0
    x[:, 5::101] *= 1e-4
    x = x.to(dtype).to(device)
    kv_c, k_pe = (x[:, :D_C], x[:, D_C:]) if fused else (x[:, :D_C].contiguous(), x[:, D_C:].contiguous())
    return kv_c, (k_pe[:, None] if pe_3d else k_pe)


def make_slots(T, num_slots, *, skip_every=5, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:T].to(torch.int64)
    slots[::skip_every] = -1
    slots[1:2] = -(2**40)  # any negative value skips
    return slots.to(device)


def make_gather_case(lens, page_size, dtype, *, kv_4d=False, padded=False, extra_rows=5, fill=NAN, seed=0):
    """Requests with random cache rows, `fill` (NaN) past each length and in unused pages, permuted
    block table with garbage tails."""
    g = torch.Generator().manual_seed(seed)
    used = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(used) + 3
    cache = make_cache(num_pages, page_size, dtype, kv_4d=kv_4d, padded=padded, fill=fill)
    rows = _rows(cache)
    bt = torch.full((len(lens), max(used, default=0) + 2), HUGE_ID, dtype=torch.int32)
    bt[:, -1] = -7
    perm = torch.randperm(num_pages, generator=g).tolist()
    for b, n in enumerate(lens):
        pages = [perm.pop() for _ in range(used[b])]
        bt[b, : used[b]] = torch.tensor(pages, dtype=torch.int32)
        data = torch.randn(used[b] * page_size, D, generator=g) * 3
        data[n:] = fill
        for j, p in enumerate(pages):
            rows[p] = data[j * page_size:(j + 1) * page_size].to(dtype)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cache, bt, cu, int(cu[-1]) + extra_rows


def _bits(t):
    """Bitwise view (NaN-safe equality)."""
    return t.contiguous().view(torch.uint8)


def _rows(cache):
    return cache if cache.dim() == 3 else cache[:, :, 0]


# ------------------------------------------------------------------------------------- loop oracles
def write_loop(kv_c, k_pe, cache, slots, k_scale):
    cache = cache.clone()
    rows, ps = _rows(cache), cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        x = torch.cat([kv_c[t], k_pe[t].flatten()])
        if k_scale is not None:  # saturate at e4m3's largest finite value, then round to nearest
            x = (x.float() / float(k_scale)).clamp(-448.0, 448.0).to(FP8)
        rows[s // ps, s % ps] = x
    return cache


def gather_loop(cache, bt, cu, num_tokens, k_scale, out_dtype):
    rows, ps = _rows(cache), cache.shape[1]
    out = torch.zeros(num_tokens, D, dtype=out_dtype)
    cu = cu.tolist()
    for b in range(len(cu) - 1):
        for i in range(cu[b + 1] - cu[b]):
            if cu[b] + i >= num_tokens:
                break
            x = rows[int(bt[b, i // ps]), i % ps].float()
            out[cu[b] + i] = (x * float(k_scale) if k_scale is not None else x).to(out_dtype)
    return out


# ------------------------------------------------------------------------------------ ops on the CPU
WRITE_CASES = [  # (cache dtype, input dtype, page_size, kv_4d, padded, pe_3d, fused)
    (torch.bfloat16, torch.bfloat16, 16, False, False, False, True),
    (torch.float16, torch.float16, 64, True, True, True, False),
    (FP8, torch.bfloat16, 16, True, False, True, True),
    (FP8, torch.float16, 64, False, True, False, False),
]


def _scale(cache_dtype, device="cpu"):
    return torch.tensor([0.037], device=device) if cache_dtype == FP8 else None


@pytest.mark.parametrize("case", WRITE_CASES)
def test_write_cpu_vs_loop(case):
    cache_dtype, dtype, ps, kv_4d, padded, pe_3d, fused = case
    cache = make_cache(7, ps, cache_dtype, kv_4d=kv_4d, padded=padded)
    kv_c, k_pe = make_tokens(40, dtype, pe_3d=pe_3d, fused=fused)
    slots = make_slots(40, 7 * ps)
    k_scale = _scale(cache_dtype)
    want = write_loop(kv_c, k_pe, cache, slots, k_scale)
    mla_attn.write_kv_cache(kv_c, k_pe, cache, slots, k_scale=k_scale)
    assert torch.equal(_bits(cache), _bits(want))


GATHER_CASES = [  # (cache dtype, out_dtype, page_size, kv_4d, padded)
    (torch.bfloat16, None, 16, False, False),
    (torch.float16, None, 64, True, True),
    (torch.bfloat16, torch.float32, 64, False, True),
    (FP8, None, 16, True, False),
    (FP8, torch.float16, 64, False, True),
    (FP8, torch.float32, 16, False, False),
]
LENS = [37, 0, 130, 1, 64, 16]


@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("extra_rows", [0, 5])
def test_gather_cpu_vs_loop(case, extra_rows):
    cache_dtype, out_dtype, ps, kv_4d, padded = case
    cache, bt, cu, n = make_gather_case(LENS, ps, cache_dtype, kv_4d=kv_4d, padded=padded, extra_rows=extra_rows)
    k_scale = _scale(cache_dtype)
    got = mla_attn.gather_kv_cache(cache, bt, cu, n, k_scale=k_scale, out_dtype=out_dtype)
    want_dtype = out_dtype or (torch.bfloat16 if cache_dtype == FP8 else cache_dtype)
    assert got.dtype == want_dtype and got.shape == (n, D)
    assert torch.equal(_bits(got), _bits(gather_loop(cache, bt, cu, n, k_scale, want_dtype)))
    assert not got.isnan().any() and (got[int(cu[-1]):] == 0).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [1, 3, 8, 16, 24, 32, 64, 100, 128, 256])
def test_write_and_gather_at_every_page_size(page_size, cache_dtype, device):
    """Every page size decode takes (a slot is page * page_size + row): against the loops, on either
    device (poisoned rows past each length and in unused pages)."""
    k_scale = _scale(cache_dtype)
    on = {"device": device}
    cache, bt, cu, n = make_gather_case([37, 0, 300, 1], page_size, cache_dtype, seed=page_size)
    got = mla_attn.gather_kv_cache(cache.to(**on), bt.to(**on), cu.to(**on), n,
                                   k_scale=None if k_scale is None else k_scale.to(**on))
    want = gather_loop(cache, bt, cu, n, k_scale, torch.bfloat16)
    assert torch.equal(_bits(got.cpu()), _bits(want))
    written = make_cache(cache.shape[0], page_size, cache_dtype)
    kv_c, k_pe = make_tokens(40, torch.bfloat16, seed=page_size)
    slots = make_slots(40, cache.shape[0] * page_size, seed=page_size)
    want = write_loop(kv_c, k_pe, written, slots, k_scale)
    written = written.to(**on)
    mla_attn.write_kv_cache(kv_c.to(**on), k_pe.to(**on), written, slots.to(**on),
                            k_scale=None if k_scale is None else k_scale.to(**on))
    assert torch.equal(_bits(written.cpu()), _bits(want))


def test_gather_truncated_and_empty_batch():
    cache, bt, cu, _ = make_gather_case(LENS, 16, torch.bfloat16)
    got = mla_attn.gather_kv_cache(cache, bt, cu, 50)  # fewer rows than cached tokens: a prefix
    assert torch.equal(got, gather_loop(cache, bt, cu, 50, None, torch.bfloat16))
    empty = mla_attn.gather_kv_cache(cache, bt[:0], cu[:1], 3)
    assert empty.shape == (3, D) and (empty == 0).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_roundtrip(cache_dtype, device):
    """Write T tokens of a few requests through a permuted block table, gather them back."""
    ps, lens = 16, [5, 40, 0, 17]
    bt, slots, cu, num_pages = write_layout(lens, ps, seed=3)
    T = len(slots)
    kv_c, k_pe = make_tokens(T, torch.bfloat16, device=device, seed=4)
    cache = make_cache(num_pages, ps, cache_dtype, device=device)
    k_scale = _scale(cache_dtype, device)
    mla_attn.write_kv_cache(kv_c, k_pe, cache, torch.tensor(slots, device=device), k_scale=k_scale)
    got = mla_attn.gather_kv_cache(cache, bt.to(device), cu.to(device), T + 3, k_scale=k_scale)
    x = torch.cat([kv_c, k_pe], -1)
    assert (got[T:] == 0).all()
    got = got[:T]
    if cache_dtype != FP8:
        assert torch.equal(got, x)
        return
    xf, gf, s = x.float(), got.float(), float(k_scale)
    q = (xf / s).clamp(-448.0, 448.0)
    # e4m3: 3 mantissa bits, so round-to-nearest is within 2^-4 relative (normals, exponent >= -6) or
    # half the subnormal step 2^-9, plus the bf16 rounding of the read-back; saturated values read back
    # as +-448 * k_scale.
    err = (gf / s - q).abs()
    assert (err <= torch.clamp(q.abs() * 2**-4, min=2**-10) + q.abs() * 2**-8 + 1e-6).all()
    assert ((xf.abs() / s > 448) <= (gf.abs() == torch.tensor(448 * s).bfloat16().float())).all()


def _op_case(device="cpu", cache_dtype=torch.bfloat16):
    cache = make_cache(5, 16, cache_dtype, kv_4d=True, device=device, fill=0.0)
    kv_c, k_pe = make_tokens(12, torch.bfloat16, pe_3d=True, device=device)
    slots = make_slots(12, 5 * 16, device=device)
    # no NaN poison here: opcheck compares outputs with NaN-unequal checks
    gcache, bt, cu, n = make_gather_case([20, 0, 33], 16, cache_dtype, fill=0.0)
    return (kv_c, k_pe, cache, slots), (gcache.to(device), bt.to(device), cu.to(device), n)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_opcheck(cache_dtype, device):
    (kv_c, k_pe, cache, slots), gather_args = _op_case(device, cache_dtype)
    k_scale = _scale(cache_dtype, device)
    # test_schema compares the (mutated) cache with allclose, which float8 lacks
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    if cache_dtype != FP8:
        utils += ("test_schema",)
    torch.library.opcheck(OPS.write_kv_cache.default, (kv_c, k_pe, cache, slots), dict(k_scale=k_scale),
                          test_utils=utils)
    for out_dtype in (None, torch.float32):
        torch.library.opcheck(OPS.gather_kv_cache.default, gather_args,
                              dict(k_scale=k_scale, out_dtype=out_dtype), test_utils=utils)


def test_torch_compile_fullgraph():
    (kv_c, k_pe, cache, slots), (gcache, bt, cu, n) = _op_case()

    def fn(kv_c, k_pe, cache, slots, bt, cu):
        mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
        return mla_attn.gather_kv_cache(cache, bt, cu, n)

    bt = torch.zeros_like(bt)[:, :2] + torch.arange(2, dtype=torch.int32)
    cu = torch.tensor([0, 20, 20, 31], dtype=torch.int32)
    want_cache = cache.clone()
    want = fn(kv_c, k_pe, want_cache, slots, bt, cu)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(kv_c, k_pe, cache, slots, bt, cu)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)


# ----------------------------------------------------------------------------------------- validation
KV_C, K_PE = make_tokens(6, torch.bfloat16)
CACHE = make_cache(3, 16, torch.bfloat16)
SLOTS = make_slots(6, 48)
SCALE = torch.tensor([0.5])


def _w(**kw):
    args = dict(kv_c=KV_C, k_pe=K_PE, kv_cache=CACHE.clone(), slot_mapping=SLOTS)
    args.update(kw)
    mla_attn.write_kv_cache(**args)


WRITE_ERRORS = [
    (dict(kv_c=KV_C.float()), TypeError, r"kv_c must be bfloat16 or float16"),
    (dict(kv_c=KV_C[:, :256]), ValueError, r"kv_c must be \[T, 512\]"),
    (dict(k_pe=K_PE.half()), TypeError, r"k_pe dtype torch.float16 must match kv_c"),
    (dict(k_pe=K_PE[:5]), ValueError, r"k_pe must be \[T, 64\] or \[T, 1, 64\] with T = 6"),
    (dict(slot_mapping=SLOTS.int()), TypeError, r"slot_mapping must be int64"),
    (dict(slot_mapping=SLOTS[:5]), ValueError, r"slot_mapping must have shape \[T\] = \[6\]"),
    (dict(slot_mapping=SLOTS.to("meta")), TypeError, r"slot_mapping is on meta but kv_c is on cpu"),
    (dict(kv_cache=CACHE.half()), TypeError, r"kv_cache dtype torch.float16 must be kv_c's dtype"),
    (dict(kv_cache=CACHE.float()), TypeError, r"kv_cache must be bfloat16, float16, float8_e4m3fn or uint8"),
    (dict(kv_cache=CACHE[..., :512]), ValueError, r"kv_cache must be \[num_pages, page_size, 576\]"),
    (dict(kv_cache=CACHE[:, :, None].expand(-1, -1, 2, -1)), ValueError, r"kv_cache must be"),
    (dict(kv_cache=CACHE.to(FP8)), ValueError, r"float8_e4m3fn kv_cache needs k_scale"),
    (dict(kv_cache=CACHE.to(FP8), k_scale=SCALE.double()), TypeError, r"k_scale must be a float32 tensor of shape \[1\]"),
    (dict(kv_cache=CACHE.to(FP8), k_scale=torch.ones(())), ValueError, r"k_scale must be a float32 tensor"),
    (dict(kv_cache=CACHE.to(FP8), k_scale=SCALE.to("meta")), TypeError, r"k_scale is on meta"),
    (dict(k_scale=SCALE), ValueError, r"k_scale is only valid with a float8_e4m3fn kv_cache"),
    (dict(kv_cache=CACHE.transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError,
     r"kv_cache: last dim must be contiguous"),
    (dict(kv_c=torch.zeros(6, 513, dtype=torch.bfloat16)[:, :512]), ValueError, r"kv_c: stride\(0\) = 513"),
    (dict(slot_mapping=torch.full((6,), 48)), ValueError, r"slot_mapping\[0\] = 48 is past the cache's .* 48 slots"),
    # value checks (on CPU by default): a zero, negative or non-finite scale would fill the cache with +-448
    (dict(kv_cache=CACHE.to(FP8), k_scale=torch.zeros(1)), ValueError,
     r"k_scale must be finite and >= 1.175e-38 \(a normal float32\), got 0.0"),
    (dict(kv_cache=CACHE.to(FP8), k_scale=torch.tensor([-1.0])), ValueError, r"k_scale must be finite and >="),
    (dict(kv_cache=CACHE.to(FP8), k_scale=torch.tensor([1e-39])), ValueError, r"k_scale must be finite and >="),
    (dict(slot_mapping=torch.tensor([3, -1, 7, -1, 3, 5])), ValueError, r"slot_mapping names slot 3 more than once"),
]


@pytest.mark.parametrize("kw,exc,match", WRITE_ERRORS)
def test_write_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        _w(**kw)


GC, GBT, GCU, GN = make_gather_case([20, 3], 16, torch.bfloat16)


def _g(**kw):
    args = dict(kv_cache=GC, block_table=GBT, cu_seqlens=GCU, num_tokens=GN)
    args.update(kw)
    return mla_attn.gather_kv_cache(**args)


GATHER_ERRORS = [
    (dict(block_table=GBT.long()), TypeError, r"block_table must be int32"),
    (dict(cu_seqlens=GCU.long()), TypeError, r"cu_seqlens must be int32"),
    (dict(cu_seqlens=GCU[:2]), ValueError, r"cu_seqlens must have B \+ 1 = 3 entries"),
    (dict(cu_seqlens=GCU.to("meta")), TypeError, r"cu_seqlens is on meta"),
    (dict(kv_cache=GC.to("meta")), TypeError, r"kv_cache is on meta"),
    (dict(num_tokens=-1), ValueError, r"num_tokens must be in \[0, 2147483647\], got -1"),
    (dict(num_tokens=torch.tensor(3)), TypeError, r"num_tokens must be an int, got Tensor"),
    (dict(out_dtype=torch.int8), TypeError, r"out_dtype must be None, bfloat16, float16 or float32"),
    (dict(kv_cache=GC.to(FP8)), ValueError, r"needs k_scale"),
    (dict(k_scale=SCALE), ValueError, r"k_scale is only valid"),
    (dict(cu_seqlens=torch.tensor([1, 20, 23], dtype=torch.int32)), ValueError, r"cu_seqlens\[0\] must be 0"),
    (dict(cu_seqlens=torch.tensor([0, 20, 19], dtype=torch.int32)), ValueError, r"non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0, 49, 50], dtype=torch.int32)), ValueError,
     r"block_table\[0, 2\] = 2147483647 is not a page id in \[0, 6\)"),
    (dict(cu_seqlens=torch.tensor([0, 65, 66], dtype=torch.int32)), ValueError, r"request 0 has 65 tokens"),
    (dict(kv_cache=GC.to(FP8), k_scale=torch.tensor([float("nan")])), ValueError, r"k_scale must be finite and >="),
]


@pytest.mark.parametrize("kw,exc,match", GATHER_ERRORS)
def test_gather_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        _g(**kw)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("case", WRITE_CASES)
@pytest.mark.parametrize("T", [1, 40, 3000])
def test_gpu_write_matches_cpu(case, T):
    cache_dtype, dtype, ps, kv_4d, padded, pe_3d, fused = case
    num_pages = -(-T // ps) + 3
    cache = make_cache(num_pages, ps, cache_dtype, kv_4d=kv_4d, padded=padded, device="cuda")
    kv_c, k_pe = make_tokens(T, dtype, pe_3d=pe_3d, fused=fused, device="cuda", seed=T)
    slots = make_slots(T, num_pages * ps, device="cuda", seed=T)
    k_scale = _scale(cache_dtype, "cuda")
    want = cache.cpu()
    OPS.write_kv_cache(kv_c.cpu(), k_pe.cpu(), want, slots.cpu(), k_scale=None if k_scale is None else k_scale.cpu())
    mla_attn.write_kv_cache(kv_c, k_pe, cache, slots, k_scale=k_scale)
    assert torch.equal(_bits(cache.cpu()), _bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("lens", [LENS, [0], [3000, 1, 0, 517] * 8])
def test_gpu_gather_matches_cpu(case, lens):
    cache_dtype, out_dtype, ps, kv_4d, padded = case
    cache, bt, cu, n = make_gather_case(lens, ps, cache_dtype, kv_4d=kv_4d, padded=padded, extra_rows=70)
    k_scale = _scale(cache_dtype)
    want = OPS.gather_kv_cache(cache, bt, cu, n, k_scale=k_scale, out_dtype=out_dtype)
    leave_nan_blocks(((n, D), want.dtype))  # every row must be written
    got = mla_attn.gather_kv_cache(cache.cuda(), bt.cuda(), cu.cuda(), n, out_dtype=out_dtype,
                                   k_scale=None if k_scale is None else k_scale.cuda())
    assert torch.equal(_bits(got.cpu()), _bits(want))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gather_rows_past_the_table_or_cache_are_zero(device, cache_dtype):
    """Rows whose page id is negative or past the cache, and rows past the block table's width, are
    zero on the CPU as on the GPU (mla_sparse_decode relies on both for its ds_mla_fp8 path)."""
    cache = make_cache(2, 16, torch.bfloat16, fill=1.0).to(cache_dtype).to(device)
    k_scale = None if cache_dtype != FP8 else torch.tensor([0.5], device=device)
    bt = torch.tensor([[HUGE_ID], [-1], [1]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 2, 4, 22], dtype=torch.int32, device=device)  # request 2: 18 rows, its table holds 16
    if device == "cuda":
        leave_nan_blocks(((24, D), torch.bfloat16))
    out = OPS.gather_kv_cache(cache, bt, cu, 24, k_scale=k_scale).float().cpu()
    one = 1.0 if k_scale is None else 0.5
    assert (out[:4] == 0).all() and (out[4:20] == one).all() and (out[20:] == 0).all()


def test_out_of_range_is_skipped(device):
    """Garbage slots and page ids past the cache (unchecked by the ops) are skipped: no write or read
    out of bounds, no error, the CPU ops as the CUDA kernels."""
    cache = make_cache(2, 16, torch.bfloat16, device=device)
    kv_c, k_pe = make_tokens(3, torch.bfloat16, device=device)
    OPS.write_kv_cache(kv_c, k_pe, cache, torch.tensor([32, 2**40, 5], device=device))
    written = cache.isnan().logical_not().all(-1).nonzero().tolist()
    assert written == [[0, 5]] and torch.equal(cache[0, 5], torch.cat([kv_c[2], k_pe[2]]))
    bt = torch.tensor([[HUGE_ID], [-3]], dtype=torch.int32, device=device)
    if device == "cuda":
        leave_nan_blocks(((4, D), torch.bfloat16))
    out = OPS.gather_kv_cache(cache, bt, torch.tensor([0, 2, 4], dtype=torch.int32, device=device), 4)
    assert (out == 0).all()


@pytest.mark.gpu
def test_gpu_gather_request_start_int_min():
    """A request start of INT_MIN in cu_seqlens (not checked on the GPU without validate) gives zero rows:
    a row's position is subtracted in 64 bits (r - INT_MIN overflowed an int)."""
    cache = make_cache(2, 16, torch.bfloat16, device="cuda", fill=1.0)
    bt = torch.tensor([[0], [1]], dtype=torch.int32, device="cuda")
    for start in (-2**31, -2**31 + 1):
        cu = torch.tensor([start, 2, 4], dtype=torch.int32, device="cuda")
        leave_nan_blocks(((6, D), torch.bfloat16))
        out = OPS.gather_kv_cache(cache, bt, cu, 6)
        assert (out[:2] == 0).all() and (out[2:4] == 1).all() and (out[4:] == 0).all()


@pytest.mark.gpu
def test_gpu_cuda_graph():
    (kv_c, k_pe, cache, slots), (gcache, bt, cu, n) = _op_case("cuda")
    want_cache = cache.clone()
    OPS.write_kv_cache(kv_c, k_pe, want_cache, slots)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
        out = mla_attn.gather_kv_cache(gcache, bt, cu, n)
    out.fill_(NAN)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache, want_cache)
    assert torch.equal(out.cpu(), OPS.gather_kv_cache(gcache.cpu(), bt.cpu(), cu.cpu(), n))


@pytest.mark.gpu
def test_gpu_errors():
    (kv_c, k_pe, cache, slots), (gcache, bt, cu, n) = _op_case("cuda")
    shifted = torch.empty(kv_c.numel() + 8, dtype=kv_c.dtype, device="cuda")[1:1 + kv_c.numel()].view(kv_c.shape)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        OPS.write_kv_cache(shifted, k_pe, cache, slots)
    with pytest.raises(RuntimeError, match="k_scale"):
        OPS.write_kv_cache(kv_c, k_pe, cache.to(FP8), slots)
    with pytest.raises(RuntimeError, match="must be on"):
        OPS.gather_kv_cache(gcache, bt.cpu(), cu, n)
