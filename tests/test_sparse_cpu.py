"""Sparse (top-k) attention on the CPU ops: the float64 reference against independent computations, the
compaction op against its rule, mla_sparse_decode / mla_sparse_prefill against the reference on
adversarial cases (tests/sparse_cases.py), the wrappers' errors, metadata reuse and tracing."""
import math

import pytest
import torch
from cases import make_decode_case, to_device
from serving_utils import RecordOps, opcheck_all
from sparse_cases import FP8, check_sparse, make_sparse_case, run_sparse, valid_first

import mla_attn
from mla_attn.reference import mla_decode_ref, mla_sparse_ref


# ------------------------------------------------------------------------------------------ reference
def test_reference_is_dense_decode_over_listed_slots():
    """Indices naming a request's keys page by page give the dense decode of that request (non-causal)."""
    case = make_decode_case([77, 130, 5], 1, 4, 16, seed=1)
    kv, table, lens = case["kv_cache"], case["block_table"], case["cache_seqlens"].tolist()
    topk = max(lens) + 3
    idx = torch.full((3, 1, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        keys = torch.arange(n)
        idx[b, 0, :n] = (table[b, keys // 16] * 16 + keys % 16).int()
    out, lse = mla_sparse_ref(case["q"], kv, idx, softmax_scale=0.07)
    ref_out, ref_lse = mla_decode_ref(case["q"], kv, table, case["cache_seqlens"], softmax_scale=0.07, causal=False,
                                      dtype=torch.float64)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)


def test_reference_sink_is_a_key_without_value():
    """A sink is a key of score `sink` and value 0: softmax over [scores, sink] with the sink's column
    dropped gives the sinked output; +inf gives 0, -inf the plain attention."""
    g = torch.Generator().manual_seed(2)
    q, kv = torch.randn(2, 3, 576, generator=g), torch.randn(1, 20, 576, generator=g)
    idx = torch.tensor([[3, 7, 7, 19, -1], [0, 1, 2, 3, 4]], dtype=torch.int32)
    sink = torch.tensor([0.3, math.inf, -math.inf])
    out, lse = mla_sparse_ref(q, kv, idx, softmax_scale=0.05, attn_sink=sink)
    plain, plain_lse = mla_sparse_ref(q, kv, idx, softmax_scale=0.05)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=0)
    for r in range(2):
        keys = kv[0, [i for i in idx[r].tolist() if i >= 0]].double()
        s = q[r].double() @ keys.T * 0.05  # [h, n]
        full = torch.softmax(torch.cat([s[:1], sink[:1].double()[:, None]], dim=1), dim=1)[:, :-1]  # finite sink
        torch.testing.assert_close(out[r, :1], full @ keys[:, :512], rtol=1e-9, atol=1e-12)
    assert not out[:, 1].any() and torch.equal(out[:, 2], plain[:, 2])


def test_reference_validity_rules():
    """-1, negatives, slots past the cache and positions past topk_length are skipped; a repeat counts
    twice; a batched topk_length applies to each token of its request."""
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(2, 2, 1, 576, generator=g), torch.randn(2, 4, 576, generator=g)
    idx = torch.tensor([[[5, -1, 8, 2**31 - 1, 5, 1], [6, -3, 0, 0, 7, 2]],
                        [[1, 2, 3, 4, 5, 6], [7, 6, 5, 4, 3, 2]]], dtype=torch.int32)
    out, lse = mla_sparse_ref(q, kv, idx, softmax_scale=0.1, topk_length=torch.tensor([5, 0], dtype=torch.int32))
    flat = kv.reshape(8, 576).double()
    for (b, t), keys in {(0, 0): [5, 5], (0, 1): [6, 0, 0, 7]}.items():
        s = flat[keys] @ q[b, t, 0].double() * 0.1
        torch.testing.assert_close(lse[b, t, 0], torch.logsumexp(s, 0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[b, t, 0], torch.softmax(s, 0) @ flat[keys, :512], rtol=1e-9, atol=1e-12)
    assert torch.isinf(lse[1]).all() and not out[1].any()


# -------------------------------------------------------------------------------------------- compaction
def _compact_loop(indices, lengths, num_slots):
    slots = torch.full_like(indices, -1)
    counts = torch.zeros(indices.shape[0], dtype=torch.int32)
    for r, row in enumerate(indices.tolist()):
        keep = [i for i in row[:max(0, min(int(lengths[r]), len(row)))] if 0 <= i < num_slots]
        slots[r, :len(keep)] = torch.tensor(keep, dtype=torch.int32)
        counts[r] = len(keep)
    return slots, counts


@pytest.mark.parametrize("topk", [1, 7, 64, 2049])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_compact_matches_its_rule(topk, with_lengths):
    g = torch.Generator().manual_seed(topk)
    idx = torch.randint(-3, 120, (9, topk), generator=g, dtype=torch.int32)
    idx[2, : topk // 2] = 2**31 - 1
    lengths = torch.randint(-2, topk + 3, (9,), generator=g, dtype=torch.int32)  # clamped to [0, topk]
    slots, counts = torch.ops.mla_attn.compact_sparse_indices(idx, lengths if with_lengths else None, 100)
    want = _compact_loop(idx, lengths if with_lengths else torch.full((9,), topk), 100)
    assert torch.equal(slots, want[0]) and torch.equal(counts, want[1])


def test_compact_opcheck():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 50, (5, 33), generator=g, dtype=torch.int32)
    for lengths in (None, torch.tensor([0, 33, 5, 17, 1], dtype=torch.int32)):
        torch.library.opcheck(torch.ops.mla_attn.compact_sparse_indices.default, (idx, lengths, 40))


# ------------------------------------------------------------------------------------------- the op
CPU_CASES = [  # (lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, fp8)
    ((3, 2), 16, 40, 16, torch.bfloat16, True, None, False, False, False),
    ((5,), 1, 33, 1, torch.float16, True, "finite", False, False, False),
    ((2, 1), 3, 64, 64, torch.bfloat16, False, "mixed", True, True, False),
    ((4,), 8, 17, 16, torch.bfloat16, False, "+inf", False, False, False),
    ((1, 3), 5, 20, 7, torch.float16, True, "-inf", False, False, False),
    ((4,), 4, 50, 16, torch.bfloat16, True, "finite", False, False, True),
]


@pytest.mark.parametrize("lead,h_q,topk,page_size,dtype,lengths,sink,split_pe,kv_4d,fp8", CPU_CASES)
def test_sparse_decode_matches_reference(lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, fp8):
    case = make_sparse_case(lead, h_q, topk, page_size, dtype=dtype, lengths=lengths, sink=sink, split_pe=split_pe,
                            kv_4d=kv_4d, fp8=fp8, seed=topk)
    assert case["kv_cache"].dtype == (FP8 if fp8 else dtype)
    assert case["num_valid"] > 0
    out = torch.full(lead + (h_q, 512), float("nan"), dtype=dtype)
    got, lse = run_sparse(case, out=out)
    assert got.data_ptr() == out.data_ptr()
    check_sparse(case, out, lse)
    fresh, lse2 = run_sparse(case)  # the functional form: same values
    assert torch.equal(fresh, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("lead,topk,page_size,kv_4d", [((3, 2), 70, 16, False), ((4,), 130, 1, True)])
def test_sparse_decode_ds_mla_fp8_cache(lead, topk, page_size, kv_4d):
    """DeepSeek-V3.2's 656-byte rows (topk not a multiple of 64, page 1 and 16, both cache ranks),
    against the reference on the dequantised cache."""
    case = make_sparse_case(lead, 8, topk, page_size, lengths=True, sink="finite", kv_4d=kv_4d, ds_fp8=True, seed=3)
    assert case["kv_cache"].dtype == torch.uint8
    out = torch.full(lead + (8, 512), float("nan"), dtype=torch.bfloat16)
    run_sparse(case, out=out)
    _, lse = run_sparse(case)
    check_sparse(case, out, lse)
    traced = torch.compile(lambda c: run_sparse(c), fullgraph=True, backend="aot_eager")(case)
    assert torch.equal(traced[1], lse)
    with pytest.raises(ValueError, match="k_scale"):
        run_sparse({**case, "k_scale": torch.tensor([1.0])})
    every_other_page = torch.cat([case["kv_cache"]] * 2)[::2][:case["kv_cache"].shape[0]]
    if page_size > 1:  # its rows are not back to back
        with pytest.raises(ValueError, match="back to back"):
            run_sparse({**case, "kv_cache": every_other_page})


# batched: one count per request (valid_first); not for a case of one request, whose count is 0 there
VALID_FIRST_PARAMS = [pytest.param(*c, batched) for c in CPU_CASES for batched in (False, True)
                      if not (batched and (len(c[0]) < 2 or c[0][0] < 2))]


@pytest.mark.parametrize("lead,h_q,topk,page_size,dtype,lengths,sink,split_pe,kv_4d,fp8,batched", VALID_FIRST_PARAMS)
def test_indices_valid_skips_the_compaction(lead, h_q, topk, page_size, dtype, lengths, sink, split_pe, kv_4d, fp8,
                                            batched):
    """indices_valid=True on rows whose valid indices come first, counted by topk_length (per token, or
    per request of a batched call): no compaction runs, the positions past the count (garbage, NaN slots
    among it) are never read, and the result is the compacting call's."""
    case = valid_first(make_sparse_case(lead, h_q, topk, page_size, dtype=dtype, lengths=lengths, sink=sink,
                                        split_pe=split_pe, kv_4d=kv_4d, fp8=fp8, seed=topk), batched=batched)
    assert int(case["topk_length"].max()) > 0
    compact = torch.ops.mla_attn.compact_sparse_indices.default
    with RecordOps() as ops:
        got = run_sparse(case, indices_valid=True)
    assert compact not in ops.calls
    check_sparse(case, *got)
    with RecordOps() as ops:
        want = run_sparse(case)
    assert compact in ops.calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def opcheck_sparse_call(kind, device):
    """opcheck of the ops one sparse decode dispatches (mla_decode with kv_slots and attn_sink; the
    compaction, or skip_invalid_slots on a ds_mla_fp8 cache), with its arguments, and of mla_decode_out.
    Not a float8_e4m3fn cache: opcheck's schema test multiplies its tensors, which torch cannot in e4m3."""
    case = make_sparse_case((3, 2), 4, 24, 16, lengths=True, sink="finite", ds_fp8=kind == "ds_fp8", seed=13)
    with RecordOps() as ops:
        run_sparse(to_device(case, device))
    names = {"mla_decode", "get_decode_metadata"} | ({"compact_sparse_indices"} if kind == "bf16" else set())
    assert {op._schema.name for op in ops.calls} == {"mla_attn::" + n for n in names}
    assert opcheck_all(ops.calls) == names | {"mla_decode_out"}


@pytest.mark.parametrize("kind", ["bf16", "ds_fp8"])
def test_opcheck_of_a_sparse_call(kind):
    opcheck_sparse_call(kind, "cpu")


@pytest.mark.parametrize("kind", ["bf16", "ds_fp8"])
def test_indices_valid_with_out_metadata_and_pieces(monkeypatch, kind):
    """indices_valid=True into out=, with a step's metadata, and in pieces of more query tokens than one
    schedule takes (limit lowered to 2): the compacting call's result each time (a ds_mla_fp8 cache skips
    invalid slots itself: the flag changes nothing there)."""
    case = valid_first(make_sparse_case((3, 2), 4, 24, 16, lengths=True, sink="finite", ds_fp8=kind == "ds_fp8",
                                        seed=12), batched=True)
    want = run_sparse(case)
    check_sparse(case, *want)
    out = torch.full(want[0].shape, float("nan"), dtype=want[0].dtype)
    md = mla_attn.get_sparse_decode_metadata(case["indices"], 4)
    got = run_sparse(case, indices_valid=True, out=out, metadata=md)
    assert got[0].data_ptr() == out.data_ptr() and torch.equal(out, want[0]) and torch.equal(got[1], want[1])
    wide = torch.full(case["indices"].shape[:-1] + (30,), -1, dtype=torch.int32)
    wide[..., :24] = case["indices"]
    got = run_sparse({**case, "indices": wide[..., :24]}, indices_valid=True)  # rows 30 apart, read in place
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setattr(mla_attn.sparse, "MAX_SCHEDULED_REQUESTS", 2)
    for out in (None, torch.full(want[0].shape, float("nan"), dtype=want[0].dtype)):
        got = run_sparse(case, indices_valid=True, out=out)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_indices_valid_is_checked():
    """The promise is verified where value checks run (always on CPU): a counted index outside the cache
    is a ValueError naming it (batched or token-major), the same index past the row's count is not."""
    case = valid_first(make_sparse_case((3, 2), 4, 20, 16, lengths=True, seed=2))
    bad = case["indices"].clone()
    r = int(case["topk_length"].argmax())
    bad[r, 0] = -1
    with pytest.raises(ValueError, match=rf"indices_valid=True, but indices\[{r}, 0\] = -1 is not a cache slot in "
                                         rf"\[0, \d+\) and it is within topk_length = \d+ of its row"):
        run_sparse({**case, "indices": bad}, indices_valid=True)
    with pytest.raises(ValueError, match=r"indices_valid=True, but indices\[0, 0\] = -1 is not a cache slot in "
                                         r"\[0, \d+\) and without topk_length every index of a row counts"):
        run_sparse({**case, "topk_length": None}, indices_valid=True)
    batched = valid_first(make_sparse_case((3, 2), 4, 20, 16, lengths=True, seed=2), batched=True)
    bad = batched["indices"].clone()
    b = int(batched["topk_length"].argmax())
    bad[b, 1, 0] = 2**31 - 1
    with pytest.raises(ValueError, match=rf"indices_valid=True, but indices\[{b}, 1, 0\] = 2147483647 is not a"):
        run_sparse({**batched, "indices": bad}, indices_valid=True)
    with pytest.raises(TypeError, match="indices_valid must be a bool, got int"):
        run_sparse(case, indices_valid=1)
    check_sparse(case, *run_sparse(case, indices_valid=True, validate=True))
    check_sparse(batched, *run_sparse(batched, indices_valid=True, validate=True))


def test_sparse_prefill_matches_reference():
    case = make_sparse_case((6,), 4, 24, 1, lengths=True, sink="finite", seed=9)
    kv = case["kv_cache"][:, 0]  # [S, 576]
    out, lse = mla_attn.mla_sparse_prefill(case["q"], kv, case["indices"], softmax_scale=case["softmax_scale"],
                                           topk_length=case["topk_length"], attn_sink=case["attn_sink"],
                                           return_lse=True)
    check_sparse(case, out, lse)
    out3 = mla_attn.mla_sparse_prefill(case["q"], kv[:, None], case["indices"], softmax_scale=case["softmax_scale"],
                                       topk_length=case["topk_length"], attn_sink=case["attn_sink"])
    assert torch.equal(out3, out)
    counted = valid_first(case)
    got = mla_attn.mla_sparse_prefill(counted["q"], kv, counted["indices"], softmax_scale=case["softmax_scale"],
                                      topk_length=counted["topk_length"], attn_sink=case["attn_sink"],
                                      return_lse=True, indices_valid=True)
    check_sparse(counted, *got)


def test_metadata_reuse():
    """The schedule depends on shapes only: one made for a step serves calls (layers) with other
    indices, lengths and caches of the same R, topk and h_q; calls of other shapes are refused."""
    case = make_sparse_case((2, 2), 8, 30, 16, lengths=True, seed=4)
    md = mla_attn.get_sparse_decode_metadata(case["indices"], 8)
    assert isinstance(md, mla_attn.SparseDecodeMetadata) and (md.rows, md.topk) == (4, 30)
    for c in (case, make_sparse_case((2, 2), 8, 30, 24, lengths=True, seed=5)):
        a = run_sparse(c, metadata=md)
        check_sparse(c, *a)
        b = run_sparse(c)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="metadata was computed for 4 query tokens of top-k 30"):
        run_sparse({**case, "indices": case["indices"][:, :1], "q": case["q"][:, :1]}, metadata=md)
    with pytest.raises(ValueError, match="metadata was computed for num_heads_q=8 but this call has 4"):
        run_sparse({**case, "q": case["q"][..., :4, :]}, metadata=md)
    with pytest.raises(TypeError, match="metadata must be a SparseDecodeMetadata"):
        run_sparse(case, metadata=md.decode)


@pytest.mark.parametrize("lead,kind", [((3, 2), "ds_fp8"), ((5,), "bf16"), ((2, 3), "fp8")])
def test_more_query_tokens_than_a_schedule_takes(monkeypatch, lead, kind):
    """Above MAX_SCHEDULED_REQUESTS query tokens (a long prefill) the call runs in pieces, each with a
    schedule of its own: the same out and lse as one piece, into out= too; a schedule for that many
    tokens cannot be made (shown here with the limit lowered to 2)."""
    case = make_sparse_case(lead, 4, 24, 16, lengths=True, sink="finite", fp8=kind == "fp8",
                            ds_fp8=kind == "ds_fp8", seed=11)
    whole = run_sparse(case)
    monkeypatch.setattr(mla_attn.sparse, "MAX_SCHEDULED_REQUESTS", 2)
    pieces = run_sparse(case)
    assert torch.equal(pieces[0], whole[0]) and torch.equal(pieces[1], whole[1])
    out = torch.full(whole[0].shape, float("nan"), dtype=whole[0].dtype)
    got, lse = run_sparse(case, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, whole[0]) and torch.equal(lse, whole[1])
    check_sparse(case, *pieces)
    with pytest.raises(ValueError, match=r"one schedule takes at most 2 query tokens, got \d+; call mla_sparse_decode "
                                         r"without metadata="):
        mla_attn.get_sparse_decode_metadata(case["indices"], 4)


def test_scheduler_request_limit():
    """get_decode_metadata takes at most MAX_SCHEDULED_REQUESTS requests, on CPU as on the GPU."""
    with pytest.raises(ValueError, match="get_decode_metadata schedules at most 50000 requests, got 50001"):
        mla_attn.get_decode_metadata(torch.ones(50001, dtype=torch.int32), 16, s_q=1)


@pytest.mark.parametrize("indices_valid", [False, True])
def test_torch_compile_fullgraph_traces(indices_valid):
    """fullgraph tracing of the whole call (fakes of every op it runs); aot_eager keeps CPU compile time small."""
    case = make_sparse_case((3,), 4, 16, 16, lengths=True, sink="finite", seed=5)
    if indices_valid:
        case = valid_first(case)

    def f(q, kv, idx, lengths, sink):
        return mla_attn.mla_sparse_decode(q, kv, idx, softmax_scale=0.04, topk_length=lengths, attn_sink=sink,
                                          return_lse=True, indices_valid=indices_valid)

    args = (case["q"], case["kv_cache"], case["indices"], case["topk_length"], case["attn_sink"])
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    want = f(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------- errors
def _call(change=None, **kw):
    case = make_sparse_case((2, 2), 4, 8, 16, lengths=True, sink="finite", seed=6)
    case.update((change or (lambda c: {}))(case))
    return lambda: run_sparse(case, **kw)


WRAPPER_CASES = [
    ("uint8 cache of 576-byte rows", _call(lambda c: dict(kv_cache=torch.zeros(4, 64, 576, dtype=torch.uint8))),
     ValueError, r"kv_cache must be \[num_pages, page_size, 656\].*\(ds_mla_fp8: 656 bytes per token\)"),
    ("int8 cache", _call(lambda c: dict(kv_cache=torch.zeros(4, 64, 656, dtype=torch.int8))), TypeError,
     r"kv_cache dtype torch.int8 must match q dtype .* or be float8_e4m3fn or uint8 \(ds_mla_fp8\)"),
    ("cache dtype", _call(lambda c: dict(kv_cache=c["kv_cache"].half())), TypeError, r"kv_cache dtype torch.float16"),
    ("q dtype", _call(lambda c: dict(q=c["q"].float())), TypeError, r"q must be bfloat16 or float16"),
    ("q dims", _call(lambda c: dict(q=c["q"][..., :500])), ValueError, r"q must be \[B, s_q, h_q, 576\]"),
    ("heads", _call(lambda c: dict(q=torch.zeros(2, 2, 129, 576, dtype=torch.bfloat16))), ValueError,
     r"num_heads_q must be in \[1, 128\], got 129"),
    ("indices dtype", _call(lambda c: dict(indices=c["indices"].long())), TypeError, r"indices must be int32"),
    ("indices shape", _call(lambda c: dict(indices=c["indices"][:1])), ValueError,
     r"indices must be \[B, s_q, topk\] = \[2, 2, topk >= 1\]"),
    ("indices topk 0", _call(lambda c: dict(indices=c["indices"][..., :0])), ValueError, r"topk >= 1"),
    ("indices token-major", _call(lambda c: dict(q=c["q"][0], indices=c["indices"][0, :1], topk_length=None)),
     ValueError, r"indices must be \[T, topk\] = \[2, topk >= 1\]"),
    ("lengths dtype", _call(lambda c: dict(topk_length=c["topk_length"].long())), TypeError,
     r"topk_length must be int32"),
    ("lengths shape", _call(lambda c: dict(topk_length=c["topk_length"].repeat(2))), ValueError,
     r"topk_length must be \[2\] \(one length per request\)"),
    ("lengths value", _call(lambda c: dict(topk_length=torch.tensor([3, 9], dtype=torch.int32))), ValueError,
     r"topk_length\[1\] = 9 is not in \[0, topk=8\]"),
    ("sink dtype", _call(lambda c: dict(attn_sink=c["attn_sink"].bfloat16())), TypeError, r"attn_sink must be float32"),
    ("sink shape", _call(lambda c: dict(attn_sink=c["attn_sink"][:2])), ValueError,
     r"attn_sink must be \[h_q\] = \[4\]"),
    ("k_scale without fp8", _call(lambda c: dict(k_scale=torch.ones(1))), ValueError,
     r"k_scale is only valid with a float8_e4m3fn kv_cache"),
    ("fp8 without k_scale", _call(lambda c: dict(kv_cache=c["kv_cache"].to(FP8))), ValueError,
     r"float8_e4m3fn kv_cache needs k_scale"),
    ("scale", _call(lambda c: dict(softmax_scale=None)), ValueError, r"softmax_scale is required"),
    ("scale inf", _call(lambda c: dict(softmax_scale=math.inf)), ValueError, r"softmax_scale must be a finite number"),
    ("out shape", _call(out=torch.zeros(2, 2, 4, 256, dtype=torch.bfloat16)), ValueError, r"out must have shape"),
    ("out strides", _call(out=torch.zeros(2, 3, 4, 512, dtype=torch.bfloat16)[:, :2]), ValueError,
     r"stride\(0\) must be s_q \* stride\(1\)"),
    ("kernel", _call(_kernel="narrow16_3wg"), ValueError, r"'narrow16_3wg' needs a float8_e4m3fn kv_cache"),
    ("kernel rows", _call(lambda c: dict(q=torch.zeros(2, 2, 32, 576, dtype=torch.bfloat16), attn_sink=None),
                          _kernel="narrow16"),
     ValueError, r"runs at most 16 query rows per request .* got 32"),
    ("prefill q", lambda: mla_attn.mla_sparse_prefill(torch.zeros(2, 1, 4, 576), torch.zeros(5, 576),
                                                      torch.zeros(2, 1, dtype=torch.int32), softmax_scale=0.1),
     ValueError, r"q must be \[T, h_q, 576\]"),
    ("prefill kv fp8", lambda: mla_attn.mla_sparse_prefill(torch.zeros(2, 4, 576, dtype=torch.bfloat16),
                                                           torch.zeros(5, 576).to(FP8),
                                                           torch.zeros(2, 1, dtype=torch.int32), softmax_scale=0.1),
     TypeError, r"kv must be bfloat16 or float16"),
    ("prefill kv shape", lambda: mla_attn.mla_sparse_prefill(torch.zeros(2, 4, 576, dtype=torch.bfloat16),
                                                             torch.zeros(5, 2, 576, dtype=torch.bfloat16),
                                                             torch.zeros(2, 1, dtype=torch.int32), softmax_scale=0.1),
     ValueError, r"kv must be \[S, 576\] or \[S, 1, 576\]"),
    ("metadata heads", lambda: mla_attn.get_sparse_decode_metadata(torch.zeros(2, 4, dtype=torch.int32), 0),
     ValueError, r"num_heads_q must be in \[1, 128\], got 0"),
    ("metadata indices", lambda: mla_attn.get_sparse_decode_metadata(torch.zeros(4, dtype=torch.int32), 4),
     ValueError, r"indices must be \[B, s_q, topk\] or \[T, topk\]"),
    ("metadata indices dtype", lambda: mla_attn.get_sparse_decode_metadata(torch.zeros(2, 4, dtype=torch.int64), 4),
     TypeError, r"indices must be int32, got torch.int64"),
]


@pytest.mark.parametrize("name,fn,exc,match", WRAPPER_CASES, ids=[c[0] for c in WRAPPER_CASES])
def test_wrapper_error(name, fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_wrapper_base_call_is_valid():
    """The error cases' base call runs: each case fails for its own change only."""
    _call()()


def test_meta_device_mismatch():
    case = make_sparse_case((2,), 4, 8, 16, sink="finite", seed=7)
    with pytest.raises(TypeError, match="attn_sink is on meta but q is on cpu"):
        run_sparse({**case, "attn_sink": case["attn_sink"].to("meta")})
    with pytest.raises(TypeError, match="indices is on meta but q is on cpu"):
        run_sparse({**case, "indices": case["indices"].to("meta")})


# --------------------------------------------------------------------------------------------- layer
def with_all_keys_indexer(layer, shuffle_seed=0, vouch=False):
    """layer, its forward given indices= that name every key each token sees causally (its request's
    slots of positions 0..pos, shuffled, then -1 and a slot past the cache): the sparse path must then
    give the dense attention (shared by the GPU test). vouch: the rows' lengths as topk_length and
    indices_valid=True (the slots past them are still -1 and past the cache)."""
    forward = layer.forward
    g = torch.Generator().manual_seed(shuffle_seed)

    def sparse_forward(x, kv, batch, k_scale=None):
        ps, num_slots = batch.page_size, kv.shape[0] * kv.shape[1]
        positions = batch.positions.tolist()
        rows = []
        for table, cu, first in ((batch.decode_block_table, batch.decode_cu_seqlens_q, 0),
                                 (batch.prefill_block_table, batch.prefill_cu_seqlens_q, batch.num_decode_tokens)):
            cu, table = cu.tolist(), table.cpu().long()
            for r in range(len(cu) - 1):
                for t in range(cu[r], cu[r + 1]):
                    p = torch.arange(positions[first + t] + 1)
                    slots = table[r, p // ps] * ps + p % ps
                    rows.append(slots[torch.randperm(len(p), generator=g)].tolist())
        topk = max(len(r) for r in rows) + 2
        idx = torch.full((len(rows), topk), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            idx[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
            idx[i, len(r)] = num_slots
        if not vouch:
            return forward(x, kv, batch, k_scale=k_scale, indices=idx.to(x.device))
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int32, device=x.device)
        return forward(x, kv, batch, k_scale=k_scale, indices=idx.to(x.device), topk_length=lengths,
                       indices_valid=True)

    layer.forward = sparse_forward
    return layer


@pytest.mark.parametrize("vouch", [False, True])
def test_layer_sparse_with_every_key_is_dense_attention(vouch):
    from layer_oracle import init_weights, run_scenario
    from test_layer import CONFIGS, STEPS_CPU, check_close
    layer = mla_attn.MLAAttention(CONFIGS["q_lora"], dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    with_all_keys_indexer(layer, vouch=vouch)

    def check(i, batch, got, want, lowp):  # as the dense layer test (absorbed prefill: one rounding more)
        check_close(i, batch, got, want, lowp, factor=1.5)

    run_scenario(layer, STEPS_CPU, page_size=16, num_pages=64, device="cpu", decode_threshold=8, check=check)


@pytest.mark.parametrize("kv_format", ["fp8", "ds_mla_fp8"])
def test_layer_sparse_over_an_fp8_cache(kv_format):
    """MLAAttention(indices=) naming every causal key of an FP8 cache (DeepSeek-V3.2's is ds_mla_fp8):
    dense attention over the keys as the cache gives them back."""
    from layer_oracle import init_weights
    from test_layer import CONFIGS, STEPS_CPU, _fp8_layer_check
    layer = mla_attn.MLAAttention(CONFIGS["q_lora"], dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    with_all_keys_indexer(layer, vouch=False)
    _fp8_layer_check(layer, STEPS_CPU, "cpu", 16, 64, 8, factor=1.5, kv_format=kv_format, sparse=True)


def test_empty_cache_gives_empty_rows():
    """A cache of no page (or no kv row): every index is outside it, so every row is empty."""
    q = torch.randn(2, 4, 576).bfloat16()
    idx = torch.tensor([[0, -1], [3, 1]], dtype=torch.int32)
    out, lse = mla_attn.mla_sparse_prefill(q, torch.zeros(0, 576).bfloat16(), idx, softmax_scale=0.1, return_lse=True)
    assert not out.any() and torch.isinf(lse).all() and (lse > 0).all()
    out = mla_attn.mla_sparse_decode(q, torch.zeros(0, 16, 576).bfloat16(), idx, softmax_scale=0.1)
    assert not out.any()
