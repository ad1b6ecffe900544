"""A seeded slice of a mutation fuzz of the public entry points' argument checks (CPU): valid calls with
one or two arguments changed at random (dtype, rank, layout, device, Python type, range). Every call must either
run or raise TypeError / ValueError (the rule of mla_attn/_validation.py), never another exception."""
import random

import pytest
import torch
from cases import make_decode_case, make_prefill_case

import mla_attn

BF = torch.bfloat16


def _decode_call():
    c = make_decode_case([20, 3], 2, 4, 16, seed=1)
    return mla_attn.mla_decode, dict(q=c["q"], kv_cache=c["kv_cache"], block_table=c["block_table"],
                                     cache_seqlens=c["cache_seqlens"], softmax_scale=0.1, causal=True,
                                     return_lse=True, out=torch.empty(2, 2, 4, 512, dtype=BF))


def _metadata_call():
    return mla_attn.get_decode_metadata, dict(cache_seqlens=torch.tensor([5, 0, 9], dtype=torch.int32),
                                              num_heads_q=4, s_q=1, causal=False)


def _sparse_call():
    c = make_decode_case([20, 3], 1, 4, 16, seed=2)
    return mla_attn.mla_sparse_decode, dict(q=c["q"][:, 0], kv_cache=c["kv_cache"].nan_to_num(),
                                            indices=torch.tensor([[0, 3, -1], [7, 7, 40]], dtype=torch.int32),
                                            softmax_scale=0.1, topk_length=torch.tensor([3, 2], dtype=torch.int32),
                                            return_lse=True)


def _prefill_call():
    c = make_prefill_case([5, 3], [7, 3], 4, split_pe=True, pad=0)
    return mla_attn.mla_prefill, dict(q=c["q"], k=c["k"], v=c["v"], cu_seqlens_q=c["cu_seqlens_q"],
                                      cu_seqlens_k=c["cu_seqlens_k"], max_seqlen_q=5, max_seqlen_k=7,
                                      softmax_scale=0.1, causal=True, k_pe=c["k_pe"])


def _write_call():
    return mla_attn.write_kv_cache, dict(kv_c=torch.randn(3, 512).to(BF), k_pe=torch.randn(3, 64).to(BF),
                                         kv_cache=torch.zeros(2, 16, 576, dtype=BF),
                                         slot_mapping=torch.tensor([4, -1, 30]))


def _gather_call():
    return mla_attn.gather_kv_cache, dict(kv_cache=torch.randn(3, 16, 576).to(BF),
                                          block_table=torch.tensor([[2, 0], [1, 1]], dtype=torch.int32),
                                          cu_seqlens=torch.tensor([0, 20, 25], dtype=torch.int32), num_tokens=27)


def _merge_call():
    return mla_attn.merge_attn_states, dict(out_a=torch.randn(3, 2, 16).to(BF), lse_a=torch.randn(3, 2),
                                            out_b=torch.randn(3, 2, 16).to(BF), lse_b=torch.randn(3, 2))


def _decode_fp8_call():
    c = make_decode_case([20, 3], 2, 4, 16, seed=3)
    scale = torch.tensor([0.05])
    kv = (c["kv_cache"].nan_to_num() / scale).to(torch.float8_e4m3fn)
    return mla_attn.mla_decode, dict(q=c["q"][..., :512].contiguous(), q_pe=c["q"][..., 512:].contiguous(), kv_cache=kv,
                                     block_table=c["block_table"], cache_seqlens=c["cache_seqlens"], k_scale=scale,
                                     fp8_mma=True, q_scale=torch.tensor([0.5]), attn_sink=torch.zeros(4),
                                     softmax_scale=0.1, return_lse=True)


def _sparse_ds_call():
    rows = mla_attn.quantize_ds_mla_fp8(torch.randn(32, 512).to(BF), torch.randn(32, 64).to(BF))
    return mla_attn.mla_sparse_decode, dict(q=torch.randn(2, 4, 576).to(BF), kv_cache=rows.view(2, 16, 656),
                                            indices=torch.tensor([[0, 31, -1], [7, 7, 40]], dtype=torch.int32),
                                            softmax_scale=0.1, topk_length=torch.tensor([3, 2], dtype=torch.int32),
                                            attn_sink=torch.zeros(4), return_lse=True)


