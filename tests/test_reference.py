"""The reference (the project's oracle) against deliberately naive float64 loops written here."""
import math

import pytest
import torch
from cases import D_V, check_unit_scale_error, make_decode_case

from mla_attn.reference import merge_attn_states_ref, mla_decode_ref, mla_prefill_ref

LENS = [300, 0, 113, 1, 15]  # request 1 also gets 0 q tokens when varlen


def naive_rows(q_rows, keys, values, scale, causal):
    """q_rows [s, h, d]; keys [L, h|1, d]; values [L, h|1, dv]. One query row at a time, float64."""
    s, h, _ = q_rows.shape
    n_keys = keys.shape[0]
    out = torch.zeros(s, h, values.shape[-1], dtype=torch.float64)
    lse = torch.full((s, h), math.inf, dtype=torch.float64)
    for t in range(s):
        visible = n_keys - s + t + 1 if causal else n_keys
        if visible <= 0:
            continue
        k = keys[:visible].double().expand(visible, h, keys.shape[-1])
        v = values[:visible].double().expand(visible, h, values.shape[-1])
        scores = (q_rows[t].double()[None] * k).sum(-1) * scale  # [visible, h]
        m = scores.max(0).values
        e = torch.exp(scores - m)
        out[t] = (e[..., None] * v).sum(0) / e.sum(0)[:, None]
        lse[t] = m + torch.log(e.sum(0))
    return out, lse


