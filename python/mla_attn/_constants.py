"""Sizes and limits the kernels are built for, shared by the ops, their checks and the reference."""
import torch

# decode: absorbed MLA over the latent cache
D_QK = 576  # a cache row and a q row: latent (512) + rope (64)
D_V = 512  # V is the first 512 dims of the latent cache
D_PE = D_QK - D_V  # the rope part
MAX_HEADS_Q = 128
MAX_SEQLEN_Q = 512  # query tokens per request
PAGE_SIZE_MIN, PAGE_SIZE_MAX = 1, 256  # below 16, or not a multiple of 16, the kernels gather rows

# prefill: un-absorbed MLA over up-projected K/V
PREFILL_D_QK = 192  # nope (128) + rope (64)
PREFILL_D_V = 128
PREFILL_D_NOPE = 128
PREFILL_D_PE = PREFILL_D_QK - PREFILL_D_NOPE

# merge: out rows are whole 16-byte vectors in every dtype
MERGE_D_ALIGN = 8

ALIGN_BYTES = 16  # TMA and vector copies: every non-unit stride is a multiple of 16 bytes
HALF_DTYPES = (torch.bfloat16, torch.float16)  # the model dtypes of q, k, v and the cache
FP8 = torch.float8_e4m3fn  # the FP8 cache format (e4m3, per-tensor k_scale)
FP8_MAX = 448.0  # largest finite e4m3 value: quantisation saturates here
