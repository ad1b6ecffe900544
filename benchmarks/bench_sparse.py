#!/usr/bin/env python3
"""Benchmark mla_attn.mla_sparse_decode (DeepSeek-V3.2 top-k attention) on one Hopper GPU.

For every config (h_q, s_q, batch; top-k 2048, bf16 cache [pages, 64, 576]):
  1. build the problem: each request owns a context of CONTEXT tokens on randomly permuted pages, and
     each of its s_q query tokens attends to TOPK distinct random positions of it (all valid), given as
     global cache slots page * 64 + row; q [b, s_q, h_q, 576] bf16, scale 1/sqrt(192);
  2. check out / LSE of a few query tokens against the float64 reference (mla_sparse_ref): eager call
     into a NaN-poisoned out, then a CUDA-graph replay into a NaN-poisoned out; "ok" = finite,
     rel-L2 < 2e-2, LSE max-abs < 1e-2;
  3. time as CUDA graphs, replays interleaved (benchmarks/_timing.py, as bench_decode.py):
       op    = the whole call without metadata=: index compaction + attention, the split-KV schedule
               reused from an earlier call of the same shapes (mla_attn.sparse._ScheduleCache),
       layer = the call with the schedule made once per step (get_sparse_decode_metadata, shapes only,
               as FlashMLA's metadata): index compaction + attention, what each layer of a step pays,
       layer_sink = the layer with an attention sink per head (attn_sink from 0 to 12 over the heads,
               around the rows' lse of ~9), checked against the reference with the same sink,
       layer_valid = the layer with indices_valid=True (every index here is a cache slot): no
               compaction kernel,
       attn  = the attention kernel alone (the compaction made once outside the graph too);
     cold = median over replays each preceded by a 512 MB read (L2 evicted), warm = each preceded by a
     ~20 us spin kernel.
Formulas (R = b * s_q query tokens, V = the valid indices of all tokens = R * TOPK here, t = op cold):
  TFLOP/s = 2 * h_q * V * (576 + 512) / t        (QK^T over 576 dims, PV over 512)
  GB/s    = (V * e + R * h_q * (576 + 512) * 2) / t   (listed cache rows + q + out; e = 1152 bytes per
            bf16 row, 656 per ds_mla_fp8 row: the bytes the cache holds)

--kv-format ds_mla_fp8: the same values in DeepSeek-V3.2's 656-byte FP8 rows (quantize_ds_mla_fp8);
the reference reads the dequantised rows.

--dense (bf16): also time the dense decode kernel (mla_decode) on the same rows: each query token's
listed keys copied in order to pages of its own, 2048 keys per token, so the same FLOPs and bytes; the
table gives its time over the attention's (the sparse rate as a fraction of the dense one).

--kernels K1,K2: also time the attention alone with each named split kernel forced (the decode op's
private split_kernel; metadata.DECODE_KERNELS) where it can run the config: an A/B of kernels in one run.

--flashmla-module MOD: also time FlashMLA on the same data, where it imports and runs (the h_q it
supports), checked like ours: bf16 cache: MOD.flash_mla_sparse_fwd(q [R, h_q, 576], kv [slots, 1, 576],
indices [R, 1, topk], scale) (its sparse prefill kernel); ds_mla_fp8: MOD.flash_mla_with_kvcache(q, the
same rows as float8_e4m3fn [pages, 64, 1, 656], indices=..., is_fp8_kvcache=True) (its sparse decode
kernel). A build you made yourself: no peer code or binary belongs in this repository.

The run's ceilings (HBM streaming read, bf16 8192^3 matmul) are measured first.

Outputs: <out>/bench_sparse[_ds_mla_fp8].json and .md (the markdown table, printed last).
usage: python benchmarks/bench_sparse.py [--quick] [--only h128_s1,...] [--out DIR] [--rep-ms 100]
                                         [--kv-format bf16|ds_mla_fp8] [--flashmla-module flash_mla]
                                         [--kernels rows64,narrow16] [--dense]
"""
import argparse
import importlib
import json
import math
import os
import time
import traceback

