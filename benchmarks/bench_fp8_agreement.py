#!/usr/bin/env python3
"""Greedy-token agreement of the FP8 KV cache (exact, and with e4m3 MMAs) with the bf16 cache, over
multi-step decoding of a small random DeepSeek-V3-like model.

Model: token embedding -> LAYERS x [RMSNorm -> MLAAttention -> residual -> RMSNorm -> gated SiLU MLP ->
residual] -> RMSNorm -> LM head. Attention dims are DeepSeek-V3's (q LoRA 1536, kv LoRA 512, nope 128,
rope 64, v 128, YaRN factor 40 with mscale 1, as examples/serve_toy.py) with a smaller hidden size
(2048) and vocabulary (4096); random unit-gain weights (as serve_toy) keep activations of order 1.

Method:
  1. BATCH requests with random prompts (lengths uniform in --prompt-len) are prefilled whole through
     the layers' prefill path (mla_prefill), each variant into its own paged cache (page 64):
       bf16     bf16 cache (the reference),
       fp8      float8_e4m3fn cache with k_scale, mla_decode exact (16-bit MMAs on dequantised keys),
       fp8_mma  the same cache, mla_decode(fp8_mma=True) (e4m3 Q and probabilities in the MMAs).
     k_scale, one per layer: a static scale calibrated on the prompts, amax / 448 of the rows the bf16
     run wrote to that layer's cache in its prefill (the largest prompt value maps to e4m3's largest;
     decode-time values beyond it saturate). The prefill itself reads no cache (no cached context), so
     its logits, and the first generated token, are the same in every variant.
  2. STEPS greedy decode steps, teacher-forced: every variant is fed the bf16 run's token, so each
     step compares the three models on the same history. Per decision (request x step) it records
     whether a variant's argmax equals bf16's, mean_v |logit_v - bf16 logit_v| / std_v(bf16 logits),
     and the bf16 top-1 margin (top1 - top2) / std(bf16 logits): how close the ties are.
  3. Free-running divergence: the first step at which a variant's own greedy sequence departs from
     bf16's. Until then its own tokens are bf16's, i.e. it has run exactly the teacher-forced steps,
     so that step is its first teacher-forced disagreement (no second run needed). Requests that never
     depart are counted as STEPS (the mean is then a lower bound) and reported separately.
The LM head runs in fp32: bf16 logits (8-bit mantissa) would tie near-equal tokens.

fp8_mma only changes the kernel above 16 query rows per request (heads x 1 new token > 16, i.e. the
default 128 heads; at --heads 16 only with --deterministic): else its row equals fp8's. It needs an
sm_90 GPU. --cpu-smoke runs tiny sizes through the ops' CPU implementations to exercise the script end
to end; those attend in fp32 whatever fp8_mma says, so there fp8_mma equals fp8 exactly and both differ
from bf16 by the cache's e4m3 rounding alone (which still flips some of the tiny model's near-ties).

Outputs: <out>/bench_fp8_agreement.{md,json} (bench_fp8_agreement_cpu_smoke.* with --cpu-smoke).
usage: python benchmarks/bench_fp8_agreement.py [--heads 128] [--layers 4] [--batch 32] [--steps 64]
           [--prompt-len 1024 4096] [--seed 0] [--deterministic] [--out DIR] [--cpu-smoke]
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import mla_attn
from mla_attn import MLAAttention, MLABatch, MLAConfig, YarnScaling
from mla_attn.layer import RMSNorm

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
PAGE = 64
VARIANTS = [("fp8", False), ("fp8_mma", True)]  # (name, fp8_mma), each against the bf16 reference
# model sizes and run defaults: the GPU run, and the CPU smoke test
FULL = dict(hidden=2048, vocab=4096, q_lora=1536, heads=128, layers=4, batch=32, steps=64,
            prompt_len=[1024, 4096], prefill_tokens=16384)
SMOKE = dict(hidden=256, vocab=512, q_lora=192, heads=4, layers=2, batch=4, steps=6,
             prompt_len=[16, 48], prefill_tokens=256)


class Block(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        h, ffn = cfg.hidden_size, 2 * cfg.hidden_size
        self.attn_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = MLAAttention(cfg, dtype=dtype)
        self.mlp_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, h, bias=False, dtype=dtype)

    def forward(self, x, kv_cache, batch, k_scale, fp8_mma):
        x = x + self.attn(self.attn_norm(x), kv_cache, batch, k_scale=k_scale, fp8_mma=fp8_mma)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ToyDeepSeek(nn.Module):
    def __init__(self, cfg, vocab, layers, dtype=torch.bfloat16):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, dtype) for _ in range(layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False, dtype=dtype)

    def forward(self, tokens, caches, batch, rows, k_scales, fp8_mma=False):
        """Logits (fp32) of the tokens `rows` of this step; every layer writes its own cache."""
        x = self.embed(tokens)
        for block, kv, k_scale in zip(self.layers, caches, k_scales):
            x = block(x, kv, batch, k_scale, fp8_mma)
        return F.linear(self.norm(x[rows].float()), self.lm_head.weight.float())


def init_weights(model, seed):
    """serve_toy's unit-gain init: norm weights 1 + 0.1 N(0, 1), embeddings N(0, 1), projections
    N(0, 1 / fan_in), so activations, attention scores and logits have std of order 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                w = 1 + 0.1 * w
            elif not name.startswith("embed"):
                w = w / math.sqrt(p.shape[1])
            p.copy_(w)
    model.requires_grad_(False)


