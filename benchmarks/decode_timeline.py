#!/usr/bin/env python3
"""Where the time of one mla_decode call goes: the split kernel's duration and how long after it the
combine kernel ends, from a torch.profiler trace of eager calls (cold: each after a 512 MB
L2-evicting read; warm: back to back). Medians over 15 calls per config and mode.

usage: python benchmarks/decode_timeline.py [--kv-dtype bf16|fp8] [--flashmla SO:PKG_ROOT]
With --flashmla a FlashMLA build (see bench_decode.py) is traced the same way, beside mla_attn.
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import bench_decode as bd
from _timing import GraphTimer

CONFIGS = [(128, 1, 1, 1024), (128, 1, 1, 16384), (128, 1, 32, 1024), (128, 1, 32, 4096), (128, 2, 32, 1024),
           (128, 1, 128, 1024), (16, 1, 1, 1024), (16, 1, 1, 16384), (16, 2, 1, 16384), (16, 1, 32, 1024),
           (16, 2, 32, 1024), (16, 2, 32, 4096)]


def trace(fn, flush=None, calls=15):
    """(split kernel us, combine end after the split kernel's end us), medians; flush() before each
    call when given."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if flush is not None:
                flush()
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    split = [e for e in ev if ("mla_decode" in e.name or "splitkv" in e.name) and "combine" not in e.name]
    combine = [e for e in ev if "combine" in e.name]
    tails = []
    for e in split:  # the first combine that starts after this split kernel (PDL: it may start early)
        later = [c for c in combine if c.time_range.start >= e.time_range.start]
        if later:
            tails.append(min(later, key=lambda c: c.time_range.start).time_range.end - e.time_range.end)
    dur = statistics.median(e.time_range.end - e.time_range.start for e in split)
    return dur, (statistics.median(tails) if tails else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--flashmla", default="")
    args = ap.parse_args()
    flush = GraphTimer().flush  # the benchmark's 512 MB L2-evicting read
    kernels = [bd.Ours()] + ([bd.FlashMLA(args.flashmla)] if args.flashmla else [])
    for h, s, b, L in CONFIGS:
        c = bd.cfg(h, s, b, L)
        p = bd.make_problem(c, 0, kv_dtype=args.kv_dtype)
        for k in kernels:
            prep = k.prepare(p, c)
            fn = prep["graph_fn"] if k.name == "mla_attn" else prep["eager"]  # FlashMLA: first call plans
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            cold, warm = trace(fn, flush), trace(fn)
            print(f"{k.name:9s} {c['name']:20s} split kernel {cold[0]:6.1f} / {warm[0]:6.1f} us, combine ends "
                  f"{cold[1]:5.1f} / {warm[1]:5.1f} us after it (cold / warm)", flush=True)


if __name__ == "__main__":
    main()
