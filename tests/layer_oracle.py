"""Independent oracle for MLAAttention and a scripted serving scenario, shared by the layer tests.

The oracle is plain un-absorbed MLA written from the DeepSeek equations: for every request it keeps
the hidden states of all its tokens so far, materialises full per-head K and V from them, and runs
standard causal softmax attention; nothing of mla_attn is used (RoPE by complex multiplication, YaRN
frequencies written out per pair).
"""
import math
import random

import torch

import mla_attn
from mla_attn.kv_cache import dequantize_ds_mla_fp8, quantize_ds_mla_fp8, quantize_fp8

D_CACHE, D_LATENT, DS_ROW_BYTES = 576, 512, 656


def init_weights(layer, seed):
    """Unit-gain random weights (x ~ N(0, 1) in, ~N(0, 1) out per projection), so scores have std ~1
    and softmax is neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                w = 1 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            p.copy_(w)
    layer.requires_grad_(False)  # inference, as in serving: no autograd graph, compile traces forward only


def _yarn_m(factor, k):
    return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0


class Oracle:
    def __init__(self, layer, dtype=torch.float64):
        self.cfg, self.dtype = layer.config, dtype
        self.w = {n: p.detach().to(dtype) for n, p in layer.named_parameters()}
        c, d = self.cfg, self.cfg.qk_rope_head_dim
        freqs = []
        ys = c.rope_scaling
        if ys is not None:
            def corr(rot):
                return d * math.log(ys.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(c.rope_theta))
            lo, hi = max(math.floor(corr(ys.beta_fast)), 0), min(math.ceil(corr(ys.beta_slow)), d - 1)
        for i in range(d // 2):
            f = c.rope_theta ** (-2 * i / d)
            if ys is not None:  # pair i interpolated by 1/factor in proportion to its ramp value
                r = min(max((i - lo) / ((hi - lo) or 1e-3), 0.0), 1.0)
                f = f * (1 - r) + f / ys.factor * r
            freqs.append(f)
        self.freqs = torch.tensor(freqs, dtype=torch.float64)
        self.rot_m = _yarn_m(ys.factor, ys.mscale) / _yarn_m(ys.factor, ys.mscale_all_dim) if ys else 1.0
        att_m = _yarn_m(ys.factor, ys.mscale_all_dim) if ys and ys.mscale_all_dim else 1.0
        self.scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5 * att_m ** 2
        self.history = {}  # request -> hidden states of all its tokens [N, hidden]

    def _lin(self, name, x):
        return x @ self.w[name + ".weight"].T

    def _norm(self, name, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * self.w[name + ".weight"]

    def _rope(self, x, pos):
        """x [N, n, 64] rotated by angle pos * f per pair, as complex numbers."""
        ang = pos.to(torch.float64)[:, None, None] * self.freqs.to(pos.device)
        rot = torch.polar(torch.full_like(ang, self.rot_m), ang)
        half = x.shape[-1] // 2
        if self.cfg.rope_interleaved:
            z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * rot
            return torch.stack([z.real, z.imag], -1).flatten(-2).to(x.dtype)
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot
        return torch.cat([z.real, z.imag], -1).to(x.dtype)

    def step(self, requests, cached=None, round_trip=None):
        """requests: [(name, hidden [n_new, hidden])] in batch order. Returns the output [T, hidden].
        cached (FP8 caches): per request, how many leading tokens the layer reads back from the cache;
        their latent and roped k_pe go through round_trip (the cache's encoding and back) first."""
        c, h = self.cfg, self.cfg.num_heads
        outs = []
        for r, (name, x_new) in enumerate(requests):
            x_new = x_new.to(self.dtype)
            x = torch.cat([self.history.get(name, x_new[:0]), x_new])
            self.history[name] = x
            n, N = x_new.shape[0], x.shape[0]
            pos_all = torch.arange(N, device=x.device)
            if c.q_lora_rank is None:
                q = self._lin("q_proj", x_new)
            else:
                q = self._lin("q_b_proj", self._norm("q_a_layernorm", self._lin("q_a_proj", x_new)))
            q = q.view(n, h, -1)
            q = torch.cat([q[..., : c.qk_nope_head_dim], self._rope(q[..., c.qk_nope_head_dim:], pos_all[N - n:])], -1)
            kv_a = self._lin("kv_a_proj_with_mqa", x)
            latent = self._norm("kv_a_layernorm", kv_a[:, : c.kv_lora_rank])
            k_pe = self._rope(kv_a[:, None, c.kv_lora_rank:], pos_all)
            if cached is not None and cached[r]:
                m = cached[r]
                latent, k_pe = latent.clone(), k_pe.clone()
                latent_m, k_pe_m = round_trip(latent[:m], k_pe[:m])
                latent[:m], k_pe[:m] = latent_m.to(self.dtype), k_pe_m.to(self.dtype)
            kv = self._lin("kv_b_proj", latent).view(N, h, -1)
            k = torch.cat([kv[..., : c.qk_nope_head_dim], k_pe.expand(N, h, -1)], -1)
            v = kv[..., c.qk_nope_head_dim:]
            s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            s = s.masked_fill(pos_all[None, :] > pos_all[N - n:, None], float("-inf"))
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
            outs.append(self._lin("o_proj", o.reshape(n, -1)))
        return torch.cat(outs)


def fp8_round_trip(k_scale):
    """(latent, k_pe) -> what a float8_e4m3fn cache with k_scale gives back."""
    return lambda latent, k_pe: (quantize_fp8(latent, k_scale).double() * k_scale,
                                 quantize_fp8(k_pe, k_scale).double() * k_scale)


def ds_mla_fp8_round_trip(latent, k_pe):
    """(latent, k_pe) -> what a ds_mla_fp8 cache gives back (its writer takes the layer's bf16 tokens)."""
    rows = dequantize_ds_mla_fp8(quantize_ds_mla_fp8(latent.bfloat16(), k_pe.bfloat16()))
    return rows[:, :D_LATENT], rows[:, None, D_LATENT:]


class PagedCache:
    """A NaN-poisoned paged latent cache with per-request page lists taken from a shuffled free list.
    A uint8 (ds_mla_fp8) cache is all ones bytes: NaN in each part of a row (e4m3, fp32 scales, bf16)."""

    def __init__(self, num_pages, page_size, dtype, device, seed):
        if dtype == torch.uint8:
            self.kv = torch.full((num_pages, page_size, DS_ROW_BYTES), 255, dtype=dtype, device=device)
        else:
            self.kv = torch.full((num_pages, page_size, D_CACHE), float("nan"), dtype=dtype, device=device)
        self.page_size = page_size
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages, self.lens = {}, {}

    def reserve(self, name, new_tokens):
        """Pages for `new_tokens` more tokens of request `name`; returns its context length before them."""
        ctx = self.lens.get(name, 0)
        pages = self.pages.setdefault(name, [])
        while len(pages) * self.page_size < ctx + new_tokens:
            pages.append(self.free.pop())
        self.lens[name] = ctx + new_tokens
        return ctx


def run_scenario(layer, steps, *, page_size, num_pages, device, decode_threshold, hidden_seed=0, check=None,
                 kv_format="model", k_scale=None, sparse=False, **build_kw):
    """Runs `steps` (lists of (request, new tokens), decodes listed first) through `layer` and the
    oracles; calls check(step, got, want_fp64, want_lowp) after each step. kv_format (write_kv_cache's):
    "model" (the layer's dtype), "fp8" (float8_e4m3fn, k_scale fp32 [1]) or "ds_mla_fp8"; with an FP8
    one the oracles see the tokens the layer reads back from the cache through its encoding: a dense
    decode reads all its keys, a dense prefill its context, a sparse (indices=) token all its keys."""
    cfg, dtype = layer.config, next(layer.parameters()).dtype
    cache_dtype = {"model": dtype, "fp8": torch.float8_e4m3fn, "ds_mla_fp8": torch.uint8}[kv_format]
    round_trip = {"model": None, "fp8": fp8_round_trip(k_scale),
                  "ds_mla_fp8": ds_mla_fp8_round_trip}[kv_format]
    cache = PagedCache(num_pages, page_size, cache_dtype, device, seed=hidden_seed)
    exact, lowp = Oracle(layer, torch.float64), Oracle(layer, dtype)
    g = torch.Generator().manual_seed(hidden_seed)
    for i, step in enumerate(steps):
        xs = [torch.randn(n, cfg.hidden_size, generator=g).to(dtype).to(device) for _, n in step]
        ctx = [cache.reserve(name, n) for name, n in step]
        batch = mla_attn.MLABatch.build([n for _, n in step], ctx, [cache.pages[name] for name, _ in step],
                                        page_size, device, decode_threshold, **build_kw)
        got = layer(torch.cat(xs), cache.kv, batch, k_scale=k_scale)
        reqs = [(name, x) for (name, _), x in zip(step, xs)]
        cached = None
        if round_trip is not None:
            cached = [c + n if sparse or r < batch.num_decodes else c for r, ((_, n), c) in enumerate(zip(step, ctx))]
        want = exact.step(reqs, cached, round_trip)
        check(i, batch, got, want, lowp.step(reqs, cached, round_trip))
    return cache