def naive_decode(c, causal):
    q = c["q"] if c["q_pe"] is None else torch.cat([c["q"], c["q_pe"]], -1)
    kv, bt, ps = c["kv_cache"], c["block_table"], c["kv_cache"].shape[1]
    kv = kv.reshape(kv.shape[0], ps, kv.shape[-1])
    outs, lses = [], []
    for b, n_keys in enumerate(c["cache_seqlens"].tolist()):
        # dense gather, one slot at a time
        keys = torch.stack([kv[int(bt[b, j // ps]), j % ps] for j in range(n_keys)]) if n_keys \
            else kv.new_zeros(0, kv.shape[-1])
        rows = q[b] if c["cu_seqlens_q"] is None else q[c["cu_seqlens_q"][b]: c["cu_seqlens_q"][b + 1]]
        o, l = naive_rows(rows, keys[:, None], keys[:, None, :D_V], c["softmax_scale"], causal)
        outs.append(o)
        lses.append(l)
    if c["cu_seqlens_q"] is None:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("layout", ["batched", "varlen", "batched_pe", "varlen_pe_4d"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s_q", [1, 2, 7])
@pytest.mark.parametrize("h_q", [1, 3, 16])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_ref_vs_naive(page_size, h_q, s_q, causal, layout):
    c = make_decode_case(LENS, s_q, h_q, page_size, varlen="varlen" in layout, split_pe="pe" in layout,
                         kv_4d="4d" in layout, seed=page_size + h_q + s_q)
    want_out, want_lse = naive_decode(c, causal)
    args = (c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"])
    kw = dict(cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"], softmax_scale=c["softmax_scale"], causal=causal)
    out, lse = mla_decode_ref(*args, **kw, dtype=torch.float64)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    out32, lse32 = mla_decode_ref(*args, **kw)  # default float32
    assert out32.dtype == lse32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse32.double(), want_lse, rtol=1e-4, atol=1e-4)


def test_decode_ref_empty_rows():
    c = make_decode_case([0, 2], 4, 2, 16)
    out, lse = mla_decode_ref(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                              softmax_scale=1.0, causal=True)
    assert (out[0] == 0).all() and (lse[0] == math.inf).all()  # no keys at all
    assert (out[1, :2] == 0).all() and (lse[1, :2] == math.inf).all()  # causal: s_q > L
    assert torch.isfinite(lse[1, 2:]).all()


def make_prefill(seq_q, seq_k, h, split_pe, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(torch.tensor(seq_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(seq_k).cumsum(0)), dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, h, 192, generator=g)
    k = torch.randn(tk, h, 192, generator=g)
    v = torch.randn(tk, h, 128, generator=g)
    k_pe = None
    if split_pe:
        k_pe = torch.randn(tk, 1, 64, generator=g)
        k = k[..., :128]
    return q, k, v, cu_q, cu_k, k_pe


@pytest.mark.parametrize("split_pe", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_ref_vs_naive(causal, split_pe):
    seq_q, seq_k = [3, 0, 5, 4, 2], [7, 4, 5, 2, 0]  # T_q < T_k, empty q, T_q > T_k, empty k
    q, k, v, cu_q, cu_k, k_pe = make_prefill(seq_q, seq_k, 3, split_pe)
    scale = 192**-0.5
    out, lse = mla_prefill_ref(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal, k_pe=k_pe,
                               dtype=torch.float64)
    k_full = k if k_pe is None else torch.cat([k, k_pe.expand(-1, 3, -1)], -1)
    for b in range(len(seq_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want_out, want_lse = naive_rows(q[qs], k_full[ks], v[ks], scale, causal)
        torch.testing.assert_close(out[qs], want_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[qs], want_lse, rtol=1e-10, atol=1e-10)
    if causal:  # bottom-right: request 3 has 4 queries over 2 keys, so its first 2 rows see nothing
        r3 = int(cu_q[3])
        assert (lse[r3: r3 + 2] == math.inf).all() and (out[r3: r3 + 2] == 0).all()


def test_merge_equals_union():
    seq_q, seq_k = [3, 2, 4], [9, 5, 6]
    q, k, v, cu_q, cu_k, _ = make_prefill(seq_q, seq_k, 2, False, seed=1)
    # split each request's keys into two disjoint sets; request 1 puts all keys in part A
    take_a = [[0, 2, 3, 7], [0, 1, 2, 3, 4], [5]]
    parts = {"a": ([], [0]), "b": ([], [0])}
    for b in range(len(seq_k)):
        idx = list(range(int(cu_k[b]), int(cu_k[b + 1])))
        a = [idx[i] for i in take_a[b]]
        for name, sel in (("a", a), ("b", [i for i in idx if i not in a])):
            parts[name][0].extend(sel)
            parts[name][1].append(parts[name][1][-1] + len(sel))
    outs, lses = [], []
    for sel, cu in parts.values():
        o, l = mla_prefill_ref(q, k[sel], v[sel], cu_q, torch.tensor(cu, dtype=torch.int32), softmax_scale=0.3,
                               causal=False, dtype=torch.float64)
        outs.append(o)
        lses.append(l)
    assert (lses[1][int(cu_q[1]): int(cu_q[2])] == math.inf).all()  # an empty part takes part in the merge
    out, lse = merge_attn_states_ref(torch.stack(outs), torch.stack(lses))
    want_out, want_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, softmax_scale=0.3, causal=False, dtype=torch.float64)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


def test_merge_all_empty():
    outs = torch.full((3, 2, 4, 8), float("nan"))  # empty parts may hold garbage
    lses = torch.tensor([math.inf, -math.inf, math.inf]).reshape(3, 1, 1).expand(3, 2, 4).clone()
    out, lse = merge_attn_states_ref(outs, lses)
    assert (out == 0).all() and (lse == math.inf).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unit_scale_check_tells_dropped_keys_from_rounding(dtype):
    """check_unit_scale_error, the GPU tests' bound, passes a kernel's roundings (fp32 scores and
    softmax, P and 16 split partials in 16 bits, 16-bit out) and fails 8 of 4099 keys dropped."""
    c = make_decode_case([4099], 1, 16, 64, seed=5, dtype=dtype)
    args = (c["q"], c["kv_cache"], c["block_table"])
    kw = dict(softmax_scale=c["softmax_scale"], causal=False)
    ref, _ = mla_decode_ref(*args, c["cache_seqlens"], **kw)
    low, _ = mla_decode_ref(*args, c["cache_seqlens"], dtype=dtype, **kw)
    keys = c["kv_cache"].view(-1, c["kv_cache"].shape[-1])[
        (c["block_table"][0, torch.arange(4099) // 64].long() * 64 + torch.arange(4099) % 64)].float()
    scores = c["q"][0, 0].float() @ keys.T * c["softmax_scale"]
    partials, lses = [], []
    for piece in torch.arange(4099).chunk(16):
        s = scores[:, piece]
        m = s.max(1, keepdim=True).values
        p = torch.exp(s - m)
        partials.append(((p.to(dtype).float() @ keys[piece, :D_V]) / p.sum(1, keepdim=True)).to(dtype).float())
        lses.append((m + p.sum(1, keepdim=True).log()).squeeze(1))
    lse = torch.logsumexp(torch.stack(lses), 0)
    kernel_like = sum(torch.exp(l - lse)[:, None] * o for o, l in zip(partials, lses)).to(dtype).view_as(ref)
    check_unit_scale_error(kernel_like, ref, low)
    dropped, _ = mla_decode_ref(*args, c["cache_seqlens"] - 8, **kw)
    with pytest.raises(AssertionError):
        check_unit_scale_error(dropped.to(dtype), ref, low)
