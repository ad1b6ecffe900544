"""Serving-engine integration on CPU (the ops' CPU implementations): opcheck of every op, with the
arguments a layer forward passes them on a real mixed batch, and torch.compile(fullgraph=True) over
MLAAttention.forward with the decode/prefill split fixed by the host-side MLABatch."""
import torch
from serving_utils import RecordOps, hidden_states, make_batch, opcheck_all, warm_layer

# the op families a mixed step (decodes, a chunked prefill with context, a new prompt) must reach
LAYER_OPS = {"get_decode_metadata", "mla_decode", "write_kv_cache", "mla_prefill", "gather_kv_cache",
             "merge_attn_states"}
ALL_OPS = LAYER_OPS | {"mla_decode_out", "mla_prefill_out", "merge_attn_states_out", "merge_attn_states_n"}
PROMPTS = {"a": 20, "b": 9, "c": 12}
MIXED = [("a", 1), ("b", 3), ("c", 14), ("d", 10)]  # c: chunk 2 (context 12); d: new prompt
DECODE = [("a", 1), ("b", 2), ("c", 1)]


def test_opcheck_every_op_cpu():
    layer, cache = warm_layer("cpu", heads=4, hidden=128, prompts=PROMPTS)
    batch = make_batch(cache, MIXED, "cpu")
    rec = RecordOps()
    with rec:
        layer(hidden_states(layer, batch.positions.shape[0], 1), cache.kv, batch)
    assert {op._schema.name.split("::")[1] for op in rec.calls} == LAYER_OPS
    assert opcheck_all(rec.calls) == ALL_OPS


def _compiled_matches_eager(layer, cache, step, seed):
    batch = make_batch(cache, step, "cpu")
    x = hidden_states(layer, batch.positions.shape[0], seed)
    kv_eager = cache.kv.clone()
    want = layer(x, kv_eager, batch)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(x, cache.kv, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the cache writes of the compiled graph landed, and only where the eager call wrote
    assert torch.equal(cache.kv.nan_to_num(7.0), kv_eager.nan_to_num(7.0))


def test_compile_fullgraph_forward_cpu():
    layer, cache = warm_layer("cpu", heads=4, hidden=128, prompts=PROMPTS)
    _compiled_matches_eager(layer, cache, MIXED, seed=2)   # prefill + chunked context + decode
    _compiled_matches_eager(layer, cache, DECODE, seed=3)  # decode-only step, metadata in the graph
