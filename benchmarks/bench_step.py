#!/usr/bin/env python3
"""What an engine sees per step: one MLAAttention decode step on one Hopper GPU, with the attention call
swapped for FlashMLA's and FlashInfer's in the same harness.

For every config (heads h_q, batch b, context L):
  1. one MLAAttention layer with DeepSeek-V3 dims (hidden 7168, q_lora_rank 1536, kv_lora_rank 512,
     nope/rope/v 128/64/128, bf16, random unit-gain weights) and bench_decode.py's problem: a paged bf16
     latent cache (page 64, pages permuted) holding L keys per request, the last one this step's token;
  2. one step = MLAAttention.forward on b new tokens (s_q 1): projections and norms, RoPE, the cache
     write of the new tokens' latents, absorbed q (q_nope W_UK), attention, W_UV, o_proj; the decode
     schedule is made once per step outside the layer (MLABatch, shared by the 61 layers of a model);
  3. peers: the same forward with its attention call (mla_decode) replaced by bench_decode.py's
     FlashMLA adapter (flash_mla_with_kvcache on the same cache and block table; --flashmla, else an
     installed flash_mla) and FlashInfer adapter (BatchMLAPagedAttentionWrapper, backend fa3, planned
     once per step OUTSIDE the graph: plan() is host work); q reaches them packed [q_nope W_UK | q_pe]
     in one [b, 1, h, 576] buffer, the concatenation engines do for them. A peer that does not import
     is skipped;
  4. checks every variant's step output against the eager mla_attn step (rel-L2 < 2e-2, finite): an
     eager call with the peers' q buffer NaN-poisoned, then a CUDA-graph replay with the step output
     and that buffer NaN-poisoned;
  5. times the step graphs with _timing.GraphTimer (cold: L2 flushed before each replay; warm: a
     spin; all variants of a config interleaved), and the per-step metadata of each variant:
       mla_attn:   get_decode_metadata's GPU time (20 calls in one CUDA graph / 20);
       FlashMLA:   its first call of a step (fresh FlashMLASchedMeta: it computes the schedule inside
                   the call) minus a later call, both as step graphs;
       FlashInfer: host time of plan() (median of 20 calls).
µs/layer = step cold µs + metadata µs / 61; a 61-layer step spends 61 x µs/layer = 61 cold + metadata.

Outputs: <out>/bench_step.json and <out>/bench_step.md (markdown table printed last).

usage: python benchmarks/bench_step.py [--heads 128,16] [--batches 1,32,128] [--contexts 4096,16384]
                                       [--out DIR] [--flashmla SO:PKG_ROOT] [--no-flashinfer]
                                       [--rep-ms 50] [--time-budget-s 120]
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
import zlib

import torch

import bench_decode as bd
from _timing import GraphTimer, capture, nvml_sample, smi
from mla_attn import MLAAttention, MLABatch, MLAConfig, get_decode_metadata

LAYERS = 61                      # DeepSeek-V3's decoder layers: each runs one MLA attention per step
HIDDEN, Q_LORA_RANK = 7168, 1536
REL_L2_TOL = 2e-2
OURS, FMLA, FMLA_FIRST, FI = "mla_attn", "flashmla", "flashmla_first_call", "flashinfer_fa3"
PEERS = (FMLA, FI)


# ----------------------------------------------------------------------------------------------
# the layer and one decode step (device-agnostic: a CPU check can run them with small shapes)
# ----------------------------------------------------------------------------------------------
def dsv3_config(heads: int, max_position: int, hidden: int = HIDDEN, q_lora_rank: int = Q_LORA_RANK) -> MLAConfig:
    """DeepSeek-V3's attention (kv_lora_rank, head dims: MLAConfig's defaults) without YaRN: YaRN changes
    the rotary values and the softmax scale, not the work, and the peers' adapters take bench_decode's
    scale 192^-0.5, which is then the layer's too."""
    return MLAConfig(hidden_size=hidden, num_heads=heads, q_lora_rank=q_lora_rank,
                     max_position_embeddings=max_position)


