"""A small subset of decode calls for compute-sanitizer (scripts/sanitize_decode.sh): every code path
once (split and unsplit requests, tail blocks, empty requests, varlen causal, page sizes 16 and 64,
q_pe split), small enough to run under memcheck and racecheck in seconds."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import mla_attn  # noqa: E402
from cases import make_decode_case  # noqa: E402
from mla_attn.reference import mla_decode_ref  # noqa: E402

CASES = [
    # (lens, s_q, h_q, page_size, varlen, split_pe)
    ([700], 1, 16, 64, False, False),          # one request split over many CTAs -> combine
    ([113, 0, 1023], 2, 8, 16, False, True),   # empty request, tail blocks, page 16, q_pe split
    ([300, 65], 7, 32, 32, True, False),        # varlen causal
    ([200], 1, 128, 64, False, False),         # two q tiles
]


def main():
    worst = 0.0
    for lens, s_q, h_q, page, varlen, split_pe in CASES:
        c = make_decode_case(lens, s_q, h_q, page, varlen=varlen, split_pe=split_pe)
        c = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        kw = dict(max_seqlen_q=c["max_seqlen_q"]) if varlen else {}
        out, lse = mla_attn.mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                                       cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"],
                                       softmax_scale=c["softmax_scale"], causal=True, return_lse=True, **kw)
        ref, _ = mla_decode_ref(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"],
                                cu_seqlens_q=c["cu_seqlens_q"], q_pe=c["q_pe"],
                                softmax_scale=c["softmax_scale"], causal=True)
        err = (out.float() - ref).abs().max().item()
        worst = max(worst, err)
        print(f"lens={lens} s_q={s_q} h_q={h_q} page={page}: max |err| {err:.2e}", flush=True)
    assert worst < 3e-2, worst


if __name__ == "__main__":
    main()
