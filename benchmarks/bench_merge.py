#!/usr/bin/env python3
"""Benchmark the LSE merge ops (mla_attn.merge_attn_states / merge_attn_states_n) on one GPU.

Configs: T tokens x h heads (default 16384 x 128), d = 512 and 128, bf16 outs, fp32 LSEs, 2-way
(merge_attn_states) and n = 4 (merge_attn_states_n); 5 % of the partial LSEs are empty (+inf).
Per config: a correctness check of the first 256 tokens against the fp32 torch reference, then the
op as a CUDA graph timed with benchmarks/_timing.py: cold = median over replays each preceded by a
512 MB read (L2 evicted), warm = each preceded by a ~20 us spin.

GB/s = (bytes read + bytes written) / cold time, with bytes read = n (T h d 2 + T h 4) (every out and
LSE, empty partials included) and written = T h d 2 + T h 4; next to it the streaming-read ceiling of
the same run (bench_decode.py's) and the ratio.

usage: python benchmarks/bench_merge.py [--out DIR] [--tokens 16384] [--heads 128] [--rep-ms 200]
                                        [--no-ceilings]
"""
import argparse
import json
import os
import sys
import traceback

import torch

import mla_attn
from mla_attn.reference import merge_attn_states_ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import GraphTimer, capture, measure_ceilings, smi  # noqa: E402

CHECK_TOKENS = 256
TOL = dict(rtol=2**-7, atol=1e-2)  # one bf16 rounding


def log(*a):
    print(*a, flush=True)


def make_inputs(n, T, h, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    outs = torch.randn(n, T, h, d, dtype=torch.bfloat16, device="cuda", generator=g)
    lses = torch.randn(n, T, h, device="cuda", generator=g) * 4
    lses[torch.rand(n, T, h, device="cuda", generator=g) < 0.05] = float("inf")
    return outs, lses


def configs(T, h):
    return [dict(name=f"{'pair' if n == 2 else f'n{n}'}_T{T}_h{h}_d{d}", n=n, T=T, h=h, d=d)
            for d in (512, 128) for n in (2, 4)]


def run_config(c, timer, rep_ms):
    n, T, h, d = c["n"], c["T"], c["h"], c["d"]
    outs, lses = make_inputs(n, T, h, d, seed=d + n)
    if n == 2:
        fn = lambda: mla_attn.merge_attn_states(outs[0], lses[0], outs[1], lses[1])  # noqa: E731
    else:
        fn = lambda: mla_attn.merge_attn_states_n(outs, lses)  # noqa: E731
    g, (out, lse) = capture(fn)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    want_out, want_lse = merge_attn_states_ref(outs[:, :CHECK_TOKENS].float(), lses[:, :CHECK_TOKENS])
    got_out, got_lse = out[:CHECK_TOKENS].float(), lse[:CHECK_TOKENS]
    row = dict(c, max_abs=float((got_out - want_out.bfloat16().float()).abs().max()),
               lse_max_abs=float((got_lse - want_lse).abs().max()))
    row["ok"] = bool(torch.allclose(got_out, want_out, **TOL) and torch.allclose(got_lse, want_lse, rtol=1e-6,
                                                                                  atol=2e-5)
                     and torch.isfinite(out).all() and not lse.isnan().any())  # lse +inf: all inputs empty
    rows = T * h
    row["bytes_read"] = n * rows * (d * 2 + 4)
    row["bytes_written"] = rows * (d * 2 + 4)
    row.update(timer.time(g, rep_ms))
    row["GBps"] = (row["bytes_read"] + row["bytes_written"]) / row["cold_us"] / 1e3
    del g, outs, lses, out, lse
    torch.cuda.empty_cache()
    return row


def write_outputs(results, out_dir):
    lines = [f"# mla_attn LSE merge benchmark ({results['info']['gpu']}, torch {results['info']['torch']})", ""]
    ceil = (results.get("ceilings") or {}).get("read_TBps")
    if ceil:
        lines += [f"Streaming-read ceiling (this run): {ceil * 1e3:.0f} GB/s.", ""]
    lines += ["cold/warm: median us of a CUDA-graph replay (cold: L2 flushed by a 512 MB read first). "
              "GB/s = (bytes read + written) / cold; % = of the read ceiling.", "",
              "| config | ok | max abs | cold us | warm us | MB moved | GB/s | % ceiling |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | ERROR | {r['error'].strip().splitlines()[-1][:80]} | | | | | |")
            continue
        pct = f"{100 * r['GBps'] / (ceil * 1e3):.0f}" if ceil else "-"
        lines.append(f"| {r['name']} | {'ok' if r['ok'] else 'FAIL'} | {r['max_abs']:.1e} | {r['cold_us']:.1f} | "
                     f"{r['warm_us']:.1f} | {(r['bytes_read'] + r['bytes_written']) / 1e6:.0f} | "
                     f"{r['GBps']:.0f} | {pct} |")
    text = "\n".join(lines) + "\n"
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_merge.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(out_dir, "bench_merge.md"), "w") as f:
            f.write(text)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write bench_merge.json and bench_merge.md here")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timing budget per mode per config (ms)")
    ap.add_argument("--no-ceilings", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_merge.py needs a CUDA GPU")
    info = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), smi=smi(), args=vars(args),
                mla_attn_build_info=mla_attn.build_info())
    results = dict(info=info, ceilings=None, rows=[])
    if not args.no_ceilings:
        results["ceilings"] = measure_ceilings(matmul=False)
        log("ceilings", json.dumps(results["ceilings"]))
    timer = GraphTimer()
    for c in configs(args.tokens, args.heads):
        try:
            r = run_config(c, timer, args.rep_ms)
            log(f"{c['name']:24s} {'ok  ' if r['ok'] else 'FAIL'} cold {r['cold_us']:8.1f} us  warm "
                f"{r['warm_us']:8.1f} us  {r['GBps']:6.0f} GB/s")
        except Exception:
            r = dict(c, error=traceback.format_exc()[-2000:], ok=False)
            log(f"{c['name']} ERROR\n{r['error']}")
            torch.cuda.empty_cache()
        results["rows"].append(r)
    log("\n" + write_outputs(results, args.out))
    sys.exit(0 if all(r["ok"] for r in results["rows"]) else 1)


if __name__ == "__main__":
    main()
