"""LSE merge: the reference vs attention over the union of key sets (float64 softmax), the ops vs the
reference on CPU and (gpu-marked) the CUDA kernel vs the CPU ops, opcheck, torch.compile, input errors."""
import math

import pytest
import torch

import mla_attn
from mla_attn.reference import merge_attn_states_ref

from conftest import leave_nan_blocks

OPS = torch.ops.mla_attn
INF = math.inf
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: dict(rtol=2**-7, atol=1e-2), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.float32: dict(rtol=1e-5, atol=1e-5)}
LSE_TOL = dict(rtol=1e-6, atol=2e-5)


# ------------------------------------------------------------------------------------------------ data
def _strided(t, g):
    """Same values in a non-contiguous layout: leading dims permuted in memory and padded, last dim
    contiguous, every stride still a multiple of 16 bytes."""
    if t.dim() < 2:
        return t
    lead = t.shape[:-1]
    big = torch.empty(tuple(reversed(lead)) + (t.shape[-1] + 8,), dtype=t.dtype, device=t.device)
    big.normal_(generator=g)
    view = big[..., : t.shape[-1]].permute(*reversed(range(len(lead))), len(lead))
    view.copy_(t)
    return view


def _strided_lse(t):
    """Non-contiguous fp32 view (leading dims stored reversed)."""
    if t.dim() < 2:
        return t
    return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))


def make_parts(n, lead, d, dtype, *, device="cpu", strided=False, empty_frac=0.2, seed=0):
    """n partials (outs [n, *lead, d], lses [n, *lead]) with random empty entries (+inf and -inf, NaN in
    their out), a few all-empty rows, and LSEs far from 0 to exercise the max subtraction."""
    g = torch.Generator(device=device).manual_seed(seed)
    outs = torch.randn((n, *lead, d), generator=g, device=device).to(dtype)
    lses = torch.randn((n, *lead), generator=g, device=device) * 3 + 40 * torch.randn((*lead,), generator=g,
                                                                                         device=device)
    u = torch.rand((n, *lead), generator=g, device=device)
    lses = torch.where(u < empty_frac, torch.where(u < empty_frac / 2, INF, -INF), lses)
    flat = lses.view(n, -1)
    if flat.shape[1] >= 2:
        flat[:, 0] = INF  # an all-empty row
        flat[:, 1] = torch.where(torch.arange(n, device=device) % 2 == 1, INF, -INF)  # all empty, mixed signs
    outs[torch.isinf(lses)] = float("nan")
    if strided:
        return [_strided(o, g) for o in outs], [_strided_lse(l) for l in lses]
    return list(outs), list(lses)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# --------------------------------------------------------------------------------- reference vs oracle
def _attend64(q, k, v):
    """q [T, h, d], k [L, h, d], v [L, h, dv]; float64 softmax. Returns out, lse (+inf for L = 0)."""
    if k.shape[0] == 0:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), q.new_full(q.shape[:-1], INF)
    s = torch.einsum("thd,lhd->thl", q, k) * 0.2
    return torch.einsum("thl,lhv->thv", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("sizes", [(7, 12), (0, 9), (9, 0), (1, 1), (5, 5, 3, 0, 2)])
def test_ref_merge_equals_union(sizes):
    """Attention over the union of disjoint key sets == merge of the partial attentions."""
    g = torch.Generator().manual_seed(len(sizes) * 10 + sizes[0])
    T, h, d, dv = 4, 3, 16, 24
    q = torch.randn(T, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(sizes), h, d, generator=g, dtype=torch.float64) * 3
    v = torch.randn(sum(sizes), h, dv, generator=g, dtype=torch.float64)
    bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
    parts = [_attend64(q, k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])]
    outs = torch.stack([o for o, _ in parts])
    lses = torch.stack([l for _, l in parts])
    for i, s in enumerate(sizes):  # vLLM marks empty parts with -inf, and their out may be garbage
        if s == 0:
            lses[i] = -INF if i % 2 else INF
            outs[i] = float("nan")
    want_out, want_lse = _attend64(q, k, v)
    out, lse = merge_attn_states_ref(outs, lses)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    if len(sizes) == 2:
        out2, lse2 = merge_attn_states_ref(outs[:1], lses[:1])
        out2, lse2 = merge_attn_states_ref(torch.stack([out2, outs[1]]), torch.stack([lse2, lses[1]]))
        torch.testing.assert_close(out2, want_out, rtol=1e-12, atol=1e-12)


