"""Context-parallel decode (mla_attn.distributed): the cache layout helpers in-process, then
cp_mla_decode across two torchrun processes (tests/distributed/cp_decode_check.py): gloo on the CPU,
NCCL on two GPUs."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from cases import make_decode_case

import mla_attn
from mla_attn.distributed import cp_mla_decode, cp_slice, cp_token_slot

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "cp_decode_check.py")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [16, 64])
def test_slice_matches_token_slots(world, page_size):
    g = torch.Generator().manual_seed(world)
    lens = torch.randint(0, 9 * page_size, (7,), generator=g, dtype=torch.int32)
    lens[0], lens[1], lens[2] = 0, page_size, world * page_size + 1
    max_pages = -(-int(lens.max()) // page_size) + 2
    table = torch.randperm(7 * max_pages, generator=g).to(torch.int32).reshape(7, max_pages)
    slices = [cp_slice(table, lens, page_size, world, r) for r in range(world)]
    assert sum(s.cache_seqlens for s in slices).tolist() == lens.tolist()
    for s in slices:
        assert s.block_table.dtype == s.cache_seqlens.dtype == torch.int32 and s.block_table.is_contiguous()
    for b, n in enumerate(lens.tolist()):
        t = torch.arange(n)
        rank, local = cp_token_slot(t, page_size, world)
        for r, s in enumerate(slices):
            mine = local[rank == r]
            # the rank's keys of request b are exactly local positions 0 .. cache_seqlens - 1, in order
            assert mine.tolist() == list(range(int(s.cache_seqlens[b])))
            got = s.block_table[b, mine // page_size]
            assert torch.equal(got, table[b, t[rank == r] // page_size])
    assert cp_token_slot(5 * page_size + 3, page_size, 2) == (1, 2 * page_size + 3)


def test_rejects_more_than_one_token():
    c = make_decode_case([40], 2, 4, 16)
    with pytest.raises(ValueError, match="key's global position"):
        cp_mla_decode(c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"], softmax_scale=0.1)
    with pytest.raises(ValueError, match="rank 2"):
        cp_slice(c["block_table"], c["cache_seqlens"], 16, 2, 2)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_rank_equals_mla_decode(one_rank_group, dtype):
    c = make_decode_case([37, 0, 130], 1, 5, 16, split_pe=True, dtype=dtype)
    args = (c["q"], c["kv_cache"], c["block_table"], c["cache_seqlens"])
    want, want_lse = mla_attn.mla_decode(*args, q_pe=c["q_pe"], softmax_scale=0.1, return_lse=True)
    out, lse = cp_mla_decode(*args, q_pe=c["q_pe"], softmax_scale=0.1, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _torchrun(device, timeout):
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(mla_attn.__file__)))  # the mla_attn under test
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", CHECK,
           "--device", device]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


@pytest.mark.slow
def test_cp_decode_two_processes_gloo():
    _torchrun("cpu", timeout=600)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context-parallel decode over NCCL needs 2 GPUs "
                    "(one rank each); the gloo/CPU variant runs everywhere")
def test_cp_decode_two_gpus_nccl():
    _torchrun("cuda", timeout=900)
