"""The per-layer calls (mla_decode, mla_sparse_decode, write_kv_cache, mla_prefill, the merges) run their
static checks once per signature
of their arguments (_validation.memoized): its signature must tell apart everything a check reads, and
a call whose arguments differ from a passed call only there (a bool given as an int, a start off 16
bytes, the device, the metadata's fields), or whose out overlaps an input (checked on every call), must
still be refused. (On CPU the ops check again, so the end-to-end tests hold with or without the memo;
the first test checks the signature itself.)"""
import os
import random

import pytest
import test_fuzz_checks
import torch
from cases import D_V, make_decode_case, make_prefill_case
from sparse_cases import make_sparse_case, run_sparse

import mla_attn
from mla_attn import _validation, decode, kv_cache, prefill, sparse
from mla_attn._validation import memoized

C = make_decode_case([20, 3], 2, 4, 16)


def call(c=C, **kw):
    return mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                               softmax_scale=c["softmax_scale"], **kw)


def counting(monkeypatch, module, name="_static_checks"):
    """Counts how often module's static checks run."""
    runs = []
    checks = getattr(module, name)

    def counted(*args):
        runs.append(1)
        return checks(*args)
    monkeypatch.setattr(module, name, counted)
    return runs


def _same_shape_at(t, offset):
    """t's values in a fresh buffer, starting `offset` elements into it (same shape and strides)."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def test_memoized_runs_checks_once_per_signature():
    """Each thing a static check can read of an argument is part of the signature; the same signature
    again is a hit; arguments without one (tensor subclasses, unhashable values) are checked every time."""
    runs = []

    def checks(*args):
        runs.append(args)
        return len(runs)
    t = torch.zeros(4, 32, dtype=torch.bfloat16)
    md = mla_attn.get_decode_metadata(torch.tensor([5], dtype=torch.int32), 16, s_q=1)
    base = (t, True, 0.5, None, "rows64", md)
    assert memoized(checks, *base) == 1
    assert memoized(checks, t.clone(), True, 0.5, None, "rows64", md._replace()) == 1  # equal, not identical
    variants = [
        (t.float(),), (t.to("meta"),), (t[:3],), (t.t().contiguous().t(),),  # dtype, device, shape, strides
        (_same_shape_at(t, 4),),  # start 8 bytes in
        (t, 1), (t, True, 1), (t, True, 0.5, False), (t, True, 0.5, None, "narrow16"),  # values and types
        (t, True, 0.5, None, "rows64", md._replace(causal=False)),  # a metadata field
        (t, True, 0.5, None, "rows64", md._replace(req_splits=md.req_splits[:0])),  # a metadata tensor
    ]
    for i, variant in enumerate(variants):
        args = variant + base[len(variant):]
        assert memoized(checks, *args) == i + 2, f"variant {i} hit the memo"
        assert memoized(checks, *args) == i + 2, f"variant {i} missed the memo"
    assert memoized(checks, torch.nn.Parameter(t, requires_grad=False), *base[1:]) == 1  # a Parameter: as t
    for uncached in ((t.as_subclass(_Subclass),), (t, [1])):
        n = len(runs)
        memoized(checks, *uncached)
        memoized(checks, *uncached)
        assert len(runs) == n + 2


class _Subclass(torch.Tensor):
    pass


def test_failed_checks_are_not_remembered():
    def checks(x):
        raise ValueError("bad")
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            memoized(checks, 1)


def test_checks_run_once_per_signature(monkeypatch):
    runs = counting(monkeypatch, decode)
    want = call()
    assert torch.equal(call(), want) and len(runs) == 1
    call(causal=False)
    assert len(runs) == 2
    q_sub = C["q"].as_subclass(_Subclass)  # a tensor subclass: no signature, checked on every call
    call({**C, "q": q_sub})
    call({**C, "q": q_sub})
    assert len(runs) == 4


def test_flags_as_ints_after_passed_bools():
    call(causal=True, return_lse=False)
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(causal=1, return_lse=False)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        call(causal=True, return_lse=0)


def test_start_alignment_is_part_of_the_signature():
    """On the meta device, where the op (a fake kernel) checks nothing of it: the wrapper alone."""
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in C.items()}
    q = meta["q"]
    def at(offset):
        return torch.empty(q.numel() + 16, dtype=q.dtype, device="meta")[offset:offset + q.numel()].view(q.shape)
    call({**meta, "q": at(8)})  # 16 bytes in: fine
    with pytest.raises(ValueError, match="q must start at a multiple of 16 bytes"):
        call({**meta, "q": at(4)})


def test_device_is_part_of_the_signature():
    call()
    with pytest.raises(TypeError, match="cache_seqlens is on meta"):
        call({**C, "cache_seqlens": C["cache_seqlens"].to("meta")})


def test_metadata_fields_are_part_of_the_signature():
    md = mla_attn.get_decode_metadata(C["cache_seqlens"], C["q"].shape[-2], s_q=C["q"].shape[1])
    other = mla_attn.get_decode_metadata(C["cache_seqlens"], C["q"].shape[-2], s_q=C["q"].shape[1], causal=False)
    call(metadata=md)
    with pytest.raises(ValueError, match="metadata was computed for causal=False"):
        call(metadata=other)
    # a field the checks compare must be a host value: a tensor's value is not in the signature
    for field, value in (("causal", torch.tensor(True)), ("num_heads_q", torch.tensor(C["q"].shape[-2]))):
        with pytest.raises(TypeError, match=f"metadata.{field} must be a host value, got a tensor"):
            call(metadata=md._replace(**{field: value}))
    case = make_sparse_case((12,), 16, 64, 16, lengths=True)
    sparse_md = mla_attn.get_sparse_decode_metadata(case["indices"], 16)
    with pytest.raises(TypeError, match="metadata.topk must be a host value, got a tensor"):
        run_sparse(case, metadata=sparse_md._replace(topk=torch.tensor(64)))


def _q_and_outs_in_one_buffer(q, d_out=D_V):
    """q's values and two outs [.., d_out] in one buffer, each out at the same offset mod 16 (so both calls
    have one signature): one right after q (apart), one 16 elements back into q's last row."""
    out_shape = q.shape[:-1] + (d_out,)
    out_numel = torch.Size(out_shape).numel()
    mem = torch.empty(q.numel() + out_numel, dtype=q.dtype)
    mem[:q.numel()].copy_(q.flatten())
    overlapping = mem[q.numel() - 16:q.numel() - 16 + out_numel].view(out_shape)
    return mem[:q.numel()].view(q.shape), mem[q.numel():].view(out_shape), overlapping


