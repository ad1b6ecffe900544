#!/usr/bin/env python3
"""Per-call fixed cost against streaming rate: one config's time over a sweep of its length.

A call's time is modelled as t(n) = fixed + n / rate, with n the keys per request (dense) or the top-k
(sparse): a least-squares line through the cold times gives the intercept (what the call pays
whatever its length: launch, the first tile's dependent loads, the epilogue, the combine, the last
CTAs' tail) and the slope (the bytes of one more key over all requests, per us: the streaming rate,
beside the read ceiling of the same run). Where the fixed cost is a large share of a cell's time, a
faster tile loop cannot reach a bandwidth target; where the rate is below the ceiling, the loop is
what bounds it.

Series (batch fixed, h_q 16 and 128, s_q 1; cold / warm CUDA-graph replays as bench_decode.py):
  sparse_ds_h16_b{32,128}: mla_sparse_decode's attention alone on DeepSeek-V3.2 FP8 rows (656 bytes),
      top-k 512 ... 8192 of 16384 context tokens (bench_sparse.py's problem);
  dense_e4m3_h16_b128_p{1,64}: mla_decode, e4m3 cache (576 bytes per key), 2048 ... 16384 keys;
  dense_bf16_h{16,128}_b128: mla_decode, bf16 cache (1152 bytes per key), 1024 ... 16384 keys;
  graph_fill: a one-kernel graph (a 1-element fill), the floor of the timing method.
Formulas: bytes(n) = batch * n * row bytes (the cache rows read); rate = slope of bytes over cold us;
fixed = intercept; share = fixed / t at each point.

usage: python benchmarks/bench_length_sweep.py [--out DIR] [--rep-ms 30] [--only sparse,dense_e4m3]
Outputs: <out>/bench_length_sweep.json and .md.
"""
import argparse
import json
import os
import statistics

import torch

import bench_decode as bd
import bench_sparse as bs
from _timing import GraphTimer, capture, measure_ceilings, smi

import mla_attn


def sparse_call(b, topk):
    bs.TOPK, bs.CONTEXT = topk, 16384  # bench_sparse's problem and check read these module globals
    p = bs.make_problem(dict(name="", h_q=16, s_q=1, b=b), 1, "ds_mla_fp8")
    md = mla_attn.get_sparse_decode_metadata(p["indices"], 16)
    slots, counts = torch.ops.mla_attn.compact_sparse_indices(p["indices"].reshape(b, topk), None,
                                                              p["kv"].shape[0] * p["kv"].shape[1])
    q, dec = p["q"].reshape(b, 1, 16, bs.D_QK), md.decode

    def attention():
        return torch.ops.mla_attn.mla_decode(q, None, p["kv"], slots, counts, None, 1, bs.SCALE, False, dec.tile_sched,
                                             dec.req_splits, dec.num_sm_parts, kv_slots=True)

    out, lse = attention()
    ok = bs.check(p, out.view(b, 1, 16, bs.D_V), lse.view(b, 1, 16))["ok"]
    return attention, ok


def dense_call(h_q, L, page, kv_dtype):
    c = bd.cfg(h_q, 1, 128, L, page=page)
    p = bd.make_problem(c, 0, kv_dtype)
    md = mla_attn.get_decode_metadata(p["lens"], h_q, s_q=1, causal=False)

    def decode():
        return mla_attn.mla_decode(p["q"], p["kv"], p["table"], p["lens"], softmax_scale=bd.SCALE, causal=False,
                                   k_scale=p["k_scale"], metadata=md, return_lse=True)

    out, lse = decode()
    ok = bd.compare(out, lse, *bd.reference_fp32(p, causal=False))["ok"]
    return decode, ok


SERIES = {
    "sparse_ds_h16_b32": (656, 32, [512, 1024, 2048, 4096, 8192], lambda n: sparse_call(32, n)),
    "sparse_ds_h16_b128": (656, 128, [512, 1024, 2048, 4096, 8192], lambda n: sparse_call(128, n)),
    "dense_e4m3_h16_b128_p64": (576, 128, [2048, 4096, 8192, 16384], lambda n: dense_call(16, n, 64, "fp8")),
    "dense_e4m3_h16_b128_p1": (576, 128, [2048, 4096, 8192, 16384], lambda n: dense_call(16, n, 1, "fp8")),
    "dense_bf16_h16_b128": (1152, 128, [1024, 2048, 4096, 8192, 16384], lambda n: dense_call(16, n, 64, "bf16")),
    "dense_bf16_h128_b128": (1152, 128, [1024, 2048, 4096, 8192, 16384], lambda n: dense_call(128, n, 64, "bf16")),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rep-ms", type=float, default=30.0)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    timer = GraphTimer()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, smi=smi(), ceilings=measure_ceilings(matmul=False))
    ceiling = res["ceilings"]["read_TBps"]
    z = torch.zeros(1, device="cuda")
    g, _ = capture(lambda: z.fill_(1.0))
    res["graph_fill"] = timer.time(g, args.rep_ms)
    series = []
    for name, (row_bytes, batch, lengths, make) in SERIES.items():
        if args.only and not any(k in name for k in args.only.split(",")):
            continue
        points = []
        for n in lengths:
            fn, ok = make(n)
            g, _ = capture(fn)
            t = timer.time(g, args.rep_ms)
            points.append(dict(n=n, ok=ok, cold_us=t["cold_us"], warm_us=t["warm_us"],
                               TBps=batch * n * row_bytes / t["cold_us"] / 1e6))
            print(name, points[-1], flush=True)
            del fn, g
            torch.cuda.empty_cache()
        us_per_key, fixed = statistics.linear_regression([p["n"] for p in points], [p["cold_us"] for p in points])
        rate = batch * row_bytes / us_per_key / 1e6
        for p in points:
            p["fixed_share"] = fixed / p["cold_us"]
        series.append(dict(name=name, row_bytes=row_bytes, batch=batch, points=points, fixed_us=fixed,
                           stream_TBps=rate, stream_of_ceiling=rate / ceiling))
        print(f"{name}: fixed {fixed:.1f} us, stream {rate:.2f} TB/s ({100 * rate / ceiling:.0f} % of ceiling)", flush=True)
    res["series"] = series
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_length_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Fixed cost and streaming rate by length ({res['gpu']})", "",
             f"Read ceiling of this run {ceiling:.2f} TB/s; a one-kernel graph (1-element fill) "
             f"{res['graph_fill']['cold_us']:.1f} us cold / {res['graph_fill']['warm_us']:.1f} warm. "
             "t = fixed + n / rate fitted to the cold times (least squares); TB/s = cache bytes / cold us.", "",
             "| series | n (keys or top-k) | ok | cold us | warm us | TB/s | fixed share |", "|---|---|---|---|---|---|---|"]
    for s in series:
        for p in s["points"]:
            lines.append(f"| {s['name']} | {p['n']} | {'ok' if p['ok'] else 'FAIL'} | {p['cold_us']:.1f} | "
                         f"{p['warm_us']:.1f} | {p['TBps']:.2f} | {100 * p['fixed_share']:.0f} % |")
    lines += ["", "| series | fixed us | stream TB/s | of ceiling |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['fixed_us']:.1f} | {s['stream_TBps']:.2f} | {100 * s['stream_of_ceiling']:.0f} % |"
              for s in series]
    with open(os.path.join(args.out, "bench_length_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
