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


@dataclass(frozen=True)
class ReferenceBasis:
    """What every comparison of one step against its reference shares, computed once: the float64
    reference, its magnitudes and both tolerances (a check compares a dozen runs per step)."""

    ref: Tensor  # [T, Hq, Dv] float64
    ref_lse: Tensor  # [T, Hq] float64
    tol: Tensor  # [T, Hq] output tolerance
    lse_tol: Tensor  # [T, Hq]
    magnitude: Tensor  # [T, Hq] largest |reference| of the row/head
    ref_finite: Tensor  # [T, Hq, Dv] bool
    ref_lse_finite: Tensor
    ref_lse_empty: Tensor  # [T, Hq] bool: the row sees no key (LSE -inf)
    qo_indptr: Tensor  # [bs+1], CPU

    @classmethod
    def of(
        cls, *, reference_output: Tensor, reference_lse: Tensor, lowp_output: Tensor, lowp_lse: Tensor, dtype: torch.dtype, qo_indptr: Tensor
    ) -> ReferenceBasis:
        ref = reference_output.detach().cpu().to(torch.float64)
        ref_lse = reference_lse.detach().cpu().to(torch.float64)
        lowp = lowp_output.detach().cpu().to(torch.float64)
        lowp_lse = lowp_lse.detach().cpu().to(torch.float64)
        lse_floor = LSE_FLOOR.get(dtype, LSE_FLOOR[torch.bfloat16])
        lse_tol = ERROR_FACTOR * torch.where(torch.isfinite(lowp_lse), (lowp_lse - ref_lse).abs(), torch.zeros_like(ref_lse)) + lse_floor
        return cls(
            ref=ref,
            ref_lse=ref_lse,
            tol=output_tolerance(ref, lowp, dtype),
            lse_tol=lse_tol,
            magnitude=ref.abs().amax(-1),
            ref_finite=torch.isfinite(ref),
            ref_lse_finite=torch.isfinite(ref_lse),
            ref_lse_empty=torch.isneginf(ref_lse),
            qo_indptr=qo_indptr.cpu(),
        )

    def compare(self, output: Tensor, lse: Tensor) -> Comparison:
        """One run's output [T, Hq, Dv] and natural-log LSE [T, Hq] against the reference."""
        out = output.detach().to("cpu", torch.float64)
        lse = lse.detach().to("cpu", torch.float64)
        err = (out - self.ref).abs().amax(-1)  # [T, Hq]
        # Rows that see no key have LSE -inf in the reference; they match when the backend agrees.
        lse_err = (lse - self.ref_lse).abs().masked_fill_(self.ref_lse_empty & torch.isneginf(lse), 0.0)
        nonfinite_out = ~torch.isfinite(out) & self.ref_finite
        nonfinite_lse = ~torch.isfinite(lse) & self.ref_lse_finite
        out_bad = nonfinite_out.any(-1)
        nonfinite = int(nonfinite_out.sum() + nonfinite_lse.sum()) if bool(out_bad.any() or nonfinite_lse.any()) else 0

        ratio = torch.nan_to_num(err / self.tol, nan=float("inf")).masked_fill_(out_bad, float("inf"))
        lse_ratio = torch.nan_to_num(lse_err / self.lse_tol, nan=float("inf")).masked_fill_(nonfinite_lse, float("inf"))
        head_fails = (ratio > 1) | (lse_ratio > 1)
        worst = None
        if err.numel():
            combined = torch.maximum(ratio, lse_ratio)
            flat = int(torch.argmax(combined))
            row, head = divmod(flat, combined.shape[1])
            request = int(torch.searchsorted(self.qo_indptr, torch.tensor(row), right=True)) - 1
            worst = Location(request=request, row=row, head=head)
        finite_err = torch.nan_to_num(err, nan=float("inf"))
        return Comparison(
            max_abs=float(finite_err.max()) if err.numel() else 0.0,
            max_rel=float((finite_err / self.magnitude.clamp_min(1e-30)).max()) if err.numel() else 0.0,
            max_lse_abs=float(torch.nan_to_num(lse_err, nan=float("inf")).max()) if lse_err.numel() else 0.0,
            worst=worst,
            failing_rows=int(head_fails.any(-1).sum()),
            total_rows=int(err.shape[0]),
            failing_heads=int(head_fails.sum()),
            nonfinite=nonfinite,
            row_errors=ratio,
            lse_errors=lse_ratio,
        )


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
    basis = ReferenceBasis.of(
        reference_output=reference_output, reference_lse=reference_lse, lowp_output=lowp_output, lowp_lse=lowp_lse, dtype=dtype, qo_indptr=qo_indptr
    )
    return basis.compare(output, lse)


def reference_basis(trace: Trace, reference: AttentionResult, lowp: AttentionResult) -> ReferenceBasis:
    """The comparison basis of one step: `reference` in float64, `lowp` the same math in the trace's dtype."""
    return ReferenceBasis.of(
        reference_output=reference.output,
        reference_lse=reference.lse,
        lowp_output=lowp.output,
        lowp_lse=lowp.lse,
        dtype=DTYPES[trace.model.q_dtype],
        # A merge step's rows are its merged tokens, each located as a request of its own.
        qo_indptr=trace.batch.qo_indptr if trace.merge is None else torch.arange(trace.merge.num_tokens + 1),
    )


def compare_to_reference(trace: Trace, result: AttentionResult, reference: AttentionResult, lowp: AttentionResult) -> Comparison:
    """`compare` for one step: `reference` in float64, `lowp` the same math in the trace's dtype."""
    return reference_basis(trace, reference, lowp).compare(result.output, result.lse)
