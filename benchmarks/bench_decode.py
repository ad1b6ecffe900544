#!/usr/bin/env python3
"""Benchmark mla_attn.mla_decode (DeepSeek MLA absorbed decode) on one Hopper GPU.

For every config:
  1. build the problem (q [b, s_q, h_q, 576] bf16, paged latent cache [pages, page, 1, 576] bf16 with
     a random page permutation, int32 block_table / cache_seqlens, causal = s_q > 1, scale 1/sqrt(192));
  2. check mla_attn (and FlashInfer's BatchMLAPagedAttentionWrapper, backend "fa3", when importable)
     against a float32 torch reference: eager call into NaN-poisoned outputs, then a CUDA graph of one
     call whose outputs are NaN-poisoned before the replay;
  3. time the whole op as a CUDA graph (scheduling metadata / FlashInfer plan made once outside),
     the kernels' replays interleaved in 4 rounds, each starting from another kernel:
       cold = median over replays each preceded by a 512 MB read (evicts the 60 MB L2),
       warm = median over replays each preceded by a ~20 us spin kernel (no memory traffic);
     replays per config are bounded by a time budget (--rep-ms per mode, scaled down when the
     whole-run budget --time-budget-s runs short);
  4. time mla_attn.get_decode_metadata eagerly (CUDA events around the host call, median of 20) and
     in a graph of 20 calls, and a step's first layer (metadata, then the decode: one graph, timed
     with the others) beside FlashMLA's call with a fresh schedule object, which does the same.
Ceilings of the same run: HBM streaming read (Triton kernel if importable, else torch.sum) and a
bf16 8192^3 matmul.

Outputs: <out>/bench_decode.json and <out>/bench_decode.md (markdown table printed last).
The static peer table below was measured with the same method, so ratios to it are
meaningful; absolute numbers move by up to ~10 % between machines, so prefer the live FlashInfer
ratio measured in this same run.

usage: python benchmarks/bench_decode.py [--quick] [--configs main|ext|all] [--only SUBSTR,..]
                                         [--out DIR] [--no-flashinfer] [--no-ceilings]
                                         [--flashmla SO:PKG_ROOT]  (a FlashMLA build, timed beside)
                                         [--flashmla-fp8 SO]  (FlashMLA's dense FP8 decode, --kv-dtype fp8*)
                                         [--kernel NAME] [--kernels K1,K2]  (forced decode kernels)
                                         [--l2-resident]  (one shared cache per config, served from L2)
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
import zlib

import torch

from _timing import GraphTimer, capture, measure_ceilings, nvml_sample, smi

D_QK, D_V = 576, 512
DEV = "cuda"  # a CPU smoke test of the data/reference/report code may set this to "cpu"
PAGE = 64
SCALE = 1.0 / math.sqrt(192.0)
REL_L2_TOL, LSE_TOL = 2e-2, 1e-2
# --kv-dtype fp8_mma: Q and P rounded to e4m3 (tests/test_decode_fp8_mma_gpu.py measures ~3 %)
FP8_MMA_REL_L2_TOL, FP8_MMA_LSE_TOL = 5e-2, 1e-1
FP8_K_SCALE = 0.02  # --kv-dtype fp8: randn data / 0.02 spans about +-200 of e4m3's +-448

# Best peer (fastest correct cold time, us, of FlashMLA, FA3 and FlashInfer) per config, from a
# separate measurement of the peers (main and ext grids).
# Measured on another H200 (power-capped, ~10 % machine-to-machine drift): indicative only. Lrand rows
# used other random lengths (same distribution), so their ratio is approximate too.
STATIC_BEST = {
    # ---- RESULTS.md (main grid) ----
    "h128_s1_b1_L1024": ("FlashInfer fa3", 18.0), "h128_s1_b1_L4096": ("FA3 (ns<=32)", 22.9),
    "h128_s1_b1_L16384": ("FA3 (ns<=32)", 32.8), "h128_s1_b32_L1024": ("FlashInfer fa3", 34.9),
    "h128_s1_b32_L4096": ("FlashMLA", 79.0), "h128_s1_b32_L16384": ("FlashMLA", 247.5),
    "h128_s1_b128_L1024": ("FlashInfer fa3", 82.0), "h128_s1_b128_L4096": ("FlashMLA", 251.1),
    "h128_s1_b128_L16384": ("FlashMLA", 972.5), "h128_s1_b128_Lrand": ("FlashMLA", 261.6),
    "h128_s2_b1_L1024": ("FlashMLA", 22.0), "h128_s2_b1_L4096": ("FlashInfer fa3", 28.3),
    "h128_s2_b1_L16384": ("FlashInfer fa3", 36.6), "h128_s2_b32_L1024": ("FlashInfer fa3", 43.6),
    "h128_s2_b32_L4096": ("FlashMLA", 121.6), "h128_s2_b32_L16384": ("FlashMLA", 452.7),
    "h128_s2_b128_L1024": ("FlashMLA", 141.3), "h128_s2_b128_L4096": ("FlashMLA", 476.5),
    "h128_s2_b128_L16384": ("FlashMLA", 1792.6), "h128_s2_b128_Lrand": ("FlashMLA", 518.1),
    "h16_s1_b1_L1024": ("FA3 (ns<=32)", 17.7), "h16_s1_b1_L4096": ("FA3 (ns=0)", 21.1),
    "h16_s1_b1_L16384": ("FA3 (ns=0)", 27.8), "h16_s1_b32_L1024": ("FlashInfer fa3", 23.0),
    "h16_s1_b32_L4096": ("FlashInfer fa3", 48.2), "h16_s1_b32_L16384": ("FlashInfer fa3", 153.2),
    "h16_s1_b128_L1024": ("FlashInfer fa3", 47.2), "h16_s1_b128_L4096": ("FlashInfer fa3", 151.1),
    "h16_s1_b128_L16384": ("FlashMLA", 577.9), "h16_s1_b128_Lrand": ("FlashMLA", 164.5),
    "h16_s2_b1_L1024": ("FlashMLA", 20.6), "h16_s2_b1_L4096": ("FlashInfer fa3", 24.3),
    "h16_s2_b1_L16384": ("FA3 (ns=0)", 31.5), "h16_s2_b32_L1024": ("FlashInfer fa3", 25.1),
    "h16_s2_b32_L4096": ("FlashInfer fa3", 50.0), "h16_s2_b32_L16384": ("FlashInfer fa3", 155.6),
    "h16_s2_b128_L1024": ("FlashInfer fa3", 47.9), "h16_s2_b128_L4096": ("FlashInfer fa3", 153.1),
    "h16_s2_b128_L16384": ("FlashMLA", 592.4), "h16_s2_b128_Lrand": ("FlashMLA", 165.1),
    "h128_s4_b32_L4096": ("FlashMLA", 225.1),
    # ---- RESULTS_ext.md (ext grid; group A, B, C page-16 rows) ----
    "h32_s1_b32_L4096": ("FlashInfer fa3", 49.2), "h32_s1_b32_L65536": ("FlashMLA", 578.8),
    "h32_s1_b128_L4096": ("FlashInfer fa3", 151.5), "h32_s1_b128_L65536": ("FlashMLA", 2278.7),
    "h64_s1_b32_L4096": ("FlashInfer fa3", 53.2), "h64_s1_b32_L65536": ("FlashMLA", 593.3),
    "h64_s1_b128_L4096": ("FlashInfer fa3", 156.0), "h64_s1_b128_L65536": ("FlashMLA", 2380.7),
    "h128_s64_b32_L4096": ("FlashMLA", 3566.4), "h16_s64_b32_L4096": ("FlashMLA", 425.8),
    "h16_s1_b1_L4096_p16": ("FA3 (ns=0)", 20.9), "h16_s1_b1_L16384_p16": ("FA3 (ns=0)", 27.6),
    "h16_s1_b128_L4096_p16": ("FlashInfer fa3", 160.4), "h16_s1_b128_L16384_p16": ("FA3 (ns<=32)", 599.5),
    "h128_s1_b1_L4096_p16": ("FlashInfer fa3", 23.3), "h128_s1_b1_L16384_p16": ("FA3 (ns<=32)", 33.4),
    "h128_s1_b128_L4096_p16": ("FlashInfer fa3", 262.6), "h128_s1_b128_L16384_p16": ("FlashInfer fa3", 1039.5),
}

QUICK = ["h128_s1_b1_L16384", "h128_s1_b128_L4096", "h128_s2_b32_L4096", "h128_s1_b128_Lrand",
         "h16_s1_b1_L4096", "h16_s1_b128_L16384", "h16_s2_b32_L1024", "h16_s1_b128_L4096_p16"]


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------
def cfg(h_q, s_q, b, L, page=PAGE, grid="main"):
    name = f"h{h_q}_s{s_q}_b{b}_L{L}" + ("" if page == PAGE else f"_p{page}")
    return dict(name=name, h_q=h_q, s_q=s_q, b=b, L=L, page=page, grid=grid)


def main_configs():
    out = []
    for h_q in (128, 16):
        for s_q in (1, 2):
            for b in (1, 32, 128):
                for L in (1024, 4096, 16384):
                    out.append(cfg(h_q, s_q, b, L))
            out.append(cfg(h_q, s_q, 128, "rand"))
    out.append(cfg(128, 4, 32, 4096))
    return out


def ext_configs():
    out = []
    for h_q in (32, 64):                       # TP4 / TP2 head counts
        for b in (32, 128):
            for L in (4096, 65536):
                out.append(cfg(h_q, 1, b, L, grid="ext"))
    for s_q in (4, 64):                        # speculative decoding (causal)
        for h_q in (128, 16):
            out.append(cfg(h_q, s_q, 32, 4096, grid="ext"))
    for h_q in (16, 128):                      # page 16 next to its page-64 twin
        for b in (1, 128):
            for L in (4096, 16384):
                for page in (16, 64):
                    out.append(cfg(h_q, 1, b, L, page=page, grid="ext"))
    return out


def page_configs():
    """The page-size sweep: SGLang's 1 (rows gathered by cp.async), vLLM's 16-128 (TMA), where the
    MMAs bound the time (h_q 128) and where the reads do (h_q 16)."""
    out = []
    for h_q, b, L in ((128, 128, 4096), (128, 32, 16384), (16, 128, 16384)):
        for page in (1, 8, 16, 32, 64, 128):
            out.append(cfg(h_q, 1, b, L, page=page, grid="pages"))
    return out


def select_configs(which, quick, only):
    if which == "main":
        cs = main_configs()
    elif which == "ext":
        cs = ext_configs()
    elif which == "pages":
        cs = page_configs()
    else:
        cs = main_configs() + ext_configs()
    if quick:
        pool = {c["name"]: c for c in main_configs() + ext_configs()}
        cs = [pool[n] for n in QUICK]
    seen, uniq = set(), []
    for c in cs:
        if c["name"] not in seen:
            seen.add(c["name"])
            uniq.append(c)
    if only:
        keys = [k for k in only.split(",") if k]
        uniq = [c for c in uniq if any(k in c["name"] for k in keys)]
    return uniq


# ----------------------------------------------------------------------------------------------
# data and float32 reference
# ----------------------------------------------------------------------------------------------
def make_problem(c, seed, kv_dtype="bf16", l2_resident=False):
    """l2_resident: every request reads one shared cache of max(lens) keys (each block-table row a random
    order of the same pages), small enough to stay in L2, so that the memory system does not set the time."""
    gen = torch.Generator().manual_seed(seed)
    b, s_q, h_q, page = c["b"], c["s_q"], c["h_q"], c["page"]
    if c["L"] == "rand":
        lens = torch.randint(1, 8193, (b,), generator=gen).clamp_min(s_q).to(torch.int32)
    else:
        lens = torch.full((b,), int(c["L"]), dtype=torch.int32)
    npages = (lens + page - 1) // page
    table = torch.zeros(b, int(npages.max()), dtype=torch.int32)
    if l2_resident:
        total = int(npages.max())
        for i, n in enumerate(npages.tolist()):
            table[i, :n] = torch.randperm(total, generator=gen)[:n]
    else:
        total = int(npages.sum())
        order = torch.randperm(total, generator=gen).to(torch.int32)
        start = 0
        for i, n in enumerate(npages.tolist()):
            table[i, :n] = order[start:start + n]
            start += n
    dgen = torch.Generator(device=DEV).manual_seed(seed)
    kv = torch.randn(total, page, 1, D_QK, dtype=torch.bfloat16, device=DEV, generator=dgen)
    q = torch.randn(b, s_q, h_q, D_QK, dtype=torch.bfloat16, device=DEV, generator=dgen)
    p = dict(q=q, kv=kv, table=table.to(DEV), lens=lens.to(DEV), table_cpu=table, lens_cpu=lens,
             npages_cpu=npages, page=page, k_scale=None)
    p["fp8_mma"] = kv_dtype == "fp8_mma"
    if kv_dtype in ("fp8", "fp8_mma"):  # the cache as write_kv_cache stores it; the reference reads stored * k_scale
        from mla_attn.kv_cache import quantize_fp8
        p["k_scale"] = torch.tensor([FP8_K_SCALE], dtype=torch.float32, device=DEV)
        p["kv"] = quantize_fp8(kv, p["k_scale"])
    return p


@torch.no_grad()
def reference_fp32(p, causal):
    """out [b, s_q, h_q, 512] fp32 and lse [b, s_q, h_q] fp32 (natural log), one request at a time."""
    q, page = p["q"], p["page"]
    b, s_q, h_q, _ = q.shape
    pages = p["kv"].view(-1, page, D_QK)
    out = torch.empty(b, s_q, h_q, D_V, dtype=torch.float32, device=DEV)
    lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=DEV)
    for i in range(b):
        L = int(p["lens_cpu"][i])
        ids = p["table_cpu"][i, :int(p["npages_cpu"][i])].to(DEV).long()
        k = pages.index_select(0, ids).reshape(-1, D_QK)[:L].float()              # [L, 576]
        if p["k_scale"] is not None:
            k = k * p["k_scale"]
        logits = (q[i].float().reshape(s_q * h_q, D_QK) @ k.t()) * SCALE           # [(t,h), L]
        if causal and s_q > 1:
            last = L - s_q + torch.arange(s_q, device=DEV)                      # last visible key
            hide = torch.arange(L, device=DEV)[None, :] > last[:, None]         # [s_q, L]
            logits = logits.view(s_q, h_q, L).masked_fill(hide[:, None, :], float("-inf"))
            logits = logits.view(s_q * h_q, L)
        m = torch.logsumexp(logits, dim=-1)
        out[i] = (torch.exp(logits - m[:, None]) @ k[:, :D_V]).view(s_q, h_q, D_V)
        lse[i] = m.view(s_q, h_q)
    return out, lse


def compare(out, lse, ref_out, ref_lse, fp8_mma=False):
    o = out.float()
    r = dict(nonfinite=int((~torch.isfinite(o)).sum()),
             rel_l2=float((o - ref_out).norm() / ref_out.norm()),
             max_abs=float((o - ref_out).abs().max()))
    l = lse.float()
    r["lse_nonfinite"] = int((~torch.isfinite(l)).sum())
    r["lse_max_abs"] = float((l - ref_lse).abs().max())
    rel_tol, lse_tol = (FP8_MMA_REL_L2_TOL, FP8_MMA_LSE_TOL) if fp8_mma else (REL_L2_TOL, LSE_TOL)
    r["ok"] = bool(r["nonfinite"] == 0 and r["lse_nonfinite"] == 0 and r["rel_l2"] < rel_tol
                   and r["lse_max_abs"] < lse_tol)
    return r


# ----------------------------------------------------------------------------------------------
# kernels: prepare(p, c) -> dict(eager=fn() -> (out, lse) into poisoned outputs, graph_fn=fn() -> (out, lse))
# out is [b, s_q, h_q, 512]; lse is [b, s_q, h_q]
# ----------------------------------------------------------------------------------------------
class Ours:
    name = "mla_attn"

    def __init__(self, kernel=None, beside=False):
        import mla_attn
        self.m = mla_attn
        self.kernel = kernel  # mla_decode's private _kernel=: None is the dispatch's choice
        # --kernels: a forced kernel timed beside the dispatch's choice (its own row key, no step timing)
        self.beside = beside
        if beside:
            self.name = f"mla_attn[{kernel}]"
        try:
            self.build_info = mla_attn.build_info()
        except Exception as e:  # pragma: no cover
            self.build_info = repr(e)

    def metadata(self, p, c):
        return self.m.get_decode_metadata(p["lens"], c["h_q"], s_q=c["s_q"], causal=c["s_q"] > 1)

    def prepare(self, p, c):
        causal = c["s_q"] > 1
        md = self.metadata(p, c)
        q, kv, table, lens, k_scale, fp8_mma = p["q"], p["kv"], p["table"], p["lens"], p["k_scale"], p["fp8_mma"]
        buf = torch.empty(q.shape[:-1] + (D_V,), dtype=q.dtype, device=q.device)

        def dec(**kw):
            return self.m.mla_decode(q, kv, table, lens, softmax_scale=SCALE, causal=causal, return_lse=True,
                                     k_scale=k_scale, fp8_mma=fp8_mma, _kernel=self.kernel, **kw)

        def eager():
            buf.fill_(float("nan"))
            # lse is allocated by the op: leave a NaN block of its size in the caching allocator
            junk = torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device=q.device)
            del junk
            return dec(metadata=md, out=buf)

        def graph_fn():
            return dec(metadata=md)

        def step_fn():  # what the first layer of a step runs: the schedule, then the decode
            return dec(metadata=self.metadata(p, c))

        info = dict(num_sm_parts=int(md.num_sm_parts))
        try:
            rs = md.req_splits.cpu()
            info["max_splits"] = int(rs[:, 0].max()) if rs.numel() else 0
        except Exception:
            pass
        prep = dict(eager=eager, graph_fn=graph_fn, info=info, keep=(md, buf))
        if not self.beside:
            prep["step_fn"] = step_fn
        return prep


class FlashInferFA3:
    name = "flashinfer_fa3"

    def __init__(self):
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        self.version = flashinfer.__version__
        self.Wrapper, self.Meta = BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)

    @staticmethod
    def csr(p):
        """The paged cache as FlashInfer indexes it: (qo_indptr, kv_indptr) on the host, kv_indices on DEV."""
        b, s_q = p["q"].shape[:2]
        npages = p["npages_cpu"]
        qo_indptr = torch.arange(b + 1, dtype=torch.int32) * s_q
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(npages, 0).to(torch.int32)])
        kv_indices = torch.cat([p["table_cpu"][i, :int(n)] for i, n in enumerate(npages.tolist())])
        return qo_indptr, kv_indptr, kv_indices.to(torch.int32).to(DEV)

    def plan(self, w, p, csr):
        """w.plan for p's batch (a host call, outside any graph); bench_step.py times it per step."""
        qo_indptr, kv_indptr, kv_indices = csr
        s_q, h_q = p["q"].shape[1:3]
        w.plan(metadata=self.Meta.csr(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                                      kv_len_arr=p["lens_cpu"].clone()),
               num_heads=h_q, head_dim_ckv=D_V, head_dim_kpe=D_QK - D_V, page_size=p["page"],
               causal=s_q > 1, sm_scale=SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               query_layout="packed", kv_cache_layout="packed", lse_mode="basee")

    def prepare(self, p, c):
        q = p["q"]
        b, s_q, h_q, _ = q.shape
        csr = self.csr(p)
        w = self.Wrapper(self.workspace, backend="fa3")
        self.plan(w, p, csr)
        qf = q.view(b * s_q, h_q, D_QK)
        cache = p["kv"].view(-1, p["page"], D_QK)
        out = torch.empty(b * s_q, h_q, D_V, dtype=torch.bfloat16, device=DEV)
        lse = torch.empty(b * s_q, h_q, dtype=torch.float32, device=DEV)

        def run():
            w.run(query=qf, kv_cache=cache, out=out, lse=lse, return_lse=True, return_lse_base_on_e=True)
            return out.view(b, s_q, h_q, D_V), lse.view(b, s_q, h_q)

        def eager():
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            return run()
        return dict(eager=eager, graph_fn=run, info={}, keep=(w, csr))


