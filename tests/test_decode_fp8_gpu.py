"""mla_decode over a float8_e4m3fn cache on the GPU, against the float32 reference run on the
dequantized cache (stored * k_scale), on the adversarial inputs of tests/cases.py: NaN in every slot
past each length and in unused pages (NaN survives quantisation), permuted block tables, zero-length
requests, odd head counts, varlen causal queries, page sizes 16...256.

Every kernel that runs an FP8 cache runs every case. Tolerance as for a 16-bit cache (2x the error of
the same computation in q's dtype, + 1e-3): the kernels convert e4m3 to bf16/fp16 exactly and apply
k_scale in fp32, so the only extra rounding of the low-precision reference (k_scale * stored rounded to
q's dtype) makes its bound looser, not ours. The e4m3-MMA kernel (fp8mma) has its own
(conftest.check_fp8_mma)."""
import pytest
import torch
from cases import DECODE_CASES, make_decode_case
from conftest import (FP8, check_decode, decode_case, decode_case_params, decode_kernels_for, poisoned_past_lengths,
                      run_decode, to_device)
from fp8_cases import to_fp8_case

import mla_attn

pytestmark = pytest.mark.gpu


# the 16-bit cases, then:
CASES = DECODE_CASES + [
    # above 64 heads (the 64-row kernel, converted in place): several requests per CTA, odd block
    # counts, tails, a request with no keys, page 16 and 32
    ([130, 0, 1000, 64], 3, 96, 16, True, True),
    ([4099, 65, 1], 2, 128, 32, False, False),
    # gathered rows (page sizes that are not a multiple of 16): whole rows by bulk copy
    ([2000, 1, 700], 1, 128, 1, False, True),
    ([4099, 65, 1], 2, 128, 3, False, False),
    ([40000], 1, 16, 64, False, False),
    # <= 32 query rows per request: the narrow kernel (N = 32 for the first three; the fourth is batch 1
    # with 21 rows, which the dispatch gives to the 64-row kernel; the last has 16 rows at batch 2,
    # three math warpgroups, and a long context)
    ([4099, 1023, 0, 1], 2, 16, 128, False, True),
    ([2000, 300], 1, 32, 32, False, False),
    ([113, 4099, 1, 0], 4, 8, 16, True, False),
    ([33000], 7, 3, 64, False, False),
    ([5, 36000], 1, 16, 32, False, False),
    # the narrow kernel at pages 48 (16-key copies) and 256 (64-key copies; varlen, q_pe split)
    ([4099, 700, 1], 1, 16, 48, False, False),
    ([1023, 5000, 64], 2, 16, 256, True, True),
]


@pytest.mark.parametrize("lens,s_q,h_q,page_size,varlen,split_pe,kernel,dtype,causal", decode_case_params(CASES, FP8))
def test_fp8_decode_matches_reference(lens, s_q, h_q, page_size, varlen, split_pe, kernel, dtype, causal):
    case = decode_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype, fp8=True)
    out, lse = run_decode(case, causal, _kernel=kernel)
    check_decode(case, causal, out, lse, kernel)


# the three dispatch paths: 16 rows, 32 rows (batch 2), 128 heads; and every kernel that runs them
KERNEL_SHAPES = [(h_q, s_q, kernel) for h_q, s_q in [(16, 1), (16, 2), (128, 1)]
                 for kernel in [None] + decode_kernels_for(FP8, h_q * s_q)]


@pytest.mark.parametrize("h_q,s_q,kernel", KERNEL_SHAPES)
def test_fp8_subnormal_values(h_q, s_q, kernel):
    """Stored values that are e4m3 subnormals (|x| < 2^-6) reach the MMAs exactly (their fp16 and
    bf16 conversions are exact) on all three kernels: 16 rows, 32 rows (batch 2) and 128 heads.
    k_scale = 256 puts most unit-scale values there."""
    case = to_device(to_fp8_case(make_decode_case([700, 64], s_q, h_q, 64, seed=21), k_scale=256.0))
    stored = case["kv_cache"].float()
    finite = stored[torch.isfinite(stored)]
    assert (finite.abs() < 2.0 ** -6).float().mean() > 0.9
    out, lse = run_decode(case, True, _kernel=kernel)
    check_decode(case, True, out, lse, kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q,kernel", [p for p in KERNEL_SHAPES if p[2] != "fp8mma"])  # fp8mma: its own file
def test_fp8_q_rows_of_different_magnitudes(h_q, s_q, kernel, dtype):
    """With an fp8 cache the MMAs run in fp16, and each bf16 Q row is stored times its own power of
    two (fp16_row_scale): rows whose magnitudes differ by 2^10, and an all-zero row, must each come
    out right on all three kernels (16 rows, 32 rows at batch 2, 128 heads)."""
    case = to_device(to_fp8_case(make_decode_case([700, 64], s_q, h_q, 64, dtype=dtype, seed=22)))
    factors = 2.0 ** torch.linspace(-8, 2, h_q).round()
    factors[h_q // 2] = 0.0
    case["q"].mul_(factors.to(case["q"].device, case["q"].dtype).view(1, 1, h_q, 1))
    out, lse = run_decode(case, True, _kernel=kernel)
    check_decode(case, True, out, lse, kernel)


def test_fp8_ragged_batch_and_scale_from_device():
    """64 ragged requests; k_scale is read on the device (a new value needs no recapture)."""
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 3000, (64,), generator=g).tolist()
    case = to_device(to_fp8_case(make_decode_case(lens, 1, 16, 64, seed=11)))
    for scale in (0.02, 0.05):
        case["k_scale"].fill_(scale)
        out, lse = run_decode(case, True)
        check_decode(case, True, out, lse, None)


def test_fp8_cuda_graph_replay_with_new_lengths_and_two_runs_identical():
    case = to_device(to_fp8_case(make_decode_case([3000, 2000, 1000, 100], 2, 16, 64, seed=5)))
    lens = case["cache_seqlens"]
    out = torch.empty(4, 2, 16, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        md = mla_attn.get_decode_metadata(lens, 16, s_q=2, causal=True)
        return run_decode(case, True, metadata=md, out=out)

    first = step()[0].clone()
    out.fill_(float("nan"))
    assert torch.equal(step()[0], first), "two runs must be bit-identical"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = step()
    written = case["kv_cache"].clone()
    for new in ([100, 2000, 999, 1], [0, 64, 65, 99]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        case["kv_cache"].copy_(poisoned_past_lengths(written, case["block_table"], new))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_decode(case, True, out, lse, None)


def test_fp8_opcheck():
    case = to_device(to_fp8_case(make_decode_case([300, 70], 2, 16, 64, seed=7)))
    c = case
    md = mla_attn.get_decode_metadata(c["cache_seqlens"], 16, s_q=2, causal=True)
    args = (c["q"], None, c["kv_cache"], c["block_table"], c["cache_seqlens"], None, 2, c["softmax_scale"], True,
            md.tile_sched, md.req_splits, md.num_sm_parts)
    # test_schema is left out: it compares inputs before/after with arithmetic torch lacks for fp8.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mla_attn.mla_decode.default, args, dict(k_scale=c["k_scale"]), test_utils=utils)
