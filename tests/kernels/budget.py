"""Error budget shared by the kernel tests: what a correct kernel in a given dtype may commit."""

from __future__ import annotations

import torch

# Unit roundoff (half an ulp at 1.0) of each storage dtype.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
# fp32 arithmetic in the kernel (scores, exp, running sums, split merge) against float64:
# relative error ~1e-6 for the head dims and lengths tested here; budget 1e-5.
FP32_BUDGET = 1e-5
# LSE = max + log(sum) is all fp32 on products of exactly representable inputs: absolute error
# ~1e-6 on the magnitudes tested here (|lse| < 20); budget 1e-4.
LSE_ATOL = 1e-4


def output_atol(dtype: torch.dtype, v_max: float) -> float:
    """Error budget of o = sum_j p_j v_j / sum_j p_j in `dtype` against float64:
    - o is rounded once to the output dtype: <= u |o| <= u max|v|;
    - the probabilities p are rounded to V's dtype for the P.V tensor-core product (fp32
      accumulation), as in every flash-attention kernel: <= u sum_j p_j |v_j| / sum_j p_j <= u max|v|;
    - plus the fp32 budget, relative to max|v|.
    """
    return (2 * UNIT_ROUNDOFF[dtype] + FP32_BUDGET) * v_max


def check_against_reference(out, lse, ref_out, ref_lse, *, dtype, v_max) -> None:
    """out [rows, Hq, Dv], lse [rows, Hq] from a kernel against float64 ref_out, ref_lse (-inf = no keys)."""
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    assert not torch.isnan(lse).any(), "NaN in the kernel LSE"
    out, lse = out.double().cpu(), lse.double().cpu()
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    atol = output_atol(dtype, v_max)
    err = (out - ref_out).abs().amax(-1)  # [bs, Hq]
    request, head = divmod(int(err.argmax()), err.shape[1])
    assert err.max() <= atol, (
        f"output error {err.max():.3g} > {atol:.3g} ({dtype}) at row {request}, head {head}"
    )
    empty = ref_lse == float("-inf")
    assert (lse[empty] == float("-inf")).all(), "a row with no keys must have lse = -inf"
    lse_err = (lse[~empty] - ref_lse[~empty]).abs()
    assert lse_err.numel() == 0 or lse_err.max() <= LSE_ATOL, f"LSE error {lse_err.max():.3g} > {LSE_ATOL}"