def test_ref_stable_for_large_lse():
    outs = torch.randn(2, 3, 8, dtype=torch.float64)
    lses = torch.tensor([[1000.0, -1000.0, 700.0], [1000.0, -1001.0, 760.0]], dtype=torch.float64)
    out, lse = merge_attn_states_ref(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(lse[0], torch.tensor(1000 + math.log(2), dtype=torch.float64))
    torch.testing.assert_close(out[0], (outs[0, 0] + outs[1, 0]) / 2)


def test_ref_empty_rules():
    outs = torch.full((3, 4, 8), float("nan"))
    outs[1, 0] = 1.0
    lses = torch.tensor([[INF, -INF, INF, -INF], [2.0, INF, -INF, -INF], [-INF, INF, INF, -INF]])
    out, lse = merge_attn_states_ref(outs, lses)
    assert torch.equal(out[0], torch.ones(8)) and lse[0] == 2.0  # one non-empty part: copied through
    assert (out[1:] == 0).all() and (lse[1:] == INF).all()  # all empty, either sign: out 0, lse +inf


# ------------------------------------------------------------------------------------ ops on the CPU
def _ref(outs, lses, dtype):
    out, lse = merge_attn_states_ref(torch.stack(outs).float(), torch.stack(lses))
    return out.to(dtype), lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_cpu_ops_match_ref(dtype, strided):
    outs, lses = make_parts(5, (6, 3), 16, dtype, strided=strided, seed=1)
    want_out, want_lse = _ref(outs[:2], lses[:2], dtype)
    out, lse = mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (6, 3, 16)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    buf = _poisoned(out.shape, dtype, "cpu")
    got, lse2 = mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1], out=buf)
    assert got is buf and torch.equal(buf, want_out) and torch.equal(lse2, want_lse)
    for n in (1, 2, 5):
        out, lse = mla_attn.merge_attn_states_n(torch.stack(outs[:n]), torch.stack(lses[:n]))
        want_out, want_lse = _ref(outs[:n], lses[:n], dtype)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        assert not out.isnan().any()


def test_cpu_n_zero_and_no_rows():
    out, lse = mla_attn.merge_attn_states_n(torch.empty(0, 3, 8), torch.empty(0, 3))
    assert (out == 0).all() and (lse == INF).all() and out.shape == (3, 8)
    out, lse = mla_attn.merge_attn_states(torch.empty(0, 4, 8), torch.empty(0, 4), torch.empty(0, 4, 8),
                                          torch.empty(0, 4))
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)


def _op_cases(device):
    outs, lses = make_parts(3, (5, 2), 16, torch.bfloat16, device=device, seed=2)
    a = (outs[0], lses[0], outs[1], lses[1])
    return a, torch.stack(outs), torch.stack(lses)


def test_opcheck(device):
    pair, outs, lses = _op_cases(device)
    torch.library.opcheck(OPS.merge_attn_states.default, pair)
    torch.library.opcheck(OPS.merge_attn_states_out.default,
                          pair + (torch.empty_like(pair[0]), torch.empty_like(pair[1])))
    torch.library.opcheck(OPS.merge_attn_states_n.default, (outs, lses))


def test_torch_compile_fullgraph():
    pair, outs, lses = _op_cases("cpu")

    def fn(oa, la, ob, lb, outs, lses):
        o, l = mla_attn.merge_attn_states(oa, la, ob, lb)
        return mla_attn.merge_attn_states_n(torch.stack([o, outs[2]]), torch.stack([l, lses[2]]))

    want = fn(*pair, outs, lses)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*pair, outs, lses)
    torch.testing.assert_close(got, want, equal_nan=True)


