#!/usr/bin/env python3
"""Host time per eager call on one Hopper GPU: what an engine pays per layer where attention runs
outside a CUDA graph (vLLM's piecewise graphs run attention eagerly: prefill, mixed batches, and decode
whenever full graphs are off), beside the GPU time of the same call.

For each call below (bf16; decode s_q 1 with the schedule made once outside, as an engine makes it per
step):
  host us = wall time of N = 200 calls issued back to back / N, after 50 warm-up calls; median of 5
            rounds, each followed by a synchronize (a round's launches fit the GPU's queue, so the
            host does not wait on the GPU while it issues them);
  GPU us  = the same call captured in a CUDA graph and replayed, each replay after a ~20 us spin kernel
            (warm: _timing.GraphTimer, so the host's launch gap is not in it), median;
  bound   = "host" where host us > GPU us: a step of such calls runs at the host's pace.
Calls:
  mla_decode            mla_attn.mla_decode(q, kv, table, lens, metadata=md) (paged cache, page 64, L keys)
  mla_decode out=       the same into a preallocated out (the op allocates lse)
  op alone              torch.ops.mla_attn.mla_decode on the same arguments: dispatch, the C++ checks and
                        the launches without the Python wrapper (the floor the wrapper adds to)
  flashmla              FlashMLA's flash_mla_with_kvcache on the same cache (--flashmla SO:PKG_ROOT:
                        bench_decode.py's adapter around a build you made yourself)
  flashinfer_fa3        FlashInfer's BatchMLAPagedAttentionWrapper.run (planned once outside), where it imports
  mla_sparse_decode     top-k 2048 over bench_sparse.py's problem, metadata=get_sparse_decode_metadata(...):
                        the ds_mla_fp8 cache, and the bf16 cache with indices_valid=True
  write_kv_cache        b new tokens into the bf16 cache
  mla_prefill           a chunked-prefill layer's calls, h_q 16 (128 under TP 8), one request of 256 new
                        tokens over 2048 context keys: the new tokens (causal, k_nope + shared k_pe,
                        return_lse), the context (not causal, into a preallocated out), and
  merge_attn_states     the two partials merged into a preallocated out

Outputs: <out>/bench_host_overhead.json and .md (the table, printed last).
usage: python benchmarks/bench_host_overhead.py [--out DIR] [--flashmla SO:PKG_ROOT] [--no-flashinfer]
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

import bench_decode as bd
import bench_sparse as bs
from _timing import GraphTimer, capture, smi

HOST_WARMUP, HOST_CALLS, HOST_ROUNDS = 50, 200, 5
GPU_REP_MS = 20.0
DENSE = [bd.cfg(128, 1, 1, 4096), bd.cfg(16, 1, 1, 4096), bd.cfg(128, 1, 32, 4096)]
SPARSE = [dict(name="h128_s1_b1", h_q=128, s_q=1, b=1), dict(name="h16_s1_b32", h_q=16, s_q=1, b=32)]


def host_us(fn):
    for _ in range(HOST_WARMUP):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(HOST_ROUNDS):
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        rounds.append((time.perf_counter() - t0) / HOST_CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def gpu_us(timer, fn):
    graph, _ = capture(fn)
    return timer.time(graph, rep_ms=GPU_REP_MS)["warm_us"]


def measure(timer, config, call, fn):
    row = dict(config=config, call=call)
    try:
        row.update(host_us=host_us(fn), gpu_us=gpu_us(timer, fn))
    except Exception as e:  # a peer that cannot run the config: reported, the others go on
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print(row, flush=True)
    return row


def dense_calls(c, peers):
    import mla_attn
    p = bd.make_problem(c, seed=1)
    md = mla_attn.get_decode_metadata(p["lens"], c["h_q"], s_q=c["s_q"])
    q, kv, table, lens = p["q"], p["kv"], p["table"], p["lens"]
    out = torch.empty(q.shape[:-1] + (bd.D_V,), dtype=q.dtype, device=q.device)
    op_args = (q, None, kv, table, lens, None, c["s_q"], bd.SCALE, md.causal, md.tile_sched, md.req_splits,
               md.num_sm_parts)
    calls = {
        "mla_decode": lambda: mla_attn.mla_decode(q, kv, table, lens, softmax_scale=bd.SCALE, metadata=md),
        "mla_decode out=": lambda: mla_attn.mla_decode(q, kv, table, lens, softmax_scale=bd.SCALE, metadata=md,
                                                       out=out),
        "op alone": lambda: torch.ops.mla_attn.mla_decode(*op_args),
    }
    for peer in peers:
        try:
            prepared = peer.prepare(p, c)
            calls[peer.name] = lambda prepared=prepared: prepared["graph_fn"]()  # holds what it keeps alive
        except Exception as e:
            print(f"{peer.name} skipped on {c['name']}: {e}", flush=True)
    return calls


def sparse_calls(c):
    import mla_attn
    calls = {}
    for kv_format, valid in (("ds_mla_fp8", False), ("bf16", True)):
        p = bs.make_problem(c, seed=2, kv_format=kv_format)
        md = mla_attn.get_sparse_decode_metadata(p["indices"], c["h_q"])
        name = f"mla_sparse_decode {kv_format}" + (" indices_valid" if valid else "")
        calls[name] = (lambda p=p, md=md, valid=valid: mla_attn.mla_sparse_decode(
            p["q"], p["kv"], p["indices"], softmax_scale=bs.SCALE, metadata=md, indices_valid=valid))
    return calls


def write_calls(c):
    import mla_attn
    p = bd.make_problem(c, seed=3)
    cache = p["kv"].squeeze(2)
    kv_c = torch.randn(c["b"], bd.D_V, dtype=torch.bfloat16, device=bd.DEV)
    k_pe = torch.randn(c["b"], bd.D_QK - bd.D_V, dtype=torch.bfloat16, device=bd.DEV)
    slots = torch.arange(c["b"], device=bd.DEV) * c["page"]
    return {"write_kv_cache": lambda: mla_attn.write_kv_cache(kv_c, k_pe, cache, slots)}


def prefill_calls():
    import mla_attn
    h, new, ctx = 16, 256, 2048
    dev, bf = bd.DEV, torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, dtype=bf, device=dev)
    q, k_new, v_new, pe_new = rand(new, h, 192), rand(new, h, 128), rand(new, h, 128), rand(new, 1, 64)
    k_ctx, v_ctx, pe_ctx = rand(ctx, h, 128), rand(ctx, h, 128), rand(ctx, 1, 64)
    cu_new = torch.tensor([0, new], dtype=torch.int32, device=dev)
    cu_ctx = torch.tensor([0, ctx], dtype=torch.int32, device=dev)
    out_ctx, out = rand(new, h, 128), rand(new, h, 128)
    scale = 192**-0.5

    def new_tokens():
        return mla_attn.mla_prefill(q, k_new, v_new, cu_new, cu_new, new, new, softmax_scale=scale, causal=True,
                                    k_pe=pe_new, return_lse=True)

    def context():
        return mla_attn.mla_prefill(q, k_ctx, v_ctx, cu_new, cu_ctx, new, ctx, softmax_scale=scale, causal=False,
                                    k_pe=pe_ctx, return_lse=True, out=out_ctx)
    o_new, lse_new = new_tokens()
    _, lse_ctx = context()
    return {"mla_prefill": new_tokens, "mla_prefill out=": context,
            "merge_attn_states out=": lambda: mla_attn.merge_attn_states(o_new, lse_new, out_ctx, lse_ctx, out=out)}


def table(rows):
    lines = ["| config | call | host us | GPU us | bound |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['call']} | ERROR | {r['error'][:80]} | |")
            continue
        bound = "host" if r["host_us"] > r["gpu_us"] else "GPU"
        lines.append(f"| {r['config']} | {r['call']} | {r['host_us']:.1f} | {r['gpu_us']:.1f} | {bound} |")
    return "\n".join(lines)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(here, "results"))
    ap.add_argument("--flashmla", default="", metavar="SO:PKG_ROOT")
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host_overhead.py needs a CUDA GPU")
    import mla_attn
    peers = []
    if args.flashmla:
        peers.append(bd.FlashMLA(args.flashmla))
    if not args.no_flashinfer:
        try:
            peers.append(bd.FlashInferFA3())
        except Exception as e:
            print(f"FlashInfer not run: {e}", flush=True)
    info = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=sys.version.split()[0],
                build=mla_attn.build_info(), smi_before=smi(), args=vars(args))
    timer, rows = GraphTimer(), []
    for c in DENSE:
        for call, fn in dense_calls(c, peers).items():
            rows.append(measure(timer, c["name"], call, fn))
        if c["b"] > 1:
            for call, fn in write_calls(c).items():
                rows.append(measure(timer, c["name"], call, fn))
    for c in SPARSE:
        for call, fn in sparse_calls(c).items():
            rows.append(measure(timer, c["name"], call, fn))
    for call, fn in prefill_calls().items():
        rows.append(measure(timer, "h16 T256 ctx2048", call, fn))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_host_overhead.json"), "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
    md = table(rows)
    with open(os.path.join(args.out, "bench_host_overhead.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
