"""The torch.ops surface on CPU: registration, CPU kernels vs the reference, opcheck, torch.compile
through the fakes, and the CPU scheduler (the twin of the device scheduler kernel)."""
import re
from pathlib import Path

import pytest
import torch
from cases import D_V, make_decode_case
from conftest import decode_kernels_for, ragged_lengths, schedule_segments

import mla_attn
from mla_attn.metadata import (BLOCK_N, DECODE_KERNELS, FIXED_COST, NO_SPLIT_SLACK, SCHEDULE_COLUMN, ScheduleRow,
                               num_sm_parts, schedule_cpu, split_payload)
from mla_attn.reference import mla_decode_ref

OPS = torch.ops.mla_attn


def _call_kwargs(c, **extra):
    kw = dict(cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"], softmax_scale=c["softmax_scale"])
    if c["cu_seqlens_q"] is not None:
        kw["max_seqlen_q"] = c["max_seqlen_q"]
    kw.update(extra)
    return kw


def _args(c):
    return c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"]


def test_ops_registered():
    for name in ("get_decode_metadata", "mla_decode", "mla_decode_out"):
        assert hasattr(OPS, name), name
    assert "arch" in mla_attn.build_info()
    assert mla_attn.__version__ == "0.1.0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("varlen,split_pe,causal", [(False, False, True), (True, True, True), (True, False, False)])
def test_decode_cpu_matches_reference(varlen, split_pe, causal, dtype):
    c = make_decode_case([37, 0, 130], 3, 5, 16, varlen=varlen, split_pe=split_pe, dtype=dtype)
    out, lse = mla_attn.mla_decode(*_args(c), **_call_kwargs(c, causal=causal, return_lse=True))
    want_out, want_lse = mla_decode_ref(*_args(c), cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"],
                                        softmax_scale=c["softmax_scale"], causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == c["q"].shape[:-1] + (D_V,) and lse.shape == c["q"].shape[:-1]
    torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-2, atol=1e-2)
    assert torch.equal(mla_attn.mla_decode(*_args(c), **_call_kwargs(c, causal=causal)), out)


def test_decode_out_variant_in_place():
    c = make_decode_case([50, 3], 2, 4, 16)
    want, want_lse = mla_attn.mla_decode(*_args(c), **_call_kwargs(c, return_lse=True))
    out = torch.full_like(want, float("nan"))
    got, lse = mla_attn.mla_decode(*_args(c), **_call_kwargs(c, out=out, return_lse=True))
    assert got is out
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _op_args(c, causal=True):
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], c["q"].shape[-2], cu_seqlens_q=c["cu_seqlens_q"],
                                      max_seqlen_q=c["max_seqlen_q"], causal=causal)
    return (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], c["cu_seqlens_q"],
            c["max_seqlen_q"], c["softmax_scale"], causal, md.tile_sched, md.req_splits, md.num_sm_parts)


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck(varlen):
    # All default opcheck tests, test_aot_dispatch_dynamic included: on these sizes it takes ~1 s.
    c = make_decode_case([20, 0, 33], 2, 3, 16, varlen=varlen, split_pe=varlen)
    args = _op_args(c)
    torch.library.opcheck(OPS.mla_decode.default, args)
    out = torch.empty(c["q"].shape[:-1] + (D_V,), dtype=c["q"].dtype)
    lse = torch.empty(c["q"].shape[:-1], dtype=torch.float32)
    torch.library.opcheck(OPS.mla_decode_out.default, args + (out, lse))
    torch.library.opcheck(OPS.mla_decode_out.default, args + (out, None))  # lse kept by the op
    torch.library.opcheck(OPS.get_decode_metadata.default,
                          (c["cache_seqlens"], c["cu_seqlens_q"], c["max_seqlen_q"], 3, True, 7, 9))


def test_decode_kernel_option_cpu():
    # The private split_kernel= of the ops: None or a kernel that can run the case runs (the CPU reference
    # stands in for every kernel); any other name is a ValueError, as from the CUDA op.
    c = make_decode_case([20, 0, 33], 2, 3, 16)
    args = _op_args(c)
    want = OPS.mla_decode(*args)
    runs = decode_kernels_for(c["kv_cache"].dtype, 2 * 3)
    for name in (None,) + DECODE_KERNELS:
        if name is not None and name not in runs:
            with pytest.raises(ValueError, match=f"decode kernel '{name}' needs"):
                OPS.mla_decode(*args, split_kernel=name)
            continue
        got = OPS.mla_decode(*args, split_kernel=name)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    out = torch.empty_like(want[0])
    lse = torch.empty_like(want[1])
    OPS.mla_decode_out(*args, out, lse, split_kernel="rows64")
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    out.fill_(float("nan"))
    OPS.mla_decode_out(*args, out, None)
    assert torch.equal(out, want[0])
    with pytest.raises(ValueError, match="unknown decode kernel 'rows32'"):
        OPS.mla_decode(*args, split_kernel="rows32")
    with pytest.raises(ValueError, match="unknown decode kernel"):
        OPS.mla_decode_out(*args, out, lse, split_kernel="")
    torch.library.opcheck(OPS.mla_decode.default, args, {"split_kernel": "seesaw"})