# ----------------------------------------------------------------------------------------- validation
def _pair(**kw):
    outs, lses = make_parts(2, (4, 2), 16, torch.bfloat16, seed=3)
    args = dict(out_a=outs[0], lse_a=lses[0], out_b=outs[1], lse_b=lses[1])
    args.update(kw)
    return args


OA = _pair()["out_a"]
PAIR_ERRORS = [
    (dict(out_a=OA.long()), TypeError, r"out_a must be bfloat16, float16 or float32"),
    (dict(out_b=OA.half()), TypeError, r"out_b dtype torch.float16 must match out_a dtype"),
    (dict(out_b=OA[:3]), ValueError, r"out_b shape \(3, 2, 16\) must match out_a shape \(4, 2, 16\)"),
    (dict(out_a=OA[..., :12], out_b=OA[..., :12]), ValueError, r"d a positive multiple of 8"),
    (dict(out_a=OA[..., :1].expand(4, 2, 2**31), out_b=OA[..., :1].expand(4, 2, 2**31)), ValueError,
     r"d a positive multiple of 8 below 2\^31"),
    (dict(out_a=OA.transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError, r"out_a: last dim must be contiguous"),
    (dict(out_a=torch.zeros(4, 2, 17, dtype=torch.bfloat16)[..., :16]), ValueError,
     r"out_a: stride\(0\) = 34 elements is not a multiple of 16 bytes"),
    (dict(lse_a=torch.zeros(4, 2, dtype=torch.float64)), TypeError, r"lse_a must be float32"),
    (dict(lse_b=torch.zeros(4, 3)), ValueError, r"lse_b must have shape \(4, 2\)"),
    (dict(lse_b=torch.zeros(4, 2, device="meta")), TypeError, r"lse_b is on meta"),
    (dict(out_b=OA.to("meta")), TypeError, r"out_b is on meta but out_a is on cpu"),
    (dict(out_a=torch.zeros((), dtype=torch.bfloat16)), ValueError, r"out_a must be \[..., d\]"),
]


@pytest.mark.parametrize("kw,exc,match", PAIR_ERRORS)
def test_pair_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        mla_attn.merge_attn_states(**_pair(**kw))


def test_out_overlapping_an_input():
    """out may be an input itself (also with another stride on a size-1 dim) or apart from it in one
    buffer; part of an input is refused. Fake tensors (no memory) are not judged."""
    buf = torch.randn(12, 3, 16).bfloat16()
    lse = torch.randn(12, 3)
    a, b = dict(out_a=buf[:4], lse_a=lse[:4]), dict(out_b=buf[4:8], lse_b=lse[4:8])
    want, _ = mla_attn.merge_attn_states(**a, **b)
    got, _ = mla_attn.merge_attn_states(**a, **b, out=buf[8:12])  # apart, in the same buffer
    assert torch.equal(got, want)
    got, _ = mla_attn.merge_attn_states(**a, **b, out=buf[:4])  # out_a itself
    assert torch.equal(got, want)
    x = torch.randn(3, 16).bfloat16()
    one = dict(out_a=x.unsqueeze(0), lse_a=torch.zeros(1, 3), out_b=torch.randn(1, 3, 16).bfloat16(), lse_b=torch.zeros(1, 3))
    mla_attn.merge_attn_states(**one, out=x.view(3, 1, 16).transpose(0, 1))  # out_a with another size-1 stride
    with pytest.raises(ValueError, match="out shares part of out_a's memory"):
        mla_attn.merge_attn_states(**a, **b, out=buf[1:5])
    # Across kinds too: a float32 out over an input's LSEs (the binding refuses it so).
    store = torch.randn(4 * 3 * 16)
    f32 = dict(out_a=torch.randn(4, 3, 16), lse_a=store[:12].view(4, 3), out_b=torch.randn(4, 3, 16), lse_b=torch.randn(4, 3))
    with pytest.raises(ValueError, match="out shares part of lse_a's memory"):
        mla_attn.merge_attn_states(**f32, out=store.view(4, 3, 16))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in {**a, **b}.items()}
        mla_attn.merge_attn_states(**fake, out=mode.from_tensor(torch.empty(9, 3, 16).bfloat16())[2:6])


