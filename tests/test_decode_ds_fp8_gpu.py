"""mla_decode over DeepSeek-V3.2's ds_mla_fp8 cache (uint8 rows of 656 bytes: e4m3 latent values with a
power-of-two scale per 128, bf16 rope) on the GPU, against the float32 reference on the dequantised cache,
on the adversarial inputs of tests/cases.py: NaN in every slot past each length and in unused pages
(NaN survives the quantisation), permuted block tables, zero-length requests, odd head counts, varlen
causal queries. The 64-row kernel reads this layout (rows gathered one by one at every page size,
converted to fp16 with their scales in shared memory), and so do the narrow kernels' form of it at up to
16 / 32 query rows (the same rows, converted in registers); every other kernel refuses it."""
import pytest
import torch
from cases import DECODE_CASES, make_decode_case
from conftest import check_decode, check_unit_scale, decode_case_params, run_decode, to_device
from fp8_cases import to_ds_case

from mla_attn.metadata import DECODE_KERNELS

pytestmark = pytest.mark.gpu

CASES = DECODE_CASES + [
    ([130, 0, 1000, 64], 3, 96, 16, True, True),  # above 64 heads: two q-tiles share each gathered row
    ([4099, 65, 1], 2, 128, 1, False, False),      # SGLang's page size 1
    ([40000], 1, 16, 64, False, False),            # one long request, split across CTAs
    ([2000, 300], 1, 32, 3, False, True),
    ([5000, 1, 64, 700], 1, 128, 64, False, False),  # two q-tiles per request, a request split across parts
    ([300, 2048], 2, 128, 1, False, True),            # four q-tiles per request, page size 1
]


def ds_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype):
    case = make_decode_case(lens, s_q, h_q, page_size, varlen=varlen, split_pe=split_pe, dtype=dtype,
                            seed=len(lens) * 1000 + s_q * 10 + h_q)
    return to_device(to_ds_case(case))


@pytest.mark.parametrize("lens,s_q,h_q,page_size,varlen,split_pe,kernel,dtype,causal",
                         decode_case_params(CASES, torch.uint8))
def test_ds_mla_fp8_decode_matches_reference(lens, s_q, h_q, page_size, varlen, split_pe, kernel, dtype, causal):
    case = ds_case(lens, s_q, h_q, page_size, varlen, split_pe, dtype)
    assert case["kv_cache"].dtype == torch.uint8
    out, lse = run_decode(case, causal, _kernel=kernel)
    check_decode(case, causal, out, lse, kernel)


@pytest.mark.parametrize("kernel,h_q", [(None, 64), ("narrow16", 16), ("narrow32", 32)])
@pytest.mark.parametrize("low", [-9, -4, 2])
def test_ds_mla_fp8_group_scales(low, kernel, h_q):
    """Each 128-column group of a row has its own scale: the groups of every row scaled by 2^(low + 6),
    2^(low + 3), 2^low, 2^(low + 3), so that the scales (about 2^-6 for unit data) span the quantiser's
    smallest, 2^-13, to 2^2; the rope part stays unit-scale. q's latent columns are divided by the same
    factors, so the scores stay unit-scale, and each output column group is checked at its own scale
    (one bound for all let the smallest group's errors hide under the largest's). Every kernel that reads
    the layout."""
    case = make_decode_case([700, 64], 1, h_q, 64, seed=23)
    column_factors = (2.0 ** torch.tensor([low + 6, low + 3, low, low + 3])).repeat_interleave(128)
    case["kv_cache"][..., :512] *= column_factors.to(case["kv_cache"].dtype)  # powers of two: exact
    case["q"][..., :512] /= column_factors.to(case["q"].dtype)
    case = to_device(to_ds_case(case))
    out, lse = run_decode(case, True, _kernel=kernel)
    check_unit_scale(case, True, out, lse, column_scale=column_factors.cuda())


@pytest.mark.parametrize("kernel", [k for k in DECODE_KERNELS if k not in ("narrow16", "narrow32", "rows64")])
def test_ds_mla_fp8_other_kernels_refuse(kernel):
    case = ds_case([100], 1, 16, 64, False, False, torch.bfloat16)
    with pytest.raises(ValueError, match="ds_mla_fp8"):
        run_decode(case, True, _kernel=kernel)
