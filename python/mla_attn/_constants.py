"""Sizes and limits the kernels are built for, shared by the ops, their checks and the reference."""
import torch

# decode: absorbed MLA over the latent cache
D_QK = 576  # a cache row and a q row: latent (512) + rope (64)
D_V = 512  # V is the first 512 dims of the latent cache
D_PE = D_QK - D_V  # the rope part
MAX_HEADS_Q = 128
MAX_SEQLEN_Q = 512  # query tokens per request
PAGE_SIZE_MIN, PAGE_SIZE_MAX = 1, 256  # below 16, or not a multiple of 16, the kernels gather rows
# Requests one device schedule takes (get_decode_metadata; sparse attention: query tokens): the range the
# scheduler's tests cover (csrc/bindings/decode_api.cpp refuses more).
MAX_SCHEDULED_REQUESTS = 50000
MAX_SM_PARTS = 1024  # parts of a schedule, and rows of tile_sched (csrc/mla_decode/config.h: kMaxSmParts)

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

# KV-cache formats (kv_format= of the cache ops; None infers the format from the cache's dtype)
KV_FORMATS = ("model", "fp8", "ds_mla_fp8")  # model dtype | e4m3 + per-tensor k_scale | DeepSeek-V3.2 rows
# ds_mla_fp8 (DeepSeek-V3.2 / FlashMLA's FP8 sparse layout), one uint8 row of 656 bytes per token:
# bytes [0, 512) e4m3 latent | [512, 528) 4 fp32 scales, one per 128 latent values | [528, 656) 64 bf16 RoPE
DS_TILE = 128  # latent values per scale
DS_NUM_TILES = D_V // DS_TILE
DS_SCALE_OFFSET = D_V  # byte offsets in a row
DS_ROPE_OFFSET = DS_SCALE_OFFSET + 4 * DS_NUM_TILES
DS_ROW_BYTES = DS_ROPE_OFFSET + 2 * D_PE  # 656
DS_MIN_SCALE_INV = 1e-4  # amax / 448 is raised to this before rounding up to a power of two (scale >= 2^-13)
