#!/usr/bin/env python3
"""Plots from the benchmark JSON files (needs matplotlib: `pip install mla_attn[plot]`;
run it wherever the JSON lands).

    python benchmarks/plot_results.py benchmarks/results/run_all.json [more.json ..] [--out DIR]

Accepts run_all.json (decode + prefill), bench_decode.json, bench_prefill.json, bench_cp_decode.json,
bench_sparse[_ds_mla_fp8].json and bench_sparse_prefill.json, and writes PNGs into --out (default: the
first file's folder):
  decode_us.png        cold us vs context, one panel per head count, a line per (batch, s_q), mla_attn
                       solid and every peer of the same run dashed / dotted;
  decode_roofline.png  % of roofline vs context, same layout;
  prefill_tflops.png   TFLOP/s vs tokens per request, one panel per head count, mla_attn solid and cuDNN
                       SDPA dashed, a color per (causal, k layout);
  cp_decode.png        context-parallel speed-up over one GPU vs context, one panel per head count;
  sparse_decode_<kv format>.png
                       top-k decode, cold us per layer vs batch, one panel per head count, a color per
                       s_q: mla_attn solid, FlashMLA dashed (FP8: its sparse decode kernel, at h_q 16 / 32
                       its h_q 64 time, as engines pad the heads for it; bf16: its sparse prefill kernel),
                       the dense kernel on the same rows dotted (bf16);
  sparse_prefill_tflops.png
                       sparse prefill TFLOP/s vs tokens, a color per head count, mla_attn solid and
                       FlashMLA dashed.
% of roofline = max(bytes / time / HBM read ceiling, flops / time / bf16 matmul ceiling), the ceilings
measured in the same run (bench_decode's "ceilings").

Rows are read as the benchmarks write them: decode {h_q, s_q, b, L, page, bytes, flops, <kernel>: {cold_us,
ok}} with "ours" = mla_attn (bench_decode.py); prefill {h, n, causal, k, tflops, cudnn_tflops}
(bench_prefill.py); CP {h_q, b, L, speedup} (bench_cp_decode.py); sparse decode {h_q, s_q, b, layer,
flashmla?, dense?: {cold_us}} and sparse prefill {h_q, tokens, tflops, flashmla_tflops?} under "results",
with "meta" (bench_sparse.py, bench_sparse_prefill.py).
"""
import argparse
import json
import os

OURS = "ours"
STYLES = ("--", ":", "-.")


def load(path):
    """-> dict(decode=, prefill=, cp=, sparse=, sparse_prefill=): each the file's results or None."""
    with open(path) as f:
        d = json.load(f)
    res = dict(decode=None, prefill=None, cp=None, sparse=None, sparse_prefill=None)
    if "decode" in d or "prefill" in d:  # run_all.json
        res.update(decode=d.get("decode"), prefill=d.get("prefill"), cp=d.get("cp"))
    elif "results" in d:  # bench_sparse.py, bench_sparse_prefill.py
        res["sparse_prefill" if "tokens" in (d["results"] or [{}])[0] or "kv_rows" in d.get("meta", {})
            else "sparse"] = d
    elif "speedup" in (d.get("rows") or [{}])[0]:
        res["cp"] = d
    elif "prefill" in os.path.basename(path):
        res["prefill"] = d
    else:
        res["decode"] = d
    return res


def kernels(row):
    """Kernel names of a row with a time: 'ours' first, then the peers in file order."""
    names = [k for k, v in row.items() if isinstance(v, dict) and v.get("cold_us")]
    return sorted(names, key=lambda k: k != OURS)


def label(kernel):
    return "mla_attn" if kernel == OURS else kernel


def roofline_pct(row, kernel, ceilings):
    """% of the roofline reached by `kernel` on a decode row (None without time or ceilings)."""
    us = (row.get(kernel) or {}).get("cold_us")
    if not us or not ceilings or not ceilings.get("read_TBps") or not ceilings.get("mm8192_bf16_TFLOPs"):
        return None
    bw = row["bytes"] / (us * 1e-6) / (ceilings["read_TBps"] * 1e12)
    fl = row["flops"] / (us * 1e-6) / (ceilings["mm8192_bf16_TFLOPs"] * 1e12)
    return 100.0 * max(bw, fl)


def _length(row):
    return row["L"] if isinstance(row["L"], int) else None  # "rand" lengths have no x position


