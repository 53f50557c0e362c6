"""The tolerance model itself: 2x the same-dtype error, plus one ulp at the row's magnitude."""

from __future__ import annotations

import pytest
import torch

from attndbg.compare.tolerance import compare

T, H, D = 4, 2, 8


def _case(*, lowp_err: float, out_err: float, magnitude: float = 1.0, dtype=torch.bfloat16):
    ref = torch.full((T, H, D), 0.5 * magnitude, dtype=torch.float64)
    ref[:, :, 0] = magnitude  # the row's largest magnitude
    lse = torch.zeros(T, H, dtype=torch.float64)
    lowp = ref.clone()
    lowp[2, 1, 3] += lowp_err
    out = ref.clone()
    out[2, 1, 3] += out_err
    return compare(
        output=out, lse=lse, reference_output=ref, reference_lse=lse, lowp_output=lowp, lowp_lse=lse,
        dtype=dtype, qo_indptr=torch.tensor([0, 2, 4]),
    )


@pytest.mark.parametrize("lowp_err", [0.05, 0.2])
def test_twice_the_same_dtype_error_is_the_bound(lowp_err: float) -> None:
    floor = 2.0**-7
    bound = 2 * lowp_err + floor
    inside = _case(lowp_err=lowp_err, out_err=0.97 * bound)
    outside = _case(lowp_err=lowp_err, out_err=1.03 * bound)
    assert inside.passed
    assert not outside.passed and outside.failing_rows == 1
    assert (outside.worst.request, outside.worst.row, outside.worst.head) == (1, 2, 1)


@pytest.mark.parametrize("magnitude", [1.0, 3.0])
@pytest.mark.parametrize("dtype,ulp", [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10), (torch.float32, 1e-5)])
def test_floor_is_one_ulp_at_the_rows_magnitude(dtype, ulp: float, magnitude: float) -> None:
    floor = ulp * magnitude
    assert _case(lowp_err=0.0, out_err=0.97 * floor, magnitude=magnitude, dtype=dtype).passed
    assert not _case(lowp_err=0.0, out_err=1.03 * floor, magnitude=magnitude, dtype=dtype).passed


def test_small_rows_use_magnitude_one() -> None:
    # A row of magnitude 0.25 still gets the floor at magnitude 1, not a quarter of it.
    assert _case(lowp_err=0.0, out_err=0.9 * 2.0**-7, magnitude=0.25).passed
