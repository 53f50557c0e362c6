"""Compare a backend's output and LSE with the float64 reference, per request/row/head.

Tolerance model (DESIGN.md "Comparison and tolerances", after FlashAttention's test criterion):
an element passes if its error against the float64 reference is at most twice the error that a
plain PyTorch implementation in the run's dtype commits on the same inputs, plus a floor of one
unit in the last place of the dtype at the row's output magnitude (at least 1): rounding the
output itself costs half of that, so no correct kernel can do better. NaN or Inf where the reference is
finite always fails. A row (query token) fails if any of its heads fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends.base import AttentionResult
from attndbg.trace.schema import DTYPES, Trace

# Twice the same-dtype error: FlashAttention's "at most 2x the error of a PyTorch implementation".
ERROR_FACTOR = 2.0
# One ulp at magnitude 1, scaled by the row's magnitude: outputs are convex combinations of the
# values, so a row over few keys can reach |v| ~ 3-4 where the ulp is 2-4x larger.
OUTPUT_FLOOR = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# LSEs are float32 in every kernel we call; their error comes from rounded scores.
LSE_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


@dataclass(frozen=True)
class Location:
    request: int
    row: int  # query token index within the step
    head: int

    def __str__(self) -> str:
        return f"req {self.request} / row {self.row} / head {self.head}"


@dataclass(frozen=True)
class Comparison:
    """One backend against the reference."""

    max_abs: float  # output
    max_rel: float  # output, relative to the reference row's largest magnitude
    max_lse_abs: float
    worst: Location | None  # where the output (or LSE) exceeds its tolerance most, or the largest error
    failing_rows: int
    total_rows: int
    failing_heads: int  # (row, head) pairs
    nonfinite: int  # NaN/Inf elements in output and LSE where the reference is finite
    row_errors: Tensor  # [T, Hq] float64: output error / tolerance (>1 fails)
    lse_errors: Tensor  # [T, Hq] float64: LSE error / tolerance

    @property
    def passed(self) -> bool:
        return self.failing_rows == 0 and self.nonfinite == 0


def output_tolerance(reference_output: Tensor, lowp_output: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, Hq] float64: the output error each row/head may have against the float64 reference."""
    ref, lowp = reference_output.double(), lowp_output.double()
    floor = OUTPUT_FLOOR.get(dtype, OUTPUT_FLOOR[torch.bfloat16])
    return ERROR_FACTOR * (lowp - ref).abs().amax(-1) + floor * ref.abs().amax(-1).clamp_min(1.0)


def compare(
    *,
    output: Tensor,  # [T, Hq, Dv]
    lse: Tensor,  # [T, Hq] natural log
    reference_output: Tensor,  # float64
    reference_lse: Tensor,  # float64
    lowp_output: Tensor,  # same math in the run's dtype
    lowp_lse: Tensor,
    dtype: torch.dtype,
    qo_indptr: Tensor,  # [bs+1]
) -> Comparison:
    out = output.detach().to("cpu", torch.float64)
    lse = lse.detach().to("cpu", torch.float64)
    ref = reference_output.detach().cpu().to(torch.float64)
    ref_lse = reference_lse.detach().cpu().to(torch.float64)
    lowp = lowp_output.detach().cpu().to(torch.float64)
    lowp_lse = lowp_lse.detach().cpu().to(torch.float64)
    lse_floor = LSE_FLOOR.get(dtype, LSE_FLOOR[torch.bfloat16])

    err = (out - ref).abs().amax(-1)  # [T, Hq]
    magnitude = ref.abs().amax(-1)
    tol = output_tolerance(ref, lowp, dtype)
    scale = magnitude.clamp_min(1e-30)
    # Rows that see no key have LSE -inf in the reference; they match when the backend agrees.
    lse_both_empty = torch.isneginf(ref_lse) & torch.isneginf(lse)
    lse_err = torch.where(lse_both_empty, torch.zeros_like(lse), (lse - ref_lse).abs())
    lse_tol = ERROR_FACTOR * torch.where(torch.isfinite(lowp_lse), (lowp_lse - ref_lse).abs(), torch.zeros_like(lse)) + lse_floor

    nonfinite_out = ~torch.isfinite(out) & torch.isfinite(ref)
    nonfinite_lse = ~torch.isfinite(lse) & torch.isfinite(ref_lse)
    nonfinite = int(nonfinite_out.sum() + nonfinite_lse.sum())

    ratio = torch.nan_to_num(err / tol, nan=float("inf"))
    lse_ratio = torch.nan_to_num(lse_err / lse_tol, nan=float("inf"))
    ratio = torch.where(nonfinite_out.any(-1), torch.full_like(ratio, float("inf")), ratio)
    lse_ratio = torch.where(nonfinite_lse, torch.full_like(lse_ratio, float("inf")), lse_ratio)
    head_fails = (ratio > 1) | (lse_ratio > 1)
    worst = None
    if err.numel():
        combined = torch.maximum(ratio, lse_ratio)
        flat = int(torch.argmax(combined))
        row, head = divmod(flat, combined.shape[1])
        request = int(torch.searchsorted(qo_indptr.cpu(), torch.tensor(row), right=True)) - 1
        worst = Location(request=request, row=row, head=head)
    finite_err = torch.nan_to_num(err, nan=float("inf"))
    return Comparison(
        max_abs=float(finite_err.max()) if err.numel() else 0.0,
        max_rel=float((finite_err / scale).max()) if err.numel() else 0.0,
        max_lse_abs=float(torch.nan_to_num(lse_err, nan=float("inf")).max()) if lse_err.numel() else 0.0,
        worst=worst,
        failing_rows=int(head_fails.any(-1).sum()),
        total_rows=int(err.shape[0]),
        failing_heads=int(head_fails.sum()),
        nonfinite=nonfinite,
        row_errors=ratio,
        lse_errors=lse_ratio,
    )


def compare_to_reference(trace: Trace, result: AttentionResult, reference: AttentionResult, lowp: AttentionResult) -> Comparison:
    """`compare` for one step: `reference` in float64, `lowp` the same math in the trace's dtype."""
    return compare(
        output=result.output,
        lse=result.lse,
        reference_output=reference.output,
        reference_lse=reference.lse,
        lowp_output=lowp.output,
        lowp_lse=lowp.lse,
        dtype=DTYPES[trace.model.q_dtype],
        qo_indptr=trace.batch.qo_indptr,
    )