def build_layer(config: MLAConfig, device, seed: int = 0) -> MLAAttention:
    """Random unit-gain weights (as examples/serve_toy.py): activations and scores of order 1, so the
    rel-L2 check compares outputs of a realistic softmax, neither flat nor one-hot."""
    torch.manual_seed(seed)
    layer = MLAAttention(config, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, w in layer.named_parameters():
            unit = 1 + 0.1 * torch.randn_like(w) if "layernorm" in name else torch.randn_like(w) / math.sqrt(w.shape[1])
            w.copy_(unit)
    return layer.eval()


def make_step(layer: MLAAttention, c: dict, seed: int) -> dict:
    """The inputs of one decode step for config c (bench_decode.make_problem's cache and block table,
    on bench_decode.DEV): every request has L - 1 cached tokens and one new token, whose latent the
    step writes into slot L - 1. p["q"] [b, 1, h, 576] is the peers' q buffer."""
    p = bd.make_problem(c, seed)
    b, L = c["b"], c["L"]
    batch = MLABatch.build([1] * b, [L - 1] * b, p["table"], c["page"], bd.DEV, num_heads=c["h_q"])
    gen = torch.Generator(device=bd.DEV).manual_seed(seed + 1)
    x = torch.randn(b, layer.config.hidden_size, dtype=torch.bfloat16, device=bd.DEV, generator=gen)
    # the layer's cache [pages, page, 576] is a view of the peers' [pages, page, 1, 576]: one memory
    return dict(p=p, cache=p["kv"].squeeze(2), batch=batch, x=x)


def run_step(layer: MLAAttention, step: dict) -> torch.Tensor:
    with torch.no_grad():
        return layer(step["x"], step["cache"], step["batch"])


@contextlib.contextmanager
def attention_swapped(layer: MLAAttention, q_buf: torch.Tensor, attend):
    """Within the block, layer's decode path calls attend() instead of mla_decode: the absorbed q is
    written into q_buf [b, 1, h, 576] as [q_nope W_UK | q_pe], attend() returns (out [b, 1, h, 512], lse);
    the rest of the step is the layer's own code (MLAAttention._decode's two einsums included)."""
    d_v = layer.config.kv_lora_rank

    def decode(q_nope, q_pe, kv_cache, batch, k_scale, fp8_mma):
        T, h = q_nope.shape[:2]
        q = q_buf.view(T, h, -1)
        q[..., :d_v] = torch.einsum("thd,hdc->thc", q_nope, layer.w_uk)
        q[..., d_v:] = q_pe
        out = attend()[0]
        return torch.einsum("thc,hcv->thv", out.reshape(T, h, d_v), layer.w_uv)

    layer._decode = decode  # an instance attribute shadows the method for this layer only
    try:
        yield
    finally:
        del layer._decode


def swapped_step(layer: MLAAttention, step: dict, attend):
    def fn():
        with attention_swapped(layer, step["p"]["q"], attend):
            return run_step(layer, step)
    return fn


def flashmla_first_call(prep: dict):
    """attend() as the first layer of a step runs FlashMLA: on a fresh FlashMLASchedMeta, so the call
    computes the split schedule (a kernel of its own) before attending; the later layers reuse it.
    None for a FlashMLA whose get_mla_metadata returns the schedule itself (older interface)."""
    meta = prep["keep"][0]
    if not hasattr(meta, "have_initialized"):
        return None

    def attend():
        meta.have_initialized, meta.config, meta.tile_scheduler_metadata, meta.num_splits = False, None, None, None
        return prep["graph_fn"]()
    return attend


# ----------------------------------------------------------------------------------------------
# checks and per-step metadata
# ----------------------------------------------------------------------------------------------
def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.float(), ref.float()
    nonfinite = int((~torch.isfinite(o)).sum())
    rel = float((o - r).norm() / r.norm())
    return dict(nonfinite=nonfinite, rel_l2=rel, ok=nonfinite == 0 and rel < REL_L2_TOL)


def check_and_capture(fn, ref: torch.Tensor, poison=()):
    """fn() eagerly, then a CUDA graph of it replayed into its NaN-poisoned output; the tensors in
    poison (buffers fn writes before reading) are NaN-poisoned before each run. Returns (row, graph)."""
    for t in poison:
        t.fill_(float("nan"))
    eager = compare(fn(), ref)
    graph, out = capture(fn)
    for t in (out,) + tuple(poison):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replay = compare(out, ref)
    row = dict(eager_check=eager, graph_check=replay, rel_l2=max(eager["rel_l2"], replay["rel_l2"]),
               ok=eager["ok"] and replay["ok"])
    return row, graph


def ours_metadata(step: dict, c: dict) -> dict:
    """bench_decode.time_metadata on the schedule the layer reads (MLABatch's: varlen, causal)."""
    batch = step["batch"]
    schedule = types.SimpleNamespace(metadata=lambda p, c: get_decode_metadata(
        batch.decode_seq_lens, c["h_q"], cu_seqlens_q=batch.decode_cu_seqlens_q,
        max_seqlen_q=batch.max_decode_query_len, causal=True))
    return bd.time_metadata(schedule, step["p"], c)


def plan_host_us(fi: bd.FlashInferFA3, prep: dict, p: dict, iters: int = 20) -> float:
    """Median host time of FlashInfer's plan() for this batch (same inputs as the captured plan, so the
    graph captured afterwards replays the same plan)."""
    w, csr = prep["keep"]
    ts = []
    for _ in range(iters + 3):
        t = time.perf_counter()
        fi.plan(w, p, csr)
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts[3:])


