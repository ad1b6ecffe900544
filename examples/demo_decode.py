"""Short demo of mla_attn.mla_decode: one decode step of a small batch over a paged latent cache.

Runs the Hopper kernel when an sm_90 GPU is present, else the CPU implementation of the same op,
and checks the result against the float64 reference (mla_attn.reference).
"""
import torch

import mla_attn
from mla_attn.reference import mla_decode_ref


def main():
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    device = "cuda" if on_gpu else "cpu"
    torch.manual_seed(0)
    batch, s_q, h_q, page_size = 4, 2, 16, 64          # 2 new tokens per request (e.g. speculative)
    lengths = torch.tensor([1000, 17, 300, 4096], dtype=torch.int32)
    pages_per_request = (lengths + page_size - 1) // page_size
    num_pages = int(pages_per_request.sum()) + 8
    block_table = torch.zeros(batch, int(pages_per_request.max()), dtype=torch.int32)
    free_pages = torch.randperm(num_pages).to(torch.int32)
    used = 0
    for b in range(batch):                              # scatter every request over random pages
        n = int(pages_per_request[b])
        block_table[b, :n] = free_pages[used:used + n]
        used += n
    kv_cache = torch.randn(num_pages, page_size, 576, dtype=torch.bfloat16)
    q = torch.randn(batch, s_q, h_q, 576, dtype=torch.bfloat16)
    scale = 192 ** -0.5                                  # DeepSeek: (qk_nope + qk_rope)^-0.5, no YaRN

    args = [t.to(device) for t in (q, kv_cache, block_table, lengths)]
    out, lse = mla_attn.mla_decode(*args, softmax_scale=scale, causal=True, return_lse=True)
    ref_out, ref_lse = mla_decode_ref(q, kv_cache, block_table, lengths, softmax_scale=scale, causal=True,
                                      dtype=torch.float64)
    err = (out.cpu().double() - ref_out).abs().max().item()
    lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
    where = torch.cuda.get_device_name() + " (sm_90a kernel)" if on_gpu else "CPU (reference implementation)"
    print(f"mla_decode on {where}")
    print(f"  batch {batch}, {s_q} new tokens x {h_q} heads per request, KV lengths {lengths.tolist()}, "
          f"page size {page_size}, causal")
    print(f"  out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
    print(f"  vs float64 reference: max |out err| {err:.2e}, max |lse err| {lse_err:.2e}")
    assert err < 2e-2 and lse_err < 1e-3, "result does not match the reference"
    print("  OK")


if __name__ == "__main__":
    main()