def spy_check_apart(monkeypatch):
    """The outputs the overlap check sees (the sparse wrapper's and the CPU ops')."""
    seen = []
    check_apart = _validation.check_apart

    def spied(name, out, inputs):
        seen.append(name)
        return check_apart(name, out, inputs)
    monkeypatch.setattr(_validation, "check_apart", spied)
    return seen


def raised_by(error):
    """Whether the wrapper (mla_attn's module of the public call) or the CPU op (_ops.py) raised."""
    return "op" if any(os.path.basename(str(entry.path)) == "_ops.py" for entry in error.traceback) else "wrapper"


def test_out_overlap_is_checked_on_every_call(monkeypatch):
    """The same signature twice: out apart from q, then out overlapping q's last row. The op checks it
    (the CUDA binding in C++, with the same message and error type), the wrapper does not again."""
    q, apart, overlapping = _q_and_outs_in_one_buffer(C["q"])
    seen = spy_check_apart(monkeypatch)
    call({**C, "q": q}, out=apart)
    assert seen.count("out") == 1
    with pytest.raises(ValueError, match="out shares memory with q") as error:
        call({**C, "q": q}, out=overlapping)
    assert raised_by(error) == "op"
    assert seen.count("out") == 2


def test_sparse_decode_memo(monkeypatch):
    case = make_sparse_case((12,), 16, 64, 16, lengths=True)
    runs = counting(monkeypatch, sparse)
    want, _ = run_sparse(case)
    got, _ = run_sparse(case)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and len(runs) == 1
    with pytest.raises(TypeError, match="indices_valid must be a bool"):
        run_sparse(case, indices_valid=0)
    q, apart, overlapping = _q_and_outs_in_one_buffer(case["q"])
    seen = spy_check_apart(monkeypatch)
    run_sparse({**case, "q": q}, out=apart)
    assert seen.count("out") == 2  # the wrapper's and the CPU op's
    with pytest.raises(ValueError, match="out shares memory with q") as error:
        run_sparse({**case, "q": q}, out=overlapping)
    assert raised_by(error) == "wrapper"  # it names the caller's tensors (the op sees the index rows it is given)
    assert seen.count("out") == 3  # then the wrapper's, which raised


def test_write_kv_cache_memo(monkeypatch):
    runs = counting(monkeypatch, kv_cache, "_write_static_checks")
    cache = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    kv_c, k_pe = torch.randn(3, 512, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    slots = torch.tensor([0, 17, 40])
    for _ in range(2):
        mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)
    assert len(runs) == 1
    assert torch.equal(cache.view(-1, 576)[17, :512], kv_c[1])
    with pytest.raises(TypeError, match="validate must be a bool or None"):
        mla_attn.write_kv_cache(kv_c, k_pe, cache, slots, validate=1)