class FlashMLA:
    """deepseek-ai/FlashMLA's SM90 dense decode, when a build of it is given (--flashmla SO:PKG_ROOT:
    the compiled module and the folder holding its flash_mla/ Python package). mla_attn ships no
    FlashMLA code or binary. Page 64 only."""
    name = "flashmla"

    def __init__(self, spec):
        import importlib.util
        so_path, pkg_root = spec.split(":")
        # named as FlashMLA's setup.py names it (an extension's init symbol follows its name)
        mod_spec = importlib.util.spec_from_file_location("flash_mla.cuda", so_path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        sys.modules["flash_mla.cuda"] = mod
        sys.path.insert(0, pkg_root)
        from flash_mla.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata
        self.get_mla_metadata, self.fwd = get_mla_metadata, flash_mla_with_kvcache

    def prepare(self, p, c):
        if p["page"] != 64 or p["k_scale"] is not None:
            raise ValueError("FlashMLA's dense decode takes a bf16 cache of page 64 only")
        q, kv, table, lens = p["q"], p["kv"], p["table"], p["lens"]
        meta, _ = self.get_mla_metadata()  # filled by the first call (the eager check), then reused

        def run(sched=meta):
            out, lse = self.fwd(q, kv, table, lens, D_V, sched, None, softmax_scale=SCALE, causal=c["s_q"] > 1)
            return out, lse.transpose(1, 2)  # lse [b, h_q, s_q] -> [b, s_q, h_q]

        def step_fn():  # a fresh schedule object: the call makes its metadata, then decodes
            return run(self.get_mla_metadata()[0])
        return dict(eager=run, graph_fn=run, step_fn=step_fn, info={}, keep=(meta,))


class FlashMLAFP8:
    """FlashMLA's SM90 dense FP8 decode as vLLM ships it (--flashmla-fp8 SO: vLLM's
    _flashmla_extension_C.abi3.so, the kernel its FlashMLA backend runs with an FP8 cache): e4m3 Q and
    cache with per-tensor descales, e4m3 math, bf16 out. Q is quantised once outside the timed call
    (amax / 448, as vLLM's q_scale); vLLM quantises it in a kernel of its own each layer. Page 64 only."""
    name = "flashmla"

    def __init__(self, so_path):
        import importlib.util
        # the module's init symbol follows its name (PyInit__flashmla_extension_C)
        spec = importlib.util.spec_from_file_location("_flashmla_extension_C", so_path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        self.ops = torch.ops._flashmla_extension_C

    def prepare(self, p, c):
        if p["page"] != 64 or p["k_scale"] is None:
            raise ValueError("FlashMLA's dense FP8 decode takes an e4m3 cache of page 64 only")
        q, table, lens, k_scale = p["q"], p["table"], p["lens"], p["k_scale"]
        q_scale = (q.float().abs().amax() / 448.0).reshape(1)
        q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
        kv = p["kv"].view(torch.float8_e4m3fn)
        _, s_q, h_q, _ = q.shape
        causal = s_q > 1

        def metadata():
            return self.ops.get_mla_decoding_metadata_dense_fp8(lens, s_q * h_q, 1)
        sched, splits = metadata()

        def run(sched=sched, splits=splits):
            out, lse = self.ops.fwd_kvcache_mla_fp8(q8, kv, D_V, lens, table, SCALE, causal, sched, splits,
                                                    q_scale, k_scale)
            return out, lse.transpose(1, 2)  # lse [b, h_q, s_q] -> [b, s_q, h_q]

        def step_fn():  # its metadata, then the decode
            return run(*metadata())
        return dict(eager=run, graph_fn=run, step_fn=step_fn, info=dict(q_scale=float(q_scale)),
                    keep=(sched, splits), fp8_math=True)


# ----------------------------------------------------------------------------------------------
# metadata timing
# ----------------------------------------------------------------------------------------------
def time_metadata(ours, p, c, iters=20):
    for _ in range(3):
        ours.metadata(p, c)
    torch.cuda.synchronize()
    evs, walls = [], []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        ours.metadata(p, c)
        e.record()
        e.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6)
        evs.append(s.elapsed_time(e) * 1e3)
    # GPU time of the scheduler alone, as a captured step runs it: `iters` calls in one graph.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            ours.metadata(p, c)
    graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    graph.replay()
    e.record()
    e.synchronize()
    return dict(md_us=statistics.median(evs), md_wall_us=statistics.median(walls),
                md_graph_us=s.elapsed_time(e) * 1e3 / iters)


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def check_kernel(kern, p, c, ref):
    """Checks one kernel (eager call, then a CUDA graph of one call) against the reference; returns
    its result row and the graph to time (None if it failed to run)."""
    r = dict(kernel=kern.name)
    try:
        prep = kern.prepare(p, c)
        r.update(prep["info"])
        fp8_math = p.get("fp8_mma", False) or prep.get("fp8_math", False)  # e4m3 Q and P: the looser bound
        out, lse = prep["eager"]()
        torch.cuda.synchronize()
        eager_chk = compare(out, lse, *ref, fp8_mma=fp8_math)
        del out, lse
        g, (gout, glse) = capture(prep["graph_fn"])
        gout.fill_(float("nan"))
        glse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graph_chk = compare(gout, glse, *ref, fp8_mma=fp8_math)
        r["eager_check"], r["graph_check"] = eager_chk, graph_chk
        r["rel_l2"] = max(eager_chk["rel_l2"], graph_chk["rel_l2"])
        r["max_abs"] = max(eager_chk["max_abs"], graph_chk["max_abs"])
        r["lse_max_abs"] = max(eager_chk["lse_max_abs"], graph_chk["lse_max_abs"])
        r["ok"] = eager_chk["ok"] and graph_chk["ok"]
        return r, (g, prep)
    except Exception:
        r["error"] = traceback.format_exc()[-3000:]
        r["ok"] = False
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return r, None


def run_kernels(kerns, p, c, ref, timer, rep_ms):
    """Checks every kernel of a config, then times those that ran with their replays interleaved
    (GraphTimer.time_interleaved), so that no kernel is favoured by its place in the order."""
    checked = [check_kernel(k, p, c, ref) for k in kerns]
    timed = [(r, gp[0]) for r, gp in checked if gp is not None]
    steps = []  # kernels whose step_fn makes the metadata and decodes: a step's first layer
    for r, gp in checked:
        if gp is not None and "step_fn" in gp[1]:
            try:
                steps.append((r, capture(gp[1]["step_fn"])[0]))
            except Exception:
                r["step_error"] = traceback.format_exc()[-1500:]
    try:
        times = timer.time_interleaved([g for _, g in timed] + [g for _, g in steps], rep_ms)
        after = nvml_sample()  # clock and power once all of them were timed (together)
        for (r, _), t in zip(timed, times):
            r.update(t, nvml_after=after)
        for (r, _), t in zip(steps, times[len(timed):]):
            r["step_cold_us"], r["step_warm_us"] = t["cold_us"], t["warm_us"]
    except Exception:
        for r, _ in timed:
            r["error"], r["ok"] = traceback.format_exc()[-3000:], False
    return [r for r, _ in checked]


def fmt(v, f="{:.1f}", none="-"):
    return none if v is None else f.format(v)


def _stem(results):
    args = results["info"]["args"]
    kv_dtype = args.get("kv_dtype", "bf16")
    stem = "bench_decode" if kv_dtype == "bf16" else f"bench_decode_{kv_dtype}"
    return stem + ("_l2_resident" if args.get("l2_resident") else "")


def live_best(row):
    """Fastest correct cold time of the live anchors (FlashInfer, FlashMLA) in a row, or None."""
    times = [r["cold_us"] for r in (row.get("flashinfer_fa3"), row.get("flashmla"))
             if r and r.get("ok") and r.get("cold_us")]
    return min(times) if times else None


def live_cells(row, cold, step):
    fm = row.get("flashmla") or {}
    fm_cold = fm.get("cold_us") if fm.get("ok") else None
    fm_step = fm.get("step_cold_us") if fm.get("ok") else None
    best = live_best(row)
    return (f"{fmt(fm_cold)} | {fmt(fm_cold / cold if (fm_cold and cold) else None, '{:.2f}')} | "
            f"{fmt(best / cold if (best and cold) else None, '{:.2f}')} | "
            f"{fmt(fm_step)} | {fmt(fm_step / step if (fm_step and step) else None, '{:.2f}')} | ")


def write_outputs(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, _stem(results) + ".json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    ce = results.get("ceilings") or {}
    lines = []
    info = results["info"]
    fp8_cache = info["args"].get("kv_dtype", "bf16") != "bf16"
    l2_resident = info["args"].get("l2_resident", False)
    static_best = {} if fp8_cache or l2_resident else STATIC_BEST  # the static table holds bf16-cache peers on HBM
    lines.append(f"# mla_attn decode benchmark ({info.get('gpu')}, torch {info.get('torch')}, "
                 f"FlashInfer {info.get('flashinfer', 'n/a')}, KV cache {info['args'].get('kv_dtype', 'bf16')}"
                 + (f", mla_attn kernel forced: {info['args']['kernel']}" if info["args"].get("kernel") else "") + ")")
    lines.append("")
    if l2_resident:
        lines.append("**L2-resident cache** (--l2-resident): every request of a config reads the same cache of L keys "
                     "(block-table rows are random orders of one set of pages), so after the first reads it is "
                     "served from L2: warm us is the kernel's own time where HBM does not bound it, and TB/s the "
                     "rate it reads at (from cold us, which includes loading the cache from HBM once).")
        lines.append("")
    if ce:
        lines.append(f"Ceilings (this run): HBM read {ce.get('read_TBps', 0):.2f} TB/s "
                     f"(Triton {ce.get('read_triton_TBps', float('nan')):.2f}, torch.sum "
                     f"{ce.get('read_torch_sum_TBps', 0):.2f}); bf16 matmul 8192^3 "
                     f"{ce.get('mm8192_bf16_TFLOPs', 0):.0f} TFLOP/s")
        lines.append("")
    lines.append("cold/warm: median us of a CUDA-graph replay of the whole op (cold: L2 flushed by a 512 MB "
                 "read first). TB/s and TFLOP/s from cold. FI = FlashInfer fa3 (live, this run). "
                 "x FI = FI cold / ours cold; x static = best peer time of the static table in bench_decode.py (another H200, another run) / ours "
                 "(> 1: ours faster). md us = get_decode_metadata, eager, CUDA events around the host call; "
                 "md graph us = its GPU time per call in a CUDA graph of 20 calls; step us = a step's first "
                 "layer: get_decode_metadata then the decode, one CUDA graph, cold (the other layers reuse "
                 "the metadata: cold us).")
    lines.append("")
    fmla = any(row.get("flashmla") for row in results["rows"])
    if fmla:
        which = ("its dense FP8 kernel, e4m3 Q and P, as vLLM ships it (--flashmla-fp8)"
                 if fp8_cache else "--flashmla")
        lines.append(f"FMLA = FlashMLA SM90 dense decode (live, this run; {which}); x live best = the faster "
                     "correct one of FI and FMLA / ours. FMLA step us = its call with a fresh schedule object "
                     "(it makes its metadata, then decodes), one CUDA graph, cold; x FMLA step = that / step us.")
        lines.append("")
    lines.append("| config | ok | rel L2 | max abs | lse err | cold us | warm us | TB/s | TFLOP/s | md us | md graph us "
                 "| step us | FI cold us | FI ok | x FI | "
                 + ("FMLA cold us | x FMLA | x live best | FMLA step us | x FMLA step | " if fmla else "")
                 + "static best (us) | x static |")
    lines.append("|---" * (22 if fmla else 17) + "|")
    for row in results["rows"]:
        o = row.get("ours", {})
        fi = row.get("flashinfer_fa3")
        st = static_best.get(row["cfg"])
        cold = o.get("cold_us")
        if "error" in o and cold is None:
            err = o["error"].strip().splitlines()[-1][:80].replace("|", "/")
            lines.append(f"| {row['cfg']} | ERROR | {err} | | | | | | | {fmt(row.get('md_us'))} | "
                         f"{fmt(row.get('md_graph_us'))} | | "
                         f"{fmt(fi.get('cold_us') if fi else None)} | | | " + ("| | | | | " if fmla else "") + "| |")
            continue
        ok = "ok" if o.get("ok") else "FAIL"
        fi_cold = fi.get("cold_us") if fi else None
        fi_ok = "" if not fi else ("ok" if fi.get("ok") else ("ERR" if "error" in fi else "FAIL"))
        x_fi = fi_cold / cold if (fi_cold and cold) else None
        x_st = st[1] / cold if (st and cold) else None
        lines.append(
            f"| {row['cfg']} | {ok} | {fmt(o.get('rel_l2'), '{:.1e}')} | {fmt(o.get('max_abs'), '{:.1e}')} | "
            f"{fmt(o.get('lse_max_abs'), '{:.1e}')} | {fmt(cold)} | {fmt(o.get('warm_us'))} | "
            f"{fmt(row['bytes'] / cold / 1e6 if cold else None, '{:.2f}')} | "
            f"{fmt(row['flops'] / cold / 1e6 if cold else None, '{:.0f}')} | {fmt(row.get('md_us'))} | "
            f"{fmt(row.get('md_graph_us'))} | {fmt(o.get('step_cold_us'))} | "
            f"{fmt(fi_cold)} | {fi_ok} | {fmt(x_fi, '{:.2f}')} | "
            + (live_cells(row, cold, o.get('step_cold_us')) if fmla else "") +
            f"{(st[0] + ' ' + format(st[1], '.1f')) if st else '-'} | {fmt(x_st, '{:.2f}')} |")
    rat_fi = [r["flashinfer_fa3"]["cold_us"] / r["ours"]["cold_us"] for r in results["rows"]
              if r.get("ours", {}).get("cold_us") and (r.get("flashinfer_fa3") or {}).get("cold_us")]
    rat_live = [live_best(r) / r["ours"]["cold_us"] for r in results["rows"]
                if r.get("ours", {}).get("cold_us") and live_best(r)] if fmla else []
    rat_st = [static_best[r["cfg"]][1] / r["ours"]["cold_us"] for r in results["rows"]
              if r.get("ours", {}).get("cold_us") and r["cfg"] in static_best]
    lines.append("")
    n_ok = sum(1 for r in results["rows"] if r.get("ours", {}).get("ok"))
    lines.append(f"Correct: {n_ok}/{len(results['rows'])} configs.")
    if rat_fi:
        lines.append(f"Geo-mean x FI (live FlashInfer fa3 / ours): "
                     f"{math.exp(sum(map(math.log, rat_fi)) / len(rat_fi)):.3f} over {len(rat_fi)} configs.")
    if rat_live:
        lines.append(f"Geo-mean x live best (FI, FMLA) / ours: "
                     f"{math.exp(sum(map(math.log, rat_live)) / len(rat_live)):.3f} over {len(rat_live)} configs; "
                     f"{sum(x >= 0.95 for x in rat_live)} at >= 0.95.")
    rat_step = [(r.get("flashmla") or {})["step_cold_us"] / r["ours"]["step_cold_us"] for r in results["rows"]
                if r.get("ours", {}).get("step_cold_us") and (r.get("flashmla") or {}).get("ok")
                and (r.get("flashmla") or {}).get("step_cold_us")]
    if rat_step:
        lines.append(f"Geo-mean x FMLA step (metadata + decode, FlashMLA / ours): "
                     f"{math.exp(sum(map(math.log, rat_step)) / len(rat_step)):.3f} over {len(rat_step)} configs.")
    if rat_st:
        lines.append(f"Geo-mean x static best anchor / ours: "
                     f"{math.exp(sum(map(math.log, rat_st)) / len(rat_st)):.3f} over {len(rat_st)} configs.")
    forced = [k for k in (results["info"]["args"].get("kernels") or "").split(",") if k]
    if forced:
        lines.append("")
        lines.append("Forced kernels (--kernels), timed in the same interleaved replays as mla_attn above (the "
                     "dispatch's choice unless --kernel): cold / warm us, x = mla_attn's cold / this cold (> 1: "
                     "the forced kernel is faster); ERR: the kernel cannot run the config or failed its check.")
        lines.append("")
        lines.append("| config | mla_attn cold / warm us | "
                     + " | ".join(f"{k} cold / warm us | x" for k in forced) + " |")
        lines.append("|---|---|" + "---|---|" * len(forced))
        for row in results["rows"]:
            o = row.get("ours", {})
            cells = []
            for k in forced:
                r = row.get(f"mla_attn[{k}]") or {}
                if r.get("ok") and r.get("cold_us"):
                    x = o.get("cold_us") / r["cold_us"] if o.get("cold_us") else None
                    cells.append(f"{fmt(r['cold_us'])} / {fmt(r.get('warm_us'))} | {fmt(x, '{:.3f}')}")
                else:
                    cells.append("ERR | -")
            lines.append(f"| {row['cfg']} | {fmt(o.get('cold_us'))} / {fmt(o.get('warm_us'))} | "
                         + " | ".join(cells) + " |")
    if results.get("errors"):
        lines.append("")
        lines.append("Errors: " + "; ".join(f"{k}: {str(v).strip().splitlines()[-1][:160]}"
                                             for k, v in results["errors"]))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, _stem(results) + ".md"), "w") as f:
        f.write(text)
    return text


