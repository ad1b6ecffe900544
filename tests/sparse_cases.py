"""Adversarial inputs of the sparse (top-k) attention tests, and their check against the float64
reference. Every index list mixes valid slots with -1, other negatives, the first slot past the cache
and INT32_MAX, repeats some valid slots, and (with lengths) hides valid slots behind topk_length; every
cache slot that no valid index names is NaN, so a read of a wrong slot shows as NaN in the output.
Row 0 has no valid index at all (out 0, lse +inf)."""
import math

import torch

from mla_attn.kv_cache import dequantize_ds_mla_fp8, quantize_ds_mla_fp8, quantize_fp8
from mla_attn.reference import mla_sparse_ref

from cases import check_unit_scale_error

D_QK, D_V = 576, 512
DS_ROW_BYTES = 656  # a ds_mla_fp8 cache row
FP8 = torch.float8_e4m3fn
K_SCALE = 0.02  # unit-scale data / 0.02 stays well inside e4m3's +-448
SINKS = {  # attn_sink [h_q] kinds: finite values of both signs (and around the lse), or infinities
    "finite": lambda h, g: torch.randn(h, generator=g) * 3 + 4,
    "+inf": lambda h, g: torch.full((h,), math.inf),
    "-inf": lambda h, g: torch.full((h,), -math.inf),
    "mixed": lambda h, g: torch.tensor([math.inf, -math.inf, 0.0, 5.0] * h)[:h],
}


def valid_mask(indices, lengths, num_slots):
    """[R, topk] bool: which positions of the [R, topk] index rows count (the rule as the docs state it)."""
    pos = torch.arange(indices.shape[1])[None, :]
    return (pos < lengths[:, None]) & (indices >= 0) & (indices < num_slots)


def make_sparse_case(lead, h_q, topk, page_size, *, num_pages=None, dtype=torch.bfloat16, lengths=False,
                     sink=None, split_pe=False, kv_4d=False, fp8=False, ds_fp8=False, seed=0):
    """lead: (B, s_q) for a batched call or (T,) for a token-major one. lengths: give topk_length (per
    request when batched, per token otherwise) with 0 and topk among its values. sink: a SINKS key.
    fp8: a float8_e4m3fn cache with k_scale; ds_fp8: DeepSeek-V3.2's 656-byte rows (uint8), whose
    dequantised values the reference reads (ref_kv)."""
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(lead)
    if num_pages is None:  # as many slots as indices (at most 2^15): about half are named, NaN and valid interleave
        num_pages = math.ceil(min(rows * topk, 2**15) / page_size) + 1
    num_slots = num_pages * page_size
    idx = torch.randint(0, num_slots, (rows, topk), generator=g, dtype=torch.int32)
    if topk >= 4:  # repeats: every fourth position copies its left neighbour
        idx[:, 3::4] = idx[:, 2::4][:, : idx[:, 3::4].shape[1]]
    u = torch.rand(rows, topk, generator=g)
    idx[u < 0.10] = -1
    idx[(u >= 0.10) & (u < 0.13)] = num_slots  # the first slot past the cache
    idx[(u >= 0.13) & (u < 0.15)] = 2**31 - 1
    idx[(u >= 0.15) & (u < 0.17)] = -7
    idx[0] = torch.where(torch.arange(topk) % 2 == 0, -1, num_slots).to(torch.int32)  # row 0: nothing valid

    topk_length, row_len = None, torch.full((rows,), topk)
    if lengths:
        n = lead[0]
        topk_length = torch.randint(0, topk + 1, (n,), generator=g, dtype=torch.int32)
        topk_length[-1] = topk
        if n > 2:
            topk_length[1] = 0
        per = rows // n
        row_len = topk_length.long().repeat_interleave(per)

    cache = torch.randn(num_slots, D_QK, generator=g)
    named = torch.zeros(num_slots, dtype=torch.bool)
    valid = valid_mask(idx, row_len, num_slots)
    named[idx[valid].long()] = True
    cache[~named] = float("nan")
    kv = cache.reshape(num_pages, page_size, D_QK).to(dtype)
    q = torch.randn(*lead, h_q, D_QK, generator=g).to(dtype)
    case = dict(q=q, q_pe=None, kv_cache=kv, indices=idx.reshape(*lead, topk), topk_length=topk_length,
                attn_sink=None if sink is None else SINKS[sink](h_q, g).float(), k_scale=None,
                softmax_scale=D_QK**-0.5, num_valid=int(valid.sum()))
    if split_pe:
        case["q"], case["q_pe"] = q[..., :D_V].contiguous(), q[..., D_V:].contiguous()
    if fp8:
        case["k_scale"] = torch.tensor([K_SCALE])
        case["kv_cache"] = quantize_fp8(kv.float(), case["k_scale"])
    if ds_fp8:
        flat = kv.reshape(num_slots, D_QK)
        rows = quantize_ds_mla_fp8(flat[:, :D_V], flat[:, D_V:])
        case["kv_cache"] = rows.view(num_pages, page_size, DS_ROW_BYTES)
        case["ref_kv"] = dequantize_ds_mla_fp8(rows).view(num_pages, page_size, D_QK)
    if kv_4d:
        case["kv_cache"] = case["kv_cache"][:, :, None]
    return case