def _sparse_prefill_call():
    return mla_attn.mla_sparse_prefill, dict(q=torch.randn(2, 4, 576).to(BF), kv=torch.randn(6, 576).to(BF),
                                             indices=torch.tensor([[0, 5, -1], [2, 9, 2]], dtype=torch.int32),
                                             softmax_scale=0.1, topk_length=torch.tensor([3, 1], dtype=torch.int32),
                                             return_lse=True)


_LAYER = mla_attn.MLAAttention(mla_attn.MLAConfig(hidden_size=64, num_heads=2, q_lora_rank=32), dtype=BF)


def _layer_call():
    batch = mla_attn.MLABatch.build([1, 3], [5, 0], [[0, 1], [2, 3]], 16, "cpu", decode_threshold=1)
    return _LAYER.forward, dict(hidden_states=torch.randn(4, 64).to(BF), kv_cache=torch.zeros(4, 16, 576, dtype=BF),
                                batch=batch)


def _batch_call():
    return mla_attn.MLABatch.build, dict(query_lens=[1, 3], context_lens=[5, 0],
                                         block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), page_size=16,
                                         device="cpu", decode_threshold=1)


def _cp_slice_call():
    return mla_attn.cp_slice, dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
                                   cache_seqlens=torch.tensor([40, 7], dtype=torch.int32), page_size=16,
                                   world_size=2, rank=1)


def _cp_token_slot_call():
    return mla_attn.cp_token_slot, dict(positions=torch.tensor([0, 17, 40]), page_size=16, world_size=2)


CALLS = [_decode_call, _metadata_call, _sparse_call, _prefill_call, _write_call, _gather_call, _merge_call,
         _decode_fp8_call, _sparse_ds_call, _sparse_prefill_call, _layer_call, _batch_call, _cp_slice_call,
         _cp_token_slot_call]

TENSOR_CHANGES = [
    lambda t, r: t.to(r.choice([torch.float32, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8])),
    lambda t, r: t[0] if t.dim() else t,  # a dim less
    lambda t, r: t.unsqueeze(r.randrange(t.dim() + 1)),  # a dim more
    lambda t, r: t.transpose(-1, -2) if t.dim() > 1 else t.flip(0),
    lambda t, r: t[:0],  # zero size
    lambda t, r: t[..., : max(t.shape[-1] - 1, 0)] if t.dim() else t,  # last dim one short
    lambda t, r: t.to("meta"),
    lambda t, r: t.reshape(-1)[:1].expand(t.shape) if t.numel() else t,  # every element one address
    lambda t, r: torch.cat([t.reshape(-1), t.reshape(-1)[:1]])[1:].view(t.shape) if t.numel() else t,  # start shifted
]
VALUE_CHANGES = [None, "x", -1, 0, 2**63, 1.5, float("nan"), [1, 2], True]


def _mutate(kw, r):
    name = r.choice(sorted(kw))
    value = kw[name]
    if isinstance(value, torch.Tensor) and r.random() < 0.8:
        kw[name] = r.choice(TENSOR_CHANGES)(value, r)
    else:
        kw[name] = r.choice(VALUE_CHANGES)
    return name


@pytest.mark.parametrize("call", CALLS, ids=[c.__name__.strip("_") for c in CALLS])
def test_bad_arguments_raise_type_or_value_errors(call):
    fn, valid = call()
    fn(**valid)  # the base call is valid
    name = getattr(fn, "__qualname__", fn.__name__)
    for i in range(300):
        r = random.Random(i)
        kw = dict(valid)
        changed = [_mutate(kw, r) for _ in range(r.choice((1, 2)))]
        try:
            fn(**kw)
        except (TypeError, ValueError):
            pass
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{name} with {changed} changed (seed {i}): {type(e).__name__}: {e}")
