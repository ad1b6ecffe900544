"""Adversarial inputs shared by the tests. Decode: NaN in every cache slot past each length and in
every unused page, permuted block tables with huge ids in the unused tails. Prefill: NaN in every
packed row past the last request and in unused columns of strided views."""
import itertools
import math

import torch

D_QK, D_V = 576, 512
HUGE_ID = 2**31 - 1


def to_device(case, device="cuda"):
    """The case with every tensor moved to `device`."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def check_unit_scale_error(out, ref, low):
    """out against the float reference ref, measured by low, the same computation in bf16/fp16 PyTorch:
    max |err| <= 2x low's + 1e-3, and each row's L2 error (last dim) <= 2x low's + 2^-8 of the row (its
    rounding to 16 bits): the max alone would pass a few keys dropped from a long row."""
    if out.numel() == 0:
        return
    err, low_err = out.double() - ref, low.double() - ref
    bound = 2 * low_err.abs().max().item() + 1e-3
    assert err.abs().max().item() <= bound, f"out max err {err.abs().max().item():.3e} > {bound:.3e}"
    row_bound = 2 * low_err.norm(dim=-1) + 2**-8 * ref.double().norm(dim=-1) + 1e-6
    excess = (err.norm(dim=-1) / row_bound).max().item()
    assert excess <= 1, f"a row's L2 error is {excess:.2f}x its bound (2x bf16/fp16 PyTorch's + 2^-8 of the row)"


def write_layout(lens, page_size, seed):
    """Where a write puts the tokens of requests of `lens` tokens: a block table over shuffled pages
    (HUGE_ID in each row's unused tail and in one spare column), every token's cache slot in request
    order, cu_seqlens over the tokens, and the number of pages (two more than used)."""
    g = torch.Generator().manual_seed(seed)
    used = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(used) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    block_table = torch.full((len(lens), max(used) + 1), HUGE_ID, dtype=torch.int32)
    slots = []
    for b, n in enumerate(lens):
        block_table[b, : used[b]] = torch.tensor([perm.pop() for _ in range(used[b])], dtype=torch.int32)
        slots += [int(block_table[b, i // page_size]) * page_size + i % page_size for i in range(n)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return block_table, slots, cu, num_pages


def make_decode_case(lens, s_q, h_q, page_size, *, varlen=False, split_pe=False, kv_4d=False,
                     dtype=torch.bfloat16, seed=0):
    """lens: keys per request. s_q: tokens per request (uniform) or, with varlen, the max; varlen
    requests get lengths in [0, s_q] including a 0-token one when there is more than one request."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    used = [math.ceil(l / page_size) for l in lens]
    max_pages = max(used, default=0) + 2
    num_pages = sum(used) + 3
    kv = torch.full((num_pages, page_size, D_QK), float("nan"), dtype=dtype)
    block_table = torch.full((B, max_pages), HUGE_ID, dtype=torch.int32)
    block_table[:, -1] = -7  # garbage of both signs in the tails
    perm = torch.randperm(num_pages, generator=g).tolist()
    for b, l in enumerate(lens):
        pages = [perm.pop() for _ in range(used[b])]
        block_table[b, : used[b]] = torch.tensor(pages, dtype=torch.int32)
        if pages:
            data = torch.randn(used[b] * page_size, D_QK, generator=g)
            data[l:] = float("nan")  # slots past the length stay poisoned
            kv[pages] = data.reshape(used[b], page_size, D_QK).to(dtype)
    if varlen:
        s = torch.randint(0, s_q + 1, (B,), generator=g)
        s[0] = s_q
        if B > 1:
            s[1] = 0
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(s, 0)
        q = torch.randn(int(cu[-1]), h_q, D_QK, generator=g).to(dtype)
    else:
        cu = None
        q = torch.randn(B, s_q, h_q, D_QK, generator=g).to(dtype)
    q_pe = None
    if split_pe:
        q, q_pe = q[..., :D_V].contiguous(), q[..., D_V:].contiguous()
    if kv_4d:
        kv = kv[:, :, None, :]
    return dict(q=q, q_pe=q_pe, kv_cache=kv, block_table=block_table,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=cu, max_seqlen_q=s_q,
                softmax_scale=D_QK**-0.5)


DECODE_CASES = [  # (lens, s_q, h_q, page_size, varlen, split_pe) for make_decode_case
    ([1023], 1, 128, 64, False, False),
    ([4099, 1], 1, 16, 16, False, False),
    ([113, 0, 15, 1023], 2, 8, 32, False, True),
    ([0], 1, 1, 64, False, False),
    ([15, 113], 4, 3, 128, False, False),
    ([1023, 4099, 7], 7, 9, 16, False, False),
    ([300, 64, 65], 1, 63, 64, False, True),
    ([2000], 1, 126, 48, False, False),
    ([513, 1000], 64, 16, 64, False, False),
    ([4099, 113, 1, 0, 1023], 7, 32, 16, True, False),
    ([1500, 900, 64], 64, 128, 64, True, True),
    ([700, 10], 512, 8, 256, True, False),
    ([300, 0, 70, 1], 2, 8, 16, True, False),  # varlen at <= 16 rows (the narrow kernel), 0-token requests
    # <= 8 rows, split: the narrow kernels' fp32 partials (TMA pages; gathered rows, varlen, q_pe split)
    ([20000, 5, 3000], 1, 8, 64, False, False),
    ([9000], 2, 2, 3, True, True),
]


def make_prefill_case(lens_q, lens_k, h_q, *, h_k=None, split_pe=False, dtype=torch.bfloat16, seed=0,
                      pad=37, scale=1.0):
    """Packed varlen prefill inputs as an engine holds them: k_nope and v are views of one kv_b_proj
    output [T_k, h_k, 256] (strided), q is a view of a wider buffer, and every row past the last
    request and every unused column is NaN. lens_k[b] may be < lens_q[b] (causal: empty rows)."""
    g = torch.Generator().manual_seed(seed)
    h_k = h_q if h_k is None else h_k
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32)
    t_q, t_k = int(cu_q[-1]), int(cu_k[-1])

    def poisoned(rows, heads, width, used):
        buf = torch.full((rows + pad, heads, width), float("nan"))
        buf[:rows, :, :used] = torch.randn(rows, heads, used, generator=g) * scale
        return buf.to(dtype)

    q = poisoned(t_q, h_q, 256, 192)[..., :192]
    kv = poisoned(t_k, h_k, 256, 256)
    k_nope, v = kv[..., :128], kv[..., 128:]
    k_pe = poisoned(t_k, 1, 64, 64)
    if split_pe:
        k = k_nope
    else:
        k = torch.cat([k_nope, k_pe.expand(-1, h_k, -1)], dim=-1)  # NaN pad rows stay NaN
        k_pe = None
    return dict(q=q, k=k, v=v, k_pe=k_pe, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lens_q, default=0), max_seqlen_k=max(lens_k, default=0),
                softmax_scale=192**-0.5)


def make_overlong_decode_case(s_q, h_q, page_size, *, seed=0):
    """Lengths past what the block table holds, as only validation refuses them: (case, reference
    case). The table's width is exactly what the first two requests' keys fill (no tail), their
    lengths are that + 300 and INT32_MAX; the kernels clamp them to the table, so the reference is the
    same case at the clamped lengths. A third request, within the table, keeps NaN past its keys."""
    keys = 12 * page_size
    case = make_decode_case([keys, keys, keys // 2 + 3], s_q, h_q, page_size, seed=seed)
    case["block_table"] = case["block_table"][:, :12].contiguous()
    overlong = {**case, "cache_seqlens": torch.tensor([keys + 300, 2**31 - 1, keys // 2 + 3], dtype=torch.int32)}
    return overlong, case


def scramble_cu_seqlens(cu, total):
    """cu_seqlens as validation would refuse them: offsets past the packed rows, negative and
    decreasing ones, a request longer than every max_seqlen. The first request stays as it was."""
    bad = cu.clone()
    tail = [total + 5, -3, total // 2, 2**31 - 1, 1, 2**31 - 1][: len(bad) - 2]
    bad[2:] = torch.tensor(tail, dtype=bad.dtype)
    return bad