def valid_first(case, batched=False):
    """The case with each row's valid indices moved to its front (in order) and counted by topk_length,
    as an indexer's output with its -1 tail cut off: what mla_sparse_decode(indices_valid=True) takes.
    Token-major with a count per token; batched=True keeps a batched case's [B, s_q, topk] form with one
    count per request, its tokens' most valid indices: a token with fewer repeats one of them (or a
    valid slot of another row) up to it; request 0 keeps 0, so row 0 stays empty. Every position past a
    row's count holds garbage: -1, the first slot past the cache, INT32_MAX or a NaN slot of the cache."""
    lead, topk = case["indices"].shape[:-1], case["indices"].shape[-1]
    rows, kv, device = math.prod(lead), case["kv_cache"], case["indices"].device
    num_slots = kv.shape[0] * kv.shape[1]
    idx = case["indices"].cpu().reshape(rows, topk)
    row_len = torch.full((rows,), topk) if case["topk_length"] is None else \
        case["topk_length"].cpu().repeat_interleave(rows // case["topk_length"].shape[0])
    valid = valid_mask(idx, row_len, num_slots)
    named = torch.zeros(num_slots, dtype=torch.bool)
    named[idx[valid].long()] = True
    nan_slot = int((~named).nonzero()[0]) if not named.all() else -1
    garbage = torch.tensor([-1, num_slots, 2**31 - 1, nan_slot], dtype=torch.int32).repeat(topk // 4 + 1)[:topk]
    out = garbage.repeat(rows, 1)
    counts = valid.sum(1)
    batched = batched and len(lead) == 2
    if batched:
        per_request = counts.view(lead).max(1).values
        per_request[0] = 0
        counts = per_request.repeat_interleave(lead[1])
    any_valid = idx[valid][:1]
    for r in range(rows):
        own = idx[r][valid[r]]
        fill = (own if own.numel() else any_valid)[:1]
        out[r, :counts[r]] = torch.cat([own, fill.expand(max(0, int(counts[r]) - own.numel()))])[:counts[r]]
    if batched:
        return dict(case, indices=out.view(case["indices"].shape).to(device),
                    topk_length=counts.view(lead)[:, 0].to(device, torch.int32))
    token_major = lambda t: None if t is None else t.reshape((rows,) + t.shape[len(lead):])
    return dict(case, q=token_major(case["q"]), q_pe=token_major(case["q_pe"]), indices=out.to(device),
                topk_length=counts.to(device, torch.int32))


def run_sparse(case, **kw):
    """mla_sparse_decode on a case, returning (out, lse)."""
    import mla_attn
    c = case
    return mla_attn.mla_sparse_decode(c["q"], c["kv_cache"], c["indices"], softmax_scale=c["softmax_scale"],
                                      q_pe=c["q_pe"], topk_length=c["topk_length"], attn_sink=c["attn_sink"],
                                      k_scale=c["k_scale"], return_lse=True, **kw)


def sparse_reference(case, dtype=torch.float64):
    c = case
    return mla_sparse_ref(c["q"], c.get("ref_kv", c["kv_cache"]), c["indices"], softmax_scale=c["softmax_scale"], q_pe=c["q_pe"],
                          topk_length=c["topk_length"], attn_sink=c["attn_sink"], k_scale=c["k_scale"], dtype=dtype)


def check_sparse(case, out, lse, *, lse_tol=1e-3):
    """The decode tests' unit-scale rule (check_unit_scale_error); lse within lse_tol; rows without a
    valid index exactly out 0, lse +inf; no NaN anywhere."""
    ref_out, ref_lse = sparse_reference(case)
    low_out, _ = sparse_reference(case, dtype=case["q"].dtype)
    assert torch.isfinite(out).all(), "non-finite output (a NaN slot was read?)"
    empty = torch.isinf(ref_lse)
    assert empty.reshape(-1, empty.shape[-1])[0].all(), "the case's row 0 must be empty"
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all(), "+inf lse exactly on empty rows"
    assert not out[empty].any(), "rows without a valid index must be 0"
    check_unit_scale_error(out, ref_out, low_out)
    seen = ~empty
    lse_err = (lse.double()[seen] - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
    assert lse_err <= lse_tol, f"lse max err {lse_err:.3e}"
