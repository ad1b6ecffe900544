"""mla_attn: Hopper kernels for DeepSeek MLA attention, exposed as torch.ops.mla_attn.*."""
import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

from . import _extension

_C = _extension.load()  # registers the TORCH_LIBRARY schemas (and CUDA kernels when built with them)
from . import _ops  # noqa: F401  (the fakes and CPU kernels of every op)
from . import reference
from .decode import get_decode_metadata, mla_decode
from .distributed import CPSlice, cp_mla_decode, cp_slice, cp_token_slot
from .kv_cache import dequantize_ds_mla_fp8, gather_kv_cache, quantize_ds_mla_fp8, write_kv_cache
from .merge import merge_attn_states, merge_attn_states_n
from .metadata import DecodeMetadata, SparseDecodeMetadata
from .prefill import mla_prefill
from .sparse import get_sparse_decode_metadata, mla_sparse_decode, mla_sparse_prefill
from .batch import MLABatch
from .layer import MLAAttention, MLAConfig
from .rotary import RotaryEmbedding, YarnScaling

build_info = _C.build_info
__version__ = "0.1.0"

__all__ = ["mla_decode", "get_decode_metadata", "DecodeMetadata", "mla_sparse_decode", "mla_sparse_prefill",
           "get_sparse_decode_metadata", "SparseDecodeMetadata", "mla_prefill", "merge_attn_states",
           "merge_attn_states_n", "write_kv_cache", "gather_kv_cache", "quantize_ds_mla_fp8",
           "dequantize_ds_mla_fp8", "MLAAttention", "MLAConfig", "MLABatch",
           "RotaryEmbedding", "YarnScaling", "cp_mla_decode", "cp_slice", "cp_token_slot", "CPSlice", "reference",
           "build_info", "__version__"]
