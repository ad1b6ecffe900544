#!/usr/bin/env python3
"""GPU time of the decode scheduler (get_decode_metadata) per call, beside the floor of a graph node.

Each call is captured 20 times in one CUDA graph; the figure is the median over 50 replays of
(replay time / 20), in us: what a captured decode step pays for its schedule. The floor: an empty kernel
(torch.cuda._sleep(1)) and a 1-element fill in the same kind of graph. Batches 1 / 32 / 128 / 512 at
4096 keys each (L4096) and at lengths uniform in [1, 8192] (Lrand), s_q 1, h_q 16 and 128.
Prints one line per call; run it with each build on PYTHONPATH to compare builds (results/
bench_scheduler_ab.md).
usage: python benchmarks/bench_scheduler.py
"""
import statistics

import torch

import mla_attn


def per_call_us(fn, iters=20, reps=50):
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def main():
    x = torch.zeros(1, device="cuda")
    print(f"empty kernel (_sleep 1): {per_call_us(lambda: torch.cuda._sleep(1)):.2f} us")
    print(f"fill 1 element: {per_call_us(lambda: x.fill_(1.0)):.2f} us")
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in (1, 32, 128, 512):
        for name, lens in (("L4096", torch.full((b,), 4096, device="cuda", dtype=torch.int32)),
                           ("Lrand", torch.randint(1, 8193, (b,), device="cuda", dtype=torch.int32, generator=g))):
            for h in (16, 128):
                t = per_call_us(lambda: mla_attn.get_decode_metadata(lens, h, s_q=1))
                print(f"get_decode_metadata b{b} {name} h{h}: {t:.2f} us")


if __name__ == "__main__":
    main()
