#!/usr/bin/env python3
"""How much of a decode kernel's cold time is fetching its code.

For a few configs and forced kernels, each timed as a CUDA graph replayed after an L2 flush (cold) and
after a spin kernel (warm), median µs:
  alone         the call;
  behind same   a graph of [a tiny call of the same kernel on buffers of its own, the call]: its time
                minus the tiny call's, both cold. The tiny call leaves the kernel's code in L2 and the
                call's own data cold;
  behind other  the same with a tiny call of another kernel first (controls for what any earlier
                kernel warms: the schedule's and the parameters' lines, TLB entries).
alone - behind same is the call's code-fetch cost when its code is not in L2 (a step whose other
kernels have streamed the L2), an upper bound: the tiny call also takes the graph's first launch, so a
call behind it can read below its warm time (h_q 128 batch 1 does); alone cold - alone warm bounds
what code and data fetched from memory cost together.
usage: python benchmarks/bench_code_fetch.py [--out benchmarks/results] [--reps 200]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402  same folder: data and configs
from _timing import GraphTimer, capture, smi  # noqa: E402

import mla_attn  # noqa: E402

# (h_q, s_q, batch, keys, cache, kernel, other kernel)
CASES = [
    (16, 2, 32, 1024, "fp8", "narrow32", "rows64"),
    (16, 2, 128, 1024, "fp8", "narrow32", "rows64"),
    (16, 2, 32, 1024, "fp8", "rows64", "narrow32"),
    (16, 1, 32, 1024, "fp8", "narrow16_3wg", "rows64"),
    (128, 1, 32, 1024, "bf16", "seesaw_steady", "rows64"),
    (128, 1, 32, 1024, "bf16", "rows64", "seesaw_steady"),
    (128, 1, 32, 1024, "bf16", "seesaw", "rows64"),
    (128, 1, 1, 1024, "bf16", "rows64", "seesaw"),
]
TINY_BATCH, TINY_KEYS = 2, 256


def decode_call(p, c, kernel):
    md = mla_attn.get_decode_metadata(p["lens"], c["h_q"], s_q=c["s_q"], causal=c["s_q"] > 1)
    out = torch.empty(p["q"].shape[:-1] + (bd.D_V,), dtype=p["q"].dtype, device="cuda")

    def fn():
        mla_attn.mla_decode(p["q"], p["kv"], p["table"], p["lens"], softmax_scale=bd.SCALE, causal=c["s_q"] > 1,
                            k_scale=p["k_scale"], _kernel=kernel, metadata=md, out=out)
    return fn


def cold_warm_us(timer, fn, reps):
    graph, _ = capture(fn)
    t = timer.time(graph, rep_ms=0, min_reps=reps, max_reps=reps)
    return {"cold": t["cold_us"], "warm": t["warm_us"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    timer = GraphTimer()
    rows = []
    for h, s, b, L, cache, kernel, other in CASES:
        c, tiny_c = bd.cfg(h, s, b, L), bd.cfg(h, s, TINY_BATCH, TINY_KEYS)
        p, tiny_p = bd.make_problem(c, 1, cache), bd.make_problem(tiny_c, 2, cache)
        call, tiny, tiny_other = decode_call(p, c, kernel), decode_call(tiny_p, tiny_c, kernel), \
            decode_call(tiny_p, tiny_c, other)
        t = {name: cold_warm_us(timer, fn, args.reps) for name, fn in (
            ("alone", call), ("tiny", tiny), ("tiny_then_call", lambda: (tiny(), call())),
            ("tiny_other", tiny_other), ("tiny_other_then_call", lambda: (tiny_other(), call())))}
        row = dict(cfg=f"h{h}_s{s}_b{b}_L{L}", cache=cache, kernel=kernel, other=other, times_us=t,
                   behind_same_cold_us=t["tiny_then_call"]["cold"] - t["tiny"]["cold"],
                   behind_other_cold_us=t["tiny_other_then_call"]["cold"] - t["tiny_other"]["cold"])
        rows.append(row)
        print(f"{row['cfg']} {cache} {kernel}: alone cold {t['alone']['cold']:.1f} warm {t['alone']['warm']:.1f}, "
              f"behind same {row['behind_same_cold_us']:.1f}, behind {other} {row['behind_other_cold_us']:.1f}",
              flush=True)
    info = dict(device=torch.cuda.get_device_name(), smi=smi(), torch=torch.__version__,
                build=mla_attn.build_info(), reps=args.reps, tiny=dict(batch=TINY_BATCH, keys=TINY_KEYS))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_code_fetch.json"), "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)
    lines = [f"# Code fetch in a cold decode call ({info['device']}, `benchmarks/bench_code_fetch.py`)", "",
             "Median µs of CUDA-graph replays; cold: L2 flushed first. behind same: a graph of a tiny call "
             f"(batch {TINY_BATCH}, {TINY_KEYS} keys, buffers of its own) of the same kernel then the call, minus "
             "the tiny call alone; behind other: the same with another kernel's tiny call. alone − behind same "
             "bounds the code-fetch cost from above (the tiny call also takes the graph's first launch); "
             "alone cold − alone warm bounds code and data fetched from memory together.", "",
             "| config | cache | kernel | alone cold | alone warm | behind same (cold) | behind other (cold) | other |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["times_us"]
        lines.append(f"| {r['cfg']} | {r['cache']} | {r['kernel']} | {t['alone']['cold']:.1f} | {t['alone']['warm']:.1f} "
                     f"| {r['behind_same_cold_us']:.1f} | {r['behind_other_cold_us']:.1f} | {r['other']} |")
    with open(os.path.join(args.out, "bench_code_fetch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