def _panels(plt, heads, title):
    """One panel per head count, two per row."""
    cols = min(2, len(heads))
    rows = -(-len(heads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    fig.suptitle(title)
    axes = axes.ravel()
    for ax in axes[len(heads):]:
        ax.set_visible(False)
    return fig, dict(zip(heads, axes))


def _log_axes(ax, plt, log_y):
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
        for axis_set in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 60, not 6x10^1
            axis_set(plt.matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, out_dir, name):
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


def plot_decode(plt, res, out_dir):
    rows = [r for r in res["rows"] if _length(r) and r.get("page", 64) == 64 and kernels(r)]
    info, ceil = res.get("info", {}), res.get("ceilings")
    heads = sorted({r["h_q"] for r in rows})
    peers = sorted({k for r in rows for k in kernels(r)} - {OURS})
    where = f"{info.get('gpu', '?')}, page 64, bf16"
    paths = []
    for metric, ylabel, name in (("us", "cold µs (CUDA graph, L2 flushed)", "decode_us.png"),
                                 ("roof", "% of roofline", "decode_roofline.png")):
        if metric == "roof" and not ceil:
            print("no ceilings in this run: decode_roofline.png skipped")
            continue
        sub = "" if metric == "us" else (f"; ceilings {ceil['read_TBps']:.2f} TB/s, "
                                         f"{ceil['mm8192_bf16_TFLOPs']:.0f} TFLOP/s")
        fig, axes = _panels(plt, heads, f"MLA decode, {where}{sub}")
        for h, ax in axes.items():
            groups = sorted({(r["b"], r["s_q"]) for r in rows if r["h_q"] == h})
            colors = plt.cm.tab10(range(len(groups)))
            for (b, s_q), color in zip(groups, colors):
                pts = sorted((r for r in rows if (r["h_q"], r["b"], r["s_q"]) == (h, b, s_q)), key=_length)
                for k, style in zip([OURS] + peers, ("-",) + STYLES):
                    xy = [(_length(r), r[k]["cold_us"] if metric == "us" else roofline_pct(r, k, ceil))
                          for r in pts if (r.get(k) or {}).get("cold_us")]
                    if xy:
                        ax.plot(*zip(*xy), style, marker="o", ms=3, color=color,
                                label=f"b{b} s_q{s_q}" if k == OURS else None)
            _log_axes(ax, plt, log_y=metric == "us")
            if metric == "roof":
                ax.set_ylim(0, 100)
            ax.set_title(f"h_q = {h}")
            ax.set_xlabel("context (keys per request)")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7, title="solid: mla_attn; " + ", ".join(
                f"{s} {label(p)}" for p, s in zip(peers, STYLES)) if peers else None, title_fontsize=7)
        paths.append(_save(fig, out_dir, name))
    return paths


def _tflops_lines(ax, pts, x_key, series, color, tag):
    """A line per (row key, line style, name) of series: TFLOP/s against pts' x_key, one color."""
    for key, style, name in series:
        xy = [(r[x_key], r[key]) for r in pts if r.get(key)]
        if xy:
            ax.plot(*zip(*xy), style, marker="o", ms=3, color=color, label=f"{name} {tag}")


def _tflops_axes(ax, plt, ceil, xlabel):
    if ceil:
        ax.axhline(ceil, color="gray", lw=0.8)
    _log_axes(ax, plt, log_y=False)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7)


def plot_prefill(plt, res, out_dir):
    """bench_prefill.py rows: {h, n (tokens per request), causal, k, tflops, cudnn_tflops?} (warm graphs)."""
    rows = res["rows"]
    ceil = (res.get("ceilings") or {}).get("mm8192_bf16_TFLOPs")
    fig, axes = _panels(plt, sorted({r["h"] for r in rows}),
                        f"MLA prefill, {res.get('device', '?')}, bf16, 16k tokens per batch"
                        + (f"; bf16 matmul ceiling {ceil:.0f} TFLOP/s" if ceil else ""))
    for h, ax in axes.items():
        # a color per (causal, k layout); mla_attn solid, cuDNN SDPA (k192 only) dashed
        groups = sorted({(r["causal"], r["k"]) for r in rows if r["h"] == h})
        for (causal, k), color in zip(groups, plt.cm.tab10(range(len(groups)))):
            pts = sorted((r for r in rows if (r["h"], r["causal"], r["k"]) == (h, causal, k)), key=lambda r: r["n"])
            _tflops_lines(ax, pts, "n", (("tflops", "-", "mla_attn"), ("cudnn_tflops", "--", "cuDNN")), color,
                          f"{'causal' if causal else 'full'} {k}")
        _tflops_axes(ax, plt, ceil, "tokens per request")
        ax.set_title(f"h = {h}")
    return [_save(fig, out_dir, "prefill_tflops.png")]


def plot_cp(plt, res, out_dir):
    rows, info = res["rows"], res.get("info", {})
    heads = sorted({r["h_q"] for r in rows})
    fig, axes = _panels(plt, heads, f"Context-parallel decode over {info.get('world', 2)} GPUs vs one "
                                    f"({info.get('gpu', '?')}; all-gather and merge included)")
    for h, ax in axes.items():
        for b in sorted({r["b"] for r in rows if r["h_q"] == h}):
            xy = sorted((r["L"], r["speedup"]) for r in rows if (r["h_q"], r["b"]) == (h, b))
            ax.plot(*zip(*xy), marker="o", ms=3, label=f"b{b}")
        ax.axhline(1.0, color="gray", lw=0.8)
        _log_axes(ax, plt, log_y=False)
        ax.set_title(f"h_q = {h}")
        ax.set_xlabel("context (keys per request)")
        ax.set_ylabel("speed-up (one-GPU µs / CP µs)")
        ax.legend(fontsize=8)
    return [_save(fig, out_dir, "cp_decode.png")]


