"""Rotary position embedding of MLA's 64 RoPE dims, with DeepSeek's YaRN context extension.

Pairing: DeepSeek checkpoints rotate adjacent pairs (2i, 2i+1) ("interleaved", GPT-J style; vLLM's
is_neox_style=False). HF's modeling_deepseek gets the same scores by permuting the dims to halves
first and rotating (i, i + 32) ("neox"); both q and k are permuted alike, so attention is unchanged,
only the layout of k_pe in the cache differs. `interleaved=False` is plain neox pairing for models
trained that way. The rotation is computed in fp32 and the result keeps x's layout and dtype.
"""
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's `rope_scaling = {"type": "yarn", ...}` (V3: factor 40, original 4096, beta 32/1,
    mscale 1, mscale_all_dim 1)."""
    factor: float
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def _mscale(factor: float, m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    @property
    def attention_mscale(self) -> float:
        """Factor on q.k: the softmax scale is (d_nope + d_rope)^-0.5 times its square."""
        return self._mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0

    @property
    def rotary_mscale(self) -> float:
        """Factor on cos/sin (1 when mscale == mscale_all_dim, as in V2/V3)."""
        return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)

    def inv_freq(self, dim: int, base: float) -> Tensor:
        """Per-pair frequencies: interpolated (/factor) for long wavelengths, original for short ones,
        blended linearly between the beta_fast and beta_slow rotation counts."""
        def corr_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(self.beta_fast)), 0)
        high = min(math.ceil(corr_dim(self.beta_slow)), dim - 1)
        extra = base ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: keep the original frequency
        return extra / self.factor * (1 - keep) + extra * keep


# One cos/sin table per (dim, max_position, base, scaling, device), shared by every layer that asks for
# it: DeepSeek-V3's 163,840 positions make a 42 MB fp32 table, which 61 layers would otherwise hold
# 61 times. Weak values: a table lives as long as a module holds it.
_TABLES: "weakref.WeakValueDictionary[tuple, Tensor]" = weakref.WeakValueDictionary()


def _cos_sin_table(dim: int, max_position: int, base: float, scaling: Optional[YarnScaling],
                   device: Optional[torch.device | str]) -> Tensor:
    probe = torch.empty(0, device=device)
    device = probe.device  # "cuda" -> "cuda:N", so equal devices share
    # Only plain tensors are shared: not fake ones (a tracing mode), nor inference tensors.
    shared = type(probe) is Tensor and not torch.is_inference_mode_enabled()
    key = (dim, max_position, float(base), scaling, device)
    table = _TABLES.get(key) if shared else None
    if table is None:
        with torch.device("cpu"):  # whatever the default device: the same values everywhere
            if scaling is None:
                inv_freq, mscale = base ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
            else:
                inv_freq, mscale = scaling.inv_freq(dim, base), scaling.rotary_mscale
            angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            table = torch.cat([angles.cos(), angles.sin()], -1) * mscale
        table = table.to(device)
        if shared:
            _TABLES[key] = table
    return table


class RotaryEmbedding(nn.Module):
    """cos/sin table for positions [0, max_position); forward(positions [T], x [T, n, dim]).

    The table is an fp32 buffer, shared by the modules created with the same arguments on the same
    device (create layers with device= to share it: module.to(device) gives each module its own copy).
    Create the layer with dtype= rather than casting it with module.to(dtype), which would round the
    table too. The table is computed on the CPU, so it is the same on every device.
    """

    def __init__(self, dim: int, max_position: int, base: float = 10000.0, interleaved: bool = True,
                 scaling: Optional[YarnScaling] = None, device: Optional[torch.device | str] = None):
        super().__init__()
        self.dim, self.interleaved = dim, interleaved
        # not persistent: derived from the config, so state dicts of checkpoints load without it
        self.register_buffer("cos_sin", _cos_sin_table(dim, max_position, base, scaling, device), persistent=False)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        cos, sin = self.cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, dim / 2]
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2).to(x.dtype)
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