def test_out_and_n_errors():
    with pytest.raises(TypeError, match=r"out dtype torch.float32 must match"):
        mla_attn.merge_attn_states(**_pair(), out=torch.empty(4, 2, 16))
    with pytest.raises(ValueError, match=r"out shape"):
        mla_attn.merge_attn_states(**_pair(), out=torch.empty(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out: elements overlap in memory"):
        mla_attn.merge_attn_states(**_pair(), out=torch.empty(1, 2, 16, dtype=torch.bfloat16).expand(4, 2, 16))
    with pytest.raises(ValueError, match=r"lse: elements overlap in memory"):
        OPS.merge_attn_states_out(*_pair().values(), torch.empty(4, 2, 16, dtype=torch.bfloat16),
                                  torch.empty(4, 1).expand(4, 2))
    with pytest.raises(ValueError, match=r"outs must be \[n, ..., d\]"):
        mla_attn.merge_attn_states_n(torch.zeros(16), torch.zeros(()))
    with pytest.raises(ValueError, match=r"lses must have shape \(3, 4\)"):
        mla_attn.merge_attn_states_n(torch.zeros(3, 4, 16), torch.zeros(4, 3))


# ----------------------------------------------------------------------------------------------- GPU
def _check_gpu(outs, lses, dtype, strided=False):
    """The CUDA ops (for 2 inputs the pair form: functional, out= into a contiguous and a strided buffer;
    always the n-way form on the stacked inputs, strided with the n dim innermost when `strided`)
    against the CPU reference."""
    want_out, want_lse = _ref([o.cpu() for o in outs], [l.cpu() for l in lses], dtype)
    got = []
    allocated = ((want_out.shape, dtype), (want_lse.shape, torch.float32))  # outputs the ops allocate: NaN first
    if len(outs) == 2:
        leave_nan_blocks(*allocated)
        got.append(mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1]))
        buf = _poisoned(want_out.shape, dtype, "cuda")
        lse_buf = _poisoned(want_lse.shape, torch.float32, "cuda")
        OPS.merge_attn_states_out(outs[0], lses[0], outs[1], lses[1], buf, lse_buf)
        got.append((buf, lse_buf))
        if want_lse.dim() <= 4:  # the kernel takes at most 4 leading dims that do not merge (documented)
            strided_buf = _strided(_poisoned(want_out.shape, dtype, "cuda"), torch.Generator("cuda"))
            strided_lse = _strided_lse(_poisoned(want_lse.shape, torch.float32, "cuda"))
            OPS.merge_attn_states_out(outs[0], lses[0], outs[1], lses[1], strided_buf, strided_lse)
            got.append((strided_buf, strided_lse))
    stacked_outs, stacked_lses = torch.stack(outs), torch.stack(lses)
    if strided:
        stacked_outs = _strided(stacked_outs, torch.Generator("cuda"))
        stacked_lses = _strided_lse(stacked_lses)
    leave_nan_blocks(*allocated)
    got.append(mla_attn.merge_attn_states_n(stacked_outs, stacked_lses))
    for out, lse in got:
        assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out.cpu(), want_out, **TOL[dtype])
        torch.testing.assert_close(lse.cpu(), want_lse, **LSE_TOL)
        empty = want_lse == INF
        assert (out.cpu()[empty] == 0).all() and (lse.cpu()[empty] == INF).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 512])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_gpu_matches_ref(n, strided, d, dtype):
    outs, lses = make_parts(n, (37, 16), d, dtype, device="cuda", strided=strided, seed=n * 7 + d)
    _check_gpu(outs, lses, dtype, strided)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d", [((1,), 8), ((3,), 24), ((2, 3, 5), 1024), ((4099,), 40), ((2, 2, 2, 2, 3), 64),
                                    ((0, 4), 16), ((1000, 3), 1032)])
