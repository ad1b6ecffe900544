#!/usr/bin/env python3
"""Context-parallel decode over 2 GPUs (mla_attn.distributed.cp_mla_decode) vs one GPU.

For h_q 16 and 128, s_q 1, batch 1/2/4/8, contexts 64k/128k/256k (bench_decode's data: bf16, page 64,
randomly permuted pages, scale 1/sqrt(192)), three CUDA graphs per config:
  single: one mla_decode over the whole cache on one GPU;
  cp:     the whole CP step, the cache dealt round-robin by page over the GPUs (cp_slice): local
          mla_decode, all-gather of (out, lse), merge_attn_states_n;
  local:  the local mla_decode alone (cp - local = the exchange and the merge).
Timing is cold (a 512 MB read evicts L2 before every replay), and the GPUs start every replay together
(an all-reduce right before the start event); a replay takes as long as its slower GPU. Every config
first checks cp against single and both against the float32 reference (bench_decode's criteria).
Every rank builds the same data from the same seeds (checked by a checksum).

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_cp_decode.py [--quick] [--only h128_b1]
        [--out DIR] [--reps 40] [--eager]

Writes <out>/bench_cp_decode.json and bench_cp_decode.md (rank 0). Exit status 1 if a check fails.
"""
import argparse
import json
import os
import statistics
import sys
import time
import zlib

import torch
import torch.distributed as dist

import bench_decode as bd  # same folder: data, reference, checks, L2 flush, graph capture
import mla_attn
from mla_attn.distributed import cp_mla_decode, cp_slice

QUICK = ["h128_b1_L65536", "h128_b8_L262144", "h16_b1_L262144", "h16_b8_L131072"]


def configs(quick, only):
    cs = [dict(name=f"h{h}_b{b}_L{L}", h_q=h, s_q=1, b=b, L=L, page=bd.PAGE)
          for h in (16, 128) for b in (1, 2, 4, 8) for L in (65536, 131072, 262144)]
    if quick:
        cs = [c for c in cs if c["name"] in QUICK]
    keys = [k for k in only.split(",") if k]
    return [c for c in cs if not keys or any(k in c["name"] for k in keys)]


