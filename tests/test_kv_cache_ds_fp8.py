"""The ds_mla_fp8 cache format (DeepSeek-V3.2: 656-byte rows of 512 e4m3 | 4 fp32 scales | 64 bf16 rope):
the quantiser bit-exact against a step-by-step transcription of the reference algorithm, dequantisation
error bounds, write -> gather round trips on the CPU ops (both cache shapes, page sizes 1/16/64, skipped
slots), kv_format inference and its errors, opcheck; and (gpu-marked) the CUDA kernels byte for byte
against the CPU ops."""
import math

import pytest
import torch
from cases import write_layout
from conftest import leave_nan_blocks

import mla_attn
from mla_attn import dequantize_ds_mla_fp8, quantize_ds_mla_fp8
from mla_attn.kv_cache import ds_mla_fp8_scales
from mla_attn.reference import mla_decode_ref

OPS = torch.ops.mla_attn
FP8 = torch.float8_e4m3fn
D_C, D_PE, D, ROW = 512, 64, 576, 656
POISON = 0xFF  # an unwritten byte: NaN as e4m3, and NaN as fp32 scale or bf16 rope


# ---------------------------------------------------------------------------------------- reference
def reference_quantize(kv_c, k_pe):
    """The reference algorithm (DeepSeek-V3.2's cache quantiser), one step per line, in float32:
    per 128-value tile, scale = 2 ** ceil(log2(max(amax / 448, 1e-4))); byte = e4m3(x / scale), round to
    nearest (no clamp: the scale keeps |x / scale| <= 448); the 4 scales as little-endian fp32; rope bf16."""
    T = kv_c.shape[0]
    out = torch.empty(T, ROW, dtype=torch.uint8)
    for k in range(4):
        tile = kv_c[:, 128 * k:128 * (k + 1)].float()
        scale_inv = (tile.abs().amax(dim=-1) / 448.0).clamp_min(1e-4)
        scale = torch.pow(2, scale_inv.log2().ceil())
        out[:, 128 * k:128 * (k + 1)] = (tile / scale[:, None]).to(FP8).view(torch.uint8)
        out[:, 512 + 4 * k:516 + 4 * k] = scale[:, None].contiguous().view(torch.uint8)
    out[:, 528:] = k_pe.reshape(T, D_PE).to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


