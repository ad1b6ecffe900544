"""mla_prefill through its CPU implementation: an independent float64 oracle, opcheck, torch.compile,
and input validation."""
import itertools

import pytest
import torch

import mla_attn

from cases import make_prefill_case
from conftest import to_device


def oracle(c, causal):
    """Plain per-request, per-head softmax attention in float64 (row i sees keys j <= i + L_k - L_q)."""
    q, v = c["q"].double(), c["v"].double()
    k = c["k"].double()
    if c["k_pe"] is not None:
        k = torch.cat([k, c["k_pe"].double().expand(-1, k.shape[1], -1)], dim=-1)
    group = q.shape[1] // k.shape[1]
    cq, ck = c["cu_seqlens_q"].tolist(), c["cu_seqlens_k"].tolist()
    t_q = cq[-1]
    out = torch.zeros(t_q, q.shape[1], 128, dtype=torch.float64)
    lse = torch.full((t_q, q.shape[1]), float("inf"), dtype=torch.float64)
    for b in range(len(cq) - 1):
        n_q, n_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for h in range(q.shape[1]):
            for i in range(n_q):
                last = i + n_k - n_q if causal else n_k - 1
                if last < 0 or n_k == 0:
                    continue
                keys = slice(ck[b], ck[b] + min(last, n_k - 1) + 1)
                s = k[keys, h // group] @ q[cq[b] + i, h] * c["softmax_scale"]
                lse[cq[b] + i, h] = torch.logsumexp(s, 0)
                out[cq[b] + i, h] = torch.softmax(s, 0) @ v[keys, h // group]
    return out, lse


def call(c, causal, **kw):
    return mla_attn.mla_prefill(c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], c["max_seqlen_q"],
                                c["max_seqlen_k"], softmax_scale=c["softmax_scale"], causal=causal, k_pe=c["k_pe"],
                                return_lse=True, **kw)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split_pe", [False, True])
@pytest.mark.parametrize("lens_q,lens_k,h_q,h_k", [([3, 1, 9], [3, 4, 9], 2, None), ([6, 2], [2, 0], 4, 2)])
def test_cpu_matches_oracle(lens_q, lens_k, h_q, h_k, split_pe, causal):
    c = make_prefill_case(lens_q, lens_k, h_q, h_k=h_k, split_pe=split_pe)
    out, lse = call(c, causal)
    ref_out, ref_lse = oracle(c, causal)
    t_q = ref_out.shape[0]
    # the CPU op computes in float32 and rounds the output to bf16 (relative step 2^-8)
    torch.testing.assert_close(out[:t_q].double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[:t_q].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_opcheck_and_compile_cpu():
    c = make_prefill_case([5, 2], [7, 2], 2, split_pe=True, pad=0)
    args = (c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], c["max_seqlen_q"], c["max_seqlen_k"],
            c["softmax_scale"], True)
    torch.library.opcheck(torch.ops.mla_attn.mla_prefill.default, args, {"k_pe": c["k_pe"]})
    out = torch.empty(c["q"].shape[0], 2, 128, dtype=c["q"].dtype)
    lse = torch.empty(c["q"].shape[0], 2)
    torch.library.opcheck(torch.ops.mla_attn.mla_prefill_out.default, args + (out, lse), {"k_pe": c["k_pe"]})

    def step(q, k, v, k_pe, cu_q, cu_k):
        return mla_attn.mla_prefill(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.1, causal=True, k_pe=k_pe,
                                    return_lse=True, validate=False)

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(c["q"], c["k"], c["v"], c["k_pe"], c["cu_seqlens_q"], c["cu_seqlens_k"])
    want = step(c["q"], c["k"], c["v"], c["k_pe"], c["cu_seqlens_q"], c["cu_seqlens_k"])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c.update(q=c["q"][..., :128]), "q must be"),
    (lambda c: c.update(v=c["v"].float()), "dtype"),
    (lambda c: c.update(cu_seqlens_k=c["cu_seqlens_k"].long()), "int32"),
    (lambda c: c.update(cu_seqlens_k=c["cu_seqlens_k"][:-1]), "B \\+ 1"),
    (lambda c: c.update(k_pe=c["k_pe"].expand(-1, 2, -1)), "k_pe must be"),
    (lambda c: c.update(max_seqlen_q=1), "max_seqlen"),
    (lambda c: c.update(cu_seqlens_q=c["cu_seqlens_q"] + 1), "must be 0"),
    (lambda c: c.update(softmax_scale=None), "softmax_scale is required"),
    (lambda c: c.update(q=torch.empty(c["q"].numel() + 8, dtype=c["q"].dtype)[4:4 + c["q"].numel()].view(c["q"].shape)),
     "q must start at a multiple of 16 bytes"),
])
def test_validation_errors(mutate, match):
    c = make_prefill_case([3, 2], [3, 2], 2, split_pe=True)
    mutate(c)
    with pytest.raises((ValueError, TypeError), match=match):
        call(c, True)


def test_chunked_prefill_merged_equals_whole(device):
    """New tokens attending causally to themselves and non-causally to two chunks of cached context,
    merged by LSE, equal one causal call over context + new tokens (bottom-right alignment)."""
    lens_new, lens_ctx = [300, 77], [1000, 2077]
    c = make_prefill_case(lens_new, [a + b for a, b in zip(lens_ctx, lens_new)], 4, split_pe=True, pad=0)
    c = to_device(c, device)
    whole_out, whole_lse = call(c, True)
    starts = c["cu_seqlens_k"].tolist()

    def keys(ranges):  # per request b: key rows [starts[b] + lo, starts[b] + hi)
        idx = torch.cat([torch.arange(starts[b] + lo, starts[b] + hi) for b, (lo, hi) in enumerate(ranges)])
        idx = idx.to(device)
        sizes = [hi - lo for lo, hi in ranges]
        cu = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int32, device=device)
        return dict(c, k=c["k"][idx], v=c["v"][idx], k_pe=c["k_pe"][idx], cu_seqlens_k=cu, max_seqlen_k=max(sizes))

    parts = [call(keys([(0, n // 2) for n in lens_ctx]), False),
             call(keys([(n // 2, n) for n in lens_ctx]), False),
             call(keys([(n, n + m) for n, m in zip(lens_ctx, lens_new)]), True)]
    out, lse = mla_attn.merge_attn_states_n(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    # each partial is rounded to bf16 before the merge: allow a few bf16 steps of |out| <~ 0.2
    torch.testing.assert_close(out.float(), whole_out.float(), atol=4e-3, rtol=0)
    torch.testing.assert_close(lse, whole_lse, atol=1e-4, rtol=0)