# ----------------------------------------------------------------------------------------------
# one config
# ----------------------------------------------------------------------------------------------
def step_variants(layer, step, c, peers, row):
    """{name: (step fn, buffers to poison)} for every variant that could be set up; the peers' per-step
    metadata lands in row. A peer that fails here is recorded in row and left out."""
    fns = {OURS: (lambda: run_step(layer, step), ())}
    q_buf = (step["p"]["q"],)
    for name, peer in peers.items():
        try:
            prep = peer.prepare(step["p"], c)
            fns[name] = (swapped_step(layer, step, prep["graph_fn"]), q_buf)
            if name == FI:
                row[FI] = dict(md_host_us=plan_host_us(peer, prep, step["p"]))
            else:
                first = flashmla_first_call(peer.prepare(step["p"], c))
                if first is not None:
                    fns[FMLA_FIRST] = (swapped_step(layer, step, first), q_buf)
        except Exception:
            row[name] = dict(error=traceback.format_exc()[-2000:], ok=False)
            log(f"   {name} setup ERROR {row[name]['error'].strip().splitlines()[-1][:200]}")
    return fns


def per_layer(row):
    """µs/layer (cold, warm) and metadata µs/step per variant, from the timed graphs."""
    o = row[OURS]
    o["md_step_us"] = o["md_graph_us"]
    fm, first = row.get(FMLA), row.get(FMLA_FIRST)
    if fm and "cold_us" in fm:
        # FlashMLA schedules inside its first call of a step: that call minus a later one
        fm["md_step_us"] = max(0.0, first["cold_us"] - fm["cold_us"]) if first and "cold_us" in first else None
    fi = row.get(FI)
    if fi and "cold_us" in fi:
        fi["md_step_us"] = fi["md_host_us"]
    for name in (OURS,) + PEERS:
        r = row.get(name)
        if r and "cold_us" in r:
            md = r.get("md_step_us") or 0.0
            r["layer_cold_us"] = r["cold_us"] + md / LAYERS
            r["layer_warm_us"] = r["warm_us"] + md / LAYERS
            r["step61_ms"] = LAYERS * r["layer_cold_us"] / 1e3


def run_config(layer, c, peers, timer, rep_ms):
    row = dict(cfg=c["name"], h_q=c["h_q"], b=c["b"], L=c["L"], page=c["page"], rep_ms=rep_ms)
    step = make_step(layer, c, seed=zlib.crc32(c["name"].encode()) & 0x7FFFFFFF)
    ref = run_step(layer, step).clone()  # the eager mla_attn step: every variant's reference
    torch.cuda.synchronize()
    row[OURS] = ours_metadata(step, c)
    graphs = {}
    for name, (fn, poison) in step_variants(layer, step, c, peers, row).items():
        try:
            r, graphs[name] = check_and_capture(fn, ref, poison)
        except Exception:
            r = dict(error=traceback.format_exc()[-2000:], ok=False)
            torch.cuda.synchronize()
        row.setdefault(name, {}).update(r)
    times = timer.time_interleaved(list(graphs.values()), rep_ms)
    after = nvml_sample()
    for name, t in zip(graphs, times):
        row[name].update(t, nvml_after=after)
    per_layer(row)
    return row


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def log(*a):
    print(*a, flush=True)


def fmt(v, f="{:.1f}"):
    return "-" if v is None else f.format(v)


def best_peer(row):
    """(name, µs/layer) of the fastest correct peer of a row, or None."""
    done = [(n, row[n]["layer_cold_us"]) for n in PEERS if (row.get(n) or {}).get("ok") and "layer_cold_us" in row[n]]
    return min(done, key=lambda nt: nt[1]) if done else None


