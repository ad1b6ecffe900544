"""FP8 (e4m3) copies of the decode test cases: the cache quantised the way write_kv_cache stores it."""
import torch

from mla_attn.kv_cache import quantize_fp8

K_SCALE = 0.02  # unit-scale data / 0.02 spans about +-200 of e4m3's +-448: no saturation


def to_fp8_case(case, k_scale=K_SCALE):
    """The case with kv_cache in float8_e4m3fn (NaN-poisoned slots stay NaN) and k_scale [1] added."""
    scale = torch.tensor([k_scale], dtype=torch.float32, device=case["kv_cache"].device)
    return {**case, "kv_cache": quantize_fp8(case["kv_cache"], scale), "k_scale": scale}


def dequantized(case):
    """The case as the reference sees it: the cache's real values (stored * k_scale) in float32."""
    return {**case, "kv_cache": case["kv_cache"].float() * case["k_scale"]}
