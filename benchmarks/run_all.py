#!/usr/bin/env python3
"""All single-GPU benchmark sweeps in one run, with every importable peer, into one report.

  1. decode: bench_decode.py's sweep (imported, same data, checks and timing), with FlashInfer when it
     imports and FlashMLA (`flash_mla`) when it imports;
  2. prefill: benchmarks/bench_prefill.py (run as `bench_prefill.py --out DIR ARGS`, expected to
     write DIR/bench_prefill.json and .md), skipped with a message while it does not exist.
Writes into --out (default benchmarks/results/): bench_decode.{json,md} and bench_prefill.{json,md}
(by the sweeps, as they go), run_all.json (every result) and run_all.md (per sweep: every peer, % of
roofline); then the PNG plots when matplotlib imports. Without matplotlib, plot elsewhere
with `python benchmarks/plot_results.py DIR/run_all.json`.

usage: python benchmarks/run_all.py [bench_decode options: --configs all --quick --only .. --out DIR ..]
                                    [--no-peers] [--no-prefill] [--prefill-args "--quick"]
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time

import torch

import bench_decode as bd
import plot_results as pr

HERE = os.path.dirname(os.path.abspath(__file__))
PREFILL = os.path.join(HERE, "bench_prefill.py")


class FlashMLA:
    """deepseek-ai/FlashMLA dense decode (page 64 only), called through its Python interface."""
    name = "flashmla"

    def __init__(self):
        import flash_mla
        self.get_mla_metadata, self.fwd = flash_mla.get_mla_metadata, flash_mla.flash_mla_with_kvcache
        self.version = getattr(flash_mla, "__version__", "?")

    def prepare(self, p, c):
        if p["page"] != 64:
            raise ValueError("FlashMLA supports page size 64 only")
        q, kv, table, lens = p["q"], p["kv"], p["table"], p["lens"]
        causal = c["s_q"] > 1
        try:  # newer FlashMLA plans on the first call, older takes the lengths
            meta, splits = self.get_mla_metadata()
        except TypeError:
            meta, splits = self.get_mla_metadata(lens, c["s_q"] * c["h_q"], 1)

        def run():
            out, lse = self.fwd(q, kv, table, lens, bd.D_V, meta, splits, softmax_scale=bd.SCALE, causal=causal)
            return out, lse.transpose(1, 2)  # lse [b, h_q, s_q] -> token-major like ours

        def eager():
            # outputs are allocated by the call: leave NaN blocks of their sizes in the caching allocator
            junk = (torch.full(q.shape[:-1] + (bd.D_V,), float("nan"), dtype=q.dtype, device=q.device),
                    torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device=q.device))
            del junk
            return run()
        return dict(eager=eager, graph_fn=run, info={}, keep=(meta, splits))


def peers():
    """Importable peers beyond FlashInfer (bench_decode handles that one)."""
    found = []
    for cls in (FlashMLA,):
        try:
            found.append(cls())
            bd.log(f"peer {cls.name} {found[-1].version} loaded")
        except Exception as e:
            bd.log(f"peer {cls.name} not importable, running without it: {e!r}")
    return found


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def decode_table(res):
    rows, ceil = res["rows"], res.get("ceilings")
    names = sorted({k for r in rows for k in pr.kernels(r)} - {pr.OURS})
    lines = ["## Decode", "",
             "cold us: median of CUDA-graph replays with L2 flushed (bench_decode.py). % roof = max(bytes/time "
             "/ HBM read ceiling, flops/time / bf16 matmul ceiling), ceilings of this run. x peer = peer us / "
             "mla_attn us (> 1: mla_attn faster).", "",
             "| config | ok | mla_attn us | % roof | " + " | ".join(f"{pr.label(n)} us | x {pr.label(n)}"
                                                             for n in names) + " |",
             "|---|---|---|---|" + "---|---|" * len(names)]
    ratios = {n: [] for n in names}
    for r in rows:
        o = r.get(pr.OURS) or {}
        us = o.get("cold_us")
        roof = pr.roofline_pct(r, pr.OURS, ceil)
        cells = [r["cfg"], "ok" if o.get("ok") else "FAIL", f"{us:.1f}" if us else "-",
                 f"{roof:.0f}" if roof is not None else "-"]
        for n in names:
            peer = (r.get(n) or {}).get("cold_us")
            cells += [f"{peer:.1f}" if peer else "-", f"{peer / us:.2f}" if peer and us else "-"]
            if peer and us:
                ratios[n].append(peer / us)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for n, xs in ratios.items():
        if xs:
            lines.append(f"Geo-mean x {pr.label(n)}: {geomean(xs):.3f} over {len(xs)} configs.")
    return lines


def run_prefill(args):
    if not os.path.exists(PREFILL):
        bd.log(f"prefill sweep skipped: {PREFILL} does not exist (it comes with mla_attn.mla_prefill)")
        return None
    cmd = [sys.executable, PREFILL, "--out", args.out] + shlex.split(args.prefill_args)
    bd.log("prefill: " + " ".join(cmd))
    rc = subprocess.run(cmd).returncode  # its own progress goes straight to our stdout
    path = os.path.join(args.out, "bench_prefill.json")
    if not os.path.exists(path):
        bd.log(f"prefill sweep wrote no {path} (exit status {rc})")
        return None
    with open(path) as f:
        res = json.load(f)
    res["exit_status"] = rc
    return res


def write_report(report, out_dir):
    with open(os.path.join(out_dir, "run_all.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    dec, pre = report["decode"], report["prefill"]
    info = dec["info"]
    ce = dec.get("ceilings") or {}
    lines = [f"# mla_attn benchmarks ({info.get('gpu')}, torch {info.get('torch')}, peers: "
             f"{', '.join(report['info']['peers']) or 'none'})", ""]
    if ce:
        lines += [f"Ceilings (this run): HBM read {ce['read_TBps']:.2f} TB/s, bf16 matmul 8192^3 "
                  f"{ce['mm8192_bf16_TFLOPs']:.0f} TFLOP/s.", ""]
    lines += decode_table(dec) + ["", "## Prefill", ""]
    md = os.path.join(out_dir, "bench_prefill.md")
    if pre is None:
        lines.append(report["info"]["prefill_note"])
    elif os.path.exists(md):
        with open(md) as f:  # the sweep's own table, one heading level down
            lines += [("#" + ln if ln.startswith("#") else ln) for ln in f.read().splitlines()]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "run_all.md"), "w") as f:
        f.write(text)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bd.add_args(ap)
    ap.add_argument("--no-peers", action="store_true", help="only FlashInfer (unless --no-flashinfer)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--prefill-args", default="", help="extra arguments for bench_prefill.py")
    args = ap.parse_args()
    t0 = time.time()
    extra = [] if args.no_peers else peers()
    bd.log(f"== decode sweep (t+{time.time() - t0:.0f}s)")
    decode = bd.run(args, extra_kernels=extra)
    prefill, note = None, "Not run (--no-prefill)."
    if not args.no_prefill:
        bd.log(f"== prefill sweep (t+{time.time() - t0:.0f}s)")
        prefill = run_prefill(args)
        note = "Not run: benchmarks/bench_prefill.py is missing or wrote no results." if prefill is None else ""
    peer_names = ([] if args.no_flashinfer or "flashinfer" not in decode["info"] else ["flashinfer_fa3"])
    report = dict(info=dict(peers=peer_names + [k.name for k in extra], prefill_note=note,
                            elapsed_s=time.time() - t0),
                  decode=decode, prefill=prefill)
    bd.log("\n" + write_report(report, args.out))
    bd.log(f"wrote {args.out}/run_all.json and run_all.md in {time.time() - t0:.0f}s")
    try:
        pr.plot([os.path.join(args.out, "run_all.json")])
    except ImportError:
        bd.log(f"matplotlib not importable: plot on another machine with\n"
               f"  python benchmarks/plot_results.py {args.out}/run_all.json")
    failed = sum(1 for r in decode["rows"] if not r.get(pr.OURS, {}).get("ok"))
    failed += bool(prefill and prefill.get("exit_status"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