def prefill_groups(lens, budget):
    """Requests in order, grouped into prefill calls of at most `budget` tokens (one request at least)."""
    groups, n = [[]], 0
    for b, L in enumerate(lens):
        if groups[-1] and n + L > budget:
            groups.append([])
            n = 0
        groups[-1].append(b)
        n += L
    return groups


def prefill(model, caches, k_scales, prompts, pages, budget, device):
    """Whole prompts through the prefill path (decode_threshold 1: every prompt of >= 2 tokens is a
    prefill); returns the logits of each prompt's last token [B, vocab]."""
    logits = []
    for group in prefill_groups([p.shape[0] for p in prompts], budget):
        lens = [prompts[b].shape[0] for b in group]
        batch = MLABatch.build(lens, [0] * len(group), [pages[b] for b in group], PAGE, device, decode_threshold=1)
        last = torch.tensor(lens, device=device).cumsum(0) - 1
        logits.append(model(torch.cat([prompts[b] for b in group]), caches, batch, last, k_scales))
    return torch.cat(logits)


def summarize(agree, rel_diff, margin):
    """agree [G, B] bool, rel_diff [G, B], margin [G, B] (bf16 top-1 margins) -> one variant's numbers."""
    G, B = agree.shape
    first = torch.where(agree.all(0), G, (~agree).int().argmax(0))  # first disagreement per request
    flips = margin[~agree]
    return dict(agreement=agree.float().mean().item(), flips=int((~agree).sum()), decisions=G * B,
                rel_logit_diff_mean=rel_diff.mean().item(), rel_logit_diff_max=rel_diff.max().item(),
                flip_margin_median=flips.median().item() if flips.numel() else None,
                flip_margin_max=flips.max().item() if flips.numel() else None,
                first_divergence_mean=first.float().mean().item(), never_diverged=int((first == G).sum()),
                first_divergence=first.tolist(), agreement_per_step=agree.float().mean(1).tolist())


def run(args, sizes, device):
    g = torch.Generator().manual_seed(args.seed)
    heads, B, G = sizes["heads"], sizes["batch"], sizes["steps"]
    lo, hi = sizes["prompt_len"]
    lens = torch.randint(lo, hi + 1, (B,), generator=g).tolist()
    cfg = MLAConfig(hidden_size=sizes["hidden"], num_heads=heads, q_lora_rank=sizes["q_lora"],
                    max_position_embeddings=max(lens) + G,
                    rope_scaling=YarnScaling(factor=40, mscale=1.0, mscale_all_dim=1.0))  # DeepSeek-V3
    model = ToyDeepSeek(cfg, sizes["vocab"], sizes["layers"])
    init_weights(model, args.seed)
    model.to(device)
    prompts = [torch.randint(sizes["vocab"], (L,), generator=g).to(device) for L in lens]

    # each request's pages, in a random order over the cache; the same layout for every variant
    npages = [math.ceil((L + G) / PAGE) for L in lens]
    perm = torch.randperm(sum(npages), generator=g).tolist()
    pages = [perm[s - n:s] for n, s in zip(npages, torch.tensor(npages).cumsum(0).tolist())]

    def new_caches(dtype):
        return [torch.zeros(sum(npages), PAGE, 576, dtype=dtype, device=device) for _ in model.layers]

    no_scale = [None] * len(model.layers)
    bf16 = new_caches(torch.bfloat16)
    with torch.no_grad():
        first = prefill(model, bf16, no_scale, prompts, pages, sizes["prefill_tokens"], device)
        k_scales = [(c.float().abs().amax() / FP8_MAX).reshape(1) for c in bf16]  # unwritten rows are 0
        fp8 = new_caches(FP8)
        prefill(model, fp8, k_scales, prompts, pages, sizes["prefill_tokens"], device)
        # fp8_mma changes decode only: after the prefill both FP8 variants hold the same cache
        caches = {"fp8": fp8, "fp8_mma": [c.clone() for c in fp8]}

        tok = first.argmax(-1)
        rows = torch.arange(B, device=device)
        agree = {name: [] for name, _ in VARIANTS}
        rel_diff = {name: [] for name, _ in VARIANTS}
        margins = []
        for step in range(G):
            batch = MLABatch.build([1] * B, [L + step for L in lens], pages, PAGE, device, decode_threshold=1,
                                   num_heads=heads, deterministic=args.deterministic)
            ref = model(tok, bf16, batch, rows, no_scale)
            ref_top, std = ref.argmax(-1), ref.std(-1)
            top2 = ref.topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]) / std)
            for name, fp8_mma in VARIANTS:
                logits = model(tok, caches[name], batch, rows, k_scales, fp8_mma)
                agree[name].append(logits.argmax(-1) == ref_top)
                rel_diff[name].append((logits - ref).abs().mean(-1) / std)
            tok = ref_top  # teacher forcing: every variant continues from bf16's token

    margin = torch.stack(margins).cpu()
    results = {name: summarize(torch.stack(agree[name]).cpu(), torch.stack(rel_diff[name]).cpu(), margin)
               for name, _ in VARIANTS}
    q = torch.tensor([0.01, 0.1, 0.5])
    bf16_margin = dict(zip(("p1", "p10", "median"), margin.flatten().quantile(q).tolist()),
                       mean=margin.mean().item())
    return dict(prompt_lens=lens, k_scales=[s.item() for s in k_scales], bf16_margin=bf16_margin,
                variants=results)