def peer_cell(r):
    if not r:
        return "-"
    if "layer_cold_us" not in r:
        return "ERR"
    return fmt(r["layer_cold_us"]) + ("" if r.get("ok") else " FAIL")


def table_row(row):
    o, best = row[OURS], best_peer(row)
    ours = o.get("layer_cold_us")
    md = " / ".join(fmt((row.get(n) or {}).get("md_step_us")) for n in (OURS,) + PEERS)
    cells = [row["cfg"], "ok" if o.get("ok") else "FAIL", fmt(ours), fmt(o.get("layer_warm_us")),
             peer_cell(row.get(FMLA)), peer_cell(row.get(FI))]
    if best and ours:
        cells += [f"{best[1] / ours:.2f}", md, f"{LAYERS * ours / 1e3:.2f} / {LAYERS * best[1] / 1e3:.2f}",
                  f"{LAYERS * (best[1] - ours) / 1e3:+.2f}"]
    else:
        cells += ["-", md, f"{fmt(o.get('step61_ms'), '{:.2f}')} / -", "-"]
    return "| " + " | ".join(cells) + " |"


def write_outputs(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_step.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    info = results["info"]
    lines = [f"# mla_attn decode step benchmark ({info.get('gpu')}, torch {info.get('torch')}, "
             f"FlashInfer {info.get('flashinfer', 'n/a')}, FlashMLA {info.get('flashmla', 'n/a')})", "",
             "One decode step of one `MLAAttention` layer, DeepSeek-V3 dims (hidden 7168, q_lora 1536, kv_lora 512, "
             "nope/rope/v 128/64/128, bf16, random weights), b requests with one new token each and L keys "
             "(L - 1 cached + the new one) in a paged bf16 latent cache (page 64, pages permuted): projections, "
             "RoPE, cache write, absorbed q, attention, W_UV, o_proj, captured in a CUDA graph. "
             "FMLA / FI: the same step with the attention call (`mla_decode`) replaced by FlashMLA's "
             "`flash_mla_with_kvcache` / FlashInfer's `BatchMLAPagedAttentionWrapper` (fa3) on the same cache "
             "and block table, q packed [q_nope·W_UK | q_pe] for them.", "",
             "cold/warm: median µs of step-graph replays, L2 flushed (512 MB read) / a ~20 µs spin before each. "
             "md = the per-step metadata, made once for all 61 layers: mla_attn = `get_decode_metadata` GPU time "
             "(20 calls in a graph / 20); FMLA = first call of a step (schedules on a fresh FlashMLASchedMeta) − "
             "a later call, cold; FI = host time of `plan()` (outside the graph, once per step). "
             f"µs/layer = cold + md/{LAYERS}. x best peer = fastest correct peer µs/layer / mla_attn µs/layer "
             f"(> 1: mla_attn faster); it is also the speed-up of a {LAYERS}-layer step's attention, "
             f"{LAYERS} × µs/layer = {LAYERS}·cold + md (ms columns); saved = best peer − mla_attn per step "
             "(the rest of the step, MoE and communication, is not run here). "
             f"ok: step output finite and rel-L2 < {REL_L2_TOL} against the eager mla_attn step (eager call and "
             "graph replay, outputs and the peers' q buffer NaN-poisoned first).", "",
             "| config | ok | mla_attn µs/layer | warm | FMLA µs/layer | FI µs/layer | x best peer "
             f"| md µs/step (mla_attn / FMLA / FI) | {LAYERS} layers ms (mla_attn / best peer) | saved ms/step |",
             "|---" * 10 + "|"]
    lines += [table_row(row) for row in results["rows"]]
    ratios = [best_peer(r)[1] / r[OURS]["layer_cold_us"] for r in results["rows"]
              if best_peer(r) and r[OURS].get("layer_cold_us")]
    lines.append("")
    lines.append(f"Correct: {sum(1 for r in results['rows'] if r[OURS].get('ok'))}/{len(results['rows'])} configs.")
    if ratios:
        lines.append(f"Geo-mean x best peer: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} "
                     f"over {len(ratios)} configs.")
    if results["errors"]:
        lines += ["", "Errors: " + "; ".join(f"{k}: {str(v).strip().splitlines()[-1][:160]}"
                                             for k, v in results["errors"])]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "bench_step.md"), "w") as f:
        f.write(text)
    return text


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def load_peers(args, results):
    """{name: adapter} of the peers that import (bench_decode.py's adapters; run_all.py's for an installed
    flash_mla when --flashmla is not given); the others are skipped with a message."""
    loaders = {FMLA: (lambda: bd.FlashMLA(args.flashmla)) if args.flashmla else _installed_flashmla}
    if not args.no_flashinfer:
        loaders[FI] = bd.FlashInferFA3
    peers = {}
    for name, load in loaders.items():
        try:
            peers[name] = load()
            version = getattr(peers[name], "version", "?")
            results["info"]["flashinfer" if name == FI else "flashmla"] = version
            log(f"{name} {version} loaded")
        except Exception as e:
            results["errors"].append((f"{name}_import", traceback.format_exc()[-1500:]))
            log(f"{name} not importable, running without it: {e!r}")
    return peers


