"""split-merge on a merge step (trace.merge): the engine's recorded merge of given partial states
against the float64 merge of the same states.

The classic mistake is the LSE base: FlashInfer's merge_state takes base-2 LSEs, vLLM's
merge_attn_states and FlashAttention's and our Triton kernels' write natural logs, and a caller
that hands one to the other weighs every state by exp(lse * log2 e) or exp(lse * ln 2) instead of
exp(lse) (FlashInfer #2113, SGLang #40903). A recorded output that fails the reference is
reproduced by merging the same states with every state's LSE, or one state's, rescaled by either
factor; the rescaling that reproduces it is named. One that none reproduces is still reported, as
a mismatch: the recorded output is the engine's own result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attndbg.backends.base import AttentionResult
from attndbg.backends.reference import merge, natural_lse
from attndbg.compare.tolerance import Comparison, ReferenceBasis
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding
from attndbg.detectors.split_merge.base import KIND, _location
from attndbg.numerics import LN2, LOG2E
from attndbg.trace.schema import DTYPES, LseBase, MergeStates

# What a rescaled LSE means, by its factor on the natural-log LSE.
_FACTORS = {
    LOG2E: "base-2 LSEs weighed as natural logs (exp(s) for 2**s)",
    LN2: "natural-log LSEs weighed as base 2 (2**s for exp(s))",
}


@dataclass(frozen=True)
class _Rescaling:
    factor: float
    states: tuple[int, ...]  # which states' LSEs were rescaled (all of them, or one)

    def words(self, count: int) -> str:
        which = "every state's LSE" if len(self.states) == count else f"state {self.states[0]}'s LSE"
        return f"{which} rescaled: {_FACTORS[self.factor]}"


def merge_step(ctx: CheckContext) -> list[Finding]:
    trace = ctx.trace
    states = trace.merge
    if states is None or states.output is None:
        return []
    data = ctx.data(None)
    lse = data.reference.lse if states.lse is None else natural_lse(states.lse, states.lse_base)
    comparison = data.compare(AttentionResult(states.output, lse))
    if comparison.passed:
        return []
    where = _location(ctx, comparison.worst, field="merge.output")
    numbers = f"recorded merge fails the float64 merge of its states on {comparison.failing_rows}/{comparison.total_rows} rows (max abs {comparison.max_abs:.3e}, LSE {comparison.max_lse_abs:.3e}, {comparison.nonfinite} NaN/Inf)"
    rescaling = _reproduced_by(states, trace.model.q_dtype)
    if rescaling is not None:
        return [
            Finding(
                KIND,
                "merge-step-lse-base",
                where,
                f"{numbers}; merging the same states with {rescaling.words(states.num_states)} reproduces it",
                f"The merge was given LSEs in another base than its kernel reads (FlashInfer's merge_state takes base 2; vLLM's merge_attn_states, FlashAttention and Triton kernels write natural logs): convert them (x log2 e or x ln 2) before merging.",
                data={"factor": rescaling.factor, "states": list(rescaling.states), "lse_base": states.lse_base.value, **_numbers(comparison)},
            )
        ]
    return [
        Finding(
            KIND,
            "merge-step-nonfinite" if comparison.nonfinite else "merge-step-mismatch",
            where,
            numbers,
            "The engine's merge disagrees with the float64 merge of the states it was given, and no LSE base confusion reproduces it"
            + (" (NaN/Inf: an empty state's output read, or exp(-inf - -inf))." if comparison.nonfinite else "."),
            data=_numbers(comparison),
        )
    ]


def _numbers(comparison: Comparison) -> dict[str, float | int]:
    return {"failing_rows": comparison.failing_rows, "max_abs": comparison.max_abs, "max_lse_abs": comparison.max_lse_abs, "nonfinite": comparison.nonfinite}


def _reproduced_by(states: MergeStates, q_dtype: str) -> _Rescaling | None:
    """The LSE rescaling whose merge matches the recorded output within the tolerance a merge in its
    dtype has, first every state's, then one state's; None when none does."""
    dtype = DTYPES[q_dtype]
    lse = natural_lse(states.s, states.lse_base)
    count = states.num_states
    candidates = [_Rescaling(f, tuple(range(count))) for f in _FACTORS]
    if count > 1:
        candidates += [_Rescaling(f, (i,)) for f in _FACTORS for i in range(count)]
    for rescaling in candidates:
        scale = torch.ones(count, 1, 1, dtype=torch.float64)
        scale[list(rescaling.states)] = rescaling.factor
        wrong = merge(replace(states, s=lse * scale, lse_base=LseBase.E)).output
        rounded = wrong.to(dtype)
        basis = ReferenceBasis.of(reference_output=wrong, reference_lse=torch.zeros(wrong.shape[:2], dtype=torch.float64), lowp_output=rounded,
                                  lowp_lse=torch.zeros(wrong.shape[:2]), dtype=dtype, qo_indptr=torch.arange(wrong.shape[0] + 1))
        if basis.compare(states.output, torch.zeros(wrong.shape[:2])).passed:
            return rescaling
    return None

