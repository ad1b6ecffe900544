"""mla_decode(fp8_mma=True) over a float8_e4m3fn cache on the GPU: the e4m3-MMA kernel
(csrc/mla_decode/fp8mma/kernel.cuh), against the float32 reference on the dequantized cache, on the
adversarial inputs of tests/cases.py (NaN past every length and in unused pages, permuted block
tables, empty requests, odd head counts, varlen causal, page sizes 16...256).

Tolerance, from measurement: conftest.check_fp8_mma. The FP8 cache itself adds 0.8-3.6 % against
the unquantized values here."""
import pytest
import torch
from cases import make_decode_case
from conftest import capture_graph, check_fp8_mma, decode_case, run_decode, to_device
from fp8_cases import to_fp8_case

import mla_attn

pytestmark = pytest.mark.gpu

CASES = [
    # (lens, s_q, h_q, page_size, varlen, split_pe): more than 16 query rows per request
    ([1023], 1, 128, 64, False, False),
    ([1023, 4099, 7], 7, 9, 16, False, False),       # several requests, tails, 63 rows
    ([300, 64, 65], 1, 63, 64, False, True),         # q_pe split, exact block multiples
    ([2000], 1, 126, 48, False, False),              # page 48
    ([130, 0, 1000, 64], 3, 96, 16, True, True),     # varlen, an empty request, odd block counts
    ([4099, 65, 1], 2, 128, 32, False, False),
    ([513, 1000], 64, 16, 64, False, False),         # 1024 rows: 16 q-tiles
    ([4099, 113, 1, 0, 1023], 7, 32, 16, True, False),
    ([700, 10], 512, 8, 256, True, False),           # page 256, 4096 rows
    ([33000], 1, 24, 64, False, False),              # batch 1, 24 rows, a long context
    ([4099, 1023, 0, 1], 2, 16, 128, False, True),   # 32 rows at batch 4 (without fp8_mma: the narrow kernel)
    ([2000, 300], 1, 32, 32, False, False),
]


def run(case, causal, **kw):
    return run_decode(case, causal, fp8_mma=True, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens,s_q,h_q,page_size,varlen,split_pe", CASES)
def test_fp8_mma_decode_matches_reference(lens, s_q, h_q, page_size, varlen, split_pe, causal, dtype):
    """fp8_mma=True through the dispatch (the forced fp8mma kernel runs in test_decode_fp8_gpu.py)."""
    case = decode_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype, fp8=True)
    out, lse = run(case, causal)
    check_fp8_mma(case, causal, out, lse)


def test_fp8_mma_q_rows_of_different_magnitude():
    """Each Q row is scaled by its own power of two before rounding to e4m3, so rows far outside
    e4m3's range (here up to ~1000, above its largest finite 448) keep their relative accuracy. The
    cache is scaled down by as much so that the largest rows' scores stay unit-scale: the error of
    rounding Q grows with the scores (rows whose scores are 32x larger measured 12 % error)."""
    case = to_device(make_decode_case([900, 64], 1, 128, 64, seed=5))
    case = to_device(to_fp8_case({**case, "kv_cache": case["kv_cache"] * 2.0 ** -8}, k_scale=0.02 * 2.0 ** -8))
    q = case["q"].clone()
    q[:, :, ::3] *= 2.0 ** 8
    q[:, :, 1::3] *= 2.0 ** 4
    q[:, :, 7] = 0
    case = {**case, "q": q}
    out, lse = run(case, True)
    check_fp8_mma(case, True, out, lse)


@pytest.mark.parametrize("lens,s_q,h_q,page_size,varlen,split_pe", CASES[:4])
def test_fp8_mma_with_a_per_tensor_q_scale(lens, s_q, h_q, page_size, varlen, split_pe):
    """q_scale (vLLM's per-tensor Q scale): Q enters the e4m3 MMAs as e4m3(q / q_scale), here
    amax(q) / 448 as a calibration would choose; within the same bounds as the per-row scales. A scale
    that differs from the rows' own changes the result, so it is not ignored."""
    case = decode_case(lens, s_q, h_q, page_size, varlen, split_pe, torch.bfloat16, fp8=True)
    q_scale = (case["q"].abs().amax().float() / 448).reshape(1)
    out, lse = run(case, True, q_scale=q_scale)
    check_fp8_mma(case, True, out, lse)
    per_row, _ = run(case, True)
    assert not torch.equal(out, per_row)


def test_fp8_mma_q_scale_saturates_and_is_read_on_each_replay():
    """A q_scale below amax(q) / 448 saturates Q at +-448 * q_scale (the documented clamp): the result
    is the reference on the clamped Q. A captured call reads the scale's value on every replay."""
    case = decode_case([1023, 300], 1, 128, 64, False, False, torch.bfloat16, fp8=True)
    q_scale = (case["q"].abs().amax().float() / 448 / 4).reshape(1)  # |q| above a quarter of the max saturates
    out, lse = run(case, True, q_scale=q_scale)
    bound = 448 * q_scale
    clamped = {k: v for k, v in case.items() if k != "references"}  # decode_case memoizes the references
    clamped["q"] = torch.maximum(torch.minimum(case["q"].float(), bound), -bound).to(case["q"].dtype)
    assert not torch.equal(clamped["q"], case["q"])
    check_fp8_mma(clamped, True, out, lse)

    static_scale = q_scale.clone()
    graph, (graph_out, _) = capture_graph(lambda: run(case, True, q_scale=static_scale))
    for scale in (q_scale * 4, q_scale):
        static_scale.copy_(scale)
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager, _ = run(case, True, q_scale=scale)
        assert torch.equal(graph_out, eager)


def test_fp8_mma_deterministic_is_bit_identical():
    """deterministic=True chooses the kernel by h_q alone: fp8_mma applies at 16 rows too, and two
    runs agree bit for bit."""
    case = to_device(to_fp8_case(make_decode_case([3000, 77, 1500], 1, 16, 64, seed=9)))
    out1, lse1 = run(case, True, deterministic=True)
    out2, lse2 = run(case, True, deterministic=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    check_fp8_mma(case, True, out1, lse1)
    exact, _ = mla_attn.mla_decode(case["q"], case["kv_cache"], case["block_table"], case["cache_seqlens"],
                                   k_scale=case["k_scale"], softmax_scale=case["softmax_scale"],
                                   return_lse=True, deterministic=True)
    # e4m3 Q and P move the output by ~3 % of its norm; two 16-bit kernels differ by their rounding.
    moved = ((out1.float() - exact.float()).norm() / exact.float().norm()).item()
    assert moved > 5e-3, f"fp8_mma=True must select the e4m3-MMA kernel (output moved {moved:.1e})"


def test_fp8_mma_keeps_16_bit_mmas_at_16_rows():
    """16 rows or fewer stream the cache: fp8_mma leaves the narrow kernel (exact up to fp32 rounding)."""
    case = to_device(to_fp8_case(make_decode_case([3000, 77], 1, 16, 64, seed=3)))
    out, lse = run(case, True)
    plain, plain_lse = mla_attn.mla_decode(case["q"], case["kv_cache"], case["block_table"], case["cache_seqlens"],
                                           k_scale=case["k_scale"], softmax_scale=case["softmax_scale"],
                                           return_lse=True)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