def add_args(ap):
    """The sweep's options; run_all.py adds them to its own parser."""
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--configs", default="main", choices=("main", "ext", "pages", "all"))
    ap.add_argument("--quick", action="store_true", help="small fixed subset (%d configs)" % len(QUICK))
    ap.add_argument("--only", default="", help="comma list of config-name substrings")
    ap.add_argument("--out", default=os.path.join(here, "results"))
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--flashmla", default="", metavar="SO:PKG_ROOT",
                    help="also time a FlashMLA build (SM90 dense decode; bf16, page 64): its compiled module "
                         "and the folder holding its flash_mla/ package")
    ap.add_argument("--flashmla-fp8", default="", metavar="SO",
                    help="with --kv-dtype fp8/fp8_mma: also time FlashMLA's SM90 dense FP8 decode from this "
                         "compiled module (vLLM's _flashmla_extension_C.abi3.so; page 64)")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8", "fp8_mma"),
                    help="fp8: float8_e4m3fn cache with k_scale (FlashInfer is not run); TB/s counts 1 byte "
                         "per cached value. fp8_mma: the same with mla_decode(fp8_mma=True)")
    ap.add_argument("--kernel", default=None,
                    help="force one decode kernel (mla_decode's private _kernel=, e.g. rows64, seesaw) on every "
                         "config; a config the kernel cannot run is reported as an error")
    ap.add_argument("--kernels", default="",
                    help="comma list of decode kernels each also timed forced, beside the dispatch's choice in the "
                         "same interleaved replays (an A/B of kernels in one run); JSON rows under mla_attn[NAME]")
    ap.add_argument("--l2-resident", action="store_true",
                    help="every request reads one shared cache of its config's length (each block-table row a "
                         "random order of the same pages), which stays in L2 where it fits (up to ~40 MB): warm "
                         "times then show what bounds a kernel when HBM does not, e.g. whether it can stream at a "
                         "faster card's read rate, measured on a slower one; TB/s counts the bytes the kernel "
                         "reads. Outputs bench_decode*_l2_resident.{json,md}")
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="timing budget per mode per kernel (ms)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="whole-run budget (default 300 s for main/--quick, 340 s for ext/all): rep-ms is "
                         "scaled down when it runs short; configs still left at 1.5x the budget are skipped")


