"""Fake (shape-only) kernels and CPU implementations of the ops defined in csrc/bindings/ops.cpp.

Fakes let torch.compile / export trace the ops without running them; output shapes depend on input
shapes only. The CPU kernels run the pure-PyTorch reference so the ops work (slowly) without a GPU.
CUDA kernels are registered from C++ (decode_api.cpp).
"""
import torch

from . import _C  # noqa: F401  (registers the mla_attn schemas)
from .metadata import DECODE_KERNELS, metadata_shapes, schedule_cpu
from .reference import D_V, mla_decode_ref


def _out_shapes(q):
    return q.shape[:-1] + (D_V,), q.shape[:-1]


# ---------------------------------------------------------------------------------------------- fakes
@torch.library.register_fake("mla_attn::get_decode_metadata")
def _(cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, causal, num_sm_parts, num_sms, *,
      deterministic=False):
    sched_shape, splits_shape = metadata_shapes(cache_seqlens.shape[0], num_sms)
    return (cache_seqlens.new_empty(sched_shape, dtype=torch.int32),
            cache_seqlens.new_empty(splits_shape, dtype=torch.int32))


@torch.library.register_fake("mla_attn::mla_decode")
def _(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
      tile_sched, req_splits, num_sm_parts, *, k_scale=None, deterministic=False, fp8_mma=False,
      kernel=None):
    out_shape, lse_shape = _out_shapes(q)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("mla_attn::mla_decode_out")
def _(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
      tile_sched, req_splits, num_sm_parts, out, lse, *, k_scale=None, deterministic=False, fp8_mma=False,
      kernel=None):
    return None


# ----------------------------------------------------------------------------------------- CPU kernels
@torch.library.register_kernel("mla_attn::get_decode_metadata", "cpu")
def _(cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, causal, num_sm_parts, num_sms, *,
      deterministic=False):
    return schedule_cpu(cache_seqlens, cu_seqlens_q, max_seqlen_q, num_heads_q, num_sm_parts, num_sms,
                        deterministic)


def _decode_cpu(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, softmax_scale, causal,
                k_scale, kernel):
    # The reference stands in for every split kernel; a name the CUDA op would refuse as unknown is
    # refused here too.
    if kernel is not None and kernel not in DECODE_KERNELS:
        raise ValueError(f"mla_attn: unknown decode kernel {kernel!r}; the kernels are {', '.join(DECODE_KERNELS)}")
    if k_scale is not None:  # FP8 cache: the reference runs on the dequantized values
        kv_cache = kv_cache.float() * k_scale.float()
    # The reference needs no schedule: the split-KV partition only changes the summation order. It
    # computes in float32 whatever fp8_mma says (fp8_mma only trades the GPU kernels' accuracy for speed).
    return mla_decode_ref(q, kv_cache, block_table, cache_seqlens, cu_seqlens_q=cu_seqlens_q, q_pe=q_pe,
                          softmax_scale=softmax_scale, causal=causal)


@torch.library.register_kernel("mla_attn::mla_decode", "cpu")
def _(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
      tile_sched, req_splits, num_sm_parts, *, k_scale=None, deterministic=False, fp8_mma=False,
      kernel=None):
    out, lse = _decode_cpu(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, softmax_scale,
                           causal, k_scale, kernel)
    return out.to(q.dtype), lse.float()


@torch.library.register_kernel("mla_attn::mla_decode_out", "cpu")
def _(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
      tile_sched, req_splits, num_sm_parts, out, lse, *, k_scale=None, deterministic=False, fp8_mma=False,
      kernel=None):
    o, l = _decode_cpu(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, softmax_scale,
                       causal, k_scale, kernel)
    out.copy_(o)
    lse.copy_(l)