def test_prefill_memo(monkeypatch):
    c = make_prefill_case([5, 3], [7, 3], 4, split_pe=True, pad=0)
    runs = counting(monkeypatch, prefill)

    def run(q=c["q"], **kw):
        return mla_attn.mla_prefill(q, c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], 5, 7, softmax_scale=0.1,
                                    causal=True, k_pe=c["k_pe"], **kw)
    want = run()
    assert torch.equal(run(), want) and len(runs) == 1
    with pytest.raises(TypeError, match="causal must be a bool"):
        mla_attn.mla_prefill(c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], 5, 7, softmax_scale=0.1,
                             causal=1, k_pe=c["k_pe"])
    q, apart, overlapping = _q_and_outs_in_one_buffer(c["q"], 128)
    seen = spy_check_apart(monkeypatch)
    assert torch.equal(run(q, out=apart), want)
    assert seen.count("out") == 1  # the CPU op's
    with pytest.raises(ValueError, match="out shares memory with q") as error:
        run(q, out=overlapping)
    assert raised_by(error) == "op"
    assert seen.count("out") == 2


def test_merge_memo(monkeypatch):
    runs = counting(monkeypatch, _validation, "check_merge")
    overlap_checks = counting(monkeypatch, _validation, "check_merge_outputs")
    mem = torch.randn(3 * 4 * 2 * 16).to(torch.bfloat16)
    out_a, out_b, out = (mem[i * 128:(i + 1) * 128].view(4, 2, 16) for i in range(3))
    lse_a, lse_b = torch.randn(4, 2), torch.randn(4, 2)
    want, _ = mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b)
    got, _ = mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out)
    assert torch.equal(got, want) and len(runs) == 4  # two calls of new signatures: wrapper and CPU op each
    mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out)
    assert len(runs) == 5  # only the CPU op's
    assert len(overlap_checks) == 2  # the CPU op's, on every call with out=
    shifted = mem[16:16 + 128].view(4, 2, 16)  # out's signature, half in out_a and half in out_b
    with pytest.raises(ValueError, match="out shares part of out_a's memory") as error:
        mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b, out=shifted)
    assert raised_by(error) == "op"
    assert len(overlap_checks) == 3
    merge_n = counting(monkeypatch, _validation, "check_merge_n")
    outs, lses = torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b])
    assert torch.equal(mla_attn.merge_attn_states_n(outs, lses)[0], want)
    mla_attn.merge_attn_states_n(outs, lses)
    assert len(merge_n) == 3  # the wrapper's once, the CPU op's twice


# ---------------------------------------------------------------------------------------- fuzzed
def _prefill_out_call():
    fn, kw = test_fuzz_checks._prefill_call()
    return fn, dict(kw, out=torch.empty(kw["q"].shape[:-1] + (128,), dtype=kw["q"].dtype), return_lse=True)


def _merge_out_call():
    fn, kw = test_fuzz_checks._merge_call()
    return fn, dict(kw, out=torch.empty_like(kw["out_a"]))


def _same_signature(t, r):
    """A tensor with t's signature (dtype, device, shape, strides, start offset mod 16) but other values at
    another address: a static check that read values or addresses would tell them apart."""
    if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
        return t
    offset = t.storage_offset() % 16
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    buf = torch.empty(offset + span, dtype=t.dtype, device=t.device)
    if t.device.type != "meta":
        g = torch.Generator().manual_seed(r.randrange(2**31))
        values = torch.randn(buf.shape, generator=g) if t.dtype.is_floating_point else \
            torch.randint(-2, 60, buf.shape, generator=g)
        buf.copy_(values)
    return buf.as_strided(t.shape, t.stride(), offset)


@pytest.mark.parametrize("call", [test_fuzz_checks._decode_call, test_fuzz_checks._decode_fp8_call,
                                  test_fuzz_checks._sparse_call, test_fuzz_checks._sparse_ds_call,
                                  test_fuzz_checks._write_call, _prefill_out_call, _merge_out_call],
                         ids=["decode", "decode_fp8", "sparse", "sparse_ds", "write", "prefill", "merge"])
def test_equal_signatures_get_equal_outcomes(call, monkeypatch):
    """Over random changes of a valid call (test_fuzz_checks' mutations), each also made again with tensors
    of the same signature but other values and addresses, the static checks' outcome (their result, or
    the exception and its message) is the same for every call of one signature: what the memo relies on."""
    outcomes = {}

    def recording(checks, *args):
        try:
            key = (checks, _validation._signature(args))
            hash(key)
        except (TypeError, RuntimeError):  # no signature: not memoized
            return checks(*args)
        try:
            result = checks(*args)
        except (TypeError, ValueError) as e:
            outcome = (type(e), str(e))
            assert outcomes.setdefault(key, outcome) == outcome, f"{outcomes[key]} != {outcome}"
            raise
        assert outcomes.setdefault(key, ("ok", result)) == ("ok", result)
        return result
    monkeypatch.setattr(_validation, "memoized", recording)
    fn, valid = call()
    for i in range(150):
        r = random.Random(i)
        kw = dict(valid)
        for _ in range(r.choice((0, 1, 2))):
            test_fuzz_checks._mutate(kw, r)
        for args in (kw, {k: _same_signature(v, r) for k, v in kw.items()}):
            try:
                fn(**args)
            except (TypeError, ValueError):
                pass
    assert len(outcomes) > 10
