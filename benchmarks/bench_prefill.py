#!/usr/bin/env python3
"""Benchmark mla_attn.mla_prefill (varlen MLA prefill: q/k head dim 192, v head dim 128) on one Hopper GPU.

Configs: h in {128, 16}; 16384 tokens in total, as requests of 512, 2048, 8192 or 16384 tokens
(T_q = T_k per request); causal and non-causal; k given whole [T, h, 192] ("k192") or as
k_nope [T, h, 128] + shared k_pe [T, 1, 64] ("k_pe"). bf16.
  TFLOP/s = 2 * h * sum_requests(visible (q, k) pairs) * (192 + 128) / time
            (causal: n (n + 1) / 2 pairs per request of n tokens, non-causal n^2).
Timing: the op as a CUDA graph, median over replays (cold = after a 512 MB L2 flush, warm = after a
spin), as in bench_decode.py (benchmarks/_timing.py). Ceiling of the same run: bf16 8192^3 matmul (and HBM read).
Peer: torch SDPA with the cuDNN backend (q/k 192, v 128, [B, h, n, d]) when it runs, same TFLOP formula.
Correctness: out and LSE of two heads against the float32 reference before timing.

usage: python benchmarks/bench_prefill.py [--out DIR] [--no-ceilings] [--heads 128,16]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import GraphTimer, capture, measure_ceilings  # noqa: E402

import mla_attn  # noqa: E402
from mla_attn._ops import prefill_cpu  # noqa: E402

TOTAL = 16384
REQUEST_LENS = (512, 2048, 8192, 16384)
SCALE = 192 ** -0.5


def flops(h, n, num_requests, causal):
    pairs = n * (n + 1) // 2 if causal else n * n
    return 2 * h * num_requests * pairs * (192 + 128)


def make(h, n, split_pe, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = TOTAL // n
    q = torch.randn(TOTAL, h, 192, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(TOTAL, h, 256, device="cuda", generator=g, dtype=torch.bfloat16)  # kv_b_proj output
    k_pe = torch.randn(TOTAL, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k_nope, v = kv[..., :128], kv[..., 128:]
    k = k_nope if split_pe else torch.cat([k_nope, k_pe.expand(-1, h, -1)], -1)
    cu = torch.arange(0, TOTAL + 1, n, dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=v, k_pe=k_pe if split_pe else None, cu=cu, n=n, b=b)


def check(p, causal):
    """Two heads (first and last) against the float32 reference."""
    heads = [0, p["q"].shape[1] - 1]
    out, lse = mla_attn.mla_prefill(p["q"], p["k"], p["v"], p["cu"], p["cu"], p["n"], p["n"], softmax_scale=SCALE,
                                    causal=causal, k_pe=p["k_pe"], return_lse=True)
    sub = lambda t: None if t is None else t[:, heads].float()  # noqa: E731
    k_pe = None if p["k_pe"] is None else p["k_pe"].float()
    ref_out, ref_lse = prefill_cpu(sub(p["q"]), sub(p["k"]), sub(p["v"]), p["cu"], p["cu"], SCALE, causal, k_pe)
    return dict(max_err=(out[:, heads].float() - ref_out).abs().max().item(),
                lse_err=(lse[:, heads] - ref_lse).abs().max().item())


def sdpa_cudnn(p, causal):
    """torch SDPA, cuDNN backend, on the batch as [B, h, n, d] (equal-length requests)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, n, h = p["b"], p["n"], p["q"].shape[1]
    k = p["k"] if p["k_pe"] is None else torch.cat([p["k"], p["k_pe"].expand(-1, h, -1)], -1)
    q4, k4, v4 = (t.reshape(b, n, h, t.shape[-1]).transpose(1, 2) for t in (p["q"], k, p["v"]))

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=SCALE)
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--rep-ms", type=float, default=300.0)
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    ceilings = {} if args.no_ceilings else measure_ceilings()
    gemm = ceilings.get("mm8192_bf16_TFLOPs")
    print(f"device {dev}; ceilings {ceilings}", flush=True)
    timer = GraphTimer()
    rows = []
    for h in (int(x) for x in args.heads.split(",")):
        for n in REQUEST_LENS:
            for causal in (False, True):
                for split_pe in (False, True):
                    p = make(h, n, split_pe)
                    row = dict(h=h, n=n, causal=causal, k="k_pe" if split_pe else "k192", **check(p, causal))
                    fl = flops(h, n, p["b"], causal)

                    def ours():
                        return mla_attn.mla_prefill(p["q"], p["k"], p["v"], p["cu"], p["cu"], n, n,
                                                    softmax_scale=SCALE, causal=causal, k_pe=p["k_pe"])
                    g, _ = capture(ours)
                    t = timer.time(g, args.rep_ms)
                    row.update(us=t["warm_us"], cold_us=t["cold_us"], tflops=fl / t["warm_us"] / 1e6)
                    if gemm:
                        row["pct_gemm"] = 100 * row["tflops"] / gemm
                    if not split_pe:
                        try:
                            g2, _ = capture(sdpa_cudnn(p, causal))
                            row["cudnn_us"] = timer.time(g2, args.rep_ms)["warm_us"]
                            row["cudnn_tflops"] = fl / row["cudnn_us"] / 1e6
                        except Exception as e:  # noqa: BLE001  (peer not available for this shape)
                            row["cudnn_error"] = repr(e)[:120]
                    print(row, flush=True)
                    rows.append(row)
                    del p
                    torch.cuda.empty_cache()
    lines = [f"device: {dev}; bf16 GEMM 8192^3: {gemm and round(gemm)} TFLOP/s; total tokens {TOTAL}", "",
             "| h | req len | causal | k | µs | TFLOP/s | % GEMM | cuDNN µs | cuDNN TFLOP/s | max err | lse err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['h']} | {r['n']} | {r['causal']} | {r['k']} | {r['us']:.1f} | {r['tflops']:.0f} | "
                     f"{r.get('pct_gemm', float('nan')):.0f} | {r.get('cudnn_us', float('nan')):.1f} | "
                     f"{r.get('cudnn_tflops', float('nan')):.0f} | {r['max_err']:.2e} | {r['lse_err']:.2e} |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:
            json.dump(dict(device=dev, ceilings=ceilings, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "bench_prefill.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
