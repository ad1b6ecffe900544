"""MLAAttention: a DeepSeek-V2/V3 attention layer over a paged latent KV cache, built on mla_attn's ops.

Weights and their names follow the DeepSeek checkpoints (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), so a checkpoint's attention state dict loads.
Per token:  q = q_b(norm(q_a(x))) -> h x [nope 128 | rope 64];  kv_a(x) -> [latent 512 | k_pe 64];
the cache row is [norm(latent) | rope(k_pe)] (576 dims, shared by all heads); kv_b maps a latent to
h x [k_nope 128 | v 128], i.e. W_UK [h, 128, 512] and W_UV [h, 512, 128].
Decode requests run absorbed (q_nope @ W_UK against the latent cache, then @ W_UV); prefills run
MHA-style on up-projected K/V, plus their cached context for later chunks of a chunked prefill.
With indices= (DeepSeek-V3.2: top-k cache slots per token from the model's indexer), every token,
decode or prefill, runs absorbed sparse attention over the slots it names (mla_sparse_decode).
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mla_attn as ops  # the public ops; resolved at call time, so import order does not matter
from . import _validation as check
from .batch import MLABatch
from .rotary import RotaryEmbedding, YarnScaling


@dataclass(frozen=True)
class MLAConfig:
    """The attention hyper-parameters of a DeepSeek-V2/V3 checkpoint (HF config names)."""
    hidden_size: int
    num_heads: int                        # heads of this rank (after tensor parallelism)
    q_lora_rank: Optional[int] = 1536     # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleaved: bool = True         # DeepSeek: pairs (2i, 2i+1); see rotary.py
    max_position_embeddings: int = 4096   # size of the cos/sin table
    rope_scaling: Optional[YarnScaling] = None

    @property
    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5 * mscale^2: the scale of q.k in the un-absorbed model. Absorbing
        W_UK does not change q.k, so the decode kernel takes the same scale (not 576^-0.5)."""
        mscale = self.rope_scaling.attention_mscale if self.rope_scaling else 1.0
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * mscale * mscale


