"""mla_prefill on the GPU against the float32 reference, on adversarial packed inputs
(tests/cases.py: strided views, NaN past the last request and in unused columns)."""
import pytest
import torch

import mla_attn
from mla_attn._ops import prefill_cpu

from cases import check_unit_scale_error, make_prefill_case
from conftest import to_device

pytestmark = pytest.mark.gpu


def run(c, causal, **kw):
    return mla_attn.mla_prefill(c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], c["max_seqlen_q"],
                                c["max_seqlen_k"], softmax_scale=c["softmax_scale"], causal=causal,
                                k_pe=c["k_pe"], return_lse=True, **kw)


def poisoned_out(c):
    """An out= of NaN: rows the kernel leaves unwritten fail the checks."""
    return torch.full(c["q"].shape[:2] + (128,), float("nan"), dtype=c["q"].dtype, device=c["q"].device)


def reference(c, causal, dtype):
    """The CPU op's math (mla_prefill_ref) run on the GPU tensors, in `dtype`."""
    q, k, v, k_pe = (None if t is None else t.to(dtype) for t in (c["q"], c["k"], c["v"], c["k_pe"]))
    return prefill_cpu(q, k, v, c["cu_seqlens_q"], c["cu_seqlens_k"], c["softmax_scale"], causal, k_pe)


def check(c, causal, out, lse):
    """out within check_unit_scale_error of the float32 math (measured by the same math in q's dtype);
    LSE within 1e-3; +inf LSE and zero output exactly on rows that see no key; only the packed rows are
    compared."""
    t_q = int(c["cu_seqlens_q"][-1])
    out, lse = out[:t_q], lse[:t_q]
    ref_out, ref_lse = (x[:t_q] for x in reference(c, causal, torch.float32))
    low_out, _ = reference(c, causal, c["q"].dtype)
    assert torch.isfinite(out).all(), "non-finite output"
    check_unit_scale_error(out, ref_out, low_out[:t_q])
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all(), "+inf lse exactly on empty rows"
    assert not out[empty].any(), "rows without a visible key must be 0"
    if (~empty).any():
        lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item()
        assert lse_err <= 1e-3, f"lse max err {lse_err:.3e}"


CASES = [
    # (lens_q, lens_k, h_q, h_k)
    ([1, 17, 128, 1000], [1, 17, 128, 1000], 16, None),
    ([4097], [4097], 16, None),
    ([1000, 17, 4097], [1000, 17, 4097], 1, None),
    ([128, 1000], [128, 1000], 128, None),
    ([17, 128, 300], [1000, 4097, 300], 16, None),  # chunk of new tokens after context: T_q < T_k
    ([200, 5, 64], [100, 0, 64], 16, None),          # more queries than keys, and no keys: empty rows
    ([129, 1], [257, 1], 8, 2),                      # grouped k/v heads
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_pe", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens_q,lens_k,h_q,h_k", CASES)
def test_prefill_matches_reference(lens_q, lens_k, h_q, h_k, causal, split_pe, dtype):
    c = to_device(make_prefill_case(lens_q, lens_k, h_q, h_k=h_k, split_pe=split_pe, dtype=dtype))
    out, lse = run(c, causal, out=poisoned_out(c))
    check(c, causal, out, lse)


def test_out_given_and_two_runs_bit_identical():
    c = to_device(make_prefill_case([300, 1000], [300, 1000], 16, split_pe=True))
    out = poisoned_out(c)
    _, lse = run(c, True, out=out)
    check(c, True, out, lse)
    out2, lse2 = run(c, True)
    t_q = int(c["cu_seqlens_q"][-1])
    assert torch.equal(out[:t_q], out2[:t_q]) and torch.equal(lse[:t_q], lse2[:t_q])


@pytest.mark.parametrize("h_q", [1, 4])
@pytest.mark.parametrize("split_pe", [False, True])
def test_one_token_with_any_stride(split_pe, h_q):
    """A tensor of one token (or one head) may carry any stride there (torch never steps a dim of extent
    1), here one that is not a multiple of 16 bytes in q, k, v and k_pe: the TMA maps took the token
    stride as given and were refused."""
    c = to_device(make_prefill_case([1], [1], h_q, split_pe=split_pe, pad=0))
    odd = dict(c)
    for key in ("q", "k", "v", "k_pe"):
        if c[key] is not None:
            t = c[key].contiguous()
            stride = [s + 1 if n == 1 else s for n, s in zip(t.shape[:-1], t.stride()[:-1])] + [1]
            odd[key] = t.as_strided(t.shape, stride)
    for causal in (True, False):
        out, lse = run(odd, causal)
        check(c, causal, out, lse)


def test_zero_keys_and_empty_batch():
    c = to_device(make_prefill_case([5, 3], [0, 0], 4, pad=0))
    c["k"], c["v"] = c["k"][:0], c["v"][:0]
    out, lse = run(c, False, out=poisoned_out(c))
    assert not out.any() and torch.isinf(lse).all() and (lse > 0).all()
    c = to_device(make_prefill_case([], [], 4, pad=0))
    out, lse = run(c, True)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)


def test_opcheck_cuda():
    c = to_device(make_prefill_case([70, 3], [130, 3], 2, split_pe=True, pad=0))
    args = (c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], c["max_seqlen_q"], c["max_seqlen_k"],
            c["softmax_scale"], True)
    torch.library.opcheck(torch.ops.mla_attn.mla_prefill.default, args, {"k_pe": c["k_pe"]})
