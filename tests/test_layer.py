"""MLAAttention over several serving steps (new prompts, chunked prefill with cached context, decode
with 1 and several new tokens, mixed in one batch) against the un-absorbed fp64 oracle
(tests/layer_oracle.py). CPU runs the ops' CPU implementations; the GPU variant runs the kernels."""
import dataclasses
import math

import numpy as np
import pytest
import torch
from layer_oracle import init_weights, run_scenario

import mla_attn
from mla_attn import MLAAttention, MLABatch, MLAConfig, YarnScaling

# (request, new tokens) per step, decodes first (query_len <= decode_threshold = 8 here)
STEPS_CPU = [
    [("c", 3), ("a", 20), ("b", 37)],                           # new prompts; c short -> absorbed path
    [("c", 1), ("a", 1), ("b", 4), ("d", 24), ("e", 40)],       # decode 1 and 4 tokens; new prompts
    [("c", 1), ("a", 2), ("b", 1), ("e", 1), ("d", 30), ("f", 12)],  # d: chunk 2 (context 24), f: new
    [("a", 1), ("b", 3), ("c", 1), ("d", 1), ("e", 1), ("f", 9)],    # f: chunk 2 (context 12)
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)],    # decode only
]

CONFIGS = {
    "q_lora": MLAConfig(hidden_size=256, num_heads=4, q_lora_rank=64),
    "q_proj_neox_yarn": MLAConfig(hidden_size=192, num_heads=3, q_lora_rank=None, rope_interleaved=False,
                                  rope_scaling=YarnScaling(factor=40, mscale=1.0, mscale_all_dim=0.707)),
    "q_lora_yarn_v3": MLAConfig(hidden_size=128, num_heads=2, q_lora_rank=48,
                                rope_scaling=YarnScaling(factor=40, mscale=1.0, mscale_all_dim=1.0)),
}


