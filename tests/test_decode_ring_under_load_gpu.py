"""The narrow kernel's stage ring under load: its math warpgroups take tiles in turn, so where the stages do
not divide among them the uses of one stage go to different warpgroups, and a warpgroup may reach use
n + 2 of a stage while use n + 1 is still landing (kv_producer.cuh, record_stage_fill). Small cases rarely
get there; a memory-bound batch under the TMA latencies of a loaded GPU does (before the fix, the first
replay of these cases already went wrong or failed on an H100). Each replay after a spin kernel (the GPU
idle, then every CTA loading at once) must reproduce the first bit for bit, and the first must match the
float32 reference on the requests it checks: a tile read from an older fill gives other bits; a ring
whose barriers lost their phases hangs or fails the launch. Each case runs in a process of its own, with
a timeout, so that a hang fails the case instead of the session and a launch failure stays in it."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_attn
from mla_attn._constants import FP8, FP8_MAX
from mla_attn.reference import mla_decode_ref

from cases import check_unit_scale_error

pytestmark = pytest.mark.gpu

BATCH, KEYS, REPLAYS, CHECKED_REQUESTS, K_SCALE = 128, 16384, 40, 4, 0.02


def _paged_fp8_cache(batch, keys, page_size, gen):
    """Requests of `keys` keys each on shuffled pages of an FP8 cache (values ~ N(0, 1) stored / K_SCALE,
    quantised in place as quantize_fp8 does)."""
    pages_per_request = keys // page_size
    num_pages = batch * pages_per_request
    values = torch.randn(num_pages, page_size, 1, 576, device="cuda", generator=gen)
    kv = values.div_(K_SCALE).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    del values
    table = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages_per_request)
    return kv, table, torch.tensor([K_SCALE], device="cuda")


def replays_under_load(kernel, h_q, page_size):
    gen = torch.Generator(device="cuda").manual_seed(page_size * 1000 + h_q)
    kv, table, k_scale = _paged_fp8_cache(BATCH, KEYS, page_size, gen)
    lens = torch.full((BATCH,), KEYS, dtype=torch.int32, device="cuda")
    q = torch.randn(BATCH, 1, h_q, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    scale = 576 ** -0.5
    md = mla_attn.get_decode_metadata(lens, h_q, s_q=1, causal=False)
    out = torch.empty(BATCH, 1, h_q, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        mla_attn.mla_decode(q, kv, table, lens, softmax_scale=scale, causal=False, k_scale=k_scale, metadata=md,
                            out=out, _kernel=kernel)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))  # every replay starts from NaN: a row it leaves unwritten shows
    graph.replay()
    first = out.clone()
    assert torch.isfinite(first).all(), "the first replay left rows unwritten"
    # The first requests against the reference on their dequantised pages (check_unit_scale_error).
    c = CHECKED_REQUESTS
    sub_kv = kv[table[:c].flatten().long()].float() * k_scale
    sub_table = torch.arange(sub_kv.shape[0], device="cuda", dtype=torch.int32).view(c, -1)
    ref, _ = mla_decode_ref(q[:c], sub_kv, sub_table, lens[:c], softmax_scale=scale, causal=False)
    low, _ = mla_decode_ref(q[:c], sub_kv, sub_table, lens[:c], softmax_scale=scale, causal=False,
                            dtype=torch.bfloat16)
    check_unit_scale_error(first[:c], ref, low)
    differ = 0
    for _ in range(REPLAYS):
        out.fill_(float("nan"))
        torch.cuda._sleep(40000)
        graph.replay()
        differ += int(not torch.equal(out, first))
    torch.cuda.synchronize()
    assert differ == 0, f"{differ} of {REPLAYS} replays differ from the first"


@pytest.mark.parametrize("kernel,h_q,page_size", [
    # TMA tiles by 16-key row groups, their pages 16 to 64 rows
    ("narrow16", 16, 16), ("narrow16", 16, 64), ("narrow16_3wg", 16, 16), ("narrow16_3wg", 16, 32),
    ("narrow16_3wg", 16, 64), ("narrow32", 32, 16), ("narrow32", 32, 64),
    ("narrow16_3wg", 16, 8),  # rows gathered whole by bulk copy (the row-staged form)
    ("narrow32", 32, 8),  # slab rows gathered by cp.async
])
def test_narrow_ring_replays_under_load(kernel, h_q, page_size):
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from test_decode_ring_under_load_gpu import replays_under_load\n"
              f"replays_under_load({kernel!r}, {h_q}, {page_size})\n"
              "print('ok')\n")
    try:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("no result within 300 s: the ring hangs")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