def _installed_flashmla():
    import run_all
    return run_all.FlashMLA()


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x]


def configs(args):
    return [dict(name=f"h{h}_b{b}_L{L}", h_q=h, s_q=1, b=b, L=L, page=bd.PAGE)
            for h in _ints(args.heads) for b in _ints(args.batches) for L in _ints(args.contexts)]


def run(args):
    t0 = time.time()
    if not torch.cuda.is_available():
        sys.exit("bench_step.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                smi_before=smi(), args=vars(args), python=sys.version.split()[0])
    results = dict(info=info, rows=[], errors=[])
    peers = load_peers(args, results)
    timer = GraphTimer()
    cfgs = configs(args)
    n_graphs = 1 + len(peers) + (FMLA in peers)  # FlashMLA adds its first-call graph
    max_position = max(c["L"] for c in cfgs)
    layer = None
    for ci, c in enumerate(cfgs):
        left = args.time_budget_s - (time.time() - t0)
        if left < -0.5 * args.time_budget_s:
            log(f"time budget exhausted: skipping {c['name']} and the rest")
            results["errors"].append(("budget", f"skipped from {c['name']} ({len(cfgs) - ci} configs)"))
            break
        # keep ~half the remaining budget for data, checks and captures; split the rest over timings
        rep_ms = max(10.0, min(args.rep_ms, max(left, 0.0) * 1e3 * 0.5 / (len(cfgs) - ci) / (2 * n_graphs)))
        if layer is None or layer.config.num_heads != c["h_q"]:
            layer = None
            torch.cuda.empty_cache()
            layer = build_layer(dsv3_config(c["h_q"], max_position), "cuda")
        log(f"[{ci + 1}/{len(cfgs)}] {c['name']} rep_ms {rep_ms:.0f} t+{time.time() - t0:.0f}s")
        try:
            row = run_config(layer, c, peers, timer, rep_ms)
        except Exception:
            results["errors"].append((c["name"], traceback.format_exc()[-1500:]))
            log(traceback.format_exc())
            torch.cuda.empty_cache()
            continue
        for name in (OURS, FMLA, FMLA_FIRST, FI):
            r = row.get(name)
            if r and "cold_us" in r:
                log(f"   {name:20s} {'ok  ' if r['ok'] else 'FAIL'} relL2 {r['rel_l2']:.1e} | step cold "
                    f"{r['cold_us']:8.1f} us warm {r['warm_us']:8.1f} us ({r['reps']} reps)")
            elif r and "error" in r:
                log(f"   {name:20s} ERROR {r['error'].strip().splitlines()[-1][:200]}")
        results["rows"].append(row)
        torch.cuda.empty_cache()
        write_outputs(results, args.out)
    info["smi_after"] = smi()
    info["elapsed_s"] = time.time() - t0
    text = write_outputs(results, args.out)
    log(f"\nwrote {args.out}/bench_step.json and bench_step.md in {info['elapsed_s']:.0f}s\n")
    log(text)
    return results


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="128,16", help="query heads per GPU (16 = 128 under TP 8)")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="4096,16384", help="keys per request, the new token included")
    ap.add_argument("--out", default=os.path.join(here, "results"))
    ap.add_argument("--flashmla", default="", metavar="SO:PKG_ROOT",
                    help="FlashMLA build to swap in (as bench_decode.py); default: an installed flash_mla")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=50.0, help="timing budget per mode per graph (ms)")
    ap.add_argument("--time-budget-s", type=float, default=120.0,
                    help="whole-run budget: rep-ms is scaled down when it runs short; configs still left "
                         "at 1.5x the budget are skipped")
    results = run(ap.parse_args())
    sys.exit(0 if results["rows"] and all(r[OURS].get("ok") for r in results["rows"]) else 1)


if __name__ == "__main__":
    main()
