"""Helpers for the serving tests (CPU and GPU): a layer with a warm paged cache, mixed and decode-only
batches over it, and a recorder of the mla_attn ops a forward pass dispatches."""
import torch
from layer_oracle import PagedCache, init_weights
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from mla_attn import MLAAttention, MLABatch, MLAConfig

DECODE_THRESHOLD = 8  # small, so that short test prompts still take the prefill path


def warm_layer(device, *, heads, hidden, prompts, page_size=16, num_pages=256, seed=0):
    """A bf16 layer and a cache holding `prompts` (request -> length), prefilled by the layer itself."""
    layer = MLAAttention(MLAConfig(hidden_size=hidden, num_heads=heads, q_lora_rank=64), dtype=torch.bfloat16)
    init_weights(layer, seed)
    layer.to(device)
    cache = PagedCache(num_pages, page_size, torch.bfloat16, device, seed)
    step = sorted(prompts.items(), key=lambda kv: kv[1] > DECODE_THRESHOLD)  # decodes first
    batch = make_batch(cache, step, device)
    layer(hidden_states(layer, batch.positions.shape[0], seed), cache.kv, batch)
    return layer, cache


def make_batch(cache, step, device, decode_threshold=DECODE_THRESHOLD, **kw):
    """MLABatch for `step` = [(request, new tokens)] (decodes first), reserving the cache pages."""
    ctx = [cache.reserve(name, n) for name, n in step]
    table = kw.pop("block_table", None)
    if table is None:
        table = [cache.pages[name] for name, _ in step]
    else:  # a fixed-width device table (CUDA graphs): fill the rows of this step's requests
        table = table.clone()
        for b, (name, _) in enumerate(step):
            table[b, : len(cache.pages[name])] = torch.tensor(cache.pages[name], dtype=torch.int32)
    return MLABatch.build([n for _, n in step], ctx, table, cache.page_size, device, decode_threshold, **kw)


def hidden_states(layer, num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    p = next(layer.parameters())
    return torch.randn(num_tokens, layer.config.hidden_size, generator=g).to(p.dtype).to(p.device)


class RecordOps(TorchDispatchMode):
    """Records the first call of every torch.ops.mla_attn op (inputs cloned before the call, since some
    ops write in place), for opcheck with the exact arguments of a real forward."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "mla_attn" and func not in self.calls:
            clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls[func] = (tree_map(clone, args), tree_map(clone, kwargs))
        return func(*args, **kwargs)


def opcheck_all(calls):
    """opcheck every recorded op, plus the ops a forward does not dispatch, with the same data: each
    `_out` twin (writing into fresh outputs) and merge_attn_states_n (the two merge inputs stacked)."""
    ops = torch.ops.mla_attn
    checked = set()
    for op, (args, kwargs) in calls.items():
        torch.library.opcheck(op, args, kwargs)
        name = op._schema.name.split("::")[1]
        checked.add(name)
        if hasattr(ops, name + "_out"):
            outs = tuple(torch.empty_like(t) for t in op(*args, **kwargs))
            torch.library.opcheck(getattr(ops, name + "_out").default, args + outs, kwargs)
            checked.add(name + "_out")
        if name == "merge_attn_states":
            out_a, lse_a, out_b, lse_b = args
            torch.library.opcheck(ops.merge_attn_states_n.default,
                                  (torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b])))
            checked.add("merge_attn_states_n")
    return checked
