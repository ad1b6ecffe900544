"""The calls an engine makes every step do not wait for the GPU: under
torch.cuda.set_sync_debug_mode("error") a device-to-host copy or a synchronize raises. Each call runs
once before (lazy initialisation, the static-check memo, the schedule cache), then again under the
mode, with value checks at their GPU default (off)."""
import pytest
import torch
from cases import make_decode_case, make_prefill_case
from conftest import run_decode, to_device
from sparse_cases import make_sparse_case, run_sparse

import mla_attn

pytestmark = pytest.mark.gpu


def _decode_calls():
    case = to_device(make_decode_case([3000, 77, 0], 2, 16, 64, seed=1))
    paged = to_device(make_decode_case([500, 9], 1, 128, 3, seed=2))  # gathered rows
    md = mla_attn.get_decode_metadata(case["cache_seqlens"], 16, s_q=2)
    return {
        "mla_decode without metadata": lambda: run_decode(case, True),
        "get_decode_metadata + mla_decode": lambda: run_decode(
            case, True, metadata=mla_attn.get_decode_metadata(case["cache_seqlens"], 16, s_q=2)),
        "mla_decode with metadata": lambda: run_decode(case, True, metadata=md),
        "mla_decode, page 3": lambda: run_decode(paged, True),
    }


def _other_calls():
    sparse = {kind: to_device(make_sparse_case((4, 2), 16, 300, 16, lengths=True, sink="finite",
                                               ds_fp8=kind == "ds_mla_fp8", seed=3), "cuda")
              for kind in ("bf16", "ds_mla_fp8")}
    g = torch.Generator().manual_seed(4)
    kv_c = torch.randn(40, 512, generator=g).bfloat16().cuda()
    k_pe = torch.randn(40, 64, generator=g).bfloat16().cuda()
    cache = torch.zeros(8, 16, 576, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(128, generator=g)[:40].cuda()
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32, device="cuda")
    prefill = to_device(make_prefill_case([5, 40], [9, 40], 16, split_pe=True))
    out_a, out_b = (torch.randn(7, 16, 512, generator=g).bfloat16().cuda() for _ in range(2))
    lse_a, lse_b = (torch.randn(7, 16, generator=g).cuda() for _ in range(2))
    return {
        "mla_sparse_decode": lambda: run_sparse(sparse["bf16"]),
        "mla_sparse_decode, ds_mla_fp8": lambda: run_sparse(sparse["ds_mla_fp8"]),
        "write_kv_cache": lambda: mla_attn.write_kv_cache(kv_c, k_pe, cache, slots),
        "gather_kv_cache": lambda: mla_attn.gather_kv_cache(cache, table, cu, 64),
        "mla_prefill": lambda: mla_attn.mla_prefill(
            prefill["q"], prefill["k"], prefill["v"], prefill["cu_seqlens_q"], prefill["cu_seqlens_k"],
            prefill["max_seqlen_q"], prefill["max_seqlen_k"], softmax_scale=0.1, causal=True,
            k_pe=prefill["k_pe"], return_lse=True),
        "merge_attn_states": lambda: mla_attn.merge_attn_states(out_a, lse_a, out_b, lse_b),
    }


@pytest.mark.parametrize("calls", [_decode_calls, _other_calls], ids=["decode", "others"])
def test_no_host_sync(calls, monkeypatch):
    monkeypatch.delenv("MLA_ATTN_VALIDATE", raising=False)  # value checks sync: off, their GPU default
    for name, call in calls().items():
        call()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as e:
            raise AssertionError(f"{name} synchronised with the host: {e}") from e
        finally:
            torch.cuda.set_sync_debug_mode("default")
