"""Argument checks of every mla_attn op, in one place. The public wrappers run them before calling
torch.ops.mla_attn.*, and the CPU kernels (_ops.py) run the static ones, so a bad argument raises the
same exception with the same message on either path; the CUDA kernels check again in C++ (there a
TORCH_CHECK raises RuntimeError, a TORCH_CHECK_VALUE ValueError). An output's overlap with the inputs
(check_*_outputs) is left to the ops, CPU and CUDA alike, which check it on every call (mla_sparse_decode
checks it in its wrapper too).

Exception rule, the same for every op:
  * TypeError: an argument of the wrong kind: its Python type, a tensor's dtype or a tensor's device.
    A tensor on another device than the op's other tensors is a TypeError too: the device, like the
    dtype, is part of what a tensor is, not of its shape or values.
  * ValueError: an argument of the right kind with a wrong shape, layout (strides), value or range,
    or an option that does not fit the other arguments (k_scale or fp8_mma without an FP8 cache, a
    decode kernel that cannot run the call, metadata computed for another call).

Static checks read tensor metadata only: no host sync, safe under CUDA graphs and torch.compile. The
public wrappers of the calls an engine makes per layer (decode, sparse decode, cache write, prefill,
merge) run them through `memoized`: once per signature of their arguments, since a call repeats the
last one's in every layer and step (see there).
Value checks (lengths, cu_seqlens, page ids, slots, k_scale's value) read the data, so they run where
want_value_checks says: by default for CPU tensors; for GPU tensors only with validate=True or
MLA_ATTN_VALIDATE=1 (they sync); validate=False disables them; never while torch.compile traces.
"""
import math
import numbers
import os
from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

import torch
from torch import Tensor
from torch.nn import Parameter

from ._constants import (ALIGN_BYTES, D_PE, D_QK, D_V, DS_ROW_BYTES, FP8, HALF_DTYPES, KV_FORMATS, MAX_HEADS_Q,
                         MAX_SCHEDULED_REQUESTS, MAX_SEQLEN_Q, MAX_SM_PARTS, MERGE_D_ALIGN, PAGE_SIZE_MAX,
                         PAGE_SIZE_MIN, PREFILL_D_NOPE, PREFILL_D_PE, PREFILL_D_QK, PREFILL_D_V)
from .metadata import DECODE_KERNELS, DecodeMetadata, SparseDecodeMetadata

_MERGE_DTYPES = HALF_DTYPES + (torch.float32,)
INT32_MAX = 2**31 - 1
_PREFILL_TILE_ROWS = 128  # csrc/mla_prefill: kBlockM
_PREFILL_MAX_GRID = 65535  # requests and heads: the prefill grid's z and y (csrc/bindings/prefill_api.cpp)
# softmax_scale * log2(e), the form the kernels take: a finite, normal float32 (their fast math
# flushes denormals to 0)
_LOG2E = math.log2(math.e)
_MAX_SOFTMAX_SCALE = float(torch.finfo(torch.float32).max) / _LOG2E
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
# decode kernels that run one cache kind only, and the query rows (max_seqlen_q * h_q) the narrow ones take
_FP8_ONLY_KERNELS = ("narrow16_3wg", "narrow32", "fp8mma")
_HALF_ONLY_KERNELS = ("seesaw", "seesaw_steady", "rows64_seesaw")
_KERNEL_MAX_ROWS = {"narrow16": 16, "narrow16_3wg": 16, "narrow32": 32}
_DS_MLA_FP8_KERNELS = ("narrow16", "narrow32", "rows64")  # those that read ds_mla_fp8 rows (csrc/mla_decode/dispatch.h)
# the MLAConfig dims the kernels are built for
LAYER_DIMS = dict(kv_lora_rank=D_V, qk_rope_head_dim=D_PE, qk_nope_head_dim=PREFILL_D_NOPE, v_head_dim=PREFILL_D_V)


# ---------------------------------------------------------------------------------------------- policy
def want_value_checks(validate: Optional[bool], device: torch.device) -> bool:
    """Whether the data-dependent checks run (see the module docstring)."""
    if validate is not None:
        return validate
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or os.environ.get("MLA_ATTN_VALIDATE", "0") == "1"


# ----------------------------------------------------------------------------------------- memo
_Result = TypeVar("_Result")
_passed_signatures: dict = {}
_MAX_PASSED_SIGNATURES = 4096  # then forgotten all at once: a serving batch size takes a few each
_PLAIN_SCALARS = frozenset((type(None), bool, int, float, str))


def _signature(args: tuple) -> tuple:
    """What a static check can read of its arguments: a tensor's dtype, device, shape, strides and start
    alignment; the type and value of anything else (a metadata tuple field by field). Raises TypeError
    for what it cannot describe (tensor subclasses other than Parameter: torch.compile's fakes answer
    differently)."""
    sig = []
    for x in args:
        kind = type(x)
        if kind is Tensor or kind is Parameter:
            sig.append((x.dtype, x.device, x.shape, x.stride(), x.storage_offset() % ALIGN_BYTES))
        elif kind in _PLAIN_SCALARS:  # (the type: True and 1 are equal keys)
            sig.append((kind, x))
        elif isinstance(x, Tensor):
            raise TypeError("tensor subclass")
        elif isinstance(x, tuple):
            sig.append((kind, _signature(x)))
        else:
            sig.append((kind, x))
    return tuple(sig)


def memoized(checks: Callable[..., _Result], *args: object) -> _Result:
    """checks(*args): an op's static checks, which read only what _signature describes of args (so no
    addresses: the ops check outputs against inputs on every call). They run once per signature that passes;
    later calls of that signature get the first one's result without running them (engines repeat a
    call's shapes in every layer and step; docs/design-decisions.md has the cost). While torch.compile
    traces (symbolic shapes) or for arguments without a signature (unhashable), they run every time."""
    if torch.compiler.is_compiling():
        return checks(*args)
    try:
        key = (checks, _signature(args))
        return _passed_signatures[key]
    except KeyError:
        pass
    except (TypeError, RuntimeError):  # unhashable, or a tensor without strides (sparse layouts)
        return checks(*args)
    result = checks(*args)
    if len(_passed_signatures) >= _MAX_PASSED_SIGNATURES:
        _passed_signatures.clear()
    _passed_signatures[key] = result
    return result


# ------------------------------------------------------------------------------------------- generic
def check_tensor(name: str, t: object) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")


def check_device(name: str, t: Tensor, like_name: str, like: Tensor) -> None:
    if t.device != like.device:
        raise TypeError(f"{name} is on {t.device} but {like_name} is on {like.device}; all inputs must share a "
                        "device")


def check_layout(name: str, t: Tensor) -> None:
    """Last dim contiguous; other strides and the start 16-byte aligned (size-1 dims are ignored: never
    stepped). The start is checked as the offset into the tensor's storage, which torch allocates
    aligned (not while torch.compile traces, which cannot read it; the CUDA ops check the address)."""
    # A contiguous tensor of 16-byte rows has every outer stride a multiple of its row: the usual case
    # skips the loop (this runs on every call).
    if not (t.is_contiguous() and t.dim() and (t.shape[-1] * t.element_size()) % ALIGN_BYTES == 0):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride(-1) == 1), got strides {t.stride()}")
        for d in range(t.dim() - 1):
            if t.shape[d] > 1 and (t.stride(d) * t.element_size()) % ALIGN_BYTES:
                raise ValueError(f"{name}: stride({d}) = {t.stride(d)} elements is not a multiple of "
                                 f"{ALIGN_BYTES} bytes (strides {t.stride()})")
    if not torch.compiler.is_compiling() and t.numel() and (t.storage_offset() * t.element_size()) % ALIGN_BYTES:
        raise ValueError(f"{name} must start at a multiple of {ALIGN_BYTES} bytes; it starts "
                         f"{t.storage_offset()} elements into its storage")


def check_no_overlap(name: str, t: Tensor) -> None:
    """An output: no two elements share memory (an expanded or overlapping view would be written by
    several threads at once). Each dim's stride must exceed the span of the dims with smaller strides.
    Not while torch.compile traces: it cannot sort symbolic strides."""
    if t.is_contiguous() or torch.compiler.is_compiling():  # the usual out=, without the sort
        return
    span = 0
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride <= span:
            raise ValueError(f"{name}: elements overlap in memory (shape {tuple(t.shape)}, strides {t.stride()}); "
                             "an output needs a distinct address per element")
        span += stride * (size - 1)