def test_decode_op_attn_sink():
    """attn_sink [h_q] of the decode op scales each head's output by exp(lse) / (exp(lse) + exp(sink))
    and leaves lse as it is: -inf is no sink, +inf zeroes the head, a request without keys stays 0."""
    c = make_decode_case([20, 0, 33], 2, 4, 16)
    args = _op_args(c)
    out, lse = OPS.mla_decode(*args)
    sink = torch.tensor([0.5, -float("inf"), float("inf"), 3.0])
    got, got_lse = OPS.mla_decode(*args, attn_sink=sink)
    assert torch.equal(got_lse, lse)
    assert torch.equal(got[..., 1, :], out[..., 1, :]) and not got[..., 2, :].any()
    assert not got[1].any()  # the request without keys
    for h in (0, 3):
        keep = torch.isfinite(lse[..., h])
        factor = 1.0 / (1.0 + torch.exp(sink[h] - lse[..., h][keep]))
        torch.testing.assert_close(got[..., h, :][keep].float(), out[..., h, :][keep].float() * factor[:, None],
                                   rtol=1e-2, atol=1e-3)
    torch.library.opcheck(OPS.mla_decode.default, args, {"attn_sink": sink})
    with pytest.raises(ValueError, match=r"attn_sink must be \[h_q\] = \[4\]"):
        OPS.mla_decode(*args, attn_sink=sink[:3])


def test_mla_decode_attn_sink():
    """mla_decode(attn_sink=) is the op's sink (on the CPU op), checked before the call."""
    c = make_decode_case([20, 0, 33], 2, 4, 16)
    sink = torch.tensor([0.5, -float("inf"), float("inf"), 3.0])
    kw = dict(softmax_scale=c["softmax_scale"], q_pe=c["q_pe"], cu_seqlens_q=c["cu_seqlens_q"],
              max_seqlen_q=c["max_seqlen_q"] if c["cu_seqlens_q"] is not None else None, return_lse=True)
    got = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], attn_sink=sink, **kw)
    want = OPS.mla_decode(*_op_args(c), attn_sink=sink)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"attn_sink must be \[h_q\] = \[4\]"):
        mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], attn_sink=sink[:3], **kw)
    with pytest.raises(TypeError, match="attn_sink must be float32"):
        mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], attn_sink=sink.double(), **kw)


def test_decode_kernel_names_match_the_dispatch_header():
    (header,) = (Path(__file__).resolve().parents[1] / "csrc").glob("**/dispatch.h")
    table = re.search(r"kDecodeKernelNames = \{\{(.*?)\}\};", header.read_text(), re.S).group(1)
    assert tuple(re.findall(r'\{DecodeKernel::\w+, "(\w+)"\}', table)) == DECODE_KERNELS