def _cold(row, key):
    return (row.get(key) or {}).get("cold_us")


def plot_sparse(plt, res, out_dir):
    """bench_sparse.py rows: per layer (schedule made once per step), FlashMLA on the same rows (FP8: its
    sparse decode kernel, h_q 64 / 128 only, so at h_q 16 / 32 its h_q 64 time stands in, as engines pad
    the heads for it; bf16: its sparse prefill kernel, every h_q), the dense kernel on the same rows (bf16,
    --dense)."""
    rows, meta = res["results"], res.get("meta", {})
    fmt = meta.get("kv_format", "bf16")
    if not rows:
        print(f"no rows in the sparse {fmt} results: skipped")
        return []
    by_cfg = {(r["h_q"], r["s_q"], r["b"]): r for r in rows}
    # bench_sparse.py's peer: FlashMLA's sparse decode kernel on the FP8 rows, its sparse prefill kernel
    # (one query token per row) on a bf16 cache
    peer_name = "FlashMLA" if fmt == "ds_mla_fp8" else "FlashMLA sparse prefill"
    fig, axes = _panels(plt, sorted({r["h_q"] for r in rows}),
                        f"Sparse (top-k {meta.get('topk', '?')}) decode, {meta.get('gpu', '?')}, {fmt} cache")
    for h, ax in axes.items():
        for s_q, color in zip(sorted({r["s_q"] for r in rows}), plt.cm.tab10(range(10))):
            pts = sorted((r for r in rows if (r["h_q"], r["s_q"]) == (h, s_q)), key=lambda r: r["b"])
            padded = fmt == "ds_mla_fp8" and h < 64
            peer = [by_cfg.get((64, s_q, r["b"]), {}) if padded else r for r in pts]
            for xy, style, name in (([(r["b"], _cold(r, "layer")) for r in pts], "-", "mla_attn"),
                                    ([(r["b"], _cold(p, "flashmla")) for r, p in zip(pts, peer)], "--",
                                     peer_name + (" (h_q 64, padded)" if padded else "")),
                                    ([(r["b"], _cold(r, "dense")) for r in pts], ":", "dense kernel, same rows")):
                xy = [(x, y) for x, y in xy if y]
                if xy:
                    ax.plot(*zip(*xy), style, marker="o", ms=3, color=color, label=f"{name} s_q {s_q}")
        _log_axes(ax, plt, log_y=True)
        ax.set_title(f"h_q = {h}")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("cold µs per layer (CUDA graph, L2 flushed)")
        ax.legend(fontsize=7)
    return [_save(fig, out_dir, f"sparse_decode_{fmt}.png")]


def plot_sparse_prefill(plt, res, out_dir):
    """bench_sparse_prefill.py rows: {h_q, tokens, tflops, flashmla_tflops?}."""
    rows, meta = res["results"], res.get("meta", {})
    if not rows:
        print("no rows in the sparse prefill results: skipped")
        return []
    ceil = (meta.get("ceilings") or {}).get("mm8192_bf16_TFLOPs")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.set_title(f"Sparse prefill (top-k {meta.get('topk', '?')}), {meta.get('gpu', '?')}, bf16"
                 + (f"; matmul ceiling {ceil:.0f} TFLOP/s" if ceil else ""), fontsize=9)
    for h, color in zip(sorted({r["h_q"] for r in rows}), plt.cm.tab10(range(10))):
        pts = sorted((r for r in rows if r["h_q"] == h), key=lambda r: r["tokens"])
        _tflops_lines(ax, pts, "tokens", (("tflops", "-", "mla_attn"), ("flashmla_tflops", "--", "FlashMLA")),
                      color, f"h_q {h}")
    _tflops_axes(ax, plt, ceil, "query tokens")
    return [_save(fig, out_dir, "sparse_prefill_tflops.png")]


def plot(paths, out_dir=None):
    import matplotlib  # optional dependency: imported only here
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = out_dir or os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for path in paths:
        res = load(path)
        for key, fn in (("decode", plot_decode), ("prefill", plot_prefill), ("cp", plot_cp),
                        ("sparse", plot_sparse), ("sparse_prefill", plot_sparse_prefill)):
            if res[key]:
                written += fn(plt, res[key], out_dir)
    plt.close("all")
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="result files")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: the first file's folder)")
    args = ap.parse_args()
    plot(args.json, args.out)


if __name__ == "__main__":
    main()
