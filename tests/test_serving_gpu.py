"""Serving-engine integration on the GPU: a decode step captured in a CUDA graph at a maximum batch and
replayed with new lengths and block tables (bit-identical to eager), torch.compile(fullgraph=True)
over the decode step and over MLAAttention.forward, opcheck of every op on a forward's arguments, and
stream order: a decode right behind the cache write, back-to-back decodes reusing freed memory."""
import pytest
import torch
from cases import make_decode_case
from conftest import capture_graph
from serving_utils import RecordOps, hidden_states, make_batch, opcheck_all, warm_layer
from test_serving import ALL_OPS, LAYER_OPS

import mla_attn

pytestmark = pytest.mark.gpu

PROMPTS = {f"r{i}": n for i, n in enumerate([700, 33, 1500, 64, 129, 3000, 1, 400])}
MAX_BATCH = 8
DECODE_STEPS = [  # (request, 1 token) per step; fewer requests than MAX_BATCH are padded
    ["r0", "r1", "r2", "r3", "r4"],
    ["r5", "r2", "r6"],
    ["r7", "r6", "r5", "r4", "r3", "r2", "r1", "r0"],
    ["r1"],
]


def _warm(heads=16):
    return warm_layer("cuda", heads=heads, hidden=512, prompts=PROMPTS, page_size=64, num_pages=512, seed=heads)


@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_graph_decode_step(heads):
    layer, cache = _warm(heads)
    width = 3100 // 64 + 2  # pages per request: fixed, the graph keeps the table's shape
    table = torch.zeros(MAX_BATCH, width, dtype=torch.int32, device="cuda")
    static = make_batch(cache, [(r, 1) for r in DECODE_STEPS[0]], "cuda", block_table=table, pad_to=MAX_BATCH)
    assert static.decode_metadata is None  # get_decode_metadata runs inside the graph
    static_x = hidden_states(layer, MAX_BATCH, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, lazy inits)
        layer(static_x, cache.kv, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, cache.kv, static)

    for i, names in enumerate(DECODE_STEPS[1:], 1):
        batch = make_batch(cache, [(r, 1) for r in names], "cuda", block_table=table, pad_to=MAX_BATCH)
        x = hidden_states(layer, MAX_BATCH, i)
        static.copy_(batch)
        static_x.copy_(x)
        static_out.fill_(float("nan"))
        graph.replay()
        got = static_out.clone()
        want = layer(x, cache.kv, batch)  # eager, same padded batch (rewrites the same cache rows)
        assert torch.isfinite(got).all()
        assert torch.equal(got, want), f"step {i}: replay differs from eager"
        assert not got[len(names):].any(), "pad tokens see no key: attention 0, o_proj 0"


def test_compile_fullgraph_decode_op_step():
    """get_decode_metadata + mla_decode under inductor: the same kernels, so bit-identical to eager."""
    c = make_decode_case([3000, 17, 640], 2, 16, 64, varlen=True, split_pe=True, seed=4)
    c = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}

    def step(q, q_pe, kv, bt, lens, cu):
        md = mla_attn.get_decode_metadata(lens, 16, cu_seqlens_q=cu, max_seqlen_q=2, deterministic=True)
        return mla_attn.mla_decode(q, kv, bt, lens, cu_seqlens_q=cu, max_seqlen_q=2, q_pe=q_pe, softmax_scale=0.07,
                                   return_lse=True, metadata=md, deterministic=True)

    args = (c["q"], c["q_pe"], c["kv_cache"], c["block_table"], c["cache_seqlens"], c["cu_seqlens_q"])
    want = step(*args)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# (cache format, h_q, kernel): every decode kernel and cache format
WRITE_THEN_DECODE_CASES = [
    ("bf16", 16, "narrow16"), ("bf16", 64, "rows64"), ("bf16", 128, "seesaw"), ("bf16", 128, "seesaw_steady"),
    ("bf16", 64, "rows64_seesaw"),
    ("fp8", 16, "narrow16"), ("fp8", 16, "narrow16_3wg"), ("fp8", 32, "narrow32"), ("fp8", 128, "rows64"),
    ("fp8", 128, "fp8mma"), ("ds", 16, "narrow16"), ("ds", 32, "narrow32"), ("ds", 128, "rows64")]


