"""CUDA kernels against the reference and the CPU scheduler (sm_90 only)."""
import pytest
import torch
from cases import D_QK, D_V, make_decode_case

import mla_attn
from mla_attn.metadata import schedule_cpu
from mla_attn.reference import mla_decode_ref

pytestmark = pytest.mark.gpu
TOL = dict(out=dict(rtol=2e-2, atol=2e-2), lse=dict(rtol=2e-3, atol=2e-3))


def _cuda(c):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}


def _run(c, causal, **kw):
    if c["cu_seqlens_q"] is not None:
        kw["max_seqlen_q"] = c["max_seqlen_q"]
    return mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                               cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"], softmax_scale=c["softmax_scale"],
                               causal=causal, return_lse=True, validate=True, **kw)


def _check(c, causal, out, lse):
    want_out, want_lse = mla_decode_ref(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                                        cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"],
                                        softmax_scale=c["softmax_scale"], causal=causal)
    torch.testing.assert_close(out.float(), want_out, **TOL["out"])
    torch.testing.assert_close(lse, want_lse.float(), **TOL["lse"])


@pytest.mark.parametrize("h_q,s_q", [(1, 1), (16, 1), (128, 1), (3, 7), (63, 2), (128, 4)])
def test_metadata_matches_cpu(h_q, s_q):
    g = torch.Generator().manual_seed(h_q * s_q)
    lens = torch.randint(0, 20000, (37,), generator=g, dtype=torch.int32)
    lens[::4] = 0
    md = mla_attn.get_decode_metadata(lens.cuda(), h_q, s_q=s_q)
    ts, rs = schedule_cpu(lens, None, s_q, h_q, md.num_sm_parts, md.tile_sched.shape[0])
    assert torch.equal(md.tile_sched.cpu(), ts) and torch.equal(md.req_splits.cpu(), rs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["batched", "varlen_pe", "batched_4d"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_q,s_q", [(1, 1), (16, 2), (128, 1), (9, 7)])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_vs_reference(page_size, h_q, s_q, causal, layout, dtype):
    lens = [1023, 0, 113, 1, 239, 4096, 799]
    c = _cuda(make_decode_case(lens, s_q, h_q, page_size, varlen="varlen" in layout, split_pe="pe" in layout,
                               kv_4d="4d" in layout, dtype=dtype, seed=h_q + s_q))
    poisoned = torch.full(c["q"].shape[:-1] + (D_V,), float("nan"), dtype=dtype, device="cuda")
    out, lse = _run(c, causal, out=poisoned)
    assert out is poisoned
    _check(c, causal, out, lse)


def test_strided_q():
    c = _cuda(make_decode_case([300, 77], 2, 16, 64))
    buf = torch.randn(2, 2, 16, D_QK + 64, device="cuda").bfloat16()
    buf[..., :D_QK] = c["q"]
    c["q"] = buf[..., :D_QK]  # row stride 640 elements = 1280 bytes: aligned but not contiguous
    _check(c, True, *_run(c, True))


def test_cuda_graph_replay():
    c = _cuda(make_decode_case([500, 64, 3000], 1, 128, 64))
    lens = c["cache_seqlens"]
    graph = torch.cuda.CUDAGraph()
    kw = dict(softmax_scale=c["softmax_scale"], return_lse=True)
    mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], lens, **kw)  # warm-up (lazy init)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # metadata computed inside the graph: no host sync allowed
        out, lse = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], lens, **kw)
    for new in ([500, 64, 3000], [17, 0, 2999], [64, 1, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        _check(c, True, out, lse)