class RMSNorm(nn.RMSNorm):
    """DeepSeek's RMSNorm: statistics and scaling in fp32, result in the input dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


class MLAAttention(nn.Module):
    """DeepSeek MLA attention over a paged latent KV cache (see the module docstring)."""

    def __init__(self, config: MLAConfig, *, device: Optional[torch.device | str] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        check.check_layer_config(config)
        c, kw = config, dict(device=device, dtype=dtype)
        self.config = c
        h, d_qk = c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, h * d_qk, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps, **kw)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * d_qk, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps, **kw)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=False, **kw)
        self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.max_position_embeddings, c.rope_theta,
                                          c.rope_interleaved, c.rope_scaling, device=device)
        self.softmax_scale = c.softmax_scale

    # kv_b_proj.weight [h * (nope + v), 512] viewed per head; views, so they follow weight updates
    def _w_kv_b(self) -> Tensor:
        c = self.config
        return self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)

    @property
    def w_uk(self) -> Tensor:
        """[h, 128, 512]: k_nope = W_UK @ latent."""
        return self._w_kv_b()[:, : self.config.qk_nope_head_dim]

    @property
    def w_uv(self) -> Tensor:
        """[h, 512, 128]: v = latent @ W_UV."""
        return self._w_kv_b()[:, self.config.qk_nope_head_dim:].transpose(1, 2)

    def _up_project(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """latent [N, 512] -> k_nope [N, h, 128], v [N, h, 128] (views of one GEMM's output)."""
        c = self.config
        kv = self.kv_b_proj(latent).view(-1, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        return kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)

    def forward(self, hidden_states: Tensor, kv_cache: Tensor, batch: MLABatch, *,
                k_scale: Optional[Tensor] = None, indices: Optional[Tensor] = None,
                topk_length: Optional[Tensor] = None, indices_valid: bool = False,
                sparse_metadata: Optional[ops.SparseDecodeMetadata] = None, fp8_mma: bool = False) -> Tensor:
        """hidden_states [T, hidden] in batch order (decode tokens first); kv_cache [num_pages,
        page_size, 576] in the layer's dtype, or float8_e4m3fn with k_scale (fp32 [1]), or uint8
        [num_pages, page_size, 656] in DeepSeek-V3.2's ds_mla_fp8 layout (dense or sparse), written
        in place; batch: this step's MLABatch. Returns [T, hidden].
        indices int32 [T, topk] (sparse attention): the cache slots (page * page_size + row) each token
        attends to, this step's own tokens included (they are written to the cache first); -1 and
        slots outside the cache are skipped; topk_length int32 [T] (optional) counts the first ones of
        each row; indices_valid=True: every counted index is a cache slot (mla_sparse_decode's option:
        no compaction); sparse_metadata: get_sparse_decode_metadata(indices, num_heads), made once per step
        for all layers (it depends on shapes only; when omitted, the one an earlier call of the same
        shapes made is reused).
        fp8_mma=True (float8_e4m3fn cache only): passed to mla_decode for the decode requests, whose
        MMAs then run in e4m3 above 16 query rows per request (h * query_len > 16; any with a
        deterministic batch); see mla_decode. mla_decode checks it: a step with decode requests raises
        ValueError on another cache. Prefills and sparse attention (indices=) do not use it."""
        c = self.config
        weight = getattr(self.kv_a_proj_with_mqa, "weight", None)
        check.check_layer_call(hidden_states, kv_cache, batch, c.hidden_size, weight, self.rotary_emb.cos_sin.shape[0],
                               fp8_mma, indices, topk_length, indices_valid, sparse_metadata)
        T, h = hidden_states.shape[0], c.num_heads
        if c.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(T, h, c.qk_nope_head_dim + c.qk_rope_head_dim).split(  # T may be 0
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = self.rotary_emb(batch.positions, q_pe)                 # [T, h, 64]
        k_pe = self.rotary_emb(batch.positions, k_pe.unsqueeze(1))    # [T, 1, 64]
        ops.write_kv_cache(latent, k_pe.squeeze(1), kv_cache, batch.slot_mapping, k_scale=k_scale)

        if indices is not None:
            attn = self._sparse(q_nope, q_pe, kv_cache, indices, topk_length, indices_valid, sparse_metadata, k_scale)
            return self.o_proj(attn.reshape(T, h * c.v_head_dim))
        n_d = batch.num_decode_tokens
        parts = []
        if n_d:
            parts.append(self._decode(q_nope[:n_d], q_pe[:n_d], kv_cache, batch, k_scale, fp8_mma))
        if batch.num_prefill_tokens:
            parts.append(self._prefill(q_nope[n_d:], q_pe[n_d:], latent[n_d:], k_pe[n_d:], kv_cache, batch, k_scale))
        if not parts:
            return self.o_proj(q.new_zeros(T, h * c.v_head_dim))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(attn.reshape(T, h * c.v_head_dim))

    def _decode(self, q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, batch: MLABatch,
                k_scale: Optional[Tensor], fp8_mma: bool) -> Tensor:
        """Absorbed: scores q_nope.(W_UK c) = (q_nope W_UK).c, so attend in the 512-dim latent space."""
        q_latent = torch.einsum("thd,hdc->thc", q_nope, self.w_uk)
        out = ops.mla_decode(q_latent, kv_cache, batch.decode_block_table, batch.decode_seq_lens,
                             cu_seqlens_q=batch.decode_cu_seqlens_q, max_seqlen_q=batch.max_decode_query_len,
                             q_pe=q_pe, softmax_scale=self.softmax_scale, causal=True,
                             metadata=batch.decode_metadata, deterministic=batch.deterministic, k_scale=k_scale,
                             fp8_mma=fp8_mma)
        return torch.einsum("thc,hcv->thv", out, self.w_uv)

    def _sparse(self, q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, indices: Tensor, topk_length: Optional[Tensor],
                indices_valid: bool, metadata: Optional[ops.SparseDecodeMetadata], k_scale: Optional[Tensor]) -> Tensor:
        """Absorbed like _decode, for every token: with top-k keys per token, attending in the latent
        space reads at most topk cache rows, where up-projecting them per token would cost more."""
        q_latent = torch.einsum("thd,hdc->thc", q_nope, self.w_uk)
        out = ops.mla_sparse_decode(q_latent, kv_cache, indices, q_pe=q_pe, softmax_scale=self.softmax_scale,
                                    topk_length=topk_length, indices_valid=indices_valid, k_scale=k_scale,
                                    metadata=metadata)
        return torch.einsum("thc,hcv->thv", out, self.w_uv)

    def _prefill(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, kv_cache: Tensor, batch: MLABatch,
                 k_scale: Optional[Tensor]) -> Tensor:
        """Causal over the chunk's own tokens; for chunks with cached context, non-causal over the
        context (gathered from the cache and up-projected), merged by LSE."""
        q = torch.cat([q_nope, q_pe], dim=-1)
        k_nope, v = self._up_project(latent)
        cu_q, max_q = batch.prefill_cu_seqlens_q, batch.max_prefill_query_len
        with_context = batch.num_context_tokens > 0
        new = ops.mla_prefill(q, k_nope, v, cu_q, cu_q, max_q, max_q, softmax_scale=self.softmax_scale,
                              causal=True, return_lse=with_context, k_pe=k_pe)
        if not with_context:
            return new
        ctx = ops.gather_kv_cache(kv_cache, batch.prefill_block_table, batch.prefill_cu_context_lens,
                                  batch.num_context_tokens, k_scale=k_scale, out_dtype=q.dtype)
        ctx_latent, ctx_pe = ctx.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        ctx_nope, ctx_v = self._up_project(ctx_latent)
        old = ops.mla_prefill(q, ctx_nope, ctx_v, cu_q, batch.prefill_cu_context_lens, max_q,
                              batch.max_context_len, softmax_scale=self.softmax_scale, causal=False,
                              return_lse=True, k_pe=ctx_pe.unsqueeze(1))
        out, _ = ops.merge_attn_states(old[0], old[1], new[0], new[1])
        return out