def test_gpu_shapes(lead, d, dtype):
    for n in (2, 3):
        outs, lses = make_parts(n, lead, d, dtype, device="cuda", seed=d)
        _check_gpu(outs, lses, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_in_place(dtype):
    """out= and lse= may be the inputs themselves (each thread reads its chunk of a row before writing
    it): out_a / lse_a, out_b / lse_b, and out_a / lse_a under another stride of a size-1 dim. A view
    one row on is refused (test_error_paths.py)."""
    outs, lses = make_parts(2, (37, 1, 16), 512, dtype, device="cuda", seed=3)
    want_out, want_lse = _ref([o.cpu() for o in outs], [l.cpu() for l in lses], dtype)

    def other_size1_stride(t):
        stride = list(t.stride())
        stride[1] = 3
        return t.as_strided(t.shape, stride)

    for k, view in ((0, lambda t: t), (1, lambda t: t), (0, other_size1_stride)):
        o, l = [t.clone() for t in outs], [t.clone() for t in lses]
        OPS.merge_attn_states_out(o[0], l[0], o[1], l[1], view(o[k]), view(l[k]))
        torch.testing.assert_close(o[k].cpu(), want_out, **TOL[dtype])
        torch.testing.assert_close(l[k].cpu(), want_lse, **LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 5])
def test_gpu_all_empty(n):
    outs = torch.full((n, 9, 4, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    lses = torch.where(torch.rand(n, 9, 4, device="cuda") < 0.5, INF, -INF)
    leave_nan_blocks(((9, 4, 64), torch.bfloat16), ((9, 4), torch.float32))
    if n == 2:
        out, lse = mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    else:
        out, lse = mla_attn.merge_attn_states_n(outs, lses)
    assert (out == 0).all() and (lse == INF).all()


@pytest.mark.gpu
def test_gpu_n_zero():
    leave_nan_blocks(((3, 8), torch.float32), ((3,), torch.float32))
    out, lse = mla_attn.merge_attn_states_n(torch.empty(0, 3, 8, device="cuda"), torch.empty(0, 3, device="cuda"))
    assert (out == 0).all() and (lse == INF).all()


@pytest.mark.gpu
def test_gpu_cuda_graph():
    outs, lses = make_parts(2, (64, 8), 512, torch.bfloat16, device="cuda", seed=5)
    out = torch.empty_like(outs[0])
    mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1], out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse = mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1], out=out)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    want_out, want_lse = _ref([o.cpu() for o in outs], [l.cpu() for l in lses], torch.bfloat16)
    torch.testing.assert_close(out.cpu(), want_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse.cpu(), want_lse, **LSE_TOL)


@pytest.mark.gpu
def test_gpu_errors():
    pair, outs, lses = _op_cases("cuda")
    shifted = torch.empty(pair[0].numel() + 1, dtype=pair[0].dtype, device="cuda")[1:].view(pair[0].shape)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        OPS.merge_attn_states(shifted, pair[1], pair[2], pair[3])
    with pytest.raises(RuntimeError, match="must be on"):
        OPS.merge_attn_states(pair[0], pair[1].cpu(), pair[2], pair[3])
    with pytest.raises(RuntimeError, match="float32"):
        OPS.merge_attn_states_n(outs, lses.double())
    outs5, lses5 = make_parts(2, (2, 2, 2, 2, 3), 16, torch.bfloat16, device="cuda", strided=True)
    with pytest.raises(ValueError, match="at most 4 leading dims"):
        OPS.merge_attn_states(outs5[0], lses5[0], outs5[1], lses5[1])