def markdown(meta, res):
    m = res["bf16_margin"]
    lines = [f"# FP8 KV cache: greedy agreement with the bf16 cache ({meta['device']})", "",
             f"Random DeepSeek-V3-like model: {meta['layers']} layers, hidden {meta['hidden']}, {meta['heads']} heads, "
             f"vocab {meta['vocab']}, q LoRA {meta['q_lora']}, kv LoRA 512, nope/rope/v 128/64/128, YaRN 40. "
             f"{meta['batch']} requests, prompts {meta['prompt_len'][0]}-{meta['prompt_len'][1]} tokens (prefilled), "
             f"{meta['steps']} greedy decode steps, teacher-forced on the bf16 run's tokens; page {PAGE}, "
             f"seed {meta['seed']}"
             f"{', deterministic schedule' if meta['deterministic'] else ''}.",
             f"k_scale per layer = amax / 448 of the bf16 prefill's cache rows: "
             f"{', '.join(f'{s:.4g}' for s in res['k_scales'])}. e4m3 MMAs applied: {meta['fp8_mma_applies']}.",
             "",
             "Agreement = argmax equal to bf16's over all requests x steps; |dlogit| = mean over the vocabulary of "
             "|logit - bf16 logit| / std(bf16 logits); flip margin = bf16 (top1 - top2) / std at the decisions "
             "that flipped; first divergence = first step (0-based) where the variant's own greedy sequence "
             "departs from bf16's, mean over requests (never = counted as steps).",
             "",
             "| variant | agreement | flips | mean \\|dlogit\\| | max \\|dlogit\\| | flip margin median / max "
             "| first divergence mean | never diverged |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in res["variants"].items():
        fm = "-" if r["flip_margin_max"] is None else f"{r['flip_margin_median']:.3f} / {r['flip_margin_max']:.3f}"
        lines.append(f"| {name} | {100 * r['agreement']:.2f} % | {r['flips']}/{r['decisions']} "
                     f"| {r['rel_logit_diff_mean']:.4f} | {r['rel_logit_diff_max']:.4f} | {fm} "
                     f"| {r['first_divergence_mean']:.1f} | {r['never_diverged']}/{meta['batch']} |")
    lines += ["", f"bf16 top-1 margin / std over all decisions: p1 {m['p1']:.3f}, p10 {m['p10']:.3f}, "
                  f"median {m['median']:.3f}, mean {m['mean']:.3f}."]
    if meta["cpu_smoke"]:
        lines += ["", "CPU smoke run: the CPU ops attend in fp32 whatever fp8_mma says, so fp8_mma equals fp8 "
                      "and agreement only reflects the FP8 cache's rounding; the GPU run is the measurement."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true",
                    help="batch-invariant decode schedule (fp8_mma then applies at any head count)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU ops (checks the script only)")
    args = ap.parse_args()

    if args.cpu_smoke:
        device, sizes = "cpu", dict(SMOKE)
    elif torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        device, sizes = "cuda", dict(FULL)
    else:
        raise SystemExit("needs an sm_90 GPU (fp8_mma is a kernel option); --cpu-smoke checks the script on CPU")
    for key in ("heads", "layers", "batch", "steps", "prompt_len"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if not 2 <= sizes["prompt_len"][0] <= sizes["prompt_len"][1]:
        raise SystemExit("--prompt-len MIN MAX needs 2 <= MIN <= MAX (a 1-token prompt would route as a decode)")

    t0 = time.time()
    res = run(args, sizes, device)
    meta = dict(sizes, seed=args.seed, deterministic=args.deterministic, cpu_smoke=args.cpu_smoke,
                device=torch.cuda.get_device_name() if device == "cuda" else "CPU, reference ops",
                fp8_mma_applies=device == "cuda" and (sizes["heads"] > 16 or args.deterministic),
                torch=torch.__version__, mla_attn=mla_attn.__version__, seconds=round(time.time() - t0, 1))
    md = markdown(meta, res)
    stem = "bench_fp8_agreement_cpu_smoke" if args.cpu_smoke else "bench_fp8_agreement"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, **res), f, indent=1)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
