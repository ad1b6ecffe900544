"""Every input error mla_decode promises to catch, with the message it raises."""
import random

import numpy as np
import pytest
import torch
from cases import D_QK, D_V, make_decode_case

import mla_attn
from mla_attn._validation import _share_an_address, want_value_checks


def base(varlen=False, split_pe=False, kv_4d=False):
    return make_decode_case([20, 3], 2, 4, 16, varlen=varlen, split_pe=split_pe, kv_4d=kv_4d)


def call(c, **kw):
    args = dict(cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"], softmax_scale=c["softmax_scale"])
    if c["cu_seqlens_q"] is not None:
        args["max_seqlen_q"] = c["max_seqlen_q"]
    args.update(kw)
    return mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], **args)


def _with(c, **changes):
    return {**c, **changes}


def _misaligned(t):
    """Same values, but rows padded by one element: stride(-2) * 2 bytes is not a multiple of 16."""
    buf = torch.empty(t.shape[:-1] + (t.shape[-1] + 1,), dtype=t.dtype)
    buf[..., :-1] = t
    return buf[..., :-1]


def _last_dim_strided(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_valid_inputs_pass():
    for kw in (dict(), dict(varlen=True), dict(split_pe=True, kv_4d=True)):
        call(base(**kw))


C = base()
CV = base(varlen=True)
CPE = base(split_pe=True)
KV = C["kv_cache"]

STATIC_ERRORS = [
    # ranks and head dims
    (_with(C, q=C["q"][..., :D_V]), ValueError, r"q must be \[B, s_q, h_q, 576\]"),
    (_with(C, q=C["q"][0]), ValueError, r"3-D \(varlen\) q needs cu_seqlens_q"),
    (_with(C, q=C["q"][None]), ValueError, r"q must be"),
    (_with(CPE, q_pe=CPE["q_pe"][..., :32]), ValueError, r"q_pe must have shape"),
    (_with(C, kv_cache=KV[..., :D_V]), ValueError, r"kv_cache must be \[num_pages, page_size, 576\]"),
    (_with(C, kv_cache=KV[:, :, None].expand(-1, -1, 2, -1)), ValueError, r"kv_cache must be"),
    # dtypes
    (_with(C, q=C["q"].float()), TypeError, r"q must be bfloat16 or float16"),
    (_with(C, kv_cache=KV.half()), TypeError, r"kv_cache dtype torch.float16 must match q dtype"),
    (_with(CPE, q_pe=CPE["q_pe"].half()), TypeError, r"q_pe dtype"),
    (_with(C, block_table=C["block_table"].long()), TypeError, r"block_table must be int32"),
    (_with(C, cache_seqlens=C["cache_seqlens"].long()), TypeError, r"cache_seqlens must be int32"),
    (_with(CV, cu_seqlens_q=CV["cu_seqlens_q"].long()), TypeError, r"cu_seqlens_q must be int32"),
    # devices
    (_with(C, block_table=C["block_table"].to("meta")), TypeError, r"block_table is on meta but q is on cpu"),
    (_with(C, kv_cache=KV.to("meta")), TypeError, r"kv_cache is on meta"),
    # layout
    (_with(C, q=_last_dim_strided(C["q"])), ValueError, r"q: last dim must be contiguous"),
    (_with(C, q=_misaligned(C["q"])), ValueError, r"q: stride\(1\) = 2308 elements is not a multiple of 16 bytes"),
    (_with(C, kv_cache=_misaligned(KV)), ValueError, r"kv_cache: stride\(1\)"),
    (_with(C, block_table=C["block_table"].t().contiguous().t()), ValueError, r"block_table: last dim"),
    # page size
    (_with(C, kv_cache=KV[:, :0]), ValueError, r"page_size must be in \[1, 256\], got 0"),
    (_with(C, kv_cache=torch.randn(2, 257, D_QK).bfloat16()), ValueError, r"page_size .* got 257"),
    (_with(C, kv_cache=torch.randn(1, 272, D_QK).bfloat16()), ValueError, r"page_size .* got 272"),
    # batch sizes
    (_with(C, block_table=C["block_table"][:1]), ValueError, r"block_table has 1 rows but cache_seqlens has 2"),
    (_with(C, q=C["q"][:1]), ValueError, r"q has batch 1 but cache_seqlens has 2"),
    (_with(CV, cu_seqlens_q=CV["cu_seqlens_q"][:2]), ValueError, r"cu_seqlens_q must have batch \+ 1 = 3"),
    # varlen plumbing
    (_with(C, cu_seqlens_q=CV["cu_seqlens_q"]), ValueError, r"cu_seqlens_q is only valid with 3-D"),
    # head count and query length limits
    (_with(C, q=C["q"][:, :, :0]), ValueError, r"num_heads_q must be in \[1, 128\], got 0"),
    (_with(C, q=torch.randn(2, 1, 129, D_QK).bfloat16()), ValueError, r"num_heads_q .* got 129"),
    (_with(C, q=C["q"][:, :0]), ValueError, r"max_seqlen_q .* must be in \[1, 512\], got 0"),
    (_with(CV, max_seqlen_q=513), ValueError, r"max_seqlen_q .* got 513"),
]


@pytest.mark.parametrize("case,exc,match", STATIC_ERRORS)
def test_static_errors(case, exc, match):
    with pytest.raises(exc, match=match):
        call(case)


def test_call_level_errors():
    with pytest.raises(ValueError, match="softmax_scale is required"):
        call(C, softmax_scale=None)
    for bad in (0.0, -0.1, float("nan"), float("inf")):  # the kernels need a finite scale > 0
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            call(C, softmax_scale=bad)
    with pytest.raises(ValueError, match="cu_seqlens_q given without max_seqlen_q"):
        call(CV, max_seqlen_q=None)
    with pytest.raises(ValueError, match=r"max_seqlen_q=3 does not match q.shape\[1\]=2"):
        call(C, max_seqlen_q=3)
    want = C["q"].shape[:-1] + (D_V,)
    with pytest.raises(ValueError, match="out must have shape"):
        call(C, out=torch.empty(want[:-1] + (576,), dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out dtype"):
        call(C, out=torch.empty(want, dtype=torch.float16))
    with pytest.raises(TypeError, match="out is on meta"):
        call(C, out=torch.empty(want, dtype=torch.bfloat16, device="meta"))


def test_out_start_and_overlap():
    """An out= view that starts off a 16-byte boundary (the kernels store 16-byte vectors), or whose
    elements share memory (written by several threads at once), is refused; so is such a q."""
    want = C["q"].shape[:-1] + (D_V,)
    offset = torch.empty(want[:-1] + (D_V + 8,), dtype=torch.bfloat16)[..., 4:4 + D_V]  # strides fine, start 8 B in
    with pytest.raises(ValueError, match="out must start at a multiple of 16 bytes; it starts 4 elements"):
        call(C, out=offset)
    with pytest.raises(ValueError, match="q must start at a multiple of 16 bytes"):
        call(_with(C, q=torch.empty(C["q"].numel() + 8, dtype=torch.bfloat16)[4:4 + C["q"].numel()].view(C["q"].shape)))
    shared = torch.empty(want[:-2] + (1, D_V), dtype=torch.bfloat16).expand(want)  # one row for every head
    with pytest.raises(ValueError, match="out: elements overlap in memory"):
        call(C, out=shared)
    rows = torch.empty(want[:-1] + (D_V,), dtype=torch.bfloat16).as_strided(want, (0, 0, 256, 1))
    with pytest.raises(ValueError, match="out: elements overlap in memory"):
        call(C, out=rows)
    fits = torch.empty(want[:-1] + (D_V + 8,), dtype=torch.bfloat16)[..., 8:8 + D_V]  # 16 B in: accepted
    assert call(C, out=fits).data_ptr() == fits.data_ptr()
    # traced with symbolic shapes (a strided out, as cp_mla_decode passes): the start and overlap checks
    # are left to the op there
    traced = torch.compile(lambda c, out: call(c, out=out), fullgraph=True, dynamic=True, backend="aot_eager")
    assert torch.equal(traced(C, fits), call(C, out=fits.clone()))


def test_fp8_cache_errors():
    fp8 = KV.to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5])
    with pytest.raises(ValueError, match="float8_e4m3fn kv_cache needs k_scale"):
        call(_with(C, kv_cache=fp8))
    with pytest.raises(ValueError, match="k_scale is only valid with a float8_e4m3fn kv_cache"):
        call(C, k_scale=scale)
    for bad, exc in ((0.5, TypeError), (scale.double(), TypeError), (scale.expand(2), ValueError)):
        with pytest.raises(exc, match=r"k_scale must be a float32 tensor of shape \[1\]"):
            call(_with(C, kv_cache=fp8), k_scale=bad)
    with pytest.raises(TypeError, match="k_scale is on meta"):
        call(_with(C, kv_cache=fp8), k_scale=scale.to("meta"))
    with pytest.raises(ValueError, match="fp8_mma=True needs a float8_e4m3fn kv_cache"):
        call(C, fp8_mma=True)
    with pytest.raises(ValueError, match="q_scale is only valid with fp8_mma=True"):
        call(_with(C, kv_cache=fp8), k_scale=scale, q_scale=scale)
    for bad, exc in ((0.5, TypeError), (scale.double(), TypeError), (scale.expand(2), ValueError)):
        with pytest.raises(exc, match=r"q_scale must be a float32 tensor of shape \[1\]"):
            call(_with(C, kv_cache=fp8), k_scale=scale, fp8_mma=True, q_scale=bad)
    for bad in (0.0, -0.5, float("inf"), 1e-39):  # value check (on CPU by default): it divides Q (1e-39: denormal)
        with pytest.raises(ValueError, match="q_scale must be finite and >="):
            call(_with(C, kv_cache=fp8), k_scale=scale, fp8_mma=True, q_scale=torch.tensor([bad]))
    for bad in (0.0, -0.5, float("nan"), 1e-39):  # value check (on CPU by default): it scales the scores
        with pytest.raises(ValueError, match="k_scale must be finite and >="):
            call(_with(C, kv_cache=fp8), k_scale=torch.tensor([bad]))


def test_fp8_cache_on_cpu_is_the_dequantized_reference():
    """The CPU op reads stored * k_scale (plumbing of k_scale through the op; the GPU kernel is
    tested against the same reference in test_decode_fp8_gpu.py)."""
    from fp8_cases import dequantized, to_fp8_case
    from mla_attn.reference import mla_decode_ref
    c = to_fp8_case(C, k_scale=0.05)
    out, lse = call(_with(c), k_scale=c["k_scale"], return_lse=True)
    d = dequantized(c)
    ref_out, ref_lse = mla_decode_ref(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"],
                                      softmax_scale=d["softmax_scale"], causal=True)
    assert torch.equal(out, ref_out.to(out.dtype)) and torch.equal(lse, ref_lse)
    out2 = call(_with(c), k_scale=c["k_scale"] * 2)
    assert not torch.equal(out2, out), "k_scale must change the result"


def test_metadata_mismatch():
    md = mla_attn.get_decode_metadata(C["cache_seqlens"], 4, s_q=2)
    call(C, metadata=md)
    with pytest.raises(ValueError, match="metadata was computed for causal=True but this call has False"):
        call(C, metadata=md, causal=False)
    bad = {
        "num_heads_q=8": mla_attn.get_decode_metadata(C["cache_seqlens"], 8, s_q=2),
        "max_seqlen_q=3": mla_attn.get_decode_metadata(C["cache_seqlens"], 4, s_q=3),
        "batch 3": mla_attn.get_decode_metadata(torch.zeros(3, dtype=torch.int32), 4, s_q=2),
    }
    for match, other in bad.items():
        with pytest.raises(ValueError, match=f"metadata was computed for {match}"):
            call(C, metadata=other)
    with pytest.raises(TypeError, match="DecodeMetadata"):
        call(C, metadata=tuple(md))
    for name, t, exc in (("tile_sched", md.tile_sched[:, :7], ValueError),
                         ("tile_sched", md.tile_sched.t().contiguous().t(), ValueError),
                         ("req_splits", md.req_splits.long(), TypeError)):
        with pytest.raises(exc, match=f"metadata.{name} must be a contiguous int32"):
            call(C, metadata=md._replace(**{name: t}))
    with pytest.raises(ValueError, match="needs s_q"):
        mla_attn.get_decode_metadata(C["cache_seqlens"], 4)


def _lens(*v):
    return torch.tensor(v, dtype=torch.int32)


def _cu(*v):
    return torch.tensor(v, dtype=torch.int32)


def _bt_with(c, b, j, value):
    bt = c["block_table"].clone()
    bt[b, j] = value
    return bt


T = CV["q"].shape[0]
VALUE_ERRORS = [
    (_with(C, cache_seqlens=_lens(-1, 3)), r"cache_seqlens\[0\] = -1 is negative"),
    (_with(C, cache_seqlens=_lens(20, 16 * C["block_table"].shape[1] + 1)), r"exceeds block_table capacity"),
    (_with(CV, cu_seqlens_q=_cu(1, 1, T)), r"cu_seqlens_q\[0\] must be 0"),
    (_with(CV, cu_seqlens_q=_cu(0, T, T - 1)), r"cu_seqlens_q\[-1\] = .* must equal the number of q tokens"),
    (_with(CV, cu_seqlens_q=_cu(0, T + 1, T)), r"non-decreasing"),
    (_with(CV, max_seqlen_q=1), r"request 0 has 2 q tokens > max_seqlen_q=1"),
    (_with(C, block_table=_bt_with(C, 0, 1, -1)), r"block_table\[0, 1\] = -1 is not a page id"),
    (_with(C, block_table=_bt_with(C, 1, 0, KV.shape[0])), r"block_table\[1, 0\] = .* is not a page id"),
]


@pytest.mark.parametrize("case,match", VALUE_ERRORS)
def test_value_errors_on_cpu(case, match):
    with pytest.raises(ValueError, match=match):
        call(case)


@pytest.mark.parametrize("case,match", VALUE_ERRORS)
def test_unchecked_values_on_cpu(case, match):
    """validate=False: the CPU op reads bad values as the CUDA kernels do (clamped): wrong numbers (the
    case's cache holds NaN past the lengths), never an error."""
    out = call(case, validate=False)
    assert out.shape == case["q"].shape[:-1] + (D_V,)


@pytest.mark.parametrize("page", [-1, KV.shape[0], 2**31 - 1])
def test_unchecked_page_ids_clamp_on_cpu(page):
    """A page id outside the cache reads the nearest page, as the CUDA kernels clamp it. The edge pages
    hold finite keys of their own (the case's last page is an unused, NaN one), so a clamp to any other
    page gives other numbers."""
    kv = KV.clone()
    g = torch.Generator().manual_seed(page % 997)
    kv[0], kv[-1] = torch.randn(kv.shape[1:], generator=g), torch.randn(kv.shape[1:], generator=g)
    case = _with(C, kv_cache=kv)
    got = call(_with(case, block_table=_bt_with(C, 1, 0, page)), validate=False)
    want = call(_with(case, block_table=_bt_with(C, 1, 0, min(max(page, 0), KV.shape[0] - 1))))
    assert torch.isfinite(want[1]).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_table_capacity_past_int32_on_cpu():
    """A block table whose capacity (columns x page_size) passes 2^31 keys: valid, and clamped in int32."""
    c = make_decode_case([10], 1, 4, 256)
    table = torch.zeros(1, 2**23, dtype=torch.int32)
    table[:, :c["block_table"].shape[1]] = c["block_table"]
    want = call(c)
    torch.testing.assert_close(call(_with(c, block_table=table)), want, rtol=0, atol=0, equal_nan=True)


def test_value_checks_policy(monkeypatch):
    # garbage past the used pages is legal (make_decode_case puts huge and negative ids there)
    assert (C["block_table"][:, -1] < 0).all()
    call(C, validate=True)
    call(_with(C, cache_seqlens=_lens(-1, 3)), validate=False)  # opt-out skips value checks
    cuda = torch.device("cuda")
    monkeypatch.delenv("MLA_ATTN_VALIDATE", raising=False)
    assert want_value_checks(None, torch.device("cpu"))
    assert not want_value_checks(None, cuda)  # no host sync on GPU by default
    assert want_value_checks(True, cuda)
    monkeypatch.setenv("MLA_ATTN_VALIDATE", "1")
    assert want_value_checks(None, cuda)


def _bytes_of(t):
    """The byte addresses of t's elements, enumerated."""
    addresses = {t.data_ptr()}
    for size, stride in zip(t.shape, t.stride()):
        addresses = {a + i * stride * t.element_size() for a in addresses for i in range(size)}
    return {a + b for a in addresses for b in range(t.element_size())} if t.numel() else set()


def test_share_an_address_against_enumeration():
    """The outputs' overlap test against the byte sets themselves: exact for views of one tensor (what an
    engine passes), and never 'apart' where two arbitrary strided views share a byte."""
    g = random.Random(0)
    buf = torch.zeros(4096, dtype=torch.uint8)
    dtypes = (torch.uint8, torch.bfloat16, torch.float32)
    for _ in range(1500):
        parent = torch.empty(0, dtype=g.choice(dtypes)).set_(buf.untyped_storage())
        shape = [g.randint(1, 6) for _ in range(3)]
        pad = g.randint(0, 3)
        rows = parent.as_strided(shape, (shape[1] * (shape[2] + pad), shape[2] + pad, 1))

        def view():
            starts = [g.randint(0, n - 1) for n in shape]
            v = rows[tuple(slice(s, g.randint(s + 1, n)) for s, n in zip(starts, shape))]
            return v.permute(*g.sample(range(3), 3))

        a, b = view(), view()
        assert _share_an_address(a, b) == bool(_bytes_of(a) & _bytes_of(b)), (a.shape, a.stride(), b.shape, b.stride())

        def arbitrary():
            t = torch.empty(0, dtype=g.choice(dtypes)).set_(buf.untyped_storage())
            dims = g.randint(1, 3)
            return t.as_strided([g.randint(1, 5) for _ in range(dims)], [g.randint(0, 12) for _ in range(dims)],
                                g.randint(0, 40))

        a, b = arbitrary(), arbitrary()
        if _bytes_of(a) & _bytes_of(b):
            assert _share_an_address(a, b), (a.shape, a.stride(), b.shape, b.stride())


def test_out_beside_an_input_in_one_buffer():
    """out and q_pe as the two column ranges of one buffer: apart, so accepted, and the same result."""
    c = base(split_pe=True)
    rows = torch.full(c["q_pe"].shape[:-1] + (D_V + 64,), float("nan"), dtype=c["q_pe"].dtype)
    rows[..., D_V:] = c["q_pe"]
    got = call(_with(c, q_pe=rows[..., D_V:]), out=rows[..., :D_V])
    assert got.data_ptr() == rows.data_ptr()
    assert torch.equal(got, call(c))


def test_numpy_host_ints():
    """Host ints may be NumPy's, as MLABatch.build and the ops' schemas take them."""
    c = base(varlen=True)
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], np.int64(c["q"].shape[-2]), cu_seqlens_q=c["cu_seqlens_q"],
                                      max_seqlen_q=np.int32(c["max_seqlen_q"]))
    got = call(c, metadata=md, max_seqlen_q=np.int64(c["max_seqlen_q"]))
    assert torch.equal(got, call(c))
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got bool"):
        call(c, max_seqlen_q=np.bool_(True))