def _byte_range(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses t's elements span."""
    first = t.data_ptr()
    if t.is_contiguous():
        return first, first + t.nbytes
    span = sum(stride * (size - 1) for stride, size in zip(t.stride(), t.shape) if size > 1)
    return first, first + (span + 1) * t.element_size()


# How many coefficients _share_an_address tries before it calls the pair overlapping.
_ADDRESS_SEARCH_STEPS = 256


def _address_terms(t: Tensor, sign: int, terms: dict[int, list[int]]) -> None:
    """Adds t's byte addresses, start + sum(i_d * stride_d) + byte, to terms: per byte stride, the range of
    its coefficient; sign -1 adds them negated."""
    steps = [(t.stride(d) * t.element_size(), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1 and t.stride(d)]
    for stride, size in steps + [(1, t.element_size())]:
        low_high = terms.setdefault(stride, [0, 0])
        low_high[sign > 0] += sign * (size - 1)


def _share_an_address(a: Tensor, b: Tensor) -> bool:
    """Whether a and b have a byte in common: whether some coefficients c_s, each in its range, give
    sum(c_s * s) over the byte strides s of both = b's start - a's. Searched from the largest stride down,
    each coefficient bounded by what the smaller strides can still add: where the strides nest (the views
    an engine makes) that leaves at most two per stride. Past _ADDRESS_SEARCH_STEPS tries it answers True:
    refusing an odd layout is safe, passing an overlap is not."""
    terms: dict[int, list[int]] = {}
    _address_terms(a, 1, terms)
    _address_terms(b, -1, terms)
    strides = sorted(terms, reverse=True)
    low_rest, high_rest = [0] * (len(strides) + 1), [0] * (len(strides) + 1)  # what strides[k:] can add
    for k in range(len(strides) - 1, -1, -1):
        low_rest[k] = low_rest[k + 1] + terms[strides[k]][0] * strides[k]
        high_rest[k] = high_rest[k + 1] + terms[strides[k]][1] * strides[k]
    tries = [_ADDRESS_SEARCH_STEPS]

    def reach(k: int, rest: int) -> bool:
        if k == len(strides):
            return rest == 0
        stride, (low, high) = strides[k], terms[strides[k]]
        first = max(low, -((high_rest[k + 1] - rest) // stride))  # ceil((rest - high_rest) / stride)
        last = min(high, (rest - low_rest[k + 1]) // stride)
        for c in range(first, last + 1):
            tries[0] -= 1
            if tries[0] < 0 or reach(k + 1, rest - c * stride):
                return True
        return False

    return reach(0, b.data_ptr() - a.data_ptr())


# Tensors with memory of their own to compare (not fake or functional subclasses).
_MEMORY_TENSORS = (Tensor, torch.nn.Parameter)


def _overlapping(out: Tensor, inputs: dict[str, Optional[Tensor]]):
    """(name, input) of each input with a byte of out's memory. None while torch.compile traces, nor for
    fake, functional or meta tensors (no memory)."""
    if (torch.compiler.is_compiling() or type(out) not in _MEMORY_TENSORS or out.device.type == "meta"
            or not out.numel()):
        return
    out_first, out_end = _byte_range(out)
    for input_name, inp in inputs.items():
        # the start alone settles the usual case (an input after out) in one call; this runs every call
        if type(inp) not in _MEMORY_TENSORS or inp.data_ptr() >= out_end:
            continue
        in_first, in_end = _byte_range(inp)
        if in_end <= out_first or in_first == in_end or inp.device != out.device:
            continue
        if _share_an_address(out, inp):
            yield input_name, inp


def check_no_partial_overlap(name: str, out: Tensor, inputs: dict[str, Tensor]) -> None:
    """An output that shares part of an input's memory. All of it is fine where each thread reads its
    part of the input before writing it (the merge)."""
    for input_name, inp in _overlapping(out, inputs):
        same_layout = out.shape == inp.shape and all(
            out.stride(d) == inp.stride(d) for d in range(out.dim()) if out.shape[d] > 1)
        if not (out.data_ptr() == inp.data_ptr() and same_layout):  # the input itself is fine
            raise ValueError(f"{name} shares part of {input_name}'s memory; an output may be an input, or apart "
                             "from it")


def check_apart(name: str, out: Optional[Tensor], inputs: dict[str, Optional[Tensor]]) -> None:
    """An output that the kernels write while other CTAs still read the inputs (decode, prefill): no
    memory in common with any of them."""
    if out is None:
        return
    for input_name, _ in _overlapping(out, inputs):
        raise ValueError(f"{name} shares memory with {input_name}; the kernels still read it while they write {name}")


def check_int32(name: str, t: Tensor, dim: int) -> None:
    check_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous, got strides {t.stride()}")


def check_int_type(name: str, x: object) -> None:
    """A host int the ops take (Python or NumPy, as the ops' schemas; a SymInt while torch.compile traces),
    not a bool."""
    if not isinstance(x, (numbers.Integral, torch.SymInt)) or isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")


def check_int(name: str, x: object, low: int, high: int = INT32_MAX) -> None:
    """A host int in [low, high]: the kernels take them in 32 bits."""
    check_int_type(name, x)
    if x < low or x > high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {x}")


def check_flags(**flags: object) -> None:
    """Options the ops take as bools (validate: None or a bool): anything else is a TypeError rather
    than a silent truth value or an error of the op's schema."""
    for name, value in flags.items():
        if not isinstance(value, bool) and not (name == "validate" and value is None):
            raise TypeError(f"{name} must be a bool{' or None' if name == 'validate' else ''}, got "
                            f"{type(value).__name__}")


def check_softmax_scale(softmax_scale: object) -> None:
    """The kernels take the block max of unscaled scores: the scale must be finite and > 0, and so must
    scale * log2(e) in float32, the form the kernels use."""
    if softmax_scale is None:
        raise ValueError("softmax_scale is required (MLA: (qk_nope + qk_rope)^-0.5 * mscale^2, e.g. 192^-0.5; "
                         "not 1/sqrt of the head dim the kernel sees)")
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a number, got {type(softmax_scale).__name__}")
    # the range first: a huge int does not convert to float for the product (False for NaN)
    if not (0 < softmax_scale <= _MAX_SOFTMAX_SCALE and softmax_scale * _LOG2E >= _FLOAT32_TINY):
        raise ValueError(f"softmax_scale must be a finite number > 0 (also as float32 times log2(e)), got "
                         f"{softmax_scale}")


def check_lse(name: str, t: Tensor, shape: Sequence[int], like_name: str, like: Tensor) -> None:
    check_tensor(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    check_device(name, t, like_name, like)


def check_lse_out(name: str, t: Tensor, shape: Sequence[int], like_name: str, like: Tensor) -> None:
    """An lse the op writes: check_lse, and a distinct address per element."""
    check_lse(name, t, shape, like_name, like)
    check_no_overlap(name, t)


def check_kv_cache_shape(kv_cache: Tensor, row: int = D_QK) -> None:
    """[num_pages, page_size, row] or [num_pages, page_size, 1, row]: row 576 values, or the 656 bytes of a
    ds_mla_fp8 row."""
    if kv_cache.dim() not in (3, 4) or kv_cache.shape[-1] != row or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        what = " (ds_mla_fp8: 656 bytes per token)" if row == DS_ROW_BYTES else ""
        raise ValueError(f"kv_cache must be [num_pages, page_size, {row}] or [num_pages, page_size, 1, {row}]{what}, "
                         f"got shape {tuple(kv_cache.shape)}")


def check_cache_page_size(kv_cache: Tensor) -> None:
    """A page size every op takes: the cache ops refuse what decode would refuse later."""
    page_size = kv_cache.shape[1]
    if not PAGE_SIZE_MIN <= page_size <= PAGE_SIZE_MAX:
        raise ValueError(f"page_size must be in [{PAGE_SIZE_MIN}, {PAGE_SIZE_MAX}], got {page_size}")


def check_decode_cache_geometry(kv_cache: Tensor) -> None:
    """A cache the decode kernels read: its shape, a page size they take, and slot ids (page * page_size
    + row) that fit 32 bits."""
    check_kv_cache_shape(kv_cache, DS_ROW_BYTES if kv_cache.dtype == torch.uint8 else D_QK)
    check_cache_page_size(kv_cache)
    page_size = kv_cache.shape[1]
    if kv_cache.shape[0] * page_size > INT32_MAX:
        raise ValueError(f"the cache must hold fewer than 2^31 slots (num_pages x page_size), got "
                         f"{kv_cache.shape[0]} x {page_size}")


_FORMAT_DTYPES = {"model": "bfloat16 or float16", "fp8": "float8_e4m3fn", "ds_mla_fp8": "uint8"}


def check_kv_format(kv_cache: Tensor, kv_format: Optional[str]) -> str:
    """The cache's format (kv_cache.py), named by its dtype (checked before); a given kv_format must name
    the same one. Returns it."""
    inferred = "ds_mla_fp8" if kv_cache.dtype == torch.uint8 else "fp8" if kv_cache.dtype == FP8 else "model"
    if kv_format is None:
        return inferred
    if not isinstance(kv_format, str):
        raise TypeError(f"kv_format must be a str or None, got {type(kv_format).__name__}")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown kv_format {kv_format!r}; the formats are {', '.join(KV_FORMATS)}")
    if kv_format != inferred:
        raise ValueError(f"kv_format={kv_format!r} needs a {_FORMAT_DTYPES[kv_format]} kv_cache, got {kv_cache.dtype}")
    return inferred


def check_k_scale(kv_cache: Tensor, k_scale: Optional[Tensor]) -> None:
    """k_scale: required with (and only valid with) a float8_e4m3fn cache; float32 [1] on its device."""
    if kv_cache.dtype == torch.uint8 and k_scale is not None:
        raise ValueError("k_scale is not used with a ds_mla_fp8 kv_cache (its scales are in the rows)")
    if kv_cache.dtype != FP8:
        if k_scale is not None:
            raise ValueError(f"k_scale is only valid with a float8_e4m3fn kv_cache, got {kv_cache.dtype}")
        return
    if k_scale is None:
        raise ValueError("a float8_e4m3fn kv_cache needs k_scale (float32 tensor of shape [1])")
    _check_scale_tensor("k_scale", k_scale, "kv_cache", kv_cache)


def _check_scale_tensor(name: str, scale: object, like_name: str, like: Tensor) -> None:
    """A scale the kernels read on the device: float32 [1] on like's device."""
    want = f"{name} must be a float32 tensor of shape [1] (a tensor keeps CUDA graphs and torch.compile working)"
    if not isinstance(scale, Tensor):
        raise TypeError(f"{want}, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{want}, got dtype {scale.dtype}")
    if scale.shape != (1,):
        raise ValueError(f"{want}, got shape {tuple(scale.shape)}")
    check_device(name, scale, like_name, like)


def check_q_scale(q_scale: Optional[Tensor], fp8_mma: bool, q: Tensor) -> None:
    """q_scale: optional with fp8_mma=True only; float32 [1] on q's device."""
    if q_scale is None:
        return
    if not fp8_mma:
        raise ValueError("q_scale is only valid with fp8_mma=True (it scales Q into e4m3 for the e4m3 MMAs)")
    _check_scale_tensor("q_scale", q_scale, "q", q)


def check_scale_value(name: str, scale: Optional[Tensor]) -> None:
    """Value check of k_scale / q_scale (host sync on GPU): the kernels fold it into the score scale,
    which must be finite and > 0, and fp8_mma divides by q_scale: a denormal scale is 0 to their fast
    math (1 / q_scale = inf, then NaN outputs), so it must be a normal float32."""
    if scale is not None:
        value = float(scale)
        if not (math.isfinite(value) and value >= _FLOAT32_TINY):
            raise ValueError(f"{name} must be finite and >= {_FLOAT32_TINY:.4g} (a normal float32), got {value}")


def check_block_table_values(block_table: Tensor, lens: Tensor, num_pages: Optional[int], page_size: int) -> None:
    """Every page a request of lens[b] keys uses is an id in [0, num_pages) (num_pages None: >= 0, the cache
    not known yet); the tail may be garbage."""
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < lens[:, None]
    bad = used & ((block_table < 0) if num_pages is None else (block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        ids = ">= 0" if num_pages is None else f"in [0, {num_pages})"
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page id {ids} "
                         f"(request {b} uses its first {-(-int(lens[b]) // page_size)} pages)")


def check_cu_seqlens_values(name: str, cu: list[int], num_q_tokens: Optional[int] = None) -> list[int]:
    """cu[0] == 0, cu[-1] == num_q_tokens (when given), non-decreasing; returns the per-request sizes."""
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    if num_q_tokens is not None and cu[-1] != num_q_tokens:
        raise ValueError(f"{name}[-1] = {cu[-1]} must equal the number of q tokens {num_q_tokens}")
    sizes = [b - a for a, b in zip(cu, cu[1:])]
    for b, s in enumerate(sizes):
        if s < 0:
            raise ValueError(f"{name} must be non-decreasing ({name}[{b}:{b + 2}] = {cu[b:b + 2]})")
    return sizes


# -------------------------------------------------------------------------------------------- decode
def _check_like_q(name: str, t: Tensor, q: Tensor, last_dim: int) -> None:
    """A tensor that goes with q (q_pe: 64 dims; a decode out: 512): q's dtype and leading dims."""
    check_tensor(name, t)
    if t.dtype != q.dtype:
        raise TypeError(f"{name} dtype {t.dtype} must match q dtype {q.dtype}")
    if t.shape != q.shape[:-1] + (last_dim,):
        raise ValueError(f"{name} must have shape {tuple(q.shape[:-1]) + (last_dim,)}, got {tuple(t.shape)}")


def check_decode(q: Tensor, q_pe: Optional[Tensor], kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
                 cu_seqlens_q: Optional[Tensor], max_seqlen_q: Optional[int], out: Optional[Tensor],
                 kv_slots: bool = False) -> tuple[int, int]:
    """Static checks of mla_decode's tensors (kv_slots: the op's sparse form). Returns (batch, max_seqlen_q)."""
    check_tensor("q", q)
    check_tensor("kv_cache", kv_cache)
    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    if kv_cache.dtype not in (q.dtype, FP8, torch.uint8):
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype}, or be float8_e4m3fn or "
                        "uint8 (ds_mla_fp8)")
    want_q = D_QK if q_pe is None else D_V
    if q.dim() not in (3, 4) or q.shape[-1] != want_q:
        raise ValueError(f"q must be [B, s_q, h_q, {want_q}] or varlen [T, h_q, {want_q}]"
                         f"{'' if q_pe is None else ' (with q_pe)'}, got shape {tuple(q.shape)}")
    if q_pe is not None:
        _check_like_q("q_pe", q_pe, q, D_PE)
    check_decode_cache_geometry(kv_cache)
    if kv_cache.shape[0] < 1 and not kv_slots:  # page ids are clamped into the cache; slots outside it skipped
        raise ValueError("kv_cache must hold at least one page, got 0")
    page_size = kv_cache.shape[1]
    check_int32("block_table", block_table, 2)
    check_int32("cache_seqlens", cache_seqlens, 1)
    batch = cache_seqlens.shape[0]
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but cache_seqlens has {batch} requests")

    if q.dim() == 3:
        if cu_seqlens_q is None:
            raise ValueError("3-D (varlen) q needs cu_seqlens_q and max_seqlen_q")
        check_int32("cu_seqlens_q", cu_seqlens_q, 1)
        if cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
        if max_seqlen_q is None:
            raise ValueError("cu_seqlens_q given without max_seqlen_q (needed to size the grid without a sync)")
        check_int_type("max_seqlen_q", max_seqlen_q)
    else:
        if cu_seqlens_q is not None:
            raise ValueError("cu_seqlens_q is only valid with 3-D (varlen) q; 4-D q has s_q tokens per request")
        if q.shape[0] != batch:
            raise ValueError(f"q has batch {q.shape[0]} but cache_seqlens has {batch} requests")
        if max_seqlen_q is not None:
            check_int_type("max_seqlen_q", max_seqlen_q)
            if max_seqlen_q != q.shape[1]:
                raise ValueError(f"max_seqlen_q={max_seqlen_q} does not match q.shape[1]={q.shape[1]}")
        max_seqlen_q = q.shape[1]
    h_q = q.shape[-2]
    if not 1 <= h_q <= MAX_HEADS_Q:
        raise ValueError(f"num_heads_q must be in [1, {MAX_HEADS_Q}], got {h_q}")
    if not 1 <= max_seqlen_q <= MAX_SEQLEN_Q:
        raise ValueError(f"max_seqlen_q (tokens per request) must be in [1, {MAX_SEQLEN_Q}], got {max_seqlen_q}")

    tensors = {"q_pe": q_pe, "kv_cache": kv_cache, "block_table": block_table, "cache_seqlens": cache_seqlens,
               "cu_seqlens_q": cu_seqlens_q, "out": out}
    for name, t in tensors.items():
        if t is not None:
            check_tensor(name, t)
            check_device(name, t, "q", q)
    for name, t in (("q", q), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if t is not None:
            check_layout(name, t)
    if out is not None:
        _check_like_q("out", out, q, D_V)
        check_layout("out", out)
        check_no_overlap("out", out)
    return batch, max_seqlen_q


def check_decode_outputs(out: Optional[Tensor], lse: Optional[Tensor], q: Tensor, q_pe: Optional[Tensor],
                         kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, cu_seqlens_q: Optional[Tensor],
                         tile_sched: Tensor, req_splits: Tensor, k_scale: Optional[Tensor], q_scale: Optional[Tensor],
                         attn_sink: Optional[Tensor]) -> None:
    """A decode's out and lse, when given: apart from every input, and lse from out."""
    if out is None and lse is None:
        return
    inputs = {"q": q, "q_pe": q_pe, "kv_cache": kv_cache, "block_table": block_table, "cache_seqlens": cache_seqlens,
              "cu_seqlens_q": cu_seqlens_q, "tile_sched": tile_sched, "req_splits": req_splits, "k_scale": k_scale,
              "q_scale": q_scale, "attn_sink": attn_sink}
    check_apart("out", out, inputs)
    check_apart("lse", lse, {**inputs, "out": out})


def check_decode_kernel(kernel: Optional[str], cache_dtype: torch.dtype, rows: int) -> None:
    """A forced decode kernel (None: the dispatch chooses) must exist and run this call: rows =
    max_seqlen_q * h_q."""
    if kernel is None:
        return
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str or None, got {type(kernel).__name__}")
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"unknown decode kernel {kernel!r}; the kernels are {', '.join(DECODE_KERNELS)}")
    if cache_dtype == torch.uint8 and kernel not in _DS_MLA_FP8_KERNELS:
        raise ValueError(f"decode kernel {kernel!r} cannot read a ds_mla_fp8 kv_cache; "
                         f"{', '.join(_DS_MLA_FP8_KERNELS)} do")
    if kernel in _FP8_ONLY_KERNELS and cache_dtype not in (FP8, torch.uint8):
        raise ValueError(f"decode kernel {kernel!r} needs a float8_e4m3fn kv_cache, got {cache_dtype}")
    if kernel in _HALF_ONLY_KERNELS and cache_dtype == FP8:
        raise ValueError(f"decode kernel {kernel!r} needs a 16-bit kv_cache, got {cache_dtype}")
    max_rows = _KERNEL_MAX_ROWS.get(kernel)
    if max_rows is not None and rows > max_rows:
        raise ValueError(f"decode kernel {kernel!r} runs at most {max_rows} query rows per request "
                         f"(max_seqlen_q * h_q), got {rows}")


def check_decode_options(q: Tensor, kv_cache: Tensor, k_scale: Optional[Tensor], fp8_mma: bool,
                         kernel: Optional[str], max_seqlen_q: int, q_scale: Optional[Tensor] = None) -> None:
    """The FP8 scales and the kernel options of one decode call (after check_decode)."""
    check_k_scale(kv_cache, k_scale)
    check_q_scale(q_scale, fp8_mma, q)
    if fp8_mma and kv_cache.dtype != FP8:
        raise ValueError(f"fp8_mma=True needs a float8_e4m3fn kv_cache, got {kv_cache.dtype}")
    check_decode_kernel(kernel, kv_cache.dtype, max_seqlen_q * q.shape[-2])


def check_num_sm_parts(num_sm_parts: int, num_sms: int) -> None:
    check_int("num_sms", num_sms, 1, MAX_SM_PARTS)
    check_int_type("num_sm_parts", num_sm_parts)
    if not 1 <= num_sm_parts <= num_sms:
        raise ValueError(f"num_sm_parts={num_sm_parts} must be in [1, num_sms={num_sms}]")


def check_schedule(tile_sched: Tensor, req_splits: Tensor, num_sm_parts: int, batch: int, q: Tensor) -> None:
    """The tensors of a DecodeMetadata against the call they are used in."""
    for name, t, cols in (("tile_sched", tile_sched, 8), ("req_splits", req_splits, 2)):
        check_tensor(f"metadata.{name}", t)
        want = f"metadata.{name} must be a contiguous int32 [N, {cols}] tensor"
        if t.dtype != torch.int32:
            raise TypeError(f"{want}, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != cols or not t.is_contiguous():
            raise ValueError(f"{want}, got shape {tuple(t.shape)} strides {t.stride()}")
        check_device(f"metadata.{name}", t, "q", q)
    if req_splits.shape[0] != batch:
        raise ValueError(f"metadata was computed for batch {req_splits.shape[0]} but this call has {batch}")
    check_num_sm_parts(num_sm_parts, tile_sched.shape[0])


def check_skip_invalid_slots(skip_invalid_slots: bool, kv_slots: bool, kv_cache: Tensor) -> None:
    """skip_invalid_slots (the decode op's private option for mla_sparse_decode): kv_slots rows of a
    ds_mla_fp8 cache, whose kernels copy each row by itself and skip the invalid ones."""
    if skip_invalid_slots and not (kv_slots and kv_cache.dtype == torch.uint8):
        raise ValueError("skip_invalid_slots needs kv_slots and a ds_mla_fp8 (uint8) kv_cache")


def _check_host_field(md: tuple, field: str) -> None:
    """A metadata field the checks compare (a host value, as get_*_metadata made it): a tensor there
    would be compared by its device value (a sync), which the static checks' signature does not hold."""
    if isinstance(getattr(md, field), Tensor):
        raise TypeError(f"metadata.{field} must be a host value, got a tensor")


def check_metadata(md: object, batch: int, max_seqlen_q: int, causal: bool, deterministic: bool, q: Tensor) -> None:
    if not isinstance(md, DecodeMetadata):
        raise TypeError(f"metadata must be a DecodeMetadata from get_decode_metadata, got {type(md).__name__}")
    for field, want in (("num_heads_q", q.shape[-2]), ("max_seqlen_q", max_seqlen_q), ("causal", causal),
                        ("deterministic", deterministic)):
        _check_host_field(md, field)
        if getattr(md, field) != want:
            raise ValueError(f"metadata was computed for {field}={getattr(md, field)} but this call has {want}")
    check_schedule(md.tile_sched, md.req_splits, md.num_sm_parts, batch, q)


def check_seqlens_values(block_table: Tensor, cache_seqlens: Tensor, page_size: int) -> None:
    """Each length in [0, what its block-table row holds] (host sync on GPU)."""
    cap = block_table.shape[1] * page_size
    for b, n in enumerate(cache_seqlens.tolist()):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} is negative")
        if n > cap:
            raise ValueError(f"cache_seqlens[{b}] = {n} exceeds block_table capacity {block_table.shape[1]} pages "
                             f"x page_size {page_size} = {cap}")


def check_decode_values(kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, cu_seqlens_q: Optional[Tensor],
                        max_seqlen_q: int, num_tokens: int, k_scale: Optional[Tensor],
                        q_scale: Optional[Tensor] = None) -> None:
    """Value checks of mla_decode (host sync on GPU)."""
    check_scale_value("k_scale", k_scale)
    check_scale_value("q_scale", q_scale)
    page_size = kv_cache.shape[1]
    check_seqlens_values(block_table, cache_seqlens, page_size)
    if cu_seqlens_q is not None:
        for b, s in enumerate(check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q.tolist(), num_tokens)):
            if s > max_seqlen_q:
                raise ValueError(f"request {b} has {s} q tokens > max_seqlen_q={max_seqlen_q}")
    check_block_table_values(block_table, cache_seqlens, kv_cache.shape[0], page_size)


def check_decode_metadata_args(cache_seqlens: Tensor, num_heads_q: int, s_q: Optional[int],
                               cu_seqlens_q: Optional[Tensor], max_seqlen_q: Optional[int]) -> int:
    """get_decode_metadata's arguments. Returns max_seqlen_q (s_q for a uniform batch)."""
    check_int32("cache_seqlens", cache_seqlens, 1)
    if cache_seqlens.shape[0] > MAX_SCHEDULED_REQUESTS:
        raise ValueError(f"get_decode_metadata schedules at most {MAX_SCHEDULED_REQUESTS} requests, got "
                         f"{cache_seqlens.shape[0]}")
    if cu_seqlens_q is None:
        if s_q is not None and max_seqlen_q is not None and max_seqlen_q != s_q:
            raise ValueError(f"s_q={s_q} and max_seqlen_q={max_seqlen_q} disagree")
        max_seqlen_q = s_q if s_q is not None else max_seqlen_q
        if max_seqlen_q is None:
            raise ValueError("get_decode_metadata needs s_q (uniform batch) or cu_seqlens_q + max_seqlen_q")
    else:
        if s_q is not None:
            raise ValueError("s_q is for a uniform batch; with cu_seqlens_q pass max_seqlen_q only")
        check_int32("cu_seqlens_q", cu_seqlens_q, 1)
        check_device("cu_seqlens_q", cu_seqlens_q, "cache_seqlens", cache_seqlens)
        if cu_seqlens_q.shape[0] != cache_seqlens.shape[0] + 1:
            raise ValueError(f"cu_seqlens_q must have batch + 1 = {cache_seqlens.shape[0] + 1} entries, got "
                             f"{cu_seqlens_q.shape[0]}")
        if max_seqlen_q is None:
            raise ValueError("cu_seqlens_q given without max_seqlen_q")
    check_int("num_heads_q", num_heads_q, 1, MAX_HEADS_Q)
    check_int("max_seqlen_q", max_seqlen_q, 1, MAX_SEQLEN_Q)
    return max_seqlen_q


# ------------------------------------------------------------------------------------------- prefill
def check_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                  max_seqlen_k: int, k_pe: Optional[Tensor], out: Optional[Tensor]) -> None:
    """Static checks of mla_prefill's arguments."""
    check_tensor("q", q)
    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    want_k = PREFILL_D_NOPE if k_pe is not None else PREFILL_D_QK
    for name, t, dim in (("q", q, PREFILL_D_QK), ("k", k, want_k), ("v", v, PREFILL_D_V), ("k_pe", k_pe, PREFILL_D_PE),
                         ("out", out, PREFILL_D_V)):
        if t is None and name in ("k_pe", "out"):  # the optional ones
            continue
        check_tensor(name, t)
        if t.dim() != 3 or t.shape[-1] != dim:
            extra = " (k_nope, since k_pe is given)" if name == "k" and k_pe is not None else ""
            raise ValueError(f"{name}{extra} must be [T, h, {dim}], got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match q dtype {q.dtype}")
        check_device(name, t, "q", q)
        check_layout(name, t)
    h_q, (t_k, h_k) = q.shape[1], k.shape[:2]
    if h_q < 1 or h_k < 1 or h_q % h_k:
        raise ValueError(f"h_q = {h_q} must be a multiple of h_k = {h_k}")
    if tuple(v.shape[:2]) != (t_k, h_k):
        raise ValueError(f"v must be [{t_k}, {h_k}, {PREFILL_D_V}] like k, got {tuple(v.shape)}")
    if k_pe is not None and tuple(k_pe.shape[:2]) != (t_k, 1):
        raise ValueError(f"k_pe must be [{t_k}, 1, {PREFILL_D_PE}] (shared by all heads), got {tuple(k_pe.shape)}")
    if out is not None:
        if tuple(out.shape) != (q.shape[0], h_q, PREFILL_D_V):
            raise ValueError(f"out must be [{q.shape[0]}, {h_q}, {PREFILL_D_V}], got {tuple(out.shape)}")
        check_no_overlap("out", out)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_int32(name, cu, 1)
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must be int32 [B + 1], got shape {tuple(cu.shape)}")
        check_device(name, cu, "q", q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must both be [B + 1]")
    if cu_seqlens_q.shape[0] - 1 > _PREFILL_MAX_GRID or h_q > _PREFILL_MAX_GRID:  # grid dims z and y
        raise ValueError(f"mla_prefill takes at most {_PREFILL_MAX_GRID} requests and heads, got "
                         f"{cu_seqlens_q.shape[0] - 1} and {h_q}")
    # The kernel's tile rows (128 a tile) are ints: the last tile's end must fit.
    check_int("max_seqlen_q", max_seqlen_q, 0, INT32_MAX // _PREFILL_TILE_ROWS * _PREFILL_TILE_ROWS)
    check_int("max_seqlen_k", max_seqlen_k, 0)


def check_prefill_outputs(out: Optional[Tensor], lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                          k_pe: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> None:
    """A prefill's out and lse, when given: apart from every input, and lse from out."""
    if out is None and lse is None:
        return
    inputs = {"q": q, "k": k, "v": v, "k_pe": k_pe, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    check_apart("out", out, inputs)
    check_apart("lse", lse, {**inputs, "out": out})


def check_prefill_values(cu_seqlens: Tensor, total: int, max_len: int, name: str) -> None:
    """Value checks of one cu_seqlens of mla_prefill (host sync on GPU)."""
    cu = cu_seqlens.tolist()
    sizes = check_cu_seqlens_values(name, cu)
    if cu[-1] > total:
        raise ValueError(f"{name}[-1] = {cu[-1]} exceeds the {total} rows of the packed tensor")
    if sizes and max(sizes) > max_len:
        raise ValueError(f"a request has {max(sizes)} rows > max_seqlen ({max_len}) given for {name}")


# --------------------------------------------------------------------------------------------- merge
def _check_merge_out(name: str, t: Tensor) -> None:
    check_tensor(name, t)
    if t.dtype not in _MERGE_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if t.dim() < 1 or t.shape[-1] == 0 or t.shape[-1] % MERGE_D_ALIGN or t.shape[-1] > INT32_MAX:
        raise ValueError(f"{name} must be [..., d] with d a positive multiple of {MERGE_D_ALIGN} below 2^31, "
                         f"got shape {tuple(t.shape)}")
    check_layout(name, t)


def _check_like_out_a(name: str, t: Tensor, out_a: Tensor) -> None:
    _check_merge_out(name, t)
    if t.dtype != out_a.dtype:
        raise TypeError(f"{name} dtype {t.dtype} must match out_a dtype {out_a.dtype}")
    if t.shape != out_a.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must match out_a shape {tuple(out_a.shape)}")
    check_device(name, t, "out_a", out_a)


def check_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Optional[Tensor] = None,
                lse: Optional[Tensor] = None) -> None:
    """merge_attn_states(_out)'s static checks: the pair, and the outputs when given (all but their
    overlap with the inputs: check_merge_outputs)."""
    _check_merge_out("out_a", out_a)
    _check_like_out_a("out_b", out_b, out_a)
    lead = out_a.shape[:-1]
    check_lse("lse_a", lse_a, lead, "out_a", out_a)
    check_lse("lse_b", lse_b, lead, "out_a", out_a)
    if out is not None:
        _check_like_out_a("out", out, out_a)
        check_no_overlap("out", out)
    if lse is not None:
        check_lse_out("lse", lse, lead, "out_a", out_a)


def check_merge_outputs(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Optional[Tensor],
                        lse: Optional[Tensor]) -> None:
    """The merge's out and lse, when given: each an input itself or apart from every input (and lse from out)."""
    inputs = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    if out is not None:
        check_no_partial_overlap("out", out, inputs)
    if lse is not None:
        check_no_partial_overlap("lse", lse, inputs if out is None else {**inputs, "out": out})


def check_merge_n(outs: Tensor, lses: Tensor) -> None:
    _check_merge_out("outs", outs)
    if outs.dim() < 2:
        raise ValueError(f"outs must be [n, ..., d], got shape {tuple(outs.shape)}")
    check_lse("lses", lses, outs.shape[:-1], "outs", outs)


# ------------------------------------------------------------------------------------------ KV cache
def _check_cache(kv_cache: Tensor, k_scale: Optional[Tensor], kv_format: Optional[str], like_name: str,
                 like: Tensor) -> str:
    """The cache of the KV-cache ops, in any of their formats. Returns the format."""
    check_tensor("kv_cache", kv_cache)
    if kv_cache.dtype not in HALF_DTYPES + (FP8, torch.uint8):
        raise TypeError(f"kv_cache must be bfloat16, float16, float8_e4m3fn or uint8 (ds_mla_fp8), got "
                        f"{kv_cache.dtype}")
    fmt = check_kv_format(kv_cache, kv_format)
    check_kv_cache_shape(kv_cache, DS_ROW_BYTES if fmt == "ds_mla_fp8" else D_QK)
    check_cache_page_size(kv_cache)
    check_device("kv_cache", kv_cache, like_name, like)
    check_layout("kv_cache", kv_cache)
    check_k_scale(kv_cache, k_scale)
    return fmt


def check_new_tokens(kv_c: Tensor, k_pe: Tensor) -> None:
    """The tokens a cache write (or quantize_ds_mla_fp8) takes: kv_c [T, 512], k_pe [T(, 1), 64], bf16/fp16."""
    check_tensor("kv_c", kv_c)
    if kv_c.dtype not in HALF_DTYPES:
        raise TypeError(f"kv_c must be bfloat16 or float16, got {kv_c.dtype}")
    if kv_c.dim() != 2 or kv_c.shape[1] != D_V:
        raise ValueError(f"kv_c must be [T, {D_V}], got shape {tuple(kv_c.shape)}")
    T = kv_c.shape[0]
    check_tensor("k_pe", k_pe)
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe dtype {k_pe.dtype} must match kv_c dtype {kv_c.dtype}")
    if k_pe.shape not in ((T, D_PE), (T, 1, D_PE)):
        raise ValueError(f"k_pe must be [T, {D_PE}] or [T, 1, {D_PE}] with T = {T}, got shape {tuple(k_pe.shape)}")
    check_device("k_pe", k_pe, "kv_c", kv_c)


def check_ds_mla_fp8_rows(rows: Tensor) -> None:
    """dequantize_ds_mla_fp8's input: uint8 [..., 656]."""
    check_tensor("rows", rows)
    if rows.dtype != torch.uint8:
        raise TypeError(f"rows must be uint8 (ds_mla_fp8), got {rows.dtype}")
    if rows.dim() < 1 or rows.shape[-1] != DS_ROW_BYTES:
        raise ValueError(f"rows must be [..., {DS_ROW_BYTES}] (ds_mla_fp8), got shape {tuple(rows.shape)}")


def check_write_kv_cache(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                         k_scale: Optional[Tensor], kv_format: Optional[str] = None) -> str:
    """Static checks of write_kv_cache. Returns the cache format."""
    check_new_tokens(kv_c, k_pe)
    T = kv_c.shape[0]
    check_tensor("slot_mapping", slot_mapping)
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping must have shape [T] = [{T}], got {tuple(slot_mapping.shape)}")
    check_device("slot_mapping", slot_mapping, "kv_c", kv_c)
    fmt = _check_cache(kv_cache, k_scale, kv_format, "kv_c", kv_c)
    check_no_overlap("kv_cache", kv_cache)  # written: tokens on one address would overwrite each other
    if fmt == "model" and kv_cache.dtype != kv_c.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must be kv_c's dtype {kv_c.dtype}, float8_e4m3fn or "
                        "uint8 (ds_mla_fp8)")
    check_layout("kv_c", kv_c)
    check_layout("k_pe", k_pe)
    return fmt


def check_gather_kv_cache(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, num_tokens: int,
                          k_scale: Optional[Tensor], out_dtype: Optional[torch.dtype],
                          kv_format: Optional[str] = None) -> str:
    """Static checks of gather_kv_cache. Returns the cache format."""
    check_int32("block_table", block_table, 2)
    check_int32("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.shape[0] != block_table.shape[0] + 1:
        raise ValueError(f"cu_seqlens must have B + 1 = {block_table.shape[0] + 1} entries (block_table has "
                         f"{block_table.shape[0]} rows), got {cu_seqlens.shape[0]}")
    check_device("cu_seqlens", cu_seqlens, "block_table", block_table)
    fmt = _check_cache(kv_cache, k_scale, kv_format, "block_table", block_table)
    check_int("num_tokens", num_tokens, 0)
    if out_dtype is not None and out_dtype not in _MERGE_DTYPES:
        raise TypeError(f"out_dtype must be None, bfloat16, float16 or float32, got {out_dtype}")
    return fmt


def check_write_values(kv_cache: Tensor, slot_mapping: Tensor, k_scale: Optional[Tensor]) -> None:
    check_scale_value("k_scale", k_scale)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    bad = slot_mapping >= num_slots
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise ValueError(f"slot_mapping[{t}] = {int(slot_mapping[t])} is past the cache's num_pages x page_size = "
                         f"{num_slots} slots")
    slots, counts = slot_mapping[slot_mapping >= 0].unique(return_counts=True)
    if bool((counts > 1).any()):  # which token's row lands there would depend on thread timing
        raise ValueError(f"slot_mapping names slot {int(slots[counts > 1][0])} more than once; valid slots must be "
                         "distinct")


def check_gather_values(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor,
                        k_scale: Optional[Tensor]) -> None:
    check_scale_value("k_scale", k_scale)
    page_size = kv_cache.shape[1]
    cap = block_table.shape[1] * page_size
    for b, n in enumerate(check_cu_seqlens_values("cu_seqlens", cu_seqlens.tolist())):
        if n > cap:
            raise ValueError(f"request {b} has {n} tokens, more than block_table's {block_table.shape[1]} pages "
                             f"x page_size {page_size} = {cap}")
    check_block_table_values(block_table, cu_seqlens[1:] - cu_seqlens[:-1], kv_cache.shape[0], page_size)


# ------------------------------------------------------------------------------- layer, batch, CP
def check_layer_call(hidden_states: object, kv_cache: object, batch: object, hidden_size: int, weight: object,
                     max_position: int, fp8_mma: object, indices: Optional[Tensor], topk_length: Optional[Tensor],
                     indices_valid: object, sparse_metadata: object) -> None:
    """MLAAttention.forward's own arguments (the ops it calls check the rest): an MLABatch, hidden_states
    [T, hidden_size] on the cache's device with T the batch's tokens, of the first projection's weight
    dtype where that is a float type (a quantised Linear keeps another dtype, or no weight), and the
    sparse options only with indices. A batch built for another page size would write and read other
    requests' rows, and a position past the layer's RoPE table would index out of it on the device."""
    from .batch import MLABatch  # batch.py imports this module
    if not isinstance(batch, MLABatch):
        raise TypeError(f"batch must be an MLABatch (MLABatch.build), got {type(batch).__name__}")
    check_tensor("hidden_states", hidden_states)
    float_weight = isinstance(weight, Tensor) and weight.dtype in HALF_DTYPES + (torch.float32,)
    if not hidden_states.dtype.is_floating_point or (float_weight and hidden_states.dtype != weight.dtype):
        raise TypeError(f"hidden_states dtype {hidden_states.dtype} must be the layer's dtype "
                        f"{weight.dtype if float_weight else 'a floating point dtype'}")
    check_tensor("kv_cache", kv_cache)
    check_device("hidden_states", hidden_states, "kv_cache", kv_cache)
    check_tensor("batch.positions", batch.positions)
    if batch.positions.dim() != 1:
        raise ValueError(f"batch.positions must be [T], got shape {tuple(batch.positions.shape)}")
    check_device("batch", batch.positions, "hidden_states", hidden_states)
    T = batch.positions.shape[0]
    if hidden_states.dim() != 2 or hidden_states.shape[0] != T or hidden_states.shape[1] != hidden_size:
        raise ValueError(f"hidden_states must be [T, hidden_size] = [{T}, {hidden_size}] (T: the batch's tokens), "
                         f"got shape {tuple(hidden_states.shape)}")
    check_flags(fp8_mma=fp8_mma, indices_valid=indices_valid)
    if indices is None and (topk_length is not None or indices_valid or sparse_metadata is not None):
        raise ValueError("topk_length, indices_valid and sparse_metadata are options of sparse attention: they need "
                         "indices")
    if kv_cache.dim() < 2 or kv_cache.shape[1] != batch.page_size:
        got = kv_cache.shape[1] if kv_cache.dim() >= 2 else None
        raise ValueError(f"kv_cache has page_size {got} but the batch was built for page_size {batch.page_size}")
    # A host check: while torch.compile traces, a comparison on the step's length would guard on it.
    if not torch.compiler.is_compiling() and batch.max_seq_len > max_position:
        raise ValueError(f"the batch reaches position {batch.max_seq_len - 1}, past the layer's RoPE table of "
                         f"{max_position} positions (MLAConfig.max_position_embeddings)")


def check_layer_config(config: object) -> None:
    """An MLAConfig the kernels run: the head dims they are built for."""
    for name, want in LAYER_DIMS.items():
        if getattr(config, name) != want:
            raise ValueError(f"mla_attn kernels need {name}={want}, got {getattr(config, name)}")


def host_int(name: str, x: object) -> int:
    """A host int (Python or NumPy), as a Python int."""
    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    return int(x)


def host_ints(name: str, values: object) -> list[int]:
    """A sequence of host ints (Python or NumPy, or an integer tensor: read on the host), as Python ints."""
    if isinstance(values, Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool or values.dim() != 1:
            raise TypeError(f"{name} must be ints: a 1-D integer tensor or a sequence, got {values.dtype} "
                            f"{tuple(values.shape)}")
        if values.device.type == "meta":
            raise TypeError(f"{name} is a meta tensor: its values cannot be read")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return [host_int(f"{name}[{i}]", x) for i, x in enumerate(values)]


def as_device(name: str, device: object) -> Optional[torch.device]:
    """A device argument (torch.device, str or int; None: torch's default), as a torch.device."""
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise TypeError(f"{name} must be a torch.device, str or int, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as e:  # an unknown device type, a negative index
        raise ValueError(f"{name}={device!r} is not a device: {e}") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{name}={device} is not one of this machine's {torch.cuda.device_count()} CUDA devices")
    return device


def check_batch(query_lens: list[int], context_lens: list[int], block_table: object, page_size: int,
                decode_threshold: int, pad_to: Optional[int], deterministic: bool = False,
                device: Optional[torch.device] = None) -> None:
    """MLABatch.build's host arguments (lengths already ints; device from as_device)."""
    check_int("page_size", page_size, PAGE_SIZE_MIN, PAGE_SIZE_MAX)
    if pad_to is not None:
        check_int("pad_to", pad_to, 0)
    check_flags(deterministic=deterministic)
    if max(query_lens + context_lens, default=0) > INT32_MAX:
        raise ValueError(f"query_lens and context_lens must be at most {INT32_MAX}")
    B = len(query_lens)
    if len(context_lens) != B:
        raise ValueError(f"{B} query_lens but {len(context_lens)} context_lens")
    if min(query_lens + context_lens, default=0) < 0:
        raise ValueError("query_lens and context_lens must be >= 0")
    if not 1 <= decode_threshold <= MAX_SEQLEN_Q:
        raise ValueError(f"decode_threshold must be in [1, {MAX_SEQLEN_Q}] (mla_decode's limit), "
                         f"got {decode_threshold}")
    num_decodes = sum(q <= decode_threshold for q in query_lens)
    if any(q <= decode_threshold for q in query_lens[num_decodes:]):
        raise ValueError(f"decode requests (query_len <= decode_threshold={decode_threshold}) must come "
                         f"before prefills; got query_lens {query_lens}")
    if pad_to is not None:
        if num_decodes < B:
            raise ValueError("pad_to is for decode-only batches (CUDA graphs)")
        if pad_to < B:
            raise ValueError(f"pad_to={pad_to} is smaller than the batch ({B} requests)")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    if isinstance(block_table, Tensor):
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table tensor must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] < B:
            raise ValueError(f"block_table tensor must be [>= {B}, max_pages], got {tuple(block_table.shape)}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError(f"block_table tensor must be contiguous in its last dim, got strides "
                             f"{block_table.stride()}")
        if max(seq_lens, default=0) > block_table.shape[1] * page_size:
            raise ValueError(f"block_table has {block_table.shape[1]} pages per request, too few for "
                             f"{max(seq_lens)} tokens of page_size {page_size}")
        if block_table.device.type == "meta" and (device is None or device.type != "meta"):
            raise TypeError(f"block_table is a meta tensor: it cannot be copied to {device or 'cpu'}")
        # As for a list table: the pages a request uses must be page ids (a negative one would make its
        # tokens' slots negative, which write_kv_cache skips). Read where that needs no sync.
        cols = -(-max(seq_lens, default=0) // page_size)
        if B and cols and block_table.device.type != "meta" and want_value_checks(None, block_table.device):
            table = block_table[:B, :cols]
            if bool((table < 0).any()):  # else the usual table: no row to look at
                check_block_table_values(table, torch.tensor(seq_lens, device=table.device), None, page_size)
        return
    if isinstance(block_table, (str, bytes)) or not isinstance(block_table, Sequence):
        raise TypeError(f"block_table must be an int32 tensor or a list of page lists, got "
                        f"{type(block_table).__name__}")
    if len(block_table) != B:
        raise ValueError(f"{len(block_table)} block_table rows for {B} requests")
    for b, (pages, n) in enumerate(zip(block_table, seq_lens)):
        pages = host_ints(f"block_table[{b}]", pages)
        if len(pages) * page_size < n:
            raise ValueError(f"request {b}: {len(pages)} pages of {page_size} cannot hold {n} tokens")
        used = pages[:-(-n // page_size)]  # the tail past them may hold anything int32 holds
        if pages and (min(used, default=0) < 0 or min(pages) < -INT32_MAX - 1 or max(pages) > INT32_MAX):
            raise ValueError(f"block_table[{b}]: page ids must be in [0, {INT32_MAX}] (int32 in the unused tail), "
                             f"got {pages}")


def check_cp_layout(page_size: int, world_size: int, rank: Optional[int] = None) -> None:
    """cp_slice / cp_token_slot: a page size, a world size and (cp_slice) the rank."""
    check_int("page_size", page_size, 1)
    check_int("world_size", world_size, 1)
    if rank is not None:
        check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")


def check_cp_positions(positions: object) -> None:
    """cp_token_slot's key positions: an int >= 0, or an integer tensor (values >= 0, read on the CPU) or
    NumPy array."""
    if isinstance(positions, Tensor):
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise TypeError(f"positions must be an int or an integer tensor, got {positions.dtype}")
        if want_value_checks(None, positions.device) and bool((positions < 0).any()):
            raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
        return
    kind = getattr(getattr(positions, "dtype", None), "kind", None)  # a NumPy array or scalar
    if kind is not None:
        if kind not in "iu":
            raise TypeError(f"positions must be ints, got a NumPy array of {positions.dtype}")
        if (positions < 0).any():
            raise ValueError(f"positions must be >= 0, got {positions.min()}")
        return
    if not isinstance(positions, (numbers.Integral, torch.SymInt)) or isinstance(positions, bool):
        raise TypeError(f"positions must be an int, an integer tensor or array, got {type(positions).__name__}")
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")


def check_cp_group(group: object) -> None:
    process_group = getattr(torch.distributed, "ProcessGroup", None)
    if group is not None and (process_group is None or not isinstance(group, process_group)):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def check_cp_requests(block_table: Tensor, cache_seqlens: Tensor) -> None:
    """cp_slice's full requests: block_table int32 [B, max_pages], cache_seqlens int32 [B]."""
    check_int32("block_table", block_table, 2)
    check_int32("cache_seqlens", cache_seqlens, 1)
    check_device("cache_seqlens", cache_seqlens, "block_table", block_table)
    if cache_seqlens.shape[0] != block_table.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but cache_seqlens has "
                         f"{cache_seqlens.shape[0]} requests")


def check_cp_query(q: Tensor) -> None:
    check_tensor("q", q)
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError("cp_mla_decode needs q [B, 1, h_q, D] (one new token per request): a rank's keys are "
                         "not a prefix of the request, so causal masking for s_q > 1 would need each key's "
                         f"global position (an offset the kernel does not take); got q shape {tuple(q.shape)}")


# -------------------------------------------------------------------------------------------- sparse
def check_compact_sparse_indices(indices: Tensor, topk_length: Optional[Tensor], num_slots: int) -> None:
    """compact_sparse_indices: indices int32 [R, topk >= 1], topk_length None or int32 [R]."""
    check_int32("indices", indices, 2)
    if indices.shape[1] < 1:
        raise ValueError(f"indices must be [R, topk] with topk >= 1, got shape {tuple(indices.shape)}")
    if topk_length is not None:
        check_int32("topk_length", topk_length, 1)
        if topk_length.shape[0] != indices.shape[0]:
            raise ValueError(f"topk_length must be [R] = [{indices.shape[0]}], got shape {tuple(topk_length.shape)}")
        check_device("topk_length", topk_length, "indices", indices)
    check_int("num_slots", num_slots, 0)


def check_sparse_cache(kv_cache: Tensor, q_dtype: Optional[torch.dtype]) -> None:
    """The cache of mla_sparse_decode: q's dtype (None: either 16-bit dtype), float8_e4m3fn, or uint8 in
    DeepSeek-V3.2's ds_mla_fp8 layout (656 bytes per token, pages back to back: it is read as one
    row per slot); either decode layout, a page size the kernels take."""
    check_tensor("kv_cache", kv_cache)
    allowed = HALF_DTYPES if q_dtype is None else (q_dtype,)
    if kv_cache.dtype not in allowed + (FP8, torch.uint8):
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must match q dtype {q_dtype}, or be float8_e4m3fn or "
                        "uint8 (ds_mla_fp8)")
    check_decode_cache_geometry(kv_cache)
    check_layout("kv_cache", kv_cache)
    # Read as one row per slot (a view [num_pages * page_size, 1, 656]): the pages must follow each
    # other at page_size rows' distance.
    pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if kv_cache.dtype == torch.uint8 and pages > 1 and page_size > 1 and \
            kv_cache.stride(0) != page_size * kv_cache.stride(1):
        raise ValueError(f"a ds_mla_fp8 kv_cache must hold its rows back to back (page stride = page_size x row "
                         f"stride, as a contiguous [num_pages, page_size, {DS_ROW_BYTES}] tensor), got strides "
                         f"{kv_cache.stride()}")


def check_sparse_indices(indices: Tensor, topk_length: Optional[Tensor], lead: Sequence[int], like: Tensor) -> None:
    """indices int32 [*lead, topk >= 1]; topk_length None or int32 [lead[0]] (per request of a batched
    call, per token of a token-major one)."""
    check_tensor("indices", indices)
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    want = "[B, s_q, topk]" if len(lead) == 2 else "[T, topk]"
    if tuple(indices.shape[:-1]) != tuple(lead) or indices.dim() != len(lead) + 1 or indices.shape[-1] < 1:
        raise ValueError(f"indices must be {want} = [{', '.join(map(str, lead))}, topk >= 1] like q, "
                         f"got shape {tuple(indices.shape)}")
    if indices.shape[-1] > 1 and indices.stride(-1) != 1:
        raise ValueError(f"indices: last dim must be contiguous, got strides {indices.stride()}")
    check_device("indices", indices, "q", like)
    if topk_length is not None:
        check_tensor("topk_length", topk_length)
        if topk_length.dtype != torch.int32:
            raise TypeError(f"topk_length must be int32, got {topk_length.dtype}")
        if tuple(topk_length.shape) != (lead[0],):
            per = "request" if len(lead) == 2 else "token"
            raise ValueError(f"topk_length must be [{lead[0]}] (one length per {per}), got shape "
                             f"{tuple(topk_length.shape)}")
        check_device("topk_length", topk_length, "q", like)


def check_attn_sink(attn_sink: Optional[Tensor], h_q: int, like: Tensor) -> None:
    if attn_sink is None:
        return
    check_tensor("attn_sink", attn_sink)
    if attn_sink.dtype != torch.float32:
        raise TypeError(f"attn_sink must be float32, got {attn_sink.dtype}")
    if tuple(attn_sink.shape) != (h_q,):
        raise ValueError(f"attn_sink must be [h_q] = [{h_q}], got shape {tuple(attn_sink.shape)}")
    if h_q > 1 and attn_sink.stride(0) != 1:
        raise ValueError(f"attn_sink must be contiguous, got stride {attn_sink.stride(0)}")
    check_device("attn_sink", attn_sink, "q", like)


def check_sparse_decode(q: Tensor, q_pe: Optional[Tensor], kv_cache: Tensor, indices: Tensor,
                        topk_length: Optional[Tensor], attn_sink: Optional[Tensor], out: Optional[Tensor]) -> int:
    """Static checks of mla_sparse_decode's tensors (out apart from the inputs: the caller, on every call).
    Returns the number of query tokens R."""
    check_tensor("q", q)
    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    want_q = D_QK if q_pe is None else D_V
    if q.dim() not in (3, 4) or q.shape[-1] != want_q:
        raise ValueError(f"q must be [B, s_q, h_q, {want_q}] or token-major [T, h_q, {want_q}]"
                         f"{'' if q_pe is None else ' (with q_pe)'}, got shape {tuple(q.shape)}")
    h_q = q.shape[-2]
    if not 1 <= h_q <= MAX_HEADS_Q:
        raise ValueError(f"num_heads_q must be in [1, {MAX_HEADS_Q}], got {h_q}")
    check_layout("q", q)
    if q_pe is not None:
        _check_like_q("q_pe", q_pe, q, D_PE)
        check_device("q_pe", q_pe, "q", q)
        check_layout("q_pe", q_pe)
    check_sparse_cache(kv_cache, q.dtype)
    check_device("kv_cache", kv_cache, "q", q)
    lead = tuple(q.shape[:-2])
    check_sparse_indices(indices, topk_length, lead, q)
    check_attn_sink(attn_sink, h_q, q)
    rows = math.prod(lead)
    if out is not None:
        _check_like_q("out", out, q, D_V)
        check_device("out", out, "q", q)
        check_layout("out", out)
        check_no_overlap("out", out)
        if q.dim() == 4 and out.shape[0] > 1 and out.shape[1] > 1 and out.stride(0) != out.shape[1] * out.stride(1):
            raise ValueError(f"out: the kernel writes it as [B * s_q, h_q, 512] rows, so stride(0) must be "
                             f"s_q * stride(1); got strides {out.stride()}")
    return rows


def check_sparse_prefill(q: Tensor, kv: Tensor) -> None:
    """mla_sparse_prefill's q and kv (the rest is mla_sparse_decode's)."""
    check_tensor("q", q)
    check_tensor("kv", kv)
    if q.dim() != 3 or q.shape[-1] != D_QK:
        raise ValueError(f"q must be [T, h_q, {D_QK}], got shape {tuple(q.shape)}")
    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    if kv.dtype not in HALF_DTYPES:
        raise TypeError(f"kv must be bfloat16 or float16 (the gathered latent rows), got {kv.dtype}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv dtype {kv.dtype} must match q dtype {q.dtype}")
    if not (kv.dim() == 2 or (kv.dim() == 3 and kv.shape[1] == 1)) or kv.shape[-1] != D_QK:
        raise ValueError(f"kv must be [S, {D_QK}] or [S, 1, {D_QK}], got shape {tuple(kv.shape)}")
    check_device("kv", kv, "q", q)  # here, not as the kv_cache view mla_sparse_decode sees
    check_layout("kv", kv)


def check_sparse_metadata(md: object, indices: Tensor, like: Tensor) -> None:
    """A SparseDecodeMetadata against the call it is reused in."""
    if not isinstance(md, SparseDecodeMetadata):
        raise TypeError(f"metadata must be a SparseDecodeMetadata from get_sparse_decode_metadata, got "
                        f"{type(md).__name__}")
    rows, topk = math.prod(indices.shape[:-1]), indices.shape[-1]
    for field in ("rows", "topk"):
        _check_host_field(md, field)
    if (md.rows, md.topk) != (rows, topk):
        raise ValueError(f"metadata was computed for {md.rows} query tokens of top-k {md.topk} but this call "
                         f"has {rows} of top-k {topk}")
    check_metadata(md.decode, rows, 1, False, False, like)  # num_heads_q and the device among the rest


def check_counted_indices_in_cache(indices: Tensor, topk_length: Optional[Tensor], num_slots: int) -> None:
    """Value check (host sync on GPU) of indices_valid=True: every index a row counts (position <
    topk_length of its request or token, every position without topk_length) is a slot in the cache
    [0, num_slots). indices [B, s_q, topk] or [T, topk]; topk_length [B] or [T] (in range: checked before)."""
    topk = indices.shape[-1]
    limit = topk if topk_length is None else topk_length.view((-1,) + (1,) * (indices.dim() - 1))
    counted = torch.arange(topk, device=indices.device) < limit
    bad = counted & ((indices < 0) | (indices >= num_slots))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        why = ("without topk_length every index of a row counts" if topk_length is None else
               f"it is within topk_length = {int(topk_length[where[0]])} of its row")
        raise ValueError(f"indices_valid=True, but indices[{', '.join(map(str, where))}] = {int(indices[where])} is "
                         f"not a cache slot in [0, {num_slots}) and {why}")


def check_topk_length_values(topk_length: Optional[Tensor], topk: int) -> None:
    """Value check (host sync on GPU): every length in [0, topk]."""
    if topk_length is None:
        return
    bad = (topk_length < 0) | (topk_length > topk)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"topk_length[{i}] = {int(topk_length[i])} is not in [0, topk={topk}]")
