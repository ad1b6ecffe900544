"""Batch invariance (deterministic=True): the scheduler never splits a request, so a request's rows are
summed by one CTA in key order and come out bit-identical whatever else is in the batch."""
import pytest
import torch
from cases import make_decode_case
from conftest import check_decode, ragged_lengths, schedule_segments, to_device
from fp8_cases import to_ds_case, to_fp8_case

import mla_attn
from mla_attn.metadata import BLOCK_N, schedule_cpu


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("parts", [1, 2, 7, 66, 132])
def test_deterministic_schedule_never_splits(parts, seed):
    lens = ragged_lengths(seed, 60, 4)
    B = lens.shape[0]
    lens[seed % B] = 200000  # one request longer than a fair share: would be split otherwise
    tile_sched, req_splits = schedule_cpu(lens, None, 1, 16, parts, 132, deterministic=True)
    n = [-(-l // BLOCK_N) for l in lens.tolist()]
    assert req_splits.tolist() == [[1, 0]] * B, "every request in one piece, no workspace slot"
    segments = schedule_segments(tile_sched, parts, n)
    for b in range(B):
        pieces = [seg for seg in segments if seg[0] == b]
        assert len(pieces) == 1, (b, pieces)
        _, lo, hi, k, _ = pieces[0]
        assert lo == 0 and k == 0 and hi == n[b], (b, pieces)
    if parts > 1:  # the same batch is split without the flag, so the test exercises a real change
        assert schedule_cpu(lens, None, 1, 16, parts, 132)[1][:, 0].max() > 1


def test_deterministic_schedule_hand_worked():
    # n = [30, 2, 2], P = 3, payload 22: part 0 takes request 0 whole (35 > 22, but the part is empty),
    # part 1 takes requests 1 and 2 (7 + 7 <= 22), part 2 is empty.
    ts, rs = schedule_cpu(torch.tensor([1920, 100, 70], dtype=torch.int32), None, 1, 1, 3, 4, deterministic=True)
    assert ts.tolist() == [[0, 0, 0, 30, 0, 1920, 0, 0], [1, 0, 2, 2, 0, 100, 0, 0]] + [[0, 0, -1, 0, 0, 0, 0, 0]] * 2
    assert rs.tolist() == [[1, 0]] * 3


def test_deterministic_flag_plumbing_cpu():
    lens = torch.tensor([5000, 10], dtype=torch.int32)
    md = mla_attn.get_decode_metadata(lens, 16, s_q=1, deterministic=True)
    assert md.deterministic and md.req_splits[:, 0].tolist() == [1, 1]
    assert not mla_attn.get_decode_metadata(lens, 16, s_q=1).deterministic
    torch.library.opcheck(torch.ops.mla_attn.get_decode_metadata.default, (lens, None, 1, 16, True, 7, 9),
                          {"deterministic": True})
    c = make_decode_case([50, 3], 1, 4, 16)
    args = (c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"])
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], 4, s_q=1, deterministic=True)
    with pytest.raises(ValueError, match="metadata was computed for deterministic=True but this call has False"):
        mla_attn.mla_decode(*args, softmax_scale=0.1, metadata=md)
    got = mla_attn.mla_decode(*args, softmax_scale=0.1, metadata=md, deterministic=True)
    assert torch.equal(got, mla_attn.mla_decode(*args, softmax_scale=0.1))


# ------------------------------------------------------------------------------------------------ GPU
# The kernels that run any max_seqlen_q, per cache format (rows64_seesaw runs as rows64 with
# deterministic=True: dispatch.h); page 24 gathers rows instead of TMA boxes.
INVARIANCE_CACHES = [(fmt, page, kernel) for fmt, page, kernels in [
    ("bf16", 64, ["rows64", "seesaw", "seesaw_steady", "rows64_seesaw"]),
    ("bf16", 24, ["rows64", "seesaw"]),
    ("fp8", 64, ["rows64", "fp8mma"]),
    ("fp8", 24, ["rows64"]),
    ("ds_mla_fp8", 64, ["rows64"]),
] for kernel in [None] + kernels]


@pytest.mark.gpu
@pytest.mark.parametrize("cache,page_size,kernel", INVARIANCE_CACHES)
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (128, 1), (64, 3)])
def test_batch_invariance_gpu(h_q, s_q, cache, page_size, kernel):
    """The same request (same q rows, same cache pages) in batches of different size, composition,
    position and max_seqlen_q gives bit-identical out and lse, with the dispatch's kernel and with
    each kernel forced, over each cache format; it is split in some of them without the flag, so the
    test covers the policy."""
    target_len = 9000
    convert = {"bf16": lambda c: c, "fp8": to_fp8_case, "ds_mla_fp8": to_ds_case}[cache]
    base = make_decode_case([target_len], s_q, h_q, page_size, varlen=True, seed=1)
    target_q = base["q"]  # its s_q tokens
    results, split_somewhere = [], False
    for comp in range(6):
        g = torch.Generator().manual_seed(100 + comp)
        others = torch.randint(0, 6000, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        pos = int(torch.randint(0, len(others) + 1, (1,), generator=g))
        lens = others[:pos] + [target_len] + others[pos:]
        c = make_decode_case(lens, 7 if comp % 2 else s_q, h_q, page_size, varlen=True, seed=200 + comp)
        # install the target: its q tokens and its keys (same values, in this case's pages)
        cu = c["cu_seqlens_q"]
        sizes = (cu[1:] - cu[:-1]).tolist()
        sizes[pos] = s_q
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(sizes), 0)
        q = torch.randn(int(cu[-1]), h_q, 576).to(torch.bfloat16)
        q[cu[pos]:cu[pos + 1]] = target_q
        pages = c["block_table"][pos, : -(-target_len // page_size)].long()
        src = base["block_table"][0, : -(-target_len // page_size)].long()
        c["kv_cache"][pages] = base["kv_cache"][src]
        c = to_device(convert(c))  # per-tensor or per-row scales: the target's bytes are the same in every batch
        max_q = max(max(sizes), 1)
        kw = dict(cu_seqlens_q=cu.cuda(), max_seqlen_q=max_q, softmax_scale=192**-0.5, causal=True, return_lse=True,
                  k_scale=c.get("k_scale"))
        args = (q.cuda(), c["kv_cache"], c["block_table"], c["cache_seqlens"])
        out = torch.full((q.shape[0], h_q, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        o, lse = mla_attn.mla_decode(*args, out=out, deterministic=True, _kernel=kernel, **kw)
        rows = slice(int(cu[pos]), int(cu[pos + 1]))
        results.append((o[rows].clone(), lse[rows].clone()))
        md = mla_attn.get_decode_metadata(args[3], h_q, cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=max_q)
        split_somewhere |= int(md.req_splits[pos, 0]) > 1
        md_det = mla_attn.get_decode_metadata(args[3], h_q, cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=max_q,
                                              deterministic=True)
        assert (md_det.req_splits[:, 0] == 1).all()
    assert split_somewhere, "the default policy never split the target: the test would prove nothing"
    o0, l0 = results[0]
    check_decode(to_device(convert(dict(base, softmax_scale=192**-0.5))), True, o0, l0, kernel)
    for o, l in results[1:]:
        assert torch.equal(o, o0) and torch.equal(l, l0)
