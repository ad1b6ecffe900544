"""FP8 copies of the decode test cases: the cache quantised the way write_kv_cache stores it, as a
float8_e4m3fn cache with a per-tensor k_scale or as DeepSeek-V3.2's uint8 ds_mla_fp8 rows."""
import torch

from mla_attn.kv_cache import dequantize_ds_mla_fp8, quantize_ds_mla_fp8, quantize_fp8

K_SCALE = 0.02  # unit-scale data / 0.02 spans about +-200 of e4m3's +-448: no saturation
D_V, D_QK, DS_ROW_BYTES = 512, 576, 656


def to_fp8_case(case, k_scale=K_SCALE):
    """The case with kv_cache in float8_e4m3fn (NaN-poisoned slots stay NaN) and k_scale [1] added."""
    scale = torch.tensor([k_scale], dtype=torch.float32, device=case["kv_cache"].device)
    return {**case, "kv_cache": quantize_fp8(case["kv_cache"], scale), "k_scale": scale}


def to_ds_case(case):
    """The case with kv_cache as uint8 ds_mla_fp8 rows of the same shape but the last dim (656 bytes;
    NaN-poisoned slots stay NaN: a NaN makes its group's scale NaN)."""
    kv = case["kv_cache"]
    flat = kv.reshape(-1, D_QK)
    rows = quantize_ds_mla_fp8(flat[:, :D_V], flat[:, D_V:])
    return {**case, "kv_cache": rows.view(*kv.shape[:-1], DS_ROW_BYTES)}


def dequantized(case):
    """The case as the reference sees it: the cache's real values in float32 (stored * k_scale, or the
    ds_mla_fp8 rows dequantised)."""
    if case["kv_cache"].dtype == torch.uint8:
        return {**case, "kv_cache": dequantize_ds_mla_fp8(case["kv_cache"])}
    return {**case, "kv_cache": case["kv_cache"].float() * case["k_scale"]}