def time_cold(fn, timer, reps):
    """Median / p10 / p90 us over reps, each replay's time being the slower rank's."""
    align = torch.zeros(1, device="cuda")
    evs = []
    for i in range(reps + 3):
        timer.flush()
        dist.all_reduce(align)  # both GPUs past their flush: the replays start together
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        if i >= 3:  # warm-up replays
            evs.append((s, e))
    torch.cuda.synchronize()
    ts = torch.tensor([s.elapsed_time(e) * 1e3 for s, e in evs], device="cuda")
    dist.all_reduce(ts, op=dist.ReduceOp.MAX)
    ts = sorted(ts.tolist())
    return dict(us=statistics.median(ts), p10_us=ts[len(ts) // 10], p90_us=ts[(9 * len(ts)) // 10], reps=reps)


def runner(fn, eager):
    """(callable to time, its outputs): a CUDA graph of fn, or fn itself with --eager."""
    if eager:
        return fn, fn()
    g, outs = bd.capture(fn)
    g.replay()  # the captured call only recorded the work: outs hold results after a replay
    return g.replay, outs


def bench_config(c, timer, args, world, rank):
    p = bd.make_problem(c, seed=zlib.crc32(c["name"].encode()) & 0x7FFFFFFF)
    sums = torch.stack([p["kv"].sum(dtype=torch.float32), p["q"].sum(dtype=torch.float32)])
    everyone = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(everyone, sums)
    if not all(torch.equal(everyone[0], x) for x in everyone):
        raise RuntimeError("ranks built different data (device RNG differs between the GPUs)")
    ref = bd.reference_fp32(p, causal=False)
    h_q, q, kv = c["h_q"], p["q"], p["kv"]
    local = cp_slice(p["table"], p["lens"], c["page"], world, rank)
    md_full = mla_attn.get_decode_metadata(p["lens"], h_q, s_q=1, causal=False)
    md_local = mla_attn.get_decode_metadata(local.cache_seqlens, h_q, s_q=1, causal=False)
    kw = dict(softmax_scale=bd.SCALE, return_lse=True)

    def single():
        return mla_attn.mla_decode(q, kv, p["table"], p["lens"], causal=False, metadata=md_full, **kw)

    def cp():
        return cp_mla_decode(q, kv, local.block_table, local.cache_seqlens, metadata=md_local, **kw)

    def local_only():
        return mla_attn.mla_decode(q, kv, local.block_table, local.cache_seqlens, causal=False,
                                   metadata=md_local, **kw)

    row = dict(cfg=c["name"], h_q=h_q, b=c["b"], L=c["L"], page=c["page"], world=world,
               graph=not args.eager, local_keys_max=int(local.cache_seqlens.max()))
    run_single, (s_out, s_lse) = runner(single, args.eager)
    run_cp, (cp_out, cp_lse) = runner(cp, args.eager)
    run_local, _ = runner(local_only, args.eager)
    torch.cuda.synchronize()
    row["check_single"] = bd.compare(s_out, s_lse, *ref)
    row["check_cp"] = bd.compare(cp_out, cp_lse, *ref)
    row["check_cp_vs_single"] = bd.compare(cp_out, cp_lse, s_out.float(), s_lse)
    ok = torch.tensor([all(row[k]["ok"] for k in ("check_single", "check_cp", "check_cp_vs_single"))],
                      dtype=torch.int32, device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    row["ok"] = bool(ok.item())
    for name, fn in (("single", run_single), ("cp", run_cp), ("local", run_local)):
        row.update({f"{name}_{k}": v for k, v in time_cold(fn, timer, args.reps).items()})
    row["speedup"] = row["single_us"] / row["cp_us"]
    row["exchange_us"] = row["cp_us"] - row["local_us"]
    return row


def write_outputs(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_cp_decode.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    info = results["info"]
    lines = [f"# Context-parallel decode, {info['world']} x {info['gpu']} (torch {info['torch']})", "",
             "us: median of cold CUDA-graph replays (L2 evicted first; GPUs start together; a replay lasts as "
             "long as its slower GPU). single = mla_decode over the whole cache on one GPU; CP = local "
             "mla_decode over the rank's pages + all-gather of (out, lse) + merge; local = the local "
             "mla_decode alone; exchange = CP - local. speed-up = single / CP.", "",
             "| config | ok | single us | CP us | local us | exchange us | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['cfg']} | {'ok' if r['ok'] else 'FAIL'} | {r['single_us']:.1f} | {r['cp_us']:.1f} | "
                     f"{r['local_us']:.1f} | {r['exchange_us']:.1f} | {r['speedup']:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "bench_cp_decode.md"), "w") as f:
        f.write(text)
    return text


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configs: {', '.join(QUICK)}")
    ap.add_argument("--only", default="", help="comma list of config-name substrings")
    ap.add_argument("--out", default=os.path.join(here, "results"))
    ap.add_argument("--reps", type=int, default=40, help="timed replays per variant and config")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA graphs "
                    "(includes Python overhead; for stacks where NCCL cannot be graph-captured)")
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    info = dict(world=world, gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, torch.cuda.nccl.version())), smi=bd.smi(), args=vars(args),
                mla_attn_build_info=mla_attn.build_info())
    results = dict(info=info, rows=[])
    timer = bd.GraphTimer()
    cfgs = configs(args.quick, args.only)
    t0 = time.time()
    for i, c in enumerate(cfgs):
        row = bench_config(c, timer, args, world, rank)
        results["rows"].append(row)
        if rank == 0:
            bd.log(f"[{i + 1}/{len(cfgs)}] {c['name']:18s} {'ok  ' if row['ok'] else 'FAIL'} single "
                   f"{row['single_us']:8.1f} us  cp {row['cp_us']:8.1f} us (local {row['local_us']:8.1f}, "
                   f"exchange {row['exchange_us']:5.1f})  x{row['speedup']:.2f}  t+{time.time() - t0:.0f}s")
            write_outputs(results, args.out)
        torch.cuda.empty_cache()
    if rank == 0:
        bd.log("\n" + write_outputs(results, args.out))
    n_fail = sum(not r["ok"] for r in results["rows"])
    dist.destroy_process_group()
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