def check_close(step, batch, got, want, want_lowp, factor):
    """Max |err| of the layer <= factor x the max |err| of the plain bf16 oracle (+ a floor)."""
    assert got.shape == want.shape and got.dtype == want_lowp.dtype
    assert torch.isfinite(got).all(), f"step {step}: non-finite output"
    err = (got.double() - want).abs().max().item()
    base = (want_lowp.double() - want).abs().max().item()
    assert err <= factor * base + 2e-3, f"step {step}: max err {err:.3e} vs bf16 oracle {base:.3e}"


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_unabsorbed_cpu(name, page_size):
    cfg = CONFIGS[name]
    layer = MLAAttention(cfg, dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    routes = []

    def check(i, batch, got, want, lowp):
        routes.append((batch.num_decodes, batch.num_prefills, batch.num_context_tokens > 0))
        # bf16 weights, activations and cache, like the plain bf16 oracle; the CPU ops then attend in
        # fp32, the absorbed path adds one rounding (q_nope @ W_UK). Measured: 0.5-0.75x the oracle's
        # error; a 5% softmax-scale error or swapped RoPE pairing gives > 3x, so 1.5x still catches them.
        check_close(i, batch, got, want, lowp, factor=1.5)

    run_scenario(layer, STEPS_CPU, page_size=page_size, num_pages=1024 // page_size, device="cpu", decode_threshold=8,
                 check=check)
    # the scenario exercised every path
    assert routes[0] == (1, 2, False) and routes[2] == (4, 2, True) and routes[4] == (6, 0, False)


def test_softmax_scale_conventions():
    assert MLAConfig(1, 1).softmax_scale == 192 ** -0.5
    v3 = MLAConfig(1, 1, rope_scaling=YarnScaling(factor=40, mscale=1.0, mscale_all_dim=1.0))
    assert math.isclose(v3.softmax_scale, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert MLAConfig(1, 1, rope_scaling=YarnScaling(factor=40)).softmax_scale == 192 ** -0.5  # mscale_all_dim 0
    with pytest.raises(ValueError, match="kv_lora_rank=512"):
        MLAAttention(MLAConfig(64, 2, kv_lora_rank=256))


def test_layers_share_the_rope_table():
    """One cos/sin table per configuration and device (DeepSeek-V3's 163,840 positions: 42 MB each),
    not one per layer; a different table where the configuration differs."""
    cfg = CONFIGS["q_lora_yarn_v3"]
    a, b = MLAAttention(cfg, dtype=torch.bfloat16), MLAAttention(cfg, dtype=torch.bfloat16, device="cpu")
    assert a.rotary_emb.cos_sin.data_ptr() == b.rotary_emb.cos_sin.data_ptr()
    longer = MLAAttention(dataclasses.replace(cfg, max_position_embeddings=8192), dtype=torch.bfloat16)
    assert longer.rotary_emb.cos_sin.data_ptr() != a.rotary_emb.cos_sin.data_ptr()
    assert torch.equal(longer.rotary_emb.cos_sin[:4096], a.rotary_emb.cos_sin)
    other = MLAAttention(CONFIGS["q_lora"], dtype=torch.bfloat16)  # no YaRN: other frequencies
    assert not torch.equal(other.rotary_emb.cos_sin, a.rotary_emb.cos_sin)
    # tables made under a tracing mode or inference mode are not shared; the default device does not matter
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        MLAAttention(cfg, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert MLAAttention(cfg, dtype=torch.bfloat16).rotary_emb.cos_sin.data_ptr() != a.rotary_emb.cos_sin.data_ptr()
    with torch.device("meta"):
        assert MLAAttention(cfg, dtype=torch.bfloat16, device="cpu").rotary_emb.cos_sin.data_ptr() == \
            a.rotary_emb.cos_sin.data_ptr()
    fresh = MLAAttention(dataclasses.replace(cfg, max_position_embeddings=4097), dtype=torch.bfloat16)
    assert type(fresh.rotary_emb.cos_sin) is torch.Tensor and torch.equal(fresh.rotary_emb.cos_sin[:4096],
                                                                          a.rotary_emb.cos_sin)
    if torch.cuda.is_available():
        on_gpu = MLAAttention(cfg, dtype=torch.bfloat16, device="cuda")
        assert MLAAttention(cfg, dtype=torch.bfloat16, device=torch.device("cuda", torch.cuda.current_device())
                            ).rotary_emb.cos_sin.data_ptr() == on_gpu.rotary_emb.cos_sin.data_ptr()
        assert torch.equal(on_gpu.rotary_emb.cos_sin.cpu(), a.rotary_emb.cos_sin)


def test_batch_build():
    b = MLABatch.build([2, 1, 30], [5, 0, 17], [[7, 3], [9], [1, 2, 4, 6]], 16, "cpu", decode_threshold=8)
    assert (b.num_decodes, b.num_decode_tokens, b.num_prefills, b.num_prefill_tokens) == (2, 3, 1, 30)
    assert (b.max_decode_query_len, b.max_prefill_query_len, b.max_context_len, b.num_context_tokens) == (2, 30, 17, 17)
    assert b.positions.tolist() == [5, 6, 0] + list(range(17, 47))
    assert b.slot_mapping[:3].tolist() == [7 * 16 + 5, 7 * 16 + 6, 9 * 16]
    assert b.slot_mapping[3:].tolist() == [2 * 16 + p % 16 if p < 32 else 4 * 16 + p % 16 for p in range(17, 47)]
    assert b.decode_seq_lens.tolist() == [7, 1] and b.decode_cu_seqlens_q.tolist() == [0, 2, 3]
    assert b.prefill_cu_seqlens_q.tolist() == [0, 30] and b.prefill_cu_context_lens.tolist() == [0, 17]
    assert b.decode_block_table.tolist() == [[7, 3, 0, 0], [9, 0, 0, 0]]
    assert b.decode_metadata is None
    padded = MLABatch.build([1, 1], [4, 0], torch.tensor([[5, 6], [7, 8]], dtype=torch.int32), 16, "cpu",
                            pad_to=4, num_heads=4)
    assert padded.decode_seq_lens.tolist() == [5, 1, 0, 0] and padded.slot_mapping.tolist() == [84, 112, -1, -1]
    assert padded.decode_metadata.req_splits.shape == (4, 2)
    with pytest.raises(ValueError, match="must come before prefills"):
        MLABatch.build([30, 1], [0, 0], [[1, 2], [3]], 16, "cpu", decode_threshold=8)
    with pytest.raises(ValueError, match="cannot hold"):
        MLABatch.build([1], [16], [[1]], 16, "cpu")
    with pytest.raises(ValueError, match="decode_threshold"):
        MLABatch.build([1], [0], [[1]], 16, "cpu", decode_threshold=513)


@pytest.mark.parametrize("lens", [([0], [5], [[0]]), ([], [], [])])
def test_forward_of_a_step_without_tokens(lens):
    """A step with no new token (an empty or idle rank) writes nothing and returns [0, hidden]."""
    layer = MLAAttention(MLAConfig(hidden_size=64, num_heads=2, q_lora_rank=32), dtype=torch.bfloat16)
    kv = torch.full((2, 16, 576), float("nan"), dtype=torch.bfloat16)
    out = layer(torch.zeros(0, 64, dtype=torch.bfloat16), kv, MLABatch.build(*lens, 16, "cpu"))
    assert out.shape == (0, 64) and kv.isnan().all()


def test_forward_refuses_a_batch_that_does_not_fit():
    """A batch built for another page size than the cache's (its slots would land in other requests'
    pages), or reaching past the layer's RoPE table (an index out of range on the device), raises before
    anything is written; copy_ into a captured batch ignores the per-step longest length."""
    layer = MLAAttention(dataclasses.replace(CONFIGS["q_lora"], max_position_embeddings=64), dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    kv = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache has page_size 16 but the batch was built for page_size 32"):
        layer(x, kv, MLABatch.build([1, 1], [5, 9], [[0], [1]], 32, "cpu"))
    with pytest.raises(ValueError, match=r"the batch reaches position 64, past the layer's RoPE table of 64 positions"):
        layer(x, kv, MLABatch.build([1, 1], [64, 9], [[0, 1, 2, 3, 4], [5]], 16, "cpu"))
    assert not kv.any()
    assert torch.isfinite(layer(x, kv, MLABatch.build([1, 1], [63, 9], [[0, 1, 2, 3], [5]], 16, "cpu"))).all()
    static = MLABatch.build([1, 1], [3, 9], torch.tensor([[0, 1, 2, 3], [5, 6, 7, 4]], dtype=torch.int32), 16, "cpu")
    longer = MLABatch.build([1, 1], [40, 9], torch.tensor([[0, 1, 2, 3], [5, 6, 7, 4]], dtype=torch.int32), 16, "cpu")
    static.copy_(longer)
    assert torch.equal(static.decode_seq_lens, longer.decode_seq_lens) and static.max_seq_len == 41
    # host ints from NumPy or a tensor, and a list table padded with -1 past the used pages, as before
    b = MLABatch.build(torch.tensor([1, 1]), np.array([3, 9]), [[0, -1], [5, -1]], np.int64(16), "cpu",
                       pad_to=np.int64(4))
    assert b.slot_mapping.tolist() == [3, 89, -1, -1]


# ------------------------------------------------------------------------------------------------ GPU
STEPS_GPU = [
    [("c", 40), ("a", 700), ("b", 1500)],
    [("c", 1), ("a", 1), ("b", 5), ("d", 300), ("e", 2000)],
    [("c", 1), ("a", 64), ("b", 1), ("e", 1), ("d", 900), ("f", 129)],   # d: chunk 2 (context 300)
    [("a", 1), ("b", 3), ("c", 1), ("d", 1), ("e", 7), ("f", 1000)],     # f: chunk 2 (context 129)
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)],
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,heads", [("q_lora", 16), ("q_lora", 128), ("q_proj_neox_yarn", 5)])
@pytest.mark.parametrize("page_size", [1, 16, 64, 100])
def test_layer_matches_unabsorbed_gpu(name, heads, page_size):
    cfg = dataclasses.replace(CONFIGS[name], num_heads=heads, hidden_size=1024)
    layer = MLAAttention(cfg, dtype=torch.bfloat16)
    init_weights(layer, seed=2)
    layer.cuda()

    def check(i, batch, got, want, lowp):
        # The kernels accumulate in fp32 but round P to bf16 (as the bf16 oracle rounds its softmax
        # output), and split-KV / context merges change the summation order; with the absorbed
        # q_latent rounding this allows 2x the plain bf16 oracle's error (CPU ops: <= 0.75x).
        check_close(i, batch, got, want, lowp, factor=2)

    run_scenario(layer, STEPS_GPU, page_size=page_size, num_pages=4 * 8192 // page_size, device="cuda",
                 decode_threshold=64, check=check, hidden_seed=heads)


def _fp8_layer_check(layer, steps, device, page_size, num_pages, decode_threshold, factor, hidden_seed=0,
                     kv_format="fp8", sparse=False):
    """FP8 cache (kv_format "fp8" with k_scale 0.05, or "ds_mla_fp8"): the oracles see every token the
    layer reads back from the cache through the cache's encoding (decodes: all keys; prefills: the
    context; sparse: all keys), so only the attention arithmetic is compared, as for a 16-bit cache."""
    errs = []

    def check(i, batch, got, want, lowp):
        errs.append(((got.double() - want).abs().max().item(), (lowp.double() - want).abs().max().item()))
        check_close(i, batch, got, want, lowp, factor=factor)

    k_scale = torch.tensor([0.05], dtype=torch.float32, device=device) if kv_format == "fp8" else None
    run_scenario(layer, steps, page_size=page_size, num_pages=num_pages, device=device,
                 decode_threshold=decode_threshold, check=check, kv_format=kv_format, k_scale=k_scale,
                 sparse=sparse, hidden_seed=hidden_seed)
    return errs


def test_layer_fp8_cache_cpu():
    layer = MLAAttention(CONFIGS["q_lora"], dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    # Same bound as the 16-bit CPU test; measured here: 0.6-1.1x the bf16 oracle's error per step.
    _fp8_layer_check(layer, STEPS_CPU, "cpu", 16, 64, 8, factor=1.5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_layer_ds_mla_fp8_cache_cpu(page_size):
    """DeepSeek-V3.2's cache under dense attention: decode reads it, prefill gathers its context."""
    layer = MLAAttention(CONFIGS["q_lora"], dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    _fp8_layer_check(layer, STEPS_CPU, "cpu", page_size, 64 * 16 // page_size, 8, factor=1.5, kv_format="ds_mla_fp8")


def test_layer_fp8_oracle_catches_a_wrong_scale():
    """The FP8 check can fail: decode reading the cache with k_scale 5% off misses the oracle."""
    layer = MLAAttention(CONFIGS["q_lora"], dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    real = layer._decode
    layer._decode = lambda q_nope, q_pe, kv, batch, k_scale, fp8_mma: real(q_nope, q_pe, kv, batch, k_scale * 1.05,
                                                                         fp8_mma)
    with pytest.raises(AssertionError, match="max err"):
        _fp8_layer_check(layer, STEPS_CPU, "cpu", 16, 64, 8, factor=1.5)


def test_layer_fp8_mma_cpu():
    """forward(fp8_mma=True) reaches mla_decode: ValueError on a bf16 cache; on an FP8 cache the CPU ops
    compute in fp32 whatever fp8_mma says, so the result equals fp8_mma=False bit for bit."""
    layer = MLAAttention(dataclasses.replace(CONFIGS["q_lora"], num_heads=32), dtype=torch.bfloat16)
    init_weights(layer, seed=1)
    k_scale = torch.tensor([0.05])
    # two requests with 5 and 9 cached tokens decode one token each (32 heads: above 16 rows)
    prefill = MLABatch.build([5, 9], [0, 0], [[0], [1]], 16, "cpu")
    decode = MLABatch.build([1, 1], [5, 9], [[0], [1]], 16, "cpu")
    x = torch.randn(14, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for dtype, scale in ((torch.bfloat16, None), (torch.float8_e4m3fn, k_scale)):
        kv = torch.zeros(2, 16, 576, dtype=dtype)
        layer(x, kv, prefill, k_scale=scale)
        if scale is None:
            with pytest.raises(ValueError, match="fp8_mma=True needs a float8_e4m3fn kv_cache"):
                layer(x[:2], kv, decode, fp8_mma=True)
            continue
        exact = layer(x[:2], kv, decode, k_scale=scale)
        e4m3 = layer(x[:2], kv, decode, k_scale=scale, fp8_mma=True)
        assert torch.isfinite(e4m3).all() and torch.equal(e4m3, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8", "ds_mla_fp8"])
@pytest.mark.parametrize("heads,page_size", [(16, 64), (128, 16)])
def test_layer_fp8_cache_gpu(heads, page_size, kv_format):
    cfg = dataclasses.replace(CONFIGS["q_lora"], num_heads=heads, hidden_size=1024)
    layer = MLAAttention(cfg, dtype=torch.bfloat16)
    init_weights(layer, seed=2)
    layer.cuda()
    _fp8_layer_check(layer, STEPS_GPU, "cuda", page_size, 4 * 8192 // page_size, 64, factor=2, hidden_seed=heads,
                     kv_format=kv_format)