def run(args, extra_kernels=()):
    """The whole sweep: writes <args.out>/bench_decode.{json,md} after every config and returns the
    results dict. extra_kernels: more peers (objects with .name and .prepare(p, c)) timed like FlashInfer;
    they appear in the JSON rows under their name, and in the markdown table only for --flashmla."""
    if args.time_budget_s is None:
        args.time_budget_s = 300.0 if (args.quick or args.configs == "main") else 340.0
    t0 = time.time()
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    props = torch.cuda.get_device_properties(0)
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                sms=props.multi_processor_count, smi_before=smi(), args=vars(args),
                python=sys.version.split()[0])
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    results = dict(info=info, ceilings=None, rows=[], errors=[])
    log(json.dumps(info, indent=1))

    try:
        ours = Ours(args.kernel)
        info["mla_attn_build_info"] = ours.build_info
    except Exception:
        sys.exit("cannot import mla_attn:\n" + traceback.format_exc())
    fi = None
    if not args.no_flashinfer and args.kv_dtype == "bf16":
        try:
            fi = FlashInferFA3()
            info["flashinfer"] = fi.version
            log(f"FlashInfer {fi.version} loaded (backend fa3)")
        except Exception as e:
            results["errors"].append(("flashinfer_import", traceback.format_exc()[-1500:]))
            log(f"FlashInfer not importable, running without it: {e!r}")

    if not args.no_ceilings:
        try:
            results["ceilings"] = measure_ceilings()
            log("ceilings", json.dumps(results["ceilings"]))
        except Exception:
            results["errors"].append(("ceilings", traceback.format_exc()[-1500:]))
            log(traceback.format_exc())

    # FlashMLA live: its bf16 dense decode (--flashmla) or, for an FP8 cache, its dense FP8 one (--flashmla-fp8)
    peer, spec = (FlashMLA, args.flashmla) if args.kv_dtype == "bf16" else (FlashMLAFP8, args.flashmla_fp8)
    if spec:
        try:
            extra_kernels = list(extra_kernels) + [peer(spec)]
            log(f"{peer.__name__} loaded")
        except Exception as e:
            results["errors"].append(("flashmla_import", traceback.format_exc()[-1500:]))
            log(f"{peer.__name__} not importable, running without it: {e!r}")

    timer = GraphTimer()
    cfgs = select_configs(args.configs, args.quick, args.only)
    forced = [Ours(k, beside=True) for k in args.kernels.split(",") if k]
    kerns = [ours] + forced + ([fi] if fi else []) + list(extra_kernels)
    log(f"{len(cfgs)} configs, kernels: {[k.name for k in kerns]}")
    for ci, c in enumerate(cfgs):
        elapsed = time.time() - t0
        left = args.time_budget_s - elapsed
        if left < -0.5 * args.time_budget_s:
            log(f"time budget exhausted: skipping {c['name']} and the rest")
            results["errors"].append(("budget", f"skipped from {c['name']} ({len(cfgs) - ci} configs)"))
            break
        # keep ~half the remaining budget for data/reference/capture; split the rest over timings
        per = max(left, 0.0) * 1e3 * 0.5 / max(1, len(cfgs) - ci) / (2 * len(kerns))
        rep_ms = max(15.0, min(args.rep_ms, per))
        causal = c["s_q"] > 1
        row = dict(cfg=c["name"], grid=c["grid"], h_q=c["h_q"], s_q=c["s_q"], b=c["b"], L=c["L"],
                   page=c["page"], causal=causal, rep_ms=rep_ms)
        try:
            ts = time.time()
            p = make_problem(c, seed=zlib.crc32(c["name"].encode()) & 0x7FFFFFFF, kv_dtype=args.kv_dtype,
                             l2_resident=args.l2_resident)
            ref = reference_fp32(p, causal)
            torch.cuda.synchronize()
            t_ref = time.time() - ts
        except Exception:
            results["errors"].append((c["name"], "data/ref: " + traceback.format_exc()[-1500:]))
            log(f"[{ci + 1}/{len(cfgs)}] {c['name']} data/reference FAILED\n{traceback.format_exc()}")
            torch.cuda.empty_cache()
            continue
        sum_L = int(p["lens_cpu"].sum())
        b, s_q, h_q = c["b"], c["s_q"], c["h_q"]
        kv_bytes = 1 if args.kv_dtype in ("fp8", "fp8_mma") else 2
        row.update(sum_L=sum_L, bytes=sum_L * D_QK * kv_bytes + b * s_q * h_q * (D_QK + D_V) * 2,
                   flops=2 * s_q * h_q * sum_L * (D_QK + D_V))
        log(f"[{ci + 1}/{len(cfgs)}] {c['name']} sum_L={sum_L} KV {sum_L * D_QK * kv_bytes / 1e6:.0f} MB "
            f"data+ref {t_ref:.1f}s rep_ms {rep_ms:.0f} t+{time.time() - t0:.0f}s")
        try:
            row.update(time_metadata(ours, p, c))
        except Exception:
            row["md_error"] = traceback.format_exc()[-1500:]
        for k, r in zip(kerns, run_kernels(kerns, p, c, ref, timer, rep_ms)):
            row["ours" if k is ours else k.name] = r
            if "cold_us" in r:
                log(f"   {k.name:15s} {'ok  ' if r['ok'] else 'FAIL'} relL2 {r['rel_l2']:.1e} "
                    f"maxabs {r['max_abs']:.1e} lse {r['lse_max_abs']:.1e} | cold {r['cold_us']:8.1f} us "
                    f"warm {r['warm_us']:8.1f} us  {row['bytes'] / r['cold_us'] / 1e6:5.2f} TB/s "
                    f"{row['flops'] / r['cold_us'] / 1e6:5.0f} TFLOP/s ({r['reps']} reps)")
            else:
                log(f"   {k.name:15s} ERROR {r['error'].strip().splitlines()[-1][:300]}")
        torch.cuda.empty_cache()
        if "md_us" in row:
            log(f"   get_decode_metadata {row['md_us']:.1f} us (events), {row['md_wall_us']:.1f} us host, "
                f"{row['md_graph_us']:.1f} us in a graph")
        results["rows"].append(row)
        del p, ref
        torch.cuda.empty_cache()
        write_outputs(results, args.out)

    info["smi_after"] = smi()
    info["elapsed_s"] = time.time() - t0
    text = write_outputs(results, args.out)
    log(f"\nwrote {args.out}/bench_decode.json and bench_decode.md in {info['elapsed_s']:.0f}s\n")
    log(text)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    results = run(ap.parse_args())
    n_fail = sum(1 for r in results["rows"] if not r.get("ours", {}).get("ok"))
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