import torch

from _timing import GraphTimer, capture, measure_ceilings, nvml_sample, smi

D_QK, D_V = 576, 512
PAGE = 64
TOPK = 2048
CONTEXT = 8192  # tokens of context per request, the top-k are drawn from
SCALE = 1.0 / math.sqrt(192.0)
REL_L2_TOL, LSE_TOL = 2e-2, 1e-2
CHECK_ROWS = 8  # query tokens checked against the float64 reference


def log(*a):
    print(*a, flush=True)


def configs(quick, only):
    cs = [dict(name=f"h{h}_s{s}_b{b}", h_q=h, s_q=s, b=b)
          for h in (16, 32, 64, 128) for s in (1, 2) for b in (1, 32, 128)]
    if quick:
        cs = [c for c in cs if c["h_q"] in (16, 128) and c["s_q"] == 1 and c["b"] in (1, 128)]
    if only:
        keys = only.split(",")
        cs = [c for c in cs if any(k in c["name"] for k in keys)]
    return cs


def make_problem(c, seed, kv_format, dev="cuda"):
    """Made on the device: a batch of 128 owns 1.2 GB of cache (bf16). kv: the cache the op reads;
    kv_ref: its values, for the reference."""
    g = torch.Generator(device=dev).manual_seed(seed)
    b, s_q, h_q = c["b"], c["s_q"], c["h_q"]
    pages_per_req = CONTEXT // PAGE
    num_pages = b * pages_per_req
    perm = torch.randperm(num_pages, generator=g, device=dev).reshape(b, pages_per_req)
    kv = torch.randn(num_pages, PAGE, D_QK, generator=g, device=dev).to(torch.bfloat16)
    # TOPK distinct positions per query token: the first TOPK of a random order of the context
    pos = torch.rand(b * s_q, CONTEXT, generator=g, device=dev).argsort(dim=1)[:, :TOPK].reshape(b, s_q, TOPK)
    slots = perm[torch.arange(b, device=dev)[:, None, None], pos // PAGE] * PAGE + pos % PAGE
    q = torch.randn(b, s_q, h_q, D_QK, generator=g, device=dev).to(torch.bfloat16)
    kv_ref = kv
    if kv_format == "ds_mla_fp8":
        import mla_attn
        rows = mla_attn.quantize_ds_mla_fp8(kv[..., :D_V].reshape(-1, D_V), kv[..., D_V:].reshape(-1, D_QK - D_V))
        kv, kv_ref = rows.view(num_pages, PAGE, -1), mla_attn.dequantize_ds_mla_fp8(rows).view(num_pages, PAGE, D_QK)
    return dict(q=q, kv=kv, kv_ref=kv_ref, indices=slots.int())


def check(p, out, lse, attn_sink=None):
    from mla_attn.reference import mla_sparse_ref
    h_q = p["q"].shape[-2]
    q = p["q"].reshape(-1, h_q, D_QK)[:CHECK_ROWS]
    idx = p["indices"].reshape(-1, TOPK)[:CHECK_ROWS]
    ref_out, ref_lse = mla_sparse_ref(q, p["kv_ref"], idx, softmax_scale=SCALE, attn_sink=attn_sink)
    o = out.reshape(-1, h_q, D_V)[:CHECK_ROWS].double()
    l = lse.reshape(-1, h_q)[:CHECK_ROWS].double()
    rel = ((o - ref_out).norm() / ref_out.norm()).item()
    lse_err = (l - ref_lse).abs().max().item()
    ok = bool(torch.isfinite(o).all()) and rel < REL_L2_TOL and lse_err < LSE_TOL
    return dict(ok=ok, rel_l2=rel, lse_err=lse_err)


def check_op(p, op, out, res):
    """Checks op() (which writes out and returns (out, lse)) against the reference: an eager call, then a
    CUDA-graph replay into a NaN-poisoned out (res["check_eager"], res["check_graph"]). Returns the
    graph and the eager call's lse."""
    _, lse = op()
    res["check_eager"] = check(p, out, lse)
    graph, (_, lse_graph) = capture(op)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    res["check_graph"] = check(p, out, lse_graph)
    return graph, lse


def flashmla_peer(flashmla, q, kv, idx, kv_format):
    """FlashMLA on the same data: a callable returning (out, lse) shaped like ours after a reshape.
    bf16: its sparse prefill kernel, one query token per row; ds_mla_fp8: its sparse decode kernel on
    the same 656-byte rows (float8_e4m3fn [pages, 64, 1, 656])."""
    if kv_format == "bf16":
        rows = q.shape[0] * q.shape[1]
        q_tok, kv_rows, idx_tok = q.reshape(rows, q.shape[2], D_QK), kv.view(-1, 1, D_QK), idx.reshape(rows, 1, TOPK)

        def sparse_prefill():
            out, _, lse = flashmla.flash_mla_sparse_fwd(q_tok, kv_rows, idx_tok, SCALE)[:3]  # out, max_logits, lse
            return out, lse
        return sparse_prefill
    meta, _ = flashmla.get_mla_metadata()  # planned by the first call, then reused
    k_cache = kv.view(torch.float8_e4m3fn).unsqueeze(-2)

    def sparse_decode():
        out, lse = flashmla.flash_mla_with_kvcache(q, k_cache, None, None, D_V, meta, None, softmax_scale=SCALE,
                                                   is_fp8_kvcache=True, indices=idx)
        return out, lse.transpose(1, 2)  # lse [b, h_q, s_q] -> token-major like ours
    return sparse_decode


def run_config(c, timer, rep_ms, flashmla, kv_format, kernels=(), dense=False):
    import mla_attn
    p = make_problem(c, seed=c["h_q"] * 100 + c["s_q"] * 10 + c["b"], kv_format=kv_format)
    q, kv, idx = p["q"], p["kv"], p["indices"]
    res = dict(c)
    out = torch.full(q.shape[:-1] + (D_V,), float("nan"), dtype=q.dtype, device=q.device)

    def op():
        return mla_attn.mla_sparse_decode(q, kv, idx, softmax_scale=SCALE, out=out, return_lse=True)

    g_op, lse = check_op(p, op, out, res)

    md = mla_attn.get_sparse_decode_metadata(idx, c["h_q"])
    g_layer, _ = capture(lambda: mla_attn.mla_sparse_decode(q, kv, idx, softmax_scale=SCALE, out=out, metadata=md))
    # The layer with an attention sink per head, spread over the rows' lse (~9 here): factors from ~1 to ~0.
    sink = torch.linspace(0.0, 12.0, c["h_q"], device=q.device)
    out_sink = torch.full_like(out, float("nan"))

    def layer_sink():
        return mla_attn.mla_sparse_decode(q, kv, idx, softmax_scale=SCALE, attn_sink=sink, out=out_sink, metadata=md,
                                          return_lse=True)
    _, lse_sink = layer_sink()
    res["check_sink"] = check(p, out_sink, lse_sink, sink)
    g_sink, _ = capture(layer_sink)
    out_valid = torch.full_like(out, float("nan"))

    def layer_valid():
        return mla_attn.mla_sparse_decode(q, kv, idx, softmax_scale=SCALE, out=out_valid, metadata=md,
                                          indices_valid=True, return_lse=True)
    _, lse_valid = layer_valid()
    res["check_valid"] = check(p, out_valid, lse_valid)
    g_valid, _ = capture(layer_valid)
    # The attention alone: the decode op over slots compacted once (what mla_sparse_decode runs last).
    rows = c["b"] * c["s_q"]
    slots, counts = torch.ops.mla_attn.compact_sparse_indices(idx.reshape(rows, TOPK), None, kv.shape[0] * kv.shape[1])
    q_rows, dec = q.reshape(rows, 1, c["h_q"], D_QK), md.decode

    def attention(kernel=None):
        o, l = torch.ops.mla_attn.mla_decode(q_rows, None, kv, slots, counts, None, 1, SCALE, False, dec.tile_sched,
                                             dec.req_splits, dec.num_sm_parts, split_kernel=kernel, kv_slots=True)
        return o.view(out.shape), l.view(lse.shape)

    o_a, l_a = attention()
    res["check_attn"] = check(p, o_a, l_a)
    g_attn, _ = capture(attention)
    graphs, names = [g_op, g_layer, g_sink, g_valid, g_attn], ["op", "layer", "layer_sink", "layer_valid", "attn"]
    for kernel in kernels:  # the attention alone with this kernel forced, checked like the op
        def forced(kernel=kernel):
            return attention(kernel)
        try:
            o_k, lse_k = forced()
            res[f"check_{kernel}"] = check(p, o_k, lse_k)
            g_k, _ = capture(forced)
        except (ValueError, RuntimeError) as e:  # the kernel cannot run this config
            res[f"{kernel}_error"] = str(e)[:200]
            continue
        graphs.append(g_k)
        names.append(f"attn_{kernel}")

    if dense:  # the dense kernel over the same rows: each token's listed keys copied to pages of its own
        table = torch.arange(rows * (TOPK // PAGE), device=q.device, dtype=torch.int32).view(rows, TOPK // PAGE)
        kv_dense = kv.view(-1, D_QK)[idx.reshape(rows, TOPK).long()].view(-1, PAGE, D_QK)
        lens = torch.full((rows,), TOPK, device=q.device, dtype=torch.int32)
        md_dense = mla_attn.get_decode_metadata(lens, c["h_q"], s_q=1, causal=False)
        out_dense = torch.full((rows, 1, c["h_q"], D_V), float("nan"), dtype=q.dtype, device=q.device)

        def dense_decode():
            return mla_attn.mla_decode(q_rows, kv_dense, table, lens, softmax_scale=SCALE, causal=False,
                                       metadata=md_dense, out=out_dense, return_lse=True)
        o_d, l_d = dense_decode()
        res["check_dense"] = check(p, o_d, l_d)
        g_dense, _ = capture(dense_decode)
        graphs.append(g_dense)
        names.append("dense")

    if flashmla is not None:
        try:
            fm = flashmla_peer(flashmla, q, kv, idx, kv_format)
            o, l = fm()
            res["flashmla_check"] = check(p, o.reshape(out.shape), l.reshape(lse.shape))
            g_fm, _ = capture(fm)
            graphs.append(g_fm)
            names.append("flashmla")
        except Exception as e:  # a peer that cannot run the config is reported, not fatal
            res["flashmla_error"] = repr(e)[:300]

    for name, t in zip(names, timer.time_interleaved(graphs, rep_ms)):
        res[name] = t
    valid = rows * TOPK
    t_s = res["op"]["cold_us"] * 1e-6
    res["tflops"] = 2 * c["h_q"] * valid * (D_QK + D_V) / t_s / 1e12
    row_bytes = kv.shape[-1] * kv.element_size()
    res["gbps"] = (valid * row_bytes + rows * c["h_q"] * (D_QK + D_V) * 2) / t_s / 1e9
    res["nvml"] = nvml_sample()
    return res


def table(results, with_fm, kernels=(), with_dense=False):
    head = ["config", "ok", "op cold us", "op warm us", "layer cold us", "layer+sink cold us",
            "layer indices_valid cold us", "attn cold us", "TFLOP/s", "GB/s"]
    head += [f"attn {k} cold us" for k in kernels]
    if with_dense:
        head += ["dense cold us", "attn rate / dense"]
    if with_fm:
        head += ["FMLA cold us", "x FMLA op", "x FMLA layer", "x FMLA attn"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:60]} |" + " |" * (len(head) - 2))
            continue
        ok = all(r[k]["ok"] for k in ("check_eager", "check_graph", "check_attn", "check_sink", "check_valid"))
        row = [r["name"], "ok" if ok else "FAIL", f"{r['op']['cold_us']:.1f}", f"{r['op']['warm_us']:.1f}",
               f"{r['layer']['cold_us']:.1f}", f"{r['layer_sink']['cold_us']:.1f}",
               f"{r['layer_valid']['cold_us']:.1f}", f"{r['attn']['cold_us']:.1f}", f"{r['tflops']:.1f}",
               f"{r['gbps']:.0f}"]
        for k in kernels:
            t = r.get(f"attn_{k}")
            row.append("-" if t is None else f"{t['cold_us']:.1f}" + ("" if r[f"check_{k}"]["ok"] else " (FAIL)"))
        if with_dense:
            d = r["dense"]
            row += [f"{d['cold_us']:.1f}" + ("" if r["check_dense"]["ok"] else " (FAIL)"),
                    f"{d['cold_us'] / r['attn']['cold_us']:.2f}"]
        if with_fm:
            fm = r.get("flashmla")
            fm_ok = fm and r["flashmla_check"]["ok"]
            row += ([f"{fm['cold_us']:.1f}" + ("" if fm_ok else " (FAIL)")] +
                    [f"{fm['cold_us'] / r[k]['cold_us']:.2f}" for k in ("op", "layer", "attn")]) if fm else ["-"] * 4
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--kv-format", choices=("bf16", "ds_mla_fp8"), default="bf16")
    ap.add_argument("--flashmla-module", default=None, help="import path of a FlashMLA build (flash_mla)")
    ap.add_argument("--kernels", default="", help="split kernels to force in extra attention timings")
    ap.add_argument("--dense", action="store_true", help="bf16: also time the dense kernel on the same rows")
    args = ap.parse_args()
    dense = args.dense and args.kv_format == "bf16"
    kernels = tuple(k for k in args.kernels.split(",") if k)

    flashmla = None
    if args.flashmla_module:
        try:
            flashmla = importlib.import_module(args.flashmla_module)
        except Exception as e:
            log(f"--flashmla-module {args.flashmla_module}: import failed ({e!r}); running without it")
    timer = GraphTimer()
    ceilings = measure_ceilings()
    log(f"ceilings: read {ceilings['read_TBps']:.2f} TB/s, bf16 matmul {ceilings['mm8192_bf16_TFLOPs']:.0f} TFLOP/s")
    results = []
    t0 = time.time()
    for c in configs(args.quick, args.only):
        try:
            results.append(run_config(c, timer, args.rep_ms, flashmla, args.kv_format, kernels, dense))
            r = results[-1]
            ok = all(r[k]["ok"] for k in ("check_eager", "check_graph", "check_attn", "check_sink")) and all(
                r[f"check_{k}"]["ok"] for k in kernels + ("dense",) if f"check_{k}" in r)
            peer = f", flashmla {r['flashmla']['cold_us']:.1f} us" if "flashmla" in r else ""
            log(f"{c['name']}: op {r['op']['cold_us']:.1f} us cold, layer {r['layer']['cold_us']:.1f} us, "
                f"layer_valid {r['layer_valid']['cold_us']:.1f} us, attn {r['attn']['cold_us']:.1f} us{peer}, "
                f"{r['tflops']:.1f} TFLOP/s, {r['gbps']:.0f} GB/s, ok={ok}")
        except Exception as e:
            traceback.print_exc()
            results.append(dict(c, error=repr(e)[:300]))
        torch.cuda.empty_cache()
    md = table(results, flashmla is not None, kernels, dense)
    meta = dict(gpu=torch.cuda.get_device_name(), smi=smi(), torch=torch.__version__, topk=TOPK, page=PAGE,
                context=CONTEXT, kv_format=args.kv_format, ceilings=ceilings, seconds=round(time.time() - t0, 1))
    stem = "bench_sparse" if args.kv_format == "bf16" else f"bench_sparse_{args.kv_format}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(f"# mla_sparse_decode, top-k {TOPK}, {args.kv_format} cache, page {PAGE} ({meta['gpu']})\n\n"
                f"Ceilings (this run): HBM read {ceilings['read_TBps']:.2f} TB/s; bf16 matmul 8192^3 "
                f"{ceilings['mm8192_bf16_TFLOPs']:.0f} TFLOP/s\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