def test_torch_compile_fullgraph():
    c = make_decode_case([40, 7], 2, 4, 16)
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], 4, s_q=2)

    def fn(q, kv, bt, lens):
        return mla_attn.mla_decode(q, kv, bt, lens, softmax_scale=0.1, metadata=md, return_lse=True)

    def fn_ops(q, kv, bt, lens):  # straight torch.ops, metadata inside the graph
        tile_sched, req_splits = OPS.get_decode_metadata(lens, None, 2, 4, True, md.num_sm_parts, 132)
        return OPS.mla_decode(q, None, kv, bt, lens, None, 2, 0.1, True, tile_sched, req_splits, md.num_sm_parts)

    want = fn(*_args(c))
    for f in (fn, fn_ops):
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(*_args(c))
        torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------- scheduler
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("parts", [1, 2, 7, 66, 132])
def test_schedule_properties(parts, seed):
    lens = ragged_lengths(seed, 40, 5)  # with zero-length requests
    B = lens.shape[0]
    tile_sched, req_splits = schedule_cpu(lens, None, 1, 16, parts, 132)
    assert tile_sched.shape == (132, 8) and tile_sched.dtype == torch.int32 and req_splits.shape == (B, 2)
    assert (tile_sched[parts:] == torch.tensor([0, 0, -1, 0, 0, 0, 0, 0], dtype=torch.int32)).all()
    n = [-(-l // BLOCK_N) for l in lens.tolist()]
    num_splits, slot_start = req_splits[:, 0].tolist(), req_splits[:, 1].tolist()
    covered = [[0] * nb for nb in n]
    splits_seen = [[] for _ in n]
    cost = [0] * parts
    for b, lo, hi, k, p in schedule_segments(tile_sched, parts, n):
        assert 0 <= lo <= hi <= n[b]
        for blk in range(lo, hi):
            covered[b][blk] += 1
        splits_seen[b].append(k)
        cost[p] += hi - lo + FIXED_COST
    assert all(c == 1 for row in covered for c in row), "every KV block exactly once"
    for b in range(B):  # split indices 0..num_splits-1, in walk order
        assert splits_seen[b] == list(range(num_splits[b])), b
    slots = [s if s > 1 else 0 for s in num_splits]
    assert slot_start == [sum(slots[:b]) for b in range(B)]
    assert sum(slots) <= 2 * (parts - 1)  # each cut adds one split; a split request has >= 2
    payload = split_payload(n, parts)
    # Balanced: only the last part takes the remainder (whole requests: at most NO_SPLIT_SLACK more).
    assert max(cost[:-1], default=0) <= payload + (NO_SPLIT_SLACK if max(num_splits, default=1) <= 1 else 0)
    for p in range(parts):  # first_seqlen: the length of the part's first request (0 for an empty part)
        r = ScheduleRow(*tile_sched[p].tolist())
        assert r.first_seqlen == (lens[r.first_request] if r.last_request >= r.first_request else 0)
    # split_list: b + 1 of each split request in order (at most parts - 1 of them), then zeros.
    split_list = [b + 1 for b in range(B) if num_splits[b] > 1]
    assert len(split_list) <= parts - 1 or not split_list
    assert tile_sched[:, SCHEDULE_COLUMN.split_list].tolist() == split_list + [0] * (132 - len(split_list))


def test_schedule_hand_worked():
    # n = [10, 3], P = 2: total 23, payload 14 (split_payload: 12 and 13 leave blocks over); whole
    # requests fit at capacity 15 <= 14 + NO_SPLIT_SLACK: part 0 takes request
    # 0 (15), request 1 (8) no longer fits. first_seqlen is the length of the part's first request.
    ts, rs = schedule_cpu(torch.tensor([640, 130], dtype=torch.int32), None, 1, 1, 2, 4)
    assert ts.tolist() == [[0, 0, 0, 10, 0, 640, 0, 0], [1, 0, 1, 3, 0, 130, 0, 0]] + [[0, 0, -1, 0, 0, 0, 0, 0]] * 2
    assert rs.tolist() == [[1, 0], [1, 0]]
    # n = [30], P = 3: total 35, payload 15 (the smallest that fits), so 10-block pieces with split
    # indices 0, 1, 2.
    ts, rs = schedule_cpu(torch.tensor([1920], dtype=torch.int32), None, 1, 1, 3, 3)
    # split_list of row 0: request 0 (+ 1) is the first split request.
    assert ts.tolist() == [[0, 0, 0, 10, 0, 1920, 1, 0], [0, 10, 0, 20, 1, 1920, 0, 0], [0, 20, 0, 30, 2, 1920, 0, 0]]
    assert rs.tolist() == [[3, 0]]
    # empty batch: all parts empty
    ts, rs = schedule_cpu(torch.zeros(0, dtype=torch.int32), None, 1, 1, 2, 2)
    assert ts.tolist() == [[0, 0, -1, 0, 0, 0, 0, 0]] * 2 and rs.shape == (0, 2)


def test_metadata_sizing():
    assert num_sm_parts(132, 1, 128) == 66  # 2 q tiles per request
    assert num_sm_parts(132, 1, 16) == 132
    assert num_sm_parts(132, 512, 128) == 1
    md = mla_attn.get_decode_metadata(torch.tensor([5, 9], dtype=torch.int32), 128, s_q=2, causal=False)
    assert (md.num_sm_parts, md.max_seqlen_q, md.num_heads_q, md.causal) == (33, 2, 128, False)
    assert md.tile_sched.shape == (132, 8) and md.req_splits.shape == (2, 2)
