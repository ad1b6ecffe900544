"""Toy serving loop around one MLAAttention layer: continuous batching over a paged latent cache.

Random small DeepSeek-like weights (q LoRA, YaRN RoPE). Each step the scheduler puts the decoding
requests first (one new token each), then fills a token budget with prompt chunks (chunked prefill:
long prompts span several steps and attend to their cached context). There is no vocabulary: a
request's next input is the RMS-normalised layer output of its last token, so the loop is
autoregressive. After every step the outputs are checked against an un-absorbed computation (full
per-head K/V materialised from every token so far, torch SDPA). Runs on an sm_90 GPU if present, else
through the ops' CPU implementations.
"""
import math

import torch
import torch.nn.functional as F

import mla_attn
from mla_attn import MLAAttention, MLABatch, MLAConfig, YarnScaling


def unabsorbed(layer, x, num_new):
    """Outputs of the last num_new of a request's tokens x [N, hidden]: MHA over up-projected K/V."""
    c, N, h = layer.config, x.shape[0], layer.config.num_heads
    pos = torch.arange(N, device=x.device)
    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x[N - num_new:]))).view(num_new, h, -1)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    latent, k_pe = layer.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    kv = layer.kv_b_proj(layer.kv_a_layernorm(latent)).view(N, h, -1)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
    q = torch.cat([q_nope, layer.rotary_emb(pos[N - num_new:], q_pe)], -1)
    k = torch.cat([k_nope, layer.rotary_emb(pos, k_pe[:, None]).expand(N, h, -1)], -1)
    visible = pos[None, :] <= pos[N - num_new:, None]  # causal: token i sees keys up to its position
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                       v.transpose(0, 1).float(), attn_mask=visible, scale=layer.softmax_scale)
    return layer.o_proj(o.transpose(0, 1).reshape(num_new, -1).to(x.dtype))


def main():
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    device = "cuda" if on_gpu else "cpu"
    torch.manual_seed(0)
    heads, hidden = (16, 1024) if on_gpu else (4, 256)
    cfg = MLAConfig(hidden_size=hidden, num_heads=heads, q_lora_rank=192,
                    rope_scaling=YarnScaling(factor=40, mscale=1.0, mscale_all_dim=1.0))  # DeepSeek-V3 style
    layer = MLAAttention(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # unit-gain weights: activations and scores of order 1
        for name, p in layer.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "layernorm" in name else torch.randn_like(p) / math.sqrt(p.shape[1]))
    layer.to(device)

    page_size, budget, decode_threshold, gen_tokens = 64 if on_gpu else 16, 512 if on_gpu else 96, 8, 6
    prompts = [700, 45, 1300, 3, 260] if on_gpu else [150, 20, 70, 3]
    num_pages = sum(math.ceil((p + gen_tokens) / page_size) for p in prompts)
    kv_cache = torch.full((num_pages, page_size, 576), float("nan"), dtype=torch.bfloat16, device=device)
    free_pages = torch.randperm(num_pages).tolist()
    reqs = [dict(prompt=torch.randn(p, hidden, dtype=torch.bfloat16, device=device), done=0, pages=[],
                 history=[], generated=0) for p in prompts]

    print(f"serve_toy on {torch.cuda.get_device_name() if on_gpu else 'CPU (reference ops)'}: "
          f"{len(prompts)} requests, prompts {prompts}, {gen_tokens} generated tokens each, {heads} heads, "
          f"page size {page_size}, token budget {budget}/step, softmax_scale {layer.softmax_scale:.4f}")
    step, worst = 0, 0.0
    with torch.no_grad():
        while any(r["generated"] < gen_tokens for r in reqs):
            # schedule: decodes first (prompt done), then prompt chunks within the token budget
            decodes = [r for r in reqs if r["done"] == r["prompt"].shape[0] and 0 < r["generated"] < gen_tokens]
            chunks, left = [], budget - len(decodes)
            for r in reqs:
                rest = r["prompt"].shape[0] - r["done"]
                if rest and left > 0:
                    chunks.append((r, min(rest, left)))
                    left -= chunks[-1][1]
            sched = [(r, 1) for r in decodes] + chunks
            sched.sort(key=lambda rn: rn[1] > decode_threshold)  # short prompt chunks ride in the decode path
            xs, ctx = [], []
            for r, n in sched:
                x = r["prompt"][r["done"]:r["done"] + n] if r["done"] < r["prompt"].shape[0] else r["next"]
                ctx.append(sum(t.shape[0] for t in r["history"]))
                while len(r["pages"]) * page_size < ctx[-1] + n:
                    r["pages"].append(free_pages.pop())
                xs.append(x)
            batch = MLABatch.build([n for _, n in sched], ctx, [r["pages"] for r, _ in sched], page_size, device,
                                   decode_threshold, num_heads=heads)
            out = layer(torch.cat(xs), kv_cache, batch)
            assert torch.isfinite(out).all(), "read a cache slot that was never written"

            err, off = 0.0, 0
            for (r, n), x in zip(sched, xs):
                r["history"].append(x)
                o = out[off:off + n]
                off += n
                want = unabsorbed(layer, torch.cat(r["history"]), n)
                err = max(err, ((o.float() - want.float()).abs().max() / want.float().abs().max()).item())
                if r["done"] < r["prompt"].shape[0]:
                    r["done"] += n
                if r["done"] == r["prompt"].shape[0]:  # prompt finished or a decode: one more token
                    r["generated"] += 1
                    r["next"] = F.rms_norm(o[-1:].float(), (hidden,)).to(torch.bfloat16)
            worst = max(worst, err)
            print(f"  step {step}: {batch.num_decodes} decode requests ({batch.num_decode_tokens} tokens), "
                  f"{batch.num_prefills} prefill chunks ({batch.num_prefill_tokens} tokens, "
                  f"{batch.num_context_tokens} cached context tokens); max rel err vs un-absorbed {err:.2e}")
            step += 1
    print(f"done in {step} steps; {sum(len(r['pages']) for r in reqs)} of {num_pages} pages used; worst rel err {worst:.2e}")
    assert worst < 5e-2, "paged absorbed/chunked attention does not match the un-absorbed computation"
    print("OK")


if __name__ == "__main__":
    main()
