#!/usr/bin/env python3
"""Benchmark mla_attn.mla_sparse_prefill (DeepSeek-V3.2 top-k prefill) on one Hopper GPU.

For every config (h_q 64 / 128, T query tokens 4096 / 16384; top-k 2048):
  1. build the problem: kv [S, 576] bf16, S = 32768 latent rows (what an engine gathers from its
     cache for the sequence); each query token attends to 2048 distinct random rows of it;
     q [T, h_q, 576] bf16, scale 1/sqrt(192);
  2. check out / LSE of the first tokens against the float64 reference (bench_sparse.check): an eager
     call into a NaN-poisoned out, then a CUDA-graph replay into a NaN-poisoned out;
  3. time the whole call (schedule, index compaction, attention) as a CUDA graph, replays
     interleaved with FlashMLA's sparse prefill on the same data when --flashmla-module is given
     (MOD.flash_mla_sparse_fwd(q, kv [S, 1, 576], indices [T, 1, topk], scale)), cold and warm as in
     bench_sparse.py.
Formula: TFLOP/s = 2 * h_q * T * 2048 * (576 + 512) / t (cold); x FMLA = FlashMLA time / ours.
The run's ceilings (HBM streaming read, bf16 8192^3 matmul) are measured first.

Outputs: <out>/bench_sparse_prefill.json and .md.
usage: python benchmarks/bench_sparse_prefill.py [--only h128_T4096,...] [--out DIR] [--rep-ms 100]
                                                 [--flashmla-module flash_mla]
"""
import argparse
import importlib
import json
import os
import time
import traceback

import torch

from _timing import GraphTimer, capture, measure_ceilings, nvml_sample, smi
from bench_sparse import D_QK, D_V, SCALE, TOPK, check, check_op, log

ROWS = 32768  # latent rows of kv the indices draw from


def configs(only):
    cs = [dict(name=f"h{h}_T{t}", h_q=h, tokens=t) for h in (64, 128) for t in (4096, 16384)]
    return [c for c in cs if not only or any(k in c["name"] for k in only.split(","))]


def make_problem(c, seed, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    kv = torch.randn(ROWS, D_QK, generator=g, device=dev).to(torch.bfloat16)
    q = torch.randn(c["tokens"], c["h_q"], D_QK, generator=g, device=dev).to(torch.bfloat16)
    idx = torch.empty(c["tokens"], TOPK, dtype=torch.int32, device=dev)
    for t0 in range(0, c["tokens"], 1024):  # TOPK distinct rows per token, 1024 tokens at a time
        t1 = min(t0 + 1024, c["tokens"])
        idx[t0:t1] = torch.rand(t1 - t0, ROWS, generator=g, device=dev).topk(TOPK, dim=1).indices.int()
    # bench_sparse.check reads kv_ref as a cache of one-row pages, indices as its slots
    return dict(q=q, kv=kv, kv_ref=kv[:, None], indices=idx)


def run_config(c, timer, rep_ms, flashmla):
    import mla_attn
    p = make_problem(c, seed=c["h_q"] + c["tokens"])
    q, kv, idx = p["q"], p["kv"], p["indices"]
    res = dict(c)
    out = torch.full(q.shape[:-1] + (D_V,), float("nan"), dtype=q.dtype, device=q.device)

    def op():
        return mla_attn.mla_sparse_prefill(q, kv, idx, softmax_scale=SCALE, out=out, return_lse=True)

    g_op, _ = check_op(p, op, out, res)
    graphs, names = [g_op], ["op"]
    if flashmla is not None:
        try:
            kv_rows, idx_rows = kv[:, None], idx[:, None]

            def fm():
                o, _, l = flashmla.flash_mla_sparse_fwd(q, kv_rows, idx_rows, SCALE)[:3]  # out, max_logits, lse
                return o, l
            o, l = fm()
            res["flashmla_check"] = check(p, o, l)
            g_fm, _ = capture(fm)
            graphs.append(g_fm)
            names.append("flashmla")
        except Exception as e:  # a peer that cannot run the config is reported, not fatal
            res["flashmla_error"] = repr(e)[:300]
    for name, t in zip(names, timer.time_interleaved(graphs, rep_ms, min_reps=10)):
        res[name] = t
    flops = 2 * c["h_q"] * c["tokens"] * TOPK * (D_QK + D_V)
    res["tflops"] = flops / (res["op"]["cold_us"] * 1e-6) / 1e12
    if "flashmla" in res:
        res["flashmla_tflops"] = flops / (res["flashmla"]["cold_us"] * 1e-6) / 1e12
    res["nvml"] = nvml_sample()
    return res


def table(results):
    head = ["config", "ok", "cold us", "warm us", "TFLOP/s", "FMLA cold us", "FMLA TFLOP/s", "x FMLA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:60]} |" + " |" * (len(head) - 2))
            continue
        ok = r["check_eager"]["ok"] and r["check_graph"]["ok"]
        row = [r["name"], "ok" if ok else "FAIL", f"{r['op']['cold_us']:.1f}", f"{r['op']['warm_us']:.1f}",
               f"{r['tflops']:.0f}"]
        fm = r.get("flashmla")
        if fm:
            row += [f"{fm['cold_us']:.1f}" + ("" if r["flashmla_check"]["ok"] else " (FAIL)"),
                    f"{r['flashmla_tflops']:.0f}", f"{fm['cold_us'] / r['op']['cold_us']:.2f}"]
        else:
            row += ["-"] * 3
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--flashmla-module", default=None, help="import path of a FlashMLA build (flash_mla)")
    args = ap.parse_args()
    flashmla = None
    if args.flashmla_module:
        try:
            flashmla = importlib.import_module(args.flashmla_module)
        except Exception as e:
            log(f"--flashmla-module {args.flashmla_module}: import failed ({e!r}); running without it")
    ceilings = measure_ceilings()
    log(f"ceilings: read {ceilings['read_TBps']:.2f} TB/s, bf16 matmul {ceilings['mm8192_bf16_TFLOPs']:.0f} TFLOP/s")
    timer = GraphTimer()
    results = []
    t0 = time.time()
    for c in configs(args.only):
        try:
            results.append(run_config(c, timer, args.rep_ms, flashmla))
            r = results[-1]
            log(f"{c['name']}: {r['op']['cold_us']:.1f} us cold, {r['tflops']:.0f} TFLOP/s, "
                f"ok={r['check_eager']['ok'] and r['check_graph']['ok']}")
        except Exception as e:
            traceback.print_exc()
            results.append(dict(c, error=repr(e)[:300]))
        torch.cuda.empty_cache()
    md = table(results)
    meta = dict(gpu=torch.cuda.get_device_name(), smi=smi(), torch=torch.__version__, topk=TOPK, kv_rows=ROWS,
                ceilings=ceilings, seconds=round(time.time() - t0, 1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sparse_prefill.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    with open(os.path.join(args.out, "bench_sparse_prefill.md"), "w") as f:
        f.write(f"# mla_sparse_prefill, top-k {TOPK}, kv {ROWS} rows ({meta['gpu']})\n\n"
                f"Ceilings (this run): HBM read {ceilings['read_TBps']:.2f} TB/s; bf16 matmul 8192^3 "
                f"{ceilings['mm8192_bf16_TFLOPs']:.0f} TFLOP/s\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