# --------------------------------------------------------------------------------------------- data
def make_tokens(T, dtype, *, pe_3d=False, device="cpu", seed=0):
    """kv_c [T, 512] and k_pe (views of one [T, 576] row, as split from the kv_a projection), each
    128-value tile at its own magnitude, plus edge tiles: all zeros, amax exactly 448 * 2^k (the scale is
    2^k, a value lands on 448), just above it, the dtype's largest values, values below the 1e-4 clamp,
    subnormals, and mixed signs."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-60, 60) if dtype == torch.bfloat16 else (-12, 10)  # fp16 overflows past ~2^15
    x = torch.randn(T, D, generator=g) * 2
    x[:, :D_C] *= torch.exp2(torch.randint(lo, hi, (T, 4), generator=g).float()).repeat_interleave(128, dim=1)
    big = torch.finfo(dtype).max
    edges = [
        lambda r: r[:D_C].zero_(),
        lambda r: r[:128].clamp_(-447, 447).index_fill_(0, torch.tensor([5]), 448.0),  # scale 1, x / scale = 448
        lambda r: r[128:256].clamp_(-0.05, 0.05).index_fill_(0, torch.tensor([0]), -448.0 / 8),  # amax 448 / 8
        lambda r: r[256:384].clamp_(-1, 1).index_fill_(0, torch.tensor([7]), 448.0 * 2**5 * (1 + 2**-7)),  # > 448 * 2^5
        lambda r: r[384:512].clamp_(-1, 1).index_fill_(0, torch.tensor([1, 2]), big),  # the dtype's largest
        lambda r: r[:D_C].clamp_(-1, 1).mul_(1e-8),  # amax / 448 below the 1e-4 clamp: scale 2^-13
        lambda r: r[:128].copy_(torch.full((128,), 2**-130 if dtype == torch.bfloat16 else 2**-20)),  # subnormals
        lambda r: r[:D_C].copy_(torch.linspace(-3, 3, D_C)),
    ]
    for t in range(min(T, len(edges))):
        edges[t](x[t])
    x = x.to(dtype).to(device)
    k_pe = x[:, D_C:]
    return x[:, :D_C], (k_pe[:, None] if pe_3d else k_pe)


def make_cache(num_pages, page_size, *, kv_4d=False, padded=False, device="cpu"):
    """Poisoned uint8 cache; padded: one spare row per page (a page stride that is not page_size * 656)."""
    cache = torch.full((num_pages, page_size + padded, ROW), POISON, dtype=torch.uint8, device=device)[:, :page_size]
    return cache[:, :, None] if kv_4d else cache


def make_slots(T, num_slots, *, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:T]
    slots[::5] = -1
    slots[1:2] = -(2**40)  # any negative value skips
    return slots.to(device)


def rows_of(cache):
    return cache if cache.dim() == 3 else cache[:, :, 0]


# -------------------------------------------------------------------------------------- the quantiser
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pe_3d", [False, True])
def test_quantize_matches_reference_bits(dtype, pe_3d):
    kv_c, k_pe = make_tokens(300, dtype, pe_3d=pe_3d)
    got = quantize_ds_mla_fp8(kv_c, k_pe)
    assert got.dtype == torch.uint8 and got.shape == (300, ROW)
    assert torch.equal(got, reference_quantize(kv_c, k_pe))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_of_every_amax(dtype):
    """The scale rounding (a mantissa carry) against 2 ** ceil(log2(.)) for every finite amax the dtype
    has, and |x| / scale <= 448 for all of them (so the e4m3 conversion never saturates)."""
    v = torch.arange(2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    v = v[v.isfinite()]
    kv_c = torch.zeros(v.numel(), D_C, dtype=dtype)
    kv_c[:, 0] = v
    got = ds_mla_fp8_scales(kv_c)[:, 0]
    assert torch.equal(got, torch.pow(2, (v.float() / 448.0).clamp_min(1e-4).log2().ceil()))
    assert (v.float().abs() / got <= 448).all()


def test_quantize_layout():
    """The byte layout, read by hand: token 1's first tile has amax exactly 448 (scale 1.0, its 448 is
    e4m3 0x7e); token 0 is all zeros (scale 2^-13, bytes 0); the rope bytes are k_pe's bf16 bits."""
    kv_c, k_pe = make_tokens(8, torch.bfloat16)
    rows = quantize_ds_mla_fp8(kv_c, k_pe)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    assert scales[1, 0] == 1.0 and rows[1, 5] == 0x7E
    assert scales[2, 1] == 2.0**-3 and rows[2, 128] == 0xFE  # amax 448 / 8: scale 2^-3, -56 is e4m3 -448
    assert scales[3, 2] == 2.0**6  # 448 * 2^5 * (1 + 2^-7) rounds the scale up past 2^5
    assert (scales[0] == 2.0**-13).all() and (rows[0, :512] == 0).all() and (scales[5] == 2.0**-13).all()
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k_pe)
    assert ((scales.log2() - scales.log2().round()) == 0).all()  # powers of two


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_error_bounds(dtype):
    kv_c, k_pe = make_tokens(300, dtype, seed=1)
    rows = quantize_ds_mla_fp8(kv_c, k_pe)
    deq = dequantize_ds_mla_fp8(rows)
    assert deq.dtype == torch.float32 and deq.shape == (300, D)
    x = kv_c.float()
    scale = rows[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative for normals (|x| / scale >=
    # 2^-6), within half the subnormal step (2^-10 * scale) below; nothing saturates
    # the one exception: bf16's largest values round up to 256 * 2^120 = 2^128, inf in fp32
    finite = deq[:, :D_C].isfinite()
    assert (x.abs()[~finite] >= 255 * 2.0**120).all()
    err = (deq[:, :D_C] - x).abs()[finite]
    assert (err <= torch.maximum(x.abs() * 2**-4, scale * 2**-10)[finite]).all()
    assert (deq[:, :D_C].abs()[finite] <= 448 * scale[finite]).all()
    assert torch.equal(deq[:, D_C:], k_pe.to(torch.bfloat16).float())  # rope: the bf16 values
    if dtype == torch.bfloat16:
        assert torch.equal(deq[:, D_C:], k_pe.float())  # exact
    # e4m3 times a power of two has 4 significant bits: the bf16 read-back is exact
    assert torch.equal(deq.bfloat16().float()[:, :D_C][finite], deq[:, :D_C][finite])
    # leading dims are kept
    assert torch.equal(dequantize_ds_mla_fp8(rows.view(30, 10, 1, ROW)), deq.view(30, 10, 1, D))


def test_nonfinite_tile_reads_back_nonfinite():
    """A NaN poisons its own tile (NaN scale) and nothing else."""
    kv_c, k_pe = make_tokens(4, torch.bfloat16, seed=2)
    kv_c = kv_c.clone()
    kv_c[3, 200] = float("nan")
    deq = dequantize_ds_mla_fp8(quantize_ds_mla_fp8(kv_c, k_pe))
    assert deq[3, 128:256].isnan().all()
    assert deq[3, :128].isfinite().all() and deq[3, 256:].isfinite().all() and deq[:3].isfinite().all()


# ------------------------------------------------------------------------------------- ops on the CPU
def write_loop(kv_c, k_pe, cache, slots):
    cache = cache.clone()
    rows, ps = rows_of(cache), cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            rows[s // ps, s % ps] = reference_quantize(kv_c[t:t + 1], k_pe[t:t + 1])[0]
    return cache


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_4d,padded,pe_3d", [(False, False, False), (True, True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_cpu_vs_loop(page_size, kv_4d, padded, pe_3d, dtype):
    num_pages = -(-60 // page_size) + 2
    cache = make_cache(num_pages, page_size, kv_4d=kv_4d, padded=padded)
    kv_c, k_pe = make_tokens(40, dtype, pe_3d=pe_3d, seed=page_size)
    slots = make_slots(40, num_pages * page_size, seed=page_size)
    want = write_loop(kv_c, k_pe, cache, slots)
    mla_attn.write_kv_cache(kv_c, k_pe, cache, slots, kv_format="ds_mla_fp8")
    assert torch.equal(cache, want)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (rows_of(cache).reshape(-1, ROW)[~written] == POISON).all()  # skipped slots: untouched


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_4d", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float32])
def test_roundtrip(page_size, kv_4d, out_dtype, device):
    """Write the tokens of a few requests through a permuted block table, gather them back: the
    dequantised rows, exactly."""
    lens = [5, 40, 0, 17]
    bt, slots, cu, num_pages = write_layout(lens, page_size, seed=page_size)
    T = len(slots)
    kv_c, k_pe = make_tokens(T, torch.bfloat16, device=device, seed=4)
    cache = make_cache(num_pages, page_size, kv_4d=kv_4d, device=device)
    mla_attn.write_kv_cache(kv_c, k_pe, cache, torch.tensor(slots, device=device))
    got = mla_attn.gather_kv_cache(cache, bt.to(device), cu.to(device), T + 3, out_dtype=out_dtype)
    want_dtype = out_dtype or torch.bfloat16
    assert got.dtype == want_dtype and got.shape == (T + 3, D)
    want = dequantize_ds_mla_fp8(quantize_ds_mla_fp8(kv_c.cpu(), k_pe.cpu())).to(want_dtype)
    assert torch.equal(got[:T].cpu(), want) and (got[T:] == 0).all()


def test_gather_cpu_vs_loop():
    cache = make_cache(9, 16)
    kv_c, k_pe = make_tokens(9 * 16, torch.bfloat16, seed=5)
    mla_attn.write_kv_cache(kv_c, k_pe, cache, torch.arange(9 * 16))
    bt = torch.tensor([[3, 0, 8], [5, 2**31 - 1, -1], [1, 7, 6]], dtype=torch.int32)
    cu = torch.tensor([0, 37, 37, 70], dtype=torch.int32)
    got = mla_attn.gather_kv_cache(cache, bt, cu, 75, out_dtype=torch.float32)
    deq = dequantize_ds_mla_fp8(cache)
    for b, (lo, hi) in enumerate([(0, 37), (37, 37), (37, 70)]):
        for i in range(hi - lo):
            assert torch.equal(got[lo + i], deq[int(bt[b, i // 16]), i % 16])
    assert (got[70:] == 0).all()


# ------------------------------------------------------------------------------------ kv_format, errors
def test_kv_format_inferred_and_named():
    kv_c, k_pe = make_tokens(6, torch.bfloat16)
    a, b = make_cache(2, 16), make_cache(2, 16)
    mla_attn.write_kv_cache(kv_c, k_pe, a, torch.arange(6))
    mla_attn.write_kv_cache(kv_c, k_pe, b, torch.arange(6), kv_format="ds_mla_fp8")
    assert torch.equal(a, b)
    bf16 = torch.zeros(2, 16, D, dtype=torch.bfloat16)
    mla_attn.write_kv_cache(kv_c, k_pe, bf16, torch.arange(6), kv_format="model")
    fp8 = torch.zeros(2, 16, D, dtype=FP8)
    mla_attn.write_kv_cache(kv_c, k_pe, fp8, torch.arange(6), k_scale=torch.tensor([0.1]), kv_format="fp8")


KV_C, K_PE = make_tokens(6, torch.bfloat16)
SLOTS = torch.arange(6)
BT, CU = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32)
MISALIGNED = torch.zeros(2 * (16 * ROW + 8), dtype=torch.uint8).as_strided((2, 16, ROW), (16 * ROW + 8, ROW, 1))
ERRORS = [  # (op, changes, exception, message)
    ("write", dict(kv_format="ds_mla_fp8", kv_cache=torch.zeros(2, 16, D, dtype=torch.bfloat16)), ValueError,
     r"kv_format='ds_mla_fp8' needs a uint8 kv_cache, got torch.bfloat16"),
    ("write", dict(kv_format="fp8"), ValueError, r"kv_format='fp8' needs a float8_e4m3fn kv_cache, got torch.uint8"),
    ("write", dict(kv_format="model"), ValueError, r"kv_format='model' needs a bfloat16 or float16 kv_cache"),
    ("write", dict(kv_format="fp8_ds_mla"), ValueError, r"unknown kv_format 'fp8_ds_mla'; the formats are model, fp8"),
    ("write", dict(kv_format=3), TypeError, r"kv_format must be a str or None, got int"),
    ("write", dict(k_scale=torch.tensor([0.5])), ValueError, r"k_scale is not used with a ds_mla_fp8 kv_cache"),
    ("write", dict(kv_cache=torch.zeros(2, 16, D, dtype=torch.uint8)), ValueError,
     r"kv_cache must be \[num_pages, page_size, 656\] or \[num_pages, page_size, 1, 656\] \(ds_mla_fp8"),
    ("write", dict(kv_cache=torch.zeros(2, 16, 2, ROW, dtype=torch.uint8)), ValueError, r"kv_cache must be \[num"),
    ("write", dict(kv_cache=torch.zeros(2, 16, ROW, dtype=torch.int8)), TypeError,
     r"kv_cache must be bfloat16, float16, float8_e4m3fn or uint8 \(ds_mla_fp8\), got torch.int8"),
    ("write", dict(kv_cache=MISALIGNED), ValueError, r"kv_cache: stride\(0\) = 10504 elements is not a multiple of 16"),
    ("write", dict(slot_mapping=torch.full((6,), 32)), ValueError, r"slot_mapping\[0\] = 32 is past the cache's"),
    ("gather", dict(kv_format="model"), ValueError, r"kv_format='model' needs a bfloat16 or float16 kv_cache"),
    ("gather", dict(k_scale=torch.tensor([0.5])), ValueError, r"k_scale is not used with a ds_mla_fp8 kv_cache"),
    ("gather", dict(kv_cache=torch.zeros(2, 16, D, dtype=torch.uint8)), ValueError, r"\[num_pages, page_size, 656\]"),
    ("gather", dict(out_dtype=torch.uint8), TypeError, r"out_dtype must be None, bfloat16, float16 or float32"),
]


@pytest.mark.parametrize("op,kw,exc,match", ERRORS)
@pytest.mark.parametrize("direct", [False, True])
def test_errors(op, kw, exc, match, direct):
    """The wrappers and (direct) the CPU kernels raise the same exceptions."""
    if direct and ("slot_mapping" in kw or kw.get("kv_format") == 3):
        pytest.skip("value checks belong to the wrappers; the schema itself refuses a non-str kv_format")
    kw = dict(kw)
    cache = kw.pop("kv_cache", make_cache(2, 16))
    if op == "write":
        fn = OPS.write_kv_cache if direct else mla_attn.write_kv_cache
        args = (KV_C, K_PE, cache, kw.pop("slot_mapping", SLOTS))
    else:
        fn = OPS.gather_kv_cache if direct else mla_attn.gather_kv_cache
        args = (cache, BT, CU, 20)
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def test_decode_reads_ds_cache():
    """mla_decode takes a ds_mla_fp8 cache (the GPU kernel: tests/test_decode_ds_fp8_gpu.py); the CPU op
    attends over the dequantised rows."""
    g = torch.Generator().manual_seed(7)
    cache = make_cache(2, 16)
    x = torch.randn(20, D, generator=g).bfloat16()
    mla_attn.write_kv_cache(x[:, :D_C], x[:, D_C:], cache, torch.arange(20))
    q = torch.randn(1, 1, 4, D, generator=g).bfloat16()
    lens = torch.tensor([20], dtype=torch.int32)
    out, lse = mla_attn.mla_decode(q, cache, BT, lens, softmax_scale=0.1, return_lse=True)
    ref_out, ref_lse = mla_decode_ref(q, dequantize_ds_mla_fp8(cache), BT, lens, softmax_scale=0.1, causal=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_opcheck():
    cache = torch.zeros(5, 16, 1, ROW, dtype=torch.uint8)
    kv_c, k_pe = make_tokens(12, torch.bfloat16, pe_3d=True, seed=6)
    slots = make_slots(12, 80)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(OPS.write_kv_cache.default, (kv_c, k_pe, cache, slots), dict(kv_format="ds_mla_fp8"),
                          test_utils=utils)
    mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
    for out_dtype in (None, torch.float32):
        torch.library.opcheck(OPS.gather_kv_cache.default, (cache, BT.expand(2, 2).contiguous(),
                                                            torch.tensor([0, 10, 25], dtype=torch.int32), 27),
                              dict(out_dtype=out_dtype), test_utils=utils)


def test_torch_compile_fullgraph():
    def fn(kv_c, k_pe, cache, slots, bt, cu):
        mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
        return mla_attn.gather_kv_cache(cache, bt, cu, 30)

    kv_c, k_pe = make_tokens(20, torch.bfloat16, seed=7)
    slots = torch.arange(20)
    want_cache, cache = make_cache(2, 16), make_cache(2, 16)
    want = fn(kv_c, k_pe, want_cache, slots, BT, CU)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(kv_c, k_pe, cache, slots, BT, CU)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size,kv_4d,padded,pe_3d", [(1, False, False, False), (16, True, True, True),
                                                           (64, False, True, True)])
@pytest.mark.parametrize("T", [1, 40, 3000])
def test_gpu_write_matches_cpu(dtype, page_size, kv_4d, padded, pe_3d, T):
    """The CUDA write, byte for byte, against the CPU op on random tokens with every edge tile."""
    num_pages = -(-T // page_size) + 3
    cache = make_cache(num_pages, page_size, kv_4d=kv_4d, padded=padded, device="cuda")
    kv_c, k_pe = make_tokens(T, dtype, pe_3d=pe_3d, device="cuda", seed=T)
    slots = make_slots(T, num_pages * page_size, seed=T, device="cuda")
    want = cache.cpu()
    OPS.write_kv_cache(kv_c.cpu(), k_pe.cpu(), want, slots.cpu())
    mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
    assert torch.equal(cache.cpu(), want)


@pytest.mark.gpu
def test_gpu_write_contiguous_inputs_and_zeros():
    """Separate (contiguous) kv_c / k_pe tensors, all-zero tokens, and slots past the cache (skipped)."""
    cache = make_cache(4, 16, device="cuda")
    kv_c, k_pe = make_tokens(50, torch.bfloat16, device="cuda", seed=8)
    kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    kv_c[10:20] = 0
    slots = torch.arange(50, device="cuda")
    slots[45:] = 2**40  # past the cache: never written (no value checks on the GPU)
    want = cache.cpu()
    OPS.write_kv_cache(kv_c.cpu()[:45], k_pe.cpu()[:45], want, slots.cpu()[:45])
    OPS.write_kv_cache(kv_c, k_pe, cache, slots)
    assert torch.equal(cache.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size,kv_4d", [(1, False), (16, True), (64, False)])
@pytest.mark.parametrize("foreign_scales", [False, True])
def test_gpu_gather_matches_cpu(out_dtype, page_size, kv_4d, foreign_scales):
    """The CUDA gather against the CPU op, bit for bit; foreign_scales: scales that are not powers of two
    (a cache written by another quantiser), so the products round."""
    lens = [37, 0, 130, 1, 64, 3000, 16]
    g = torch.Generator().manual_seed(page_size)
    used = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(used) + 3
    cache = make_cache(num_pages, page_size, kv_4d=kv_4d)
    kv_c, k_pe = make_tokens(num_pages * page_size, torch.bfloat16, seed=9)
    OPS.write_kv_cache(kv_c, k_pe, cache, torch.arange(num_pages * page_size))
    if foreign_scales:
        scales = torch.rand(num_pages, page_size, 4, generator=g) * 3 + 0.01
        rows_of(cache)[..., 512:528] = scales.view(torch.uint8)
    perm = torch.randperm(num_pages, generator=g).tolist()
    bt = torch.full((len(lens), max(used) + 2), 2**31 - 1, dtype=torch.int32)
    bt[:, -1] = -7
    for b in range(len(lens)):
        bt[b, :used[b]] = torch.tensor([perm.pop() for _ in range(used[b])], dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    n = int(cu[-1]) + 70
    want = OPS.gather_kv_cache(cache, bt, cu, n, out_dtype=out_dtype)
    leave_nan_blocks(((n, D), want.dtype))  # every row must be written
    got = mla_attn.gather_kv_cache(cache.cuda(), bt.cuda(), cu.cuda(), n, out_dtype=out_dtype)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_cuda_graph():
    kv_c, k_pe = make_tokens(20, torch.float16, device="cuda", seed=10)
    slots = torch.arange(20, device="cuda")
    bt, cu = BT.cuda(), CU.cuda()
    cache = make_cache(2, 16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
        out = mla_attn.gather_kv_cache(cache, bt, cu, 24)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want_cache = make_cache(2, 16)
    OPS.write_kv_cache(kv_c.cpu(), k_pe.cpu(), want_cache, slots.cpu())
    assert torch.equal(cache.cpu(), want_cache)
    assert torch.equal(out.cpu(), OPS.gather_kv_cache(want_cache, BT, CU, 24))