@pytest.mark.parametrize("fmt,heads,kernel", WRITE_THEN_DECODE_CASES)
def test_decode_reads_the_row_written_just_before(fmt, heads, kernel):
    """A decode issued right behind the cache write sees the row it wrote, on every kernel and cache
    format (an early start of the decode, e.g. by programmatic dependent launch, must wait for the
    write). Each step poisons the last key row of every request, rewrites it with write_kv_cache and
    decodes (eagerly, then in a CUDA graph): the output must be finite and equal to a decode of the same
    cache run after a synchronize."""
    torch.manual_seed(0)
    batch, page, length = 4, 64, 200
    per = -(-length // page)
    slots = batch * per * page
    k_scale = torch.tensor([0.02], device="cuda") if fmt == "fp8" else None
    if fmt == "ds":
        cache = torch.zeros(batch * per, page, 656, dtype=torch.uint8, device="cuda")
    else:
        dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.bfloat16
        cache = torch.zeros(batch * per, page, 1, 576, dtype=dtype, device="cuda")
    mla_attn.write_kv_cache(torch.randn(slots, 512, device="cuda", dtype=torch.bfloat16),
                            torch.randn(slots, 64, device="cuda", dtype=torch.bfloat16), cache,
                            torch.arange(slots, device="cuda"), k_scale=k_scale)
    table = torch.randperm(batch * per, device="cuda", dtype=torch.int32).view(batch, per)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    last = table[:, (length - 1) // page].long() * page + (length - 1) % page
    rows = cache.view(slots, -1)
    poison_rows = rows if fmt == "bf16" else rows.view(torch.uint8)  # 0xff: NaN in e4m3, fp32 and bf16
    poison = float("nan") if fmt == "bf16" else 255
    q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=torch.bfloat16)
    kv_c = torch.empty(batch, 512, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.empty(batch, 64, device="cuda", dtype=torch.bfloat16)
    md = mla_attn.get_decode_metadata(lens, heads, s_q=1)
    kw = dict(softmax_scale=0.07, metadata=md, k_scale=k_scale, fp8_mma=kernel == "fp8mma", _kernel=kernel)

    def step():
        poison_rows.index_fill_(0, last, poison)
        mla_attn.write_kv_cache(kv_c, k_pe, cache, last, k_scale=k_scale)
        return mla_attn.mla_decode(q, cache, table, lens, **kw)

    def check(out):
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "the decode read the poisoned row"
        assert torch.equal(out, mla_attn.mla_decode(q, cache, table, lens, **kw))

    for _ in range(10):
        kv_c.normal_(), k_pe.normal_()
        check(step())
    graph, out = capture_graph(step)
    for _ in range(10):
        kv_c.normal_(), k_pe.normal_()
        out.fill_(float("nan"))
        graph.replay()
        check(out)


def test_back_to_back_decodes_reusing_freed_outputs():
    """Decodes issued back to back with nothing in between, the output of every other call freed at once
    so that later calls reuse its memory (most requests are not split, so most combine CTAs return
    before their griddepcontrol.wait): the kept outputs equal the same decodes run one at a time."""
    torch.manual_seed(1)
    batch, page, length, heads = 128, 64, 1024, 16
    per = length // page
    kv = torch.randn(batch * per, page, 1, 576, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * per, device="cuda", dtype=torch.int32).view(batch, per)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    md = mla_attn.get_decode_metadata(lens, heads, s_q=1)
    qs = [torch.randn(batch, 1, heads, 576, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
    decode = lambda q: mla_attn.mla_decode(q, kv, table, lens, softmax_scale=0.07, metadata=md)
    want = []
    for q in qs[::2]:
        want.append(decode(q))
        torch.cuda.synchronize()
    kept = []
    for i, q in enumerate(qs):
        out = decode(q)
        if i % 2 == 0:
            kept.append(out)
        del out
    torch.cuda.synchronize()
    for got, ref in zip(kept, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_compile_fullgraph_forward_gpu(kind):
    layer, cache = _warm()
    step = ([("r0", 1), ("r1", 5), ("r2", 700), ("new", 300)] if kind == "mixed"
            else [(r, 1) for r in DECODE_STEPS[2]])
    batch = make_batch(cache, step, "cuda", decode_threshold=64)
    x = hidden_states(layer, batch.positions.shape[0], 9)
    kv_eager = cache.kv.clone()
    want = layer(x, kv_eager, batch)
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, cache.kv, batch)
    # inductor fuses the RMSNorm / RoPE / projection epilogues, so intermediates may round differently
    # in bf16 (1 ulp = 0.4%); the attention ops themselves are the same kernels.
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    written = batch.slot_mapping
    rows_got = cache.kv.view(-1, 576)[written]
    rows_want = kv_eager.view(-1, 576)[written]
    torch.testing.assert_close(rows_got, rows_want, rtol=2e-2, atol=2e-2)


def test_opcheck_every_op_gpu():
    layer, cache = _warm()
    batch = make_batch(cache, [("r0", 1), ("r1", 3), ("r2", 70), ("new", 40)], "cuda", decode_threshold=8)
    rec = RecordOps()
    with rec:
        layer(hidden_states(layer, batch.positions.shape[0], 1), cache.kv, batch)
    assert {op._schema.name.split("::")[1] for op in rec.calls} == LAYER_OPS
    assert opcheck_all(rec.calls) == ALL_OPS
